"""The wheels' shared libraries are stripped (`make wheel` strips the staged copies,
packaging/build_wheels.py strip_library) and still export what the unstripped build does:
the TF op library still registers its ops and the delegate still runs a model."""
import os
import subprocess
import sys
import textwrap
import zipfile

import numpy as np
import pytest
from elftools.elf.elffile import ELFFile

from tests.built_wheels import built_wheel, packaging_module

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LIB_DIR = os.path.join(ROOT, "pkm_serve", "lib")

WHEELS = {  # name -> (dist/ pattern, what, make target)
    "tf": ("pkm_serve-*.whl", "TF", "wheel-tf"),
    "device": ("pkm_serve_device-*x86_64.whl", "device", "wheel-device"),
    "keras": ("pkm_serve_keras-*.whl", "Keras", "wheel-keras"),
}


def _extract_libraries(which, tmp_path):
    wheel = built_wheel(*WHEELS[which])
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if n.startswith("pkm_serve/lib/") and n.endswith(".so")]
        assert names, f"{wheel} packs no library"
        return {os.path.basename(n): z.extract(n, tmp_path) for n in names}


def _sections_and_exports(path):
    with open(path, "rb") as f:
        elf = ELFFile(f)
        sections = {s.name for s in elf.iter_sections()}
        exports = {s.name for s in elf.get_section_by_name(".dynsym").iter_symbols()
                   if s.name and s.entry.st_shndx != "SHN_UNDEF"}
    return sections, exports


@pytest.mark.parametrize("which", sorted(WHEELS))
def test_wheel_libraries_are_stripped_and_export_what_the_build_does(which, tmp_path):
    for name, path in _extract_libraries(which, tmp_path).items():
        sections, exports = _sections_and_exports(path)
        kept = sorted(s for s in sections if s in (".symtab", ".strtab") or s.startswith(".debug"))
        assert not kept, f"{which} wheel: {name} is not stripped (has {kept})"
        _, built_exports = _sections_and_exports(os.path.join(LIB_DIR, name))
        assert exports == built_exports, (which, name, sorted(built_exports ^ exports)[:10])


def test_stripped_op_library_registers_the_ops(tmp_path):
    op_lib = _extract_libraries("tf", tmp_path)["_pkm_ops.so"]
    # A fresh process: pkm_serve's own op library is not loaded there (a second registration
    # of the same ops would fail). TF is imported first, so the RUNPATH is not needed.
    program = textwrap.dedent("""
        import sys
        import numpy as np
        import tensorflow as tf
        ops = tf.load_op_library(sys.argv[1])
        out = ops.pkm_embedding_bag(np.eye(3, dtype=np.float32), [[0, 2]], [[1.0, 2.0]],
                                    combiner="sum")
        print("out", out.numpy().tolist())
    """)
    proc = subprocess.run([sys.executable, "-c", program, op_lib], capture_output=True, text=True,
                          timeout=300, env={k: v for k, v in os.environ.items()
                                            if not k.startswith("PKM_")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "out [[1.0, 0.0, 2.0]]" in proc.stdout, proc.stdout


@pytest.mark.parametrize("which", ["tf", "device"])
def test_stripped_delegate_runs_a_model(which, tmp_path, monkeypatch):
    from pkm_serve import tflite
    delegate = _extract_libraries(which, tmp_path)["libpkm_tflite.so"]
    monkeypatch.setenv("PKM_TFLITE_DELEGATE", delegate)
    assert tflite.delegate_path() == delegate
    table = np.arange(12, dtype=np.float32).reshape(4, 3)
    model = tflite.build_embedding_bag_model(table, 2, combiner="mean")
    (out,) = tflite.run_tflite(model, [np.array([[1, 3]], np.int32), np.ones((1, 2), np.float32)],
                               interpreter="litert")
    np.testing.assert_allclose(out, [(table[1] + table[3]) / 2])


def test_strip_library_refuses_a_copy_that_lost_exports(tmp_path):
    build_wheels = packaging_module("build_wheels")
    staged = tmp_path / "libpkm_tflite.so"
    staged.write_bytes(open(os.path.join(LIB_DIR, "libpkm_tflite.so"), "rb").read())
    build_wheels.strip_library(str(staged))  # the real strip keeps every export
    # A tool that leaves another library in its place (as a wrong strip could).
    tool = tmp_path / "bad_strip"
    tool.write_text(f"#!/bin/sh\ncp {os.path.join(LIB_DIR, 'libpkm_capi_cpu.so')} \"$2\"\n")
    tool.chmod(0o755)
    with pytest.raises(build_wheels.PackagingError,
                       match=r"removed exported symbols of .*libpkm_tflite.so: \[.*PkmEmbeddingBagRegistration"):
        build_wheels.strip_library(str(staged), str(tool))
