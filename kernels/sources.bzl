"""The one list of pkm_serve's native sources and compile flags.

Read by the root BUILD and serving/tf_serving/BUILD.pkm_ops (`load`), and by
the Makefile: kernels/bzl_to_make.py turns every `NAME = [...]` below into a
make variable (build/sources.mk), so all three builds compile the same files
with the same flags. Paths are relative to the package that loads this file
(the repository root here; tensorflow_serving/custom_ops/pkm once staged).

Keep to plain lists of string literals (the Makefile's reader accepts nothing
else). To add a source file: append it to the list of its library below, then
run `make serving-cc-check`; tests/serving_cc/test_build_sources.py fails while
a .cc/.cu under kernels/ or tflite_delegate/ is in no list.
"""

# ---- the framework-free kernel core: in every production library ----------
PKM_CORE_SRCS = [
    "kernels/core/backward.cc",
    "kernels/core/bag_columns_avx512.cc",
    "kernels/core/bag_problem.cc",
    "kernels/core/bag_window.cc",
    "kernels/core/embedding_bag.cc",
    "kernels/core/forward.cc",
    "kernels/core/forward_int8.cc",
    "kernels/core/fused_optimizer.cc",
    "kernels/core/shape_rules.cc",
    "kernels/core/short_rows.cc",
    "kernels/core/table_pages.cc",
    "kernels/core/vector_ops.cc",
    "kernels/core/vector_ops_f16c.cc",
]

PKM_CORE_HDRS = [
    "kernels/core/bag_problem.h",
    "kernels/core/bag_window.h",
    "kernels/core/embedding_bag.h",
    "kernels/core/forward_int8.h",
    "kernels/core/fused_optimizer.h",
    "kernels/core/internal.h",
    "kernels/core/row_optimizer.h",
    "kernels/core/shape_rules.h",
    "kernels/core/short_rows.h",
    "kernels/core/table_pages.h",
    "kernels/core/vector_ops.h",
]

# The slow, obviously-correct reference: test builds only (the core test,
# the TFLite fuzz test, the C ABI library that the GPU tests compare against).
PKM_CORE_REFERENCE_SRCS = [
    "kernels/core/reference.cc",
]

PKM_CORE_TEST_SRCS = [
    "kernels/core/embedding_bag_test.cc",
]

# The shape/dtype rule set's own test program (make core-test runs both).
PKM_SHAPE_RULES_TEST_SRCS = [
    "kernels/core/shape_rules_test.cc",
]

# ---- TF op library (_pkm_ops.so; the cc_library linked into TF Serving) ----
PKM_TF_SRCS = [
    "kernels/tf/embedding_bag_ops.cc",
    "kernels/tf/embedding_bag_kernels.cc",
    "kernels/tf/quantized_embedding_bag_ops.cc",
    "kernels/tf/quantized_embedding_bag_kernels.cc",
    "kernels/tf/fused_optimizer_ops.cc",
]

# GPU kernels: compiled with -DGOOGLE_CUDA=1 (`make gpu`, --config=cuda); the
# file is empty without it.
PKM_TF_GPU_SRCS = [
    "kernels/tf/embedding_bag_gpu_kernels.cc",
    "kernels/tf/fused_optimizer_gpu_kernels.cc",
]

PKM_TF_HDRS = [
    "kernels/tf/embedding_bag_common.h",
    "kernels/tf/embedding_bag_kernel_template.h",
    "kernels/tf/embedding_bag_cpu_backend.h",
    "kernels/tf/quantized_embedding_bag_common.h",
    "kernels/tf/fused_optimizer_common.h",
]

# XLA lowering of the ops (tf2xla kernels) and their Host custom-call targets
# (typed FFI on the core): in the op library, which then links libtensorflow_cc.
PKM_XLA_SRCS = [
    "kernels/xla/embedding_bag_xla_cpu.cc",
    "kernels/xla/embedding_bag_xla_cpu_targets.cc",
    "kernels/xla/quantized_xla_cpu.cc",
    "kernels/xla/quantized_xla_cpu_targets.cc",
]

