"""PKM training steps inside Keras-JAX and Keras-PyTorch on a GPU: our CUDA kernels
vs the same Keras model with the composite lookup vs plain PyTorch with nn.EmbeddingBag.

Seed shape: B=16384 queries of d_model=1024, 4 heads x knn 32 (K=128 slots per
query), values D=1024, 512^2 = 262144 value rows (a 1 GiB float32 table),
k_dim=128. One step = forward + backward + SGD update (SGD so that the
optimizer's own state does not blur the lookup's cost), through
`model.train_on_batch` for Keras (whose returned loss syncs the device) and a
plain loop for PyTorch. Each system runs in its own process (a Keras backend is
fixed per process); peak GPU memory is the framework allocator's peak over the
whole run (parameters, gradients, activations).

    python bench/keras_backends_gpu.py --out DIR       # all systems, writes keras_backends_<gpu>.{json,md}
    python bench/keras_backends_gpu.py --worker SYSTEM # one system, prints one JSON line
"""

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
B, D_MODEL, D, N_KEYS, HEADS, KNN, K_DIM = 16384, 1024, 1024, 512, 4, 32, 128
# PKM_BENCH_SMOKE=1: a tiny shape on the CPU, to check the script itself without a GPU.
SMOKE = os.environ.get("PKM_BENCH_SMOKE") == "1"
if SMOKE:
    B, D_MODEL, D, N_KEYS, HEADS, KNN, K_DIM = 64, 32, 32, 16, 2, 4, 16
DEV = "cpu" if SMOKE else "cuda"
WARMUP, STEPS = 3, 10
SYSTEMS = {  # name -> (KERAS_BACKEND, layer implementation or None for plain PyTorch)
    "keras-jax fused (pkm_serve CUDA FFI)": ("jax", "fused"),
    "keras-jax composite (gather-mul-sum)": ("jax", "composite"),
    "keras-torch fused (pkm_serve torch op)": ("torch", "fused"),
    "keras-torch composite (gather-mul-sum)": ("torch", "composite"),
    "pytorch nn.EmbeddingBag (no Keras)": ("torch", None),
}


def _keras_worker(backend, implementation):
    import keras
    import numpy as np

    from pkm_serve.layers import ProductKeyMemory

    keras.utils.set_random_seed(0)
    layer = ProductKeyMemory(v_dim=D, k_dim=K_DIM, n_keys=N_KEYS, heads=HEADS, knn=KNN,
                             implementation=implementation)
    model = keras.Sequential([keras.Input((D_MODEL,)), layer])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    rng = np.random.default_rng(0)
    x_np = rng.normal(size=(B, D_MODEL)).astype("float32")
    y_np = rng.normal(size=(B, D)).astype("float32")
    if backend == "jax":
        import jax

        x, y = jax.device_put(x_np), jax.device_put(y_np)
        device = jax.devices()[0]
        peak = lambda: (device.memory_stats() or {}).get("peak_bytes_in_use", 0)  # noqa: E731
        gpu = device.device_kind
    else:
        import torch

        x, y = torch.as_tensor(x_np, device=DEV), torch.as_tensor(y_np, device=DEV)
        peak = torch.cuda.max_memory_allocated if DEV == "cuda" else (lambda: 0)
        gpu = torch.cuda.get_device_name() if DEV == "cuda" else "cpu (smoke)"
    from pkm_serve import backends

    kernel = backends.kernel_device() if implementation == "fused" else None
    losses = [float(model.train_on_batch(x, y)) for _ in range(WARMUP)]
    start = time.perf_counter()
    for _ in range(STEPS):
        losses.append(float(model.train_on_batch(x, y)))  # a Python float: waits for the step
    step_ms = (time.perf_counter() - start) / STEPS * 1e3
    return {"gpu": gpu, "kernel_device": kernel, "step_ms": step_ms, "peak_gpu_mib": peak() / 2**20,
            "loss_first": losses[0], "loss_last": losses[-1]}


