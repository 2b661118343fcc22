"""Bags written one position at a time (tf.add_n / Python sum over ids[:, k], as
hand-written recommenders do) and read off a running sum (tf.math.cumsum(rows,
axis=1)[:, -1]): fused where they are exactly the (weighted) sum over the bag,
reported otherwise, and never silent. References: numpy float64 and the
original SavedModel; the .tflite through the delegate. One export for the module."""
import re

import numpy as np
import pytest
import keras
import tensorflow as tf

from pkm_serve import ops, tflite
from pkm_serve.export import export_saved_model
from export_models import run_as_a_server

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


def _keras_take_per_position(m, ids, w):  # as a Keras 3 Embedding gathers: keras.ops.take wraps negative ids
    return keras.layers.Add()([keras.ops.take(m.t, ids[:, k], axis=0) * w[:, k:k + 1] for k in range(1, K)])


def _mean_of_stacked(m, ids, w):
    return tf.reduce_mean(tf.stack([tf.gather(m.t, ids[:, k]) * w[:, k, None] for k in range(K)], axis=-2), axis=1)


def _sum_of_stacked_on_the_last_axis(m, ids):
    return tf.reduce_sum(tf.stack([tf.gather(m.t, ids[:, k]) for k in range(K)], axis=-1), axis=-1, keepdims=True)


def _sliced_rows_of_later_positions(m, ids, w):  # gathered once, each position sliced off the rows
    rows = tf.gather(m.t, ids)
    return tf.add_n([rows[:, k] * w[:, k:k + 1] for k in range(1, K)])


def _unstacked_rows(m, ids):
    return sum(tf.unstack(tf.nn.embedding_lookup(m.t, ids), axis=1))


def _mean_of_concatenated(m, ids, w):  # [B, K, D] built as a concat of rows each expanded at the bag axis
    return tf.reduce_mean(tf.concat([tf.expand_dims(tf.gather(m.t, ids[:, k]) * w[:, k:k + 1], -2)
                                     for k in range(K)], -2), axis=-2)


SAME = lambda bag: bag  # noqa: E731
# name: (specs, body, positions summed, weighted, the output from the bag)
FUSED = {
    "add_n_weighted": ([IDS, W], _add_n_weighted, range(K), True, SAME),
    "python_sum_of_unstacked": ([IDS, W], _python_sum_of_unstacked, range(K), True, SAME),
    "running_sum_of_later_positions": ([IDS], _running_sum_of_later_positions, range(1, K), False, SAME),
    "add_n_then_a_bias_row": ([IDS], lambda m, ids: tf.add_n([tf.gather(m.t, ids[:, k]) for k in range(K)]) + m.t[0],
                              range(K), False, lambda bag: bag + TABLE[0]),
    "python_sum_then_a_bias_row": ([IDS, W], lambda m, ids, w: _python_sum_of_unstacked(m, ids, w) + m.t[0],
                                   range(K), True, lambda bag: bag + TABLE[0]),
    "add_n_rank3": ([IDS3, W3], _add_n_rank3, range(K), True, SAME),
    "keras_take_per_position": ([IDS, W], _keras_take_per_position, range(1, K), True, SAME),
    "sliced_rows_of_later_positions": ([IDS, W], _sliced_rows_of_later_positions, range(1, K), True, SAME),
    "unstacked_rows": ([IDS], _unstacked_rows, range(K), False, SAME),
    "mean_of_stacked": ([IDS, W], _mean_of_stacked, range(K), True, lambda bag: bag / K),
    "mean_of_concatenated": ([IDS, W], _mean_of_concatenated, range(K), True, lambda bag: bag / K),
    "sum_of_stacked_on_the_last_axis": ([IDS], _sum_of_stacked_on_the_last_axis, range(K), False,
                                        lambda bag: bag[..., None]),
    "cumsum_last": ([IDS], lambda m, ids: tf.math.cumsum(tf.gather(m.t, ids), axis=1)[:, -1], range(K), False,
                    SAME),
    "cumsum_reverse_first_weighted": ([IDS, W], lambda m, ids, w: tf.math.cumsum(
        tf.gather(m.t, ids) * tf.expand_dims(w, -1), axis=-2, reverse=True)[:, 0], range(K), True, SAME),
    "cumsum_last_keepdims": ([IDS], lambda m, ids: tf.math.cumsum(tf.gather(m.t, ids), axis=1)[:, -1:],
                             range(K), False, lambda bag: bag[..., None, :]),
}

