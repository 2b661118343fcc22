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
