"""What every benchmark shares: the machine's name, interleaved A/B timing, the
JSON-last-line child protocol, and writing results under bench/results.

The machine is shared and noisy, so comparisons are made inside one process
with the systems called alternately (noise hits all alike) and reported as
per-round ratios; medians and minima are both kept.

    from harness import interleaved, machine_info, machine_name, write_results

    res = interleaved({"fused": run_fused, "torch": run_torch}, rounds=9)
    res["systems"]["fused"]["median_ms"], res["ratios"]["torch/fused"]["median"]
    write_results("my_bench", report, markdown_text)   # bench/results/my_bench.{json,md}

Stable API (other benchmarks copy it): RESULTS_DIR, utc_date, machine_info,
machine_name, time_calls, interleaved, ab, run_child, write_results; on a CUDA
device (through torch, imported only there): cuda_event_ms, cuda_graph_ms.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from typing import Callable, Mapping, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS_DIR = os.path.join(HERE, "results")
# How busy the machine was, for the results' header (PKM_BENCH_MACHINE_NOTE overrides it).
SHARED_NOTE = os.environ.get("PKM_BENCH_MACHINE_NOTE",
                             "shared with other engineers' builds and tests (noisy: compare the ratios of one run)")


def utc_date() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


# ---- the machine -------------------------------------------------------------

def _first_cpu() -> dict:
    """The first processor's fields of /proc/cpuinfo ({} where there is none)."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def _cpu_model(cpu: dict) -> str:
    """The model name, with the x86 family and model numbers: a virtual machine's name can be
    as bare as 'AMD EPYC', which does not tell one generation from another."""
    name = cpu.get("model name")
    if not name:
        return platform.processor() or platform.machine() or "unknown CPU"
    if cpu.get("cpu family") and cpu.get("model"):
        name += f" (family {cpu['cpu family']}, model {cpu['model']})"
    return name


def _cpu_isa(cpu: dict) -> list:
    flags = (cpu.get("flags") or cpu.get("Features") or "").split()  # x86 / aarch64
    return [x for x in ("avx512f", "avx2", "fma", "f16c", "asimd") if x in flags]


def gpu_names() -> list:
    """GPU names from nvidia-smi, else from an already imported torch; [] when none."""
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)
            names = [line.strip() for line in out.stdout.splitlines() if line.strip()]
            if out.returncode == 0 and names:
                return names
        except (OSError, subprocess.SubprocessError):
            pass
    torch = sys.modules.get("torch")  # never imported here: it costs seconds
    if torch is not None and torch.cuda.is_available():
        return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return []


def machine_info() -> dict:
    """CPU model, cores, ISA flags, memory, GPUs (a list, empty without), Python, platform."""
    try:
        memory_gb = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        memory_gb = None
    cpu = _first_cpu()
    return {"cpu": _cpu_model(cpu), "cores": os.cpu_count(), "isa": _cpu_isa(cpu), "memory_gb": memory_gb,
            "gpus": gpu_names(), "python": platform.python_version(), "platform": platform.platform()}


def machine_name(info: Mapping | None = None) -> str:
    """One line for a report: 'AMD EPYC 7B13, 2 cores[, AVX2], 8.0 GB[, GPU NVIDIA H200]'."""
    info = machine_info() if info is None else info
    text = f"{info['cpu']}, {info['cores']} cores"
    isa = info.get("isa") or []
    widest = next((name for flag, name in (("avx512f", "AVX-512"), ("avx2", "AVX2"), ("asimd", "NEON"))
                   if flag in isa), None)
    if widest:
        text += f", {widest}"
    if info.get("memory_gb"):
        text += f", {info['memory_gb']} GB"
    gpus = info.get("gpus") or []
    if len(set(gpus)) == 1:
        text += f", GPU {gpus[0]}" if len(gpus) == 1 else f", GPU {len(gpus)}x {gpus[0]}"
    elif gpus:
        text += ", GPUs " + " + ".join(gpus)
    return text


# ---- timing ------------------------------------------------------------------

