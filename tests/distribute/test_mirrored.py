"""MirroredStrategy: EmbeddingBag and ProductKeyMemory models train to the
same weights on 1 and on 2 replicas (2 logical CPU devices, same global
batch), with dense and with row-sparse table gradients."""

import json
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
def two_replica_runs(tmp_path_factory, request):
    """(process, output folder) of one fresh interpreter (logical devices must be set before TF
    initialises) that runs all of this module's trainings: mirrored_train.py's CASES, then
    untouched_table_train.py's UNTOUCHED_CASES, then the checks below. Each part saves its results
    before the next starts, so a crash (the bugs below crashed the process) fails the tests of the
    parts it left without results, with the process' stderr."""
    out = tmp_path_factory.mktemp("two_replicas")
    # The trainings only where this module's slow tests (their readers) run, not under -m "not slow".
    slow = any(item.module is request.module and item.get_closest_marker("slow") for item in request.session.items)
    cases = [",".join("-".join(c) for c in cases) if slow else "" for cases in (CASES, UNTOUCHED_CASES)]
    proc = subprocess.run([sys.executable, "-c", _RUNNER, HERE, str(out), *cases], capture_output=True, text=True,
                          timeout=1200)  # the two scripts' limits together
    return proc, out


def _saved(runs, name):
    proc, out = runs
    if not (out / name).exists():
        pytest.fail(f"no {name} (exit status {proc.returncode}): {proc.stderr[-3000:]}")
    return dict(np.load(out / name)) if name.endswith(".npz") else json.loads((out / name).read_text())


def _check(runs, name):
    """The result of one of the runner's checks, or a failure with its stderr."""
    results = _saved(runs, "checks.json")
    if name not in results:
        pytest.fail(f"check {name} gave no result (exit status {runs[0].returncode}): {runs[0].stderr[-3000:]}")
    return results[name]


@pytest.fixture(scope="module")
def trained(two_replica_runs):
    return _saved(two_replica_runs, "weights.npz")


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


_RUNNER = """
import json, sys, traceback
here, out, mirrored_cases, untouched_cases = sys.argv[1:]
sys.path.insert(0, here)
import mirrored_train  # sets 2 logical CPU devices (untouched_table_train sets the same: no change)
import untouched_table_train
import keras, numpy as np, tensorflow as tf
from pkm_serve.layers import EmbeddingBag
from pkm_serve.optimizers import LazyAdam


def fused_under_two_replicas():
    with tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]).scope():
        ids = keras.Input((4,), dtype="int64")
        model = keras.Model(ids, keras.layers.Dense(1)(EmbeddingBag(50, 8, fused_optimizer=True)(ids)))
        model.compile(LazyAdam(0.01), "mse")
    try:
        model.fit(np.random.randint(0, 50, (16, 4)), np.ones((16, 1), np.float32), batch_size=8, verbose=0)
        return "trained"
    except ValueError as e:
        return "refused: " + " ".join(str(e).split())


def all_padding_batch():
    x = np.random.default_rng(0).integers(0, 50, (16, 4))
    x[:8] = -1  # the first global batch is all padding: no replica touches a row
    y = np.random.default_rng(1).standard_normal((16, 1)).astype(np.float32)
    tables = []
    for devices in (["/cpu:0"], ["/cpu:0", "/cpu:1"]):
        keras.utils.set_random_seed(0)
        with tf.distribute.MirroredStrategy(devices).scope():  # TF's default cross-device ops
            ids = keras.Input((4,), dtype="int64")
            bag = EmbeddingBag(50, 8, sparse_gradient=True)
            model = keras.Model(ids, keras.layers.Dense(1)(bag(ids)))
            model.compile(keras.optimizers.SGD(0.1), "mse")
        init = bag.embeddings.numpy()
        model.fit(x, y, batch_size=8, verbose=0, shuffle=False)
        tables.append(bag.embeddings.numpy())
    moved = np.abs(tables[0] - init).max()
    return {"diff": float(np.abs(tables[0] - tables[1]).max() / moved), "moved": float(moved)}


checks = {}
parts = [("fused", fused_under_two_replicas), ("all_padding", all_padding_batch)]
if untouched_cases:
    parts.insert(0, ("tables.npz", lambda: untouched_table_train.main(out + "/tables.npz", untouched_cases.split(","))))
if mirrored_cases:
    parts.insert(0, ("weights.npz", lambda: mirrored_train.main(out + "/weights.npz", mirrored_cases.split(","))))
for name, part in parts:
    try:  # a Python error fails its part alone
        result = part()
    except BaseException:
        traceback.print_exc()
        continue
    finally:
        sys.stderr.flush()
    if not name.endswith(".npz"):
        checks[name] = result
        with open(out + "/checks.json", "w") as f:
            json.dump(checks, f)
"""


def test_the_fused_optimizer_is_refused_under_several_replicas(two_replica_runs):
    """Each replica's backward would update the table with its own gradient, and TF's ring
    gatherer crashed the process (a custom loop) on the empty table gradient it returns."""
    refusal = _check(two_replica_runs, "fused")
    assert refusal.startswith("refused:"), refusal  # Keras wraps the layer's ValueError
    assert "fused_optimizer=True does not run under a tf.distribute strategy with 2 replicas" in refusal


def test_sparse_gradient_of_an_all_padding_batch_under_two_replicas(two_replica_runs):
    """TF's ring gatherer crashed the process (SIGSEGV) on a row-sparse gradient empty on every
    replica; now it trains to the one-replica weights."""
    result = _check(two_replica_runs, "all_padding")
    assert result["moved"] > 1e-3 and result["diff"] <= 1e-5, result


# Every optimizer once, LazyAdam (the one that stepped row 0) on both paths; clipping, EMA, and an
# overflow of mixed_float16's loss scale on one replica (LazyAdam's check and the one installed for SGD).
UNTOUCHED_CASES = [("fit", "lazy_adam"), ("ragged", "lazy_adam"), ("ragged", "rowwise_adagrad"), ("fit", "sgd"),
                   ("ragged", "adam"), ("fit", "lazy_adam_clipnorm"), ("ragged", "lazy_adam_global_clipnorm"),
                   ("fit", "lazy_adam_ema"), ("overflow", "lazy_adam"), ("overflow", "sgd")]


@pytest.fixture(scope="module")
def untouched_table_runs(two_replica_runs):
    return _saved(two_replica_runs, "tables.npz")


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
