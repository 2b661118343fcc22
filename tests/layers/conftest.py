import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _float32_policy():
    """Tests that switch the global dtype policy must not leak it."""
    keras.config.set_dtype_policy("float32")
    yield
    keras.config.set_dtype_policy("float32")


@pytest.fixture(scope="session")
def op_library_path():
    from pkm_serve import ops

    ops.load_library()  # a missing library fails here with the build hint
    return ops.library_path()