def _summary(times_s: Sequence[float]) -> dict:
    ms = [1e3 * t for t in times_s]
    return {"median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms), "times_ms": ms}


def _timed(fn: Callable, sync: Callable | None) -> float:
    t0 = time.perf_counter()
    fn()
    if sync is not None:
        sync()  # e.g. torch.cuda.synchronize: time the work, not the launch
    return time.perf_counter() - t0


def op_compute_ms(run_metadata, op_types) -> list:
    """Compute time (ms) of each node of one of op_types in a FULL_TRACE run's step stats."""
    return [(ns.op_end_rel_nanos - ns.op_start_rel_nanos) / 1e6
            for dev in run_metadata.step_stats.dev_stats for ns in dev.node_stats
            if " = " in ns.timeline_label and ns.timeline_label.split(" = ")[1].split("(")[0] in op_types]


def cuda_event_ms(fn: Callable, iters: int, warmup: int = 3) -> float:
    """Median ms of fn() over `iters` calls, each between two CUDA events (torch's current
    stream): device time, plus any host time inside fn() during which the GPU waits."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return statistics.median(cuda_event_once_ms(fn) for _ in range(iters))


def cuda_event_once_ms(fn: Callable) -> float:
    """ms of one fn() between two CUDA events on torch's current stream, waited for."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def cuda_graph_ms(fn: Callable, iters: int, calls_per_graph: int = 20, warmup: int = 3) -> float:
    """Device time of one fn() without host overhead: `calls_per_graph` calls captured in one
    CUDA graph (fn must not synchronise or allocate outside torch), median replay / calls."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls_per_graph):
            fn()
    return cuda_event_ms(graph.replay, iters, warmup=2) / calls_per_graph


def time_calls(fn: Callable, repeats: int, warmup: int = 1, sync: Callable | None = None, *,
               budget_s: float | None = None) -> dict:
    """One system alone: median_ms, min_ms, max_ms, times_ms over `repeats` calls after `warmup`
    (with budget_s, `repeats` is a minimum and calls go on until budget_s seconds have passed)."""
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    return interleaved({"fn": fn}, repeats, warmup, sync, budget_s=budget_s)["systems"]["fn"]


def interleaved(systems: Mapping[str, Callable], rounds: int, warmup: int = 1,
                sync: Callable | None = None, baseline: str | None = None, *,
                before_round: Callable[[int], None] | None = None,
                budget_s: float | None = None, max_rounds: int | None = None) -> dict:
    """Call every system once per round, the order rotating each round (so no
    system always runs right after another's cache damage). Returns
    {"rounds", "baseline", "systems": {name: summary}, "ratios": {"other/baseline": {median, min, max,
    per_round}}}; the baseline is the first system unless named. A ratio > 1 means `other` is slower.
    before_round(r), untimed, runs before round r (e.g. to feed round r's inputs). With budget_s,
    `rounds` is a minimum: rounds go on until budget_s seconds have passed or max_rounds are done."""
    names = list(systems)
    if not names or rounds < 1:
        raise ValueError("interleaved needs at least one system and one round")
    baseline = names[0] if baseline is None else baseline
    if baseline not in systems:
        raise ValueError(f"baseline {baseline!r} is not one of {names}")
    for _ in range(warmup):
        for name in names:
            _timed(systems[name], sync)
    times = {name: [] for name in names}
    start, r = time.perf_counter(), 0
    while r < rounds or (budget_s is not None and time.perf_counter() - start < budget_s
                         and (max_rounds is None or r < max_rounds)):
        if before_round is not None:
            before_round(r)
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(_timed(systems[name], sync))
        r += 1
    ratios = {}
    for name in names:
        if name == baseline:
            continue
        per_round = [a / b for a, b in zip(times[name], times[baseline])]
        ratios[f"{name}/{baseline}"] = {"median": statistics.median(per_round), "min": min(per_round),
                                        "max": max(per_round), "per_round": per_round}
    return {"rounds": r, "baseline": baseline,
            "systems": {name: _summary(times[name]) for name in names}, "ratios": ratios}


def ab(a: Callable, b: Callable, rounds: int, warmup: int = 1, sync: Callable | None = None,
       names: tuple = ("a", "b")) -> dict:
    """Two systems, flat: {<a>_median_ms, <a>_min_ms, <b>_median_ms, <b>_min_ms,
    ratio_median, ratio_min, ratio_max (a / b per round), rounds}."""
    res = interleaved({names[0]: a, names[1]: b}, rounds, warmup, sync, baseline=names[1])
    out = {"rounds": rounds}
    for name in names:
        out[f"{name}_median_ms"] = res["systems"][name]["median_ms"]
        out[f"{name}_min_ms"] = res["systems"][name]["min_ms"]
    ratio = res["ratios"][f"{names[0]}/{names[1]}"]
    out.update(ratio_median=ratio["median"], ratio_min=ratio["min"], ratio_max=ratio["max"])
    return out


# ---- children and results ----------------------------------------------------

def run_child(script: str, args: Sequence, timeout: float = 1200, env: Mapping | None = None) -> dict:
    """Run `python script *args` in a fresh process (its memory is its own) and
    parse the JSON object on its last stdout line; {"error": last line} on failure."""
    cmd = [sys.executable, script, *map(str, args)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env=None if env is None else {**os.environ, **env})
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        return {"error": tail[0][:300]}
    try:
        return json.loads(lines[-1])
    except json.JSONDecodeError:
        return {"error": f"no JSON on the last line: {lines[-1][:200]}"}


def write_results(name: str, report: Mapping, markdown: str | None = None, out_dir: str = RESULTS_DIR) -> dict:
    """bench/results/<name>.json (and <name>.md when markdown is given); returns the paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {"json": os.path.join(out_dir, f"{name}.json")}
    with open(paths["json"], "w") as f:
        json.dump(report, f, indent=1)
        f.write("\n")
    if markdown is not None:
        paths["md"] = os.path.join(out_dir, f"{name}.md")
        with open(paths["md"], "w") as f:
            f.write(markdown if markdown.endswith("\n") else markdown + "\n")
    return paths
