"""Builds the TF-free Keras wheel (pkm_serve_keras) from the tree `make build` produced.

    python packaging/build_keras_wheel.py [--dist dist] [--stage build/wheel/keras]

Stages pkm_serve/{__init__,product_keys}.py, pkm_serve/layers (without the
TF-only recall_task), pkm_serve/backends and the TF-free libraries (a manylinux wheel, `auditwheel repair` grafting nothing): always
libpkm_xla_cpu.so (JAX) and libpkm_capi_cpu.so (PyTorch); libpkm_xla_gpu.so and
libpkm_cuda.so when `make gpu` built them (CUDA: cudart static, the driver at run
time). Then checks that no packed library needs a TensorFlow library, and strips them
(build_wheels.strip_library).
No pkm_serve/tflite.py: its delegate (libpkm_tflite.so) is the TF and device wheels'.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from build_wheels import strip_library  # noqa: E402  (beside this file: run as a script, on sys.path)
PACKAGE = os.path.join(ROOT, "pkm_serve")
MODULES = ("__init__.py", "product_keys.py")
LAYER_MODULES = ("__init__.py", "_lookup.py", "_optimizer_placeholders.py", "embedding_bag.py",
                 "product_key_memory.py")
CPU_LIBS = ("libpkm_xla_cpu.so", "libpkm_capi_cpu.so")
CUDA_LIBS = ("libpkm_xla_gpu.so", "libpkm_cuda.so")


class PackagingError(RuntimeError):
    pass


def stage_tree(stage):
    """The wheel's sources under `stage`; returns the library names packed."""
    if os.path.exists(stage):
        shutil.rmtree(stage)
    pkg = os.path.join(stage, "pkm_serve")
    os.makedirs(os.path.join(pkg, "layers"))
    os.makedirs(os.path.join(pkg, "lib"))
    for name in MODULES:
        shutil.copy2(os.path.join(PACKAGE, name), pkg)
    for name in LAYER_MODULES:
        shutil.copy2(os.path.join(PACKAGE, "layers", name), os.path.join(pkg, "layers"))
    shutil.copytree(os.path.join(PACKAGE, "backends"), os.path.join(pkg, "backends"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    missing = [n for n in CPU_LIBS if not os.path.exists(os.path.join(PACKAGE, "lib", n))]
    if missing:
        raise PackagingError(f"pkm_serve/lib/ lacks {missing}: run `make backends-deps` first")
    libs = list(CPU_LIBS) + [n for n in CUDA_LIBS if os.path.exists(os.path.join(PACKAGE, "lib", n))]
    for name in libs:
        _check_no_tensorflow(os.path.join(PACKAGE, "lib", name))
        shutil.copy2(os.path.join(PACKAGE, "lib", name), os.path.join(pkg, "lib"))
        strip_library(os.path.join(pkg, "lib", name))
    shutil.copy2(os.path.join(ROOT, "packaging", "keras", "pyproject.toml"), stage)
    shutil.copy2(os.path.join(ROOT, "packaging", "tf_free_wheel_setup.py"), os.path.join(stage, "setup.py"))
    shutil.copy2(os.path.join(ROOT, "README.md"), stage)
    return libs


def _check_no_tensorflow(path):
    needed = subprocess.run(["readelf", "-d", path], check=True, capture_output=True, text=True).stdout
    if "tensorflow" in needed:
        raise PackagingError(f"{path} needs a TensorFlow library:\n{needed}")


def _repair(wheel, out):
    """Retags the wheel manylinux: `auditwheel repair` must find no library to graft
    (the libraries need only libc/libstdc++/libm/libgcc; cudart is linked statically)."""
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    subprocess.run([sys.executable, "-m", "auditwheel", "repair", "--plat", "manylinux_2_35_x86_64", "--only-plat", "-w", out, wheel],
                   check=True, env=env)
    (repaired,) = glob.glob(os.path.join(out, "pkm_serve_keras-*.whl"))
    with zipfile.ZipFile(repaired) as zf:
        grafted = [n for n in zf.namelist() if ".libs/" in n]
    if grafted:
        raise PackagingError(f"auditwheel grafted libraries into {repaired}: {grafted}")
    return repaired


def build(dist, stage):
    libs = stage_tree(stage)
    out = os.path.join(stage, "dist")
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", out, stage],
                   check=True)
    (wheel,) = glob.glob(os.path.join(out, "pkm_serve_keras-*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    want = {f"pkm_serve/lib/{n}" for n in libs} | {"pkm_serve/backends/jax_ops.py",
                                                  "pkm_serve/backends/torch_ops.py"}
    if not want <= names:
        raise PackagingError(f"{wheel} lacks {sorted(want - names)}")
    wheel = _repair(wheel, os.path.join(stage, "repaired"))
    os.makedirs(dist, exist_ok=True)
    for old in glob.glob(os.path.join(dist, "pkm_serve_keras-*.whl")):
        os.remove(old)
    target = os.path.join(dist, os.path.basename(wheel))
    shutil.copy2(wheel, target)
    return target


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dist", default=os.path.join(ROOT, "dist"))
    ap.add_argument("--stage", default=os.path.join(ROOT, "build", "wheel", "keras"))
    args = ap.parse_args(argv)
    print("wrote", build(args.dist, args.stage))
    return 0


if __name__ == "__main__":
    sys.exit(main())
