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
constexpr int kRowsInFlight = 4;
constexpr int kDefaultForwardVecsPerLane = 2;

template <typename T, typename IdxT, int VEC, int U>
__global__ void __launch_bounds__(kForwardThreads)
    ForwardKernel(PkmBags bags, int64_t num_indices, int64_t tiles, T* __restrict__ out) {
  constexpr int kTileCols = kWarp * VEC * U;
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
    for (int v = 0; v < VEC; ++v) acc[u][v] = 0.f;
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
      for (int j = 0; j < kRowsInFlight; ++j)
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
          for (int v = 0; v < VEC; ++v) acc[u][v] = fmaf(weight[j], rows[j][u][v], acc[u][v]);
    }
  }

  const float scale = CombinerScale(bags.combiner, WarpSum(weight_sum), WarpSum(weight_sq_sum));
  T* out_row = out + bag * dim;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int64_t col = lane_col + static_cast<int64_t>(u) * kWarp * VEC;
    if (col < dim) {
      float scaled[VEC];
#pragma unroll
      for (int v = 0; v < VEC; ++v) scaled[v] = acc[u][v] * scale;
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
  ForwardKernel<T, IdxT, VEC, U><<<static_cast<unsigned>(blocks), kForwardThreads, 0, stream>>>(
      bags, num_indices, tiles, static_cast<T*>(out));
  return CheckLaunch("pkm_cuda_forward");
}

template <typename T, typename IdxT>
int DispatchVec(const PkmBags& bags, int64_t num_indices, void* out, int vecs_per_lane,
                cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const bool vector_ok = bags.dim % kVec == 0 && Aligned16(bags.table) && Aligned16(out);
  if (!vector_ok) return LaunchForward<T, IdxT, 1, 4>(bags, num_indices, out, stream);
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
  int vecs_per_lane = kDefaultForwardVecsPerLane;
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
