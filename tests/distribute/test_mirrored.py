"""MirroredStrategy: EmbeddingBag and ProductKeyMemory models train to the
same weights on 1 and on 2 replicas (2 logical CPU devices, same global
batch), with dense and with row-sparse table gradients."""

import os
import subprocess
import sys

import numpy as np
import pytest

from tests.pairwise import pairwise

HERE = os.path.dirname(os.path.abspath(__file__))


# 1 and 2 replicas sum the batch's gradients in a different order, so the
# weights differ by float32 rounding. SGD passes that on as it is (at most
# 5e-7 relative over 12 random initialisations). Adam divides each step by
# sqrt(v), which turns rounding of a near-zero gradient element into a larger
# relative change of its step: at most 3e-6 over the same 12, and once 2.3e-5
# in CI with an unseeded initialisation. Losing one replica's gradient
# (training on half of each batch) moves every weight by >= 6e-3 relative
# with SGD and >= 9e-2 with Adam, far above either bound.
TOLERANCE = {"sgd": 1e-5, "lazy_adam": 1e-4}


# Every pair of (model, table gradient, optimizer) values, in 4 trainings instead of 8.
CASES = pairwise(("embedding_bag", "pkm"), ("dense", "sparse"), ("sgd", "lazy_adam"))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return _arrays_of_script(tmp_path_factory.mktemp("mirrored") / "weights.npz", "mirrored_train.py",
                             ["-".join(case) for case in CASES])


