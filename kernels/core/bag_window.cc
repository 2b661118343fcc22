#include "kernels/core/bag_window.h"

#include <algorithm>

#include "kernels/core/internal.h"

namespace pkm {
namespace internal {

namespace {

// Enough entries that `ahead` (at most 64) stays within this window and the next.
constexpr int64_t kWindowEntries = 256;

}  // namespace

void CollectWindow(const Table& table, const Bags& bags, int64_t b, int64_t b1, BagWindow* window) {
  const char* data = static_cast<const char*>(table.data);
  const int64_t row_bytes = table.dim * ElemSize(table.type);
  const bool int8 = table.type == ElemType::kInt8;
  const int64_t param_bytes = int8 ? ElemSize(table.row_params_type) : 0;
  const char* scales = static_cast<const char*>(table.row_scales);
  const char* biases = static_cast<const char*>(table.row_biases);
  window->first_bag = b;
  window->ends.clear();
  window->weight_sums.clear();
  window->weight_sq_sums.clear();
  window->bias_sums.clear();
  int64_t n = 0;  // entries so far; the vectors are sized ahead of each bag
  for (; b < b1 && n < kWindowEntries; ++b) {
    const int64_t begin = bags.Begin(b), end = bags.End(b);
    if (static_cast<int64_t>(window->rows.size()) < n + end - begin) {
      window->rows.resize(n + end - begin);
      window->coefs.resize(n + end - begin);
      if (int8) window->row_ids.resize(n + end - begin);
    }
    float weight_sum = 0.f, weight_sq_sum = 0.f;
    for (int64_t j = begin; j < end; ++j) {
      const int64_t r = IndexAt(bags, j);
      if (r < 0) continue;  // padding
      const float w = WeightAt(bags, j);
      weight_sum += w;
      weight_sq_sum += w * w;
      window->rows[n] = data + r * row_bytes;
      window->coefs[n] = w;
      // int8: the row's scale (and bias) are read by ApplyRowParams, after a
      // window of rows has been summed (a random row's scale is a cache miss).
      if (int8) {
        window->row_ids[n] = r;
        __builtin_prefetch(scales + r * param_bytes, 0, 3);
        if (biases != nullptr) __builtin_prefetch(biases + r * param_bytes, 0, 3);
      }
      ++n;
    }
    window->ends.push_back(n);
    window->weight_sums.push_back(weight_sum);
    window->weight_sq_sums.push_back(weight_sq_sum);
    window->bias_sums.push_back(0.f);
  }
  window->end_bag = b;
  window->count = n;
}

void ApplyRowParams(const Table& table, BagWindow* window) {
  if (table.type != ElemType::kInt8) return;
  int64_t k = 0;
  for (size_t i = 0; i < window->ends.size(); ++i) {
    float bias_sum = 0.f;
    for (; k < window->ends[i]; ++k) {
      const int64_t r = window->row_ids[k];
      if (table.row_biases != nullptr)
        bias_sum += window->coefs[k] * RowParam(table.row_biases, table.row_params_type, r);
      window->coefs[k] *= RowParam(table.row_scales, table.row_params_type, r);
    }
    window->bias_sums[i] = bias_sum;
  }
}

int64_t PrefetchAhead(int64_t row_bytes) {
  return std::clamp<int64_t>(8192 / std::max<int64_t>(row_bytes, 1), 8, 64);
}

}  // namespace internal
}  // namespace pkm
