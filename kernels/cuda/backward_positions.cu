// The row pass of the table gradient for narrow rows (backward.cuh step 3),
// walked by sorted position instead of by table row. RowsKernel gives a warp 4
// consecutive table rows and sums them one after the other: at B*K = 2M over
// 4M rows a row has ~0.5 entries, so each warp mostly waits on one chain of
// dependent loads (segment start -> sorted entry -> bag, weight -> gradient row)
// per row. Here a warp takes 32 consecutive sorted positions, owns the rows
// that start there, and walks their positions with the gradient rows (and the
// table rows of rows starting there, for the dots) of the next kStages - 1
// positions in flight, copied by cp.async into a per-warp ring in shared memory
// (no registers held while they fly), across row boundaries. Each row is still
// summed in position order by one warp (fmaf from 0, as RowsKernel): the result
// is bitwise the same. 16-bit tables with at least as many entries as rows keep
// 2 positions' rows in registers instead (faster there). Untouched rows of a
// dense d_table get their zeros from 16-byte stores, a warp per 32 rows: in the
// walk's launch, or, where most rows are untouched, first, in a launch of
// their own. With the sum combiner the pass stores d_weights too (StoreDot),
// saving the d_weights kernel. Where most rows are untouched, the rows with a
// single entry are written by SingleEntryRowsKernel (backward_single_rows.cu)
// and the walk skips them.
#include "kernels/cuda/backward_positions.cuh"
#include "kernels/cuda/backward_rows.cuh"

namespace pkm_cuda {
namespace {

// Bytes of ring per warp: 8 stages of 512-byte rows (one vector per lane),
// 4 of 1 KB rows. 4-warp blocks (32 KB of static shared memory each), 6
// resident per SM, i.e. at most 80 registers (no spills). H200, round 8
// (bench/results/gpu_round8_h200_notes.md): the huge-table backward (B=65536,
// K=32, D=256, N=4M) 1.26 -> 1.20 ms bf16, 2.27 -> 2.23 fp32 against the
// round-5 walk with 2 positions in registers; a 4 KB ring at 8 blocks per SM
// measured the same. 16-bit rows at ~2 entries per row (B=4096, K=128, N=256K)
// were ~6% slower with the ring (0.200 -> 0.212 ms; fp32 ones 5% faster), so
// 16-bit tables with at least as many entries as rows keep the register walk
// (PositionsKernelInRegisters).
#ifndef PKM_BWD_POSITION_STAGE_BYTES
#define PKM_BWD_POSITION_STAGE_BYTES 8192
#endif
constexpr int kStageBytes = PKM_BWD_POSITION_STAGE_BYTES;
constexpr int kPositionThreads = 128;
template <int U>
__host__ __device__ constexpr int PositionStages() { return kStageBytes / (2 * U * kWarp * 16); }
#ifndef PKM_BWD_POSITION_MIN_BLOCKS
#define PKM_BWD_POSITION_MIN_BLOCKS 6
#endif

// CopyAsync16 under a policy: 0 none, 1 evict_first, 2 evict_last.
template <int kPolicy>
__device__ __forceinline__ void CopyAsync16As(void* smem, const void* gmem) {
  if constexpr (kPolicy == 0) {
    CopyAsync16(smem, gmem);
  } else {
    const uint64_t policy = kPolicy == 1 ? EvictFirstPolicy() : EvictLastPolicy();
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "l"(policy)
                 : "memory");
  }
}

// The walk's ring: per warp, kStages slots of (gradient row, table row) as this
// lane's 16-byte pieces; each lane copies and reads back only its own pieces,
// so cp.async.wait_group orders them (no barrier).
template <int U>
__device__ __forceinline__ uint4* RingSlot(uint4* ring, int stage, int part, int u, int lane) {
  return ring + ((stage * 2 + part) * U + u) * kWarp + lane;
}

// Window lane `at`'s copies (its gradient row; its table row when a row
// starts there and the dots are wanted) into ring stage `stage`, as one commit
// group, empty when `at` < 0: with one group committed per position walked,
// wait_group<kStages - 1> after issuing kStages - 1 positions ahead means "the
// position being walked has landed". Warp-uniform call.
template <typename T, int VEC, int U>
__device__ __forceinline__ void IssueCopies(const BackwardArgs& a, uint4* ring, int stage, int at, uint32_t my_row,
                                            uint32_t my_bag, unsigned fresh_rows, int lane, int64_t lane_col) {
  const uint32_t row = __shfl_sync(kFullMask, my_row, at & (kWarp - 1));
  const uint32_t bag = __shfl_sync(kFullMask, my_bag, at & (kWarp - 1));
  if (at >= 0) {
    const int64_t dim = a.bags.dim;
    const T* grad = static_cast<const T*>(a.grad) + static_cast<int64_t>(bag) * dim;
    const T* table = static_cast<const T*>(a.bags.table) + static_cast<int64_t>(row) * dim;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t col = lane_col + static_cast<int64_t>(u) * kWarp * VEC;
      if (col >= dim) continue;
      CopyAsync16As<L2Hints<T>::kKeepGradient ? 2 : 0>(RingSlot<U>(ring, stage, 0, u, lane), grad + col);
      if ((fresh_rows >> at) & 1u)
        CopyAsync16As<L2Hints<T>::kStreamOnce ? 1 : 0>(RingSlot<U>(ring, stage, 1, u, lane), table + col);
    }
  }
  CopyAsyncCommit();
}

