// Phase 5 of the CUDA backward: d_weights from the raw dots grad[bag] . table[row]
// that the row pass left per entry (and per tile), with the combiner's correction.
#include "kernels/cuda/backward.cuh"

namespace pkm_cuda {
namespace {

// One warp per bag: d_weights from the raw dots and the combiner.
template <typename IdxT>
__global__ void WeightsGradKernel(PkmBags bags, int64_t num_indices, int64_t tiles,
                                  const float* dots, void* d_weights) {
  const int64_t bag = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
  if (bag >= bags.num_bags) return;
  const int lane = threadIdx.x % kWarp;
  int64_t begin, end;
  BagRange(bags, num_indices, bag, &begin, &end);
  auto raw_dot = [&](int64_t entry) {
    float d = 0.f;
    for (int64_t t = 0; t < tiles; ++t) d += dots[t * num_indices + entry];
    return d;
  };
  float weighted_dots = 0.f, weight_sum = 0.f, weight_sq_sum = 0.f;
  if (bags.combiner != PKM_SUM) {
    for (int64_t entry = begin + lane; entry < end; entry += kWarp) {
      if (!ValidEntry<IdxT>(bags, entry)) continue;
      const float w = LoadWeight(bags.weights, bags.weights_type, entry);
      weighted_dots += w * raw_dot(entry);
      weight_sum += w;
      weight_sq_sum += w * w;
    }
    weighted_dots = WarpSum(weighted_dots);
    weight_sum = WarpSum(weight_sum);
    weight_sq_sum = WarpSum(weight_sq_sum);
  }
  for (int64_t entry = begin + lane; entry < end; entry += kWarp) {
    float dw = 0.f;
    if (ValidEntry<IdxT>(bags, entry)) {
      const float d = raw_dot(entry);
      if (bags.combiner == PKM_SUM) {
        dw = d;
      } else if (bags.combiner == PKM_MEAN) {
        dw = weight_sum != 0.f ? (d - weighted_dots / weight_sum) / weight_sum : 0.f;
      } else {
        const float w = LoadWeight(bags.weights, bags.weights_type, entry);
        dw = weight_sq_sum > 0.f
                 ? (d - w * weighted_dots / weight_sq_sum) * rsqrtf(weight_sq_sum)
                 : 0.f;
      }
    }
    StoreWeight(d_weights, bags.weights_type, entry, dw);
  }
}

}  // namespace

int LaunchWeightsGrad(const PkmBags& bags, int64_t num_indices, int64_t tiles, const float* dots,
                      void* d_weights, cudaStream_t stream) {
  if (d_weights == nullptr || bags.num_bags == 0) return PKM_CUDA_OK;
  const unsigned blocks = Blocks(bags.num_bags, kWarpsPerBlock);
  if (bags.indices_int64)
    WeightsGradKernel<int64_t><<<blocks, kBackwardThreads, 0, stream>>>(bags, num_indices, tiles, dots, d_weights);
  else
    WeightsGradKernel<int32_t><<<blocks, kBackwardThreads, 0, stream>>>(bags, num_indices, tiles, dots, d_weights);
  return CheckLaunch("backward d_weights");
}

}  // namespace pkm_cuda
