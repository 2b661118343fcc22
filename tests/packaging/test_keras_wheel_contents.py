"""What packaging/build_keras_wheel.py stages for the TF-free Keras wheel (no wheel is
built: the staged tree is what `python -m build` packs). Installing and running the
wheel under JAX / PyTorch is tests/backends/test_keras_wheel.py."""
import os
import re

from tests.built_wheels import packaging_module


def test_every_library_a_staged_module_loads_is_packed(tmp_path):
    # The wheel shipped pkm_serve/tflite.py without libpkm_tflite.so, the delegate it loads.
    builder = packaging_module("build_keras_wheel")
    stage = tmp_path / "stage"
    packed = set(builder.stage_tree(str(stage)))
    named = {}
    for dirpath, _, files in os.walk(stage / "pkm_serve"):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                for lib in re.findall(r"lib\w+\.so", open(path).read()):
                    named.setdefault(lib, set()).add(os.path.relpath(path, stage))
    # The CUDA libraries are packed only where `make gpu` built them.
    missing = {lib: sorted(mods) for lib, mods in named.items()
               if lib not in packed and lib not in builder.CUDA_LIBS}
    assert not missing, f"staged modules name libraries the Keras wheel does not pack: {missing}"
    assert not (stage / "pkm_serve" / "tflite.py").exists()
    assert {"jax_ops.py", "torch_ops.py"} <= set(os.listdir(stage / "pkm_serve" / "backends"))
