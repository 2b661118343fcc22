// Rows of a table gradient with exactly one entry, written by bag before the
// position walk (backward_positions.cu), which then skips them.
#include "kernels/cuda/backward_positions.cuh"

namespace pkm_cuda {
namespace {

// Rows with exactly one entry, by bag: a warp reads its bag's gradient row
// once and writes coef * gradient as the row gradient of each entry whose row
// no other entry references (and that entry's dot), where the walk would read
// the gradient row again for every entry. With more table rows than entries
// most touched rows are such (B*K = 2M over 4M rows: 77% of them, 60% of the
// entries). Each is the walk's sum of one entry, fmaf(coef, g, 0), and the
// same dot (AddEntry's order): bitwise what the walk would store. H200, round
// 20 (bench/results/gpu_round20_h200_notes.md), graph-replayed dense backward
// with d_weights: B=65536 K=32 D=256 N=4M fp32 2.18 -> 1.97 ms, bf16 1.157 ->
// 1.150 (its walk was bound by L2 throughput, not the gradient's re-reads),
// D=512 N=2M bf16 1.038 -> 1.003; row-sparse fp32 1.70 -> 1.59 ms. Table
// rows in flight per warp: 4; 2 or 8 measured the same for dense fp32, up to
// 2% slower for dense bf16, and 8 was 7% slower row-sparse.
#ifndef PKM_BWD_SINGLE_ROWS_IN_FLIGHT  // -D for an A/B
#define PKM_BWD_SINGLE_ROWS_IN_FLIGHT 4
#endif
constexpr int kSingleRowsInFlight = PKM_BWD_SINGLE_ROWS_IN_FLIGHT;
template <typename T, int VEC, int U, typename IdxT>
__global__ void __launch_bounds__(kBackwardThreads) SingleEntryRowsKernel(BackwardArgs a) {
  const int64_t bag = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
  if (bag >= a.bags.num_bags) return;
  const int lane = threadIdx.x % kWarp;
  const int64_t dim = a.bags.dim, num_rows = a.bags.num_rows;
  const int64_t lane_col = static_cast<int64_t>(lane) * VEC;
  const bool want_dots = a.dots != nullptr;
  int64_t begin, end;
  BagRange(a.bags, a.num_indices, bag, &begin, &end);
  if (begin == end) return;
  RowTile<T, VEC, U> g;
  LoadTile<T, VEC, U>(static_cast<const T*>(a.grad) + bag * dim, lane_col, dim, true, g);
  const float bag_scale = a.bag_scale ? a.bag_scale[bag] : 1.f;
  for (int64_t chunk = begin; chunk < end; chunk += kWarp) {
    const int64_t entry = chunk + lane;
    int64_t row = -1;
    if (entry < end) {
      const int64_t idx = static_cast<int64_t>(static_cast<const IdxT*>(a.bags.indices)[entry]);
      if (idx >= 0 && idx < num_rows && a.seg_begin[idx + 1] - a.seg_begin[idx] == 1u) row = idx;
    }
    float coef = 0.f;
    if (row >= 0) coef = (a.bags.weights ? LoadWeight(a.bags.weights, a.bags.weights_type, entry) : 1.f) * bag_scale;
    unsigned pending = __ballot_sync(kFullMask, row >= 0);
    const bool mine = row >= 0;
    float my_dot = 0.f;
    while (pending != 0) {
      int at[kSingleRowsInFlight];
      RowTile<T, VEC, U> x[kSingleRowsInFlight];
#pragma unroll
      for (int j = 0; j < kSingleRowsInFlight; ++j) {  // every table row of the batch first
        at[j] = PopLowest(&pending);
        const int64_t r = __shfl_sync(kFullMask, row, at[j] & (kWarp - 1));
        LoadTile<T, VEC, U>(static_cast<const T*>(a.bags.table) + (at[j] >= 0 ? r : 0) * dim, lane_col, dim,
                            at[j] >= 0 && want_dots, x[j]);
      }
#pragma unroll
      for (int j = 0; j < kSingleRowsInFlight; ++j) {
        if (at[j] < 0) break;
        const int64_t r = __shfl_sync(kFullMask, row, at[j]);
        const float c = __shfl_sync(kFullMask, coef, at[j]);
        float acc[U][VEC];
        ZeroAcc<VEC, U>(acc);
        const float partial_dot = AddScaledRow<T, VEC, U>(c, g, x[j], acc);
        StoreRow<T, VEC, U>(a, r, lane_col, acc);
        if (want_dots) {
          const float dot = WarpSum(partial_dot);
          if (lane == at[j]) my_dot = dot;
        }
      }
    }
    if (want_dots && mine) StoreDot(a, static_cast<uint32_t>(entry), my_dot);
  }
}

template <typename T, int VEC, int U>
int LaunchAs(const BackwardArgs& args, cudaStream_t stream) {
  const unsigned blocks = Blocks(args.bags.num_bags, kWarpsPerBlock);
  if (args.bags.indices_int64)
    SingleEntryRowsKernel<T, VEC, U, int64_t><<<blocks, kBackwardThreads, 0, stream>>>(args);
  else
    SingleEntryRowsKernel<T, VEC, U, int32_t><<<blocks, kBackwardThreads, 0, stream>>>(args);
  return CheckLaunch("backward rows of one entry");
}

// The position walk's vectors: one or two 16-byte vectors per lane.
template <typename T>
int LaunchFor(const BackwardArgs& args, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  if (args.bags.dim <= kWarp * kVec) return LaunchAs<T, kVec, 1>(args, stream);
  return LaunchAs<T, kVec, 2>(args, stream);
}

}  // namespace

int LaunchSingleEntryRows(const BackwardArgs& args, cudaStream_t stream) {
  if (args.bags.num_bags / kWarpsPerBlock >= INT32_MAX) return SetInvalid("backward: too many bags for one launch");
  switch (args.bags.elem_type) {
    case PKM_FLOAT16: return LaunchFor<__half>(args, stream);
    case PKM_BFLOAT16: return LaunchFor<__nv_bfloat16>(args, stream);
    default: return LaunchFor<float>(args, stream);
  }
}

}  // namespace pkm_cuda
