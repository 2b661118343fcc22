"""Runs checks of several check modules (round34_checks.py, round35_checks.py, ...) inside one process
with KERAS_BACKEND set, so that the backend, Keras, pkm_serve and TensorFlow are imported once for all
of them; test_backends_rounds.py runs it. Prints {"<module>.<check>": "ok"} for each check passed, or
the end of its traceback: a failing check does not stop the others, and each test reads its own.
A check taking an argument gets a fresh directory (a SavedModel's), removed afterwards.

    KERAS_BACKEND=jax python -m tests.backends.run_checks round34.jax_export round35.listed_ids
"""

import importlib
import json
import os
import shutil
import sys
import tempfile
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def run(name):
    """'round34.jax_export' -> "ok", or the end of the check's traceback."""
    module, check = name.split(".")
    function = importlib.import_module(f"tests.backends.{module}_checks").CHECKS[check]
    directory = tempfile.mkdtemp(prefix=f"{module}_{check}_") if function.__code__.co_argcount == 1 else None
    try:
        function(*([os.path.join(directory, "saved")] if directory else []))
    except Exception:  # noqa: BLE001 - reported as that check's failure
        return traceback.format_exc()[-3000:]
    finally:
        if directory:
            shutil.rmtree(directory, ignore_errors=True)
    return "ok"


if __name__ == "__main__":
    import pkm_serve  # noqa: F401  (registers the layers)

    for name in sys.argv[1:]:
        print(json.dumps({name: run(name)}), flush=True)
