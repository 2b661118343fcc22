# GPU part of the build (included by the top-level Makefile). Nothing here is
# in BUILD_TARGETS: `make setup` / `make build` never need nvcc.
#
#   make gpu            libpkm_cuda.so (CUDA launchers + core CPU reference,
#                       C ABI for ctypes) and _pkm_ops_gpu.so (the TF op
#                       library with CPU and GPU kernels, -DGOOGLE_CUDA=1)
#   make gpu-standalone only libpkm_cuda.so (what tests/gpu and the bench need;
#                       no TensorFlow required)
#   make capi-cpu       libpkm_capi_cpu.so: the C ABI without CUDA (no nvcc;
#                       in TEST_DEPS for tests/capi/test_capi_cpu_abi.py)
NVCC       ?= nvcc
# Ask nvcc where its toolkit is (it may be a wrapper script on the PATH).
CUDA_HOME  ?= $(shell $(NVCC) --dryrun -c -x cu /dev/null 2>&1 | sed -n 's/^\#\$$ TOP=//p' | head -n1)
NVCC_EXTRA ?=
CUDA_ARCH  ?= -gencode arch=compute_90,code=sm_90 -gencode arch=compute_90,code=compute_90
NVCC_FLAGS := -std=c++17 -O3 -DNDEBUG $(CUDA_ARCH) -I. -Xcompiler -fPIC,-fvisibility=hidden \
              -Xptxas -warn-spills $(NVCC_EXTRA)
CUDA_DIR   := kernels/cuda
CUDA_SRCS  := $(PKM_CUDA_SRCS)
CUDA_HDRS  := $(PKM_CUDA_HDRS) $(PKM_CUDA_TEXTUAL_HDRS) kernels/core/bag_problem.h
CUDA_OBJS  := $(patsubst $(CUDA_DIR)/%.cu,$(BUILDDIR)/cuda/%.o,$(CUDA_SRCS))
# cudart is linked statically: the libraries then load next to any CUDA
# runtime (TF's, PyTorch's) and share the driver's primary context.
CUDA_LIBS   = -L$(CUDA_HOME)/lib64 -L$(CUDA_HOME)/targets/x86_64-linux/lib -lcudart_static -ldl -lpthread -lrt

PKM_CUDA_LIB := $(LIBDIR)/libpkm_cuda.so
PKM_CAPI_CPU_LIB := $(LIBDIR)/libpkm_capi_cpu.so
TF_GPU_OP_LIB := $(LIBDIR)/_pkm_ops_gpu.so
TF_GPU_KERNEL_OBJS := $(patsubst kernels/tf/%.cc,$(BUILDDIR)/tf_gpu/%.o,$(PKM_TF_GPU_SRCS))

$(BUILDDIR)/cuda/%.o: $(CUDA_DIR)/%.cu $(CUDA_HDRS)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCC_FLAGS) -c $< -o $@

$(BUILDDIR)/capi/pkm_capi_cuda.o: kernels/capi/pkm_capi.cc kernels/capi/pkm_capi.h $(CORE_HDRS) $(CUDA_DIR)/embedding_bag_cuda.h
	@mkdir -p $(dir $@)
	$(CXX) $(CXXSTD) $(OPT) $(WARN) $(PIC) -DPKM_CAPI_WITH_CUDA -I. -c $< -o $@

$(BUILDDIR)/capi/pkm_capi_cpu.o: kernels/capi/pkm_capi.cc kernels/capi/pkm_capi.h $(CORE_HDRS) $(CUDA_DIR)/embedding_bag_cuda.h
	@mkdir -p $(dir $@)
	$(CXX) $(CXXSTD) $(OPT) $(WARN) $(PIC) -I. -c $< -o $@

$(PKM_CUDA_LIB): $(BUILDDIR)/capi/pkm_capi_cuda.o $(CUDA_OBJS) $(CORE_OBJS) $(CORE_REFERENCE_OBJS)
	@mkdir -p $(LIBDIR)
	$(CXX) -shared $^ -o $@ $(CUDA_LIBS) -Wl,--no-undefined

$(PKM_CAPI_CPU_LIB): $(BUILDDIR)/capi/pkm_capi_cpu.o $(CORE_OBJS) $(CORE_REFERENCE_OBJS)
	@mkdir -p $(LIBDIR)
	$(CXX) -shared $^ -o $@ -Wl,--no-undefined

# The TF GPU kernels: g++ with TF's headers and GOOGLE_CUDA=1; the CUDA
# translation units above never see a TF header.
$(BUILDDIR)/tf_gpu/%.o: kernels/tf/%.cc $(CORE_HDRS) $(wildcard kernels/tf/*.h) $(CUDA_DIR)/embedding_bag_cuda.h $(STAMP)
	@mkdir -p $(dir $@)
	$(CXX) $(PKM_CXXSTD) $(PKM_TF_COPTS) $(PIC) -DGOOGLE_CUDA=1 -I. $(TF_CFLAGS) -c $< -o $@

$(TF_GPU_OP_LIB): $(TF_GPU_KERNEL_OBJS) $(TF_OBJS) $(CUDA_OBJS) $(CORE_OBJS)
	@mkdir -p $(LIBDIR)
	$(CXX) -shared $^ -o $@ $(TF_LFLAGS) $(CUDA_LIBS) -Wl,--no-undefined

# The CPU build of the C ABI needs no nvcc; its ctypes test runs in CI.
TEST_DEPS += $(PKM_CAPI_CPU_LIB)

gpu-standalone: $(PKM_CUDA_LIB)
gpu: $(PKM_CUDA_LIB) $(TF_GPU_OP_LIB)
capi-cpu: $(PKM_CAPI_CPU_LIB)

.PHONY: gpu gpu-standalone capi-cpu
