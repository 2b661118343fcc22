// Device helpers shared by the forward and backward EmbeddingBag kernels.
#ifndef PKM_KERNELS_CUDA_COMMON_CUH_
#define PKM_KERNELS_CUDA_COMMON_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "kernels/cuda/embedding_bag_cuda.h"

namespace pkm_cuda {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kWarp = 32;

template <typename T> __device__ __forceinline__ float ToFloat(T v);
template <> __device__ __forceinline__ float ToFloat<float>(float v) { return v; }
template <> __device__ __forceinline__ float ToFloat<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float ToFloat<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}

template <typename T> __device__ __forceinline__ T FromFloat(float v);
template <> __device__ __forceinline__ float FromFloat<float>(float v) { return v; }
template <> __device__ __forceinline__ __half FromFloat<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// VEC consecutive elements: one 16-byte access when VEC * sizeof(T) == 16,
// else VEC scalar accesses (the unaligned / odd-dim fallback uses VEC == 1).
template <typename T, int VEC>
union Pack {
  static_assert(VEC == 1 || sizeof(T) * VEC == 16, "pack is a scalar or 16 bytes");
  T elems[VEC];
  typename std::conditional<VEC == 1, T, uint4>::type raw;
};

template <typename T, int VEC>
__device__ __forceinline__ void LoadPack(const T* ptr, Pack<T, VEC>& pack) {
  if constexpr (VEC == 1) {
    pack.raw = ptr[0];
  } else {
    pack.raw = __ldg(reinterpret_cast<const uint4*>(ptr));
  }
}

// All-zero bits: 0.0 in float32, float16 and bfloat16.
template <typename T, int VEC>
__device__ __forceinline__ void ZeroPack(Pack<T, VEC>& pack) {
  if constexpr (VEC == 1) {
    pack.elems[0] = FromFloat<T>(0.f);
  } else {
    pack.raw = make_uint4(0u, 0u, 0u, 0u);
  }
}

template <typename T, int VEC>
__device__ __forceinline__ void LoadFloats(const T* ptr, float (&out)[VEC]) {
  Pack<T, VEC> pack;
  LoadPack<T, VEC>(ptr, pack);
#pragma unroll
  for (int i = 0; i < VEC; ++i) out[i] = ToFloat<T>(pack.elems[i]);
}

template <typename T, int VEC>
__device__ __forceinline__ void StoreFloats(T* ptr, const float (&in)[VEC]) {
  Pack<T, VEC> pack;
#pragma unroll
  for (int i = 0; i < VEC; ++i) pack.elems[i] = FromFloat<T>(in[i]);
  if constexpr (VEC == 1) {
    ptr[0] = pack.raw;
  } else {
    *reinterpret_cast<uint4*>(ptr) = pack.raw;
  }
}

// Weights may have their own element type; the branch is warp-uniform.
__device__ __forceinline__ float LoadWeight(const void* weights, int type, int64_t i) {
  switch (type) {
    case PKM_FLOAT16: return __half2float(static_cast<const __half*>(weights)[i]);
    case PKM_BFLOAT16: return __bfloat162float(static_cast<const __nv_bfloat16*>(weights)[i]);
    default: return static_cast<const float*>(weights)[i];
  }
}

__device__ __forceinline__ void StoreWeight(void* weights, int type, int64_t i, float v) {
  switch (type) {
    case PKM_FLOAT16: static_cast<__half*>(weights)[i] = __float2half_rn(v); break;
    case PKM_BFLOAT16: static_cast<__nv_bfloat16*>(weights)[i] = __float2bfloat16_rn(v); break;
    default: static_cast<float*>(weights)[i] = v;
  }
}

__device__ __forceinline__ int64_t LoadSplit(const void* splits, int is64, int64_t i) {
  return is64 ? static_cast<const int64_t*>(splits)[i]
              : static_cast<int64_t>(static_cast<const int32_t*>(splits)[i]);
}

// [begin, end) of a bag's entries. Ragged splits are clamped into
// [0, num_indices] so a malformed split can never make us read past the end.
__device__ __forceinline__ void BagRange(const PkmBags& bags, int64_t num_indices,
                                         int64_t bag, int64_t* begin, int64_t* end) {
  if (bags.row_splits == nullptr) {
    *begin = bag * bags.bag_size;
    *end = *begin + bags.bag_size;
    return;
  }
  int64_t b = LoadSplit(bags.row_splits, bags.row_splits_int64, bag);
  int64_t e = LoadSplit(bags.row_splits, bags.row_splits_int64, bag + 1);
  b = b < 0 ? 0 : (b > num_indices ? num_indices : b);
  e = e < b ? b : (e > num_indices ? num_indices : e);
  *begin = b;
  *end = e;
}

// The forward kernels' per-lane entry load: the row of entry `pos` when it is
// valid (0 <= index < num_rows), else -1; an index >= num_rows is counted once
// (by the warp of tile 0) into bags.invalid_index_count when that is set.
template <typename IdxT>
__device__ __forceinline__ int64_t LoadEntryRow(const PkmBags& bags, const IdxT* __restrict__ indices, int64_t pos,
                                                bool count_invalid) {
  const int64_t idx = static_cast<int64_t>(indices[pos]);
  if (idx >= 0 && idx < bags.num_rows) return idx;
  if (idx >= bags.num_rows && count_invalid && bags.invalid_index_count != nullptr)
    atomicAdd(bags.invalid_index_count, 1);
  return -1;
}

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

// Factor applied to sum(w * x) for a bag: 1 (sum), 1/sum(w) (mean),
// 1/sqrt(sum(w^2)) (sqrtn); 0 when the denominator is 0.
__device__ __forceinline__ float CombinerScale(int combiner, float weight_sum, float weight_sq_sum) {
  if (combiner == PKM_MEAN) return weight_sum != 0.f ? 1.f / weight_sum : 0.f;
  if (combiner == PKM_SQRTN) return weight_sq_sum > 0.f ? rsqrtf(weight_sq_sum) : 0.f;
  return 1.f;
}

// Host side.
int64_t NumIndices(const PkmBags& bags);
int SetInvalid(const std::string& message);
int CheckLaunch(const char* what);  // cudaGetLastError after a launch
int CheckCuda(cudaError_t err, const char* what);
// Validates fields every launcher needs; returns PKM_CUDA_OK or an error code.
int ValidateCommon(const PkmBags* bags);
bool Aligned16(const void* ptr);

}  // namespace pkm_cuda

#endif  // PKM_KERNELS_CUDA_COMMON_CUH_