def _torch_worker():
    import torch
    from torch import nn

    torch.manual_seed(0)
    half = K_DIM // 2

    class TorchPKM(nn.Module):
        def __init__(self):
            super().__init__()
            self.query_proj = nn.Linear(D_MODEL, HEADS * K_DIM)
            self.query_bn = nn.BatchNorm1d(HEADS * K_DIM)
            self.keys = nn.Parameter(torch.empty(HEADS, 2, N_KEYS, half).uniform_(-half ** -0.5, half ** -0.5))
            self.values = nn.EmbeddingBag(N_KEYS * N_KEYS, D, mode="sum")
            nn.init.normal_(self.values.weight, std=D ** -0.5)

        def forward(self, x):
            q = self.query_bn(self.query_proj(x)).view(-1, HEADS, 2, half)
            scores, index = torch.einsum("bhsd,hsnd->bhsn", q, self.keys).topk(KNN, dim=-1)
            pair_scores = (scores[:, :, 0, :, None] + scores[:, :, 1, None, :]).flatten(2)
            pair_index = (index[:, :, 0, :, None] * N_KEYS + index[:, :, 1, None, :]).flatten(2)
            best, pos = pair_scores.topk(KNN, dim=-1)
            slots = pair_index.gather(-1, pos).flatten(1)
            weights = torch.softmax(best, dim=-1).flatten(1)
            return self.values(slots, per_sample_weights=weights)

    model = TorchPKM().to(DEV)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(B, D_MODEL, device=DEV)
    y = torch.randn(B, D, device=DEV)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = torch.mean((model(x) - y) ** 2)
        loss.backward()
        opt.step()
        return float(loss)

    losses = [step() for _ in range(WARMUP)]
    start = time.perf_counter()
    losses += [step() for _ in range(STEPS)]
    step_ms = (time.perf_counter() - start) / STEPS * 1e3
    cuda = DEV == "cuda"
    return {"gpu": torch.cuda.get_device_name() if cuda else "cpu (smoke)", "step_ms": step_ms,
            "peak_gpu_mib": (torch.cuda.max_memory_allocated() if cuda else 0) / 2**20,
            "loss_first": losses[0], "loss_last": losses[-1]}


def run_worker(name):
    backend, implementation = SYSTEMS[name]
    result = _torch_worker() if implementation is None else _keras_worker(backend, implementation)
    result["system"] = name
    print("RESULT " + json.dumps(result), flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    parser.add_argument("--worker")
    args = parser.parse_args()
    if args.worker:
        return run_worker(args.worker)
    rows = []
    for name, (backend, _) in SYSTEMS.items():
        env = dict(os.environ, KERAS_BACKEND=backend, XLA_PYTHON_CLIENT_PREALLOCATE="false",
                   PYTHONUNBUFFERED="1")
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", name], env=env,
                              capture_output=True, text=True, timeout=300)
        lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            rows.append({"system": name, "error": (proc.stderr or proc.stdout)[-1500:]})
        else:
            rows.append(json.loads(lines[-1][len("RESULT "):]))
        print(json.dumps(rows[-1])[:2000], flush=True)
    write(rows, args.out)


def write(rows, out_dir):
    gpu = next((r["gpu"] for r in rows if "gpu" in r), "unknown GPU")
    tag = gpu.replace(" ", "_")
    shape = {"B": B, "d_model": D_MODEL, "D": D, "n_keys": N_KEYS, "rows": N_KEYS ** 2, "heads": HEADS,
             "knn": KNN, "k_dim": K_DIM, "warmup": WARMUP, "steps": STEPS, "optimizer": "SGD(0.01)"}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"keras_backends_{tag}.json"), "w") as f:
        json.dump({"gpu": gpu, "shape": shape, "results": rows}, f, indent=1)
    lines = [f"# PKM training step inside Keras 3 backends on {gpu}", "",
             f"B={B} queries x d_model={D_MODEL}, {HEADS} heads x knn {KNN} (K={HEADS * KNN} slots), "
             f"D={D}, {N_KEYS}^2={N_KEYS ** 2} value rows (float32), k_dim={K_DIM}; one step = forward + "
             f"backward + SGD update; mean of {STEPS} steps after {WARMUP} warm-up steps; peak = the "
             "framework allocator's peak over the run. Each system in its own process, one after another "
             "on the one GPU.", "",
             "| system | step (ms) | peak GPU memory (MiB) | loss first -> last |", "|---|---:|---:|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['system']} | failed | | {r['error'].splitlines()[-1][:120] if r['error'] else ''} |")
        else:
            lines.append(f"| {r['system']} | {r['step_ms']:.1f} | {r['peak_gpu_mib']:.0f} | "
                         f"{r['loss_first']:.4f} -> {r['loss_last']:.4f} |")
    with open(os.path.join(out_dir, f"keras_backends_{tag}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