// This lane's pieces of one slot's gradient (part 0) or table (1) row; zeros past dim.
template <typename T, int VEC, int U>
__device__ __forceinline__ void ReadSlot(uint4* ring, int stage, int part, int lane, int64_t lane_col, int64_t dim,
                                         RowTile<T, VEC, U>& tile) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int64_t col = lane_col + static_cast<int64_t>(u) * kWarp * VEC;
    if (col < dim) tile.v[u].raw = *RingSlot<U>(ring, stage, part, u, lane);
    else ZeroPack<T, VEC>(tile.v[u]);
  }
}

// The walk's state between windows (warp-uniform but the registers).
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
// Both walks below start each window with it.
struct WindowScan {
  int count;        // positions in the window (<= 32)
  uint32_t my_row;  // this lane's position's row
  uint32_t my_bag;
  EntryMeta meta;
  int64_t my_hi;    // where the row starting at this lane ends
  unsigned starts;  // lanes where a row starts (the walk's row excepted)
  unsigned longs;   // of those, rows longer than long_segment
  unsigned singles; // of those, rows of one entry left to SingleEntryRowsKernel (else 0)
};

__device__ __forceinline__ WindowScan ScanWindow(const BackwardArgs& a, int64_t cursor, int64_t end, int lane,
                                                 int64_t walk_row) {
  WindowScan s;
  s.count = static_cast<int>(min(static_cast<int64_t>(kWarp), end - cursor));
  const bool in = lane < s.count;
  s.my_row = in ? a.sorted_rows[cursor + lane] : 0u;
  s.meta = LoadEntryMeta(a, cursor + lane, in);
  s.my_bag = static_cast<uint32_t>(s.meta.bag);
  // The row at the window's last position may run on: its end from seg_begin.
  const uint32_t tail_row = __shfl_sync(kFullMask, s.my_row, s.count - 1);
  const int64_t tail_hi = a.seg_begin[tail_row + 1];
  uint32_t prev_row = __shfl_up_sync(kFullMask, s.my_row, 1);
  const bool starts_here = in && (lane == 0 ? static_cast<int64_t>(s.my_row) != walk_row : s.my_row != prev_row);
  s.starts = __ballot_sync(kFullMask, starts_here);
  // A row's end: the next start in the window, or the tail row's end.
  const unsigned later = lane == kWarp - 1 ? 0u : s.starts & (~0u << (lane + 1));
  s.my_hi = later != 0 ? cursor + __ffs(later) - 1 : tail_hi;
  s.longs = __ballot_sync(kFullMask, starts_here && s.my_hi - (cursor + lane) > a.long_segment);
  s.singles = __ballot_sync(kFullMask, a.single_entry_rows_done && starts_here && s.my_hi == cursor + lane + 1);
  return s;
}

// The entry at window lane `at` (gradient row g) into the walk's row sum, and
// its d_weights dot with the walk's table row when wanted.
template <typename T, int VEC, int U>
__device__ __forceinline__ void AddEntry(const BackwardArgs& a, const WindowScan& s, int at, int lane,
                                         bool want_dots, const RowTile<T, VEC, U>& g, Walk<T, VEC, U>& w) {
  const float coef = __shfl_sync(kFullMask, s.meta.coef, at);
  const float partial_dot = AddScaledRow<T, VEC, U>(coef, g, w.table, w.acc);
  if (want_dots) {
    const float dot = WarpSum(partial_dot);
    const uint32_t entry = __shfl_sync(kFullMask, s.meta.entry, at);
    if (lane == 0) StoreDot(a, entry, dot);
  }
}

