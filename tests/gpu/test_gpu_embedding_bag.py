"""CUDA EmbeddingBag kernels (kernels/cuda) against the core's CPU reference and PyTorch.

These tests need a CUDA GPU, PyTorch with CUDA, and `make gpu-standalone`
(pkm_serve/lib/libpkm_cuda.so). CI has no GPU, so there they skip with that
reason; that skip is legitimate, not a hidden failure. On a GPU machine run:

    make gpu-standalone && CUDA_VISIBLE_DEVICES=0 python -m pytest -q tests/gpu

(tests/conftest.py hides GPUs unless CUDA_VISIBLE_DEVICES is set.) They drive
the C launchers through ctypes on torch CUDA tensors, so TensorFlow is not
needed; a machine with CUDA but without the built library fails, not skips.
"""

import zlib

import numpy as np
import pytest

from gpu_common import CONFIG_IDS, CONFIGS, DEV, DTYPES, pkm_capi, torch  # noqa: F401  (skips without CUDA)

RTOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def assert_close(got, want, dtype, what, floor=0.0):
    got = got.detach().float().cpu().numpy()
    want = want.detach().float().cpu().numpy()
    assert got.shape == want.shape, what
    assert np.all(np.isfinite(got)), f"{what}: non-finite values"
    rtol = RTOL[dtype]
    # Elementwise, relative to the element and to the tensor's scale (sums in
    # another order differ by rounding relative to the terms, not the result).
    # `floor` is the size of the terms when the result may cancel to ~0.
    scale = max(float(np.abs(want).max()) if want.size else 0.0, floor, 1e-30)
    err = np.abs(got - want)
    bad = err > rtol * np.abs(want) + rtol * scale
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} of {bad.size} elements off; max abs err {err.max():.3g}, scale {scale:.3g}")


def random_case(rng, dtype, ragged, combiner, with_weights, idx_dtype, num_rows, dim, num_bags, max_bag,
                pad_frac=0.15):
    """Random bags with padding, empty bags (ragged) and all-padding bags."""
    table = torch.from_numpy(rng.standard_normal((num_rows, dim)).astype(np.float32)).to(dtype)
    if ragged:
        sizes = rng.integers(0, max_bag + 1, size=num_bags)
        sizes[rng.random(num_bags) < 0.1] = 0  # extra empty bags
        splits = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        nnz = int(splits[-1])
        idx = rng.integers(0, num_rows, size=nnz)
        shape = (nnz,)
    else:
        idx = rng.integers(0, num_rows, size=(num_bags, max_bag))
        shape = idx.shape
        splits = None
    idx = np.where(rng.random(shape) < pad_frac, -1 - rng.integers(0, 3, size=shape), idx)
    if not ragged and num_bags > 2 and max_bag > 0:
        idx[1, :] = -1  # one bag of padding only
    # mean over weights that could sum to ~0 is ill-conditioned: keep them positive there
    w = rng.uniform(0.25, 1.5, size=shape) if combiner == "mean" else rng.uniform(-1.5, 1.5, size=shape)
    weights = torch.from_numpy(w.astype(np.float32)).to(dtype) if with_weights else None
    indices = torch.from_numpy(idx.astype(np.int64)).to(idx_dtype)
    row_splits = torch.from_numpy(splits) if ragged else None
    return table, indices, weights, row_splits


def random_cases(rng, dtype, combiner, ragged, max_rows):
    """The grid the dense and sparse tests walk: dims of the scalar path (1: tiny, 37: odd), the
    vector path (256) and more than one 1024-column tile (1288), with and without weights; yields
    (what, with_weights, (table, indices, weights, splits))."""
    for dim in (1, 37, 256, 1288):
        for with_weights in (True, False):
            idx_dtype = torch.int32 if rng.random() < 0.5 else torch.int64
            num_rows = int(rng.integers(1, max_rows))
            case = random_case(rng, dtype, ragged, combiner, with_weights, idx_dtype, num_rows=num_rows, dim=dim,
                               num_bags=int(rng.integers(1, 70)), max_bag=int(rng.integers(0, 40)))
            yield f"dim={dim} weights={with_weights} idx={idx_dtype} rows={num_rows}", with_weights, case


