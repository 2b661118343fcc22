"""Checks of round 35's review under JAX, run inside one process with KERAS_BACKEND set;
test_backends_review35.py runs them. Each check raises AssertionError with a message on failure and
prints {"<check>": "ok"}.

    KERAS_BACKEND=jax python -m tests.backends.review35_checks jit_then_jax2tf /tmp/out
"""

import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def check_jit_then_jax2tf(directory):
    """A jitted product-key search called once (a test call), then converted with jax2tf into a
    SavedModel: TF runs it with the slots JAX gave. The search chose lax.top_k or a sort when traced,
    and jax.jit's cache handed the export the trace of the first call: lax.top_k, which TF 2.21's
    XlaCallModule failed to deserialise ('vhlo.composite_v2'). Executed, the search keeps lax.top_k."""
    import jax
    import tensorflow as tf
    from jax.experimental import jax2tf

    from pkm_serve.backends.product_keys import product_key_search

    rng = np.random.default_rng(7)
    query, keys = rng.normal(size=(3, 2, 2, 4)).astype("float32"), rng.normal(size=(2, 2, 16, 4)).astype("float32")
    search = jax.jit(lambda q, k: product_key_search(q, k, 3)[0])
    want = np.asarray(search(query, keys))
    assert "chlo.top_k" in search.lower(query, keys).as_text(), "the executed search no longer uses lax.top_k"
    module = tf.Module()
    module.search = tf.function(jax2tf.convert(search), autograph=False, input_signature=[
        tf.TensorSpec(query.shape, tf.float32), tf.TensorSpec(keys.shape, tf.float32)])
    tf.saved_model.save(module, directory)
    got = tf.saved_model.load(directory).search(tf.constant(query), tf.constant(keys)).numpy()
    np.testing.assert_array_equal(got, want)
    print(json.dumps({"jit_then_jax2tf": "ok"}))


def check_vmapped_unsigned_ids():
    """jax.vmap of a fused EmbeddingBag over uint32 ids: one host check per call, not one per mapped
    row. Under vmap the range check's cond becomes a select, so the check runs on every call, and
    vmap_method="sequential" made that one host callback per row (256 rows: 40-60x the int32 call).
    The rows read are int32's, and an id past int32 still fails naming it."""
    import jax

    from pkm_serve.layers import EmbeddingBag

    bag = EmbeddingBag(100, 4, combiner="mean")
    ids = np.random.default_rng(3).integers(0, 100, size=(8, 1, 3))
    want = np.asarray(jax.vmap(bag)(ids.astype("int32")))
    calls, callback = [], jax.pure_callback

    def counted(f, *args, **kwargs):
        return callback(lambda *xs: (calls.append(1), f(*xs))[1], *args, **kwargs)
    jax.pure_callback = counted
    try:
        mapped = jax.jit(jax.vmap(bag))
        np.testing.assert_array_equal(np.asarray(mapped(ids.astype("uint32"))), want)
        assert len(calls) == 1, f"{len(calls)} host callbacks for one call of 8 mapped rows"
        past = ids.astype("uint32")
        past[5, 0, 1] = 4294967295
        try:
            mapped(past).block_until_ready()
        except Exception as err:  # noqa: BLE001 - XLA's runtime error carries the callback's
            assert "= 4294967295 is out of range [0, 100)" in str(err), str(err)
        else:
            raise AssertionError("a uint32 id past the table was taken under vmap")
    finally:
        jax.pure_callback = callback
    print(json.dumps({"vmapped_unsigned_ids": "ok"}))


def check_sharded_unsigned_ids():
    """A jitted EmbeddingBag over uint32 ids sharded across 2 CPU devices (run with
    --xla_force_host_platform_device_count=2): ids in range read int32's rows, and an id past int32 is
    an error the caller catches. The range check's host callback ran on one device: its error left the
    other waiting in an all-reduce, and 40 s later XLA aborted the process ('Termination timeout')."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from pkm_serve.layers import EmbeddingBag

    assert jax.device_count() == 2, jax.devices()
    bag = EmbeddingBag(100, 4, combiner="mean")
    ids = np.random.default_rng(3).integers(0, 100, size=(8, 3))
    want = np.asarray(bag(ids.astype("int32")))
    rows = NamedSharding(Mesh(np.array(jax.devices()), ("batch",)), PartitionSpec("batch"))
    lookup = jax.jit(bag)
    np.testing.assert_array_equal(np.asarray(lookup(jax.device_put(ids.astype("uint32"), rows))), want)
    past = ids.astype("uint32")
    past[6, 1] = 4294967295
    try:
        lookup(jax.device_put(past, rows)).block_until_ready()
    except Exception as err:  # noqa: BLE001 - XLA's runtime error
        assert "is out of range [0, 100)" in str(err), str(err)
    else:
        raise AssertionError("a uint32 id past the table was taken with sharded ids")
    print(json.dumps({"sharded_unsigned_ids": "ok"}))


CHECKS = {name[len("check_"):]: f for name, f in globals().items() if name.startswith("check_")}

if __name__ == "__main__":
    import pkm_serve  # noqa: F401  (registers the layers)

    args = sys.argv[1:]
    while args:
        name = args.pop(0)
        if name == "jit_then_jax2tf":
            CHECKS[name](args.pop(0))
        else:
            CHECKS[name]()
