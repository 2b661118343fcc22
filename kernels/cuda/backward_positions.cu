// The row pass of the table gradient for narrow rows (backward.cuh step 3),
// walked by sorted position instead of by table row. RowsKernel gives a warp 4
// consecutive table rows and sums them one after the other: at B*K = 2M over
// 4M rows a row has ~0.5 entries, so each warp mostly waits on one chain of
// dependent loads (segment start -> sorted entry -> bag, weight -> gradient row)
// per row. Here a warp takes 32 consecutive sorted positions, owns the rows
// that start there, and walks their positions kPositionsInFlight at a time:
// the gradient rows (and table rows, for the dots) of all of them are loaded
// before any is summed, across row boundaries. Each row is still summed in
// position order by one warp (fmaf from 0, as RowsKernel): the result is
// bitwise the same. Untouched rows of a dense d_table get their zeros in the
// same launch from plain 16-byte stores (a warp per 32 rows). With the sum
// combiner the pass stores d_weights too (StoreDot), saving the d_weights kernel.
#include "kernels/cuda/backward_rows.cuh"

namespace pkm_cuda {
namespace {

#ifndef PKM_BWD_POSITIONS_IN_FLIGHT
#define PKM_BWD_POSITIONS_IN_FLIGHT 2
#endif
#ifndef PKM_BWD_POSITION_THREADS
#define PKM_BWD_POSITION_THREADS 256
#endif
constexpr int kPositionsInFlight = PKM_BWD_POSITIONS_IN_FLIGHT;
constexpr int kPositionThreads = PKM_BWD_POSITION_THREADS;
// Resident 256-thread blocks asked for, i.e. a register cap (4 -> 64, 3 -> 80,
// 2 -> 128): the pass is latency-bound, so resident warps count most. Picked on
// the H200 (bench/results/gpu_kernels_ab_h200_round5_*): one vector per lane at
// 64 (16-bit rows spill 44 bytes there and are still faster than at 80), fp32
// two vectors at 80, 16-bit two vectors at 128 (they spill under 80).
constexpr int PositionMinBlocks(int elem_bytes, int u) {
#ifdef PKM_BWD_POSITION_MIN_BLOCKS
  return PKM_BWD_POSITION_MIN_BLOCKS;
#else
  return u == 1 ? 4 : (elem_bytes == 2 ? 2 : 3);
#endif
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
template <typename T, int VEC, int U>
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
    *reinterpret_cast<uint4*>(out + col) = pack.raw;
  }
}

// One entry's raw dot: to dots for the d_weights kernel, or (a.d_weights set:
// sum combiner) to d_weights as that kernel would store it (0 + dot). Long
// rows' d_weights come from the pieces pass (PiecesKernel).
__device__ __forceinline__ void StoreDot(const BackwardArgs& a, uint32_t entry, float dot) {
  if (a.d_weights != nullptr) StoreWeight(a.d_weights, a.bags.weights_type, entry, 0.f + dot);
  else a.dots[entry] = dot;
}

// The walk's state between batches (warp-uniform but the registers).
template <typename T, int VEC, int U>
struct Walk {
  int64_t row = -1;  // the row being summed (-1: none yet)
  int64_t hi = 0;    // its end position (long rows only)
  bool long_row = false;  // summed from the pieces pass instead
  RowTile<T, VEC, U> table;  // its table row (for the dots)
  float acc[U][VEC];
};

// One window of up to 32 positions from `cursor`: per lane its position's row
// and metadata; per window (bit masks) where rows start and which are long.
// Returns where the next window starts.
template <typename T, int VEC, int U>
__device__ int64_t WalkWindow(const BackwardArgs& a, int64_t cursor, int64_t end, int lane, int64_t lane_col,
                              Walk<T, VEC, U>& w) {
  const int64_t dim = a.bags.dim;
  const int count = static_cast<int>(min(static_cast<int64_t>(kWarp), end - cursor));
  const bool in = lane < count;
  const uint32_t my_row = in ? a.sorted_rows[cursor + lane] : 0u;
  const EntryMeta meta = LoadEntryMeta(a, cursor + lane, in);
  const uint32_t my_bag = static_cast<uint32_t>(meta.bag);
  // The row at the window's last position may run on: its end from seg_begin.
  const uint32_t tail_row = __shfl_sync(kFullMask, my_row, count - 1);
  const int64_t tail_hi = a.seg_begin[tail_row + 1];
  uint32_t prev_row = __shfl_up_sync(kFullMask, my_row, 1);
  const bool starts_here = in && (lane == 0 ? static_cast<int64_t>(my_row) != w.row : my_row != prev_row);
  const unsigned starts = __ballot_sync(kFullMask, starts_here);
  // A row's end: the next start in the window, or the tail row's end.
  const unsigned later = lane == kWarp - 1 ? 0u : starts & (~0u << (lane + 1));
  const int64_t my_hi = later != 0 ? cursor + __ffs(later) - 1 : tail_hi;
  const unsigned longs = __ballot_sync(kFullMask, starts_here && my_hi - (cursor + lane) > a.long_segment);
  const T* __restrict__ grad = static_cast<const T*>(a.grad);
  const T* __restrict__ table = static_cast<const T*>(a.bags.table);
  const bool want_dots = a.dots != nullptr;
  for (int k = 0; k < count; k += kPositionsInFlight) {
    RowTile<T, VEC, U> g[kPositionsInFlight], x[kPositionsInFlight];
    // Every load of the batch first: gradient rows, table rows of the rows that start here.
#pragma unroll
    for (int j = 0; j < kPositionsInFlight; ++j) {
      const int at = (k + j) & (kWarp - 1);
      const bool active = k + j < count;
      const uint32_t row = __shfl_sync(kFullMask, my_row, at);
      const uint32_t bag = __shfl_sync(kFullMask, my_bag, at);
      const bool fresh = active && ((starts >> at) & 1u);
      LoadTile<T, VEC, U>(grad + static_cast<int64_t>(bag) * dim, lane_col, dim, active, g[j]);
      LoadTile<T, VEC, U>(table + static_cast<int64_t>(row) * dim, lane_col, dim, fresh && want_dots, x[j]);
    }
#pragma unroll
    for (int j = 0; j < kPositionsInFlight; ++j) {
      const int at = k + j;
      if (at >= count) break;
      if ((starts >> at) & 1u) {
        if (w.row >= 0) StoreRow<T, VEC, U>(a, w.row, lane_col, w.acc);
        ZeroAcc<VEC, U>(w.acc);
        w.row = __shfl_sync(kFullMask, my_row, at);
        w.long_row = (longs >> at) & 1u;
        w.table = x[j];
        if (w.long_row) {
          w.hi = __shfl_sync(kFullMask, my_hi, at);
          if (a.d_table != nullptr) AddPieces<VEC, U>(a, w.row, cursor + at, w.hi, lane_col, w.acc);
        }
      }
      if (w.long_row) continue;  // its dots came from the pieces pass
      const float coef = __shfl_sync(kFullMask, meta.coef, at);
      float partial_dot = 0.f;
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int v = 0; v < VEC; ++v) {
          const float gv = ToFloat<T>(g[j].v[u].elems[v]);
          w.acc[u][v] = fmaf(coef, gv, w.acc[u][v]);
          partial_dot = fmaf(gv, ToFloat<T>(w.table.v[u].elems[v]), partial_dot);
        }
      if (want_dots) {
        const float dot = WarpSum(partial_dot);
        const uint32_t entry = __shfl_sync(kFullMask, meta.entry, at);
        if (lane == 0) StoreDot(a, entry, dot);
      }
    }
    // Inside a long row: jump to its end.
    if (w.long_row && w.hi > cursor + k + kPositionsInFlight) return w.hi;
  }
  return cursor + count;
}

