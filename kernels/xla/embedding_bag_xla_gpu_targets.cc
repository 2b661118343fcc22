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

// The CUDA platform of Targets: the launchers on XLA's stream, the
// backward's workspace from XLA's scratch allocator.
struct CudaPlatform {
  static ffi::Error Forward(const CoreCall& call, ffi::AnyBuffer& out, pkm_cuda_stream_t stream,
                            ffi::ScratchAllocator&) {
    if (out.element_count() == 0) return ffi::Error::Success();
    const PkmBags b = pkm::ToBagProblem(call.table, call.bags, call.combiner);
    return FromLauncher(pkm_cuda_forward(&b, out.untyped_data(), nullptr, stream));
  }

  static ffi::Error Backward(const CoreCall& call, const ffi::AnyBuffer& grad, ffi::AnyBuffer& d_params,
                             ffi::AnyBuffer& d_weights, pkm_cuda_stream_t stream, ffi::ScratchAllocator& scratch) {
    const PkmBags b = pkm::ToBagProblem(call.table, call.bags, call.combiner);
    const size_t workspace_bytes = pkm_cuda_backward_workspace_bytes(&b, nullptr);
    void* workspace = nullptr;
    if (workspace_bytes > 0) {
      // XLA's FFI refuses alignments above 16 ("Unsupported alignment"); 16 is
      // all the launcher needs (its sub-buffers sit at multiples of 256 past the base).
      std::optional<void*> allocated = scratch.Allocate(workspace_bytes, 16);
      if (!allocated) return ffi::Error::Internal("PkmEmbeddingBag backward: could not allocate its workspace");
      workspace = *allocated;
    }
    void* d_params_data = d_params.element_count() > 0 ? d_params.untyped_data() : nullptr;
    void* d_weights_data = call.has_weights && d_weights.element_count() > 0 ? d_weights.untyped_data() : nullptr;
    return FromLauncher(pkm_cuda_backward(&b, grad.untyped_data(), d_params_data, d_weights_data, workspace,
                                          workspace_bytes, nullptr, stream));
  }
};
// Every handler takes the stream and the scratch allocator (the forward
// leaves the allocator unused: one context list serves all four targets).
using CudaTargets = Targets<CudaPlatform, ffi::PlatformStream<pkm_cuda_stream_t>, ffi::ScratchAllocator>;

}  // namespace
}  // namespace pkm_xla

PKM_XLA_DEFINE_TARGETS(gpu, ::pkm_xla::CudaTargets)
