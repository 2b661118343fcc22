"""A check module run in a process of its own with KERAS_BACKEND set (a Keras backend is fixed per
process): backend_checks.py and keras_habit_checks.py print one JSON line per check passed, and
run_checks.py one per check of several check modules (each check's failure its own line)."""

import importlib.util
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def start(backend, args, module="backend_checks", **extra_env):
    env = dict(os.environ, KERAS_BACKEND=backend, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, **extra_env)
    return subprocess.Popen([sys.executable, "-m", f"tests.backends.{module}", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc, what, timeout=300):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"{what} failed:\n{out[-3000:]}\n{err[-3000:]}"
    results = {}
    for line in out.splitlines():
        if line.startswith("{"):
            results.update(json.loads(line))
    return results


def installed(backend):
    return importlib.util.find_spec(backend) is not None


def checks_side_by_side(processes):
    """result(process) -> that process's {"<module>.<check>": "ok" or its failure}: one run_checks.py
    process per entry of `processes` ({name: (backend, [check, ...], extra environment)}) started now,
    side by side, and waited for at the first ask."""
    procs = {name: start(backend, checks, module="run_checks", **env)
             for name, (backend, checks, env) in processes.items()}
    done = {}

    def result(name):
        if name not in done:
            # (one process runs a dozen checks: on 2 busy cores it took 280 s)
            done[name] = finish(procs[name], f"{name} {processes[name][1]}", timeout=900)
        return done[name]

    return result