def _arrays_of_script(out, script, args=()):
    """The arrays `script` (in this folder) saves to `out`, run in a fresh
    interpreter: logical devices must be set before TF initialises."""
    proc = subprocess.run([sys.executable, os.path.join(HERE, script), str(out), *args],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(np.load(out))


@pytest.mark.slow
@pytest.mark.parametrize("kind,gradient,optimizer", CASES)
def test_one_and_two_replicas_train_to_equal_weights(trained, kind, gradient, optimizer):
    key = f"{kind}-{gradient}-{optimizer}"
    count = sum(1 for k in trained if k.startswith(f"{key}/one/"))
    assert count >= 3  # table (and keys for pkm), head kernel, head bias
    for i in range(count):
        one, two, init = (trained[f"{key}/{which}/{i}"] for which in ("one", "two", "init"))
        assert np.max(np.abs(one - init)) > 1e-3, f"{key} weight {i} did not train"
        rel = np.max(np.abs(one - two)) / np.max(np.abs(one))
        assert rel <= TOLERANCE[optimizer], f"{key} weight {i}: 1 vs 2 replicas differ by {rel:.3g} (relative)"


@pytest.mark.slow
@pytest.mark.parametrize("kind,gradient,optimizer", CASES)
def test_every_replica_of_the_table_is_read_in_place_after_training(trained, kind, gradient, optimizer):
    # SGD scatters a row-sparse gradient into each replica's variable; each must leave
    # copy-on-read mode again, or every later dense read (predict) copies the table.
    key = f"{kind}-{gradient}-{optimizer}"
    for which, replicas in (("one", 1), ("two", 2)):
        copies = trained[f"{key}/reads_copy/{which}"]
        assert copies.shape == (replicas,), f"{key} ({which}): found {copies.shape[0]} table replicas"
        assert not copies.any(), f"{key} ({which}): a replica of the table copies on every read"


_FUSED_UNDER_TWO_REPLICAS = """
import os
os.environ["KERAS_BACKEND"] = "tensorflow"
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras, numpy as np
from pkm_serve.layers import EmbeddingBag
from pkm_serve.optimizers import LazyAdam
with tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]).scope():
    ids = keras.Input((4,), dtype="int64")
    model = keras.Model(ids, keras.layers.Dense(1)(EmbeddingBag(50, 8, fused_optimizer=True)(ids)))
    model.compile(LazyAdam(0.01), "mse")
try:
    model.fit(np.random.randint(0, 50, (16, 4)), np.ones((16, 1), np.float32), batch_size=8, verbose=0)
    print("trained")
except ValueError as e:
    print("refused:", " ".join(str(e).split()))
"""


def test_the_fused_optimizer_is_refused_under_several_replicas():
    """Each replica's backward would update the table with its own gradient, and TF's ring
    gatherer crashed the process (a custom loop) on the empty table gradient it returns."""
    proc = subprocess.run([sys.executable, "-c", _FUSED_UNDER_TWO_REPLICAS], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("refused:"), proc.stdout[-2000:]  # Keras wraps the layer's ValueError
    assert "fused_optimizer=True does not run under a tf.distribute strategy with 2 replicas" in proc.stdout


_ALL_PADDING_BATCH = """
import os
os.environ["KERAS_BACKEND"] = "tensorflow"
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras, numpy as np
from pkm_serve.layers import EmbeddingBag
x = np.random.default_rng(0).integers(0, 50, (16, 4))
x[:8] = -1  # the first global batch is all padding: no replica touches a row
y = np.random.default_rng(1).standard_normal((16, 1)).astype(np.float32)
tables = []
for devices in (["/cpu:0"], ["/cpu:0", "/cpu:1"]):
    keras.utils.set_random_seed(0)
    with tf.distribute.MirroredStrategy(devices).scope():
        ids = keras.Input((4,), dtype="int64")
        bag = EmbeddingBag(50, 8, sparse_gradient=True)
        model = keras.Model(ids, keras.layers.Dense(1)(bag(ids)))
        model.compile(keras.optimizers.SGD(0.1), "mse")
    init = bag.embeddings.numpy()
    model.fit(x, y, batch_size=8, verbose=0, shuffle=False)
    tables.append(bag.embeddings.numpy())
moved = np.abs(tables[0] - init).max()
print("diff", np.abs(tables[0] - tables[1]).max() / moved, "moved", moved)
"""


def test_sparse_gradient_of_an_all_padding_batch_under_two_replicas():
    """TF's ring gatherer crashed the process (SIGSEGV) on a row-sparse gradient empty on every
    replica; now it trains to the one-replica weights."""
    proc = subprocess.run([sys.executable, "-c", _ALL_PADDING_BATCH], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    diff, moved = (float(v) for v in proc.stdout.split()[1::2])
    assert moved > 1e-3 and diff <= 1e-5, proc.stdout


# Every optimizer once, LazyAdam (the one that stepped row 0) on both paths; clipping, EMA, and an
# overflow of mixed_float16's loss scale on one replica (LazyAdam's check and the one installed for SGD).
UNTOUCHED_CASES = [("fit", "lazy_adam"), ("ragged", "lazy_adam"), ("ragged", "rowwise_adagrad"), ("fit", "sgd"),
                   ("ragged", "adam"), ("fit", "lazy_adam_clipnorm"), ("ragged", "lazy_adam_global_clipnorm"),
                   ("fit", "lazy_adam_ema"), ("overflow", "lazy_adam"), ("overflow", "sgd")]


@pytest.fixture(scope="module")
def untouched_table_runs(tmp_path_factory):
    return _arrays_of_script(tmp_path_factory.mktemp("untouched") / "tables.npz", "untouched_table_train.py",
                             ["-".join(case) for case in UNTOUCHED_CASES])


@pytest.mark.slow
@pytest.mark.parametrize("path,optimizer", UNTOUCHED_CASES)
def test_a_step_no_replica_touches_trains_as_on_one_replica(untouched_table_runs, path, optimizer):
    """A global batch of padding only, after a step that gave row 0 moments: 2 replicas got a zero
    row-0 gradient there (TF's gatherer crashes on slices empty everywhere) and LazyAdam stepped
    row 0 with its decayed moments (0.36 of the training's largest move, relative); one replica
    leaves it. Now every optimizer trains to the one-replica table."""
    key = f"{path}-{optimizer}"
    one, two, init = (untouched_table_runs[f"{key}/{which}"] for which in ("one", "two", "init"))
    assert np.abs(one[0] - init[0]).max() > 1e-2  # row 0 trained (step 1), so its moments are not 0
    rel = np.abs(one - two).max() / np.abs(one - init).max()
    assert rel <= 1e-5, f"{key}: 1 vs 2 replicas differ by {rel:.3g} (relative)"


@pytest.mark.slow
def test_ema_overwrite_under_a_mirrored_strategy_trains_as_without_one(untouched_table_runs):
    """use_ema with ema_overwrite_frequency: Keras overwrites the variables with their averages through
    a merge_call inside a tf.cond, which TF refuses, so fit failed under any MirroredStrategy (Keras'
    own Adam too). LazyAdam / RowwiseAdagrad now overwrite each replica's copy: the table trains as
    without a strategy (a skipped overwrite: 0.45 apart, relative; 1 and 2 replicas agree even then)."""
    one, two, plain = (untouched_table_runs[f"fit-lazy_adam_ema/{which}"] for which in ("one", "two", "no_strategy"))
    init = untouched_table_runs["fit-lazy_adam_ema/init"]
    without_ema = untouched_table_runs["fit-lazy_adam/one"]
    moved = np.abs(plain - init).max()
    assert np.abs(plain - without_ema).max() > 0.1 * moved  # EMA plays a part here
    for replicas, table in (("1", one), ("2", two)):
        rel = np.abs(table - plain).max() / moved
        assert rel <= 1e-5, f"{replicas} replica(s) vs no strategy differ by {rel:.3g} (relative)"
