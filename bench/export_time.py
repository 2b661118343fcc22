"""How `pkm-serve export`'s graph rewrite scales with the number of fused sites.

A tf.Module with S tables, each read as gather -> multiply by weights ->
reduce_sum (S composite sites in one serving function), saved once per S. Each
tree given (a checkout with its op library built or linked in pkm_serve/lib)
rewrites it in a fresh process: read the SavedModel proto, then time
`fuse_saved_model_proto` alone (min of --repeats) and report ms per site, so trees can
be compared side by side in one run. Writes bench/results/<name>.{json,md}.

    .venv/bin/python bench/export_time.py [--sites 25,100,400] [--trees .,/tmp/base]
        [--repeats 3] [--name export_time]
(a tree other than this one: `git worktree add --detach /tmp/base REV` and link
this checkout's pkm_serve/lib into it)
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

from harness import ROOT, machine_name, run_child, utc_date, write_results

BUILD_CHILD = r"""
import sys
import numpy as np, tensorflow as tf
sites, path = int(sys.argv[1]), sys.argv[2]
rng = np.random.default_rng(0)

class Model(tf.Module):
    def __init__(self):
        self.tables = [tf.Variable(rng.random((100, 8), dtype=np.float32)) for _ in range(sites)]

    @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.int32),
                                  tf.TensorSpec([None, 4], tf.float32)])
    def serve(self, ids, w):
        bags = [tf.reduce_sum(tf.gather(t, ids) * w[..., None], axis=1) for t in self.tables]
        return {"y": tf.add_n(bags)}

model = Model()
tf.saved_model.save(model, path, signatures={"serving_default": model.serve})
print("{}")
"""

FUSE_CHILD = r"""
import json, sys, time
from pkm_serve import ops
from pkm_serve.export.exporter import fuse_saved_model_proto, read_saved_model
ops.load_library()
path, repeats = sys.argv[1], int(sys.argv[2])
times, fused = [], 0
for _ in range(repeats):
    proto = read_saved_model(path)
    start = time.perf_counter()
    sites = fuse_saved_model_proto(proto, batch_size=8)
    times.append(time.perf_counter() - start)
    fused = sum(s.status == "fused" for s in sites)
print(json.dumps({"fuse_s": min(times), "fused": fused}))
"""


def _commit(tree: str) -> str:
    """The tree's commit, marked when tracked files differ from it."""
    head = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip() or tree
    dirty = subprocess.run(["git", "-C", tree, "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return head + (" (modified)" if dirty else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sites", default="25,100,400")
    parser.add_argument("--trees", default=".", help="comma-separated checkouts to compare")
    parser.add_argument("--repeats", type=int, default=3, help="rewrites per tree and size (min)")
    parser.add_argument("--name", default="export_time")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sites.split(",")]
    trees = [os.path.abspath(os.path.join(ROOT, t)) for t in args.trees.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "fuse.py"), "w") as f:
            f.write(FUSE_CHILD)
        with open(os.path.join(tmp, "build.py"), "w") as f:
            f.write(BUILD_CHILD)
        for sites in sizes:
            model = os.path.join(tmp, f"m{sites}")
            built = run_child(os.path.join(tmp, "build.py"), [sites, model])
            if "error" in built:
                sys.exit(f"building the {sites}-site model failed: {built['error']}")
            for tree in trees:
                got = run_child(os.path.join(tmp, "fuse.py"), [model, args.repeats], env={"PYTHONPATH": tree})
                row = {"sites": sites, "tree": _commit(tree), **got}
                if "fuse_s" in got:
                    row["ms_per_site"] = 1e3 * got["fuse_s"] / sites
                rows.append(row)
                print(row, flush=True)
    report = {"machine": machine_name(), "date": utc_date(), "rows": rows}
    lines = [f"# Export graph rewrite time vs fused sites\n",
             f"{report['machine']}, {report['date']}. `python bench/export_time.py --sites "
             f"{args.sites} --trees {args.trees} --repeats {args.repeats}`: the rewrite "
             "(`fuse_saved_model_proto`) of one serving function with S gather-multiply-reduce_sum "
             f"sites, min of {args.repeats}, each tree in a fresh process.\n",
             "| sites | tree | fused | rewrite s | ms per site |", "|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['sites']} | {r['tree']} | error: {r['error']} | | |")
        else:
            lines.append(f"| {r['sites']} | {r['tree']} | {r['fused']} | {r['fuse_s']:.2f} | "
                         f"{r['ms_per_site']:.1f} |")
    write_results(args.name, report, "\n".join(lines))


if __name__ == "__main__":
    main()