# name: (specs, body, reason)
REPORTED = {
    "add_n_repeated_position": ([IDS], lambda m, ids: tf.add_n([tf.gather(m.t, ids[:, k]) for k in (0, 1, 1, 3)]),
                                "not each position of a range once"),
    "add_n_weight_of_another_position": ([IDS, W], lambda m, ids, w: tf.add_n(
        [tf.gather(m.t, ids[:, k]) * w[:, (k + 1) % K, None] for k in range(K)]), "not per index"),
    "positions_and_a_bias_row_in_one_sum": ([IDS], lambda m, ids: tf.add_n(
        [tf.gather(m.t, ids[:, k]) for k in range(K)] + [tf.broadcast_to(m.t[0], [tf.shape(ids)[0], D])]),
        "no position of the bag"),
    "sliced_rows_read_again": ([IDS], lambda m, ids: (lambda rows: tf.add_n([rows[:, k] for k in range(K)]) *
                                                      rows[:, 0])(tf.gather(m.t, ids)), "another consumer"),
    "add_n_reading_a_position_shape": ([IDS], lambda m, ids: (lambda rows: tf.add_n(rows) + tf.cast(
        tf.shape(rows[0])[1], tf.float32))([tf.gather(m.t, ids[:, k]) for k in range(K)]), "shape of a position"),
    "stacked_positions_reading_their_shape": ([IDS], lambda m, ids: (lambda stacked: tf.reduce_sum(stacked, -1) + tf.cast(
        tf.shape(stacked)[1], tf.float32))(tf.stack([tf.gather(m.t, ids[:, k]) for k in range(K)], -1)),
        "shape of the stacked"),
    "cumsum_exclusive": ([IDS], lambda m, ids: tf.math.cumsum(tf.gather(m.t, ids), axis=1, exclusive=True)[:, -1],
                         "partial running sum"),
}

POSITION_WEIGHTS = RNG.uniform(0.5, 2, K).astype(np.float32)
FIELD_POSITION_WEIGHTS = RNG.uniform(0.5, 2, (F, K)).astype(np.float32)
# Weights every bag shares (one per position, or per field and position): name -> (specs, body, weights)
SHARED_WEIGHTS = {
    "einsum_positional_weights": ([IDS], lambda m, ids: tf.einsum("bkd,k->bd", tf.gather(m.t, ids), m.v),
                                  POSITION_WEIGHTS),
    "matvec_positional_weights": ([IDS], lambda m, ids: tf.linalg.matvec(tf.gather(m.t, ids), m.v, transpose_a=True),
                                  POSITION_WEIGHTS),
    "tensordot_positional_weights": ([IDS], lambda m, ids: tf.tensordot(tf.gather(m.t, ids), m.v, axes=[[1], [0]]),
                                     POSITION_WEIGHTS),
    "keras_matmul_positional_weights": ([IDS], lambda m, ids: keras.ops.matmul(m.v, tf.gather(m.t, ids)),
                                        POSITION_WEIGHTS),
    "tensordot_of_field_bags": ([IDS3], lambda m, ids: tf.tensordot(tf.gather(m.t, ids), m.v, axes=[[2], [0]]),
                                POSITION_WEIGHTS),
    "einsum_field_positional_weights": ([IDS3], lambda m, ids: tf.einsum("bfkd,fk->bfd", tf.gather(m.t, ids), m.v2),
                                        FIELD_POSITION_WEIGHTS),
}