// Sums the rows of one window, the next positions' rows in flight through the
// ring. Returns where the next window starts.
template <typename T, int VEC, int U>
__device__ int64_t WalkWindow(const BackwardArgs& a, int64_t cursor, int64_t end, int lane, int64_t lane_col,
                              Walk<T, VEC, U>& w, uint4* ring) {
  constexpr int kStages = PositionStages<U>();
  const int64_t dim = a.bags.dim;
  const WindowScan sc = ScanWindow(a, cursor, end, lane, w.row);
  const int count = sc.count;
  const uint32_t my_row = sc.my_row, my_bag = sc.my_bag;
  const unsigned starts = sc.starts, longs = sc.longs;
  const bool want_dots = a.dots != nullptr;
  // The positions walked: all but the rows of one entry another pass wrote.
  const unsigned live = (count == kWarp ? kFullMask : (1u << count) - 1u) & ~sc.singles;
  const unsigned fresh_rows = want_dots ? starts & live : 0u;  // whose table rows are copied
  unsigned to_issue = live, to_walk = live;
  int issued = 0;
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i, ++issued)
    IssueCopies<T, VEC, U>(a, ring, issued % kStages, PopLowest(&to_issue), my_row, my_bag, fresh_rows, lane,
                           lane_col);
  for (int walked = 0; to_walk != 0; ++walked, ++issued) {
    const int k = PopLowest(&to_walk);
    IssueCopies<T, VEC, U>(a, ring, issued % kStages, PopLowest(&to_issue), my_row, my_bag, fresh_rows, lane,
                           lane_col);
    CopyAsyncWait<kStages - 1>();
    const int stage = walked % kStages;
    if ((starts >> k) & 1u) {
      if (w.row >= 0) StoreRow<T, VEC, U>(a, w.row, lane_col, w.acc);
      ZeroAcc<VEC, U>(w.acc);
      w.row = __shfl_sync(kFullMask, my_row, k);
      w.long_row = (longs >> k) & 1u;
      if (want_dots) ReadSlot<T, VEC, U>(ring, stage, 1, lane, lane_col, dim, w.table);
      if (w.long_row) {
        w.hi = __shfl_sync(kFullMask, sc.my_hi, k);
        if (a.d_table != nullptr) AddPieces<VEC, U>(a, w.row, cursor + k, w.hi, lane_col, w.acc);
      }
    }
    if (!w.long_row) {
      RowTile<T, VEC, U> g;
      ReadSlot<T, VEC, U>(ring, stage, 0, lane, lane_col, dim, g);
      AddEntry<T, VEC, U>(a, sc, k, lane, want_dots, g, w);
    } else if (w.hi > cursor + k + 1) {  // inside a long row: jump to its end
      CopyAsyncWait<0>();  // copies still in flight would land in the next window's ring
      return w.hi;
    }
  }
  return cursor + count;
}

