"""Runs every fixture case in one TFLite interpreter and saves the results:
the aarch64 side of tests/aarch64, started under qemu by test_aarch64.py as
    python3.11 run_on_device.py FIXTURES INTERPRETER OUT.npz
(imports numpy and pkm_serve.tflite only; the delegate is $PKM_TFLITE_DELEGATE).
OUT.npz holds each case's outputs as "<case>/output_<i>" and a "meta" JSON
string: the machine, the interpreter module's file, the shared objects mapped
into the process, each case's error (if any) and, for fused cases, the ops
that run.
"""
import json
import os
import platform
import sys

import numpy as np


def run_case(fixtures, case, arrays, interpreter):
    """Runs one manifest case; returns {"outputs": [...]} or {"error": str}."""
    from pkm_serve import tflite
    inputs = [arrays[f"{case['name']}/input_{i}"] for i in range(case["n_inputs"])]
    try:
        outputs = tflite.run_tflite(os.path.join(fixtures, case["model"]), inputs,
                                    interpreter=interpreter, num_threads=case["num_threads"],
                                    fuse_composites=case["fuse_composites"],
                                    use_delegate=case["use_delegate"])
    except (RuntimeError, ValueError) as e:
        return {"error": str(e)}
    return {"outputs": [np.array(o) for o in outputs]}


def plan(fixtures, case, interpreter):
    from pkm_serve import tflite
    it = tflite.make_interpreter(os.path.join(fixtures, case["model"]), interpreter,
                                 fuse_composites=case["fuse_composites"],
                                 use_delegate=case["use_delegate"])
    return tflite.ops_in_plan(it)


def main(fixtures, interpreter, out_path):
    from pkm_serve import tflite
    with open(os.path.join(fixtures, "manifest.json")) as f:
        manifest = json.load(f)
    arrays = dict(np.load(os.path.join(fixtures, "cases.npz")))
    results, meta = {}, {"cases": {}}
    for case in manifest["cases"]:
        if interpreter not in case["interpreters"]:
            continue
        print(case["name"], file=sys.stderr, flush=True)  # the last name tells which case crashed
        res = run_case(fixtures, case, arrays, interpreter)
        info = {"error": res.get("error")}
        for i, out in enumerate(res.get("outputs", [])):
            results[f"{case['name']}/output_{i}"] = out
        if case["error"] is None:
            info["ops_in_plan"] = plan(fixtures, case, interpreter)
        meta["cases"][case["name"]] = info
    module = tflite.interpreter_module(interpreter)
    with open("/proc/self/maps") as f:
        mapped = sorted({line.split()[-1] for line in f if line.rstrip().endswith(".so")
                         or ".so." in line})
    meta.update(machine=platform.machine(), python=sys.version, numpy=np.__version__,
                interpreter_file=module.__file__, delegate=tflite.delegate_path(),
                mapped=mapped)
    np.savez(out_path, meta=np.array(json.dumps(meta)), **results)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
