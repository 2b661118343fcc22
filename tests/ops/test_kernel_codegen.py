"""The x86-64 forward kernels are vectorised in the op library as built.

GCC decides this, not the source: with a 64-byte inner loop it once unrolled
the single-row fp32 kernel completely and left it scalar (16 `vfmadd...ss` per
line; K=1 ran at half the speed of tf.gather). The AVX2 (x86-64-v3) and
AVX-512 (x86-64-v4) clones of the fp32 row kernels must use packed FMAs.

Nor does a target attribute reach what a function calls out of line: a loop
inside a lambda that internal.h's weight-loader dispatch (WithWeightLoader,
WithVectorsAndWeights) calls is compiled for the file's baseline target (SSE2)
unless it is inlined into the function that carries the attribute (round 45:
the AVX-512 short rows ran as SSE2, bfloat16 D=128 at 3.7x the time).
"""

import os
import re
import shutil
import subprocess

import pytest

from pkm_serve import ops

OBJDUMP = shutil.which("objdump")
# kernel -> (packed FMAs at least, scalar FMAs at most). A row's tail (fewer
# than 8 or 16 columns) may stay scalar: one FMA per column for the row kernel,
# eight (one per row) for the 8-row kernel, whose main loop has at least one
# packed FMA per row. A scalar main loop has 16 per 64-byte line.
KERNELS = {"pkm::vec::(anonymous namespace)::AxpyRowF32(": (1, 15),
           "pkm::vec::(anonymous namespace)::AxpyGroupF32(": (8, None)}


@pytest.fixture(scope="module")
def bodies():
    if OBJDUMP is None:
        pytest.skip("objdump (binutils) is not installed")
    out = subprocess.run([OBJDUMP, "-d", "-C", "--no-show-raw-insn", ops.library_path()], capture_output=True,
                         text=True, check=True).stdout
    return re.split(r"\n(?=[0-9a-f]+ <)", out)


@pytest.mark.parametrize("clone,register", [("arch_x86_64_v3", "ymm"), ("arch_x86_64_v4", "[yz]mm")])
@pytest.mark.parametrize("kernel", KERNELS)
def test_fp32_row_kernels_use_packed_fma(bodies, kernel, clone, register):
    body = [b for b in bodies if kernel in b.split("\n", 1)[0] and f"[clone .{clone}]>" in b.split("\n", 1)[0]]
    assert len(body) == 1, f"{kernel} {clone}: {len(body)} bodies found in {ops.library_path()}"
    packed = re.findall(rf"\bvfmadd\d+ps\s.*%{register}\d+", body[0])
    scalar = re.findall(r"\bvfmadd\d+ss\s", body[0])
    least_packed, most_scalar = KERNELS[kernel]
    assert len(packed) >= least_packed, (len(packed), body[0][:3000])
    if most_scalar is not None:
        assert len(scalar) <= most_scalar, (len(scalar), body[0][:3000])


# Legacy-SSE (no VEX/EVEX prefix) packed float arithmetic: what a vector loop
# compiles to at the x86-64 baseline target.
LEGACY_SSE_PACKED = re.compile(r"\t(?:add|sub|mul|max|min)ps |\tp(?:and|slld|srld) ")


def test_loops_behind_the_weight_loader_are_not_baseline_code(bodies):
    behind_loader = [b for b in bodies
                     if re.search(r"WithWeightLoader|WithVectorsAndWeights", b.split("\n", 1)[0])
                     and "[clone .default]" not in b.split("\n", 1)[0]]
    baseline = [b.split("\n", 1)[0][:300] for b in behind_loader if LEGACY_SSE_PACKED.search(b)]
    assert not baseline, f"{len(baseline)} functions reached through the weight loader hold SSE2 loops: {baseline[:3]}"


def test_fused_adam_update_takes_packed_square_roots(bodies):
    """The CPU fused Adam's column loop (kernels/core/fused_optimizer.cc) vectorised: without the core's
    -fno-math-errno, GCC kept it scalar with a call to sqrtf per column (1.83 ns a column, 0.37 after)."""
    clones = [b for b in bodies if "AdamColumns(" in b.split("\n", 1)[0]
              and "[clone .arch_x86_64_v3]>" in b.split("\n", 1)[0]]
    assert len(clones) == 1, f"AdamColumns' AVX2 clone: {len(clones)} bodies found in {ops.library_path()}"
    assert re.search(r"\bvsqrtps\s.*%ymm\d+", clones[0]), clones[0][:3000]
    assert not re.search(r"\bcall\b.*sqrtf", clones[0]), clones[0][:3000]
