// Host-side helpers of the CUDA launchers: argument checks and error text.
#include <string>

#include "kernels/cuda/common.cuh"

namespace pkm_cuda {
namespace {
thread_local std::string last_error;

bool MulOverflows(int64_t a, int64_t b) {
  return a != 0 && b > INT64_MAX / a;
}
}  // namespace

int64_t NumIndices(const PkmBags& bags) {
  return bags.row_splits ? bags.num_indices : bags.num_bags * bags.bag_size;
}

int SetInvalid(const std::string& message) {
  last_error = message;
  return PKM_CUDA_INVALID_ARGUMENT;
}

int CheckCuda(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return PKM_CUDA_OK;
  last_error = std::string(what) + ": " + cudaGetErrorName(err) + ": " + cudaGetErrorString(err);
  return static_cast<int>(err);
}

int CheckLaunch(const char* what) { return CheckCuda(cudaGetLastError(), what); }

bool Aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

int ValidateCommon(const PkmBags* bags) {
  if (bags == nullptr) return SetInvalid("bags is null");
  const PkmBags& b = *bags;
  auto type_ok = [](int32_t t) { return t == PKM_FLOAT32 || t == PKM_FLOAT16 || t == PKM_BFLOAT16; };
  if (!type_ok(b.elem_type))
    return SetInvalid("elem_type must be float32 (0), float16 (1) or bfloat16 (2), got " +
                      std::to_string(b.elem_type));
  if (b.weights != nullptr && !type_ok(b.weights_type))
    return SetInvalid("weights_type must be float32 (0), float16 (1) or bfloat16 (2), got " +
                      std::to_string(b.weights_type));
  if (b.combiner != PKM_SUM && b.combiner != PKM_MEAN && b.combiner != PKM_SQRTN && b.combiner != PKM_MAX)
    return SetInvalid("combiner must be sum (0), mean (1), sqrtn (2) or max (3), got " +
                      std::to_string(b.combiner));
  if (b.combiner == PKM_MAX && b.weights != nullptr)
    return SetInvalid("the max combiner takes no weights (as torch's mode='max'); pass weights = NULL");
  if (b.index_policy != PKM_NEGATIVE_IS_PADDING && b.index_policy != PKM_OUT_OF_RANGE_IS_PADDING)
    return SetInvalid("index_policy must be negative-is-padding (0) or out-of-range-is-padding (2) on the "
                      "GPU (the device cannot report an index error), got " + std::to_string(b.index_policy));
  if (b.num_rows < 0 || b.dim < 0 || b.num_bags < 0)
    return SetInvalid("num_rows, dim and num_bags must be >= 0, got " + std::to_string(b.num_rows) +
                      ", " + std::to_string(b.dim) + ", " + std::to_string(b.num_bags));
  if (MulOverflows(b.num_rows, b.dim) || MulOverflows(b.num_bags, b.dim))
    return SetInvalid("table or output element count overflows int64");
  if (b.row_splits == nullptr) {
    if (b.bag_size < 0) return SetInvalid("bag_size must be >= 0, got " + std::to_string(b.bag_size));
    if (MulOverflows(b.num_bags, b.bag_size)) return SetInvalid("num_bags * bag_size overflows int64");
  } else if (b.num_indices < 0) {
    return SetInvalid("num_indices must be >= 0 for ragged bags, got " + std::to_string(b.num_indices));
  }
  if (NumIndices(b) > 0 && b.indices == nullptr) return SetInvalid("indices is null");
  if (b.num_rows > 0 && b.dim > 0 && b.table == nullptr) return SetInvalid("table is null");
  return PKM_CUDA_OK;
}

}  // namespace pkm_cuda

extern "C" const char* pkm_cuda_last_error(void) { return pkm_cuda::last_error.c_str(); }
