"""The C++ SavedModel runner (build/serving_cc/pkm_saved_model_run) and the three
exported models it is checked on; shared by tests/serving_cc and
bench/serving_cc_latency.py."""
import json
import os
import subprocess

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROGRAM = os.path.join(REPO, "build", "serving_cc", "pkm_saved_model_run")

# Rows in the int64 model's value table (demo_model's n_keys = 64 squared).
INT64_MODEL_ROWS = 64 * 64


def require_program():
    if not os.access(PROGRAM, os.X_OK):
        raise FileNotFoundError(f"{PROGRAM} is missing: run `make serving-cc-program` (or `make serving-cc-check`)")
    return PROGRAM


class CcRun:
    def __init__(self, proc):
        self.returncode = proc.returncode
        self.stderr = proc.stderr
        self.result = json.loads(proc.stdout) if proc.returncode == 0 else None

    def output(self, key):
        """The output as a numpy array of its dtype and shape."""
        import tensorflow as tf
        o = self.result["outputs"][key]
        return np.asarray(o["values"], dtype=tf.as_dtype(o["dtype"]).as_numpy_dtype).reshape(o["shape"])


def tensor_arg(name, array):
    """--input=NAME=DTYPE:[SHAPE]:VALUES (float32 values printed so they round-trip)."""
    array = np.asarray(array)
    shape = "[" + ",".join(str(d) for d in array.shape) + "]"
    if array.dtype == np.float32:
        values = ",".join(np.format_float_positional(v, unique=True) for v in array.ravel())
    else:
        values = ",".join(str(v) for v in array.ravel())
    return f"--input={name}={array.dtype.name}:{shape}:{values}"


def tensor_file_arg(name, array, directory):
    """--input=NAME=@FILE with FILE a binary TensorProto written by TF's own make_tensor_proto."""
    import tensorflow as tf
    path = os.path.join(directory, f"{name}.pb")
    with open(path, "wb") as f:
        f.write(tf.make_tensor_proto(np.asarray(array)).SerializeToString())
    return f"--input={name}=@{path}"


def run_cc(model_dir, signature, input_args, *extra, timeout=120):
    """Runs the program; TF's own logging quietened, GPUs hidden as in CI."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([require_program(), f"--model_dir={model_dir}", f"--signature={signature}",
                           *input_args, *extra], capture_output=True, text=True, timeout=timeout, env=env)
    return CcRun(proc)


# ---- the three models -----------------------------------------------------------

def export_demo_pkm(workdir):
    """The demo's PKM model (composite gather-multiply-sum), fused by `pkm-serve export`:
    serving_default(query [B, 64] float32) -> output [B, 256]."""
    import tensorflow as tf
    from pkm_serve.demo import build_composite_pkm
    from pkm_serve.export import exporter
    original = os.path.join(workdir, "demo_original")
    model = build_composite_pkm(tf)
    tf.saved_model.save(model, original, signatures={"serving_default": model.serve})
    result = exporter.export_saved_model(original, os.path.join(workdir, "demo_fused"), version=1, quiet=True)
    if not result.fused:
        raise AssertionError(f"the export fused no site: {result.message}")
    return result.dst


def save_ragged_model(path, rows=500, dim=24, seed=3):
    """bag(values [nnz] int64, row_splits [B+1] int64, weights [nnz] float32) -> output [B, dim]:
    the ragged op (PkmRaggedEmbeddingBag), combiner mean. Returns (path, table)."""
    import tensorflow as tf
    from pkm_serve import ops
    ops.load_library()
    table = np.random.default_rng(seed).standard_normal((rows, dim)).astype(np.float32)

    class RaggedBag(tf.Module):
        def __init__(self):
            super().__init__()
            self.table = tf.Variable(table)

        @tf.function(input_signature=[tf.TensorSpec([None], tf.int64, name="values"),
                                      tf.TensorSpec([None], tf.int64, name="row_splits"),
                                      tf.TensorSpec([None], tf.float32, name="weights")])
        def bag(self, values, row_splits, weights):
            ids = tf.RaggedTensor.from_row_splits(values, row_splits, validate=False)
            w = tf.RaggedTensor.from_row_splits(weights, row_splits, validate=False)
            return {"output": ops.embedding_bag(self.table, ids, w, combiner="mean")}

    module = RaggedBag()
    tf.saved_model.save(module, path, signatures={"bag": module.bag})
    return path, table


def save_int64_model(path, seed=0):
    """pkm_serve/serving/demo_model.py's fused PKM model: int64 indices throughout.
    lookup(indices [B, K] int64, weights [B, K] float32) -> output [B, 64];
    serving_default(query [B, 32] float32) -> output, slots (int64)."""
    from pkm_serve.serving.demo_model import save_pkm_model
    return save_pkm_model(path, seed=seed, fused=True)


