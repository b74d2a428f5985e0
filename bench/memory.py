"""Memory and time of one forward-gradient step against backprop: the lean engine beside the forward_ad one.

For each model and batch size, with float32 on one device:

* transient memory (peak bytes allocated during the call above what was live before; ``fgfw.lean.measure_peak``:
  torch's profiler memory events on the CPU, the allocator's peak statistics on a GPU) of a no_grad forward,
  a backprop step (forward + backward, gradients included) and each engine's directional derivative;
* step peak = parameters + optimizer state (one parameter-sized momentum, as AFGFW and FW-with-momentum keep)
  + the batch + the transient;
* tangent memory: the largest total size of tangents alive at once (the lean engine's are tracked with weak
  references; the forward_ad engine attaches a tangent to every parameter for the whole pass, so it holds all
  of them) against the largest layer's parameters;
* median time of each call;
* the lean engine with K = 1, 4, 16 tangents in one pass (``ENGINES["lean"].batched``) against K single passes.

Tangents come from the project's tangent stream (``fgfw._ops.fill_tangent_`` on the fastest backend), as the
optimizer draws them. Writes bench/memory.csv and bench/figures/memory_*.png.

    PYTHONPATH=python python bench/memory.py [--quick] [--device cpu|cuda]
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from fgfw import _ops
from fgfw.experiments import write_csv
from fgfw.forward_grad import ENGINES
from fgfw.lean import measure_peak
from fgfw.models import paper_mlp

HERE = Path(__file__).resolve().parent
ENGINE_NAMES = ("forward_ad", "lean")
KS = (1, 4, 16)


class TokenClassifier(nn.Module):
    """A small Transformer encoder that labels every token."""

    def __init__(self, features=32, dim=128, heads=4, layers=2, classes=10):
        super().__init__()
        self.embed = nn.Linear(features, dim)
        self.encoder = nn.Sequential(*(nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0, batch_first=True)
                                       for _ in range(layers)))
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        return self.head(self.encoder(self.embed(x))).flatten(0, 1)


def deep_mlp(depth=8, width=512):
    layers, fan_in = [], 784
    for _ in range(depth):
        layers += [nn.Linear(fan_in, width), nn.ReLU()]
        fan_in = width
    return nn.Sequential(*layers, nn.Linear(width, 10))


def small_cnn():
    return nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(64, 10))


def batch(name, size):
    if name.startswith("transformer"):
        seq = 256 if name == "transformer_4l" else 128
        return torch.randn(size, seq, 32), torch.randint(0, 10, (size * seq,))
    if name == "cnn":
        return torch.randn(size, 3, 32, 32), torch.randint(0, 10, (size,))
    return torch.randn(size, 784), torch.randint(0, 10, (size,))


MODELS = {"paper_net": paper_mlp, "deep_mlp": deep_mlp, "cnn": small_cnn, "transformer": TokenClassifier,
          # the larger shapes: 16 x 1024 MLP; 4-layer encoder, d = 256, sequence 256
          "deep_wide_mlp": lambda: deep_mlp(16, 1024),
          "transformer_4l": lambda: TokenClassifier(dim=256, layers=4)}
BATCHES = {"paper_net": (4096, 16384), "deep_mlp": (256, 2048), "cnn": (32, 128), "transformer": (4, 16),
           "deep_wide_mlp": (512, 4096), "transformer_4l": (2, 8)}
QUICK_BATCHES = {"paper_net": (1024,), "deep_mlp": (128,), "cnn": (8,), "transformer": (2,), "deep_wide_mlp": (128,),
                 "transformer_4l": (1,)}
DEFAULT_MODELS = ("paper_net", "deep_mlp", "cnn", "transformer")


class TangentSource:
    """make_tangent / make_tangents from the tangent stream, recording the most tangent bytes alive at once."""

    def __init__(self, params, backend):
        self.params, self.backend = params, backend
        self.offsets = [0]
        for p in params[:-1]:
            self.offsets.append(self.offsets[-1] + p.numel())
        self.live = self.most = 0

    def _track(self, u):
        self.live += u.nbytes
        self.most = max(self.most, self.live)
        weakref.finalize(u, self._release, u.nbytes)
        return u

    def _release(self, nbytes):
        self.live -= nbytes

    def one(self, j, tangent_id=0):
        p = self.params[j]
        return self._track(_ops.fill_tangent_(torch.empty_like(p), 0, 1, tangent_id, self.offsets[j], 0, self.backend))

    def stacked(self, k):
        def make(j):
            p = self.params[j]
            u = torch.empty((k, *p.shape), dtype=p.dtype, device=p.device)
            for i in range(k):
                _ops.fill_tangent_(u[i], 0, 1, i, self.offsets[j], 0, self.backend)
            return self._track(u)
        return make


def median_times(calls, repeats, device):
    """Median seconds per call, the calls interleaved round-robin so that a busy machine slows all alike."""
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def largest_layer_bytes(model):
    # the lean attention rule holds the in- and out-projection tangents together: one layer
    return max(sum(p.nbytes for p in m.parameters(recurse=isinstance(m, nn.MultiheadAttention)))
               for m in model.modules())


def run_case(name, size, device, repeats):
    torch.manual_seed(0)
    model = MODELS[name]().to(device)
    x, y = (t.to(device) for t in batch(name, size))
    params = list(model.parameters())
    backend = _ops.resolve_backend(None, device)
    closure = lambda: F.cross_entropy(model(x), y)
    param_bytes = sum(p.nbytes for p in params)
    static = 2 * param_bytes + x.nbytes  # parameters, one momentum, the batch

    def forward():
        with torch.no_grad():
            closure()

    def backprop():
        closure().backward()
        model.zero_grad(set_to_none=True)

    calls = {"no_grad_forward": forward, "backprop": backprop}
    sources = {}
    for engine in ENGINE_NAMES:
        sources[engine] = TangentSource(params, backend)
        calls[engine] = (lambda e=engine: ENGINES[e](model, params, sources[e].one, closure))
    for k in KS:
        sources[f"lean_k{k}"] = TangentSource(params, backend)
        calls[f"lean_k{k}"] = (lambda k=k: ENGINES["lean"].batched(model, params, sources[f"lean_k{k}"].stacked(k),
                                                                    closure, k))
    transients = {}
    for call, fn in calls.items():
        fn()  # warm-up
        transients[call] = measure_peak(fn, device)[1]
    seconds_of = median_times(calls, repeats, device)
    rows = []
    for call in calls:
        transient, seconds = transients[call], seconds_of[call]
        tangents = (param_bytes if call == "forward_ad" else sources[call].most) if call in sources else 0
        rows.append(dict(model=name, batch=size, call=call, transient_bytes=transient, peak_bytes=static + transient,
                         seconds=seconds, tangent_bytes=tangents, param_bytes=param_bytes,
                         largest_layer_bytes=largest_layer_bytes(model), batch_bytes=x.nbytes))
    return rows


def ratios(rows):
    """Per (model, batch) and engine: the four ratios the issue sets targets for."""
    by = {r["call"]: r for r in rows}
    out = []
    for engine in ENGINE_NAMES + tuple(f"lean_k{k}" for k in KS):
        r = by[engine]
        k = int(engine.split("_k")[1]) if "_k" in engine else 1
        out.append(dict(
            model=r["model"], batch=r["batch"], engine=engine, k=k,
            peak_vs_backprop=r["peak_bytes"] / by["backprop"]["peak_bytes"],
            transient_vs_forward=r["transient_bytes"] / max(1, by["no_grad_forward"]["transient_bytes"]),
            tangent_vs_largest_layer=r["tangent_bytes"] / r["largest_layer_bytes"],
            time_vs_backprop=r["seconds"] / by["backprop"]["seconds"],
            time_vs_k_lean_passes=r["seconds"] / (k * by["lean"]["seconds"])))
    return out


def plot(table, path_ratios, path_k):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = sorted({(r["model"], r["batch"]) for r in table}, key=lambda c: (list(MODELS).index(c[0]), c[1]))
    labels = [f"{m}\nB={b}" for m, b in cases]
    metrics = [("peak_vs_backprop", 0.5, "step peak / backprop step peak"),
               ("transient_vs_forward", 2.2, "transient / no_grad forward transient"),
               ("tangent_vs_largest_layer", 1.0, "tangent memory / largest layer params"),
               ("time_vs_backprop", 1.5, "time / backprop step time")]
    fig, axes = plt.subplots(len(metrics), 1, figsize=(max(8, 1.1 * len(cases)), 3.2 * len(metrics)))
    for ax, (key, target, title) in zip(axes, metrics):
        for i, engine in enumerate(ENGINE_NAMES):
            values = [next(r[key] for r in table if (r["model"], r["batch"]) == c and r["engine"] == engine)
                      for c in cases]
            ax.bar([j + (i - 0.5) * 0.38 for j in range(len(cases))], values, 0.38, label=engine)
        ax.axhline(target, color="k", ls="--", lw=1, label=f"target {target}")
        ax.set_yscale("log")
        ax.set_xticks(range(len(cases)), labels, fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path_ratios, dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for c, label in zip(cases, labels):
        rows = sorted((r for r in table if (r["model"], r["batch"]) == c and r["engine"].startswith("lean_k")),
                      key=lambda r: r["k"])
        ks = [r["k"] for r in rows]
        axes[0].plot(ks, [r["transient_vs_forward"] for r in rows], marker="o", label=label.replace("\n", " "))
        axes[1].plot(ks, [r["time_vs_k_lean_passes"] for r in rows], marker="o")
    axes[0].set(xscale="log", yscale="log", xlabel="K tangents in one pass", ylabel="transient / no_grad forward")
    axes[1].set(xscale="log", xlabel="K tangents in one pass", ylabel="time / (K single lean passes)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path_k, dpi=110)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="one small batch per model, one repeat")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(DEFAULT_MODELS),
                        help="models to measure (default: the four small ones; deep_wide_mlp and transformer_4l are "
                             "the issue's larger shapes, minutes each on a 2-core CPU)")
    parser.add_argument("--out", default=str(HERE / "memory.csv"))
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (on a shared CPU, 1 keeps OpenMP from spinning against others)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    batches = QUICK_BATCHES if args.quick else BATCHES
    repeats = 1 if args.quick else args.repeats

    measurements = []
    for name in args.models:
        for size in batches[name]:
            rows = run_case(name, size, device, repeats)
            measurements += rows
            for r in rows:
                print(f"{name:12s} B={size:<6d} {r['call']:16s} transient {r['transient_bytes'] / 2**20:9.2f} MiB  "
                      f"peak {r['peak_bytes'] / 2**20:9.2f} MiB  tangents {r['tangent_bytes'] / 2**20:7.3f} MiB  "
                      f"{r['seconds'] * 1e3:9.2f} ms", flush=True)
    table = [r for name in args.models for size in batches[name]
             for r in ratios([m for m in measurements if m["model"] == name and m["batch"] == size])]
    out = Path(args.out)
    write_csv(out, measurements)
    write_csv(out.with_name(out.stem + "_ratios.csv"), table)
    figures = HERE / "figures"
    figures.mkdir(exist_ok=True)
    plot(table, figures / f"{out.stem}_ratios.png", figures / f"{out.stem}_k.png")
    print(f"\n{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, device {device}")
    print("model        batch  engine       peak/bp  transient/fwd  tangent/layer  time/bp  time/(K lean)")
    for r in table:
        print(f"{r['model']:12s} {r['batch']:<6d} {r['engine']:12s} {r['peak_vs_backprop']:7.3f}  "
              f"{r['transient_vs_forward']:13.2f}  {r['tangent_vs_largest_layer']:13.3f}  "
              f"{r['time_vs_backprop']:7.2f}  {r['time_vs_k_lean_passes']:13.2f}")


if __name__ == "__main__":
    main()
