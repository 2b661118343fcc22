# The JAX and PyTorch Keras backends (pkm_serve/backends; included by the top-level Makefile).
# Their tests (tests/backends) need jax and torch, pinned in requirements-backends.lock, and the
# TF-free native libraries: the XLA Host handlers for JAX (libpkm_xla_cpu.so, kernels/xla/xla.mk)
# and the C ABI for PyTorch (libpkm_capi_cpu.so, kernels/cuda/cuda.mk). CUDA: `make gpu`.
BACKENDS_STAMP := $(VENV)/.backends-installed

$(BACKENDS_STAMP): requirements-backends.lock $(STAMP)
	$(PIP) install -q --disable-pip-version-check -r requirements-backends.lock
	touch $@

backends-deps: $(BACKENDS_STAMP) $(XLA_CPU_TARGETS_LIB) $(PKM_CAPI_CPU_LIB)

TEST_DEPS += $(BACKENDS_STAMP) $(XLA_CPU_TARGETS_LIB) $(PKM_CAPI_CPU_LIB)

.PHONY: backends-deps

# The TF-free Keras wheel (layers + backends + these libraries; CUDA ones when built):
# dist/pkm_serve_keras-*.whl, installed and run by tests/backends/test_keras_wheel.py.
# The target is the wheel file itself (fixed platform tag), so a wheel missing from dist/ is rebuilt.
KERAS_WHEEL := $(DIST)/pkm_serve_keras-$(shell sed -n 's/^version = "\(.*\)"/\1/p' \
		packaging/keras/pyproject.toml)-py3-none-manylinux_2_35_x86_64.whl
KERAS_WHEEL_LIBS := $(XLA_CPU_TARGETS_LIB) $(PKM_CAPI_CPU_LIB) $(wildcard $(XLA_GPU_TARGETS_LIB) $(PKM_CUDA_LIB))
$(KERAS_WHEEL): $(PACKAGING_STAMP) $(KERAS_WHEEL_LIBS) $(shell find pkm_serve/backends pkm_serve/layers \
		-name '*.py' 2>/dev/null) pkm_serve/__init__.py pkm_serve/product_keys.py \
		packaging/keras/pyproject.toml packaging/tf_free_wheel_setup.py packaging/build_keras_wheel.py \
		packaging/build_wheels.py
	$(PY) packaging/build_keras_wheel.py --dist $(DIST)

wheel-keras: $(KERAS_WHEEL)
wheel: wheel-keras
TEST_DEPS += $(KERAS_WHEEL)

.PHONY: wheel-keras
