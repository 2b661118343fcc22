"""Bags written as a matmul of weights by the gathered rows. tf.matmul(tf.broadcast_to(v, [tf.shape(ids)[0],
1, K]), rows) (weights [..., 1, K] of any making) was reported; now fused. And a fused matmul bag answered
requests the original refuses: the matmul contracts the weights' K with the ids' K and broadcasts neither,
where the op broadcast ids and weights (weights fed [B, 1], ids of one position against K positional
weights); an Assert now refuses them as the original does (matmul_width.py)."""
import numpy as np
import pytest
import tensorflow as tf

from export_models import run_as_a_server
from round34_forms import IDS, K, N, POSITION_WEIGHTS, RNG, WEIGHTS, np_bags, run_both, save_and_export


def _ids(batch, k=K):
    ids = RNG.integers(0, N, (batch, k))
    ids[0, 1:3] = ids[0, 0]  # repeated ids
    return ids


BROADCAST_ROWS = {
    "batch_of_the_ids": lambda m, ids: tf.matmul(tf.broadcast_to(m.v, [tf.shape(ids)[0], 1, K]), tf.gather(m.t, ids)),
    "batch_of_the_ids_from_slice": lambda m, ids: tf.matmul(
        tf.broadcast_to(m.v[None, None, :], tf.stack([tf.shape(ids)[0], 1, K])), tf.gather(m.t, ids)),
    "tiled": lambda m, ids: tf.matmul(tf.tile(m.v[None, None, :], [tf.shape(ids)[0], 1, 1]), tf.gather(m.t, ids)),
}


@pytest.mark.parametrize("form", sorted(BROADCAST_ROWS))
def test_matmul_of_positional_weights_broadcast_to_the_batch_is_fused(tmp_path, form):
    result = save_and_export(tmp_path, [IDS], lambda m, ids: BROADCAST_ROWS[form](m, ids))
    [site] = result.sites
    assert (site.status, site.pattern, site.weighted) == ("fused", "matmul", True), site.reason
    for batch in (1, 5):
        ids = _ids(batch)
        expected = np_bags(ids, POSITION_WEIGHTS)[:, None]
        want, got = run_both(tmp_path, result, ids)
        np.testing.assert_allclose(want, expected, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


# (signature, body, feeds the original's matmul refuses)
MATMUL_BAGS = {
    "weights_row": ([IDS, WEIGHTS], lambda m, ids, w: tf.matmul(w[:, None, :], tf.gather(m.t, ids)),
                    [(_ids(3), RNG.uniform(size=(3, 1)).astype(np.float32))]),
    "weights_column_adjoint": ([IDS, WEIGHTS], lambda m, ids, w: tf.matmul(w[..., None], tf.gather(m.t, ids),
                                                                           transpose_a=True),
                               [(_ids(3), RNG.uniform(size=(3, 1)).astype(np.float32))]),
    "rows_transposed": ([IDS, WEIGHTS], lambda m, ids, w: tf.matmul(tf.gather(m.t, ids), w[..., None],
                                                                    transpose_a=True),
                        [(_ids(3), RNG.uniform(size=(3, 1)).astype(np.float32))]),
    "positional": ([IDS], lambda m, ids: tf.matmul(m.v[None, None, :], tf.gather(m.t, ids)), [(_ids(3, 1),)]),
    "broadcast_to_batch": ([IDS], BROADCAST_ROWS["batch_of_the_ids"], [(_ids(3, 1),)]),
}


@pytest.mark.parametrize("form", sorted(MATMUL_BAGS))
def test_fused_matmul_bag_refuses_widths_the_original_matmul_refuses(tmp_path, form):
    specs, body, refused = MATMUL_BAGS[form]
    result = save_and_export(tmp_path, specs, body)
    [site] = result.sites
    assert site.status == "fused", site.reason
    for feed in refused:
        feed = {f"args_{i}": a for i, a in enumerate(feed)}
        for model in (tmp_path / "m", result.dst):
            with pytest.raises(tf.errors.InvalidArgumentError) as refusal:
                run_as_a_server(model, "serving_default", feed)
            if model == result.dst:
                assert "contracts the two and broadcasts neither" in str(refusal.value)
    # wider ids with weights as wide (a server feeds any shape) are answered alike
    wide_ids = _ids(2, K + 2)
    feed = {"args_0": wide_ids} if len(specs) == 1 else {
        "args_0": wide_ids, "args_1": RNG.uniform(size=(2, K + 2)).astype(np.float32)}
    if len(specs) == 1:  # positional weights have K entries: both refuse ids of K + 2
        for model in (tmp_path / "m", result.dst):
            with pytest.raises(tf.errors.InvalidArgumentError):
                run_as_a_server(model, "serving_default", feed)
        return
    expected = np_bags(wide_ids, feed["args_1"])
    for model in (tmp_path / "m", result.dst):
        out = run_as_a_server(model, "serving_default", feed)
        np.testing.assert_allclose(out.reshape(expected.shape), expected, rtol=1e-5, atol=1e-5)