# The same for XLA_GPU_JIT on the CUDA launchers: GPU builds only.
PKM_XLA_GPU_SRCS = [
    "kernels/xla/embedding_bag_xla_gpu.cc",
    "kernels/xla/embedding_bag_xla_gpu_targets.cc",
]

PKM_XLA_HDRS = [
    "kernels/xla/embedding_bag_xla_ffi.h",
    "kernels/xla/embedding_bag_xla_lowering.h",
]

# ---- CUDA launchers (no TensorFlow header) --------------------------------
PKM_CUDA_SRCS = [
    "kernels/cuda/common.cu",
    "kernels/cuda/forward.cu",
    "kernels/cuda/forward_int8.cu",
    "kernels/cuda/backward.cu",
    "kernels/cuda/backward_positions.cu",
    "kernels/cuda/backward_rows.cu",
    "kernels/cuda/backward_single_rows.cu",
    "kernels/cuda/backward_sort.cu",
    "kernels/cuda/backward_weights.cu",
    "kernels/cuda/fused_optimizer.cu",
    "kernels/cuda/product_keys.cu",
]

PKM_CUDA_HDRS = [
    "kernels/cuda/embedding_bag_cuda.h",
]

# Included by the .cu files only.
PKM_CUDA_TEXTUAL_HDRS = [
    "kernels/cuda/backward.cuh",
    "kernels/cuda/backward_positions.cuh",
    "kernels/cuda/backward_rows.cuh",
    "kernels/cuda/backward_staged.cuh",
    "kernels/cuda/common.cuh",
]

# ---- C ABI for ctypes callers (GPU tests and benchmarks; test build) -------
PKM_CAPI_SRCS = [
    "kernels/capi/pkm_capi.cc",
]

PKM_CAPI_HDRS = [
    "kernels/capi/pkm_capi.h",
]

# ---- TFLite kernel + external delegate (libpkm_tflite.so, no TF) -----------
PKM_TFLITE_SRCS = [
    "tflite_delegate/flexbuffer_map.cc",
    "tflite_delegate/thread_pool.cc",
    "tflite_delegate/embedding_bag_tflite.cc",
    "tflite_delegate/op_options.cc",
    "tflite_delegate/custom_op.cc",
    "tflite_delegate/check_then_tflite.cc",
    "tflite_delegate/composite_chain.cc",
    "tflite_delegate/composite_shapes.cc",
    "tflite_delegate/delegate.cc",
]

PKM_TFLITE_HDRS = [
    "tflite_delegate/check_then_tflite.h",
    "tflite_delegate/composite_chain.h",
    "tflite_delegate/composite_shapes.h",
    "tflite_delegate/embedding_bag_tflite.h",
    "tflite_delegate/flexbuffer_map.h",
    "tflite_delegate/thread_pool.h",
    "tflite_delegate/tflite_abi.h",
]

PKM_TFLITE_TEST_SRCS = [
    "tflite_delegate/fuzz_test.cc",
]

# ---- compile flags ----------------------------------------------------------
PKM_CXXSTD = [
    "-std=c++17",
]

# The core and the TFLite library: hot loops, optimised hard. No errno from
# sqrt: nothing reads it, and a sqrt that may set it is never vectorised (the
# fused optimizers' Adam loop, kernels/core/fused_optimizer.cc).
PKM_CORE_COPTS = [
    "-O3",
    "-DNDEBUG",
    "-fno-math-errno",
    "-fvisibility=hidden",
    "-Wall",
    "-Wextra",
    "-Wno-unused-parameter",
]

# TF adapters: translation only, against TF's (deprecation-noisy) headers.
PKM_TF_COPTS = [
    "-O2",
    "-DNDEBUG",
    "-Wno-deprecated-declarations",
]
