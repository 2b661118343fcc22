// The per-row gradient pass of the CUDA backward (phases 3-4 of backward.cuh),
// generic over what happens to each row tile's gradient once it is summed:
// the epilogue (store it: backward_rows.cu; apply an optimizer update to the
// table in place: fused_optimizer.cu). An epilogue is a struct with
//   bool WantsGradient(const BackwardArgs&)  — whether long rows need their
//        piece sums added (false: only the dots are wanted);
//   template <T, VEC, U> void Apply(a, row, lane_col, touched, acc) — called
//        by every lane of the warp (warp-uniform `touched`: the row has entries).
#ifndef PKM_KERNELS_CUDA_BACKWARD_ROWS_CUH_
#define PKM_KERNELS_CUDA_BACKWARD_ROWS_CUH_

#include "kernels/cuda/backward.cuh"
#include "kernels/cuda/backward_staged.cuh"

namespace pkm_cuda {

// One warp per (piece, tile): the parts of long rows inside sorted positions
// [piece * L, piece * L + L). A range of L positions meets at most two rows
// longer than L: the one at its first position and the one at its last.
template <typename T, int VEC, int U, bool kMax>
__global__ void __launch_bounds__(RowPassThreads(sizeof(T)), MinBlocks(VEC, U, sizeof(T)))
    PiecesKernel(BackwardArgs a, int64_t pieces) {
  const int lane = threadIdx.x % kWarp;
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * (RowPassThreads(sizeof(T)) / kWarp) + threadIdx.x / kWarp;
  if (warp >= pieces * a.tiles) return;
  const int64_t piece = warp / a.tiles;
  const int64_t tile = warp % a.tiles;
  const int64_t L = a.long_segment;
  const int64_t s_begin = piece * L;
  const int64_t s_end = min(a.num_indices, s_begin + L);
  const int64_t dim = a.bags.dim;
  const uint32_t first_row = a.sorted_rows[s_begin];
  for (int slot = 0; slot < 2; ++slot) {
    const uint32_t row = a.sorted_rows[slot == 0 ? s_begin : s_end - 1];
    bool use = row < a.bags.num_rows && (slot == 0 || row != first_row);
    int64_t lo = 0, hi = 0;
    if (use) {
      lo = a.seg_begin[row];
      hi = a.seg_begin[row + 1];
      use = hi - lo > L;
    }
    if (tile == 0 && lane == 0) a.piece_row[2 * piece + slot] = use ? static_cast<int32_t>(row) : -1;
    if (!use) continue;
    float acc[U][VEC];
    ZeroAcc<VEC, U>(acc);
    const int64_t r0 = max(lo, s_begin), r1 = min(hi, s_end);
    AccumulateRange<T, VEC, U, kMax>(a, row, r0, r1, tile, lane, LoadEntryMeta(a, r0 + lane, r0 + lane < r1), acc);
    float* out = a.piece_sum + (2 * piece + slot) * dim;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t col = tile * kTileCols + static_cast<int64_t>(lane) * VEC + u * kWarp * VEC;
#pragma unroll
      for (int v = 0; v < VEC; ++v)
        if (col + v < dim) out[col + v] = acc[u][v];
    }
    // The position pass stores d_weights itself (a.d_weights; one tile) but
    // for long rows, whose dots lane 0 just wrote.
    if (a.d_weights != nullptr) {
      __syncwarp();
      for (int64_t pos = r0 + lane; pos < r1; pos += kWarp) {
        const uint32_t entry = a.sorted_entries[pos];
        StoreWeight(a.d_weights, a.bags.weights_type, entry, 0.f + a.dots[entry]);
      }
    }
  }
}


