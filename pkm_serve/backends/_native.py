"""Where the TF-free native libraries live, and what the kernels accept.

Both are plain C shared objects that link no framework: the XLA typed-FFI
handlers (kernels/xla/*_targets.cc) for JAX, the C ABI (kernels/capi) for
PyTorch. Each holds the one kernel core; the CUDA ones also the launchers.
"""

from __future__ import annotations

import os

LIB_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "lib")

# Library per (runtime, device), built by: make xla-targets-cpu | make gpu | make capi-cpu |
# make gpu-standalone. PKM_SERVE_LIB_DIR points every one of them at another folder.
LIBRARIES = {
    ("jax", "cpu"): "libpkm_xla_cpu.so",
    ("jax", "cuda"): "libpkm_xla_gpu.so",
    ("torch", "cpu"): "libpkm_capi_cpu.so",
    ("torch", "cuda"): "libpkm_cuda.so",
}
MAKE_TARGETS = {
    "libpkm_xla_cpu.so": "make xla-targets-cpu",
    "libpkm_xla_gpu.so": "make gpu",
    "libpkm_capi_cpu.so": "make capi-cpu",
    "libpkm_cuda.so": "make gpu-standalone",
}

# The kernels' combiner codes (PKM_SUM.. in kernels/core/bag_problem.h).
COMBINER_CODES = {"sum": 0, "mean": 1, "sqrtn": 2, "max": 3}
# The core's message (kernels/core/embedding_bag.h, kMaxWithWeightsError), word for word.
MAX_WITH_WEIGHTS_ERROR = ("combiner 'max' takes no weights (as torch's embedding_bag mode='max' refuses "
                          "per_sample_weights): pass weights=None")


def row_splits_error(row_splits, num_values):
    """The core's message for host row_splits [B+1] that do not split `num_values` values
    (ValidateLayout in kernels/core/embedding_bag.cc, same checks in the same order), or None."""
    import numpy as np

    splits = np.asarray(row_splits, np.int64).reshape(-1)
    if splits[0] != 0:
        return f"row_splits[0] must be 0, got {splits[0]}"
    down = np.flatnonzero(splits[1:] < splits[:-1])
    if down.size:
        b = int(down[0])
        return (f"row_splits must be non-decreasing: row_splits[{b + 1}] = {splits[b + 1]} < "
                f"row_splits[{b}] = {splits[b]}")
    if splits[-1] != num_values:
        return f"row_splits[-1] = {splits[-1]} must equal the number of values ({num_values})"
    return None


def index_error(indices, num_rows):
    """The core's message for the first host index >= num_rows (negative ones are padding; the
    flat position as ValidateIndices counts it in kernels/core/embedding_bag.cc), or None."""
    import numpy as np

    flat = np.asarray(indices).reshape(-1)
    bad = np.flatnonzero(flat >= num_rows)
    if not bad.size:
        return None
    j = int(bad[0])
    return f"indices[{j}] = {flat[j]} is out of range [0, {num_rows}) (negative indices are padding)"


class NativeLibraryUnavailableError(ImportError):
    """The backend's native library for this device is not built or not shipped."""


def library_path(runtime: str, device: str) -> str:
    """Path of the library for `runtime` ("jax"/"torch") on `device`
    ("cpu"/"cuda"); raises NativeLibraryUnavailableError when it is missing."""
    name = LIBRARIES[(runtime, device)]
    path = os.path.join(os.environ.get("PKM_SERVE_LIB_DIR") or LIB_DIR, name)
    if not os.path.exists(path):
        raise NativeLibraryUnavailableError(
            f"pkm_serve: {name} (the {runtime} kernels for {device}) not found at {path}; in a "
            f"source checkout run `{MAKE_TARGETS[name]}`, or install the pkm_serve_keras wheel")
    return path


def combiner_code(combiner: str, weights=None) -> int:
    if combiner not in COMBINER_CODES:
        raise ValueError(f"combiner must be one of {tuple(COMBINER_CODES)}, got {combiner!r}")
    if combiner == "max" and weights is not None:
        raise ValueError(MAX_WITH_WEIGHTS_ERROR)
    return COMBINER_CODES[combiner]