def to_dev(*tensors):
    return [t.to(DEV) if t is not None else None for t in tensors]


@pytest.mark.parametrize("dtype,combiner,ragged", CONFIGS, ids=CONFIG_IDS)
def test_forward_and_backward_match_cpu_reference(lib, dtype, combiner, ragged):
    rng = np.random.default_rng(zlib.crc32(f"{dtype}-{combiner}-{ragged}".encode()))
    for what, with_weights, (table, indices, weights, splits) in random_cases(rng, dtype, combiner, ragged, 300):
        dim = table.shape[1]
        want = lib.cpu_forward(table, indices, weights, combiner, splits, reference=True)
        g_table, g_indices, g_weights, g_splits = to_dev(table, indices, weights, splits)
        got = lib.cuda_forward(g_table, g_indices, g_weights, combiner, g_splits)
        assert_close(got, want, dtype, "forward " + what)

        grad = torch.from_numpy(rng.standard_normal(tuple(want.shape)).astype(np.float32)).to(dtype)
        want_dt, want_dw = lib.cpu_backward(table, indices, grad, weights, combiner, splits, reference=True)
        got_dt, got_dw = lib.cuda_backward(g_table, g_indices, grad.to(DEV), g_weights, combiner, g_splits)
        assert_close(got_dt, want_dt, dtype, "d_table " + what)
        if with_weights:
            # d_weights are dot products of D standard-normal pairs: terms of
            # size ~sqrt(D) that mean/sqrtn corrections can cancel to ~0.
            assert_close(got_dw, want_dw, dtype, "d_weights " + what, floor=float(np.sqrt(dim)))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_hot_rows_split_into_pieces_match_reference_and_are_deterministic(lib, dtype):
    rng = np.random.default_rng(7)
    num_rows, dim, num_bags, bag = 50, 160, 300, 24
    idx = rng.integers(0, num_rows, size=(num_bags, bag))
    idx[rng.random(idx.shape) < 0.6] = 3  # row 3 holds ~60% of all entries
    idx[rng.random(idx.shape) < 0.05] = -1
    table = torch.from_numpy(rng.standard_normal((num_rows, dim)).astype(np.float32)).to(dtype)
    weights = torch.from_numpy(rng.uniform(-1, 1, size=idx.shape).astype(np.float32)).to(dtype)
    indices = torch.from_numpy(idx)
    grad = torch.from_numpy(rng.standard_normal((num_bags, dim)).astype(np.float32)).to(dtype)
    for combiner in ("sum", "sqrtn"):
        want_dt, want_dw = lib.cpu_backward(table, indices, grad, weights, combiner, reference=True)
        args = to_dev(table, indices, grad, weights)
        for long_segment in (7, 64, 0):  # 0 = default (at least 512 entries a piece)
            opts = {"long_segment_entries": long_segment}
            d_table, d_weights = lib.cuda_backward(args[0], args[1], args[2], args[3], combiner, options=opts)
            assert_close(d_table, want_dt, dtype, f"d_table {combiner} long_segment={long_segment}")
            assert_close(d_weights, want_dw, dtype, f"d_weights {combiner} long_segment={long_segment}",
                         floor=float(np.sqrt(dim)))
            again = lib.cuda_backward(args[0], args[1], args[2], args[3], combiner, options=opts)
            assert torch.equal(again[0], d_table) and torch.equal(again[1], d_weights), "not bitwise reproducible"


