"""Runs .tflite signatures in the TF-free venv (.venv-tflite-runtime) with the
pkm delegate: `<venv>/bin/python run_signature_in_runtime.py JOBS.json`.

JOBS.json lists {"model", "signature", "inputs" (.npz), "outputs" (.npz)};
each outputs file gets the signature's outputs by name, or `error`.
"""
import json
import sys

import numpy as np


def main(jobs_path):
    try:
        import tensorflow  # noqa: F401
        raise SystemExit("tensorflow must not be importable in the device-like venv")
    except ImportError:
        pass
    from pkm_serve import tflite

    for job in json.load(open(jobs_path)):
        try:
            interp = tflite.make_interpreter(job["model"], interpreter="tflite_runtime")
            runner = interp.get_signature_runner(job["signature"])
            with np.load(job["inputs"]) as npz:
                outputs = runner(**{k: npz[k] for k in npz.files})
            np.savez(job["outputs"], **outputs)
        except (RuntimeError, ValueError) as e:
            np.savez(job["outputs"], error=np.array(str(e)))


if __name__ == "__main__":
    main(sys.argv[1])
