// EmbeddingBag forward over a row-wise int8 table on the GPU: one warp per
// (bag, column tile), as forward.cu, reading a quarter of the bytes.
//
// Row r dequantises as scale[r] * q + bias[r] (PkmBags' row_scales /
// row_biases, float32 or float16). The lane holding an entry folds its weight
// into c = w * scale[r] and w * bias[r]; both are broadcast with shuffles, so
// the column loop is one int8 -> float conversion and one FMA per element, and
// the biases enter once per bag. Accumulation and output are float32.
#include <string>

#include "kernels/cuda/common.cuh"

namespace pkm_cuda {
namespace {

constexpr int kInt8Threads = 256;
constexpr int kInt8RowsInFlight = 4;
constexpr int kInt8TilesPerLane = 4;  // VEC-column groups per lane

__device__ __forceinline__ float LoadRowParam(const void* p, int type, int64_t r) {
  return type == PKM_FLOAT16 ? __half2float(static_cast<const __half*>(p)[r]) : static_cast<const float*>(p)[r];
}

template <int VEC>
__device__ __forceinline__ void LoadQuads(const int8_t* ptr, float (&out)[VEC]) {
  if constexpr (VEC == 4) {
    const char4 q = __ldg(reinterpret_cast<const char4*>(ptr));
    out[0] = q.x; out[1] = q.y; out[2] = q.z; out[3] = q.w;
  } else {
#pragma unroll
    for (int v = 0; v < VEC; ++v) out[v] = static_cast<float>(__ldg(ptr + v));
  }
}

template <typename IdxT, int VEC>
__global__ void __launch_bounds__(kInt8Threads)
    ForwardInt8Kernel(PkmBags bags, int64_t num_indices, int64_t tiles, float* __restrict__ out) {
  constexpr int U = kInt8TilesPerLane;
  constexpr int64_t kTileCols = kWarp * VEC * U;
  const int lane = threadIdx.x % kWarp;
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * (kInt8Threads / kWarp) + threadIdx.x / kWarp;
  if (warp >= bags.num_bags * tiles) return;
  const int64_t bag = warp / tiles, tile = warp % tiles;
  const int64_t dim = bags.dim;
  const int64_t lane_col = tile * kTileCols + static_cast<int64_t>(lane) * VEC;
  const int8_t* __restrict__ table = static_cast<const int8_t*>(bags.table);
  const IdxT* __restrict__ indices = static_cast<const IdxT*>(bags.indices);

  int64_t begin, end;
  BagRange(bags, num_indices, bag, &begin, &end);
  float acc[U][VEC];
#pragma unroll
  for (int u = 0; u < U; ++u)
#pragma unroll
    for (int v = 0; v < VEC; ++v) acc[u][v] = 0.f;
  float weight_sum = 0.f, weight_sq_sum = 0.f, bias_sum = 0.f;  // lane-partial

  for (int64_t chunk = begin; chunk < end; chunk += kWarp) {
    const int count = static_cast<int>(min(static_cast<int64_t>(kWarp), end - chunk));
    int64_t my_row = -1;
    float my_coef = 0.f;
    if (lane < count) my_row = LoadEntryRow<IdxT>(bags, indices, chunk + lane, tile == 0);
    if (my_row >= 0) {
      const float w = bags.weights ? LoadWeight(bags.weights, bags.weights_type, chunk + lane) : 1.f;
      my_coef = w * LoadRowParam(bags.row_scales, bags.row_params_type, my_row);
      if (bags.row_biases != nullptr) bias_sum += w * LoadRowParam(bags.row_biases, bags.row_params_type, my_row);
      weight_sum += w;
      weight_sq_sum += w * w;
    }
    for (int k = 0; k < count; k += kInt8RowsInFlight) {
      float rows[kInt8RowsInFlight][U][VEC];
      float coef[kInt8RowsInFlight];
#pragma unroll
      for (int j = 0; j < kInt8RowsInFlight; ++j) {
        const int64_t row = __shfl_sync(kFullMask, my_row, k + j);
        coef[j] = __shfl_sync(kFullMask, my_coef, k + j);
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int64_t col = lane_col + static_cast<int64_t>(u) * kWarp * VEC;
          if (row >= 0 && col < dim) {
            LoadQuads<VEC>(table + row * dim + col, rows[j][u]);
          } else {
#pragma unroll
            for (int v = 0; v < VEC; ++v) rows[j][u][v] = 0.f;
          }
        }
      }
#pragma unroll
      for (int j = 0; j < kInt8RowsInFlight; ++j)
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
          for (int v = 0; v < VEC; ++v) acc[u][v] = fmaf(coef[j], rows[j][u][v], acc[u][v]);
    }
  }
  const float scale = CombinerScale(bags.combiner, WarpSum(weight_sum), WarpSum(weight_sq_sum));
  const float bias = WarpSum(bias_sum);
  float* out_row = out + bag * dim;
#pragma unroll
  for (int u = 0; u < U; ++u) {
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      const int64_t col = lane_col + static_cast<int64_t>(u) * kWarp * VEC + v;
      if (col < dim) out_row[col] = (acc[u][v] + bias) * scale;
    }
  }
}

