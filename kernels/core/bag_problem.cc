// The two translations between the C descriptor (bag_problem.h) and the
// core's Table/Bags/Combiner.
#include <string>

#include "kernels/core/embedding_bag.h"
#include "kernels/core/shape_rules.h"

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
  // An int8 table is the descriptor's one non-float table type: its row parameters are checked
  // here, the rest by the shared rule set (which knows float tables only).
  const bool int8_table = in.elem_type == PKM_INT8;
  if (int8_table && (in.row_scales == nullptr || (in.row_params_type != PKM_FLOAT32 &&
                                                  in.row_params_type != PKM_FLOAT16)))
    return Status::Error("an int8 table needs row_scales, with row_params_type 0 (float32) or 1 (float16)");
  PkmBags as_float = in;
  if (int8_table) as_float.elem_type = PKM_FLOAT32;
  const Status rule = BagProblemRule(as_float);
  if (!rule.ok) return rule;
  *table = Table();
  table->data = in.table;
  table->type = static_cast<ElemType>(in.elem_type);
  table->num_rows = in.num_rows;
  table->dim = in.dim;
  if (int8_table) {
    table->row_scales = in.row_scales;
    table->row_biases = in.row_biases;
    table->row_params_type = static_cast<ElemType>(in.row_params_type);
  }
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
  out.row_scales = table.row_scales;
  out.row_biases = table.row_biases;
  out.row_params_type = static_cast<int32_t>(table.row_params_type);
  return out;
}

}  // namespace pkm
