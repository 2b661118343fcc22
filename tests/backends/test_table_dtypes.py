"""Float64 tables in the Keras layers, the same on every backend: a TypeError at construction
naming the table dtype and what to use. Before, TensorFlow and PyTorch refused at the first call
(PyTorch's composite instead computed a float64 table in float32), and JAX without
jax_enable_x64 computed in float32 while the layer said float64."""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import pytest  # noqa: E402

from tests.backends import table_dtype_checks  # noqa: E402
from tests.backends.check_processes import finish, installed, start  # noqa: E402


@pytest.mark.slow
def test_float64_tables_get_one_clear_refusal_on_every_backend():
    # JAX without jax_enable_x64 (its default) is the backend that computed silently in float32.
    procs = {backend: start(backend, [], module="table_dtype_checks") for backend in ("jax", "torch")
             if installed(backend)}
    if not procs:
        pytest.skip("needs the JAX or PyTorch Keras backend")
    reference = {name: table_dtype_checks.outcome(way) for name, way in table_dtype_checks.WAYS.items()}
    outcomes = {run: finish(proc, f"{run} table dtype checks")["outcomes"] for run, proc in procs.items()}
    for way, got in reference.items():
        if way.startswith("float32"):
            assert got == ["ok", "float32", True], (way, got)
            continue
        layer = way.split("(")[0].split()[0]
        assert got[0] == "TypeError" and got[1].startswith(f"{layer}: the table would be stored as float64"), got
    for run, got in outcomes.items():
        assert got == reference, (run, got)
