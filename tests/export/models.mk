# Test dependencies of the export corpus (tests/export/test_export_library_models.py):
# the model libraries of requirements-models.lock, into the project venv.
MODELS_STAMP := $(VENV)/.models-installed
$(MODELS_STAMP): requirements-models.lock $(STAMP)
	$(PIP) install -q --disable-pip-version-check --no-deps -r requirements-models.lock
	touch $@

TEST_DEPS += $(MODELS_STAMP)