@pytest.mark.parametrize("vecs", [1, 2, 4])
def test_forward_tuning_variants_agree(lib, vecs):
    rng = np.random.default_rng(vecs)
    table, indices, weights, _ = random_case(rng, torch.float32, False, "sum", True, torch.int64, 500, 1024, 64, 50)
    want = lib.cpu_forward(table, indices, weights, "sum", reference=True)
    got = lib.cuda_forward(*to_dev(table, indices, weights), "sum", options={"forward_vecs_per_lane": vecs})
    assert_close(got, want, torch.float32, f"forward_vecs_per_lane={vecs}")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_misaligned_table_takes_scalar_path_and_matches(lib, dtype):
    """A table starting 1 element past a 16-byte boundary cannot use 16-byte loads."""
    rng = np.random.default_rng(17)
    table, indices, weights, _ = random_case(rng, dtype, False, "sqrtn", True, torch.int32, 90, 1032, 20, 9)
    flat = torch.empty(table.numel() + 1, dtype=dtype, device=DEV)
    g_table = flat[1:].view(table.shape)
    g_table.copy_(table.to(DEV))
    assert g_table.data_ptr() % 16 != 0
    g_indices, g_weights = to_dev(indices, weights)
    want = lib.cpu_forward(table, indices, weights, "sqrtn", reference=True)
    assert_close(lib.cuda_forward(g_table, g_indices, g_weights, "sqrtn"), want, dtype, "misaligned forward")
    grad = torch.randn(tuple(want.shape)).to(dtype)
    want_dt, want_dw = lib.cpu_backward(table, indices, grad, weights, "sqrtn", reference=True)
    got_dt, got_dw = lib.cuda_backward(g_table, g_indices, grad.to(DEV), g_weights, "sqrtn")
    assert_close(got_dt, want_dt, dtype, "misaligned d_table")
    assert_close(got_dw, want_dw, dtype, "misaligned d_weights", floor=float(np.sqrt(1032)))


def test_matches_torch_embedding_bag(lib):
    """Sum with per_sample_weights and mean without weights, forward and both gradients."""
    import torch.nn.functional as F

    rng = np.random.default_rng(11)
    num_rows, dim, num_bags, bag = 1000, 512, 256, 32
    table = torch.randn(num_rows, dim, device=DEV, requires_grad=True)
    indices = torch.from_numpy(rng.integers(0, num_rows, size=(num_bags, bag))).to(DEV)
    weights = torch.rand(num_bags, bag, device=DEV, requires_grad=True)
    grad = torch.randn(num_bags, dim, device=DEV)

    want = F.embedding_bag(indices, table, mode="sum", per_sample_weights=weights)
    want.backward(grad)
    got = lib.cuda_forward(table.detach(), indices, weights.detach(), "sum")
    d_table, d_weights = lib.cuda_backward(table.detach(), indices, grad, weights.detach(), "sum")
    assert_close(got, want, torch.float32, "forward vs torch")
    assert_close(d_table, table.grad, torch.float32, "d_table vs torch")
    assert_close(d_weights, weights.grad, torch.float32, "d_weights vs torch")

    table.grad = None
    want = F.embedding_bag(indices, table, mode="mean")
    want.backward(grad)
    assert_close(lib.cuda_forward(table.detach(), indices, None, "mean"), want, torch.float32, "mean vs torch")
    d_table, _ = lib.cuda_backward(table.detach(), indices, grad, None, "mean")
    assert_close(d_table, table.grad, torch.float32, "mean d_table vs torch")


def test_bf16_backward_with_weights_works_where_torch_raises(lib):
    rng = np.random.default_rng(5)
    table, indices, weights, _ = random_case(rng, torch.bfloat16, False, "sum", True, torch.int64, 400, 256, 32, 16, 0.0)
    grad = torch.randn(32, 256).to(torch.bfloat16)
    want_dt, want_dw = lib.cpu_backward(table, indices, grad, weights, "sum", reference=True)
    got_dt, got_dw = lib.cuda_backward(*to_dev(table, indices, grad, weights), "sum")
    assert_close(got_dt, want_dt, torch.bfloat16, "bf16 d_table")
    assert_close(got_dw, want_dw, torch.bfloat16, "bf16 d_weights")


