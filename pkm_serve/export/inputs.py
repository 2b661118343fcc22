"""The inputs an export verifies on: --sample-inputs read and checked against the
signatures, and the feeds verification generates inputs from (before anything
is written, so a bad argument leaves nothing behind)."""
from __future__ import annotations

from typing import Dict, Optional, Sequence

import numpy as np

from pkm_serve.export.errors import ExportError


def read_samples(sample_inputs: Optional[str]) -> Optional[Dict[str, np.ndarray]]:
    if sample_inputs is None:
        return None
    _check_is_npz(sample_inputs)
    try:
        with np.load(sample_inputs, allow_pickle=False) as npz:
            return {k: npz[k] for k in npz.files}
    except (OSError, ValueError) as e:
        raise ExportError(f"--sample-inputs {sample_inputs} is not a readable .npz: "
                          f"{e}") from None


def _check_is_npz(path: str) -> None:
    """np.load reads a .npy as one array (a TypeError followed) and calls any other file
    pickled data; a .npz is a zip archive."""
    try:
        with open(path, "rb") as f:
            magic = f.read(6)
    except OSError as e:
        raise ExportError(f"--sample-inputs {path} is not a readable .npz: {e.strerror or e}") from None
    savez = "np.savez(FILE, NAME=array, ...) or SIG/NAME keys"
    if magic == b"\x93NUMPY":
        raise ExportError(f"--sample-inputs {path} is a .npy (one unnamed array); write the inputs "
                          f"by name with {savez}")
    if not magic.startswith(b"PK"):
        raise ExportError(f"--sample-inputs {path} is not a .npz (a zip of named arrays, as {savez} "
                          "writes)")


def check_sample_keys(proto, chosen: Sequence[str], samples) -> None:
    """Refused here, before anything is written: a SIG/NAME key whose SIG is no
    signature of the model (a misspelling, else silently unused); and, with several
    signatures, a bare NAME key (fed to each of them) that some signature does not take."""
    if samples is None:
        return
    signatures = proto.meta_graphs[0].signature_def
    inputs = {name: set(signatures[name].inputs) for name in chosen}
    bare = set().union(*inputs.values())
    for key in sorted(samples):
        if "/" in key and key not in bare and key.split("/", 1)[0] not in signatures:
            expected = sorted(bare) + sorted(f"{s}/{n}" for s in chosen for n in inputs[s])
            raise ExportError(f"--sample-inputs key {key!r} names signature {key.split('/', 1)[0]!r}, "
                              "which the model does not have; "
                              f"expected keys: {expected}")
    if len(chosen) < 2:
        return
    for key in sorted(k for k in samples if "/" not in k):
        lacking = [name for name in chosen if key not in inputs[name]]
        if lacking:
            having = [name for name in chosen if key in inputs[name]]
            example = f" (here {', '.join(repr(f'{n}/{key}') for n in having)})" if having else ""
            raise ExportError(
                f"--sample-inputs key {key!r} is a bare NAME, which is fed to every signature, but "
                f"signature(s) {lacking} take no input {key!r}: with several signatures ({list(chosen)}), "
                f"key each input SIG/NAME{example}")


# Signature input dtypes verification can generate (DT_* enums of types.proto).
_GENERATED_DTYPES = {1: "float32", 2: "float64", 3: "int32", 4: "uint8", 5: "int16",
                     6: "int8", 7: "string", 9: "int64", 10: "bool", 14: "bfloat16",
                     17: "uint16", 19: "float16", 22: "uint32", 23: "uint64"}


def signature_feeds(proto, chosen: Sequence[str], samples, assets_dir=None) -> Dict[str, dict]:
    """{signature: {input: Feed}} (`assets_dir`: the SavedModel's assets/); refuses, before anything is written, a
    signature with an input that can be neither generated nor found in
    --sample-inputs."""
    from pkm_serve.export import feeds as F
    from tensorflow.python.framework import dtypes

    for name in chosen:
        for key, info in proto.meta_graphs[0].signature_def[name].inputs.items():
            given = samples is not None and (key in samples or f"{name}/{key}" in samples)
            if info.dtype not in _GENERATED_DTYPES and not given:
                raise ExportError(
                    f"signature {name!r} input {key!r} has dtype "
                    f"{dtypes.as_dtype(info.dtype).name}, for which no inputs can be "
                    "generated: pass it in --sample-inputs, or leave the signature out "
                    "with --signatures")
    tables = F.ModelTables(proto.meta_graphs[0], assets_dir)  # read once for every signature
    return {name: F.signature_feeds(proto, name, assets_dir, tables) for name in chosen}
