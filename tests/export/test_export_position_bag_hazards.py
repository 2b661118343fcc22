"""Per-position sums the export must not fuse as written, or must fuse with the
original's own checks: positions weighted by entries of different tensors,
positions counted from the end of the ids (which a server feeding another width
moves), tf.unstack (which refuses any other width), ids cast position by position,
a tf.unstack of the rows read elsewhere, zero starts that broadcast the sum.
References: numpy float64 and the original SavedModel, also run as TF Serving
runs it (feeds of any width, unchecked against the signature)."""
import re

import numpy as np
import pytest
import keras
import tensorflow as tf

from pkm_serve import ops, tflite
from pkm_serve.export import export_saved_model
from export_models import run_as_a_server

ops.load_library()

N, D, K = 30, 4, 5
RNG = np.random.default_rng(34)
TABLE = RNG.standard_normal((N, D)).astype(np.float32)
IDS, W = tf.TensorSpec([None, K], tf.int64), tf.TensorSpec([None, K], tf.float32)
FLOAT_IDS = tf.TensorSpec([None, K], tf.float32)


def _bag(ids, positions, w=None):
    """sum over `positions` of TABLE[ids[:, k]] (* w[:, k]); a negative id is row N + id, as Keras wraps it."""
    rows = TABLE.astype(np.float64)[ids[:, list(positions)].astype(np.int64)]
    weights = np.ones(rows.shape[:-1]) if w is None else w[:, list(positions)].astype(np.float64)
    return np.einsum("bk,bkd->bd", weights, rows)


def _relu_for_later(w):
    return np.where(np.arange(w.shape[1]) < 2, w, np.maximum(w, 0))


# name: (specs, body, reference(feed)); every one reported as weighted by different tensors
TWO_WEIGHT_TENSORS = {
    "add_n_weights_then_their_relu": ([IDS, W], lambda m, ids, w: tf.add_n(
        [tf.gather(m.t, ids[:, k]) * (w if k < 2 else tf.nn.relu(w))[:, k:k + 1] for k in range(K)]),
        lambda f: _bag(f["args_0"], range(K), _relu_for_later(f["args_1"]))),
    "stacked_weights_then_their_relu": ([IDS, W], lambda m, ids, w: tf.reduce_sum(tf.stack(
        [tf.gather(m.t, ids[:, k]) * (w if k < 2 else tf.nn.relu(w))[:, k, None] for k in range(K)], 1), 1),
        lambda f: _bag(f["args_0"], range(K), _relu_for_later(f["args_1"]))),
}

# name: (specs, body, the positions read of ids `width` wide, reason); reported
FROM_THE_END = {
    "positions_from_the_end": ([IDS], lambda m, ids: tf.add_n([tf.gather(m.t, ids[:, k]) for k in range(-K, 0)]),
                               lambda width: range(width - K, width), "counted from the end"),
    "last_position_as_minus_one": ([IDS, W], lambda m, ids, w: tf.add_n(
        [tf.gather(m.t, ids[:, k]) * w[:, k, None] for k in (0, 1, 2, 3, -1)]),
        lambda width: [0, 1, 2, 3, width - 1], "counted from the end"),
    "reverse_cumsum_at_minus_k": ([IDS], lambda m, ids: tf.math.cumsum(
        tf.gather(m.t, ids), axis=1, reverse=True)[:, -K], lambda width: range(width - K, width),
        "partial running sum"),
}

# name: (specs, body, positions summed, weighted); fused, refusing any width but K as tf.unstack does
UNSTACKED = {
    "unstacked_ids": ([IDS], lambda m, ids: tf.add_n([tf.gather(m.t, x) for x in tf.unstack(ids, axis=1)]),
                      range(K), False),
    "unstacked_rows_from_the_second": ([IDS], lambda m, ids: tf.add_n(tf.unstack(tf.gather(m.t, ids), axis=1)[1:]),
                                       range(1, K), False),
    "unstacked_weights": ([IDS, W], lambda m, ids, w: tf.add_n(
        [tf.gather(m.t, ids[:, k]) * wk[:, None] for k, wk in enumerate(tf.unstack(w, axis=1))]), range(K), True),
}

# name: (specs, body, positions summed, weighted); fused: tf.cast(ids[:, k]) is tf.cast(ids)[:, k]
CAST_IDS = {
    "keras_take_of_cast_float_ids": ([FLOAT_IDS], lambda m, x: keras.layers.Add()(
        [keras.ops.take(m.t, keras.ops.cast(x[:, k], "int32"), axis=0) for k in range(K)]), range(K), False),
    "gather_of_cast_ids_weighted": ([IDS, W], lambda m, ids, w: tf.add_n(
        [tf.gather(m.t, tf.cast(ids[:, k], tf.int32)) * w[:, k:k + 1] for k in range(1, K)]), range(1, K), True),
}