def test_out_of_range_indices_are_padding_and_counted(lib):
    rng = np.random.default_rng(3)
    table, indices, weights, _ = random_case(rng, torch.float32, False, "mean", True, torch.int64, 100, 64, 40, 12)
    bad = torch.from_numpy(rng.random(indices.shape) < 0.1)
    indices_oob = torch.where(bad, torch.full_like(indices, 100) + indices.abs(), indices)  # >= num_rows
    as_padding = torch.where(bad, torch.full_like(indices, -1), indices)
    counter = torch.zeros(1, dtype=torch.int32, device=DEV)
    got = lib.cuda_forward(*to_dev(table, indices_oob, weights), "mean", invalid_counter=counter)
    want = lib.cpu_forward(table, as_padding, weights, "mean", reference=True)
    assert_close(got, want, torch.float32, "forward with out-of-range indices")
    assert int(counter.item()) == int(bad.sum()), "each out-of-range entry counted once"

    grad = torch.randn(40, 64)
    counter.zero_()
    got_dt, got_dw = lib.cuda_backward(*to_dev(table, indices_oob, grad, weights), "mean", invalid_counter=counter)
    want_dt, want_dw = lib.cpu_backward(table, as_padding, grad, weights, "mean", reference=True)
    assert_close(got_dt, want_dt, torch.float32, "d_table with out-of-range indices")
    assert_close(got_dw, want_dw, torch.float32, "d_weights with out-of-range indices", floor=8.0)
    assert int(counter.item()) == int(bad.sum())
    # the CPU path rejects them, naming position and value
    with pytest.raises(pkm_capi.PkmError, match="out of range"):
        lib.cpu_forward(table, indices_oob, weights, "mean", reference=True)


def test_index_policy_out_of_range_is_padding_is_the_devices_rule(lib):
    """Policy 2 gives the device's default result; the CPU reference under
    policy 2 agrees; PKM_NO_PADDING is refused (the device cannot raise it)."""
    rng = np.random.default_rng(4)
    table, indices, weights, _ = random_case(rng, torch.float32, False, "sqrtn", True, torch.int64, 80, 32, 24, 8)
    bad = torch.from_numpy(rng.random(indices.shape) < 0.15)
    indices = torch.where(bad, torch.full_like(indices, 80) + indices.abs(), indices)
    stream = torch.cuda.current_stream().cuda_stream
    d_table, d_indices, d_weights = to_dev(table, indices, weights)
    default = lib.cuda_forward(d_table, d_indices, d_weights, "sqrtn")
    out = torch.full_like(default, float("nan"))
    bags = pkm_capi.make_bags(d_table, d_indices, d_weights, "sqrtn", index_policy="out_of_range_is_padding")
    lib._check_cuda(lib.lib.pkm_cuda_forward(pkm_capi.ctypes.byref(bags), out.data_ptr(), None, stream), "forward")
    assert torch.equal(out, default)
    want = torch.full((24, 32), float("nan"))
    host = pkm_capi.make_bags(table, indices, weights, "sqrtn", index_policy="out_of_range_is_padding")
    err = pkm_capi.ctypes.create_string_buffer(256)
    assert lib.lib.pkm_cpu_forward(pkm_capi.ctypes.byref(host), want.data_ptr(), 1, err, len(err)) == 0, err.value
    assert_close(out, want, torch.float32, "forward under out-of-range-is-padding")
    bags.index_policy = pkm_capi.INDEX_POLICIES["no_padding"]
    with pytest.raises(pkm_capi.PkmError, match="index_policy must be"):
        lib._check_cuda(lib.lib.pkm_cuda_forward(pkm_capi.ctypes.byref(bags), out.data_ptr(), None, stream),
                        "forward")


def test_poisoned_outputs_are_fully_overwritten(lib):
    """Rows nobody references get zeros in d_table; empty bags give zeros."""
    table = torch.randn(64, 128, device=DEV)
    indices = torch.tensor([[5, 5, -1], [-1, -1, -1], [7, 9, 5]], device=DEV)
    weights = torch.rand(3, 3, device=DEV)
    out = torch.full((3, 128), float("nan"), device=DEV)
    lib.cuda_forward(table, indices, weights, "sqrtn", out=out)
    assert torch.all(out[1] == 0) and torch.isfinite(out).all()
    d_table, d_weights = lib.cuda_backward(table, indices, torch.randn(3, 128, device=DEV), weights, "sum")
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[[5, 7, 9]] = False
    assert torch.all(d_table[untouched.to(DEV)] == 0) and torch.isfinite(d_table).all()
    assert torch.all(d_weights[indices < 0] == 0)


