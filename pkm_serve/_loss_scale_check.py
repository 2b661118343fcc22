"""Keras' ``LossScaleOptimizer.check_finite`` (what ``mixed_float16`` wraps every optimizer in),
reading an ``IndexedSlices``' values alone: the rows it leaves out are 0.

Keras' check scattered each slice's verdict into a dense ``[N, D]`` bool tensor, where a row
listed twice (a table looked up twice: TF concatenates the lookups' slices) kept one slice's
verdict: an inf in the other passed, and the step wrote inf / NaN into the table instead of being
skipped, with every optimizer (stock ``Adam`` and ``SGD`` too). A sparse-gradient lookup, or
a composite one (its gather's gradient is an ``IndexedSlices`` of a slice per index), installs
this check on Keras' class (``install``); checks of gradients without ``IndexedSlices`` are
Keras' own, and a subclass' own ``check_finite`` is left as it is.
"""

from __future__ import annotations

import functools
import sys

import tensorflow as tf

_INSTALLED = "_pkm_reads_slice_values"


def all_finite(grads):
    """Whether every gradient is finite, an IndexedSlices' values read alone; in a replica context of
    several replicas, every replica's gradients: Keras checks each replica's own, not yet all-reduced,
    and takes the first replica's verdict, so an overflow on another replica alone was applied (inf /
    NaN weights, the loss scale kept), with every optimizer."""
    finite = [tf.reduce_all(tf.math.is_finite(g.values if isinstance(g, tf.IndexedSlices) else g))
              for g in grads if g is not None]
    finite = tf.reduce_all(tf.stack(finite)) if finite else tf.constant(True)
    context = tf.distribute.get_replica_context()  # None in a cross-replica context
    if context is None or context.num_replicas_in_sync < 2:
        return finite
    replicas_not_finite = context.all_reduce(tf.distribute.ReduceOp.SUM, tf.cast(tf.logical_not(finite), tf.int32))
    return tf.equal(replicas_not_finite, 0)


def install():
    """Gives Keras' LossScaleOptimizer the check above for IndexedSlices. Without keras imported
    there is no LossScaleOptimizer yet: nothing is done, and a later call installs it."""
    keras = sys.modules.get("keras")
    wrapper = getattr(getattr(keras, "optimizers", None), "LossScaleOptimizer", None)
    if wrapper is None or getattr(wrapper.check_finite, _INSTALLED, False):
        return
    keras_check = wrapper.check_finite

    @functools.wraps(keras_check)  # __wrapped__: Keras' own
    def check_finite(self, grads):
        if any(isinstance(g, tf.IndexedSlices) for g in grads):
            return all_finite(grads)
        return keras_check(self, grads)

    setattr(check_finite, _INSTALLED, True)
    wrapper.check_finite = check_finite
