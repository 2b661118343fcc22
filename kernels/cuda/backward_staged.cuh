// The row pass of backward_rows.cuh for wide vector rows (more than two
// 16-byte vectors per lane; used for fp32 dim > 256), with the
// upstream-gradient rows staged through shared memory by cp.async.
//
// Why: at the seed PKM shape (fp32 dim 1024, ~8 entries per row) RowsKernel
// holds each entry's 4 KB gradient row in registers (156+ of them per
// thread), so only ~12 warps fit on an SM, each with one row in flight, and
// the pass ran latency-bound. Here a warp keeps kStages gradient rows in
// flight in shared memory (48 KB per 4-warp block) without spending registers
// on them, across row boundaries, so the loads of a row's entries (and of the
// next row's) overlap its epilogue.
//
// A warp owns kRowsPerWarp consecutive table rows (one column tile) as in
// RowsKernel; their entries are walked in sorted-position order (long rows,
// summed by the pieces pass, are left out of the walk), and each row tile's
// gradient is summed `fmaf(coef, g, acc)` from 0 in position order and its
// dots formed exactly as AccumulateRange does: results are bitwise those of
// RowsKernel. Each lane copies and reads back only its own 16-byte slots of a
// stage, so no barrier is needed: cp.async.wait_group orders them per thread.
#ifndef PKM_KERNELS_CUDA_BACKWARD_STAGED_CUH_
#define PKM_KERNELS_CUDA_BACKWARD_STAGED_CUH_

#include "kernels/cuda/backward.cuh"

namespace pkm_cuda {

constexpr int kStagedThreads = 128;
constexpr int kStagedWarps = kStagedThreads / kWarp;
// Bytes of staged gradient per warp: 12 KB, so a block's 48 KB is static
// shared memory. Resident blocks asked for: fp32 rows (8 vectors of
// accumulators and of the table row per lane) need ~160 registers, so three;
// 16-bit rows (not launched: see LaunchRowPassesAs) would fit four.
constexpr int kStagedBytesPerWarp = 12 * 1024;
#ifndef PKM_BWD_STAGED_MIN_BLOCKS_F32
#define PKM_BWD_STAGED_MIN_BLOCKS_F32 3
#endif
__host__ __device__ constexpr int StagedMinBlocks(int elem_bytes) {
  return elem_bytes == 4 ? PKM_BWD_STAGED_MIN_BLOCKS_F32 : 4;
}

// 16 bytes global -> shared, cached in L2 only (.cg): a gradient row is reused
// by the warps of other rows, through L2.
__device__ __forceinline__ void CopyAsync16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void CopyAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void CopyAsyncWait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// The warp's walk: the entries of its short rows, numbered 0.. in sorted-
// position order ("steps"). Lane i (i <= rows) holds row i's seg_begin and
// first step (lane rows: the group's end), read back by shuffles: arrays
// indexed by a loop variable would live in local memory.
struct StagedWalk {
  int32_t seg;    // positions < 2^31 (MakeLayout)
  int32_t start;
  int rows;

  __device__ __forceinline__ int32_t Seg(int r) const { return __shfl_sync(kFullMask, seg, r); }
  __device__ __forceinline__ int32_t Start(int r) const { return __shfl_sync(kFullMask, start, r); }

  // Sorted position of this lane's step s (valid when s < Start(rows)).
  __device__ __forceinline__ int64_t Position(int64_t s) const {
    int64_t pos = Seg(0) + s;
#pragma unroll
    for (int i = 1; i < kRowsPerWarp; ++i) {
      const int32_t first = Start(i), at = Seg(i);
      if (i < rows && s >= first) pos = at + (s - first);
    }
    return pos;
  }
};

// The walk of the kRowsPerWarp rows from first_row.
__device__ __forceinline__ StagedWalk MakeWalk(const BackwardArgs& a, int64_t num_rows, int64_t first_row, int lane) {
  StagedWalk w;
  w.rows = static_cast<int>(min(num_rows - first_row, kRowsPerWarp));
  w.seg = lane <= w.rows ? static_cast<int32_t>(a.seg_begin[first_row + lane]) : 0;
  // Row `lane`'s step count (long rows: none), then an exclusive scan over the lanes.
  const int32_t len = __shfl_down_sync(kFullMask, w.seg, 1) - w.seg;
  const int32_t own = lane < w.rows && len <= a.long_segment ? len : 0;
  int32_t sum = own;
#pragma unroll
  for (int d = 1; d <= kRowsPerWarp; d *= 2) {
    const int32_t up = __shfl_up_sync(kFullMask, sum, d);
    if (lane >= d) sum += up;
  }
  w.start = sum - own;
  return w;
}

// This lane's columns of table row `row` (zeros when the dots are not wanted).
template <typename T, int VEC, int U>
__device__ __forceinline__ void LoadTableRow(const BackwardArgs& a, int64_t row, int64_t dim, int64_t lane_col,
                                             bool want_dots, float (&x)[U][VEC]) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int64_t col = lane_col + static_cast<int64_t>(u) * kWarp * VEC;
    if (want_dots && col < dim) {
      LoadFloats<T, VEC>(static_cast<const T*>(a.bags.table) + row * dim + col, x[u]);
    } else {
#pragma unroll
      for (int v = 0; v < VEC; ++v) x[u][v] = 0.f;
    }
  }
}

// Metadata of the 32 steps [base, base + 32): lane i holds step base + i.
__device__ __forceinline__ EntryMeta LoadStepMeta(const BackwardArgs& a, const StagedWalk& w, int64_t steps,
                                                  int64_t base, int lane) {
  const int64_t s = base + lane;
  const int64_t pos = w.Position(s);
  return LoadEntryMeta(a, s < steps ? pos : 0, s < steps);
}

