// Host-side helpers of the CUDA launchers: argument checks and error text.
#include <string>

#include "kernels/core/shape_rules.h"
#include "kernels/cuda/common.cuh"

namespace pkm_cuda {
namespace {
thread_local std::string last_error;
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
  // The device cannot report an index error: the GPU's own rule, before the shared ones.
  if (bags->index_policy != PKM_NEGATIVE_IS_PADDING && bags->index_policy != PKM_OUT_OF_RANGE_IS_PADDING)
    return SetInvalid("index_policy must be negative-is-padding (0) or out-of-range-is-padding (2) on the "
                      "GPU (the device cannot report an index error), got " + std::to_string(bags->index_policy));
  // Types, combiner, counts, overflow and null buffers: the core's rule set,
  // with the same words as the C ABI and every other runtime.
  const pkm::Status rule = pkm::BagProblemRule(*bags);
  return rule.ok ? PKM_CUDA_OK : SetInvalid(rule.message);
}

}  // namespace pkm_cuda

extern "C" const char* pkm_cuda_last_error(void) { return pkm_cuda::last_error.c_str(); }