// WalkWindow with 2 positions' rows in registers instead of the ring (round 5's
// walk, no L2 hints), for 16-bit rows with at least as many entries as table
// rows (see kStageBytes). Same summation order: bitwise the same result.
template <typename T, int VEC, int U>
__device__ int64_t WalkWindowInRegisters(const BackwardArgs& a, int64_t cursor, int64_t end, int lane,
                                         int64_t lane_col, Walk<T, VEC, U>& w) {
  constexpr int kInFlight = 2;
  const int64_t dim = a.bags.dim;
  const WindowScan sc = ScanWindow(a, cursor, end, lane, w.row);
  const int count = sc.count;
  const uint32_t my_row = sc.my_row, my_bag = sc.my_bag;
  const unsigned starts = sc.starts, longs = sc.longs;
  const T* __restrict__ grad = static_cast<const T*>(a.grad);
  const T* __restrict__ table = static_cast<const T*>(a.bags.table);
  const bool want_dots = a.dots != nullptr;
  for (int k = 0; k < count; k += kInFlight) {
    RowTile<T, VEC, U> g[kInFlight], x[kInFlight];
#pragma unroll
    for (int j = 0; j < kInFlight; ++j) {  // every load of the batch first
      const int at = (k + j) & (kWarp - 1);
      const bool active = k + j < count;
      const uint32_t row = __shfl_sync(kFullMask, my_row, at);
      const uint32_t bag = __shfl_sync(kFullMask, my_bag, at);
      const bool fresh = active && ((starts >> at) & 1u);
      LoadTile<T, VEC, U>(grad + static_cast<int64_t>(bag) * dim, lane_col, dim, active, g[j]);
      LoadTile<T, VEC, U>(table + static_cast<int64_t>(row) * dim, lane_col, dim, fresh && want_dots, x[j]);
    }
#pragma unroll
    for (int j = 0; j < kInFlight; ++j) {
      const int at = k + j;
      if (at >= count) break;
      if ((starts >> at) & 1u) {
        if (w.row >= 0) StoreRow<T, VEC, U, false>(a, w.row, lane_col, w.acc);
        ZeroAcc<VEC, U>(w.acc);
        w.row = __shfl_sync(kFullMask, my_row, at);
        w.long_row = (longs >> at) & 1u;
        w.table = x[j];
        if (w.long_row) {
          w.hi = __shfl_sync(kFullMask, sc.my_hi, at);
          if (a.d_table != nullptr) AddPieces<VEC, U>(a, w.row, cursor + at, w.hi, lane_col, w.acc);
        }
      }
      if (w.long_row) continue;  // its dots came from the pieces pass
      AddEntry<T, VEC, U>(a, sc, at, lane, want_dots, g[j], w);
    }
    if (w.long_row && w.hi > cursor + k + kInFlight) return w.hi;  // inside a long row: jump to its end
  }
  return cursor + count;
}

// The rows that start in sorted positions [chunk * 32, chunk * 32 + 32).
template <typename T, int VEC, int U, bool kRing>
__device__ void GradientOfChunk(const BackwardArgs& a, int64_t chunk, int lane, uint4* ring) {
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
  // Rows of one entry (the next position's row differs) when SingleEntryRowsKernel wrote them.
  uint32_t next = __shfl_down_sync(kFullMask, my_row, 1);
  if (lane == kWarp - 1 && a.single_entry_rows_done)
    next = c0 + kWarp < n ? a.sorted_rows[c0 + kWarp] : static_cast<uint32_t>(num_rows);
  const unsigned walked = starts & ~__ballot_sync(kFullMask, a.single_entry_rows_done && next != my_row);
  if (walked == 0) return;
  const uint32_t last_row = __shfl_sync(kFullMask, my_row, 31 - __clz(walked));
  const int64_t end = a.seg_begin[last_row + 1];
  const int64_t lane_col = static_cast<int64_t>(lane) * VEC;
  Walk<T, VEC, U> w;
  ZeroAcc<VEC, U>(w.acc);
  for (int64_t cursor = c0 + __ffs(walked) - 1; cursor < end;) {
    if constexpr (kRing) cursor = WalkWindow<T, VEC, U>(a, cursor, end, lane, lane_col, w, ring);
    else cursor = WalkWindowInRegisters<T, VEC, U>(a, cursor, end, lane, lane_col, w);
  }
  StoreRow<T, VEC, U, kRing && L2Hints<T>::kStreamOnce>(a, w.row, lane_col, w.acc);
}

// Dense d_table: zeros into the untouched rows of [group * 32, group * 32 + 32).
template <typename T, int VEC, bool kStream>
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
      Store16<kStream>(out + col, zero.raw);
  }
}

// Warp g zeroes the untouched rows of [g * 32, g * 32 + 32), before the walk:
// tables with more rows than entries, where the zeros are most of d_table.
// Against zeroing them in the walk's launch (below), the H200 took 1.211 ->
// 1.161 ms for the bf16 huge-table backward (B=65536 K=32 D=256 N=4M), 2.223
// -> 2.176 fp32, 1.083 -> 1.040 bf16 at D=512 N=2M (round 11): the zeros'
// pure writes no longer mix with the walk's reads. Where entries outnumber
// rows it cost 2-3% (B=4096 K=128 N=256K: bf16 0.202 -> 0.208 ms) and gained
// under 1% (N=1M), so those keep the zeros in the walk's launch. Its stores
// are evict_first for every element size (fp32 too, unlike the walk's): fp32
// 1.976 -> 1.959 ms there, 16-bit the same (round 20); two or eight groups
// per warp, their starts loaded first, were 1-3% slower.
constexpr int kZeroThreads = 256;
template <typename T, int VEC>
__global__ void __launch_bounds__(kZeroThreads) UntouchedRowsKernel(BackwardArgs a, int64_t zero_groups) {
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * (kZeroThreads / kWarp) + threadIdx.x / kWarp;
  if (warp < zero_groups) ZeroUntouchedRows<T, VEC, true>(a, warp, threadIdx.x % kWarp);
}

