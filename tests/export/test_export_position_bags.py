"""Bags written one position at a time (tf.add_n / Python sum over ids[:, k], as
hand-written recommenders do) and read off a running sum (tf.math.cumsum(rows,
axis=1)[:, -1]): fused where they are exactly the (weighted) sum over the bag,
reported otherwise, and never silent. References: numpy float64 and the
original SavedModel; the .tflite through the delegate. One export for the module."""
import re

import numpy as np
import pytest
import tensorflow as tf

from pkm_serve import ops, tflite
from pkm_serve.export import export_saved_model

ops.load_library()

N, D, K, F = 30, 4, 5, 3
RNG = np.random.default_rng(33)
TABLE = RNG.standard_normal((N, D)).astype(np.float32)
IDS, W = tf.TensorSpec([None, K], tf.int64), tf.TensorSpec([None, K], tf.float32)
IDS3, W3 = tf.TensorSpec([None, F, K], tf.int64), tf.TensorSpec([None, F, K], tf.float32)


def _add_n_weighted(m, ids, w):
    return tf.add_n([tf.gather(m.t, ids[:, k]) * w[:, k:k + 1] for k in range(K)])


def _python_sum_of_unstacked(m, ids, w):  # sum() starts at 0: 0 + t0 + t1 + ...
    return sum(tf.nn.embedding_lookup(m.t, i) * wk[:, None] for i, wk in zip(tf.unstack(ids, axis=1),
                                                                          tf.unstack(w, axis=1)))


def _running_sum_of_later_positions(m, ids):  # positions 1..K-1, from tf.zeros
    total = tf.zeros([tf.shape(ids)[0], D])
    for k in reversed(range(1, K)):
        total += tf.gather(m.t, ids[..., k])
    return total


def _add_n_rank3(m, ids, w):  # [B, F, K] ids: one bag per field
    return tf.add_n([tf.gather(m.t, ids[:, :, k]) * w[:, :, k, None] for k in range(K)])


# name: (specs, body, positions summed, weighted, reference reduce of rows [.., K, D] -> bag)
FUSED = {
    "add_n_weighted": ([IDS, W], _add_n_weighted, range(K), True),
    "python_sum_of_unstacked": ([IDS, W], _python_sum_of_unstacked, range(K), True),
    "running_sum_of_later_positions": ([IDS], _running_sum_of_later_positions, range(1, K), False),
    "add_n_rank3": ([IDS3, W3], _add_n_rank3, range(K), True),
    "cumsum_last": ([IDS], lambda m, ids: tf.math.cumsum(tf.gather(m.t, ids), axis=1)[:, -1], range(K), False),
    "cumsum_reverse_first_weighted": ([IDS, W], lambda m, ids, w: tf.math.cumsum(
        tf.gather(m.t, ids) * tf.expand_dims(w, -1), axis=-2, reverse=True)[:, 0], range(K), True),
    "cumsum_last_keepdims": ([IDS], lambda m, ids: tf.math.cumsum(tf.gather(m.t, ids), axis=1)[:, -1:],
                             range(K), False),
}

# name: (specs, body, reason)
REPORTED = {
    "add_n_repeated_position": ([IDS], lambda m, ids: tf.add_n([tf.gather(m.t, ids[:, k]) for k in (0, 1, 1, 3)]),
                                "not each position of a range once"),
    "add_n_weight_of_another_position": ([IDS, W], lambda m, ids, w: tf.add_n(
        [tf.gather(m.t, ids[:, k]) * w[:, (k + 1) % K, None] for k in range(K)]), "not per index"),
    "add_n_plus_a_bias_row": ([IDS], lambda m, ids: tf.add_n([tf.gather(m.t, ids[:, k]) for k in range(K)]) + m.t[0],
                              "no position of the bag"),
    "cumsum_exclusive": ([IDS], lambda m, ids: tf.math.cumsum(tf.gather(m.t, ids), axis=1, exclusive=True)[:, -1],
                         "partial running sum"),
    "cumsum_prefix": ([IDS], lambda m, ids: tf.math.cumsum(tf.gather(m.t, ids), axis=1)[:, 2],
                      "partial running sum"),
}

# Not bags: token + position embeddings, one position of the ids.
NOT_SITES = {"token_plus_position": ([IDS], lambda m, ids: tf.gather(m.t, ids) + m.t[:K]),
             "first_position_plus_second_table": ([IDS], lambda m, ids: tf.gather(m.t, ids[:, 0]) +
                                                  tf.gather(m.t2, ids[:, 1]))}


def _signature(m, name, specs, body):
    def call(*args):
        return {"out": body(m, *args)}
    call.__name__ = name  # the site's function is __inference_<name>_<n>
    return tf.function(input_signature=specs)(call)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    path = tmp_path_factory.mktemp("position_bags")
    module = tf.Module()
    module.t, module.t2 = tf.Variable(TABLE), tf.Variable(TABLE[::-1].copy())
    forms = {**FUSED, **REPORTED, **NOT_SITES}
    signatures = {name: _signature(module, name, spec[0], spec[1]) for name, spec in forms.items()}
    tf.saved_model.save(module, str(path / "m"), signatures=signatures)
    lite = str(path / "m.tflite")
    result = export_saved_model(str(path / "m"), str(path / "out"), quiet=True, tflite=lite,
                                signatures=sorted(FUSED))
    sites = {}
    for site in result.sites:
        name = next(n for n in forms if re.fullmatch(rf"__inference_{n}_\d+", site.function))
        sites.setdefault(name, []).append(site)
    return path, result, lite, sites