# name: (specs, body, reference(feed), reason); reported
READ_ELSEWHERE = {
    "unstacked_rows_last_read_elsewhere": ([IDS], lambda m, ids: (lambda p: tf.add_n(p[:4]) + tf.nn.relu(p[4]))(
        tf.unstack(tf.gather(m.t, ids), axis=1)),
        lambda f: _bag(f["args_0"], range(4)) + np.maximum(_bag(f["args_0"], [4]), 0), "another consumer"),
}
FORMS = {**TWO_WEIGHT_TENSORS, **FROM_THE_END, **UNSTACKED, **CAST_IDS, **READ_ELSEWHERE}


def _zeros_then_positions(zeros_shape, positions):
    def body(m, ids):
        total = tf.zeros(zeros_shape(ids))
        for k in range(K):
            total += tf.gather(m.t, positions(ids, k))
        return total
    return body


# name: (specs, body, reference(feed)); a zero start that broadcasts the sum: reported, the export goes on
BROADCAST_ZEROS = {
    "zeros_b_1_d_start": ([IDS], _zeros_then_positions(lambda ids: [tf.shape(ids)[0], 1, D], lambda ids, k: ids[:, k]),
                          lambda f: np.zeros([len(f["args_0"]), 1, D]) + _bag(f["args_0"], range(K))),
    "zeros_1_d_start_of_one_bag": ([tf.TensorSpec([K], tf.int64)], _zeros_then_positions(
        lambda ids: [1, D], lambda ids, k: ids[k]), lambda f: _bag(f["args_0"][None], range(K))),
}


def _save_and_export(path, forms, fused_names, lite):
    module = tf.Module()
    module.t = tf.Variable(TABLE)
    signatures = {}
    for name, (specs, body, *_) in forms.items():
        def call(*args, body=body):
            return {"out": body(module, *args)}
        call.__name__ = name  # the site's function is __inference_<name>_<n>
        signatures[name] = tf.function(input_signature=specs)(call)
    tf.saved_model.save(module, str(path / "m"), signatures=signatures)
    result = export_saved_model(str(path / "m"), str(path / "out"), quiet=True, tflite=lite,
                                signatures=sorted(fused_names) or None)
    sites = {}
    for site in result.sites:
        name = next(n for n in forms if re.fullmatch(rf"__inference_{n}_\d+", site.function))
        sites.setdefault(name, []).append(site)
    return result, sites, (tf.saved_model.load(str(path / "m")), tf.saved_model.load(result.dst))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    path = tmp_path_factory.mktemp("position_bag_hazards")
    lite = str(path / "m.tflite")
    result, sites, loaded = _save_and_export(path, FORMS, {**UNSTACKED, **CAST_IDS}, lite)
    return path, result, sites, loaded, tflite.make_interpreter(lite)


def _feed(specs, batch, width=K):
    feed = {"args_0": RNG.integers(0, N, [batch, width]).astype(specs[0].dtype.as_numpy_dtype)}
    if len(specs) == 2:
        feed["args_1"] = RNG.uniform(-2, 2, [batch, width]).astype(np.float32)
    return feed


def _run_both(loaded, name, feed):
    return tuple(model.signatures[name](**feed)["out"].numpy() for model in loaded)


