// XLA GPU ("CUDA") custom-call targets of the PkmEmbeddingBag lowering: typed
// FFI handlers on the CUDA launchers (kernels/cuda), XLA's stream and XLA's
// scratch allocator. Only XLA's public FFI header: no TensorFlow, so the same
// object serves the TF op library (_pkm_ops_gpu.so, which registers the
// handlers with TF's XLA: embedding_bag_xla_gpu.cc) and libpkm_xla_gpu.so,
// whose exported handlers any XLA runtime can register (the GPU test runs
// them under JAX's XLA on a machine without TensorFlow).
//
// As in the TF GPU kernels, an index >= N is treated as padding on the device
// (never read); shapes and attributes are checked by the lowering at compile
// time and again here.
#include <cstdint>
#include <optional>
#include <string>

#include "kernels/cuda/embedding_bag_cuda.h"
#include "kernels/xla/embedding_bag_xla_ffi.h"
#include "xla/ffi/api/ffi.h"

namespace pkm_xla {
namespace {

ffi::Error FromLauncher(int code) {
  if (code == PKM_CUDA_OK) return ffi::Error::Success();
  if (code == PKM_CUDA_INVALID_ARGUMENT) return ffi::Error::InvalidArgument(pkm_cuda_last_error());
  return ffi::Error::Internal(std::string("PkmEmbeddingBag CUDA launch failed: ") + pkm_cuda_last_error());
}

ffi::Error Forward(pkm_cuda_stream_t stream, const ffi::AnyBuffer& params, const ffi::AnyBuffer& indices,
                   const ffi::AnyBuffer* splits, const ffi::AnyBuffer& weights, ffi::AnyBuffer* out,
                   int32_t combiner, int32_t has_weights) {
  pkm::Table table;
  pkm::Bags bags;
  pkm::Combiner comb;
  if (ffi::Error e = ToCoreArgs(params, indices, splits, weights, combiner, has_weights, &table, &bags, &comb);
      e.failure())
    return e;
  if (out->element_count() == 0) return ffi::Error::Success();
  const PkmBags b = pkm::ToBagProblem(table, bags, comb);
  return FromLauncher(pkm_cuda_forward(&b, out->untyped_data(), nullptr, stream));
}

ffi::Error Backward(pkm_cuda_stream_t stream, ffi::ScratchAllocator& scratch, const ffi::AnyBuffer& grad,
                    const ffi::AnyBuffer& params, const ffi::AnyBuffer& indices, const ffi::AnyBuffer* splits,
                    const ffi::AnyBuffer& weights, ffi::AnyBuffer* d_params, ffi::AnyBuffer* d_weights,
                    int32_t combiner, int32_t has_weights) {
  pkm::Table table;
  pkm::Bags bags;
  pkm::Combiner comb;
  if (ffi::Error e = ToCoreArgs(params, indices, splits, weights, combiner, has_weights, &table, &bags, &comb);
      e.failure())
    return e;
  const PkmBags b = pkm::ToBagProblem(table, bags, comb);
  const size_t workspace_bytes = pkm_cuda_backward_workspace_bytes(&b, nullptr);
  void* workspace = nullptr;
  if (workspace_bytes > 0) {
    // XLA's FFI refuses alignments above 16 ("Unsupported alignment"); 16 is
    // all the launcher needs (its sub-buffers sit at multiples of 256 past the base).
    std::optional<void*> allocated = scratch.Allocate(workspace_bytes, 16);
    if (!allocated) return ffi::Error::Internal("PkmEmbeddingBag backward: could not allocate its workspace");
    workspace = *allocated;
  }
  void* d_params_data = d_params->element_count() > 0 ? d_params->untyped_data() : nullptr;
  void* d_weights_data = has_weights && d_weights->element_count() > 0 ? d_weights->untyped_data() : nullptr;
  return FromLauncher(pkm_cuda_backward(&b, grad.untyped_data(), d_params_data, d_weights_data, workspace,
                                        workspace_bytes, nullptr, stream));
}

// Every handler runs on XLA's CUDA stream; the backward ones also take its
// scratch allocator (for the launcher's workspace).
auto StreamBinding() { return ffi::Ffi::Bind().Ctx<ffi::PlatformStream<pkm_cuda_stream_t>>(); }

XLA_FFI_DEFINE_HANDLER(kForwardHandler,
                       [](pkm_cuda_stream_t stream, ffi::AnyBuffer params, ffi::AnyBuffer indices,
                          ffi::AnyBuffer weights, ffi::Result<ffi::AnyBuffer> out, int32_t combiner,
                          int32_t has_weights) {
                         return Forward(stream, params, indices, nullptr, weights, &*out, combiner, has_weights);
                       },
                       (BindOperands<3, 1>(StreamBinding())));

XLA_FFI_DEFINE_HANDLER(kRaggedForwardHandler,
                       [](pkm_cuda_stream_t stream, ffi::AnyBuffer params, ffi::AnyBuffer values,
                          ffi::AnyBuffer splits, ffi::AnyBuffer weights, ffi::Result<ffi::AnyBuffer> out,
                          int32_t combiner, int32_t has_weights) {
                         return Forward(stream, params, values, &splits, weights, &*out, combiner, has_weights);
                       },
                       (BindOperands<4, 1>(StreamBinding())));

XLA_FFI_DEFINE_HANDLER(kBackwardHandler,
                       [](pkm_cuda_stream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer grad,
                          ffi::AnyBuffer params, ffi::AnyBuffer indices, ffi::AnyBuffer weights,
                          ffi::Result<ffi::AnyBuffer> d_params, ffi::Result<ffi::AnyBuffer> d_weights,
                          int32_t combiner, int32_t has_weights) {
                         return Backward(stream, scratch, grad, params, indices, nullptr, weights, &*d_params,
                                         &*d_weights, combiner, has_weights);
                       },
                       (BindOperands<4, 2>(StreamBinding().Ctx<ffi::ScratchAllocator>())));

XLA_FFI_DEFINE_HANDLER(kRaggedBackwardHandler,
                       [](pkm_cuda_stream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer grad,
                          ffi::AnyBuffer params, ffi::AnyBuffer values, ffi::AnyBuffer splits,
                          ffi::AnyBuffer weights, ffi::Result<ffi::AnyBuffer> d_params,
                          ffi::Result<ffi::AnyBuffer> d_weights, int32_t combiner, int32_t has_weights) {
                         return Backward(stream, scratch, grad, params, values, &splits, weights, &*d_params,
                                         &*d_weights, combiner, has_weights);
                       },
                       (BindOperands<5, 2>(StreamBinding().Ctx<ffi::ScratchAllocator>())));

}  // namespace
}  // namespace pkm_xla

// The handlers as C symbols (XLA_FFI_Handler), one per custom-call target.
PKM_XLA_EXPORT_HANDLERS(gpu)
