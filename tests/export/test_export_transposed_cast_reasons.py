"""Float16 rows transposed to [B, D, K] and cast to float32 before the mean over K (Keras mixed precision's
Permute + channels_first pooling) are fused since round 37; where such a site stays composite, its report said
"a cast after the transpose is not fused", untrue and not the cause. It now names the cause: keepdims=True, the
transposed rows read by another op too, or more casts than the two fused. One export of one model holding the
three reported sites and the fused one (its outputs: test_export_transposed_half_rows.py)."""
import numpy as np
import pytest
import tensorflow as tf

from round34_forms import IDS, TABLE, save_and_export

HALF = TABLE.astype(np.float16)


def _transposed(m, ids):
    return tf.transpose(tf.gather(m.t, ids), [0, 2, 1])


def _read_twice(m, ids):
    rows = _transposed(m, ids)
    return tf.reduce_mean(tf.cast(rows, tf.float32), -1) + tf.cast(rows[:, :, 0], tf.float32)


FORMS = {  # name: (body of (module, ids), words the site's reason holds; None: fused)
    "fused": (lambda m, i: tf.reduce_mean(tf.cast(_transposed(m, i), tf.float32), -1), None),
    "keepdims": (lambda m, i: tf.reduce_mean(tf.cast(_transposed(m, i), tf.float32), -1, keepdims=True)[..., 0],
                 "keepdims=True"),
    "read_twice": (_read_twice, "is read by another op too"),
    "three_casts": (lambda m, i: tf.reduce_mean(tf.cast(tf.cast(tf.cast(_transposed(m, i), tf.float32),
                                                                tf.float16), tf.float32), -1), "3 casts in a row"),
}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("transposed_cast_reasons")
    return save_and_export(tmp_path, [IDS], lambda m, i: tf.concat(
        [body(m, i) for body, _ in FORMS.values()], 1), table=HALF)


def test_transposed_cast_sites_left_composite_name_their_cause(exported):
    sites = exported.sites
    assert len(sites) == len(FORMS), [s.reason for s in sites]
    for site, (name, (_, words)) in zip(sites, FORMS.items()):
        if words is None:
            assert site.status == "fused", (name, site.reason)
            continue
        assert site.status == "skipped" and words in site.reason, (name, site.reason)
        assert "a cast after the transpose is not fused" not in site.reason, (name, site.reason)