# Not bags: token + position embeddings, one position of the ids.
NOT_SITES = {"token_plus_position": ([IDS], lambda m, ids: tf.gather(m.t, ids) + m.t[:K]),
             "tensordot_over_the_features": ([IDS], lambda m, ids: tf.tensordot(tf.gather(m.t, ids), m.v[:D], 1)),
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
    module.v, module.v2 = tf.Variable(POSITION_WEIGHTS), tf.Variable(FIELD_POSITION_WEIGHTS)
    forms = {**FUSED, **REPORTED, **NOT_SITES, **SHARED_WEIGHTS}
    signatures = {name: _signature(module, name, spec[0], spec[1]) for name, spec in forms.items()}
    tf.saved_model.save(module, str(path / "m"), signatures=signatures)
    lite = str(path / "m.tflite")
    result = export_saved_model(str(path / "m"), str(path / "out"), quiet=True, tflite=lite,
                                signatures=sorted(FUSED) + sorted(SHARED_WEIGHTS))
    sites = {}
    for site in result.sites:
        name = next(n for n in forms if re.fullmatch(rf"__inference_{n}_\d+", site.function))
        sites.setdefault(name, []).append(site)
    loaded = (tf.saved_model.load(str(path / "m")), tf.saved_model.load(result.dst), tflite.make_interpreter(lite))
    return path, result, loaded, sites


def _inputs(specs, batch):
    shape = [batch] + specs[0].shape.as_list()[1:]
    feed = {"args_0": RNG.integers(0, N, shape)}
    if len(specs) == 2:
        feed["args_1"] = RNG.uniform(-2, 2, shape).astype(np.float32)
    return feed


def _reference(feed, positions, weighted):
    """The bag of the positions summed; a negative id (taken only by Keras' wrap) is row N + id."""
    ids = feed["args_0"][..., list(positions)]
    w = feed["args_1"][..., list(positions)] if weighted else np.ones(ids.shape)
    return np.einsum("...k,...kd->...d", w.astype(np.float64), TABLE.astype(np.float64)[ids])


def _run_both(loaded, name, feed):
    return tuple(model.signatures[name](**feed)["out"].numpy() for model in loaded[:2])


@pytest.mark.parametrize("name", sorted(FUSED))
def test_position_sums_and_cumsum_ends_are_fused_bags(exported, name):
    _, _, loaded, sites = exported
    specs, _, positions, weighted, output = FUSED[name]
    [site] = sites[name]
    assert (site.status, site.weighted, site.combiner) == ("fused", weighted, "sum"), site.reason
    wraps = name.startswith("keras")  # keras.ops.take reads id -1 as row N - 1, and refuses -(N + 1)
    for batch in (0, 1, 3):
        feed = _inputs(specs, batch)
        if wraps and batch:
            feed["args_0"][0, positions[0]] = -2
        reference = output(_reference(feed, positions, weighted))
        want, got = _run_both(loaded, name, feed)
        np.testing.assert_allclose(want, reference, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-5)
        if batch:
            from_lite = loaded[2].get_signature_runner(name)(**feed)["out"]
            np.testing.assert_allclose(from_lite, reference, rtol=1e-5, atol=1e-5)
    for bad in (-N - 1 if wraps else -1, N):  # the original's gathers refuse both; so does the fused model
        feed = _inputs(specs, 2)
        feed["args_0"][..., positions[-1]] = bad
        for model in loaded[:2]:
            with pytest.raises(tf.errors.InvalidArgumentError):
                model.signatures[name](**feed)


@pytest.mark.parametrize("name", sorted(REPORTED))
def test_sums_that_are_not_the_whole_bag_are_reported_and_left_as_written(exported, name):
    _, _, loaded, sites = exported
    specs, _, reason = REPORTED[name]
    [site] = sites[name]
    assert site.status == "skipped" and reason in site.reason, site.reason
    feed = _inputs(specs, 3)
    want, got = _run_both(loaded, name, feed)
    np.testing.assert_array_equal(got, want)


def test_embeddings_added_across_tables_or_positions_are_no_bag(exported):
    assert not any(name in exported[3] for name in NOT_SITES)


@pytest.mark.parametrize("name", ["add_n_weighted", "running_sum_of_later_positions", "keras_take_per_position"])
def test_a_position_sum_fed_more_or_fewer_positions_than_declared_reads_the_originals(exported, name):
    """A server feeds [B, 7] ids to a [None, 5] signature: the composite sums the positions it
    slices, so does the fused op (ids[..., a:b]), not all 7. [B, 3]: the composite's ids[:, 4]
    fails; so does the fused model."""
    path, result, _, _ = exported
    specs, _, positions, weighted, _ = FUSED[name]
    wide = {"args_0": RNG.integers(0, N, (3, K + 2))}
    if weighted:
        wide["args_1"] = RNG.uniform(-2, 2, (3, K + 2)).astype(np.float32)
    reference = _reference(wide, positions, weighted)
    np.testing.assert_allclose(run_as_a_server(path / "m", name, wide), reference, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(run_as_a_server(result.dst, name, wide), reference, rtol=1e-5, atol=1e-5)
    narrow = {key: value[:, :K - 2] for key, value in wide.items()}
    with pytest.raises(tf.errors.InvalidArgumentError):
        run_as_a_server(path / "m", name, narrow)
    # (ids and weights both narrow: either's Assert may fail first)
    with pytest.raises(tf.errors.InvalidArgumentError, match="the (ids|weights) have.*positions, but the original"):
        run_as_a_server(result.dst, name, narrow)


def test_ids_gathered_but_not_summed_are_still_refused_out_of_range(exported):
    """rows = gather(t, ids) refuses a bad id at any position, also position 0, which
    rows[:, 1] + .. + rows[:, K-1] does not sum: the fused model refuses it too."""
    _, _, loaded, _ = exported
    feed = _inputs(FUSED["sliced_rows_of_later_positions"][0], 2)
    for bad in (-1, N):
        feed["args_0"][1, 0] = bad
        for model in loaded[:2]:
            with pytest.raises(tf.errors.InvalidArgumentError):
                model.signatures["sliced_rows_of_later_positions"](**feed)


@pytest.mark.parametrize("name", sorted(SHARED_WEIGHTS))
def test_positional_weights_every_bag_shares_are_fused(exported, name):
    """einsum('bkd,k->bd') / matvec(rows, v, transpose_a=True) / tensordot(rows, v, [[1], [0]]): weights
    of the bag axis only (one per position) weigh every bag alike; the first two were reported as not
    matching the ids' shape, tensordot was silent."""
    _, _, loaded, sites = exported
    specs, _, weights = SHARED_WEIGHTS[name]
    [site] = sites[name]
    assert (site.status, site.weighted) == ("fused", True), site.reason
    for batch in (0, 1, 3):
        feed = _inputs(specs, batch)
        w = np.broadcast_to(weights, feed["args_0"].shape).astype(np.float64)
        reference = np.einsum("...k,...kd->...d", w, TABLE.astype(np.float64)[feed["args_0"]])
        want, got = _run_both(loaded, name, feed)
        np.testing.assert_allclose(want, reference, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        if batch:
            from_lite = loaded[2].get_signature_runner(name)(**feed)["out"]
            np.testing.assert_allclose(from_lite, want, rtol=1e-5, atol=1e-5)