def test_bad_arguments_give_clear_errors(lib):
    table = torch.randn(10, 8, device=DEV)
    indices = torch.zeros(2, 3, dtype=torch.int64, device=DEV)
    with pytest.raises(pkm_capi.PkmError, match="combiner"):
        bags = pkm_capi.make_bags(table, indices)
        bags.combiner = 7
        rc = lib.lib.pkm_cuda_forward(pkm_capi.ctypes.byref(bags), table.data_ptr(), None,
                                      torch.cuda.current_stream().cuda_stream)
        lib._check_cuda(rc, "forward")
    with pytest.raises(pkm_capi.PkmError, match="workspace .* too small"):
        lib.cuda_backward(table, indices, torch.randn(2, 8, device=DEV), torch.ones(2, 3, device=DEV),
                          workspace=torch.empty(16, dtype=torch.uint8, device=DEV))
    with pytest.raises(pkm_capi.PkmError, match="no weights"):
        bags = pkm_capi.make_bags(table, indices)
        rc = lib.lib.pkm_cuda_backward(pkm_capi.ctypes.byref(bags), table.data_ptr(), None, table.data_ptr(),
                                       None, 0, None, torch.cuda.current_stream().cuda_stream)
        lib._check_cuda(rc, "backward")


@pytest.mark.large
def test_table_over_2_31_elements(lib):
    """64-bit offsets: rows past element 2^31 of a 600000 x 4096 bf16 table (4.9 GB)."""
    num_rows, dim = 600_000, 4096
    table = torch.empty(num_rows, dim, dtype=torch.bfloat16, device=DEV)
    table.normal_()
    rows = torch.tensor([[num_rows - 1, 524_289, 3], [599_000, -1, 550_000]], device=DEV)
    weights = torch.tensor([[0.5, -1.0, 2.0], [1.0, 3.0, 0.25]], device=DEV, dtype=torch.bfloat16)
    got = lib.cuda_forward(table, rows, weights, "sum")
    safe = rows.clamp(min=0)
    want = (table[safe].float() * (weights.float() * (rows >= 0)).unsqueeze(-1)).sum(1)
    assert_close(got, want, torch.bfloat16, "forward past 2^31 elements")
    grad = torch.randn(2, dim, device=DEV).to(torch.bfloat16)
    d_table, d_weights = lib.cuda_backward(table, rows, grad, weights, "sum")
    for b in range(2):
        for k in range(3):
            r = int(rows[b, k])
            if r < 0:
                continue
            want_row = grad[b].float() * float(weights[b, k])
            assert_close(d_table[r], want_row, torch.bfloat16, f"d_table row {r}")
            want_dw = (grad[b].float() * table[r].float()).sum()
            assert_close(d_weights[b, k].reshape(1), want_dw.reshape(1), torch.bfloat16, f"d_weight {b},{k}")
    del table, d_table


def test_empty_bags_and_no_bags(lib):
    """K = 0 (every bag empty), ragged bags all empty, and no bags at all."""
    table = torch.randn(20, 16, device=DEV)
    grad = torch.randn(5, 16, device=DEV)
    for combiner in ("sum", "mean", "sqrtn"):
        indices = torch.empty(5, 0, dtype=torch.int64, device=DEV)
        weights = torch.empty(5, 0, device=DEV)
        out = lib.cuda_forward(table, indices, weights, combiner, out=torch.full((5, 16), float("nan"), device=DEV))
        assert torch.all(out == 0)
        d_table, _ = lib.cuda_backward(table, indices, grad, weights, combiner)
        assert torch.all(d_table == 0)
        splits = torch.zeros(6, dtype=torch.int64, device=DEV)
        values = torch.empty(0, dtype=torch.int32, device=DEV)
        out = lib.cuda_forward(table, values, None, combiner, row_splits=splits)
        assert out.shape == (5, 16) and torch.all(out == 0)
    no_bags = torch.empty(0, 3, dtype=torch.int64, device=DEV)
    assert lib.cuda_forward(table, no_bags, None, "sum").shape == (0, 16)
    d_table, _ = lib.cuda_backward(table, no_bags, torch.empty(0, 16, device=DEV), None, "sum")
    assert torch.all(d_table == 0)