// The rows that start in sorted positions [chunk * 32, chunk * 32 + 32).
template <typename T, int VEC, int U>
__device__ void GradientOfChunk(const BackwardArgs& a, int64_t chunk, int lane) {
  const int64_t n = a.num_indices, num_rows = a.bags.num_rows;
  const int64_t c0 = chunk * kWarp;
  const int64_t pos = c0 + lane;
  const uint32_t my_row = pos < n ? a.sorted_rows[pos] : static_cast<uint32_t>(num_rows);
  uint32_t prev = __shfl_up_sync(kFullMask, my_row, 1);
  if (lane == 0) prev = c0 > 0 ? a.sorted_rows[c0 - 1] : UINT32_MAX;
  const unsigned starts = __ballot_sync(kFullMask, pos < n && my_row < num_rows && my_row != prev);
  // Skipped entries (sorted last, row = num_rows) get d_weight 0 (the d_weights kernel's ValidEntry).
  if (a.d_weights != nullptr && pos < n && my_row >= num_rows)
    StoreWeight(a.d_weights, a.bags.weights_type, a.sorted_entries[pos], 0.f);
  if (starts == 0) return;
  const uint32_t last_row = __shfl_sync(kFullMask, my_row, 31 - __clz(starts));
  const int64_t end = a.seg_begin[last_row + 1];
  const int64_t lane_col = static_cast<int64_t>(lane) * VEC;
  Walk<T, VEC, U> w;
  ZeroAcc<VEC, U>(w.acc);
  for (int64_t cursor = c0 + __ffs(starts) - 1; cursor < end;)
    cursor = WalkWindow<T, VEC, U>(a, cursor, end, lane, lane_col, w);
  StoreRow<T, VEC, U>(a, w.row, lane_col, w.acc);
}

