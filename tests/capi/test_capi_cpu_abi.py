"""The standalone C ABI (kernels/capi) without CUDA: runs in CI.

libpkm_capi_cpu.so (`make capi-cpu`, a TEST_DEPS of `make test`; or
libpkm_cuda.so where only that was built) exports the
core's CPU forward/backward behind the same PkmBags struct that the GPU tests
hand to the CUDA launchers; this checks the struct layout and the error path
through ctypes on numpy arrays, against the numpy reference (tests/reference.py).
"""

import ctypes
import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "kernels", "capi"))
import pkm_capi  # noqa: E402

from tests.reference import embedding_bag, embedding_bag_sum_grads  # noqa: E402

LIB_PATH = os.path.join(ROOT, "pkm_serve", "lib", "libpkm_capi_cpu.so")


@pytest.fixture(scope="module")
def lib():
    # libpkm_cuda.so exports the same CPU functions: use it on GPU machines
    # where only `make gpu-standalone` was run.
    for path in (LIB_PATH, os.path.join(ROOT, "pkm_serve", "lib", "libpkm_cuda.so")):
        if os.path.exists(path):
            return pkm_capi.PkmLib(path).lib
    pytest.fail(f"{LIB_PATH} is missing: run `make capi-cpu` (make test builds it)")


