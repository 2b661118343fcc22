// The two translations between the C descriptor (bag_problem.h) and the
// core's Table/Bags/Combiner.
#include <string>

#include "kernels/core/embedding_bag.h"

namespace pkm {

// The enums take their values from bag_problem.h; these keep the casts below
// sound if anyone gives them literals again.
static_assert(static_cast<int>(ElemType::kFloat32) == PKM_FLOAT32 && static_cast<int>(ElemType::kFloat16) == PKM_FLOAT16 &&
                  static_cast<int>(ElemType::kBFloat16) == PKM_BFLOAT16 && static_cast<int>(ElemType::kInt8) == PKM_INT8,
              "pkm::ElemType must equal the PKM_* element types");
static_assert(static_cast<int>(Combiner::kSum) == PKM_SUM && static_cast<int>(Combiner::kMean) == PKM_MEAN &&
                  static_cast<int>(Combiner::kSqrtn) == PKM_SQRTN && static_cast<int>(Combiner::kMax) == PKM_MAX,
              "pkm::Combiner must equal the PKM_* combiners");
static_assert(static_cast<int>(IndexPolicy::kNegativeIsPadding) == PKM_NEGATIVE_IS_PADDING &&
                  static_cast<int>(IndexPolicy::kNoPadding) == PKM_NO_PADDING &&
                  static_cast<int>(IndexPolicy::kOutOfRangeIsPadding) == PKM_OUT_OF_RANGE_IS_PADDING,
              "pkm::IndexPolicy must equal the PKM_* index policies");

Status FromBagProblem(const PkmBags& in, Table* table, Bags* bags, Combiner* combiner) {
  auto float_type = [](int32_t t) { return t == PKM_FLOAT32 || t == PKM_FLOAT16 || t == PKM_BFLOAT16; };
  if (!float_type(in.elem_type) || (in.weights != nullptr && !float_type(in.weights_type)))
    return Status::Error("elem_type and weights_type must be 0 (float32), 1 (float16) or 2 (bfloat16)");
  Status s = CheckCombiner(static_cast<Combiner>(in.combiner), in.weights != nullptr);
  if (!s.ok) return s;
  if (in.index_policy < PKM_NEGATIVE_IS_PADDING || in.index_policy > PKM_OUT_OF_RANGE_IS_PADDING)
    return Status::Error("index_policy must be 0 (negative is padding), 1 (no padding) or 2 (out of range is "
                         "padding), got " + std::to_string(in.index_policy));
  *table = Table();
  table->data = in.table;
  table->type = static_cast<ElemType>(in.elem_type);
  table->num_rows = in.num_rows;
  table->dim = in.dim;
  *bags = Bags();
  bags->indices = in.indices;
  bags->indices_int64 = in.indices_int64 != 0;
  bags->num_bags = in.num_bags;
  bags->bag_size = in.bag_size;
  bags->row_splits = in.row_splits;
  bags->row_splits_int64 = in.row_splits_int64 != 0;
  if (in.row_splits != nullptr) bags->num_values = in.num_indices;
  bags->weights = in.weights;
  bags->weights_type = static_cast<ElemType>(in.weights_type);
  bags->index_policy = static_cast<IndexPolicy>(in.index_policy);
  *combiner = static_cast<Combiner>(in.combiner);
  return Status::Ok();
}

PkmBags ToBagProblem(const Table& table, const Bags& bags, Combiner combiner) {
  PkmBags out{};
  out.table = table.data;
  out.elem_type = static_cast<int32_t>(table.type);
  out.num_rows = table.num_rows;
  out.dim = table.dim;
  out.indices = bags.indices;
  out.indices_int64 = bags.indices_int64;
  out.num_bags = bags.num_bags;
  out.bag_size = bags.bag_size;
  out.row_splits = bags.row_splits;
  out.row_splits_int64 = bags.row_splits_int64;
  out.num_indices = bags.row_splits != nullptr ? bags.num_values : bags.num_bags * bags.bag_size;
  out.weights = bags.weights;
  out.weights_type = static_cast<int32_t>(bags.weights_type);
  out.combiner = static_cast<int32_t>(combiner);
  out.invalid_index_count = nullptr;
  out.index_policy = static_cast<int32_t>(bags.index_policy);
  return out;
}

}  // namespace pkm
