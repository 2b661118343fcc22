# TFLite kernel + external delegate (libpkm_tflite.so), its ASan fuzz test and
# the TF-free device-like venv the tests run models in. Included by Makefile.
TFLITE_DIR     := tflite_delegate
TFLITE_SRCS    := $(PKM_TFLITE_SRCS)
TFLITE_HDRS    := $(wildcard $(TFLITE_DIR)/*.h)
TFLITE_LIB     := $(LIBDIR)/libpkm_tflite.so
TFLITE_OBJS    := $(patsubst $(TFLITE_DIR)/%.cc,$(BUILDDIR)/tflite/%.o,$(TFLITE_SRCS))
TFLITE_CXXFLAGS := $(PKM_CXXSTD) $(PKM_CORE_COPTS) $(PIC) -I.

$(BUILDDIR)/tflite/%.o: $(TFLITE_DIR)/%.cc $(TFLITE_HDRS) $(CORE_HDRS)
	@mkdir -p $(dir $@)
	$(CXX) $(TFLITE_CXXFLAGS) -c $< -o $@

# Links no TensorFlow/TFLite library: only libstdc++/libc/libm/pthread.
$(TFLITE_LIB): $(TFLITE_OBJS) $(CORE_OBJS)
	@mkdir -p $(LIBDIR)
	$(CXX) -shared $^ -o $@ -Wl,--no-undefined -Wl,-z,defs -lpthread

# Fuzz test of Prepare/Invoke on random tensors, under AddressSanitizer + UBSan.
# One object per source at -O0 (the sanitizers check every access at any
# level): built by `make -j` with the rest of TEST_DEPS, ~70 s of compiler time
# on the 2-core CI host where one -O1 compile of all of them took ~210 s.
TFLITE_FUZZ   := $(BUILDDIR)/tflite/fuzz_asan
SAN_FLAGS     := -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer
FUZZ_SRCS     := $(TFLITE_DIR)/fuzz_test.cc $(TFLITE_SRCS) $(CORE_SRCS) $(PKM_CORE_REFERENCE_SRCS)
FUZZ_OBJS     := $(patsubst %.cc,$(BUILDDIR)/asan/%.o,$(FUZZ_SRCS))
$(BUILDDIR)/asan/%.o: %.cc $(TFLITE_HDRS) $(CORE_HDRS)
	@mkdir -p $(dir $@)
	$(CXX) $(CXXSTD) -O0 -g $(SAN_FLAGS) -I. -c $< -o $@
$(TFLITE_FUZZ): $(FUZZ_OBJS)
	@mkdir -p $(dir $@)
	$(CXX) $(SAN_FLAGS) $^ -o $@ -lpthread

FUZZ_ITERS ?= 20000
asan-tflite: $(TFLITE_FUZZ)
	ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 $(TFLITE_FUZZ) $(FUZZ_ITERS)

# Device-like environment: tflite_runtime 2.14 + numpy<2, no TensorFlow.
TFLITE_RT_VENV  := .venv-tflite-runtime
TFLITE_RT_STAMP := $(TFLITE_RT_VENV)/.installed
$(TFLITE_RT_STAMP): requirements-tflite-runtime.txt
	test -x $(TFLITE_RT_VENV)/bin/python || $(PYTHON_BOOT) -m venv $(TFLITE_RT_VENV)
	$(TFLITE_RT_VENV)/bin/pip install -q --disable-pip-version-check -r requirements-tflite-runtime.txt
	touch $@

tflite-runtime-venv: $(TFLITE_RT_STAMP)

BUILD_TARGETS += $(TFLITE_LIB)
TEST_DEPS += $(TFLITE_LIB) $(TFLITE_RT_STAMP) $(TFLITE_FUZZ)

.PHONY: asan-tflite tflite-runtime-venv