def bags_for(table, indices, weights, combiner, row_splits=None):
    bags = pkm_capi.PkmBags()
    bags.table = table.ctypes.data
    bags.elem_type = 0
    bags.num_rows, bags.dim = table.shape
    bags.indices = indices.ctypes.data
    bags.indices_int64 = int(indices.dtype == np.int64)
    if row_splits is None:
        bags.num_bags, bags.bag_size = indices.shape
    else:
        bags.row_splits = row_splits.ctypes.data
        bags.row_splits_int64 = 1
        bags.num_bags = row_splits.size - 1
    bags.num_indices = indices.size
    bags.weights = weights.ctypes.data if weights is not None else None
    bags.combiner = pkm_capi.COMBINERS[combiner]
    return bags


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("idx_dtype", [np.int32, np.int64])
def test_cpu_forward_and_backward_through_the_c_abi(lib, combiner, idx_dtype):
    rng = np.random.default_rng(len(combiner) * 10 + np.dtype(idx_dtype).itemsize)
    table = rng.standard_normal((50, 24)).astype(np.float32)
    indices = rng.integers(-1, 50, size=(9, 6)).astype(idx_dtype)
    weights = rng.uniform(0.5, 1.5, size=indices.shape).astype(np.float32)
    err = ctypes.create_string_buffer(256)
    want = embedding_bag(table, indices, weights, combiner)
    for reference in (0, 1):
        out = np.full((9, 24), np.nan, np.float32)
        rc = lib.pkm_cpu_forward(ctypes.byref(bags_for(table, indices, weights, combiner)), out.ctypes.data,
                                 reference, err, len(err))
        assert rc == 0, err.value
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    # backward, sum: d_table[r] = sum of w * grad over entries of r; d_w = grad . row
    if combiner == "sum":
        grad = rng.standard_normal((9, 24)).astype(np.float32)
        d_table = np.full_like(table, np.nan)
        d_weights = np.full_like(weights, np.nan)
        rc = lib.pkm_cpu_backward(ctypes.byref(bags_for(table, indices, weights, combiner)), grad.ctypes.data,
                                  d_table.ctypes.data, d_weights.ctypes.data, 0, err, len(err))
        assert rc == 0, err.value
        want_dt, want_dw = embedding_bag_sum_grads(table, indices, weights, grad)
        np.testing.assert_allclose(d_table, want_dt, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(d_weights, want_dw, rtol=1e-5, atol=1e-5)


def test_errors_name_the_problem(lib):
    table = np.ones((4, 3), np.float32)
    indices = np.array([[0, 7]], np.int64)
    err = ctypes.create_string_buffer(256)
    out = np.empty((1, 3), np.float32)
    rc = lib.pkm_cpu_forward(ctypes.byref(bags_for(table, indices, None, "sum")), out.ctypes.data, 0, err, len(err))
    assert rc == -1 and b"indices[1] = 7" in err.value
    bags = bags_for(table, np.array([[0, 1]], np.int64), None, "sum")
    bags.combiner = 9
    rc = lib.pkm_cpu_forward(ctypes.byref(bags), out.ctypes.data, 0, err, len(err))
    assert rc == -1 and b"combiner" in err.value
    # ragged: row_splits[-1] must match the number of values
    splits = np.array([0, 1, 3], np.int64)
    rc = lib.pkm_cpu_forward(ctypes.byref(bags_for(table, np.array([0, 1], np.int64), None, "sum", splits)),
                             np.empty((2, 3), np.float32).ctypes.data, 0, err, len(err))
    assert rc == -1 and err.value, "mismatched row_splits accepted"


def test_null_output_and_gradient_buffers_are_errors(lib):
    # The CPU entry points dereferenced them (SIGSEGV); the CUDA ones already said so.
    table = np.ones((5, 4), np.float32)
    bags = bags_for(table, np.array([[1, 2], [3, 4]], np.int32), None, "sum")
    err = ctypes.create_string_buffer(256)
    d_table = np.zeros_like(table)
    for reference in (0, 1):
        assert lib.pkm_cpu_forward(ctypes.byref(bags), None, reference, err, len(err)) == -1
        assert err.value == b"forward: out is null"
        assert lib.pkm_cpu_backward(ctypes.byref(bags), None, d_table.ctypes.data, None, reference, err,
                                    len(err)) == -1
        assert err.value == b"backward: grad_out is null"
    opt = pkm_capi.PkmRowOptimizer(kind=0, learning_rate=0.1)
    assert lib.pkm_cpu_fused_update(ctypes.byref(bags), None, ctypes.byref(opt), None, 1, err, len(err)) == -1
    assert err.value == b"fused update: grad_out is null"
    alloc = pkm_capi.SPARSE_ALLOC_FN(lambda ctx, n, rows, grads: 0)
    assert lib.pkm_cpu_sparse_backward(ctypes.byref(bags), None, alloc, None, None, err, len(err)) == -1
    assert err.value == b"sparse backward: grad_out is null"


def test_null_buffers_of_no_elements_are_taken_and_ids_still_checked(lib):
    """An empty torch tensor's data_ptr is null: a [N, 0] table's [B, 0] output and gradient, or no
    bags' [0, D] ones, were refused as "out is null" (valid lookups too, and a bad id got that
    message instead of its own). Such buffers are now taken; ids and row_splits are still checked."""
    err = ctypes.create_string_buffer(256)
    for reference in (0, 1):
        zero_width = np.ones((5, 0), np.float32)
        d_table = np.ones((5, 0), np.float32)
        good_ids = np.array([[1, -1], [4, 0]], np.int64)
        good = bags_for(zero_width, good_ids, None, "sum")
        assert lib.pkm_cpu_forward(ctypes.byref(good), None, reference, err, len(err)) == 0, err.value
        assert lib.pkm_cpu_backward(ctypes.byref(good), None, d_table.ctypes.data, None, reference, err,
                                    len(err)) == 0, err.value
        bad_ids = np.array([[1, 7]], np.int64)
        bad = bags_for(zero_width, bad_ids, None, "sum")
        assert lib.pkm_cpu_forward(ctypes.byref(bad), None, reference, err, len(err)) == -1
        assert b"out of range" in err.value, err.value  # the reference words its errors its own way
        if not reference:
            assert err.value.startswith(b"indices[1] = 7 is out of range [0, 5)"), err.value
        table = np.ones((5, 3), np.float32)
        no_values, one_split = np.zeros([0], np.int64), np.array([0], np.int64)  # kept alive: bags point at them
        no_bags = bags_for(table, no_values, None, "sum", one_split)
        assert lib.pkm_cpu_forward(ctypes.byref(no_bags), None, reference, err, len(err)) == 0, err.value
        d_table = np.full_like(table, 7.0)
        assert lib.pkm_cpu_backward(ctypes.byref(no_bags), None, d_table.ctypes.data, None, reference, err,
                                    len(err)) == 0, err.value
        np.testing.assert_array_equal(d_table, 0)  # no bags: a zero gradient
        values = np.array([1, 2], np.int64)
        uncovered = bags_for(table, values, None, "sum", one_split)
        assert lib.pkm_cpu_forward(ctypes.byref(uncovered), None, reference, err, len(err)) == -1
        if not reference:
            assert b"row_splits[-1] = 0 must equal the number of values (2)" in err.value, err.value


def test_ctypes_mirror_matches_the_c_struct_layout(lib, monkeypatch):
    pkm_capi.check_layout(lib)  # PkmLib ran it too; explicit here
    size = ctypes.c_size_t()
    assert lib.pkm_bags_layout(ctypes.byref(size), None, 0) == len(pkm_capi.PkmBags._fields_)
    assert size.value == ctypes.sizeof(pkm_capi.PkmBags)

    # A mirror without the last field (the layout before index_policy) is caught.
    class OldPkmBags(ctypes.Structure):
        _fields_ = pkm_capi.PkmBags._fields_[:-1]

    monkeypatch.setattr(pkm_capi, "PkmBags", OldPkmBags)
    with pytest.raises(pkm_capi.PkmError, match="mirror differs"):
        pkm_capi.check_layout(lib)


@pytest.mark.parametrize("reference", [0, 1])
def test_index_policies_through_the_c_abi(lib, reference):
    rng = np.random.default_rng(7 + reference)
    table = rng.standard_normal((6, 5)).astype(np.float32)
    indices = np.array([[0, -1, 3], [5, 9, 2]], np.int64)  # -1 at [1], 9 (>= 6) at [4]
    weights = rng.uniform(0.5, 1.5, size=indices.shape).astype(np.float32)
    err = ctypes.create_string_buffer(256)
    out = np.full((2, 5), np.nan, np.float32)

    def forward(policy):
        bags = bags_for(table, indices, weights, "mean")
        bags.index_policy = policy
        return lib.pkm_cpu_forward(ctypes.byref(bags), out.ctypes.data, reference, err, len(err))

    policies = pkm_capi.INDEX_POLICIES
    assert forward(policies["negative_is_padding"]) == -1
    if not reference:
        assert err.value == b"indices[4] = 9 is out of range [0, 6) (negative indices are padding)"
    assert forward(policies["no_padding"]) == -1
    if not reference:
        assert err.value == b"indices[1] = -1 is out of range [0, 6) (stock GATHER allows no padding)"
    assert np.isnan(out).all(), "written on error"
    rc = forward(policies["out_of_range_is_padding"])
    if reference:
        # The device's rule, as the reference the GPU tests compare against.
        assert rc == 0, err.value
        padded = np.where((indices >= 0) & (indices < 6), indices, -1)
        np.testing.assert_allclose(out, embedding_bag(table, padded, weights, "mean"), rtol=1e-5, atol=1e-6)
    else:
        assert rc == -1 and b"GPU" in err.value
    assert forward(5) == -1 and b"index_policy must be" in err.value


def test_the_ctypes_wrapper_refuses_ids_and_grads_the_library_would_misread():
    # PkmLib read int16 ids as int32 bits and a [1, 1] or float16 grad past / as float32 bits.
    torch = pytest.importorskip("torch")
    path = next((p for p in (LIB_PATH, os.path.join(ROOT, "pkm_serve", "lib", "libpkm_cuda.so"))
                 if os.path.exists(p)), LIB_PATH)
    wrapper = pkm_capi.PkmLib(path)
    table = torch.ones((5, 4))
    with pytest.raises(pkm_capi.PkmError, match="indices must be int32 or int64, got torch.int16"):
        wrapper.cpu_forward(table, torch.tensor([[0, 2]], dtype=torch.int16))
    ids = torch.tensor([[0, 2], [1, 1]])
    for grad in (torch.ones(1, 1), torch.ones(2, 4, dtype=torch.float16)):
        with pytest.raises(pkm_capi.PkmError, match=r"grad must be a contiguous \[2, 4\] torch.float32"):
            wrapper.cpu_backward(table, ids, grad)
    d_table, _ = wrapper.cpu_backward(table, ids, torch.ones(2, 4))
    np.testing.assert_array_equal(d_table[:, 0].numpy(), [1, 2, 1, 0, 0])
