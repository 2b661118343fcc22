"""tf.train.Checkpoint restores of LazyAdam / RowwiseAdagrad's float32 state of a float16 / bfloat16
variable from a checkpoint that holds it in the variable's half dtype (an earlier pkm_serve, Keras'
Adam).

TF's restore reads each saved tensor in the dtype the variable's ``_serialize_to_tensors`` gives, and
RestoreV2 refused a half tensor for a float32 one ("expected dtype float does not equal original
dtype bfloat16"), failing the whole read, the model's weights included. Here, within a restore of
the variable (a ``CheckpointPosition`` of it among the callers), that method gives the checkpoint's
half dtype, and the restore casts the tensor read to float32. Saving is left as it is (float32).
"""

from __future__ import annotations

import sys

import tensorflow as tf
from tensorflow.python.checkpoint import restore as tf_restore

_HALF = (tf.float16, tf.bfloat16)


def accept_half_checkpoints(variable):
    """Lets a tf.train.Checkpoint restore float32 `variable` from a half-precision saved tensor."""
    serialize, restore = variable._serialize_to_tensors, variable._restore_from_tensors

    def serialize_as_saved():
        tensors = serialize()
        saved = _saved_dtypes(variable)
        # the value read is not restored: the restore reads the dtype (and device) from it
        return {name: tf.cast(tf.convert_to_tensor(variable), saved[name]) if _is_half_of(saved.get(name), tensor)
                else tensor for name, tensor in tensors.items()}

    def restore_in_own_dtype(restored_tensors):
        return restore({name: tf.cast(tensor, variable.dtype) for name, tensor in restored_tensors.items()})

    variable._serialize_to_tensors = serialize_as_saved
    variable._restore_from_tensors = restore_in_own_dtype


def _is_half_of(saved_dtype, tensor):
    return saved_dtype in _HALF and tensor.dtype != saved_dtype


def _saved_dtypes(variable):
    """{attribute name: dtype in the checkpoint} where `variable` is being restored, else {}."""
    frame = sys._getframe(2)
    while frame is not None:
        position = frame.f_locals.get("self")
        if isinstance(position, tf_restore.CheckpointPosition) and position.trackable is variable:
            dtype_map = getattr(position.checkpoint, "dtype_map", None) or {}
            return {attribute.name: dtype_map.get(attribute.checkpoint_key)
                    for attribute in position.object_proto.attributes}
        frame = frame.f_back
    return {}
