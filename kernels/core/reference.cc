// The slow, obviously-correct EmbeddingBag: serial loops straight from the
// definition, with gradients from the textbook derivatives. Tests pit the fast
// core (and the GPU kernels) against it, so it shares none of the fast path's
// layout, validation or gather code: it reads indices, row_splits and weights
// itself, and checks them itself. (Scalar float conversions are shared; the
// core test checks those against the compiler's own _Float16.)
#include <cmath>
#include <string>
#include <vector>

#include "kernels/core/embedding_bag.h"

namespace pkm {

namespace {

int64_t ReadInteger(const void* p, bool is_int64, int64_t i) {
  if (is_int64) return static_cast<const int64_t*>(p)[i];
  return static_cast<const int32_t*>(p)[i];
}

float ReadFloat(const void* p, ElemType type, int64_t i) {
  if (type == ElemType::kFloat32) return static_cast<const float*>(p)[i];
  if (type == ElemType::kFloat16) return HalfToFloat(static_cast<const uint16_t*>(p)[i]);
  return BFloat16ToFloat(static_cast<const uint16_t*>(p)[i]);
}

void WriteFloat(void* p, ElemType type, int64_t i, float v) {
  if (type == ElemType::kFloat32) static_cast<float*>(p)[i] = v;
  else if (type == ElemType::kFloat16) static_cast<uint16_t*>(p)[i] = FloatToHalf(v);
  else static_cast<uint16_t*>(p)[i] = FloatToBFloat16(v);
}

float TableAt(const Table& t, int64_t row, int64_t d) {
  const int64_t i = row * t.dim + d;
  if (t.type == ElemType::kInt8) {
    const float bias = t.row_biases ? ReadFloat(t.row_biases, t.row_params_type, row) : 0.f;
    return ReadFloat(t.row_scales, t.row_params_type, row) * static_cast<const int8_t*>(t.data)[i] + bias;
  }
  return ReadFloat(t.data, t.type, i);
}

// The bags as plain lists of entry positions.
struct BagList {
  std::vector<std::vector<int64_t>> entries;
  int64_t total = 0;  // entries including padding
};

Status ListBags(const Table& t, const Bags& b, Combiner c, BagList* out) {
  if (b.num_bags < 0 || b.bag_size < 0) return Status::Error("bag shape must be non-negative");
  if (c == Combiner::kMax && b.weights != nullptr) return Status::Error("max takes no weights");
  if (t.type == ElemType::kInt8 && (t.row_scales == nullptr || (t.row_params_type != ElemType::kFloat32 &&
                                                               t.row_params_type != ElemType::kFloat16)))
    return Status::Error("int8 table needs per-row float32 or float16 scales");
  out->entries.assign(b.num_bags, {});
  int64_t total = b.num_bags * b.bag_size;
  if (b.row_splits != nullptr) {
    total = ReadInteger(b.row_splits, b.row_splits_int64, b.num_bags);
    if (ReadInteger(b.row_splits, b.row_splits_int64, 0) != 0 || total != b.num_values)
      return Status::Error("bad row_splits");
  }
  for (int64_t bag = 0; bag < b.num_bags; ++bag) {
    int64_t first = bag * b.bag_size, last = first + b.bag_size;
    if (b.row_splits != nullptr) {
      first = ReadInteger(b.row_splits, b.row_splits_int64, bag);
      last = ReadInteger(b.row_splits, b.row_splits_int64, bag + 1);
      if (last < first) return Status::Error("row_splits must be non-decreasing");
    }
    for (int64_t j = first; j < last; ++j) {
      const int64_t r = ReadInteger(b.indices, b.indices_int64, j);
      if (r >= 0 && r < t.num_rows) {
        out->entries[bag].push_back(j);
        continue;
      }
      // Outside [0, num_rows): padding or an error, as the policy says.
      const bool padding = b.index_policy == IndexPolicy::kOutOfRangeIsPadding ||
                           (r < 0 && b.index_policy == IndexPolicy::kNegativeIsPadding);
      if (!padding) return Status::Error("index out of range at " + std::to_string(j));
    }
  }
  out->total = total;
  return Status::Ok();
}

float Weight(const Bags& b, int64_t j) { return b.weights ? ReadFloat(b.weights, b.weights_type, j) : 1.f; }

int64_t Row(const Bags& b, int64_t j) { return ReadInteger(b.indices, b.indices_int64, j); }

// max: for each column, the entry holding the bag's maximum (the first NaN
// if there is one, else the first one on ties), or -1 for an empty bag.
std::vector<int64_t> MaxEntries(const Table& t, const Bags& b, const std::vector<int64_t>& entries) {
  std::vector<int64_t> argmax(t.dim, -1);
  for (int64_t d = 0; d < t.dim; ++d)
    for (int64_t j : entries) {
      if (argmax[d] >= 0 && std::isnan(TableAt(t, Row(b, argmax[d]), d))) break;
      const float v = TableAt(t, Row(b, j), d);
      if (argmax[d] < 0 || std::isnan(v) || v > TableAt(t, Row(b, argmax[d]), d)) argmax[d] = j;
    }
  return argmax;
}

// One bag's combined output (float32) and its denominator (1 for max).
void BagOutput(const Table& t, const Bags& b, Combiner c, const std::vector<int64_t>& entries,
               std::vector<float>* out, float* denom) {
  out->assign(t.dim, 0.f);
  if (c == Combiner::kMax) {
    const std::vector<int64_t> argmax = MaxEntries(t, b, entries);
    for (int64_t d = 0; d < t.dim; ++d) (*out)[d] = argmax[d] < 0 ? 0.f : TableAt(t, Row(b, argmax[d]), d);
    *denom = 1.f;
    return;
  }
  float ws = 0.f, wq = 0.f;
  for (int64_t j : entries) {
    const float w = Weight(b, j);
    ws += w;
    wq += w * w;
    for (int64_t d = 0; d < t.dim; ++d) (*out)[d] += w * TableAt(t, Row(b, j), d);
  }
  *denom = c == Combiner::kMean ? ws : c == Combiner::kSqrtn ? std::sqrt(wq) : 1.f;
  for (int64_t d = 0; d < t.dim; ++d) (*out)[d] = *denom != 0.f ? (*out)[d] / *denom : 0.f;
}

}  // namespace

Status ReferenceForward(const Table& table, const Bags& bags, Combiner combiner, void* out,
                        ElemType out_type) {
  BagList list;
  Status s = ListBags(table, bags, combiner, &list);
  if (!s.ok) return s;
  std::vector<float> row;
  for (int64_t b = 0; b < bags.num_bags; ++b) {
    float denom;
    BagOutput(table, bags, combiner, list.entries[b], &row, &denom);
    for (int64_t d = 0; d < table.dim; ++d) WriteFloat(out, out_type, b * table.dim + d, row[d]);
  }
  return Status::Ok();
}

Status ReferenceBackward(const Table& table, const Bags& bags, Combiner combiner,
                         const void* grad_out, ElemType grad_type, void* d_table,
                         ElemType d_table_type, void* d_weights) {
  if (table.type == ElemType::kInt8) return Status::Error("no gradient for int8 tables");
  BagList list;
  Status s = ListBags(table, bags, combiner, &list);
  if (!s.ok) return s;
  const int64_t dim = table.dim;
  std::vector<float> d_table_f(d_table ? table.num_rows * dim : 0, 0.f);
  std::vector<float> d_weights_f(d_weights && bags.weights ? list.total : 0, 0.f);
  std::vector<float> out;
  for (int64_t b = 0; b < bags.num_bags; ++b) {
    float denom;
    BagOutput(table, bags, combiner, list.entries[b], &out, &denom);
    if (denom == 0.f) continue;  // the output is constant 0: zero gradients
    if (combiner == Combiner::kMax) {  // each column's gradient to its maximum's row
      const std::vector<int64_t> argmax = MaxEntries(table, bags, list.entries[b]);
      for (int64_t d = 0; d < dim; ++d)
        if (d_table && argmax[d] >= 0)
          d_table_f[Row(bags, argmax[d]) * dim + d] += ReadFloat(grad_out, grad_type, b * dim + d);
      continue;
    }
    // out = sum_k w_k x_k / denom(w):
    //   d out / d x_k = w_k / denom
    //   d out / d w_k = (x_k - out * d denom / d w_k) / denom,
    //   with d denom / d w_k = 0 (sum), 1 (mean), w_k / denom (sqrtn).
    for (int64_t j : list.entries[b]) {
      const float w = Weight(bags, j);
      const float d_denom = combiner == Combiner::kMean ? 1.f : combiner == Combiner::kSqrtn ? w / denom : 0.f;
      float dw = 0.f;
      for (int64_t d = 0; d < dim; ++d) {
        const float g = ReadFloat(grad_out, grad_type, b * dim + d);
        if (d_table) d_table_f[Row(bags, j) * dim + d] += g * w / denom;
        dw += g * (TableAt(table, Row(bags, j), d) - out[d] * d_denom) / denom;
      }
      if (!d_weights_f.empty()) d_weights_f[j] = dw;
    }
  }
  for (size_t i = 0; i < d_table_f.size(); ++i) WriteFloat(d_table, d_table_type, i, d_table_f[i]);
  for (size_t i = 0; i < d_weights_f.size(); ++i) WriteFloat(d_weights, bags.weights_type, i, d_weights_f[i]);
  return Status::Ok();
}

}  // namespace pkm
