"""File-system steps of an export: version numbers, copying, permissions."""
from __future__ import annotations

import os
import shutil
from typing import Callable, Optional

SAVED_MODEL_PB = "saved_model.pb"
FINGERPRINT_PB = "fingerprint.pb"
_CHUNK = 16 * 2 ** 20


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def next_version(dst: str) -> int:
    if not os.path.isdir(dst):
        return 1
    versions = [int(d) for d in os.listdir(dst) if d.isdigit()]
    return max(versions) + 1 if versions else 1


def tree_bytes(path: str, skip=(SAVED_MODEL_PB, FINGERPRINT_PB)) -> int:
    return sum(os.path.getsize(os.path.join(root, f))
               for root, _, files in os.walk(path) for f in files
               if not (root == path and f in skip))


def copy_tree(src: str, dst: str, on_bytes: Optional[Callable[[int], None]] = None) -> None:
    """Copies SRC except saved_model.pb and fingerprint.pb (both rewritten),
    reporting each copied chunk's size to on_bytes (variables can be GBs)."""
    os.makedirs(dst, exist_ok=True)
    for root, dirs, files in os.walk(src):
        rel = os.path.relpath(root, src)
        target = dst if rel == "." else os.path.join(dst, rel)
        os.makedirs(target, exist_ok=True)
        for name in files:
            if rel == "." and name in (SAVED_MODEL_PB, FINGERPRINT_PB):
                continue
            from_path, to_path = os.path.join(root, name), os.path.join(target, name)
            with open(from_path, "rb") as fin, open(to_path, "wb") as fout:
                while True:
                    chunk = fin.read(_CHUNK)
                    if not chunk:
                        break
                    fout.write(chunk)
                    if on_bytes is not None:
                        on_bytes(len(chunk))
            shutil.copystat(from_path, to_path)