// One row tile of the row pass: sum its entries (or add its pieces) and hand
// the gradient to the epilogue.
template <typename T, int VEC, int U, bool kMax, class Epilogue>
__device__ __forceinline__ void RowStep(const BackwardArgs& a, const Epilogue& epilogue, int64_t row, int64_t lo,
                                        int64_t hi, int64_t tile, int lane, int64_t lane_col, bool wants_gradient,
                                        const EntryMeta& meta) {
  float acc[U][VEC];
  ZeroAcc<VEC, U>(acc);
  if (hi - lo <= a.long_segment) {
    AccumulateRange<T, VEC, U, kMax>(a, row, lo, hi, tile, lane, meta, acc);
  } else if (wants_gradient) {
    AddPieces<VEC, U>(a, row, lo, hi, lane_col, acc);
  }
  epilogue.template Apply<T, VEC, U>(a, row, lane_col, hi > lo, acc);
}

// One warp per (kRowsPerWarp consecutive table rows, tile): each row tile's
// gradient is summed once and handed to the epilogue. While a row is summed,
// the next row's segment bounds and first entries are already being fetched.
template <typename T, int VEC, int U, bool kMax, class Epilogue>
__global__ void __launch_bounds__(RowPassThreads(sizeof(T)), MinBlocks(VEC, U, sizeof(T)))
    RowsKernel(BackwardArgs a, Epilogue epilogue) {
  const int lane = threadIdx.x % kWarp;
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * (RowPassThreads(sizeof(T)) / kWarp) + threadIdx.x / kWarp;
  const int64_t num_rows = a.bags.num_rows;
  const int64_t row_groups = (num_rows + kRowsPerWarp - 1) / kRowsPerWarp;
  if (warp >= row_groups * a.tiles) return;
  const int64_t first_row = (warp / a.tiles) * kRowsPerWarp;
  const int64_t last_row = min(num_rows, first_row + kRowsPerWarp);
  const int64_t tile = warp % a.tiles;
  const int64_t lane_col = tile * kTileCols + static_cast<int64_t>(lane) * VEC;
  const bool wants_gradient = epilogue.WantsGradient(a);
  if constexpr (U <= 2) {
    // Narrow rows: the group's segment bounds in one load (lane i holds
    // seg_begin[first_row + i]).
    const int group_rows = static_cast<int>(last_row - first_row);
    const uint32_t my_seg = lane <= group_rows ? a.seg_begin[first_row + lane] : 0u;
    int64_t lo = __shfl_sync(kFullMask, my_seg, 0);
    int64_t hi = __shfl_sync(kFullMask, my_seg, 1);
    EntryMeta meta = LoadEntryMeta(a, lo + lane, lo + lane < hi);
    for (int r = 0; r < group_rows; ++r) {
      int64_t next_hi = hi;
      EntryMeta next_meta{0u, 0, 0.f};
      if (r + 1 < group_rows) {
        next_hi = __shfl_sync(kFullMask, my_seg, r + 2);
        next_meta = LoadEntryMeta(a, hi + lane, hi + lane < next_hi);
      }
      RowStep<T, VEC, U, kMax>(a, epilogue, first_row + r, lo, hi, tile, lane, lane_col, wants_gradient, meta);
      lo = hi;
      hi = next_hi;
      meta = next_meta;
    }
  } else {
    // Wide rows: the bounds row by row (the H200 run found this faster there).
    int64_t lo = a.seg_begin[first_row];
    int64_t hi = a.seg_begin[first_row + 1];
    EntryMeta meta = LoadEntryMeta(a, lo + lane, lo + lane < hi);
    for (int64_t row = first_row; row < last_row; ++row) {
      int64_t next_hi = hi;
      EntryMeta next_meta{0u, 0, 0.f};
      if (row + 1 < last_row) {
        next_hi = a.seg_begin[row + 2];
        next_meta = LoadEntryMeta(a, hi + lane, hi + lane < next_hi);
      }
      RowStep<T, VEC, U, kMax>(a, epilogue, row, lo, hi, tile, lane, lane_col, wants_gradient, meta);
      lo = hi;
      hi = next_hi;
      meta = next_meta;
    }
  }
}