// Dense d_table: zeros into the untouched rows of [group * 32, group * 32 + 32).
template <typename T, int VEC>
__device__ void ZeroUntouchedRows(const BackwardArgs& a, int64_t group, int lane) {
  const int64_t num_rows = a.bags.num_rows, dim = a.bags.dim;
  const int64_t r0 = group * kWarp, r = r0 + lane;
  const uint32_t begin = r <= num_rows ? a.seg_begin[r] : 0u;
  uint32_t next = __shfl_down_sync(kFullMask, begin, 1);
  if (lane == kWarp - 1) next = r + 1 <= num_rows ? a.seg_begin[r + 1] : 0u;
  unsigned untouched = __ballot_sync(kFullMask, r < num_rows && next == begin);
  Pack<T, VEC> zero;
  ZeroPack<T, VEC>(zero);
  while (untouched != 0) {
    const int bit = __ffs(untouched) - 1;
    untouched &= untouched - 1;
    T* out = static_cast<T*>(a.d_table) + (r0 + bit) * dim;
    for (int64_t col = static_cast<int64_t>(lane) * VEC; col < dim; col += kWarp * VEC)
      *reinterpret_cast<uint4*>(out + col) = zero.raw;
  }
}

// Warps [0, chunks) sum the rows starting in their chunk; warps [0,
// zero_groups) then zero their group's untouched rows. (Interleaving the zero
// groups over all warps, zeros first or last, measured slower on the H200.)
template <typename T, int VEC, int U>
__global__ void __launch_bounds__(kPositionThreads, PositionMinBlocks(sizeof(T), U))
    PositionsKernel(BackwardArgs a, int64_t chunks, int64_t zero_groups) {
  const int lane = threadIdx.x % kWarp;
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * (kPositionThreads / kWarp) + threadIdx.x / kWarp;
  if (warp < chunks) GradientOfChunk<T, VEC, U>(a, warp, lane);
  if (warp < zero_groups) ZeroUntouchedRows<T, VEC>(a, warp, lane);
}

template <typename T, int VEC, int U>
int LaunchPositionPassAs(const BackwardArgs& args, int64_t pieces, cudaStream_t stream) {
  constexpr int kThreads = RowPassThreads(sizeof(T));
  if (pieces > 0) {
    const int64_t warps = pieces * args.tiles;
    if (warps / (kThreads / kWarp) >= INT32_MAX) return SetInvalid("backward: too many pieces for one launch");
    PiecesKernel<T, VEC, U, false><<<Blocks(warps, kThreads / kWarp), kThreads, 0, stream>>>(args, pieces);
    if (int status = CheckLaunch("backward pieces pass")) return status;
  }
  const int64_t chunks = (args.num_indices + kWarp - 1) / kWarp;
  const bool dense = args.d_table != nullptr && args.slot_of_row == nullptr;
  const int64_t zero_groups = dense ? (args.bags.num_rows + kWarp - 1) / kWarp : 0;
  const int64_t warps = max(chunks, zero_groups);
  if (warps / (kPositionThreads / kWarp) >= INT32_MAX) return SetInvalid("backward: too many rows for one launch");
  if (warps == 0) return PKM_CUDA_OK;
  PositionsKernel<T, VEC, U><<<Blocks(warps, kPositionThreads / kWarp), kPositionThreads, 0, stream>>>(
      args, chunks, zero_groups);
  return CheckLaunch("backward position pass");
}

template <typename T>
int LaunchPositionPassFor(const BackwardArgs& args, int64_t pieces, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  if (args.bags.dim <= kWarp * kVec) return LaunchPositionPassAs<T, kVec, 1>(args, pieces, stream);
  return LaunchPositionPassAs<T, kVec, 2>(args, pieces, stream);
}

}  // namespace

bool PositionPassApplies(const BackwardArgs& args) {
#ifdef PKM_BWD_NO_POSITION_PASS  // -D for an A/B against the row pass alone
  return false;
#endif
  const int64_t vec = args.bags.elem_type == PKM_FLOAT32 ? 4 : 8;
  return args.max_entry == nullptr && args.bags.dim % vec == 0 && args.bags.dim <= 2 * kWarp * vec &&
         Aligned16(args.bags.table) && Aligned16(args.grad) && (args.d_table == nullptr || Aligned16(args.d_table));
}

int LaunchPositionPass(const BackwardArgs& args, int64_t pieces, cudaStream_t stream) {
  switch (args.bags.elem_type) {
    case PKM_FLOAT16: return LaunchPositionPassFor<__half>(args, pieces, stream);
    case PKM_BFLOAT16: return LaunchPositionPassFor<__nv_bfloat16>(args, pieces, stream);
    default: return LaunchPositionPassFor<float>(args, pieces, stream);
  }
}

}  // namespace pkm_cuda
