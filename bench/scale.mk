# Scaling-out benchmarks (issue #18), included by the top-level Makefile.
# Long and memory-hungry (a 1 GiB table; the PKM step holds ~1.6 GB of table
# and Adam slots per framework, one process at a time): never part of `make test`.
#   make bench-scale   dense vs sparse gradient crossover, PS 1 vs 2 shards,
#                      PKM training step with Adam against PyTorch
bench-scale: setup
	$(PIP) install -q --disable-pip-version-check -r bench/requirements.txt
	$(PY) bench/sparse_gradient.py
	$(PY) bench/pkm_step_vs_torch.py

.PHONY: bench-scale