// Starts the copy of step s's gradient row tile (its bag from the meta windows
// of steps [base, base + 64)) into stage slot; commits a (maybe empty) group.
template <typename T, int VEC, int U>
__device__ __forceinline__ void StageStep(const BackwardArgs& a, int64_t s, int64_t steps, int64_t base,
                                          const EntryMeta& cur, const EntryMeta& next, int64_t lane_col,
                                          uint4* slot, int lane) {
  const int64_t window_bag = s - base < kWarp ? cur.bag : next.bag;  // warp-uniform choice
  const int64_t bag = __shfl_sync(kFullMask, window_bag, static_cast<int>((s - base) % kWarp));
  if (s < steps) {
    const T* grad = static_cast<const T*>(a.grad) + bag * a.bags.dim;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t col = lane_col + static_cast<int64_t>(u) * kWarp * VEC;
      if (col < a.bags.dim) CopyAsync16(slot + u * kWarp + lane, grad + col);
    }
  }
  CopyAsyncCommit();
}

template <typename T, int VEC, int U, class Epilogue>
__global__ void __launch_bounds__(kStagedThreads, StagedMinBlocks(sizeof(T)))
    StagedRowsKernel(BackwardArgs a, Epilogue epilogue) {
  constexpr int kSlotBytes = U * kWarp * 16;
  constexpr int kStages = kStagedBytesPerWarp / kSlotBytes;
  static_assert(kStages >= 2 && VEC * sizeof(T) == 16, "staged rows: 16-byte vectors, two stages or more");
  __shared__ uint4 stage[kStagedWarps][kStages][U * kWarp];
  const int lane = threadIdx.x % kWarp;
  const int warp_in_block = threadIdx.x / kWarp;
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * kStagedWarps + warp_in_block;
  const int64_t num_rows = a.bags.num_rows;
  const int64_t row_groups = (num_rows + kRowsPerWarp - 1) / kRowsPerWarp;
  if (warp >= row_groups * a.tiles) return;
  const int64_t first_row = (warp / a.tiles) * kRowsPerWarp;
  const int64_t tile = warp % a.tiles;
  const int64_t lane_col = tile * kTileCols + static_cast<int64_t>(lane) * VEC;
  const int64_t dim = a.bags.dim;
  const bool wants_gradient = epilogue.WantsGradient(a);
  const bool want_dots = a.dots != nullptr;

  const StagedWalk w = MakeWalk(a, num_rows, first_row, lane);
  const int64_t steps = w.Start(w.rows);

  uint4(*slots)[U * kWarp] = stage[warp_in_block];
  int64_t base = 0;  // meta windows: cur = steps [base, base + 32), next = the 32 after
  EntryMeta cur = LoadStepMeta(a, w, steps, 0, lane);
  EntryMeta next = LoadStepMeta(a, w, steps, kWarp, lane);
#pragma unroll
  for (int s = 0; s < kStages; ++s) StageStep<T, VEC, U>(a, s, steps, base, cur, next, lane_col, slots[s], lane);

  int64_t s = 0;  // next step to consume
  for (int r = 0; r < w.rows; ++r) {
    const int64_t row = first_row + r;
    const int64_t lo = w.Seg(r), hi = w.Seg(r + 1), row_end_step = w.Start(r + 1);
    float acc[U][VEC];
    ZeroAcc<VEC, U>(acc);
    if (hi - lo > a.long_segment) {
      if (wants_gradient) AddPieces<VEC, U>(a, row, lo, hi, lane_col, acc);
    } else if (hi > lo) {
      float x[U][VEC];  // the table row, for the dots
      LoadTableRow<T, VEC, U>(a, row, dim, lane_col, want_dots, x);
      for (; s < row_end_step; ++s) {
        if (s - base == kWarp) {  // slide the meta windows
          base += kWarp;
          cur = next;
          next = LoadStepMeta(a, w, steps, base + kWarp, lane);
        }
        const int k = static_cast<int>(s - base);
        const float coef = __shfl_sync(kFullMask, cur.coef, k);
        const uint32_t entry = __shfl_sync(kFullMask, cur.entry, k);
        CopyAsyncWait<kStages - 1>();
        const uint4* slot = slots[s % kStages];
        float partial_dot = 0.f;
#pragma unroll
        for (int u = 0; u < U; ++u) {
          Pack<T, VEC> pack;
          pack.raw = slot[u * kWarp + lane];
          const int64_t col = lane_col + static_cast<int64_t>(u) * kWarp * VEC;
#pragma unroll
          for (int v = 0; v < VEC; ++v) {
            const float g = col < dim ? ToFloat<T>(pack.elems[v]) : 0.f;
            acc[u][v] = fmaf(coef, g, acc[u][v]);
            partial_dot = fmaf(g, x[u][v], partial_dot);
          }
        }
        // The slot's values are in registers (acc used them): refill it.
        StageStep<T, VEC, U>(a, s + kStages, steps, base, cur, next, lane_col, slots[s % kStages], lane);
        if (want_dots) {
          const float dot = WarpSum(partial_dot);
          if (lane == 0) a.dots[tile * a.num_indices + entry] = dot;
        }
      }
    }
    epilogue.template Apply<T, VEC, U>(a, row, lane_col, hi > lo, acc);
  }
  CopyAsyncWait<0>();
}

}  // namespace pkm_cuda

#endif  // PKM_KERNELS_CUDA_BACKWARD_STAGED_CUH_
