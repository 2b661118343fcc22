"""One shape rule set (kernels/core/shape_rules.h): the same bad shape gives the
same message from the TF op eagerly, under XLA (the lowering, shapes unknown at
trace time), in TFLite (the kernel's Prepare) and through the C ABI."""
import os
import sys

import numpy as np
import pytest
import tensorflow as tf

from pkm_serve import ops, tflite

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "kernels", "capi"))
import pkm_capi  # noqa: E402

N, D, K, B = 40, 8, 5, 2
TABLE = np.random.default_rng(0).standard_normal((N, D)).astype(np.float32)
CAPI_LIB = os.path.join(ROOT, "pkm_serve", "lib", "libpkm_capi_cpu.so")

# case: (params shape, indices shape, weights shape, the one message)
CASES = {
    "rank-3 params": ((10, 4, D), (B, K), (B, K), "params must be a [N, D] matrix, got shape [10, 4, 8]"),
    "weights unlike indices": ((N, D), (B, K), (B, K + 1),
                               "weights must have the shape of indices [2, 5], got [2, 6]"),
}


def tf_eager(params, indices, weights):
    lib = ops.load_library()
    lib.pkm_embedding_bag(tf.zeros(params), tf.zeros(indices, tf.int32), tf.ones(weights))


def tf_xla(params, indices, weights):
    # Unknown rank at trace time: the shape function passes, the XLA lowering decides.
    spec = [tf.TensorSpec(None, tf.float32), tf.TensorSpec(None, tf.int32), tf.TensorSpec(None, tf.float32)]
    f = tf.function(lambda p, i, w: ops.load_library().pkm_embedding_bag(p, i, w), jit_compile=True,
                    input_signature=spec)
    f(tf.zeros(params), tf.zeros(indices, tf.int32), tf.ones(weights))


def tflite_prepare(params, indices, weights, tmp_path):
    from ai_edge_litert import schema_py_generated as schema
    import flatbuffers

    base = tflite.build_embedding_bag_model(TABLE, K, batch=B)
    model = schema.ModelT.InitFromObj(schema.Model.GetRootAsModel(bytearray(base), 0))
    sub = model.subgraphs[0]
    op = sub.operators[0]
    sub.tensors[op.inputs[0]].shape = list(params)
    sub.tensors[op.inputs[2]].shape = list(weights)
    sub.tensors[op.inputs[2]].shapeSignature = None
    b = flatbuffers.Builder(1024)
    b.Finish(model.Pack(b), file_identifier=b"TFL3")
    path = tmp_path / "bad.tflite"
    path.write_bytes(bytes(b.Output()))
    it = tflite.make_interpreter(str(path), "litert")
    it.allocate_tensors()


def c_abi(params, indices, weights):
    pkm_capi.PkmLib(CAPI_LIB).check_shapes(params, indices, weights)


@pytest.mark.parametrize("case", sorted(CASES))
def test_same_bad_shape_same_message_in_every_runtime(case, tmp_path):
    params, indices, weights, message = CASES[case]
    with pytest.raises(tf.errors.InvalidArgumentError) as eager:
        tf_eager(params, indices, weights)
    with pytest.raises(tf.errors.InvalidArgumentError) as xla:
        tf_xla(params, indices, weights)
    with pytest.raises((RuntimeError, ValueError)) as lite:
        tflite_prepare(params, indices, weights, tmp_path)
    with pytest.raises(pkm_capi.PkmError) as capi:
        c_abi(params, indices, weights)
    for runtime, err in (("TF eager", eager), ("XLA", xla), ("TFLite", lite), ("C ABI", capi)):
        assert message in str(err.value), (runtime, str(err.value))
    assert "PkmEmbeddingBag: " + message in str(lite.value)  # TFLite names the op


def test_c_abi_check_shapes_gives_the_output_shape_and_refuses_max_with_weights(monkeypatch):
    lib = pkm_capi.PkmLib(CAPI_LIB)
    assert lib.check_shapes((N, D), (3, 4, K), (3, 4, K)) == (3, 4, D)
    assert lib.check_shapes((N, D), (7,), None, row_splits=(4,)) == (3, D)
    monkeypatch.setitem(pkm_capi.COMBINERS, "max", 3)  # PKM_MAX, whether or not the kernels have it yet
    with pytest.raises(pkm_capi.PkmError, match="combiner 'max' takes no weights"):
        lib.check_shapes((N, D), (B, K), (B, K), combiner="max")
