"""The registered PyTorch ops (torch.ops.pkm_serve.embedding_bag / _backward) called
directly, past pkm_serve.backends.embedding_bag's checks: what the kernels would read
through raw pointers is checked by the ops themselves (a strided table was read in storage
order, short weights and a small grad past their buffers, a float16 grad as float32 bits)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def ops():
    from pkm_serve.backends import torch_ops  # noqa: F401  (registers the ops)

    return torch.ops.pkm_serve.embedding_bag, torch.ops.pkm_serve.embedding_bag_backward


TABLE = torch.arange(20, dtype=torch.float32).reshape(5, 4)
IDS = torch.tensor([[1, 2, -1], [4, 0, 0]])


@pytest.mark.parametrize("args, error, message", [
    ((torch.arange(20.0).reshape(4, 5).t(), IDS, None, None, 0), ValueError, "table must be contiguous"),
    ((TABLE, IDS, torch.ones(1), None, 0), ValueError, r"weights must be \(2, 3\) torch.float32"),
    ((TABLE, IDS, torch.ones(2, 3, dtype=torch.float64), None, 0), ValueError, "weights must be"),
    ((TABLE, IDS.float(), None, None, 0), TypeError, "indices must be int32 or int64"),
    ((TABLE.double(), IDS, None, None, 0), TypeError, "table must be a"),
    ((TABLE, IDS[None], None, None, 0), ValueError, r"indices must be \[B, K\]"),
    ((TABLE, IDS.reshape(-1), None, torch.tensor([[0, 6]]), 0), ValueError, "row_splits must be a"),
])
def test_forward_op_refuses_what_it_cannot_read(ops, args, error, message):
    with pytest.raises(error, match=message):
        ops[0](*args)


@pytest.mark.parametrize("grad", [torch.ones(1, 1), torch.ones(2, 4, dtype=torch.float16), torch.ones(3, 4)])
def test_backward_op_refuses_a_grad_of_another_shape_or_dtype(ops, grad):
    with pytest.raises(ValueError, match=r"grad must be \[2, 4\] torch.float32"):
        ops[1](grad, TABLE, IDS, None, None, 0)


def test_direct_calls_still_match_the_reference(ops):
    out = ops[0](TABLE, IDS, None, None, 0)
    table = TABLE.numpy().astype(np.float64)
    np.testing.assert_array_equal(out.numpy(), [table[1] + table[2], table[4] + 2 * table[0]])
    d_table, _ = ops[1](torch.ones(2, 4), TABLE, IDS, None, None, 0)
    np.testing.assert_array_equal(d_table[:, 0].numpy(), [2, 1, 1, 0, 1])