// The pieces pass (when there are long rows), then the row pass.
template <typename T, int VEC, int U, bool kMax, class Epilogue>
int LaunchRowPassesAs(const BackwardArgs& args, int64_t pieces, const Epilogue& epilogue, cudaStream_t stream) {
  constexpr int kThreads = RowPassThreads(sizeof(T));
  if (pieces > 0) {
    const int64_t warps = pieces * args.tiles;
    if (warps / (kThreads / kWarp) >= INT32_MAX) return SetInvalid("backward: too many pieces for one launch");
    PiecesKernel<T, VEC, U, kMax><<<Blocks(warps, kThreads / kWarp), kThreads, 0, stream>>>(args, pieces);
    if (int status = CheckLaunch("backward pieces pass")) return status;
  }
  const int64_t warps = (args.bags.num_rows + kRowsPerWarp - 1) / kRowsPerWarp * args.tiles;
  if (warps / (kThreads / kWarp) >= INT32_MAX) return SetInvalid("backward: too many table rows for one launch");
  if (warps == 0) return PKM_CUDA_OK;
#ifndef PKM_BWD_NO_STAGED  // -D for an A/B against RowsKernel alone
  // Wide fp32 vector rows: gradient rows staged by cp.async. 16-bit rows keep
  // RowsKernel (the H200 run: seed bf16 backward 1.42 -> 1.51 ms staged).
  if constexpr (!kMax && VEC > 1 && U > 2 && sizeof(T) == 4) {
    static const bool carveout = cudaFuncSetAttribute(StagedRowsKernel<T, VEC, U, Epilogue>,
                                                      cudaFuncAttributePreferredSharedMemoryCarveout,
                                                      cudaSharedmemCarveoutMaxShared) == cudaSuccess;
    (void)carveout;  // a hint: without it the kernel still runs, maybe with fewer blocks per SM
    StagedRowsKernel<T, VEC, U, Epilogue><<<Blocks(warps, kStagedWarps), kStagedThreads, 0, stream>>>(args, epilogue);
    return CheckLaunch("backward row pass (staged)");
  }
#endif
  RowsKernel<T, VEC, U, kMax, Epilogue><<<Blocks(warps, kThreads / kWarp), kThreads, 0, stream>>>(args, epilogue);
  return CheckLaunch("backward row pass");
}

// 16-byte vectors where dim and every pointer allow, else scalar accesses.
template <typename T, class Epilogue>
int LaunchRowPasses(const BackwardArgs& args, int64_t pieces, const Epilogue& epilogue, bool aligned,
                    cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const bool vector_ok = aligned && args.bags.dim % kVec == 0 && Aligned16(args.bags.table) && Aligned16(args.grad);
  constexpr int kU = kTileCols / (kWarp * kVec);
  const bool max = args.max_entry != nullptr;
  // Narrow rows (one tile of 1 or 2 vectors per lane: fp32 dim <= 128 / 256,
  // 16-bit dim <= 256 / 512) get kernels with fewer registers and so more
  // resident warps: the row pass is latency-bound (huge tables of short rows).
  if (vector_ok && args.bags.dim <= kWarp * kVec)
    return max ? LaunchRowPassesAs<T, kVec, 1, true>(args, pieces, epilogue, stream)
               : LaunchRowPassesAs<T, kVec, 1, false>(args, pieces, epilogue, stream);
  if (vector_ok && args.bags.dim <= kWarp * kVec * 2)
    return max ? LaunchRowPassesAs<T, kVec, 2, true>(args, pieces, epilogue, stream)
               : LaunchRowPassesAs<T, kVec, 2, false>(args, pieces, epilogue, stream);
  if (vector_ok)
    return max ? LaunchRowPassesAs<T, kVec, kU, true>(args, pieces, epilogue, stream)
               : LaunchRowPassesAs<T, kVec, kU, false>(args, pieces, epilogue, stream);
  return max ? LaunchRowPassesAs<T, 1, kTileCols / kWarp, true>(args, pieces, epilogue, stream)
             : LaunchRowPassesAs<T, 1, kTileCols / kWarp, false>(args, pieces, epilogue, stream);
}

}  // namespace pkm_cuda

#endif  // PKM_KERNELS_CUDA_BACKWARD_ROWS_CUH_
