"""Gathered rows pooled by a window (Keras AveragePooling1D / MaxPooling1D of an Embedding: tf.nn.avg_pool /
max_pool of the rows expanded to [B, 1, K, D]) were no site at all, not even reported. A window shorter than
the bag is reported (not fused), the outputs unchanged. An average pool of one window of the whole bag is
the mean bag: it was reported too; it is fused (as reduce_mean is; weighted rows divided by K), its
[B, 1, D] shape kept. One export of one model holding every form; outputs against numpy float64."""
import numpy as np
import pytest
import tensorflow as tf

from round34_forms import IDS, K, N, POSITION_WEIGHTS, RNG, TABLE, save_and_export

D = TABLE.shape[1]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("windowed_pooling")
    result = save_and_export(tmp_path, [IDS], lambda m, ids: tf.concat([
        tf.reshape(tf.nn.avg_pool1d(tf.gather(m.t, ids), K, K, "VALID"), [-1, D]),
        tf.reshape(tf.nn.avg_pool1d(tf.gather(m.t, ids) * m.v[:, None], K, 1, "VALID"), [-1, D]),
        tf.reshape(tf.nn.avg_pool1d(tf.gather(m.t, ids), 2, 2, "VALID"), [-1, 2 * D]),
        tf.reshape(tf.nn.max_pool1d(tf.gather(m.t, ids), 2, 2, "VALID"), [-1, 2 * D])], 1))
    return tmp_path, result


def test_whole_bag_average_pools_are_fused_and_windows_reported(exported):
    _, result = exported
    assert [(s.status, s.combiner) for s in result.sites] == [
        ("fused", "mean"), ("fused", "sum"), ("skipped", "mean"), ("skipped", "max")], \
        [s.reason for s in result.sites]
    assert all("pooled by a window" in s.reason for s in result.sites[2:])


def test_pooled_bags_compute_the_original(exported):
    tmp_path, result = exported
    ids = RNG.integers(0, N, (3, K))
    rows = TABLE.astype(np.float64)[ids]
    weighted = rows * POSITION_WEIGHTS.astype(np.float64)[:, None]
    expected = np.concatenate([rows.mean(1), weighted.mean(1), rows[:, :4].reshape(3, 2, 2, D).mean(2).reshape(
        3, -1), rows[:, :4].reshape(3, 2, 2, D).max(2).reshape(3, -1)], 1)
    for model in (tmp_path / "m", result.dst):
        out = tf.saved_model.load(str(model)).signatures["serving_default"](args_0=ids)["out"].numpy()
        np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)
