"""Training-step benchmark: peak memory and time of a forward, a forward-gradient step and a backprop step.

For each model (the paper's MLP, a deep wide MLP, a small CNN, a Transformer encoder) and two batch
sizes, three kinds of case, float32:

(a) ``forward``: the loss under ``torch.no_grad()`` (the floor any training step pays);
(b) ``fg:<engine>``: one AFGFW step (one tangent: the JVP of the loss plus the fused Frank-Wolfe update),
    once for EVERY engine in ``fgfw.forward_grad.ENGINES``: a new engine is a new column, nothing to edit;
(c) ``backprop_fw``: one FrankWolfe step (zero_grad, forward, backward, update, zero_grad again so that
    the gradients count as the step's memory, as the tangents of (b) do).

Both optimizers keep one parameter-sized momentum (AFGFW's v; FrankWolfe with momentum 0.9), an L1
ball per tensor of twice its initial norm (zero-initialised tensors first get U(-1e-3, 1e-3) values),
the fastest backend available (``--backend`` to choose).

How memory is measured
----------------------
Every case runs in a fresh Python process (``--case``), so no allocator cache, lazily built kernel or
other case's memory is in the number. In that process: build the model, the batch and the optimizer;
run two warm-up steps (one-time initialisation: momentum allocation, oneDNN/cuBLAS handles, lazy
module state); then take the baseline and measure ``--repeats`` steps.

* CPU: the baseline is the resident set size (RSS, /proc/self/statm) after the warm-up; the peak RSS
  (VmHWM) is reset by writing 5 to /proc/self/clear_refs (Linux >= 4.0), and the reported transient is
  VmHWM - baseline after the measured steps. The process runs with ``MALLOC_MMAP_THRESHOLD_=65536`` so
  that glibc serves every block of 64 KiB or more with mmap and returns it on free: otherwise freed
  warm-up memory stays resident, inflates the baseline and hides the step's peak. Page granularity
  (4 KiB) and small-block heap growth make numbers below about 1 MiB noise.
* GPU: the CUDA caching allocator's statistics: baseline = ``memory_allocated()`` after the warm-up,
  ``reset_peak_memory_stats()``, transient = ``max_memory_allocated()`` - baseline.

The baseline (parameters, momentum, the batch, torch itself on the CPU) is reported beside the
transient. Time: median wall time of the measured steps (CUDA synchronised; at least ``--repeats``,
more for fast cases until 0.5 s is measured). Ratios: (b)/(a) and (b)/(c) of transient memory (left
out where the reference is below 1 MiB, noise on the CPU) and of time.

    PYTHONPATH=python python bench/train_step.py                     # CPU sizes, results in bench/results/
    PYTHONPATH=python python bench/train_step.py --device cuda       # GPU sizes
    PYTHONPATH=python python bench/train_step.py --models paper_mlp --quick

Writes ``train_step_<device>.csv`` and ``train_step_<device>.png`` into ``--out`` (default
bench/results); ``--figure`` copies the plot (e.g. to bench/figures/).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
# below this, CPU transients are page and heap-growth noise: no memory ratio is computed against them
NOISE_MIB = 1.0
PYTHON_DIR = os.path.join(os.path.dirname(HERE), "python")


# -- models ----------------------------------------------------------------------------------------------------------
def deep_mlp(depth: int, width: int, in_features: int = 784, classes: int = 10) -> nn.Sequential:
    layers, fan_in = [], in_features
    for _ in range(depth):
        layers += [nn.Linear(fan_in, width), nn.ReLU()]
        fan_in = width
    return nn.Sequential(*layers, nn.Linear(fan_in, classes))


def small_cnn(classes: int = 10) -> nn.Sequential:
    """Three 3x3 convolutions with max-pooling, for 3x32x32 images (CIFAR-sized)."""
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(128 * 8 * 8, classes))


class Encoder(nn.Module):
    """A Transformer encoder over token ids, mean-pooled into a classifier."""

    def __init__(self, layers: int, dim: int, heads: int, vocab: int = 1000, seq: int = 256, classes: int = 10):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True), layers,
            enable_nested_tensor=False)
        self.head = nn.Linear(dim, classes)

    def forward(self, tokens):
        h = self.embed(tokens) + self.position[:tokens.shape[1]]
        return self.head(self.encoder(h).mean(1))


SEQ = 256
# name -> (constructor, input maker(batch), batch sizes on the CPU, batch sizes on a GPU)
MODELS = {
    "paper_mlp": (lambda: deep_mlp(4, 10), lambda b: torch.rand(b, 784), (64, 1024), (64, 4096)),
    "mlp_16x1024": (lambda: deep_mlp(16, 1024), lambda b: torch.rand(b, 784), (16, 128), (128, 1024)),
    "cnn": (small_cnn, lambda b: torch.rand(b, 3, 32, 32), (16, 64), (128, 512)),
    "transformer_4x256": (lambda: Encoder(4, 256, 4, seq=SEQ), lambda b: torch.randint(0, 1000, (b, SEQ)),
                          (1, 4), (8, 32)),
}


# -- one case, in its own process --------------------------------------------------------------------------------------
def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def run_case(model_name: str, batch: int, case: str, device: str, backend: str | None, repeats: int) -> dict:
    import fgfw

    torch.manual_seed(0)
    make_model, make_input, _, _ = MODELS[model_name]
    dev = torch.device(device)
    model = make_model().to(dev)
    x = make_input(batch).to(dev)
    y = torch.randint(0, 10, (batch,), device=dev)
    # the radius rule needs a non-zero initial norm: the encoder's zero-initialised biases get small values
    with torch.no_grad():
        for p in model.parameters():
            if not p.any():
                p.uniform_(-1e-3, 1e-3)
    constraint = fgfw.L1Ball.relative_to_init(2.0)
    closure = lambda: F.cross_entropy(model(x), y)  # noqa: E731

    if case == "forward":
        def step():
            with torch.no_grad():
                closure()
    elif case == "backprop_fw":
        opt = fgfw.FrankWolfe(model.parameters(), constraint=constraint, step_size=1e-3, momentum=0.9, backend=backend)

        def step():
            opt.zero_grad(set_to_none=True)
            closure().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    elif case.startswith("fg:"):
        opt = fgfw.AFGFW(model, constraint=constraint, step_size=1e-3, averaging_weight=0.1, seed=0,
                         engine=case[3:], backend=backend)

        def step():
            opt.step(closure)
    else:
        raise ValueError(f"unknown case {case!r}")

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    for _ in range(2):
        step()
    sync()
    if dev.type == "cuda":
        baseline = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    else:
        baseline = _rss_bytes()
        _reset_hwm()
    times = []
    # at least `repeats` steps, more (up to 50) for fast cases until half a second is measured
    while len(times) < repeats or (sum(times) < 0.5 and len(times) < 50):
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else _hwm_bytes()
    return dict(model=model_name, parameters=sum(p.numel() for p in model.parameters()), batch=batch, case=case,
                transient_mib=max(peak - baseline, 0) / 2**20, baseline_mib=baseline / 2**20,
                time_ms=1e3 * statistics.median(times))


def spawn_case(model_name: str, batch: int, case: str, args) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [PYTHON_DIR, os.environ.get("PYTHONPATH")])),
               MALLOC_MMAP_THRESHOLD_="65536")
    command = [sys.executable, os.path.abspath(__file__), "--case", json.dumps(
        dict(model_name=model_name, batch=batch, case=case, device=args.device, backend=args.backend,
             repeats=args.repeats))]
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"case {model_name} batch {batch} {case} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


# -- the table and the plot --------------------------------------------------------------------------------------------
def with_ratios(rows: list[dict]) -> list[dict]:
    """Adds (b)/(a) and (b)/(c) ratios of transient memory and time to each forward-gradient row."""
    index = {(r["model"], r["batch"], r["case"]): r for r in rows}
    for r in rows:
        if r["case"].startswith("fg:"):
            forward = index.get((r["model"], r["batch"], "forward"))
            backprop = index.get((r["model"], r["batch"], "backprop_fw"))
            for name, ref in (("forward", forward), ("backprop", backprop)):
                if ref:
                    if ref["transient_mib"] >= NOISE_MIB:
                        r[f"memory_vs_{name}"] = r["transient_mib"] / ref["transient_mib"]
                    r[f"time_vs_{name}"] = r["time_ms"] / ref["time_ms"]
    return rows


def plot(path: str, rows: list[dict], cases: list[str], title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys((r["model"], r["batch"]) for r in rows))
    index = {(r["model"], r["batch"], r["case"]): r for r in rows}
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 1.1 * len(groups) * len(cases) / 2), 7), sharex=True)
    width = 0.8 / len(cases)
    for ax, key, label in ((axes[0], "transient_mib", "step memory above baseline (MiB)"),
                           (axes[1], "time_ms", "time per step (ms)")):
        for j, case in enumerate(cases):
            values = [index[g + (case,)][key] if g + (case,) in index else 0 for g in groups]
            ax.bar([i + (j - (len(cases) - 1) / 2) * width for i in range(len(groups))],
                   [max(v, 1e-3) for v in values], width, label=case)
        ax.set(yscale="log", ylabel=label)
        ax.grid(alpha=0.3, axis="y")
    axes[0].set_title(title, fontsize=10)
    axes[0].legend(fontsize=8, ncol=len(cases))
    axes[1].set_xticks(range(len(groups)), [f"{m}\nbatch {b}" for m, b in groups], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def print_table(rows: list[dict]) -> None:
    print(f"{'model':<18} {'batch':>5} {'case':<16} {'transient MiB':>13} {'baseline MiB':>12} {'time ms':>9} "
          f"{'mem b/a':>8} {'mem b/c':>8} {'time b/a':>8} {'time b/c':>8}")
    for r in rows:
        ratios = "".join(f" {r[k]:8.2f}" if k in r else f" {'':>8}"
                         for k in ("memory_vs_forward", "memory_vs_backprop", "time_vs_forward", "time_vs_backprop"))
        print(f"{r['model']:<18} {r['batch']:>5} {r['case']:<16} {r['transient_mib']:13.1f} {r['baseline_mib']:12.1f} "
              f"{r['time_ms']:9.2f}{ratios}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case and print its JSON
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated from {','.join(MODELS)}")
    parser.add_argument("--backend", default=None, help="fused-op backend (default: the fastest available)")
    parser.add_argument("--repeats", type=int, default=3, help="least measured steps per case (after 2 warm-ups)")
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for the case processes")
    parser.add_argument("--quick", action="store_true", help="the smaller batch size only")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--figure", default=None, help="also copy the plot to this path")
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(**json.loads(args.case))))
        return

    from fgfw.experiments import write_csv
    from fgfw.forward_grad import ENGINES

    cases = ["forward", *(f"fg:{name}" for name in ENGINES), "backprop_fw"]
    rows = []
    for model_name in args.models.split(","):
        _, _, cpu_batches, gpu_batches = MODELS[model_name]
        batches = gpu_batches if args.device.startswith("cuda") else cpu_batches
        for batch in batches[:1] if args.quick else batches:
            for case in cases:
                rows.append(spawn_case(model_name, batch, case, args))
                print(f"  {model_name} batch {batch} {case}: {rows[-1]['transient_mib']:.1f} MiB, "
                      f"{rows[-1]['time_ms']:.1f} ms", file=sys.stderr, flush=True)
    rows = with_ratios(rows)
    device = args.device.split(":")[0]
    machine = (torch.cuda.get_device_name() if device == "cuda"
               else f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    print(f"\ndevice: {device} ({machine}); torch {torch.__version__}; engines {', '.join(ENGINES)}\n")
    print_table(rows)
    os.makedirs(args.out, exist_ok=True)
    write_csv(os.path.join(args.out, f"train_step_{device}.csv"), rows)
    path = os.path.join(args.out, f"train_step_{device}.png")
    plot(path, rows, cases, f"one training step, float32, {device} ({machine})")
    if args.figure:
        os.makedirs(os.path.dirname(args.figure) or ".", exist_ok=True)
        shutil.copyfile(path, args.figure)
    print(f"\nwrote {path} and train_step_{device}.csv")


if __name__ == "__main__":
    main()
