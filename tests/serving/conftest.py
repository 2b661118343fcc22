"""Session fixtures of the serving tests (helpers live in serving_helpers.py)."""

import pytest

from serving_helpers import write_model


@pytest.fixture(scope="session")
def tf_with_ops():
    import tensorflow as tf
    from pkm_serve import ops
    ops.load_library()
    return tf


@pytest.fixture(scope="session")
def saved_models(tmp_path_factory, tf_with_ops):
    """Versions 1 and 2 of a fused PKM model (seeds 1 and 2) and a composite one, written once."""
    root = tmp_path_factory.mktemp("models")
    store = root / "store"
    store.mkdir()
    paths = {v: write_model(str(store), v, seed=v) for v in (1, 2)}
    composite = root / "composite"
    composite.mkdir()
    paths["composite"] = write_model(str(composite), 1, seed=7, fused=False)
    return paths


@pytest.fixture
def invoked_rows(monkeypatch):
    """Rows of every TFLite interpreter run, in order (the runs a request was batched or split into)."""
    from pkm_serve.serving import tflite_servable
    rows, run = [], tflite_servable._Interpreter.run

    def counting(self, key, inputs):
        rows.append(len(next(iter(inputs.values()))))
        return run(self, key, inputs)
    monkeypatch.setattr(tflite_servable._Interpreter, "run", counting)
    return rows