def _assert_reported_and_same(sites, loaded, name, reason, reference, feed):
    [site] = sites[name]
    assert site.status == "skipped" and reason in site.reason, (site.status, site.reason)
    want, got = _run_both(loaded, name, feed)
    np.testing.assert_allclose(want, reference(feed), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", sorted(TWO_WEIGHT_TENSORS))
def test_positions_weighted_by_different_tensors_are_reported(exported, name):
    """w[:, k] for the first positions, relu(w)[:, k] for the others: no one weights
    tensor of the bag (the fused op took w for every position: other numbers)."""
    _, _, sites, loaded, _ = exported
    specs, _, reference = TWO_WEIGHT_TENSORS[name]
    for batch in (1, 3):
        _assert_reported_and_same(sites, loaded, name, "weighted by entries of different tensors", reference,
                                  _feed(specs, batch))


@pytest.mark.parametrize("name", sorted(FROM_THE_END))
def test_positions_counted_from_the_end_are_reported_and_read_as_written(exported, name):
    """ids[:, -1] (reverse cumsum [:, -K]) is position 4 of the declared 5 but
    position 6 of the 7 a server may feed: the fused op had read ids[..., 0:5] (all 7) instead."""
    path, result, sites, loaded, _ = exported
    specs, _, positions, reason = FROM_THE_END[name]
    [site] = sites[name]
    assert site.status == "skipped" and reason in site.reason, (site.status, site.reason)
    for width in (K, K + 2):
        feed = _feed(specs, 3, width)
        reference = _bag(feed["args_0"], positions(width), feed.get("args_1"))
        np.testing.assert_allclose(run_as_a_server(path / "m", name, feed), reference, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(run_as_a_server(result.dst, name, feed), reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", sorted(UNSTACKED))
def test_unstacked_positions_refuse_any_other_width_as_the_original(exported, name):
    """tf.unstack(ids, axis=1) has num=5: [B, 7] ids (or weights) fed by a server fail in the
    original; the fused op, which read ids[..., 0:5], summed them."""
    path, result, sites, loaded, _ = exported
    specs, _, positions, weighted = UNSTACKED[name]
    [site] = sites[name]
    assert (site.status, site.weighted) == ("fused", weighted), site.reason
    feed = _feed(specs, 3)
    reference = _bag(feed["args_0"], positions, feed.get("args_1"))
    for got in _run_both(loaded, name, feed):
        np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-5)
    for width in (K + 2, K - 1):
        other = _feed(specs, 3, width)
        with pytest.raises(tf.errors.InvalidArgumentError):
            run_as_a_server(path / "m", name, other)
        with pytest.raises(tf.errors.InvalidArgumentError, match="positions, but the original model"):
            run_as_a_server(result.dst, name, other)
    if weighted:  # ids of 5 positions, weights of 7: the original's unstack of the weights fails
        mixed = {"args_0": feed["args_0"], "args_1": _feed(specs, 3, K + 2)["args_1"]}
        with pytest.raises(tf.errors.InvalidArgumentError):
            run_as_a_server(path / "m", name, mixed)
        with pytest.raises(tf.errors.InvalidArgumentError, match="the weights have"):
            run_as_a_server(result.dst, name, mixed)


@pytest.mark.parametrize("name", sorted(CAST_IDS))
def test_positions_of_cast_ids_are_fused(exported, name):
    """keras.ops.take(t, keras.ops.cast(x[:, k], 'int32'), 0) summed with keras.layers.Add (float ids,
    as Keras feeds them), tf.gather(t, tf.cast(ids[:, k], tf.int32)): neither fused nor reported before."""
    _, _, sites, loaded, interpreter = exported
    specs, _, positions, weighted = CAST_IDS[name]
    [site] = sites[name]
    assert (site.status, site.weighted) == ("fused", weighted), site.reason
    wraps = name.startswith("keras")  # keras.ops.take reads id -2 as row N - 2
    for batch in (0, 1, 3):
        feed = _feed(specs, batch)
        if wraps and batch:
            feed["args_0"][0, 1] = -2
        reference = _bag(feed["args_0"], positions, feed.get("args_1"))
        for got in _run_both(loaded, name, feed):
            np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-5)
        if batch:
            from_lite = interpreter.get_signature_runner(name)(**feed)["out"]
            np.testing.assert_allclose(from_lite, reference, rtol=1e-5, atol=1e-5)
    feed = _feed(specs, 2)
    feed["args_0"][1, positions[-1]] = N
    for model in loaded:  # the original's gather refuses row N; so does the fused op
        with pytest.raises(tf.errors.InvalidArgumentError):
            model.signatures[name](**feed)


def test_an_unstack_of_the_rows_read_elsewhere_is_reported(exported):
    """add_n(p[:4]) + relu(p[4]) of p = tf.unstack(rows): the unstack and the gather stay for p[4],
    so the site saves nothing; it was reported fused."""
    _, _, sites, loaded, _ = exported
    name = "unstacked_rows_last_read_elsewhere"
    _, _, reference, reason = READ_ELSEWHERE[name]
    _assert_reported_and_same(sites, loaded, name, reason, reference, _feed([IDS], 3))


def test_zero_starts_that_broadcast_the_sum_are_reported_and_the_export_goes_on(tmp_path):
    """tf.zeros([B, 1, D]) + rows [B, D] is [B, B, D]; tf.zeros([1, D]) + rows [D] is [1, D]: the
    export aborted ('the fused SavedModel does not load ... _output_shapes inconsistent')."""
    result, sites, loaded = _save_and_export(tmp_path, BROADCAST_ZEROS, {}, None)
    _assert_reported_and_same(sites, loaded, "zeros_b_1_d_start", "zero start", BROADCAST_ZEROS[
        "zeros_b_1_d_start"][2], _feed([IDS], 3))
    one_bag = {"args_0": RNG.integers(0, N, [K])}
    _assert_reported_and_same(sites, loaded, "zeros_1_d_start_of_one_bag", "zero start", BROADCAST_ZEROS[
        "zeros_1_d_start_of_one_bag"][2], one_bag)
