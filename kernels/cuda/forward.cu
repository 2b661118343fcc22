// EmbeddingBag forward on the GPU: kSplit warps per (bag, column tile).
//
// Each lane keeps U vectors of VEC columns (16-byte loads), so a warp covers
// 32 * VEC * U contiguous columns of every row it gathers. The bag's indices
// and weights are fetched 32 at a time (one per lane) and broadcast with
// shuffles; rows are loaded kRowsInFlight at a time, kept as raw 16-byte packs
// (half the registers of floats for 16-bit rows) and only then accumulated, so
// each lane keeps kRowsInFlight * U independent 16-byte loads in flight.
// Accumulation is float32; the combiner's scale is computed on the fly from
// the same weights. With kSplit > 1 (small batches: too few (bag, tile) pairs
// to fill the GPU) the kSplit warps of a group take every kSplit-th chunk of 32
// entries and warp 0 of the group adds the others' partial sums in warp order
// through shared memory: a fixed order, so results stay bitwise reproducible.
#include <algorithm>
#include <cstdio>
#include <string>

#include "kernels/cuda/common.cuh"

namespace pkm_cuda {
namespace {

constexpr int kForwardThreads = 256;
constexpr int kForwardWarps = kForwardThreads / kWarp;
// With one vector per lane (narrow tiles) twice as many rows are in flight, so
// every lane still keeps 8 loads outstanding.
#ifndef PKM_FWD_ROWS_IN_FLIGHT_U1
#define PKM_FWD_ROWS_IN_FLIGHT_U1 8
#endif
__host__ __device__ constexpr int RowsInFlight(int u) { return u == 1 ? PKM_FWD_ROWS_IN_FLIGHT_U1 : 4; }
constexpr int kDefaultForwardVecsPerLane = 2;
// Below this many warps the default drops to one vector per lane (twice the
// warps) and then splits bags over several warps: small batches are
// latency-bound, not bandwidth-bound. 132 SMs x 64 resident warps.
constexpr int64_t kFewWarps = 132 * 64;
constexpr int kMaxSplit = 4;

// The max combiner's step: NaN propagates (fmaxf would drop it), as the CPU's.
__device__ __forceinline__ float MaxKeepingNaN(float acc, float x) { return x > acc || x != x ? x : acc; }

template <typename T, int VEC, int U, int R, bool kMax>
__device__ __forceinline__ void AccumulateRows(const T* __restrict__ table, int64_t dim, int64_t lane_col,
                                               int64_t my_row, float my_weight, int count, float (&acc)[U][VEC]) {
  // count <= 32 and R divides 32, so k + j never leaves the warp; lanes past
  // `count` hold row -1.
  for (int k = 0; k < count; k += R) {
    Pack<T, VEC> rows[R][U];
    float weight[R];
    bool valid[R];
#pragma unroll
    for (int j = 0; j < R; ++j) {
      const int64_t row = __shfl_sync(kFullMask, my_row, k + j);
      weight[j] = __shfl_sync(kFullMask, my_weight, k + j);
      valid[j] = row >= 0;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t col = lane_col + static_cast<int64_t>(u) * kWarp * VEC;
        if (row >= 0 && col < dim) {
          LoadPack<T, VEC>(table + row * dim + col, rows[j][u]);
        } else {
          ZeroPack<T, VEC>(rows[j][u]);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < R; ++j) {
      if (kMax && !valid[j]) continue;  // padding: not a candidate
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int v = 0; v < VEC; ++v) {
          const float x = ToFloat<T>(rows[j][u].elems[v]);
          acc[u][v] = kMax ? MaxKeepingNaN(acc[u][v], x) : fmaf(weight[j], x, acc[u][v]);
        }
    }
  }
}

// Warp 0 of a split group: acc and the weight sums += the other warps' (in
// warp order); partial[warp][lane][U * VEC + 2] in shared memory.
template <int VEC, int U, int kSplit, bool kMax>
__device__ __forceinline__ void CombineSplit(float* partial, int group_warp0, int part, int lane, float (&acc)[U][VEC],
                                             float* weight_sum, float* weight_sq_sum) {
  constexpr int kStride = U * VEC + 2;
  float* mine = partial + ((group_warp0 + part) * kWarp + lane) * kStride;
  if (part != 0) {
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int v = 0; v < VEC; ++v) mine[u * VEC + v] = acc[u][v];
    mine[U * VEC] = *weight_sum;
    mine[U * VEC + 1] = *weight_sq_sum;
  }
  __syncthreads();
  if (part != 0) return;
#pragma unroll
  for (int s = 1; s < kSplit; ++s) {
    const float* other = mine + s * kWarp * kStride;
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int v = 0; v < VEC; ++v)
        acc[u][v] = kMax ? MaxKeepingNaN(acc[u][v], other[u * VEC + v]) : acc[u][v] + other[u * VEC + v];
    *weight_sum += other[U * VEC];
    *weight_sq_sum += other[U * VEC + 1];
  }
}

