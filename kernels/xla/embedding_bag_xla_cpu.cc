// The XLA CPU side of the op library: the lowering registered for
// XLA_CPU_JIT, and the Host handlers of embedding_bag_xla_cpu_targets.cc
// registered with TF's XLA.
#include "kernels/xla/embedding_bag_xla_lowering.h"

PKM_REGISTER_XLA_PLATFORM(cpu, "Host", ::tensorflow::DEVICE_CPU_XLA_JIT);

// Marker read by pkm_serve (ctypes): this library lowers the ops for XLA's
// CPU backend. The GPU library also exports pkm_xla_has_gpu_target.
extern "C" __attribute__((visibility("default"))) int pkm_xla_has_cpu_target() { return 1; }

// See RegisterLoweringsLate (embedding_bag_xla_lowering.h). Called by
// pkm_serve after tf.load_op_library; returns 1 when it had to add the kernels.
extern "C" __attribute__((visibility("default"))) int pkm_xla_register_late() {
  static const int added = pkm_xla::RegisterLoweringsLate(::tensorflow::DEVICE_CPU_XLA_JIT);
  return added;
}
