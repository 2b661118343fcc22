"""Runs TFLite models in the TF-free venv (.venv-tflite-runtime): invoked by
the tests as `<venv>/bin/python run_in_runtime.py JOB.npz OUT.npz`.

JOB.npz holds `model_path` and `interpreter`, `num_threads`, `fuse_composites`
scalars plus input arrays named `input_<i>`. OUT.npz gets `output_<i>`, or
`error` with the runtime's message.
"""
import sys

import numpy as np


def main(job_path, out_path):
    try:
        import tensorflow  # noqa: F401
        raise SystemExit("tensorflow must not be importable in the device-like venv")
    except ImportError:
        pass
    from pkm_serve import tflite

    job = np.load(job_path)
    n_inputs = sum(1 for k in job.files if k.startswith("input_"))
    inputs = [job[f"input_{i}"] for i in range(n_inputs)]
    try:
        outputs = tflite.run_tflite(str(job["model_path"]), inputs,
                                    interpreter=str(job["interpreter"]),
                                    num_threads=int(job["num_threads"]),
                                    fuse_composites=bool(job["fuse_composites"]))
        np.savez(out_path, **{f"output_{i}": o for i, o in enumerate(outputs)})
    except (RuntimeError, ValueError) as e:
        np.savez(out_path, error=np.array(str(e)))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
