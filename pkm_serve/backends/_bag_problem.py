"""The ctypes mirror of the C descriptor PkmBags (kernels/core/bag_problem.h),
defined once: the PyTorch backend (_capi.py) and the C ABI's test and benchmark
binding (kernels/capi/pkm_capi.py) use it. No torch, no TensorFlow: ctypes only.
"""

from __future__ import annotations

import ctypes


class PkmBags(ctypes.Structure):
    """Mirror of PkmBags in kernels/core/bag_problem.h; layout_mismatch checks it
    against the library's pkm_bags_layout."""

    _fields_ = [
        ("table", ctypes.c_void_p),
        ("elem_type", ctypes.c_int32),
        ("num_rows", ctypes.c_int64),
        ("dim", ctypes.c_int64),
        ("indices", ctypes.c_void_p),
        ("indices_int64", ctypes.c_int32),
        ("num_bags", ctypes.c_int64),
        ("bag_size", ctypes.c_int64),
        ("row_splits", ctypes.c_void_p),
        ("row_splits_int64", ctypes.c_int32),
        ("num_indices", ctypes.c_int64),
        ("weights", ctypes.c_void_p),
        ("weights_type", ctypes.c_int32),
        ("combiner", ctypes.c_int32),
        ("invalid_index_count", ctypes.c_void_p),
        ("index_policy", ctypes.c_int32),
        ("row_scales", ctypes.c_void_p),
        ("row_biases", ctypes.c_void_p),
        ("row_params_type", ctypes.c_int32),
    ]


def layout_mismatch(lib, mirror=PkmBags):
    """None when `mirror` (PkmBags) has the size and field offsets of the loaded
    C ABI library `lib` (its pkm_bags_layout), else what differs, in words."""
    fields = [name for name, _ in mirror._fields_]
    size, offsets = ctypes.c_size_t(), (ctypes.c_size_t * len(fields))()
    size_p = ctypes.POINTER(ctypes.c_size_t)
    lib.pkm_bags_layout.argtypes = [size_p, size_p, ctypes.c_size_t]
    lib.pkm_bags_layout.restype = ctypes.c_size_t
    count = lib.pkm_bags_layout(ctypes.byref(size), offsets, len(fields))
    want = (ctypes.sizeof(mirror), [getattr(mirror, f).offset for f in fields])
    got = (size.value, list(offsets))
    if count == len(fields) and got == want:
        return None
    return (f"the library's PkmBags has {count} fields, size and offsets {got}; "
            f"the mirror (pkm_serve/backends/_bag_problem.py) has {len(fields)}, {want}")
