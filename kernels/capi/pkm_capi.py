"""ctypes binding of the standalone C ABI (libpkm_cuda.so / libpkm_capi_cpu.so).

For GPU tests and benchmarks on machines without TensorFlow: the CUDA
launchers run on torch CUDA tensors (raw device pointers + torch's current
stream), the core's CPU forward/backward (fast or reference) on torch CPU
tensors. Build the library with `make gpu-standalone` (or `make capi-cpu`).
"""

import ctypes
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
# The one PkmBags mirror (torch- and TF-free), shared with the PyTorch backend.
from pkm_serve.backends._bag_problem import PkmBags, layout_mismatch  # noqa: E402
# PKM_CUDA_LIB selects another build (e.g. a tuning variant) for tests and benchmarks.
DEFAULT_CUDA_LIB = os.environ.get("PKM_CUDA_LIB") or os.path.join(ROOT, "pkm_serve", "lib", "libpkm_cuda.so")

COMBINERS = {"sum": 0, "mean": 1, "sqrtn": 2, "max": 3}
# PKM_NEGATIVE_IS_PADDING / PKM_NO_PADDING / PKM_OUT_OF_RANGE_IS_PADDING.
INDEX_POLICIES = {"negative_is_padding": 0, "no_padding": 1, "out_of_range_is_padding": 2}
INVALID_ARGUMENT = -1


OPTIMIZERS = {"sgd": 0, "rowwise_adagrad": 1, "adam": 2}


class PkmRowOptimizer(ctypes.Structure):
    """Mirror of PkmRowOptimizer in kernels/core/row_optimizer.h."""

    _fields_ = [
        ("kind", ctypes.c_int32),
        ("learning_rate", ctypes.c_float),
        ("epsilon", ctypes.c_float),
        ("beta_1", ctypes.c_float),
        ("beta_2", ctypes.c_float),
        ("step", ctypes.c_int64),
        ("state0", ctypes.c_void_p),
        ("state1", ctypes.c_void_p),
    ]


def make_row_optimizer(kind, learning_rate, state=(), epsilon=1e-7, beta_1=0.9, beta_2=0.999, step=1):
    """PkmRowOptimizer over float32 torch tensors `state`: () for sgd,
    (accumulator [N],) for rowwise_adagrad, (m [N, D], v [N, D]) for adam."""
    import torch

    if kind not in OPTIMIZERS:
        raise PkmError(f"optimizer must be one of {sorted(OPTIMIZERS)}, got {kind!r}")
    for t in state:
        if t.dtype != torch.float32 or not t.is_contiguous():
            raise PkmError("optimizer state must be contiguous float32 tensors")
    opt = PkmRowOptimizer()
    opt.kind = OPTIMIZERS[kind]
    opt.learning_rate, opt.epsilon, opt.beta_1, opt.beta_2, opt.step = learning_rate, epsilon, beta_1, beta_2, step
    opt.state0 = _ptr(state[0]) if len(state) > 0 else None
    opt.state1 = _ptr(state[1]) if len(state) > 1 else None
    return opt


class PkmCudaOptions(ctypes.Structure):
    _fields_ = [("forward_vecs_per_lane", ctypes.c_int32), ("long_segment_entries", ctypes.c_int64)]


class PkmError(RuntimeError):
    pass


def _elem_type(dtype, allow_int8=False):
    import torch

    types = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
    if allow_int8:
        types[torch.int8] = 3
    if dtype not in types:
        kinds = "float32, float16, bfloat16" + (" or int8 (with row_scales)" if allow_int8 else "")
        raise PkmError(f"element type must be {kinds}, got {dtype}")
    return types[dtype]