SMALL_BATCH = [(dtype, combiner, ragged) for dtype in DTYPES for combiner in ("sum", "mean", "sqrtn")
               for ragged in (False, True)]


@pytest.mark.parametrize("dtype,combiner,ragged", SMALL_BATCH, ids=CONFIG_IDS)
def test_small_batch_long_bags_and_narrow_rows(lib, dtype, combiner, ragged):
    """Few bags of many entries (the forward splits each bag over 2-4 warps and adds the
    warps' sums in a fixed order) and narrow rows over a table most of whose rows are
    untouched (the backward's 1- and 2-vector row kernels, which skip untouched rows'
    table loads): against the float64 reference, and bitwise equal run to run."""
    rng = np.random.default_rng(zlib.crc32(f"small-{dtype}-{combiner}-{ragged}".encode()))
    for dim in (64, 128, 256, 512, 1024):
        for num_bags, max_bag, num_rows in ((3, 300, 5000), (8, 70, 5000), (40, 140, 20000)):
            with_weights = bool(rng.random() < 0.7)
            table, indices, weights, splits = random_case(
                rng, dtype, ragged, combiner, with_weights, torch.int64, num_rows=num_rows, dim=dim,
                num_bags=num_bags, max_bag=max_bag)
            what = f"dim={dim} bags={num_bags}x{max_bag} rows={num_rows} weights={with_weights}"
            want = lib.cpu_forward(table, indices, weights, combiner, splits, reference=True)
            g = to_dev(table, indices, weights, splits)
            got = lib.cuda_forward(g[0], g[1], g[2], combiner, g[3])
            assert_close(got, want, dtype, "forward " + what)
            assert torch.equal(got, lib.cuda_forward(g[0], g[1], g[2], combiner, g[3])), "forward not bitwise " + what
            grad = torch.from_numpy(rng.standard_normal(tuple(want.shape)).astype(np.float32)).to(dtype)
            want_dt, want_dw = lib.cpu_backward(table, indices, grad, weights, combiner, splits, reference=True)
            got_dt, got_dw = lib.cuda_backward(g[0], g[1], grad.to(DEV), g[2], combiner, g[3])
            assert_close(got_dt, want_dt, dtype, "d_table " + what)
            if with_weights:
                assert_close(got_dw, want_dw, dtype, "d_weights " + what, floor=float(np.sqrt(dim)))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_small_batch_max_and_invalid_counter(lib, dtype):
    """The split forward with the max combiner (partial maxima combined across warps) and
    the invalid-index counter (each entry counted once across the split warps)."""
    rng = np.random.default_rng(zlib.crc32(f"small-max-{dtype}".encode()))
    num_rows, dim = 3000, 256
    table = torch.from_numpy(rng.standard_normal((num_rows, dim)).astype(np.float32)).to(dtype)
    idx = rng.integers(0, num_rows, size=(4, 200))
    idx[rng.random(idx.shape) < 0.1] = -1
    idx[2, 50:] = -1  # a bag whose valid rows all sit in the first chunks
    bad = rng.random(idx.shape) < 0.05
    idx[bad] = num_rows + 7
    t, i = table.to(DEV), torch.from_numpy(idx).to(DEV)
    counter = torch.zeros(1, dtype=torch.int32, device=DEV)
    out = lib.cuda_forward(t, i, None, "max", invalid_counter=counter).float().cpu().numpy()
    assert int(counter.item()) == int(bad.sum())
    for b in range(idx.shape[0]):
        valid = [r for r in idx[b] if 0 <= r < num_rows]
        np.testing.assert_array_equal(out[b], table.float().numpy()[valid].max(axis=0), err_msg=f"bag {b}")