def _inputs(specs, batch):
    shape = [batch] + specs[0].shape.as_list()[1:]
    feed = {"args_0": RNG.integers(0, N, shape)}
    if len(specs) == 2:
        feed["args_1"] = RNG.uniform(-2, 2, shape).astype(np.float32)
    return feed


def _reference(feed, positions, weighted, keepdims=False):
    ids = feed["args_0"][..., list(positions)]
    w = feed["args_1"][..., list(positions)] if weighted else np.ones(ids.shape)
    bag = np.einsum("...k,...kd->...d", w.astype(np.float64), TABLE.astype(np.float64)[ids])
    return bag[..., None, :] if keepdims else bag


def _run_both(path, result, name, feed):
    original = tf.saved_model.load(str(path / "m")).signatures[name]
    fused = tf.saved_model.load(result.dst).signatures[name]
    return original(**feed)["out"].numpy(), fused(**feed)["out"].numpy()


@pytest.mark.parametrize("name", sorted(FUSED))
def test_position_sums_and_cumsum_ends_are_fused_bags(exported, name):
    path, result, lite, sites = exported
    specs, _, positions, weighted = FUSED[name]
    [site] = sites[name]
    assert (site.status, site.weighted, site.combiner) == ("fused", weighted, "sum"), site.reason
    for batch in (0, 1, 3):
        feed = _inputs(specs, batch)
        reference = _reference(feed, positions, weighted, keepdims=name.endswith("keepdims"))
        want, got = _run_both(path, result, name, feed)
        np.testing.assert_allclose(want, reference, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-5)
        if batch:
            from_lite = tflite.make_interpreter(lite).get_signature_runner(name)(**feed)["out"]
            np.testing.assert_allclose(from_lite, reference, rtol=1e-5, atol=1e-5)
    for bad in (-1, N):  # the original's gathers refuse both; so does the fused model
        feed = _inputs(specs, 2)
        feed["args_0"][..., positions[-1]] = bad
        for model in (tf.saved_model.load(str(path / "m")), tf.saved_model.load(result.dst)):
            with pytest.raises(tf.errors.InvalidArgumentError):
                model.signatures[name](**feed)


@pytest.mark.parametrize("name", sorted(REPORTED))
def test_sums_that_are_not_the_whole_bag_are_reported_and_left_as_written(exported, name):
    path, result, _, sites = exported
    specs, _, reason = REPORTED[name]
    [site] = sites[name]
    assert site.status == "skipped" and reason in site.reason, site.reason
    feed = _inputs(specs, 3)
    want, got = _run_both(path, result, name, feed)
    np.testing.assert_array_equal(got, want)


def test_embeddings_added_across_tables_or_positions_are_no_bag(exported):
    assert not any(name in exported[3] for name in NOT_SITES)


def _run_as_a_server(saved_model, signature, feed):
    """The signature run as TF Serving runs it: feeds of any shape, unchecked against the signature."""
    graph = tf.Graph()
    with graph.as_default(), tf.compat.v1.Session(graph=graph) as sess:
        holders = {k: tf.compat.v1.placeholder(tf.as_dtype(v.dtype), None) for k, v in feed.items()}
        meta = tf.compat.v1.saved_model.loader.load(
            sess, ["serve"], str(saved_model), input_map={f"{signature}_{k}:0": v for k, v in holders.items()})
        out = graph.get_tensor_by_name(meta.signature_def[signature].outputs["out"].name)
        return sess.run(out, {holders[k]: v for k, v in feed.items()})


@pytest.mark.parametrize("name", ["add_n_weighted", "running_sum_of_later_positions"])
def test_a_position_sum_fed_more_or_fewer_positions_than_declared_reads_the_originals(exported, name):
    """A server feeds [B, 7] ids to a [None, 5] signature: the composite sums the positions it
    slices, so does the fused op (ids[..., a:b]), not all 7. [B, 3]: the composite's ids[:, 4]
    fails; so does the fused model."""
    path, result, _, _ = exported
    specs, _, positions, weighted = FUSED[name]
    wide = {"args_0": RNG.integers(0, N, (3, K + 2))}
    if weighted:
        wide["args_1"] = RNG.uniform(-2, 2, (3, K + 2)).astype(np.float32)
    reference = _reference(wide, positions, weighted)
    np.testing.assert_allclose(_run_as_a_server(path / "m", name, wide), reference, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(_run_as_a_server(result.dst, name, wide), reference, rtol=1e-5, atol=1e-5)
    narrow = {key: value[:, :K - 2] for key, value in wide.items()}
    with pytest.raises(tf.errors.InvalidArgumentError):
        _run_as_a_server(path / "m", name, narrow)
    with pytest.raises(tf.errors.InvalidArgumentError, match="the ids have.*positions, but the original"):
        _run_as_a_server(result.dst, name, narrow)