def _set_int8_rows(bags, table, row_scales, row_biases):
    """The int8-row fields of PkmBags: row r of an int8 table is
    row_scales[r] * q + row_biases[r] (both [N], float32 or float16)."""
    import torch

    if (table.dtype == torch.int8) != (row_scales is not None):
        raise PkmError("row_scales are needed for an int8 table, and only for one")
    if row_scales is None:
        return
    for name, t in (("row_scales", row_scales), ("row_biases", row_biases)):
        if t is None:
            continue
        if t.shape != (table.shape[0],) or t.dtype != row_scales.dtype or not t.is_contiguous():
            raise PkmError(f"{name} must be a contiguous [{table.shape[0]}] vector of row_scales' dtype, "
                           f"got {tuple(t.shape)} {t.dtype}")
    if row_scales.dtype not in (torch.float32, torch.float16):
        raise PkmError(f"row_scales must be float32 or float16, got {row_scales.dtype}")
    bags.row_scales = _ptr(row_scales)
    bags.row_biases = _ptr(row_biases)
    bags.row_params_type = _elem_type(row_scales.dtype)


def _current_stream(device):
    """torch's current cudaStream_t on `device`, without building a torch.cuda.Stream (host time on the
    backward's path: the call is event-timed against writing d_table once)."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None and device.index is not None:
        return raw(device.index)
    return torch.cuda.current_stream(device).cuda_stream


def _ptr(tensor):
    return ctypes.c_void_p(tensor.data_ptr()) if tensor is not None and tensor.numel() > 0 else None


def check_layout(lib):
    """Raises PkmError unless PkmBags has the library's size and offsets."""
    mismatch = layout_mismatch(lib, PkmBags)  # this module's name: a test swaps it
    if mismatch:
        raise PkmError(f"PkmBags mirror differs from the library: {mismatch}")


def make_bags(table, indices, weights=None, combiner="sum", row_splits=None, invalid_counter=None,
              index_policy="negative_is_padding", row_scales=None, row_biases=None):
    """PkmBags over torch tensors (all on one device, contiguous).

    Dense: indices [B, K]. Ragged: indices [nnz] values and row_splits [B + 1].
    An int8 table needs row_scales (and optionally row_biases), [N] each.
    The tensors must outlive every call that uses the returned struct.
    """
    import torch

    for name, t in (("table", table), ("indices", indices), ("weights", weights), ("row_splits", row_splits)):
        if t is not None and not t.is_contiguous():
            raise PkmError(f"{name} must be contiguous")
    if table.dim() != 2:
        raise PkmError(f"table must be [N, D], got shape {tuple(table.shape)}")
    if weights is not None and weights.shape != indices.shape:
        raise PkmError(f"weights must have the shape of indices {tuple(indices.shape)}, got {tuple(weights.shape)}")
    bags = PkmBags()
    bags.table = _ptr(table)
    bags.elem_type = _elem_type(table.dtype, allow_int8=True)
    bags.num_rows, bags.dim = table.shape
    _set_int8_rows(bags, table, row_scales, row_biases)
    for name, t in (("indices", indices), ("row_splits", row_splits)):
        if t is not None and t.dtype not in (torch.int32, torch.int64):
            raise PkmError(f"{name} must be int32 or int64, got {t.dtype}")
    bags.indices = _ptr(indices)
    bags.indices_int64 = int(indices.dtype == torch.int64)
    if row_splits is None:
        if indices.dim() != 2:
            raise PkmError(f"dense indices must be [B, K], got shape {tuple(indices.shape)}")
        bags.num_bags, bags.bag_size = indices.shape
        bags.num_indices = indices.numel()
    else:
        bags.row_splits = _ptr(row_splits)
        bags.row_splits_int64 = int(row_splits.dtype == torch.int64)
        bags.num_bags = row_splits.numel() - 1
        bags.num_indices = indices.numel()
    bags.weights = _ptr(weights)
    bags.weights_type = _elem_type(weights.dtype) if weights is not None else 0
    if combiner not in COMBINERS:
        raise PkmError(f"combiner must be one of {sorted(COMBINERS)}, got {combiner!r}")
    bags.combiner = COMBINERS[combiner]
    bags.invalid_index_count = _ptr(invalid_counter)
    if index_policy not in INDEX_POLICIES:
        raise PkmError(f"index_policy must be one of {sorted(INDEX_POLICIES)}, got {index_policy!r}")
    bags.index_policy = INDEX_POLICIES[index_policy]
    return bags


# int alloc(void* ctx, int64_t num_rows_touched, int64_t** rows, void** row_grads)
SPARSE_ALLOC_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int64,
                                   ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p))


