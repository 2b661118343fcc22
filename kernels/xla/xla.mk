# XLA lowering of the PkmEmbeddingBag ops (included by the top-level Makefile).
#  - embedding_bag_xla_cpu_targets.cc: the "Host" custom-call targets (typed
#    FFI on the core; XLA's public FFI header only, no TF) and
#    embedding_bag_xla_cpu.cc: tf2xla kernels for XLA_CPU_JIT + their
#    registration with TF's XLA; both linked into the op library _pkm_ops.so, which then
#    also links libtensorflow_cc.so.2 (XlaOpKernel, XlaOpRegistrar live there;
#    the Python process has it loaded already through TF's pywrap module).
#  - embedding_bag_xla_gpu_targets.cc: the "CUDA" targets (typed FFI on the
#    CUDA launchers; XLA's public FFI header only, no TF) and
#    embedding_bag_xla_gpu.cc: XLA_GPU_JIT kernels + their registration with
#    TF's XLA; both only in _pkm_ops_gpu.so (`make gpu`). `make gpu` also
#    builds libpkm_xla_gpu.so: the targets alone (no TF), for the GPU test
#    that runs them under JAX's XLA (tests/xla/test_xla_ffi_targets.py).
XLA_DIR     := kernels/xla
XLA_HDRS    := $(PKM_XLA_HDRS) $(PKM_TF_HDRS) $(CORE_HDRS)
# Sources come from kernels/sources.bzl (PKM_XLA_SRCS, PKM_XLA_GPU_SRCS).
XLA_CPU_OBJ := $(patsubst $(XLA_DIR)/%.cc,$(BUILDDIR)/xla/%.o,$(PKM_XLA_SRCS))
XLA_CPU_TARGETS_LIB := $(LIBDIR)/libpkm_xla_cpu.so
XLA_GPU_TARGETS_OBJ := $(BUILDDIR)/xla/embedding_bag_xla_gpu_targets.o
XLA_GPU_OBJ := $(filter-out $(XLA_GPU_TARGETS_OBJ),$(patsubst $(XLA_DIR)/%.cc,$(BUILDDIR)/xla/%.o,$(PKM_XLA_GPU_SRCS)))
XLA_GPU_TARGETS_LIB := $(LIBDIR)/libpkm_xla_gpu.so
XLA_LFLAGS   = -l:libtensorflow_cc.so.2
# XLA's headers include highwayhash and farmhash, which the pip TF ships
# under include/external/.
TF_INCLUDE   = $(patsubst -I%,%,$(filter -I%,$(TF_CFLAGS)))
XLA_CFLAGS   = $(TF_CFLAGS) -I$(TF_INCLUDE)/external/highwayhash -I$(TF_INCLUDE)/external/farmhash_archive/src

# The tf2xla kernels only build HLO when a graph is compiled: -O1 there (XLA's headers
# made embedding_bag_xla_cpu.cc take 54 s of CPU at -O2, 40 s at -O1, in every set-up).
# The custom-call targets run the kernels and keep PKM_TF_COPTS.
XLA_LOWERING_OBJS := $(filter-out %_targets.o,$(XLA_CPU_OBJ) $(XLA_GPU_OBJ))
$(XLA_LOWERING_OBJS): XLA_OPT := -O1

$(BUILDDIR)/xla/%.o: $(XLA_DIR)/%.cc $(XLA_HDRS) $(STAMP)
	@mkdir -p $(dir $@)
	$(CXX) $(PKM_CXXSTD) $(PKM_TF_COPTS) $(XLA_OPT) $(PIC) -I. $(XLA_CFLAGS) -c $< -o $@

$(TF_OP_LIB): $(XLA_CPU_OBJ)
$(TF_OP_LIB): TF_LFLAGS += $(XLA_LFLAGS)

$(TF_GPU_OP_LIB): $(XLA_CPU_OBJ) $(XLA_GPU_OBJ) $(XLA_GPU_TARGETS_OBJ)
$(TF_GPU_OP_LIB): TF_LFLAGS += $(XLA_LFLAGS)

$(XLA_GPU_TARGETS_LIB): $(XLA_GPU_TARGETS_OBJ) $(CUDA_OBJS) $(CORE_OBJS)
	@mkdir -p $(LIBDIR)
	$(CXX) -shared $^ -o $@ $(CUDA_LIBS) -Wl,--no-undefined

gpu: $(XLA_GPU_TARGETS_LIB)

# The Host targets alone (no TF), for running them under another XLA runtime
# (tests/xla/test_xla_ffi_targets.py does on "cpu" where JAX is installed).
$(XLA_CPU_TARGETS_LIB): $(BUILDDIR)/xla/embedding_bag_xla_cpu_targets.o $(CORE_OBJS)
	@mkdir -p $(LIBDIR)
	$(CXX) -shared $^ -o $@ -lpthread -Wl,--no-undefined

xla-targets-cpu: $(XLA_CPU_TARGETS_LIB)
.PHONY: xla-targets-cpu

# The XLA benchmark (fused under XLA vs fused outside XLA vs composite under
# XLA; a few minutes): writes bench/results/xla_embedding_bag.{json,md}.
bench-xla: setup
	$(PY) bench/xla_embedding_bag.py

.PHONY: bench-xla
