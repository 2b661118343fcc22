"""Positional weights v every bag shares, given as a signature input: a server feeds v in any shape.
The original indexes v[k] (refusing v shorter than K, reading K of a longer v) or multiplies
v[None, None, :] @ rows / tensordot (refusing any length but K); the fused op broadcast v to the ids
(v [1] and v [2, K] answered, v [K + 2] refused). Now reported, left as written; v a variable or a
constant stays fused (test_export_forms_round34*.py)."""
import numpy as np
import pytest
import tensorflow as tf

from export_models import run_as_a_server
from round34_forms import FIELD_IDS, FIELDS, K, N, RNG, TABLE, save_and_export

IDS = tf.TensorSpec([None, K], tf.int64)
V = tf.TensorSpec([K], tf.float32)

FED_WEIGHTS = {  # (ids spec, body, reads only v[:K] (indexing) rather than all of v (a product))
    "gathered_positions": (IDS, lambda m, ids, v: tf.add_n([tf.gather(m.t, ids[:, k]) * v[k] for k in range(K)]), True),
    "sliced_rows": (IDS, lambda m, ids, v: (lambda rows: tf.add_n([rows[:, k] * v[k] for k in range(K)]))(
        tf.gather(m.t, ids)), True),
    "matmul": (IDS, lambda m, ids, v: tf.squeeze(tf.matmul(v[None, None, :], tf.gather(m.t, ids)), 1), False),
    "tensordot": (FIELD_IDS, lambda m, ids, v: tf.tensordot(tf.gather(m.t, ids), v, axes=[[2], [0]]), False),
}


@pytest.mark.parametrize("form", sorted(FED_WEIGHTS))
def test_positional_weights_fed_as_an_input_are_reported_and_answer_as_the_original(tmp_path, form):
    spec, body, indexes = FED_WEIGHTS[form]
    result = save_and_export(tmp_path, [spec, V], body)
    [site] = result.sites
    assert site.status == "skipped" and "fed at run time" in site.reason, (site.status, site.reason)
    ids = RNG.integers(0, N, (2, K) if spec is IDS else (2, FIELDS, K))
    for length in (K, 1, K + 2):
        v = RNG.uniform(0.5, 2, length).astype(np.float32)
        feed = {"args_0": ids, "args_1": v}
        answers = length == K or (indexes and length > K)
        for model in (tmp_path / "m", result.dst):
            if not answers:
                with pytest.raises(tf.errors.InvalidArgumentError):
                    run_as_a_server(model, "serving_default", feed)
                continue
            expected = np.einsum("...k,...kd->...d", v[:K].astype(np.float64) * np.ones(ids.shape),
                                 TABLE.astype(np.float64)[ids])
            np.testing.assert_allclose(run_as_a_server(model, "serving_default", feed), expected, rtol=1e-5, atol=1e-5)
