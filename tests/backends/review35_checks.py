"""Checks of round 35's review under JAX, run inside one process with KERAS_BACKEND set;
test_backends_rounds.py runs them (run_checks.py). Each check raises AssertionError with a message on failure and
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


def _bad_sparse_batches():
    """(ids, weights) BCOO pairs a bag must refuse: two ids at position [0, 0]; weights missing at [1, 0]."""
    from jax.experimental import sparse

    repeated = np.array([[0, 0], [0, 0], [1, 1]])
    positions = np.array([[0, 0], [0, 1], [1, 0]])

    def bcoo(values, where):
        return sparse.BCOO((np.asarray(values), where), shape=(2, 4))

    return {"repeated": (bcoo(np.array([3, 4, 5], "int32"), repeated), bcoo(np.ones(3, "float32"), repeated)),
            "missing_weight": (bcoo(np.array([1, 2, 3], "int32"), positions),
                               bcoo(np.array([0.5, 2.0], "float32"), positions[:2]))}


def _assert_refused(call, how):
    try:
        np.asarray(call())
    except Exception as err:  # noqa: BLE001 - XLA's runtime error
        assert "is out of range [0, 10)" in str(err), f"{how}: {err}"
    else:
        raise AssertionError(f"{how}: a bad sparse batch was read (another row, or weight 0)")


# The bag of each bad batch that holds the bad position, and the other bag's float64 sum (ids, weights).
_BAD_BAG = {"repeated": (0, [5], [1.0]), "missing_weight": (1, [1, 2], [0.5, 2.0])}


def _assert_bad_bag_is_nan(bag, out, name, how):
    """The composite (no kernel to refuse the batch): NaN for the malformed bag, where it read the bag's
    other rows (or none) as if the bad position were padding, and the other bag as float64 numpy's."""
    bad, ids, weights = _BAD_BAG[name]
    table = np.asarray(bag.embeddings.value, np.float64)
    out = np.asarray(out)
    assert np.isnan(out[bad]).all(), f"{how}, {name}: the malformed bag was read: {out[bad]}"
    np.testing.assert_allclose(out[1 - bad], np.asarray(weights) @ table[ids], rtol=1e-6, atol=1e-7)


def check_exported_sparse_bad_entries():
    """jax.export of an EmbeddingBag (the CPU kernel's FFI call allowed) on BCOO ids and weights: a
    well-formed batch gives the eager result, and ids repeated at one position, or weights missing at an
    id's, fail the kernel's range check (the export holds no host callback: two ids summed into another
    row's, a missing weight read 0); the composite gives NaN for such a bag (it was read as padding)."""
    import jax
    from jax import export
    from jax.experimental import sparse

    from pkm_serve.layers import EmbeddingBag

    def arguments(ids, weights):
        return ids.data, ids.indices, weights.data, weights.indices

    batches = _bad_sparse_batches()
    ids, _ = batches["missing_weight"]
    good = (ids, sparse.BCOO((np.array([0.5, 2.0, 1.5], "float32"), ids.indices), shape=(2, 4)))
    for implementation in ("fused", "composite"):
        bag = EmbeddingBag(10, 3, combiner="sum", implementation=implementation)
        bag.build()   # (built inside the export's trace, its table would be a leaked tracer)

        def lookup(ids, id_positions, weights, weight_positions, bag=bag):
            return bag(sparse.BCOO((ids, id_positions), shape=(2, 4)),
                       sparse.BCOO((weights, weight_positions), shape=(2, 4)))

        for name, batch in {"good": good, **batches}.items():
            exported = export.export(jax.jit(lookup), disabled_checks=[export.DisabledSafetyCheck.custom_call(
                "pkm_embedding_bag_forward")])(*(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arguments(*batch)))
            call = lambda: exported.call(*arguments(*batch))  # noqa: E731
            if name == "good":
                np.testing.assert_allclose(np.asarray(call()), np.asarray(bag(*batch)), rtol=1e-6)
            elif implementation == "fused":
                _assert_refused(call, f"export, {name}")
            else:
                _assert_bad_bag_is_nan(bag, call(), name, "composite export")
    print(json.dumps({"exported_sparse_bad_entries": "ok"}))


def check_sharded_sparse_bad_entries():
    """jax.jit of an EmbeddingBag on BCOO ids and weights with 2 CPU devices: ids repeated at one position,
    or weights missing at an id's, fail the CPU kernel's range check (no host callback runs with several
    devices: they were read as another row's id, or weight 0); the composite gives NaN for such a bag."""
    import jax

    from pkm_serve.layers import EmbeddingBag

    assert jax.device_count() == 2, jax.devices()
    for implementation in ("fused", "composite"):
        bag = EmbeddingBag(10, 3, combiner="sum", implementation=implementation)
        bag.build()   # (built inside jax.jit, its table would be a leaked tracer)
        lookup = jax.jit(lambda ids, weights, bag=bag: bag(ids, weights))
        for name, batch in _bad_sparse_batches().items():
            if implementation == "fused":
                _assert_refused(lambda: lookup(*batch), f"2 devices, {name}")
            else:
                _assert_bad_bag_is_nan(bag, lookup(*batch), name, "composite, 2 devices")
    print(json.dumps({"sharded_sparse_bad_entries": "ok"}))


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
