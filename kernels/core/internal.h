// Small inline helpers shared by the fast and the reference implementations.
#ifndef PKM_KERNELS_CORE_INTERNAL_H_
#define PKM_KERNELS_CORE_INTERNAL_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <type_traits>

#include "kernels/core/embedding_bag.h"
#include "kernels/core/vector_ops.h"

namespace pkm {
namespace internal {

inline int64_t ReadInt(const void* p, bool is_int64, int64_t i) {
  return is_int64 ? static_cast<const int64_t*>(p)[i]
                  : static_cast<int64_t>(static_cast<const int32_t*>(p)[i]);
}

inline int64_t IndexAt(const Bags& bags, int64_t j) {
  return ReadInt(bags.indices, bags.indices_int64, j);
}

inline float WeightAt(const Bags& bags, int64_t j) {
  return bags.weights ? vec::LoadElem(bags.weights, bags.weights_type, j) : 1.f;
}

// An int8 table's row scale or bias (float32 or float16); a null vector is 0.
inline float RowParam(const void* params, ElemType type, int64_t r) {
  if (params == nullptr) return 0.f;
  return type == ElemType::kFloat16 ? HalfToFloat(static_cast<const uint16_t*>(params)[r])
                                    : static_cast<const float*>(params)[r];
}

// Calls f(load_weight) with the bags' weight loader (load_weight(j) is entry
// j's weight as a float; 1 without weights): a loop templated on it holds no
// per-entry type switch. Chosen once per block of bags. Always inlined, and so
// must f be where it holds the loop: a function called out of line is compiled
// for its file's default target (SSE2), not for its caller's target attribute
// (round 45's short rows through a plain inline one: bfloat16 D=128 3.7x the time).
#define PKM_LOADER_INLINE __attribute__((always_inline))
template <typename F>
PKM_LOADER_INLINE inline void WithWeightLoader(const Bags& bags, F&& f) {
  const uint16_t* halves = static_cast<const uint16_t*>(bags.weights);
  if (bags.weights == nullptr) {
    f([](int64_t) PKM_LOADER_INLINE { return 1.f; });
  } else if (bags.weights_type == ElemType::kBFloat16) {
    f([halves](int64_t j) PKM_LOADER_INLINE { return BFloat16ToFloat(halves[j]); });
  } else if (bags.weights_type == ElemType::kFloat16) {
    f([halves](int64_t j) PKM_LOADER_INLINE { return HalfToFloat(halves[j]); });
  } else {  // float32 (CheckTypes)
    f([w = static_cast<const float*>(bags.weights)](int64_t j) PKM_LOADER_INLINE { return w[j]; });
  }
}
#undef PKM_LOADER_INLINE

// Calls f(std::integral_constant<int, V>{}) for V = dim / 16, 1 to 8: the
// 16-column vectors of a row of 16-128 columns, as a template argument.
template <typename F>
inline void WithVectorsPerRow(int64_t dim, F&& f) {
  switch (dim / 16) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    default: return f(std::integral_constant<int, 8>{});
  }
}

// Calls f(vectors, load_weight) with both of the above: the short-row loops'
// dispatch on their row width and weight type.
template <typename F>
inline void WithVectorsAndWeights(int64_t dim, const Bags& bags, F&& f) {
  WithVectorsPerRow(dim, [&](auto vectors) { WithWeightLoader(bags, [&](auto load) { f(vectors, load); }); });
}

#if defined(__x86_64__)
// x rounded as a float of its own: GCC does not fuse it into the sum it feeds
// (the loops that keep a sum rounded as the window path's, which is compiled
// without FMA).
__attribute__((always_inline)) inline float Unfused(float x) {
  asm("" : "+x"(x));
  return x;
}
#endif

inline void StoreElem(void* base, ElemType type, int64_t i, float v) {
  switch (type) {
    case ElemType::kFloat32: static_cast<float*>(base)[i] = v; break;
    case ElemType::kFloat16: static_cast<uint16_t*>(base)[i] = FloatToHalf(v); break;
    case ElemType::kBFloat16: static_cast<uint16_t*>(base)[i] = FloatToBFloat16(v); break;
    case ElemType::kInt8: break;
  }
}

// Type, shape and combiner checks common to forward and backward
// (CheckCombiner included: max refuses weights).
Status CheckTypes(const Table& t, const Bags& bags, Combiner combiner, ElemType out_type, bool for_gradient);

// ValidateBags in parts. ValidateLayout: row_splits well formed, a known
// index policy. FirstInvalidEntry: the first entry of [begin, end) whose
// index the policy rejects, or end. InvalidIndexError: the message for entry j.
Status ValidateLayout(const Bags& bags);
int64_t FirstInvalidEntry(const Table& table, const Bags& bags, int64_t begin, int64_t end);
Status InvalidIndexError(const Table& table, const Bags& bags, int64_t j);
// Lowers *first_bad to j (atomically) where j is smaller.
void RecordFirstInvalid(std::atomic<int64_t>* first_bad, int64_t j);

// pf over bags whose every block first checks its own bags' indices and is
// skipped, its first invalid entry recorded in *first_bad, if one is invalid:
// the forward reads each block's indices just before it sums them (the sums
// then find them in cache), instead of in a pass (and a dispatch to the threads) of its own before
// it (TF op, 2 threads, Zen 4 EPYC: 0.81-0.96x the time at K=128, D=32-128;
// bench/results/cpu_fused_index_check_ab_zen4_round19.md). The blocks
// cover every entry, so the least recorded entry is the first invalid one.
// The result refers to table, bags, pf and first_bad: use it while they live.
// (The short rows check theirs as they sum them: ForSelfCheckedBlocks.)
ParallelFor CheckedBagsFor(const Table& table, const Bags& bags, const ParallelFor& pf,
                           std::atomic<int64_t>* first_bad);
// pf over the bags for loops that check each block's indices themselves:
// fn(b0, b1) returns the block's first invalid entry, else its end
// (bags.End(b1 - 1)); the invalid one is recorded in *first_bad.
void ForSelfCheckedBlocks(const Bags& bags, const ParallelFor& pf, int64_t cost_per_bag,
                          std::atomic<int64_t>* first_bad, const std::function<int64_t(int64_t, int64_t)>& fn);

// The short-row loops' own index check (SumShortRows, the int8 short rows of
// ForwardInt8), in place of CheckedBagsFor's pass over the block: each index
// is compared with the bound where the loop reads it to prefetch its row,
// ahead_entries before it is summed (one unsigned compare where a sign test
// was), and FirstInvalidInHead checks the block's first ahead_entries apart.
// On the Xeon model 207 (2 threads, B=2048 K=128 N=65536, int64 indices, the
// core before and after in one process): bfloat16 D=64 0.94x the time,
// float32 D=32 0.94x, D=64 0.97x, bfloat16 D=128 0.96x, int8 D=64 0.95x,
// D=128 0.96x; int32 indices 0.98-1.0x.
struct IndexBound {
  uint64_t rows;  // an index is a row where it is below this as unsigned
  bool negative_is_padding;
};
inline IndexBound IndexBoundOf(const Table& table, const Bags& bags) {
  return {static_cast<uint64_t>(table.num_rows), bags.index_policy == IndexPolicy::kNegativeIsPadding};
}
// For an index the unsigned compare found to be no row: whether it is an
// error (else it is padding).
inline bool EndsBlock(IndexBound bound, int64_t index) { return index >= 0 || !bound.negative_is_padding; }
// FirstInvalidEntry over the block's entries that no prefetch reads before
// they are summed, [block_begin, block_begin + ahead_entries) within the
// block; block_end where all are valid.
inline int64_t FirstInvalidInHead(const Table& table, const Bags& bags, int64_t block_begin, int64_t block_end,
                                  int64_t ahead_entries) {
  const int64_t head_end = std::min(block_end, block_begin + ahead_entries);
  const int64_t bad = FirstInvalidEntry(table, bags, block_begin, head_end);
  return bad < head_end ? bad : block_end;
}

// 1, 1/sum(w) or 1/sqrt(sum w^2); 0 where the denominator is 0; 1 for max.
float CombinerScale(Combiner c, float weight_sum, float weight_sq_sum);

}  // namespace internal
}  // namespace pkm

#endif  // PKM_KERNELS_CORE_INTERNAL_H_