// Warps [0, chunks) sum the rows starting in their chunk; warps [0,
// zero_groups) then zero their group's untouched rows (none where
// UntouchedRowsKernel ran). (On the H200, zeroing each gap between touched rows
// in the walk, so that d_table is written in row order, measured slower (round
// 8: 1.25 -> 1.33 ms bf16), as did interleaving the zero groups over all
// warps, zeros first or last (round 5; round 8: two groups per chunk warp,
// 1.19 -> 1.24 ms).)
template <typename T, int VEC, int U>
__global__ void __launch_bounds__(kPositionThreads, PKM_BWD_POSITION_MIN_BLOCKS)
    PositionsKernel(BackwardArgs a, int64_t chunks, int64_t zero_groups) {
  __shared__ uint4 rings[kPositionThreads / kWarp][PositionStages<U>() * 2 * U * kWarp];
  const int lane = threadIdx.x % kWarp;
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * (kPositionThreads / kWarp) + threadIdx.x / kWarp;
  if (warp < chunks) GradientOfChunk<T, VEC, U, true>(a, warp, lane, rings[threadIdx.x / kWarp]);
  if (warp < zero_groups) ZeroUntouchedRows<T, VEC, L2Hints<T>::kStreamOnce>(a, warp, lane);
}

// The same with WalkWindowInRegisters: 256-thread blocks, register caps as in
// round 5 (one vector per lane 64, 16-bit two vectors 128, fp32 two vectors 80).
constexpr int kRegisterWalkThreads = 256;
constexpr int RegisterWalkMinBlocks(int elem_bytes, int u) { return u == 1 ? 4 : (elem_bytes == 2 ? 2 : 3); }
template <typename T, int VEC, int U>
__global__ void __launch_bounds__(kRegisterWalkThreads, RegisterWalkMinBlocks(sizeof(T), U))
    PositionsKernelInRegisters(BackwardArgs a, int64_t chunks, int64_t zero_groups) {
  const int lane = threadIdx.x % kWarp;
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * (kRegisterWalkThreads / kWarp) + threadIdx.x / kWarp;
  if (warp < chunks) GradientOfChunk<T, VEC, U, false>(a, warp, lane, nullptr);
  if (warp < zero_groups) ZeroUntouchedRows<T, VEC, false>(a, warp, lane);
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
  int64_t zero_groups = dense ? (args.bags.num_rows + kWarp - 1) / kWarp : 0;
  if (max(chunks, zero_groups) / (kPositionThreads / kWarp) >= INT32_MAX)
    return SetInvalid("backward: too many rows for one launch");
  if (zero_groups > 0 && args.num_indices < args.bags.num_rows) {
    UntouchedRowsKernel<T, VEC><<<Blocks(zero_groups, kZeroThreads / kWarp), kZeroThreads, 0, stream>>>(
        args, zero_groups);
    if (int status = CheckLaunch("backward zeros of untouched rows")) return status;
    zero_groups = 0;
  }
  // Where most rows are untouched, most touched ones have one entry. Only the
  // ring walk (WalkWindow) skips them; the register walk below runs only where
  // entries are at least as many as rows, so never after this pass.
  BackwardArgs args_walk = args;
#ifndef PKM_BWD_NO_SINGLE_ENTRY_ROWS  // -D for an A/B against the walk alone
  if (args.num_indices < args.bags.num_rows && args.bags.num_bags > 0) {
    if (int status = LaunchSingleEntryRows(args, stream)) return status;
    args_walk.single_entry_rows_done = true;
  }
#endif
  const int64_t warps = max(chunks, zero_groups);
  if (warps == 0) return PKM_CUDA_OK;
  if constexpr (sizeof(T) == 2) {
    if (args.num_indices >= args.bags.num_rows) {
      PositionsKernelInRegisters<T, VEC, U><<<Blocks(warps, kRegisterWalkThreads / kWarp), kRegisterWalkThreads, 0,
                                              stream>>>(args_walk, chunks, zero_groups);
      return CheckLaunch("backward position pass");
    }
  }
  PositionsKernel<T, VEC, U><<<Blocks(warps, kPositionThreads / kWarp), kPositionThreads, 0, stream>>>(
      args_walk, chunks, zero_groups);
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
