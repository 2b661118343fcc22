"""bench/harness.py: the timing, ratios, child protocol and result files every benchmark uses."""

import json
import os
import sys
import time

import pytest

from bench import harness


def sleeper(seconds):
    return lambda: time.sleep(seconds)


def test_interleaved_ratio_follows_the_slower_system():
    res = harness.interleaved({"fast": sleeper(0.002), "slow": sleeper(0.008)}, rounds=5, warmup=0)
    assert res["rounds"] == 5 and res["baseline"] == "fast"
    fast, slow = res["systems"]["fast"], res["systems"]["slow"]
    assert len(fast["times_ms"]) == len(slow["times_ms"]) == 5
    assert fast["min_ms"] <= fast["median_ms"] <= fast["max_ms"]
    assert slow["min_ms"] >= 8.0 and fast["min_ms"] >= 2.0
    ratio = res["ratios"]["slow/fast"]
    assert len(ratio["per_round"]) == 5 and ratio["min"] <= ratio["median"] <= ratio["max"]
    assert 1.5 < ratio["median"] < 4.5  # 4x by construction; sleep overshoot and noise shrink it


def test_interleaved_rotates_the_order_each_round():
    calls = []
    systems = {name: (lambda n=name: calls.append(n)) for name in "abc"}
    harness.interleaved(systems, rounds=3, warmup=0)
    assert calls == list("abc") + list("bca") + list("cab")


def test_interleaved_rejects_an_unknown_baseline():
    with pytest.raises(ValueError, match="baseline 'z'"):
        harness.interleaved({"a": sleeper(0)}, rounds=1, baseline="z")


def test_ab_is_flat_and_ratio_is_a_over_b():
    res = harness.ab(sleeper(0.006), sleeper(0.002), rounds=3, warmup=0, names=("new", "old"))
    assert set(res) == {"rounds", "new_median_ms", "new_min_ms", "old_median_ms", "old_min_ms",
                        "ratio_median", "ratio_min", "ratio_max"}
    assert res["ratio_min"] <= res["ratio_median"] <= res["ratio_max"] and res["ratio_median"] > 1.3


def test_time_calls_uses_sync():
    synced = []
    res = harness.time_calls(lambda: None, repeats=4, warmup=2, sync=lambda: synced.append(1))
    assert len(res["times_ms"]) == 4 and len(synced) == 6


def test_machine_name_names_cpu_cores_and_gpu():
    info = harness.machine_info()
    assert info["cores"] == os.cpu_count() and info["cpu"] and isinstance(info["gpus"], list)
    name = harness.machine_name({"cpu": "Test CPU", "cores": 2, "memory_gb": 8.0, "gpus": ["NVIDIA H200"]})
    assert name == "Test CPU, 2 cores, 8.0 GB, GPU NVIDIA H200"
    assert harness.machine_name({"cpu": "X", "cores": 4, "gpus": ["G", "G"]}) == "X, 4 cores, GPU 2x G"
    assert "GPU" not in harness.machine_name({"cpu": "X", "cores": 4, "gpus": []})
    assert harness.machine_name({"cpu": "X", "cores": 2, "isa": ["avx2", "fma"], "gpus": []}) == "X, 2 cores, AVX2"
    assert harness.machine_name({"cpu": "X", "cores": 2, "isa": ["avx512f", "avx2"]}) == "X, 2 cores, AVX-512"


def test_run_child_reads_the_last_json_line_and_reports_failures(tmp_path):
    script = tmp_path / "child.py"
    script.write_text("import json, sys\nprint('noise')\nif sys.argv[1] == 'ok':\n"
                      "    print(json.dumps({'x': int(sys.argv[2])}))\nelse:\n    sys.exit('bad shape')\n")
    assert harness.run_child(str(script), ["ok", 7]) == {"x": 7}
    assert harness.run_child(str(script), ["fail", 0]) == {"error": "bad shape"}


def test_write_results_writes_json_and_markdown(tmp_path):
    paths = harness.write_results("t", {"a": 1}, "# T", out_dir=str(tmp_path))
    assert json.loads(open(paths["json"]).read()) == {"a": 1}
    assert open(paths["md"]).read() == "# T\n"
    assert set(harness.write_results("u", {}, out_dir=str(tmp_path))) == {"json"}


def test_interleaved_before_round_and_budget():
    seen = []
    res = harness.interleaved({"a": sleeper(0.001)}, rounds=2, warmup=0, before_round=seen.append,
                              budget_s=0.03, max_rounds=50)
    assert seen == list(range(res["rounds"])) and 2 <= res["rounds"] <= 50
    assert len(res["systems"]["a"]["times_ms"]) == res["rounds"]
    capped = harness.interleaved({"a": sleeper(0)}, rounds=1, warmup=0, budget_s=10, max_rounds=3)
    assert capped["rounds"] == 3


def test_time_calls_budget_keeps_calling():
    calls = []
    res = harness.time_calls(lambda: calls.append(time.sleep(0.001)), repeats=1, warmup=0, budget_s=0.03)
    assert len(res["times_ms"]) == len(calls) >= 5
