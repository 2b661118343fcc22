"""Persisting-L2 access window over the upstream gradient around the dense backward at the huge
shape (B=65536 K=32 D=256 N=4M): the driver's persisting-L2 limit set to its maximum for the whole
run, then blocks of 15 event-timed calls per variant (no window; a window over the gradient with
hit ratio fitted to the set-aside, 1.0 and 0.5), four rounds, the variants' outputs compared
bitwise. An experiment of round 11 (bench/results/gpu_round11_h200_notes.md); the CUDA launchers
set no window themselves.

    python bench/gpu_l2_window.py      (on a GPU machine, after make gpu-standalone; writes $OUT/gpu_l2_window.json)
"""
import ctypes, os, sys, json
import torch
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "kernels", "capi")); sys.path.insert(0, os.path.join(ROOT, "bench"))
import harness, pkm_capi
from gpu_kernels_ab import DTYPES, inputs
lib = pkm_capi.PkmLib(os.path.join(ROOT, "pkm_serve", "lib", "libpkm_cuda.so"))
cuda = ctypes.CDLL("libcuda.so.1")
class Win(ctypes.Structure):
    _fields_ = [("base_ptr", ctypes.c_void_p), ("num_bytes", ctypes.c_size_t), ("hitRatio", ctypes.c_float),
                ("hitProp", ctypes.c_int), ("missProp", ctypes.c_int)]
class Val(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("w", Win)]
def attr(a):
    v = ctypes.c_int(); assert cuda.cuDeviceGetAttribute(ctypes.byref(v), a, 0) == 0; return v.value
torch.zeros(1, device="cuda")
maxp, maxw = attr(108), attr(109)
print("max persisting L2", maxp, "max window", maxw, "L2", torch.cuda.get_device_properties(0).L2_cache_size)
rc = cuda.cuCtxSetLimit(0x06, ctypes.c_size_t(maxp)); print("set limit rc", rc)
cuda.cuStreamSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(Val)]
def set_window(ptr, nbytes, ratio):
    v = Val(); v.w.base_ptr = ptr; v.w.num_bytes = nbytes; v.w.hitRatio = ratio
    v.w.hitProp = 2 if nbytes else 0; v.w.missProp = 1 if nbytes else 0
    rc = cuda.cuStreamSetAttribute(ctypes.c_void_p(torch.cuda.current_stream().cuda_stream), 1, ctypes.byref(v))
    assert rc == 0, rc
out = {}
for dt in ("bf16", "fp32"):
    table, indices, weights, grad = inputs(65536, 32, 256, 4194304, DTYPES[dt])
    ws = torch.empty(lib.cuda_backward_workspace_bytes(table, indices, weights, "sum"), dtype=torch.uint8, device="cuda")
    o = (torch.empty_like(table), torch.empty_like(weights))
    fn = lambda: lib.cuda_backward(table, indices, grad, weights, "sum", workspace=ws, out=o)
    gb = grad.numel() * grad.element_size()
    n = min(gb, maxw)
    variants = {"none": (0, 0, 0.0), "window_fit": (grad.data_ptr(), n, min(1.0, maxp / n)),
                "window_1.0": (grad.data_ptr(), n, 1.0), "window_0.5": (grad.data_ptr(), n, 0.5)}
    times = {k: [] for k in variants}
    ref = None
    for rnd in range(4):
        for k, (p, nb, r) in variants.items():
            set_window(p, nb, r)
            for _ in range(3):
                fn()
            for it in range(15):
                times[k].append(harness.cuda_event_once_ms(fn))
            if ref is None: ref = (o[0].clone(), o[1].clone())
            else: assert torch.equal(ref[0], o[0]) and torch.equal(ref[1], o[1])
            set_window(0, 0, 0.0)
            torch.cuda.synchronize()
            cuda.cuCtxResetPersistingL2Cache()
            torch.cuda.synchronize()
    res = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    print(dt, "grad MB", gb / 1e6, {k: round(v, 4) for k, v in res.items()}, flush=True)
    out[dt] = res
    del table, indices, weights, grad, ws, o
    torch.cuda.empty_cache()
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "gpu_l2_window.json"), "w"))
