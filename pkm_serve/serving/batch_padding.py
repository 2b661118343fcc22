"""How a batch's requests are padded to one another (batching_util.cc's AddPadding, with
pad_variable_length_inputs) and to the batch's allowed size (batching_session.cc)."""
import grpc
import numpy as np

from pkm_serve.serving.errors import ServingError


def merge_inputs(tasks, padding_rows, pad_variable_length_inputs):
    """The batch's inputs: the tasks' concatenated along dimension 0 (each first padded past
    dimension 0 to the batch's largest sizes, with pad_variable_length_inputs), then
    `padding_rows` copies of the last task's first row (batching_session.cc)."""
    merged = {}
    for k in tasks[0].inputs:
        parts = [t.inputs[k] for t in tasks]
        if pad_variable_length_inputs and parts[0].ndim > 1:
            shape = tuple(max(sizes) for sizes in zip(*(p.shape[1:] for p in parts)))
            parts = [_pad_past_dim0(p, shape) for p in parts]
        if padding_rows:
            parts.append(np.repeat(parts[-1][:1], padding_rows, axis=0))
        merged[k] = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
    return merged


def _pad_past_dim0(value, shape):
    """batching_util.cc AddPadding: `value` grown after its elements in every dimension but
    the 0th to `shape`, the new places filled with its first element."""
    if value.shape[1:] == shape:
        return value
    out = np.full(value.shape[:1] + shape, value.flat[0], dtype=value.dtype)
    out[tuple(slice(0, n) for n in value.shape)] = value
    return out


def drop_unpaddable(tasks):
    """The tasks that AddPadding can pad for this batch; the others get its error (upstream
    fails the whole batch with it: here only the request that causes it)."""
    largest = {k: tuple(max(sizes) for sizes in zip(*(t.inputs[k].shape[1:] for t in tasks)))
               for k in tasks[0].inputs} if tasks else {}
    keep = []
    for t in tasks:
        problem = None
        for k, v in t.inputs.items():
            if v.ndim > 6:
                problem = "Only tensors with rank from 1 to 6 can be padded."
            elif v.size == 0 and v.shape[1:] != largest[k]:
                problem = "Got empty tensor in batch of non-empty tensors."
        if problem is None:
            keep.append(t)
        else:
            t.error = ServingError(grpc.StatusCode.INVALID_ARGUMENT, problem)
    return keep