template <typename IdxT, int VEC>
int LaunchInt8(const PkmBags& bags, int64_t num_indices, float* out, cudaStream_t stream) {
  constexpr int64_t kTileCols = kWarp * VEC * kInt8TilesPerLane;
  const int64_t tiles = (bags.dim + kTileCols - 1) / kTileCols;
  const int64_t blocks = (bags.num_bags * tiles + kInt8Threads / kWarp - 1) / (kInt8Threads / kWarp);
  if (blocks > 0x7fffffffLL) return SetInvalid("int8 forward: too many bags for one launch");
  ForwardInt8Kernel<IdxT, VEC><<<static_cast<unsigned>(blocks), kInt8Threads, 0, stream>>>(bags, num_indices,
                                                                                           tiles, out);
  return CheckLaunch("pkm_cuda_forward_int8");
}

template <typename IdxT>
int DispatchInt8(const PkmBags& bags, int64_t num_indices, float* out, cudaStream_t stream) {
  const bool quads = bags.dim % 4 == 0 && reinterpret_cast<uintptr_t>(bags.table) % 4 == 0;
  return quads ? LaunchInt8<IdxT, 4>(bags, num_indices, out, stream)
               : LaunchInt8<IdxT, 1>(bags, num_indices, out, stream);
}

}  // namespace
}  // namespace pkm_cuda

extern "C" int pkm_cuda_forward_int8(const PkmBags* bags, float* out, pkm_cuda_stream_t stream) {
  using namespace pkm_cuda;
  if (bags == nullptr) return SetInvalid("bags is null");
  if (bags->elem_type != PKM_INT8) return SetInvalid("int8 forward: elem_type must be int8 (3), got " +
                                                     std::to_string(bags->elem_type));
  if (bags->row_scales == nullptr) return SetInvalid("int8 forward: row_scales is null");
  if (bags->row_params_type != PKM_FLOAT32 && bags->row_params_type != PKM_FLOAT16)
    return SetInvalid("int8 forward: row_params_type must be float32 (0) or float16 (1), got " +
                      std::to_string(bags->row_params_type));
  // Every other field follows the float launchers' rules.
  PkmBags as_float = *bags;
  as_float.elem_type = PKM_FLOAT32;
  const int status = ValidateCommon(&as_float);
  if (status != PKM_CUDA_OK) return status;
  if (bags->num_bags == 0 || bags->dim == 0) return PKM_CUDA_OK;
  if (out == nullptr) return SetInvalid("int8 forward: out is null");
  const int64_t num_indices = NumIndices(*bags);
  return bags->indices_int64 ? DispatchInt8<int64_t>(*bags, num_indices, out, stream)
                             : DispatchInt8<int32_t>(*bags, num_indices, out, stream);
}
