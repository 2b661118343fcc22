// The slow, obviously-correct EmbeddingBag: serial loops straight from the
// definition, with gradients from the textbook derivatives. Tests pit the fast
// core (and the GPU kernels) against it.
#include <cmath>
#include <vector>

#include "kernels/core/embedding_bag.h"
#include "kernels/core/internal.h"

namespace pkm {

using internal::IndexAt;
using internal::WeightAt;

namespace {

float TableAt(const Table& t, int64_t row, int64_t d) {
  const int64_t i = row * t.dim + d;
  if (t.type == ElemType::kInt8) {
    const float zp = t.row_zero_points ? static_cast<float>(t.row_zero_points[row]) : 0.f;
    return t.row_scales[row] * (static_cast<float>(static_cast<const int8_t*>(t.data)[i]) - zp);
  }
  return vec::LoadElem(t.data, t.type, i);
}

// The combined output of one bag, in float32, before storing.
void BagOutput(const Table& t, const Bags& bags, Combiner c, int64_t b, std::vector<float>* out,
               float* weight_sum, float* weight_sq_sum) {
  out->assign(t.dim, 0.f);
  float ws = 0.f, wq = 0.f;
  for (int64_t j = bags.Begin(b); j < bags.End(b); ++j) {
    const int64_t r = IndexAt(bags, j);
    if (r < 0) continue;
    const float w = WeightAt(bags, j);
    ws += w;
    wq += w * w;
    for (int64_t d = 0; d < t.dim; ++d) (*out)[d] += w * TableAt(t, r, d);
  }
  float denom = 1.f;
  if (c == Combiner::kMean) denom = ws;
  if (c == Combiner::kSqrtn) denom = std::sqrt(wq);
  for (int64_t d = 0; d < t.dim; ++d) (*out)[d] = denom != 0.f ? (*out)[d] / denom : 0.f;
  *weight_sum = ws;
  *weight_sq_sum = wq;
}

}  // namespace

Status ReferenceForward(const Table& table, const Bags& bags, Combiner combiner, void* out,
                        ElemType out_type) {
  Status s = internal::CheckTypes(table, bags, out_type, false);
  if (!s.ok) return s;
  s = ValidateBags(table, bags, SerialFor());
  if (!s.ok) return s;
  std::vector<float> row;
  for (int64_t b = 0; b < bags.num_bags; ++b) {
    float ws, wq;
    BagOutput(table, bags, combiner, b, &row, &ws, &wq);
    for (int64_t d = 0; d < table.dim; ++d)
      internal::StoreElem(out, out_type, b * table.dim + d, row[d]);
  }
  return Status::Ok();
}

Status ReferenceBackward(const Table& table, const Bags& bags, Combiner combiner,
                         const void* grad_out, ElemType grad_type, void* d_table,
                         ElemType d_table_type, void* d_weights) {
  Status s = internal::CheckTypes(table, bags, d_table_type, true);
  if (!s.ok) return s;
  s = ValidateBags(table, bags, SerialFor());
  if (!s.ok) return s;
  const int64_t dim = table.dim;
  std::vector<float> d_table_f(d_table ? table.num_rows * dim : 0, 0.f);
  std::vector<float> out;
  for (int64_t b = 0; b < bags.num_bags; ++b) {
    float ws, wq;
    BagOutput(table, bags, combiner, b, &out, &ws, &wq);
    // d out / d x_k = w_k / denom ;  d out / d w_k = x_k / denom - out * d(denom)/d(w_k) / denom
    float denom = 1.f;
    if (combiner == Combiner::kMean) denom = ws;
    if (combiner == Combiner::kSqrtn) denom = std::sqrt(wq);
    for (int64_t j = bags.Begin(b); j < bags.End(b); ++j) {
      const int64_t r = IndexAt(bags, j);
      float dw = 0.f;
      if (r >= 0 && denom != 0.f) {
        const float w = WeightAt(bags, j);
        float d_denom = 0.f;
        if (combiner == Combiner::kMean) d_denom = 1.f;
        if (combiner == Combiner::kSqrtn) d_denom = w / denom;
        for (int64_t d = 0; d < dim; ++d) {
          const float g = vec::LoadElem(grad_out, grad_type, b * dim + d);
          if (d_table) d_table_f[r * dim + d] += g * w / denom;
          dw += g * (TableAt(table, r, d) - out[d] * d_denom) / denom;
        }
      }
      if (d_weights && bags.weights) internal::StoreElem(d_weights, bags.weights_type, j, dw);
    }
  }
  if (d_table)
    for (int64_t i = 0; i < table.num_rows * dim; ++i)
      internal::StoreElem(d_table, d_table_type, i, d_table_f[i]);
  return Status::Ok();
}

}  // namespace pkm
