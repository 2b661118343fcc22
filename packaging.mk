# Wheels: `make wheel` writes dist/pkm_serve-*.whl (TF wheel) and dist/pkm_serve_device-*.whl
# (TF-free device wheel) from the libraries `make build` produced; `make wheel-check` installs
# the TF wheel in a fresh venv and runs the README's habits there (also part of `make test`:
# tests/packaging/test_installed_wheel.py). Included by Makefile.
DIST          := dist
PACKAGING_STAMP := $(VENV)/.packaging-installed

$(PACKAGING_STAMP): requirements-packaging.txt $(STAMP)
	$(PIP) install -q --disable-pip-version-check -r requirements-packaging.txt
	touch $@

# The targets are the wheel files themselves (build_wheels.py names them: fixed platform
# tags), so a wheel missing from dist/ is rebuilt, not only a changed one.
WHEEL_PATHS      := $(shell $(PYTHON_BOOT) packaging/build_wheels.py names --dist $(DIST))
TF_WHEEL         := $(word 1,$(WHEEL_PATHS))
DEVICE_WHEEL     := $(word 2,$(WHEEL_PATHS))
A64_DEVICE_WHEEL := $(word 3,$(WHEEL_PATHS))

wheel: wheel-tf wheel-device

wheel-tf: $(TF_WHEEL)
wheel-device: $(DEVICE_WHEEL)

# Both are prerequisites of `make test` (tests/packaging); rebuilt when what they pack changes.
PACKAGE_FILES := $(shell find pkm_serve -name '*.py' -not -path '*/__pycache__/*' 2>/dev/null)
$(TF_WHEEL): $(PACKAGING_STAMP) $(TF_OP_LIB) $(TFLITE_LIB) $(PACKAGE_FILES) pyproject.toml \
		setup.py README.md packaging/build_wheels.py
	$(PY) packaging/build_wheels.py tf --dist $(DIST)

$(DEVICE_WHEEL): $(PACKAGING_STAMP) $(TFLITE_LIB) pkm_serve/__init__.py pkm_serve/tflite.py pkm_serve/tflite_cli.py pkm_serve/tflite_model.py pkm_serve/tflite_metadata.py pkm_serve/tflite_report.py \
		packaging/device/pyproject.toml packaging/tf_free_wheel_setup.py packaging/build_wheels.py
	$(PY) packaging/build_wheels.py device --dist $(DIST)

# Fresh venv, nothing of the checkout on sys.path: pip install the TF wheel (+ serving, tflite
# extras), then packaging/check_installed_wheel.py (README tour, .keras round trips, `pkm-serve
# export --tflite`, `pkm-serve serve`). The same test `make test` runs.
wheel-check: $(TF_WHEEL)
	$(PY) -m pytest -q tests/packaging/test_installed_wheel.py $(PYTEST_ARGS)

TEST_DEPS += $(TF_WHEEL) $(DEVICE_WHEEL)

.PHONY: wheel wheel-tf wheel-device wheel-check

# The device wheel for aarch64, from the cross-built delegate (tflite_delegate/aarch64.mk);
# tests/aarch64 installs it in the emulated aarch64 interpreter and runs the fixtures through it.
$(A64_DEVICE_WHEEL): $(PACKAGING_STAMP) $(A64_LIB) pkm_serve/__init__.py pkm_serve/tflite.py pkm_serve/tflite_cli.py pkm_serve/tflite_model.py pkm_serve/tflite_metadata.py pkm_serve/tflite_report.py \
		packaging/device/pyproject.toml packaging/tf_free_wheel_setup.py packaging/build_wheels.py
	$(PY) packaging/build_wheels.py device-aarch64 --dist $(DIST)

wheel-device-aarch64: $(A64_DEVICE_WHEEL)
test-aarch64 aarch64-test-deps: $(A64_DEVICE_WHEEL)

.PHONY: wheel-device-aarch64
