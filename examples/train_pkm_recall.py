"""Train a small Product-Key Memory model on synthetic key -> value recall (CPU, ~1 minute).

    .venv/bin/python examples/train_pkm_recall.py
    .venv/bin/python examples/train_pkm_recall.py --param-matched     # also a same-parameter FFN
    .venv/bin/python examples/train_pkm_recall.py --steps 300 --report out/recall
        (writes out/recall.json with per-step losses, out/recall.md, out/recall.png)

32768 random unit-vector keys each map to one of 256 random values. Nothing
about a key predicts its value, so the model has to store the pairs. The PKM
model is compared with the same network whose memory is replaced by a
feed-forward block of the same width (d_model -> 4*d_model -> d_model); with
--param-matched also by a feed-forward block with as many parameters as the
memory layer. All see the same batches for the same number of steps.

The training code lives in pkm_serve.layers.recall_task (tests/layers/test_recall_task.py tests it).
"""
import argparse
import dataclasses
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pkm_serve.layers.recall_task import (  # noqa: E402
    RecallConfig,
    parameter_matched_hidden_units,
    run_recall_comparison,
)


def main(argv=None):
    defaults = RecallConfig()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for field in dataclasses.fields(RecallConfig):
        parser.add_argument("--" + field.name.replace("_", "-"), type=type(getattr(defaults, field.name)),
                            default=getattr(defaults, field.name))
    parser.add_argument("--implementation", choices=["fused", "composite"], default="fused")
    parser.add_argument("--fallback", choices=["composite"], default=None,
                        help="use the composite if the op library is not built")
    parser.add_argument("--param-matched", action="store_true",
                        help="also train a feed-forward baseline with as many parameters as the memory")
    parser.add_argument("--report", metavar="STEM",
                        help="write STEM.json (results with per-step losses), STEM.md and STEM.png")
    args = parser.parse_args(argv)
    config = RecallConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(RecallConfig)})

    baselines = [None]
    if args.param_matched:
        baselines.append(parameter_matched_hidden_units(config))
    print(f"task: {config.num_pairs} keys -> {config.num_values} values; "
          f"PKM n_keys={config.n_keys} ({config.n_keys ** 2} slots) heads={config.heads} knn={config.knn}; "
          f"{config.steps} steps of batch {config.batch_size}")
    report = run_recall_comparison(config, args.implementation, args.fallback, baselines)

    summary = summarise(report)
    print()
    print(summary)
    if args.report:
        write_report(report, summary, args.report, " ".join(["examples/train_pkm_recall.py"] + (argv or sys.argv[1:])))
    return report


def summarise(report):
    lines = [
        "| model | params | steps | start loss | end loss | recall accuracy | train s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        lines.append(f"| {r['model']} | {r['params']} | {r['steps']} | {r['start_loss']:.4f} | "
                     f"{r['end_loss']:.4f} | {r['end_accuracy']:.4f} | {r['train_seconds']:.1f} |")
    pkm, *others = report["results"]
    lines.append("")
    for other in others:
        verdict = "beats" if pkm["end_loss"] < other["end_loss"] else "does NOT beat"
        lines.append(f"PKM {verdict} {other['model']}: end loss {pkm['end_loss']:.4f} vs "
                     f"{other['end_loss']:.4f}, recall accuracy {pkm['end_accuracy']:.4f} vs "
                     f"{other['end_accuracy']:.4f}")
    return "\n".join(lines)


def write_report(report, summary, stem, command):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    os.makedirs(os.path.dirname(os.path.abspath(stem)), exist_ok=True)
    with open(stem + ".json", "w") as f:
        json.dump(report, f, indent=1)
    config = report["config"]
    with open(stem + ".md", "w") as f:
        f.write("# Synthetic key -> value recall: PKM vs feed-forward baselines\n\n")
        f.write(f"Command: `.venv/bin/python {command}`\n\n")
        f.write(f"Task: {config['num_pairs']} random keys (unit vectors in R^{config['key_dim']}) -> "
                f"{config['num_values']} random values; chance loss ln({config['num_values']}) = "
                f"{np.log(config['num_values']):.3f}. Loss/accuracy over all stored pairs before and after "
                f"training. PKM: n_keys={config['n_keys']} ({config['n_keys'] ** 2} slots), heads={config['heads']}, "
                f"knn={config['knn']}, k_dim={config['k_dim']}, d_model={config['d_model']}. "
                f"Adam lr={config['learning_rate']}, batch {config['batch_size']}.\n\n")
        f.write(summary + "\n")
    figure, axis = plt.subplots(figsize=(7, 4))
    window = 25
    for r in report["results"]:
        losses = np.convolve(r["step_losses"], np.ones(window) / window, mode="valid")
        axis.plot(np.arange(window, window + len(losses)), losses, label=f"{r['model']} ({r['params']:,} params)")
    axis.set_xlabel("step")
    axis.set_ylabel(f"batch loss ({window}-step mean)")
    axis.set_title("key -> value recall")
    axis.legend()
    figure.tight_layout()
    figure.savefig(stem + ".png", dpi=100)
    print("wrote", stem + ".json,", stem + ".md,", stem + ".png")


if __name__ == "__main__":
    main()
