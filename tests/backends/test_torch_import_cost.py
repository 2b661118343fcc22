"""`import pkm_serve` registers the torch ops once torch is imported (torch.export.load needs them):
that registration must not import torch._dynamo (~1 s added to every `import torch`, TF-only and
JAX processes too), so the torch.compile constant mark of the library-load check is set by hand,
and it must stay the mark torch.compiler.assume_constant_result sets."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_registration_after_import_torch_leaves_dynamo_unimported():
    pytest.importorskip("torch")
    script = ("import sys, pkm_serve, torch; "
              "print('registered', hasattr(torch.ops.pkm_serve, 'embedding_bag'), "
              "'dynamo', 'torch._dynamo' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.stdout.split() == ["registered", "True", "dynamo", "False"], proc.stderr[-2000:]


def test_the_constant_mark_is_the_one_torch_compile_reads():
    torch = pytest.importorskip("torch")
    from pkm_serve.backends import torch_ops

    def marked_by_torch():
        return True

    torch.compiler.assume_constant_result(marked_by_torch)
    assert vars(torch_ops._library_loads) == vars(marked_by_torch) == {"_dynamo_marked_constant": True}
