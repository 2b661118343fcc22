// EmbeddingBag forward on the GPU: one warp per (bag, column tile).
//
// Each lane keeps U vectors of VEC columns (16-byte loads), so a warp covers
// 32 * VEC * U contiguous columns of every row it gathers. The bag's indices
// and weights are fetched 32 at a time (one per lane) and broadcast with
// shuffles; rows are loaded kRowsInFlight at a time before they are
// accumulated, so each lane keeps kRowsInFlight * U independent 16-byte loads
// in flight. Accumulation is float32; the combiner's scale is computed on the
// fly from the same weights.
#include <algorithm>
#include <cstdio>
#include <string>

#include "kernels/cuda/common.cuh"

namespace pkm_cuda {
namespace {

constexpr int kForwardThreads = 256;
// With one vector per lane (narrow tiles) twice as many rows are in flight, so
// every lane still keeps 8 loads outstanding.
__host__ __device__ constexpr int RowsInFlight(int u) { return u == 1 ? 8 : 4; }
constexpr int kDefaultForwardVecsPerLane = 2;
// Below this many warps the default drops to one vector per lane (twice the
// warps): small batches are latency-bound, not bandwidth-bound.
constexpr int64_t kFewWarps = 132 * 64;

// kMax: elementwise max over the bag's valid rows (an empty bag gives 0)
// instead of the weighted sum.
template <typename T, typename IdxT, int VEC, int U, bool kMax>
__global__ void __launch_bounds__(kForwardThreads)
    ForwardKernel(PkmBags bags, int64_t num_indices, int64_t tiles, T* __restrict__ out) {
  constexpr int kTileCols = kWarp * VEC * U;
  constexpr int kRowsInFlight = RowsInFlight(U);
  const int lane = threadIdx.x % kWarp;
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * (kForwardThreads / kWarp) +
                       threadIdx.x / kWarp;
  if (warp >= bags.num_bags * tiles) return;
  const int64_t bag = warp / tiles;
  const int64_t tile = warp % tiles;
  const int64_t dim = bags.dim;
  const int64_t num_rows = bags.num_rows;
  const int64_t lane_col = tile * kTileCols + static_cast<int64_t>(lane) * VEC;
  const T* __restrict__ table = static_cast<const T*>(bags.table);
  const IdxT* __restrict__ indices = static_cast<const IdxT*>(bags.indices);

  int64_t begin, end;
  BagRange(bags, num_indices, bag, &begin, &end);

  float acc[U][VEC];
#pragma unroll
  for (int u = 0; u < U; ++u)
#pragma unroll
    for (int v = 0; v < VEC; ++v) acc[u][v] = kMax ? -INFINITY : 0.f;
  float weight_sum = 0.f, weight_sq_sum = 0.f;  // lane-partial, valid entries only

  for (int64_t chunk = begin; chunk < end; chunk += kWarp) {
    const int count = static_cast<int>(min(static_cast<int64_t>(kWarp), end - chunk));
    int64_t my_row = -1;  // -1: padding, out of range, or past the chunk
    float my_weight = 0.f;
    if (lane < count) {
      const int64_t idx = static_cast<int64_t>(indices[chunk + lane]);
      if (idx >= 0 && idx < num_rows) {
        my_row = idx;
        my_weight = bags.weights ? LoadWeight(bags.weights, bags.weights_type, chunk + lane) : 1.f;
        weight_sum += my_weight;
        weight_sq_sum += my_weight * my_weight;
      } else if (idx >= num_rows && tile == 0 && bags.invalid_index_count != nullptr) {
        atomicAdd(bags.invalid_index_count, 1);
      }
    }
    // count <= 32 and kRowsInFlight divides 32, so k + j never leaves the warp;
    // lanes past `count` hold row -1.
    for (int k = 0; k < count; k += kRowsInFlight) {
      float rows[kRowsInFlight][U][VEC];
      float weight[kRowsInFlight];
#pragma unroll
      for (int j = 0; j < kRowsInFlight; ++j) {
        const int64_t row = __shfl_sync(kFullMask, my_row, k + j);
        weight[j] = __shfl_sync(kFullMask, my_weight, k + j);
        const T* row_ptr = table + row * dim;
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int64_t col = lane_col + static_cast<int64_t>(u) * kWarp * VEC;
          if (row >= 0 && col < dim) {
            LoadFloats<T, VEC>(row_ptr + col, rows[j][u]);
          } else {
#pragma unroll
            for (int v = 0; v < VEC; ++v) rows[j][u][v] = 0.f;
          }
        }
      }
#pragma unroll
      for (int j = 0; j < kRowsInFlight; ++j) {
        if (kMax && __shfl_sync(kFullMask, my_row, k + j) < 0) continue;  // padding: not a candidate
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
          for (int v = 0; v < VEC; ++v)
            acc[u][v] = kMax ? fmaxf(acc[u][v], rows[j][u][v]) : fmaf(weight[j], rows[j][u][v], acc[u][v]);
      }
    }
  }

  const float weight_total = WarpSum(weight_sum);
  // max: weight_sum counts the valid entries (weights are refused, so 1 each).
  const float scale = kMax ? (weight_total > 0.f ? 1.f : 0.f)
                           : CombinerScale(bags.combiner, weight_total, WarpSum(weight_sq_sum));
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

template <typename T, typename IdxT, int VEC, int U>
int LaunchForward(const PkmBags& bags, int64_t num_indices, void* out, cudaStream_t stream) {
  constexpr int64_t kTileCols = kWarp * VEC * U;
  const int64_t tiles = (bags.dim + kTileCols - 1) / kTileCols;
  const int64_t warps = bags.num_bags * tiles;
  const int64_t blocks = (warps + kForwardThreads / kWarp - 1) / (kForwardThreads / kWarp);
  if (blocks > 0x7fffffffLL) return SetInvalid("forward: too many bags for one launch");
  if (bags.combiner == PKM_MAX)
    ForwardKernel<T, IdxT, VEC, U, true><<<static_cast<unsigned>(blocks), kForwardThreads, 0, stream>>>(
        bags, num_indices, tiles, static_cast<T*>(out));
  else
    ForwardKernel<T, IdxT, VEC, U, false><<<static_cast<unsigned>(blocks), kForwardThreads, 0, stream>>>(
        bags, num_indices, tiles, static_cast<T*>(out));
  return CheckLaunch("pkm_cuda_forward");
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
