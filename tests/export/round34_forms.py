"""Shared by the round-34 export form tests: a tf.Module with a table `t` and positional weights `v`
saved with one signature and exported, both SavedModels run, and the numpy float64 bag reference."""
import collections
import os

import numpy as np
import tensorflow as tf

from pkm_serve import ops
from pkm_serve.export import export_saved_model

ops.load_library()

N, D, K, FIELDS = 30, 4, 5, 3
RNG = np.random.default_rng(34)
TABLE = RNG.standard_normal((N, D)).astype(np.float32)
POSITION_WEIGHTS = RNG.uniform(0.5, 2, K).astype(np.float32)
IDS = tf.TensorSpec([None, K], tf.int64)
WEIGHTS = tf.TensorSpec([None, K], tf.float32)
FIELD_IDS = tf.TensorSpec([None, FIELDS, K], tf.int64)


def save_and_export(tmp_path, specs, body, table=TABLE, **export_args):
    module = tf.Module()
    module.t = tf.Variable(table)
    module.v = tf.Variable(POSITION_WEIGHTS)
    f = tf.function(input_signature=specs)(lambda *args: {"out": body(module, *args)})
    tf.saved_model.save(module, str(tmp_path / "m"), signatures={"serving_default": f})
    return export_saved_model(str(tmp_path / "m"), str(tmp_path / "out"), quiet=True, **export_args)


_LOADED = collections.OrderedDict()


def loaded_signature(path, name="serving_default"):
    """A SavedModel's signature, loaded once per written SavedModel (keyed by its
    saved_model.pb's path and mtime; the last few kept): a test runs several inputs
    through its original and fused models, and each load costs more than the runs."""
    pb = os.path.join(str(path), "saved_model.pb")
    key = (pb, os.stat(pb).st_mtime_ns)
    if key not in _LOADED:
        _LOADED[key] = tf.saved_model.load(str(path))
        while len(_LOADED) > 4:
            _LOADED.popitem(last=False)
    return _LOADED[key].signatures[name]


def run_both(tmp_path, result, *args):
    """The original's and the fused SavedModel's output for the signature's args in order."""
    inputs = {f"args_{i}": a for i, a in enumerate(args)}
    original = loaded_signature(tmp_path / "m")
    fused = loaded_signature(result.dst)
    return original(**inputs)["out"].numpy(), fused(**inputs)["out"].numpy()


def random_ids(batch=4, k=K):
    ids = RNG.integers(1, N, (batch, k))
    ids[0, 2:] = 0  # padding for the masked forms
    return ids


def np_bags(ids, weights=None):
    """sum_k w[b, k] * table[ids[b, k]] in float64 (w: [B, K], [K] or None)."""
    w = np.ones(ids.shape) if weights is None else np.broadcast_to(weights, ids.shape)
    return np.einsum("bk,bkd->bd", w.astype(np.float64), TABLE.astype(np.float64)[ids])
