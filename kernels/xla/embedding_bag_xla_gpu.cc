// The XLA GPU side of _pkm_ops_gpu.so (`make gpu`): the lowering registered
// for XLA_GPU_JIT, and the CUDA handlers of embedding_bag_xla_gpu_targets.cc
// registered with TF's XLA for the "CUDA" platform.
#include "kernels/xla/embedding_bag_xla_lowering.h"

PKM_REGISTER_XLA_PLATFORM(gpu, "CUDA", ::tensorflow::DEVICE_GPU_XLA_JIT);

// Marker read by pkm_serve (ctypes): this library lowers the ops for XLA's GPU backend.
extern "C" __attribute__((visibility("default"))) int pkm_xla_has_gpu_target() { return 1; }

// As pkm_xla_register_late (embedding_bag_xla_cpu.cc), for XLA_GPU_JIT.
extern "C" __attribute__((visibility("default"))) int pkm_xla_register_late_gpu() {
  static const int added = pkm_xla::RegisterLoweringsLate(::tensorflow::DEVICE_GPU_XLA_JIT);
  return added;
}