// kMax: elementwise max over the bag's valid rows (an empty bag gives 0)
// instead of the weighted sum.
// 16-bit rows with two vectors per lane: capped at 64 registers (4 blocks of
// 256 per SM), which the H200 run found 6-7% faster there (seed bf16, 1 KB
// bf16 rows) and slower for the other shapes.
__host__ __device__ constexpr int ForwardMinBlocks(int elem_bytes, int u) { return elem_bytes == 2 && u == 2 ? 4 : 1; }

template <typename T, typename IdxT, int VEC, int U, int kSplit, bool kMax>
__global__ void __launch_bounds__(kForwardThreads, ForwardMinBlocks(sizeof(T), U))
    ForwardKernel(PkmBags bags, int64_t num_indices, int64_t tiles, T* __restrict__ out) {
  constexpr int kTileCols = kWarp * VEC * U;
  const int lane = threadIdx.x % kWarp;
  const int warp_in_block = threadIdx.x / kWarp;
  const int part = warp_in_block % kSplit;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * (kForwardWarps / kSplit) + warp_in_block / kSplit;
  // A split group's warps meet at a barrier: none of them may return early.
  const bool active = item < bags.num_bags * tiles;
  if (kSplit == 1 && !active) return;
  const int64_t bag = active ? item / tiles : 0;
  const int64_t tile = item % tiles;
  const int64_t dim = bags.dim;
  const int64_t lane_col = tile * kTileCols + static_cast<int64_t>(lane) * VEC;
  const T* __restrict__ table = static_cast<const T*>(bags.table);
  const IdxT* __restrict__ indices = static_cast<const IdxT*>(bags.indices);

  int64_t begin = 0, end = 0;
  if (active) BagRange(bags, num_indices, bag, &begin, &end);

  float acc[U][VEC];
#pragma unroll
  for (int u = 0; u < U; ++u)
#pragma unroll
    for (int v = 0; v < VEC; ++v) acc[u][v] = kMax ? -INFINITY : 0.f;
  float weight_sum = 0.f, weight_sq_sum = 0.f;  // lane-partial, valid entries only

  for (int64_t chunk = begin + part * kWarp; chunk < end; chunk += kSplit * kWarp) {
    const int count = static_cast<int>(min(static_cast<int64_t>(kWarp), end - chunk));
    int64_t my_row = -1;  // -1: padding, out of range, or past the chunk
    float my_weight = 0.f;
    if (lane < count) {
      my_row = LoadEntryRow<IdxT>(bags, indices, chunk + lane, tile == 0);
      if (my_row >= 0) {
        my_weight = bags.weights ? LoadWeight(bags.weights, bags.weights_type, chunk + lane) : 1.f;
        weight_sum += my_weight;
        weight_sq_sum += my_weight * my_weight;
      }
    }
    AccumulateRows<T, VEC, U, RowsInFlight(U), kMax>(table, dim, lane_col, my_row, my_weight, count, acc);
  }

  weight_sum = WarpSum(weight_sum);
  weight_sq_sum = WarpSum(weight_sq_sum);
  if constexpr (kSplit > 1) {
    __shared__ float partial[kForwardWarps * kWarp * (U * VEC + 2)];
    CombineSplit<VEC, U, kSplit, kMax>(partial, warp_in_block - part, part, lane, acc, &weight_sum, &weight_sq_sum);
    if (part != 0 || !active) return;
  }
  // max: weight_sum counts the valid entries (weights are refused, so 1 each).
  const float scale = kMax ? (weight_sum > 0.f ? 1.f : 0.f)
                           : CombinerScale(bags.combiner, weight_sum, weight_sq_sum);
  T* out_row = out + bag * dim;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int64_t col = lane_col + static_cast<int64_t>(u) * kWarp * VEC;
    if (col < dim) {
      float scaled[VEC];
#pragma unroll
      for (int v = 0; v < VEC; ++v) scaled[v] = kMax ? (scale > 0.f ? acc[u][v] : 0.f) : acc[u][v] * scale;
      StoreFloats<T, VEC>(out_row + col, scaled);
    }
  }
}

template <typename T, typename IdxT, int VEC, int U, int kSplit>
int LaunchForwardSplit(const PkmBags& bags, int64_t num_indices, int64_t tiles, void* out, cudaStream_t stream) {
  const int64_t groups_per_block = kForwardWarps / kSplit;
  const int64_t blocks = (bags.num_bags * tiles + groups_per_block - 1) / groups_per_block;
  if (blocks > 0x7fffffffLL) return SetInvalid("forward: too many bags for one launch");
  if (bags.combiner == PKM_MAX)
    ForwardKernel<T, IdxT, VEC, U, kSplit, true><<<static_cast<unsigned>(blocks), kForwardThreads, 0, stream>>>(
        bags, num_indices, tiles, static_cast<T*>(out));
  else
    ForwardKernel<T, IdxT, VEC, U, kSplit, false><<<static_cast<unsigned>(blocks), kForwardThreads, 0, stream>>>(
        bags, num_indices, tiles, static_cast<T*>(out));
  return CheckLaunch("pkm_cuda_forward");
}

