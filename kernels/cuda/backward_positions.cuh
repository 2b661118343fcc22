// Device helpers shared by the position walk (backward_positions.cu) and the
// pass over the rows with one entry (backward_single_rows.cu): L2 hints, a
// lane's tile of a row, storing a finished row and an entry's dot, and one
// entry's arithmetic, which both keep in the same order so their results are
// bitwise those of one walk.
#ifndef PKM_KERNELS_CUDA_BACKWARD_POSITIONS_CUH_
#define PKM_KERNELS_CUDA_BACKWARD_POSITIONS_CUH_

#include "kernels/cuda/backward.cuh"

namespace pkm_cuda {

// L2 eviction priorities (createpolicy + .L2::cache_hint, sm_80+). Before the
// single-entry pass, the walk moved ~1.9x its d_table's bytes through DRAM
// (ncu, bf16 huge table: 2.2 GB
// written, 1.8 GB read, ~0.85 GB of it the touched table rows, most of the
// rest the 32 MB upstream gradient, gathered K times, re-read: 11% of the
// reads hit L2). Per element size on the H200 (round 8): fp32 rows mark the gradient
// rows evict_last (2.25 -> 2.23 ms, two runs); 16-bit rows mark the table rows
// and d_table lines, touched once, evict_first (one run: 1.17 ms against 1.19
// with the gradient rows evict_last instead; another: 1.204 against 1.203
// without hints, i.e. no gain there).
#ifndef PKM_BWD_L2_HINTS
#define PKM_BWD_L2_HINTS 1  // -D...=0 for an A/B without them
#endif
template <typename T>
struct L2Hints {
  static constexpr bool kKeepGradient = PKM_BWD_L2_HINTS && sizeof(T) == 4;
  static constexpr bool kStreamOnce = PKM_BWD_L2_HINTS && sizeof(T) == 2;
};

__device__ __forceinline__ uint64_t EvictFirstPolicy() {
  uint64_t p;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
  return p;
}
__device__ __forceinline__ uint64_t EvictLastPolicy() {
  uint64_t p;
  asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(p));
  return p;
}

// A d_table store; kStream: evict_first.
template <bool kStream>
__device__ __forceinline__ void Store16(void* p, uint4 v) {
  if constexpr (!kStream) {
    *static_cast<uint4*>(p) = v;
  } else {
    asm volatile("st.global.L2::cache_hint.v4.u32 [%0], {%1, %2, %3, %4}, %5;" ::"l"(p), "r"(v.x), "r"(v.y),
                 "r"(v.z), "r"(v.w), "l"(EvictFirstPolicy())
                 : "memory");
  }
}

template <typename T, int VEC, int U>
struct RowTile {
  Pack<T, VEC> v[U];
};

template <typename T, int VEC, int U>
__device__ __forceinline__ void LoadTile(const T* row_ptr, int64_t lane_col, int64_t dim, bool active,
                                         RowTile<T, VEC, U>& tile) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int64_t col = lane_col + static_cast<int64_t>(u) * kWarp * VEC;
    if (!active || col >= dim) ZeroPack<T, VEC>(tile.v[u]);
    else LoadPack<T, VEC>(row_ptr + col, tile.v[u]);
  }
}

// Stores a finished row: d_table row, or its sparse slot.
template <typename T, int VEC, int U, bool kStream = L2Hints<T>::kStreamOnce>
__device__ __forceinline__ void StoreRow(const BackwardArgs& a, int64_t row, int64_t lane_col,
                                         const float (&acc)[U][VEC]) {
  if (a.d_table == nullptr) return;
  const int64_t dim = a.bags.dim;
  T* out = static_cast<T*>(a.d_table) + (a.slot_of_row ? a.slot_of_row[row] : row) * dim;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int64_t col = lane_col + static_cast<int64_t>(u) * kWarp * VEC;
    if (col >= dim) continue;
    Pack<T, VEC> pack;
#pragma unroll
    for (int v = 0; v < VEC; ++v) pack.elems[v] = FromFloat<T>(acc[u][v]);
    Store16<kStream>(out + col, pack.raw);
  }
}

// One entry's raw dot: to dots for the d_weights kernel, or (a.d_weights set:
// sum combiner) to d_weights as that kernel would store it (0 + dot). Long
// rows' d_weights come from the pieces pass (PiecesKernel).
__device__ __forceinline__ void StoreDot(const BackwardArgs& a, uint32_t entry, float dot) {
  if (a.d_weights != nullptr) StoreWeight(a.d_weights, a.bags.weights_type, entry, 0.f + dot);
  else a.dots[entry] = dot;
}

// The lowest lane of *pending (then cleared), or -1 when none is left.
__device__ __forceinline__ int PopLowest(unsigned* pending) {
  const int at = __ffs(*pending) - 1;
  *pending &= *pending - 1;
  return at;
}

// acc += coef * g on this lane's columns; returns this lane's part of the dot
// g . table. One entry's arithmetic, in the order every pass here keeps.
template <typename T, int VEC, int U>
__device__ __forceinline__ float AddScaledRow(float coef, const RowTile<T, VEC, U>& g,
                                              const RowTile<T, VEC, U>& table, float (&acc)[U][VEC]) {
  float partial_dot = 0.f;
#pragma unroll
  for (int u = 0; u < U; ++u)
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      const float gv = ToFloat<T>(g.v[u].elems[v]);
      acc[u][v] = fmaf(coef, gv, acc[u][v]);
      partial_dot = fmaf(gv, ToFloat<T>(table.v[u].elems[v]), partial_dot);
    }
  return partial_dot;
}

// Where the table has more rows than entries: writes the gradient rows (and
// dots) of the rows with exactly one entry, by bag (backward_single_rows.cu);
// the walk is then launched with single_entry_rows_done.
int LaunchSingleEntryRows(const BackwardArgs& args, cudaStream_t stream);

}  // namespace pkm_cuda

#endif  // PKM_KERNELS_CUDA_BACKWARD_POSITIONS_CUH_
