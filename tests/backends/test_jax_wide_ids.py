"""JAX without jax_enable_x64 turns int64 ids into int32 and wraps those past 2^31 around
(2^32 + 1 read row 1, 2^32 - 1 became padding) with no error: host ids that do not fit
are refused first. Runs in interpreters of its own (JAX's x64 flag is process-wide): one without
x64 for the op's and the layer's checks, one with it."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("jax")

_SCRIPT = """
import numpy as np
from pkm_serve.backends import jax_ops
params = np.arange(20, dtype=np.float32).reshape(5, 4)
print(np.asarray(jax_ops.embedding_bag(params, np.array([[1, 2]], np.int64))).tolist())
for ids in ([[2**32 + 1, 2]], [[2**32 - 1, 2]], [[-2**31 - 1, 0]]):
    try:
        jax_ops.embedding_bag(params, np.array(ids, np.int64))
        print("accepted", ids)
    except ValueError as err:
        print("refused:", str(err).split(",")[0])
try:  # ragged bags whose row_splits do not fit int32: [0, 2**32 + 2] was read as [0, 2]
    jax_ops.embedding_bag(params, np.array([1, 2], np.int64), row_splits=np.array([0, 2**32 + 2], np.int64))
    print("accepted row_splits")
except ValueError as err:
    print("refused:", str(err).split(",")[0])
"""


_SECTION_END = "-- end of section --"


@pytest.fixture(scope="module")
def without_x64():
    """(the process, [each script's stdout]): _SCRIPT then _LAYER_SCRIPT in one interpreter without x64."""
    script = f"{_SCRIPT}\nprint({_SECTION_END!r})\n{_LAYER_SCRIPT}"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, JAX_PLATFORMS="cpu", KERAS_BACKEND="jax"))
    return proc, proc.stdout.split(_SECTION_END + "\n")


def test_ids_past_int32_are_refused_without_x64(without_x64):
    proc, sections = without_x64
    assert len(sections) == 2, proc.stderr[-3000:]   # _SCRIPT ran to its end
    lines = sections[0].strip().splitlines()
    assert lines[0] == "[[12.0, 14.0, 16.0, 18.0]]"  # rows 1 + 2, int64 ids that fit still work
    assert lines[1:4] == ["refused: indices hold values past int32"] * 3, proc.stdout
    assert lines[4:] == ["refused: row_splits hold values past int32"], proc.stdout


_LAYER_SCRIPT = """
import os
os.environ["KERAS_BACKEND"] = "jax"
import numpy as np
from pkm_serve.layers import EmbeddingBag, ProductKeyMemory
layer = EmbeddingBag(input_dim=5, output_dim=4)
layer.build((None, 2))
layer.embeddings.assign(np.arange(20, dtype=np.float32).reshape(5, 4))
print(np.asarray(layer(np.array([[1, 2]], np.int64))).tolist())
for ids in ([[2**32 + 1, 2]], [[2**31, 2]]):
    try:
        print("accepted", ids, np.asarray(layer(np.array(ids, np.int64))).tolist())
    except ValueError as err:
        print("refused:", str(err).split(" (")[0])
for make in (lambda: EmbeddingBag(input_dim=2**31, output_dim=1), lambda: ProductKeyMemory(n_keys=46341)):
    try:
        make()
        print("accepted a table past int32")
    except ValueError as err:
        print("refused:", str(err).split(" needs")[0])
"""


def test_the_layer_refuses_ids_and_tables_past_int32_without_x64(without_x64):
    """Keras converts the layer's host ids to a JAX array before call(): 2^32 + 1 read row 1
    and 2^31 became padding (TF, the reference, refuses both as out of range [0, 5))."""
    proc, sections = without_x64
    assert proc.returncode == 0 and len(sections) == 2, proc.stderr[-3000:]
    lines = sections[1].strip().splitlines()
    assert lines[0] == "[[12.0, 14.0, 16.0, 18.0]]"  # rows 1 + 2: int64 ids that fit still work
    assert lines[1:3] == ["refused: EmbeddingBag: indices hold values past int32"] * 2, proc.stdout
    assert lines[3:] == ["refused: EmbeddingBag: a table of 2147483648 rows",
                         "refused: ProductKeyMemory: a table of 2147488281 rows"], proc.stdout


_X64_FLOAT_IDS_SCRIPT = """
import os
os.environ["KERAS_BACKEND"] = "jax"
import jax
jax.config.update("jax_enable_x64", True)
import numpy as np
from pkm_serve.layers import EmbeddingBag
layer = EmbeddingBag(input_dim=5, output_dim=4)
layer.build((None, 2))
layer.embeddings.assign(np.arange(20, dtype=np.float32).reshape(5, 4))
print(np.asarray(layer(np.array([[1.0, 2.0]]))).tolist())
try:
    layer(np.array([[2.0**31 + 5, 2.0]]))
    print("accepted")
except ValueError as err:
    print("refused:", str(err).split(" is out of range")[0].split("indices[0] = ")[-1])
"""


def test_float_ids_keep_their_value_with_x64():
    """With jax_enable_x64, float ids are cast to int64 (as int64 ids pass): the out-of-range error
    names the id, as TF's does (they went through int32 and saturated: it named 2147483647)."""
    proc = subprocess.run([sys.executable, "-c", _X64_FLOAT_IDS_SCRIPT], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0] == "[[12.0, 14.0, 16.0, 18.0]]", proc.stdout  # rows 1 + 2
    assert lines[1] == f"refused: {2**31 + 5}", proc.stdout
