# Serving load-test tools (owned by the serving part): C load generators on loopback.
#   make serving-load-tools   installs Debian's wrk (REST) and h2load (gRPC) if missing
#   make bench-serving        the bounded serving load benchmark (not part of `make test`)
SERVING_LOAD_PKGS := wrk nghttp2-client

serving-load-tools:
	@missing=""; \
	command -v wrk >/dev/null || missing="$$missing wrk"; \
	command -v h2load >/dev/null || missing="$$missing nghttp2-client"; \
	if [ -n "$$missing" ]; then \
	  echo "installing$$missing (Debian)"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -q && $$SUDO apt-get install -y -q --no-install-recommends $$missing; \
	fi

bench-serving: setup serving-load-tools
	$(PIP) install -q --disable-pip-version-check -r bench/requirements.txt
	$(PY) bench/serving_load.py $(SERVING_BENCH_ARGS)

# Server RSS of a 512 MiB-table model: fp32 SavedModel, int8 .tflite, int8 SavedModel
# (bench/serving_memory.py; ~10 min, mostly the .tflite conversion; not part of `make test`)
bench-serving-memory: setup
	$(PY) bench/serving_memory.py $(SERVING_MEMORY_ARGS)

.PHONY: serving-load-tools bench-serving bench-serving-memory

# `make bench` runs bench/serving_load.py too: it needs the load generators first.
bench: serving-load-tools
