// The XLA GPU side of _pkm_ops_gpu.so (`make gpu`): the lowering registered
// for XLA_GPU_JIT, and the CUDA handlers of embedding_bag_xla_gpu_targets.cc
// registered with TF's XLA for the "CUDA" platform.
#include "kernels/xla/embedding_bag_xla_lowering.h"
#include "xla/ffi/api/ffi.h"

namespace xla::ffi {
const XLA_FFI_Api* GetXlaFfiApi();  // exported by libtensorflow_framework
}  // namespace xla::ffi

extern "C" {
XLA_FFI_Error* pkm_xla_gpu_forward(XLA_FFI_CallFrame* frame);
XLA_FFI_Error* pkm_xla_gpu_backward(XLA_FFI_CallFrame* frame);
XLA_FFI_Error* pkm_xla_gpu_ragged_forward(XLA_FFI_CallFrame* frame);
XLA_FFI_Error* pkm_xla_gpu_ragged_backward(XLA_FFI_CallFrame* frame);
}

namespace pkm_xla {
XLA_FFI_REGISTER_HANDLER(::xla::ffi::GetXlaFfiApi(), kForwardTarget, "CUDA", pkm_xla_gpu_forward);
XLA_FFI_REGISTER_HANDLER(::xla::ffi::GetXlaFfiApi(), kBackwardTarget, "CUDA", pkm_xla_gpu_backward);
XLA_FFI_REGISTER_HANDLER(::xla::ffi::GetXlaFfiApi(), kRaggedForwardTarget, "CUDA", pkm_xla_gpu_ragged_forward);
XLA_FFI_REGISTER_HANDLER(::xla::ffi::GetXlaFfiApi(), kRaggedBackwardTarget, "CUDA", pkm_xla_gpu_ragged_backward);
}  // namespace pkm_xla

PKM_REGISTER_XLA_LOWERINGS(::tensorflow::DEVICE_GPU_XLA_JIT);

// Marker read by pkm_serve (ctypes): this library lowers the ops for XLA's GPU backend.
extern "C" __attribute__((visibility("default"))) int pkm_xla_has_gpu_target() { return 1; }

extern "C" __attribute__((visibility("default"))) int pkm_xla_register_late_gpu() {
  static const int added = pkm_xla::RegisterLoweringsLate(::tensorflow::DEVICE_GPU_XLA_JIT);
  return added;
}