// Warps per (bag, tile): 1, or up to kMaxSplit when the launch would leave
// most of the GPU idle and bags have more than one chunk of 32 entries each.
#ifndef PKM_FWD_MAX_SPLIT
#define PKM_FWD_MAX_SPLIT kMaxSplit
#endif
int ForwardSplit(const PkmBags& bags, int64_t num_indices, int64_t warps) {
  const int64_t chunks_per_bag = (num_indices / std::max<int64_t>(bags.num_bags, 1) + kWarp - 1) / kWarp;
  int split = 1;
  while (split < PKM_FWD_MAX_SPLIT && warps * split * 2 <= kFewWarps && chunks_per_bag >= split * 2) split *= 2;
  return split;
}

template <typename T, typename IdxT, int VEC, int U>
int LaunchForward(const PkmBags& bags, int64_t num_indices, void* out, cudaStream_t stream) {
  constexpr int64_t kTileCols = kWarp * VEC * U;
  const int64_t tiles = (bags.dim + kTileCols - 1) / kTileCols;
  if constexpr (U == 1 && VEC > 1) {  // the small-batch shape: split bags over warps
    switch (ForwardSplit(bags, num_indices, bags.num_bags * tiles)) {
      case 4: return LaunchForwardSplit<T, IdxT, VEC, U, 4>(bags, num_indices, tiles, out, stream);
      case 2: return LaunchForwardSplit<T, IdxT, VEC, U, 2>(bags, num_indices, tiles, out, stream);
      default: break;
    }
  }
  return LaunchForwardSplit<T, IdxT, VEC, U, 1>(bags, num_indices, tiles, out, stream);
}

// The default vectors per lane: one when a single vector per lane already
// covers the row (rows of 32 * 16 bytes or less: no idle lanes) or when the
// launch would have few warps; else two.
int DefaultVecsPerLane(const PkmBags& bags, int vec) {
  const int64_t cols_per_tile = static_cast<int64_t>(kWarp) * vec * kDefaultForwardVecsPerLane;
  const int64_t tiles = (bags.dim + cols_per_tile - 1) / cols_per_tile;
  if (bags.dim <= static_cast<int64_t>(kWarp) * vec || bags.num_bags * tiles < kFewWarps) return 1;
  return kDefaultForwardVecsPerLane;
}

template <typename T, typename IdxT>
int DispatchVec(const PkmBags& bags, int64_t num_indices, void* out, int vecs_per_lane,
                cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const bool vector_ok = bags.dim % kVec == 0 && Aligned16(bags.table) && Aligned16(out);
  if (!vector_ok) return LaunchForward<T, IdxT, 1, 4>(bags, num_indices, out, stream);
  if (vecs_per_lane == 0) vecs_per_lane = DefaultVecsPerLane(bags, kVec);
  switch (vecs_per_lane) {
    case 1: return LaunchForward<T, IdxT, kVec, 1>(bags, num_indices, out, stream);
    case 4: return LaunchForward<T, IdxT, kVec, 4>(bags, num_indices, out, stream);
    default: return LaunchForward<T, IdxT, kVec, 2>(bags, num_indices, out, stream);
  }
}

template <typename T>
int DispatchIndex(const PkmBags& bags, int64_t num_indices, void* out, int vecs_per_lane,
                  cudaStream_t stream) {
  return bags.indices_int64
             ? DispatchVec<T, int64_t>(bags, num_indices, out, vecs_per_lane, stream)
             : DispatchVec<T, int32_t>(bags, num_indices, out, vecs_per_lane, stream);
}

}  // namespace
}  // namespace pkm_cuda

extern "C" int pkm_cuda_forward(const PkmBags* bags, void* out, const PkmCudaOptions* options,
                                pkm_cuda_stream_t stream) {
  using namespace pkm_cuda;
  const int status = ValidateCommon(bags);
  if (status != PKM_CUDA_OK) return status;
  if (bags->num_bags == 0 || bags->dim == 0) return PKM_CUDA_OK;
  if (out == nullptr) return SetInvalid("forward: out is null");
  int vecs_per_lane = 0;  // DefaultVecsPerLane
  if (options != nullptr && options->forward_vecs_per_lane != 0) {
    vecs_per_lane = options->forward_vecs_per_lane;
    if (vecs_per_lane != 1 && vecs_per_lane != 2 && vecs_per_lane != 4)
      return SetInvalid("forward_vecs_per_lane must be 0 (default), 1, 2 or 4, got " +
                        std::to_string(vecs_per_lane));
  }
  const int64_t num_indices = NumIndices(*bags);
  switch (bags->elem_type) {
    case PKM_FLOAT16: return DispatchIndex<__half>(*bags, num_indices, out, vecs_per_lane, stream);
    case PKM_BFLOAT16:
      return DispatchIndex<__nv_bfloat16>(*bags, num_indices, out, vecs_per_lane, stream);
    default: return DispatchIndex<float>(*bags, num_indices, out, vecs_per_lane, stream);
  }
}
