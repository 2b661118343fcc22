"""`.keras` and SavedModel round trips; a SavedModel reloads in a process that
only loads the op library (no pkm_serve, no layer code)."""
import json
import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

from pkm_serve.layers import EmbeddingBag, ProductKeyMemory
from tests.saved_model_ops import graph_op_types

D_MODEL = 24


def build_model(implementation="fused"):
    keras.utils.set_random_seed(0)
    x_in = keras.Input((D_MODEL,), name="x")
    bag_in = keras.Input((5,), dtype="int64", name="bag_indices")
    bag_weights_in = keras.Input((5,), name="bag_weights")
    memory = ProductKeyMemory(
        v_dim=16, k_dim=16, n_keys=12, heads=2, knn=4, implementation=implementation, name="pkm"
    )(x_in)
    bag = EmbeddingBag(30, 16, combiner="sqrtn", implementation=implementation, name="bag_sum")(
        bag_in, weights=bag_weights_in
    )
    return keras.Model([x_in, bag_in, bag_weights_in], keras.layers.Dense(3, name="head")(memory + bag))


@pytest.fixture(scope="module")
def trained():
    """A model after a few training steps (non-trivial BN statistics) and sample inputs."""
    rng = np.random.default_rng(0)
    model = build_model()
    inputs = [
        rng.standard_normal((32, D_MODEL)).astype(np.float32),
        rng.integers(-1, 30, size=(32, 5)),
        rng.uniform(0.5, 1.5, size=(32, 5)).astype(np.float32),
    ]
    model.compile(keras.optimizers.Adam(0.01), "mse")
    model.fit(inputs, rng.standard_normal((32, 3)).astype(np.float32), epochs=3, verbose=0)
    return model, inputs, model(inputs, training=False).numpy()


def test_keras_file_round_trip_is_exact(trained, tmp_path):
    model, inputs, expected = trained
    path = str(tmp_path / "model.keras")
    model.save(path)
    restored = keras.models.load_model(path)
    assert isinstance(restored.get_layer("pkm"), ProductKeyMemory)
    assert isinstance(restored.get_layer("bag_sum"), EmbeddingBag)
    assert restored.get_layer("pkm").get_config() == model.get_layer("pkm").get_config()
    np.testing.assert_array_equal(restored(inputs, training=False).numpy(), expected)


def test_pkm_config_round_trip():
    layer = ProductKeyMemory(
        v_dim=10, k_dim=8, n_keys=6, heads=2, knn=3, query_batchnorm=False,
        input_dropout=0.1, query_dropout=0.2, value_dropout=0.3,
        values_initializer=keras.initializers.Zeros(), fallback="composite",
    )
    clone = ProductKeyMemory.from_config(layer.get_config())
    assert clone.get_config() == layer.get_config()
    clone.build((None, 5))
    assert clone.query_bn is None and np.all(clone.memory.embeddings.numpy() == 0)
    assert json.dumps(keras.saving.serialize_keras_object(layer))  # JSON-serialisable


def _export_both_ways(model, directory):
    """tf.saved_model.save with an explicit signature, and keras Model.export."""
    specs = [tf.TensorSpec(i.shape, i.dtype, name=i.name) for i in model.inputs]
    serve = tf.function(lambda x, bag_indices, bag_weights: {"y": model([x, bag_indices, bag_weights], training=False)},
                        input_signature=specs)
    saved = os.path.join(directory, "tf_saved_model_save")
    tf.saved_model.save(model, saved, signatures=serve.get_concrete_function())
    exported = os.path.join(directory, "keras_export")
    model.export(exported, format="tf_saved_model", verbose=False)
    return saved, exported


FRESH_PROCESS = textwrap.dedent(
    """
    import sys
    import numpy as np
    import tensorflow as tf
    library, out_path, *model_dirs = sys.argv[1:]
    tf.load_op_library(library)
    inputs = dict(np.load(out_path + ".inputs.npz"))
    results = {}
    for i, model_dir in enumerate(model_dirs):
        serve = tf.saved_model.load(model_dir).signatures["serving_default"]
        (output,) = serve(**{k: tf.constant(v) for k, v in inputs.items()}).values()
        results[f"out{i}"] = output.numpy()
    assert "pkm_serve" not in sys.modules, "the fresh process must not need pkm_serve"
    np.savez(out_path, **results)
    """
)


def test_saved_model_reloads_in_a_fresh_process_with_only_the_op_library(trained, tmp_path, op_library_path):
    model, inputs, expected = trained
    saved, exported = _export_both_ways(model, str(tmp_path))
    for directory in (saved, exported):
        assert {"PkmEmbeddingBag"} <= graph_op_types(directory), "the fused op must be in the graph"
    out_path = str(tmp_path / "fresh")
    np.savez(out_path + ".inputs.npz", x=inputs[0], bag_indices=inputs[1], bag_weights=inputs[2])
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH="")
    result = subprocess.run(
        [sys.executable, "-c", FRESH_PROCESS, op_library_path, out_path, saved, exported],
        cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    reloaded = np.load(out_path + ".npz")
    np.testing.assert_array_equal(reloaded["out0"], expected)
    np.testing.assert_array_equal(reloaded["out1"], expected)


@pytest.fixture(scope="module")
def composite_exports(tmp_path_factory):
    """The composite model and its two SavedModels (tf.saved_model.save, keras Model.export),
    built and exported once for the two tests below."""
    model = build_model(implementation="composite")
    return (model, *_export_both_ways(model, str(tmp_path_factory.mktemp("composite"))))


def test_composite_model_exports_with_stock_ops_only(composite_exports):
    """implementation='composite' gives a SavedModel any TF runtime can serve."""
    _, saved, _ = composite_exports
    op_types = graph_op_types(saved)
    assert not any(op.startswith("Pkm") for op in op_types)
    assert "GatherV2" in op_types or "ResourceGather" in op_types


def test_exporter_fuses_the_composite_layers(composite_exports, tmp_path):
    """pkm-serve export turns both composite lookups back into PkmEmbeddingBag (of keras' export)."""
    from pkm_serve.export.exporter import export_saved_model

    rng = np.random.default_rng(1)
    model, _, source = composite_exports
    result = export_saved_model(source, str(tmp_path / "fused"), quiet=True)
    assert len(result.fused) == 2, [site for site in result.sites]
    assert "PkmEmbeddingBag" in graph_op_types(result.dst)
    inputs = [
        rng.standard_normal((6, D_MODEL)).astype(np.float32),
        rng.integers(-1, 30, size=(6, 5)),
        rng.uniform(0.5, 1.5, size=(6, 5)).astype(np.float32),
    ]
    serve = tf.saved_model.load(result.dst).signatures["serving_default"]
    (fused_out,) = serve(x=inputs[0], bag_indices=inputs[1], bag_weights=inputs[2]).values()
    np.testing.assert_allclose(fused_out.numpy(), model(inputs, training=False).numpy(), rtol=1e-5, atol=1e-6)
