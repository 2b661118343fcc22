# The linked-op C++ path (included by the top-level Makefile):
#
#   make serving-cc-check   build build/serving_cc/pkm_saved_model_run against the
#                           pip TF's libtensorflow_cc, then run tests/serving_cc
#                           (C++ outputs vs Python's on exported models)
#
# The op's objects are the very ones in _pkm_ops.so (same sources and flags,
# kernels/sources.bzl; the XLA lowering included), put in an archive and linked with --whole-archive:
# what cc_library(alwayslink = 1) does in tensorflow_model_server. Nothing
# dlopens an op library; `ldd` of the program shows no _pkm_ops.so.
CC_CHECK_DIR     := $(BUILDDIR)/serving_cc
CC_CHECK_BIN     := $(CC_CHECK_DIR)/pkm_saved_model_run
CC_CHECK_OPS_LIB := $(CC_CHECK_DIR)/libpkm_ops.a
TF_LIBDIR         = $(patsubst -L%,%,$(firstword $(filter -L%,$(TF_LFLAGS))))

$(CC_CHECK_OPS_LIB): $(TF_OBJS) $(XLA_CPU_OBJ) $(CORE_OBJS)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^

$(CC_CHECK_DIR)/saved_model_run.o: serving/cc_check/saved_model_run.cc $(STAMP)
	@mkdir -p $(dir $@)
	$(CXX) $(PKM_CXXSTD) $(PKM_TF_COPTS) -I. $(TF_CFLAGS) -c $< -o $@

# --no-as-needed: the program calls nothing in libtensorflow_cc by name, but
# the kernels of every stock op (MatMul, TopKV2, ...) register from it.
$(CC_CHECK_BIN): $(CC_CHECK_DIR)/saved_model_run.o $(CC_CHECK_OPS_LIB)
	$(CXX) $< -Wl,--whole-archive $(CC_CHECK_OPS_LIB) -Wl,--no-whole-archive \
	    -Wl,--no-as-needed -L$(TF_LIBDIR) -l:libtensorflow_cc.so.2 $(TF_LFLAGS) -Wl,-rpath,$(TF_LIBDIR) \
	    -lpthread -o $@

# The control: the same link without --whole-archive. Nothing references the
# kernels' objects by name, so the linker drops them and the ops never
# register; tests/serving_cc builds it to show the check above can fail.
CC_CHECK_CONTROL_BIN := $(CC_CHECK_DIR)/pkm_saved_model_run_no_whole_archive
$(CC_CHECK_CONTROL_BIN): $(CC_CHECK_DIR)/saved_model_run.o $(CC_CHECK_OPS_LIB)
	$(CXX) $< $(CC_CHECK_OPS_LIB) \
	    -Wl,--no-as-needed -L$(TF_LIBDIR) -l:libtensorflow_cc.so.2 $(TF_LFLAGS) -Wl,-rpath,$(TF_LIBDIR) \
	    -lpthread -o $@

serving-cc-program: $(CC_CHECK_BIN)

# In `make test` too: compiling and linking the program takes ~30 s on 2 cores,
# and pytest then runs tests/serving_cc with the rest of the suite.
TEST_DEPS += $(CC_CHECK_BIN)

# Latency of the C++ session run beside the Python paths (results: bench/results/serving_cc_latency_*).
bench-serving-cc: build $(CC_CHECK_BIN)
	$(PY) bench/serving_cc_latency.py

serving-cc-check: build $(CC_CHECK_BIN)
	$(PY) -m pytest -q tests/serving_cc $(PYTEST_ARGS)

# `make -s print-VAR`: a variable as make resolves it (tests/serving_cc checks
# the Makefile reads kernels/sources.bzl).
print-%:
	@echo $($*)

.PHONY: serving-cc-program serving-cc-check bench-serving-cc
