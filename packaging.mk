# Wheels: `make wheel` writes dist/pkm_serve-*.whl (TF wheel) and dist/pkm_serve_device-*.whl
# (TF-free device wheel) from the libraries `make build` produced; `make wheel-check` installs
# the TF wheel in a fresh venv and runs the README's habits there. Included by Makefile.
DIST          := dist
PACKAGING_STAMP := $(VENV)/.packaging-installed
TF_WHEEL_STAMP  := $(BUILDDIR)/wheel/.tf-built
DEVICE_WHEEL_STAMP := $(BUILDDIR)/wheel/.device-built

$(PACKAGING_STAMP): requirements-packaging.txt $(STAMP)
	$(PIP) install -q --disable-pip-version-check -r requirements-packaging.txt
	touch $@

wheel: wheel-tf wheel-device

wheel-tf: $(TF_WHEEL_STAMP)
wheel-device: $(DEVICE_WHEEL_STAMP)

# Both are prerequisites of `make test` (tests/packaging); rebuilt when what they pack changes.
PACKAGE_FILES := $(shell find pkm_serve -name '*.py' -not -path '*/__pycache__/*' 2>/dev/null)
$(TF_WHEEL_STAMP): $(PACKAGING_STAMP) $(TF_OP_LIB) $(TFLITE_LIB) $(PACKAGE_FILES) pyproject.toml \
		setup.py README.md packaging/build_wheels.py
	$(PY) packaging/build_wheels.py tf --dist $(DIST)
	@mkdir -p $(dir $@) && touch $@

$(DEVICE_WHEEL_STAMP): $(PACKAGING_STAMP) $(TFLITE_LIB) pkm_serve/__init__.py pkm_serve/tflite.py \
		packaging/device/pyproject.toml packaging/device/setup.py packaging/build_wheels.py
	$(PY) packaging/build_wheels.py device --dist $(DIST)
	@mkdir -p $(dir $@) && touch $@

# Fresh venv, nothing of the checkout on sys.path: pip install the TF wheel (+ serving, tflite
# extras), then the README tour, a .keras round trip, `pkm-serve export` and `pkm-serve serve`.
WHEEL_CHECK_VENV := $(BUILDDIR)/wheel-check-venv
wheel-check: $(TF_WHEEL_STAMP)
	rm -rf $(WHEEL_CHECK_VENV)
	$(PYTHON_BOOT) -m venv $(WHEEL_CHECK_VENV)
	$(WHEEL_CHECK_VENV)/bin/pip install -q --disable-pip-version-check \
		"$$(ls $(DIST)/pkm_serve-*.whl)[serving,tflite]"
	cd $(WHEEL_CHECK_VENV) && env -u PYTHONPATH $(abspath $(WHEEL_CHECK_VENV))/bin/python -I \
		$(abspath packaging/check_installed_wheel.py)

TEST_DEPS += $(TF_WHEEL_STAMP) $(DEVICE_WHEEL_STAMP)

.PHONY: wheel wheel-tf wheel-device wheel-check

# The device wheel for aarch64, from the cross-built delegate (tflite_delegate/aarch64.mk);
# tests/aarch64 installs it in the emulated aarch64 interpreter and runs the fixtures through it.
A64_DEVICE_WHEEL_STAMP := $(BUILDDIR)/wheel/.device-aarch64-built
$(A64_DEVICE_WHEEL_STAMP): $(PACKAGING_STAMP) $(A64_LIB) pkm_serve/__init__.py pkm_serve/tflite.py \
		packaging/device/pyproject.toml packaging/device/setup.py packaging/build_wheels.py
	$(PY) packaging/build_wheels.py device-aarch64 --dist $(DIST)
	@mkdir -p $(dir $@) && touch $@

wheel-device-aarch64: $(A64_DEVICE_WHEEL_STAMP)
test-aarch64 aarch64-test-deps: $(A64_DEVICE_WHEEL_STAMP)

.PHONY: wheel-device-aarch64
