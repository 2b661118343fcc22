"""The --report JSON (schema pinned by golden/report_schema.json, fields that
agree with the reasons), an export that fuses nothing (as convertible as its
source), and progress output that moves."""
import io
import json
import os
import re
import sys
import time

import pytest
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import export_models as M  # noqa: E402

from pkm_serve import ops  # noqa: E402
from pkm_serve.export import main  # noqa: E402
from pkm_serve.export.progress import Progress  # noqa: E402
from pkm_serve.export.sites import REPORT_KEYS  # noqa: E402

ops.load_library()
GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden",
                      "report_schema.json")


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """Reports of: a fused model with --tflite, sparse sites, an unfusable one."""
    base = tmp_path_factory.mktemp("reports")
    out = {}
    for name, build, extra in [
            ("fused", M.gather_weighted_sum, ["--tflite", str(base / "fused.tflite")]),
            ("sparse", lambda p: M.sparse_all_combiners(p, safe=True), []),
            ("unfusable", M.unfusable_reductions, ["--tflite", str(base / "unfusable.tflite")])]:
        build(base / name)
        report = base / f"{name}.json"
        assert main([str(base / name), str(base / (name + "_out")), "--report", str(report),
                     "--quiet"] + extra) == 0
        out[name] = {"json": json.loads(report.read_text()), "src": str(base / name),
                     "dst": str(base / (name + "_out") / "1")}
    return out


def _type_name(value):
    return {bool: "bool", int: "int", float: "float", str: "str", list: "list",
            dict: "dict", type(None): "null"}[type(value)]


def _check(obj, golden, what):
    assert sorted(obj) == sorted(golden), f"{what} keys changed"
    for key, value in obj.items():
        assert _type_name(value) in golden[key].split("|"), f"{what}.{key}: {value!r}"


def test_report_schema_matches_golden(reports):
    golden = json.load(open(GOLDEN))
    assert tuple(golden["site"]) == REPORT_KEYS  # also the order the report writes
    for name, rep in reports.items():
        data = rep["json"]
        _check(data, golden["report"], name)
        for site in data["sites"]:
            _check(site, golden["site"], f"{name} site")
            for key, allowed in golden["values"].items():
                assert site[key] in allowed, (name, key, site[key])
        for row in data["verification"]:
            _check(row, golden["verification_row"], f"{name} verification")
        if data["tflite"] is not None:
            _check(data["tflite"], golden["tflite"], f"{name} tflite")
            for row in data["tflite"]["verification"]:
                _check(row, golden["verification_row"], f"{name} tflite verification")


def test_report_fields_agree_with_reasons(reports):
    for name, rep in reports.items():
        data = rep["json"]
        sites = data["sites"]
        fused = [s for s in sites if s["status"] == "fused"]
        assert data["sites_found"] == len(sites)
        assert data["sites_fused"] == len(fused)
        assert data["sites_skipped"] == len(sites) - len(fused)
        assert data["saved_bytes_at_batch"] == sum(s["saved_bytes_at_batch"] or 0
                                                   for s in fused)
        for s in sites:
            assert (s["status"] == "fused") == (s["reason"] == ""), s
            # A reason about the site's weights or mask comes with the flag set.
            reason = s["reason"]
            if reason.startswith(("weights", "multiplier", "sparse weights")):
                assert s["weighted"], s
            if reason.startswith(("mask", "tf.where")):
                assert s["masked"], s
            if reason.startswith("weighted or masked"):
                assert s["weighted"] or s["masked"], s
            if s["status"] == "fused":
                assert s["bytes_per_index"], s
    unfusable_sites = reports["unfusable"]["json"]["sites"]
    assert len(unfusable_sites) == 5 and not any(s["status"] == "fused"
                                                 for s in unfusable_sites)
    assert reports["unfusable"]["json"]["message"].endswith("exported unchanged")


def test_export_that_fuses_nothing_is_as_convertible_as_its_source(reports):
    rep = reports["unfusable"]
    src_pb = open(os.path.join(rep["src"], "saved_model.pb"), "rb").read()
    dst_pb = open(os.path.join(rep["dst"], "saved_model.pb"), "rb").read()
    assert src_pb == dst_pb  # the graph is the source's, byte for byte
    for path in (rep["src"], rep["dst"]):  # the stock converter, builtins only
        assert tf.lite.TFLiteConverter.from_saved_model(path).convert()
    tflite = rep["json"]["tflite"]
    assert tflite["custom_ops"] == [] and tflite["status"] == "verified with the pkm delegate"


LINE = re.compile(r"^\[\s*(\d+\.\d)s\] (.*)$")


def test_export_progress_names_phases_with_elapsed_time(tmp_path, capsys):
    M.gather_weighted_sum(tmp_path / "m")
    assert main([str(tmp_path / "m"), str(tmp_path / "dst"), "--tflite",
                 str(tmp_path / "m.tflite")]) == 0
    lines = capsys.readouterr().err.splitlines()
    ours = [LINE.match(line) for line in lines if LINE.match(line)]
    texts = [m.group(2) for m in ours]
    times = [float(m.group(1)) for m in ours]
    assert times == sorted(times) and times[-1] > 0
    for phase in ("rewriting functions", "copying variables and assets",
                  "verifying signatures", "converting to TFLite",
                  "verifying the .tflite through the pkm delegate"):
        assert any(t.startswith(phase) and t.endswith("...") for t in texts), phase
        assert any(t.startswith(phase) and "done in" in t for t in texts), phase
    # Counted units reach their totals (the old bars stayed at 0/4).
    def done(phase):
        [line] = [t for t in texts if t.startswith(phase + ": done in")]
        return line
    assert re.search(r"\((\d+) functions / \1 functions\)$", done("rewriting functions"))
    assert done("verifying signatures").endswith("(1 signatures / 1 signatures)")
    assert re.search(r"\(([\d.]+) MiB / \1 MiB\)$", done("copying variables and assets"))


def test_long_phase_prints_lines_that_move():
    stream = io.StringIO()
    progress = Progress(stream=stream, heartbeat_s=0.05)
    with progress.phase("converting to TFLite"):
        time.sleep(0.4)
    lines = stream.getvalue().splitlines()
    beats = [line for line in lines if "still running" in line]
    assert len(beats) >= 2, lines
    seconds = [float(LINE.match(line).group(1)) for line in beats]
    assert seconds == sorted(seconds) and seconds[-1] > seconds[0]
    assert "done in 0." in lines[-1]
    quiet = io.StringIO()
    with Progress(quiet=True, stream=quiet, heartbeat_s=0.01).phase("x"):
        time.sleep(0.05)
    assert quiet.getvalue() == ""


def test_counted_phase_prints_its_count_while_running():
    stream = io.StringIO()
    progress = Progress(stream=stream, interval_s=0.05, heartbeat_s=60)
    with progress.phase("copying variables and assets", total=4 * 2 ** 20, unit="B") as phase:
        for _ in range(4):
            time.sleep(0.06)
            phase.advance(2 ** 20)
    lines = stream.getvalue().splitlines()
    counts = [line for line in lines if line.split("] ", 1)[1].startswith("  copying")]
    assert counts and all(re.search(r": [123]\.0 MiB / 4\.0 MiB$", line) for line in counts)
    assert lines[-1].endswith("(4.0 MiB / 4.0 MiB)")
