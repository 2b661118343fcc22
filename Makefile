# pkm_serve build. Two commands matter on a fresh machine:
#   make demo   set up (venv, pinned deps, native libraries) and run the end-to-end demo
#   make test   set up and run the test suite
# Everything is idempotent: a second run only rebuilds what changed.
SHELL := /bin/bash
.DEFAULT_GOAL := build

PYTHON_BOOT ?= python3
VENV     := .venv
PY       := $(VENV)/bin/python
PIP      := $(VENV)/bin/pip
LIBDIR   := pkm_serve/lib
BUILDDIR := build
STAMP    := $(VENV)/.installed

CXX      ?= g++
CXXSTD   := -std=c++17
OPT      := -O3 -DNDEBUG
WARN     := -Wall -Wextra -Wno-unused-parameter
PIC      := -fPIC

# ---- the one list of native sources and flags ----------------------------
# kernels/sources.bzl, which the root BUILD and serving/tf_serving/BUILD.pkm_ops
# load too; its lists become the PKM_* make variables here.
include $(BUILDDIR)/sources.mk
$(BUILDDIR)/sources.mk: kernels/sources.bzl kernels/bzl_to_make.py
	@mkdir -p $(dir $@)
	$(PYTHON_BOOT) kernels/bzl_to_make.py $< > $@.tmp && mv $@.tmp $@

# ---- the framework-free kernel core (shared by every runtime) -------------
CORE_DIR  := kernels/core
CORE_SRCS := $(PKM_CORE_SRCS)
CORE_HDRS := $(PKM_CORE_HDRS)
CORE_CXXFLAGS := $(PKM_CXXSTD) $(PKM_CORE_COPTS) $(PIC) -I.

# Fragments add their libraries to BUILD_TARGETS and what tests need to TEST_DEPS.
BUILD_TARGETS :=
TEST_DEPS :=

# ---- Python environment ---------------------------------------------------
$(STAMP): requirements.lock pyproject.toml
	rm -f $(TF_FLAGS_FILE)
	test -x $(PY) || $(PYTHON_BOOT) -m venv $(VENV)
	$(PIP) install -q --disable-pip-version-check -r requirements.lock
	$(PIP) install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $@

venv: $(STAMP)

# ---- TF custom-op library ---------------------------------------------------
# TF's compile and link flags, asked of the venv's TF once and kept beside it (each ask imports
# TF, ~5 s: asked at every expansion, a fresh set-up spent over two minutes of CPU on them);
# written through a temporary file, as parallel jobs may ask at once; a new venv asks again.
TF_FLAGS_FILE := $(VENV)/.tf_flags
tf_flags = $(shell { test -s $(TF_FLAGS_FILE) || { $(PY) -c 'import tensorflow as tf; \
	print(" ".join(tf.sysconfig.get_compile_flags())); print(" ".join(tf.sysconfig.get_link_flags()))' \
	> $(TF_FLAGS_FILE).$$$$ && mv $(TF_FLAGS_FILE).$$$$ $(TF_FLAGS_FILE); rm -f $(TF_FLAGS_FILE).$$$$; }; \
	sed -n $(1)p $(TF_FLAGS_FILE); } 2>/dev/null)
TF_CFLAGS = $(call tf_flags,1)
TF_LFLAGS = $(call tf_flags,2)
# CPU kernels only; the GPU kernels (*_gpu_kernels.cc) are built by `make gpu`.
TF_OP_SRCS := $(PKM_TF_SRCS)
TF_OP_LIB  := $(LIBDIR)/_pkm_ops.so

$(BUILDDIR)/core/%.o: $(CORE_DIR)/%.cc $(CORE_HDRS)
	@mkdir -p $(dir $@)
	$(CXX) $(CORE_CXXFLAGS) -c $< -o $@

CORE_OBJS := $(patsubst $(CORE_DIR)/%.cc,$(BUILDDIR)/core/%.o,$(CORE_SRCS))
# The reference implementation: linked into test programs only.
CORE_REFERENCE_OBJS := $(patsubst $(CORE_DIR)/%.cc,$(BUILDDIR)/core/%.o,$(PKM_CORE_REFERENCE_SRCS))

