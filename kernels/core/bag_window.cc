#include "kernels/core/bag_window.h"

#include <algorithm>
#include <type_traits>

#include "kernels/core/internal.h"

namespace pkm {
namespace internal {

namespace {

// Enough entries that `ahead` (at most 64) stays within this window and the next.
constexpr int64_t kWindowEntries = 256;

// One bag's valid entries into rows/coefs (and row_ids, int8 tables) from
// position n on; returns the new n. A template per index type, weight type and
// table kind, so the loop holds no per-entry type switch and keeps its sums in
// registers (the generic loop spilled them and was 21% of the bfloat16 D=128
// forward's samples on the 2-core EPYC).
template <typename Index, typename LoadWeight, bool kInt8>
__attribute__((always_inline)) inline int64_t CollectBag(const Index* idx, LoadWeight load_weight, int64_t begin,
                                                         int64_t end, const char* data, int64_t row_bytes,
                                                         const char* scales, const char* biases, int64_t param_bytes,
                                                         int64_t n, const char** rows, float* coefs, int64_t* row_ids,
                                                         float* weight_sum, float* weight_sq_sum) {
  float ws = 0.f, wsq = 0.f;
  for (int64_t j = begin; j < end; ++j) {
    const int64_t r = static_cast<int64_t>(idx[j]);
    if (r < 0) continue;  // padding
    const float w = load_weight(j);
    ws += w;
    wsq += w * w;
    rows[n] = data + r * row_bytes;
    coefs[n] = w;
    // int8: the row's scale (and bias) are read by ApplyRowParams just before
    // the entry's group is summed (a random row's scale is a cache miss).
    if constexpr (kInt8) {
      row_ids[n] = r;
      vec::PrefetchTableLine(scales + r * param_bytes);
      if (biases != nullptr) vec::PrefetchTableLine(biases + r * param_bytes);
    }
    ++n;
  }
  *weight_sum = ws;
  *weight_sq_sum = wsq;
  return n;
}

template <typename Index, typename LoadWeight, bool kInt8>
void CollectBags(const Table& table, const Bags& bags, LoadWeight load_weight, int64_t b, int64_t b1,
                 BagWindow* window) {
  const char* data = static_cast<const char*>(table.data);
  const int64_t row_bytes = table.dim * ElemSize(table.type);
  const int64_t param_bytes = kInt8 ? ElemSize(table.row_params_type) : 0;
  const char* scales = static_cast<const char*>(table.row_scales);
  const char* biases = static_cast<const char*>(table.row_biases);
  const Index* idx = static_cast<const Index*>(bags.indices);
  window->first_bag = b;
  window->ends.clear();
  window->weight_sums.clear();
  window->weight_sq_sums.clear();
  int64_t n = 0;  // entries so far; the vectors are sized ahead of each bag
  for (; b < b1 && n < kWindowEntries; ++b) {
    const int64_t begin = bags.Begin(b), end = bags.End(b);
    // Each vector by its own size: a thread's windows carry over from calls
    // on other tables (BlockScratch), where row_ids were not wanted.
    const int64_t need = n + end - begin;
    if (static_cast<int64_t>(window->rows.size()) < need) window->rows.resize(need);
    if (static_cast<int64_t>(window->coefs.size()) < need) window->coefs.resize(need);
    if (kInt8 && static_cast<int64_t>(window->row_ids.size()) < need) window->row_ids.resize(need);
    float weight_sum, weight_sq_sum;
    n = CollectBag<Index, LoadWeight, kInt8>(idx, load_weight, begin, end, data, row_bytes, scales, biases,
                                             param_bytes, n, window->rows.data(), window->coefs.data(),
                                             window->row_ids.data(), &weight_sum, &weight_sq_sum);
    window->ends.push_back(n);
    window->weight_sums.push_back(weight_sum);
    window->weight_sq_sums.push_back(weight_sq_sum);
  }
  window->end_bag = b;
  window->count = n;
}

template <typename Index, bool kInt8>
void CollectBagsAnyWeights(const Table& table, const Bags& bags, int64_t b, int64_t b1, BagWindow* window) {
  WithWeightLoader(bags, [&](auto load_weight) {
    CollectBags<Index, decltype(load_weight), kInt8>(table, bags, load_weight, b, b1, window);
  });
}

}  // namespace

void CollectWindow(const Table& table, const Bags& bags, int64_t b, int64_t b1, BagWindow* window) {
  const bool int8 = table.type == ElemType::kInt8;
  if (bags.indices_int64) {
    if (int8) CollectBagsAnyWeights<int64_t, true>(table, bags, b, b1, window);
    else CollectBagsAnyWeights<int64_t, false>(table, bags, b, b1, window);
  } else {
    if (int8) CollectBagsAnyWeights<int32_t, true>(table, bags, b, b1, window);
    else CollectBagsAnyWeights<int32_t, false>(table, bags, b, b1, window);
  }
}

void ApplyRowParams(const Table& table, BagWindow* window, int64_t k0, int64_t k1, float* bias_sum) {
  for (int64_t k = k0; k < k1; ++k) {
    const int64_t r = window->row_ids[k];
    if (table.row_biases != nullptr)
      *bias_sum += window->coefs[k] * RowParam(table.row_biases, table.row_params_type, r);
    window->coefs[k] *= RowParam(table.row_scales, table.row_params_type, r);
  }
}

BlockScratch& ThreadBlockScratch() {
  thread_local BlockScratch scratch;
  return scratch;
}

void BlockScratch::Release() {
  // Above these sizes (256 KB of acc, 16 windows' worth of entries or bags) a
  // block's rare long bags or wide rows would stay allocated on the thread.
  constexpr size_t kKeepFloats = 65536, kKeepEntries = 16 * kWindowEntries;
  auto release_if_large = [](auto& v, size_t keep) {
    if (v.capacity() > keep) std::remove_reference_t<decltype(v)>().swap(v);
  };
  release_if_large(acc, kKeepFloats);
  for (BagWindow& w : windows) {
    release_if_large(w.rows, kKeepEntries);
    release_if_large(w.coefs, kKeepEntries);
    release_if_large(w.ahead_rows, kKeepEntries);
    release_if_large(w.row_ids, kKeepEntries);
    release_if_large(w.ends, kKeepEntries);
    release_if_large(w.weight_sums, kKeepEntries);
    release_if_large(w.weight_sq_sums, kKeepEntries);
  }
}

int64_t PrefetchAhead(ElemType type, int64_t row_bytes) {
  row_bytes = std::max<int64_t>(row_bytes, 1);
#if defined(PKM_X86_F16C)
  if (vec::f16c::HasAvx512()) {
    const bool wide_float32 = type == ElemType::kFloat32 && row_bytes >= 2048 && row_bytes <= 4096;
    return std::clamp<int64_t>((wide_float32 ? 131072 : 65536) / row_bytes, 8, 128);
  }
#endif
  return std::clamp<int64_t>(8192 / row_bytes, 8, 64);
}

}  // namespace internal
}  // namespace pkm