def _check_grad(grad, bags, table):
    """The upstream gradient the C functions read: [bags, D] contiguous, of the outputs' dtype."""
    import torch

    want = torch.float32 if table.dtype == torch.int8 else table.dtype
    if tuple(grad.shape) != (bags.num_bags, bags.dim) or grad.dtype != want or not grad.is_contiguous():
        raise PkmError(f"grad must be a contiguous [{bags.num_bags}, {bags.dim}] {want} tensor, got "
                       f"{tuple(grad.shape)} {grad.dtype}{'' if grad.is_contiguous() else ' (not contiguous)'}")


def _sparse_alloc(table, keep):
    """A callback that allocates rows [U] int64 and row_grads [U, D] like
    `table` (same device and dtype) and keeps them in keep["rows"/"row_grads"]."""
    import torch

    def alloc(_ctx, num_rows, rows_p, grads_p):
        try:
            keep["rows"] = torch.empty(num_rows, dtype=torch.int64, device=table.device)
            keep["row_grads"] = torch.empty((num_rows, table.shape[1]), dtype=table.dtype, device=table.device)
            rows_p[0] = keep["rows"].data_ptr() if num_rows else None
            grads_p[0] = keep["row_grads"].data_ptr() if num_rows and table.shape[1] else None
            return 0
        except Exception as e:  # an exception must not unwind through C
            keep["error"] = e
            return 1

    return SPARSE_ALLOC_FN(alloc)