$(BUILDDIR)/tf/%.o: kernels/tf/%.cc $(CORE_HDRS) $(PKM_TF_HDRS) $(STAMP)
	@mkdir -p $(dir $@)
	$(CXX) $(PKM_CXXSTD) $(PKM_TF_COPTS) $(PIC) -I. $(TF_CFLAGS) -c $< -o $@

TF_OBJS := $(patsubst kernels/tf/%.cc,$(BUILDDIR)/tf/%.o,$(TF_OP_SRCS))

$(TF_OP_LIB): $(TF_OBJS) $(CORE_OBJS)
	@mkdir -p $(LIBDIR)
	$(CXX) -shared $^ -o $@ $(TF_LFLAGS) -Wl,--no-undefined -Wl,-z,defs

BUILD_TARGETS += $(TF_OP_LIB)
TEST_DEPS += $(TF_OP_LIB)

# ---- core C++ tests (reference vs fast on random shapes) --------------------
CORE_TEST := $(BUILDDIR)/core_test
$(CORE_TEST): $(PKM_CORE_TEST_SRCS) $(CORE_OBJS) $(CORE_REFERENCE_OBJS) $(CORE_HDRS)
	$(CXX) $(CXXSTD) -O2 -I. $< $(CORE_OBJS) $(CORE_REFERENCE_OBJS) -o $@ -lpthread

SHAPE_RULES_TEST := $(BUILDDIR)/shape_rules_test
$(SHAPE_RULES_TEST): $(PKM_SHAPE_RULES_TEST_SRCS) $(CORE_OBJS) $(CORE_HDRS)
	$(CXX) $(CXXSTD) -O2 -I. $< $(CORE_OBJS) -o $@ -lpthread

core-test: $(CORE_TEST) $(SHAPE_RULES_TEST)
	$(CORE_TEST)
	$(SHAPE_RULES_TEST)

# ---- fragments owned by the GPU and TFLite parts (`include`: a missing one is an error) ---
include kernels/cuda/cuda.mk
include tflite_delegate/tflite.mk
include tflite_delegate/aarch64.mk
include kernels/xla/xla.mk
include serving/cc_check.mk
include bench/scale.mk
include packaging.mk
include backends.mk
include bench/serving.mk
include tests/export/models.mk

# ---- entry points -----------------------------------------------------------
build: $(STAMP) $(BUILD_TARGETS)
setup: build

# Set-up runs one make job per core and pytest one worker per core (pytest-xdist, a
# module per worker at a time: module fixtures are built once; modules in tests/conftest.py's
# order, slow ones first, not xdist's by test count). JOBS=1 / PYTEST_WORKERS=0 run them serially. The 30 slowest test phases are listed at the end (the suite's time budget).
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
PYTEST_WORKERS ?= $(JOBS)
PYTEST_PARALLEL = $(if $(filter-out 0 1,$(PYTEST_WORKERS)),-n $(PYTEST_WORKERS) --dist loadscope --no-loadscope-reorder)

test-deps: setup $(TEST_DEPS) $(CORE_TEST) $(SHAPE_RULES_TEST)

test:
	$(MAKE) --no-print-directory -j$(JOBS) test-deps
	$(CORE_TEST)
	$(SHAPE_RULES_TEST)
	$(PY) -m pytest -q tests $(PYTEST_PARALLEL) --durations=30 $(PYTEST_ARGS)

demo:
	$(MAKE) --no-print-directory -j$(JOBS) setup
	$(VENV)/bin/pkm-serve demo

# Every CPU benchmark (the GPU one runs on a GPU machine: bench/gpu_embedding_bag.py),
# then the report. Each writes its results under bench/results/.
bench: setup
	$(PIP) install -q --disable-pip-version-check -r bench/requirements.txt
	$(PY) bench/cpu_embedding_bag.py
	$(PY) bench/tflite_embedding_bag.py
	$(PY) bench/pkm_layer.py
	$(PY) bench/export_memory.py
	$(PY) bench/serving_load.py
	$(MAKE) bench-report

bench-report: $(STAMP)
	$(PY) bench/report.py

clean:
	rm -rf $(BUILDDIR) $(LIBDIR)

.PHONY: build setup venv test test-deps demo bench bench-report clean core-test