class PkmLib:
    """The loaded library, with torch-tensor wrappers around its C functions."""

    def __init__(self, path=None):
        path = path or DEFAULT_CUDA_LIB
        if not os.path.exists(path):
            raise PkmError(f"{path} not found: build it with `make gpu-standalone` (or `make capi-cpu`)")
        lib = ctypes.CDLL(path)
        self.lib = lib
        self.has_cuda = bool(lib.pkm_capi_has_cuda())
        bags_p, opts_p = ctypes.POINTER(PkmBags), ctypes.POINTER(PkmCudaOptions)
        vp, err_args = ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_size_t]
        check_layout(lib)
        i64_p = ctypes.POINTER(ctypes.c_int64)
        lib.pkm_check_shapes.argtypes = [i64_p, ctypes.c_int] * 4 + [ctypes.c_int32, i64_p,
                                                                       ctypes.POINTER(ctypes.c_int)] + err_args
        lib.pkm_cpu_forward.argtypes = [bags_p, vp, ctypes.c_int] + err_args
        lib.pkm_cpu_backward.argtypes = [bags_p, vp, vp, vp, ctypes.c_int] + err_args
        lib.pkm_cpu_sparse_backward.argtypes = [bags_p, vp, SPARSE_ALLOC_FN, vp, vp] + err_args
        opt_p = ctypes.POINTER(PkmRowOptimizer)
        lib.pkm_cpu_fused_update.argtypes = [bags_p, vp, opt_p, vp, ctypes.c_int] + err_args
        if self.has_cuda:
            lib.pkm_cuda_forward.argtypes = [bags_p, vp, opts_p, vp]
            lib.pkm_cuda_backward_workspace_bytes.argtypes = [bags_p, opts_p]
            lib.pkm_cuda_backward_workspace_bytes.restype = ctypes.c_size_t
            lib.pkm_cuda_backward.argtypes = [bags_p, vp, vp, vp, vp, ctypes.c_size_t, opts_p, vp]
            lib.pkm_cuda_last_error.restype = ctypes.c_char_p
            lib.pkm_cuda_forward_int8.argtypes = [bags_p, vp, vp]
            lib.pkm_cuda_sparse_backward_workspace_bytes.argtypes = [bags_p, opts_p]
            lib.pkm_cuda_sparse_backward_workspace_bytes.restype = ctypes.c_size_t
            lib.pkm_cuda_sparse_backward.argtypes = [bags_p, vp, SPARSE_ALLOC_FN, vp, vp, vp, ctypes.c_size_t,
                                                     opts_p, vp]
            lib.pkm_cuda_fused_update_workspace_bytes.argtypes = [bags_p, opts_p]
            lib.pkm_cuda_fused_update_workspace_bytes.restype = ctypes.c_size_t
            lib.pkm_cuda_fused_update.argtypes = [bags_p, vp, opt_p, vp, vp, ctypes.c_size_t, opts_p, vp]
            if hasattr(lib, "pkm_cuda_product_topk"):  # builds before it (A/B benches) lack it
                i64, i32 = ctypes.c_int64, ctypes.c_int
                lib.pkm_cuda_product_topk.argtypes = [vp, i64, i64, i32, vp, vp, vp, vp]
                lib.pkm_cuda_product_topk_backward.argtypes = [vp, vp, i64, i64, i32, vp, vp]

    # ---- CUDA (torch CUDA tensors) -------------------------------------------
    def _check_cuda(self, rc, what):
        if rc != 0:
            kind = "invalid argument" if rc == INVALID_ARGUMENT else f"CUDA error {rc}"
            raise PkmError(f"{what}: {kind}: {self.lib.pkm_cuda_last_error().decode()}")

    @staticmethod
    def _options(options):
        if options is None:
            return None
        opts = PkmCudaOptions()
        opts.forward_vecs_per_lane = options.get("forward_vecs_per_lane", 0)
        opts.long_segment_entries = options.get("long_segment_entries", 0)
        return ctypes.byref(opts)

    def cuda_forward(self, table, indices, weights=None, combiner="sum", row_splits=None,
                     invalid_counter=None, options=None, out=None):
        import torch

        bags = make_bags(table, indices, weights, combiner, row_splits, invalid_counter)
        if out is None:
            out = torch.empty((bags.num_bags, bags.dim), dtype=table.dtype, device=table.device)
        stream = _current_stream(table.device)
        rc = self.lib.pkm_cuda_forward(ctypes.byref(bags), _ptr(out), self._options(options), stream)
        self._check_cuda(rc, "pkm_cuda_forward")
        return out

    def cuda_forward_int8(self, table, row_scales, indices, weights=None, combiner="sum", row_splits=None,
                          row_biases=None, invalid_counter=None, out=None):
        """Forward over a row-wise int8 table (int8 [N, D], row_scales/row_biases [N]): float32 out."""
        import torch

        bags = make_bags(table, indices, weights, combiner, row_splits, invalid_counter,
                         row_scales=row_scales, row_biases=row_biases)
        if out is None:
            out = torch.empty((bags.num_bags, bags.dim), dtype=torch.float32, device=table.device)
        stream = _current_stream(table.device)
        rc = self.lib.pkm_cuda_forward_int8(ctypes.byref(bags), _ptr(out), stream)
        self._check_cuda(rc, "pkm_cuda_forward_int8")
        return out

    def cuda_backward_workspace_bytes(self, table, indices, weights=None, combiner="sum", row_splits=None,
                                      options=None):
        bags = make_bags(table, indices, weights, combiner, row_splits)
        return self.lib.pkm_cuda_backward_workspace_bytes(ctypes.byref(bags), self._options(options))

    def cuda_backward(self, table, indices, grad, weights=None, combiner="sum", row_splits=None,
                      want_d_table=True, want_d_weights=True, invalid_counter=None, options=None,
                      workspace=None, out=None):
        """Returns (d_table or None, d_weights or None); `out`: (d_table, d_weights) tensors to write
        into instead (either may be None to skip it)."""
        import torch

        bags = make_bags(table, indices, weights, combiner, row_splits, invalid_counter)
        _check_grad(grad, bags, table)
        opts = self._options(options)
        if out is not None:
            d_table, d_weights = out
        else:
            d_table = torch.empty_like(table) if want_d_table else None
            d_weights = torch.empty_like(weights) if (want_d_weights and weights is not None) else None
        if workspace is None:  # (a caller's workspace skips the size query: host time before any launch)
            ws_bytes = self.lib.pkm_cuda_backward_workspace_bytes(ctypes.byref(bags), opts)
            workspace = torch.empty(max(ws_bytes, 1), dtype=torch.uint8, device=table.device)
        stream = _current_stream(table.device)
        rc = self.lib.pkm_cuda_backward(ctypes.byref(bags), _ptr(grad), _ptr(d_table), _ptr(d_weights),
                                        _ptr(workspace), workspace.numel(), opts, stream)
        self._check_cuda(rc, "pkm_cuda_backward")
        return d_table, d_weights

    def cuda_sparse_backward(self, table, indices, grad, weights=None, combiner="sum", row_splits=None,
                             want_d_weights=True, options=None):
        """Returns (rows [U] int64, row_grads [U, D], d_weights or None)."""
        import torch

        bags = make_bags(table, indices, weights, combiner, row_splits)
        _check_grad(grad, bags, table)
        opts = self._options(options)
        d_weights = torch.empty_like(weights) if (want_d_weights and weights is not None) else None
        ws_bytes = self.lib.pkm_cuda_sparse_backward_workspace_bytes(ctypes.byref(bags), opts)
        workspace = torch.empty(max(ws_bytes, 1), dtype=torch.uint8, device=table.device)
        keep = {}
        callback = _sparse_alloc(table, keep)
        stream = _current_stream(table.device)
        rc = self.lib.pkm_cuda_sparse_backward(ctypes.byref(bags), _ptr(grad), callback, None, _ptr(d_weights),
                                               _ptr(workspace), workspace.numel(), opts, stream)
        self._check_cuda(rc, "pkm_cuda_sparse_backward")
        return keep["rows"], keep["row_grads"], d_weights

    def cuda_fused_update(self, table, indices, grad, optimizer, state=(), weights=None, combiner="sum",
                          row_splits=None, want_d_weights=True, options=None, workspace=None, **hyper):
        """Updates `table` (and `state`) in place; returns d_weights or None.
        `hyper`: learning_rate, epsilon, beta_1, beta_2, step (make_row_optimizer)."""
        import torch

        bags = make_bags(table, indices, weights, combiner, row_splits)
        _check_grad(grad, bags, table)
        opt = make_row_optimizer(optimizer, state=state, **hyper)
        opts = self._options(options)
        d_weights = torch.empty_like(weights) if (want_d_weights and weights is not None) else None
        if workspace is None:
            ws_bytes = self.lib.pkm_cuda_fused_update_workspace_bytes(ctypes.byref(bags), opts)
            workspace = torch.empty(max(ws_bytes, 1), dtype=torch.uint8, device=table.device)
        stream = _current_stream(table.device)
        rc = self.lib.pkm_cuda_fused_update(ctypes.byref(bags), _ptr(grad), ctypes.byref(opt), _ptr(d_weights),
                                            _ptr(workspace), workspace.numel(), opts, stream)
        self._check_cuda(rc, "pkm_cuda_fused_update")
        return d_weights

    def cuda_product_topk(self, scores, knn):
        """scores: float32 CUDA [rows, 2, n_keys] -> (best [rows, knn] float32, index [rows, knn] int64,
        pos [rows, knn, 2] int32): the product-key top-k (pkm_cuda_product_topk)."""
        import torch

        if scores.dtype != torch.float32 or scores.dim() != 3 or scores.shape[1] != 2:
            raise PkmError(f"product top-k: scores must be float32 [rows, 2, n_keys], got {scores.dtype} "
                           f"{list(scores.shape)}")
        scores = scores.contiguous()
        rows, _, n_keys = scores.shape
        best = torch.empty((rows, knn), dtype=torch.float32, device=scores.device)
        index = torch.empty((rows, knn), dtype=torch.int64, device=scores.device)
        pos = torch.empty((rows, knn, 2), dtype=torch.int32, device=scores.device)
        stream = _current_stream(scores.device)
        rc = self.lib.pkm_cuda_product_topk(_ptr(scores), rows, n_keys, knn, _ptr(best), _ptr(index), _ptr(pos),
                                            stream)
        self._check_cuda(rc, "pkm_cuda_product_topk")
        return best, index, pos

    def cuda_product_topk_backward(self, d_best, pos, n_keys):
        """d_best [rows, knn] float32, pos from cuda_product_topk -> d_scores [rows, 2, n_keys]."""
        import torch

        d_best = d_best.contiguous().float()
        rows, knn = d_best.shape
        d_scores = torch.empty((rows, 2, n_keys), dtype=torch.float32, device=d_best.device)
        stream = _current_stream(d_best.device)
        rc = self.lib.pkm_cuda_product_topk_backward(_ptr(d_best), _ptr(pos.contiguous()), rows, n_keys, knn,
                                                     _ptr(d_scores), stream)
        self._check_cuda(rc, "pkm_cuda_product_topk_backward")
        return d_scores

    # ---- core CPU (torch CPU tensors) -----------------------------------------
    def _check_cpu(self, rc, err, what):
        if rc != 0:
            raise PkmError(f"{what}: {err.value.decode()}")

    def check_shapes(self, params, indices, weights=None, combiner="sum", row_splits=None):
        """The core's shape rules on shapes (tuples of ints): the forward output's shape, or PkmError."""
        def arr(shape):
            return (None, 0) if shape is None else ((ctypes.c_int64 * max(len(shape), 1))(*shape), len(shape))

        args = [x for shape in (params, indices, row_splits, weights) for x in arr(shape)]
        out = (ctypes.c_int64 * (len(indices) + 1))()
        rank, err = ctypes.c_int(), ctypes.create_string_buffer(512)
        rc = self.lib.pkm_check_shapes(*args, COMBINERS[combiner], out, ctypes.byref(rank), err, len(err))
        self._check_cpu(rc, err, "pkm_check_shapes")
        return tuple(out[:rank.value])

    def cpu_forward(self, table, indices, weights=None, combiner="sum", row_splits=None, reference=True,
                    row_scales=None, row_biases=None):
        import torch

        bags = make_bags(table, indices, weights, combiner, row_splits, row_scales=row_scales,
                         row_biases=row_biases)
        out_dtype = torch.float32 if table.dtype == torch.int8 else table.dtype
        out = torch.empty((bags.num_bags, bags.dim), dtype=out_dtype)
        err = ctypes.create_string_buffer(512)
        rc = self.lib.pkm_cpu_forward(ctypes.byref(bags), _ptr(out), int(reference), err, len(err))
        self._check_cpu(rc, err, "pkm_cpu_forward")
        return out

    def cpu_backward(self, table, indices, grad, weights=None, combiner="sum", row_splits=None, reference=True):
        import torch

        bags = make_bags(table, indices, weights, combiner, row_splits)
        _check_grad(grad, bags, table)
        d_table = torch.empty_like(table)
        d_weights = torch.empty_like(weights) if weights is not None else None
        err = ctypes.create_string_buffer(512)
        rc = self.lib.pkm_cpu_backward(ctypes.byref(bags), _ptr(grad), _ptr(d_table), _ptr(d_weights),
                                       int(reference), err, len(err))
        self._check_cpu(rc, err, "pkm_cpu_backward")
        return d_table, d_weights

    def cpu_sparse_backward(self, table, indices, grad, weights=None, combiner="sum", row_splits=None):
        """Returns (rows [U] int64, row_grads [U, D], d_weights or None)."""
        import torch

        bags = make_bags(table, indices, weights, combiner, row_splits)
        _check_grad(grad, bags, table)
        d_weights = torch.empty_like(weights) if weights is not None else None
        keep = {}
        callback = _sparse_alloc(table, keep)
        err = ctypes.create_string_buffer(512)
        rc = self.lib.pkm_cpu_sparse_backward(ctypes.byref(bags), _ptr(grad), callback, None, _ptr(d_weights),
                                              err, len(err))
        self._check_cpu(rc, err, "pkm_cpu_sparse_backward")
        return keep["rows"], keep["row_grads"], d_weights

    def cpu_fused_update(self, table, indices, grad, optimizer, state=(), weights=None, combiner="sum",
                         row_splits=None, num_threads=1, **hyper):
        """The core's fused backward + optimizer: updates `table` and `state`
        in place; returns d_weights or None."""
        import torch

        bags = make_bags(table, indices, weights, combiner, row_splits)
        _check_grad(grad, bags, table)
        opt = make_row_optimizer(optimizer, state=state, **hyper)
        d_weights = torch.empty_like(weights) if weights is not None else None
        err = ctypes.create_string_buffer(512)
        rc = self.lib.pkm_cpu_fused_update(ctypes.byref(bags), _ptr(grad), ctypes.byref(opt), _ptr(d_weights),
                                           num_threads, err, len(err))
        self._check_cpu(rc, err, "pkm_cpu_fused_update")
        return d_weights
