"""Training at inference memory on real models (issue 23): fgfw's steps against MeZO and backprop.

Models, random init (nothing is downloaded), float32 on the CPU, bfloat16 in the GPU presets:

* ``resnet18``: torchvision's ResNet-18, 10 classes, 3 x 32 x 32 images, BatchNorm in train mode;
* ``gpt2``: Hugging Face ``GPT2LMHeadModel`` (the issue's 4 layers x 256, vocabulary 1,000: 3.5 M parameters);
* ``llama``: Hugging Face ``LlamaForCausalLM`` of the same size (4 x 256, SwiGLU 688, RMSNorm, rotary positions);
* GPU presets: ``gpt2_124m`` (12 x 768, vocabulary 50,257: GPT-2 small's shape) and ``llama_1b``
  (16 x 2048, SwiGLU 5,632, vocabulary 32,000: 0.95 B parameters); preset ``gpt2`` (float32 unless ``--dtype``):
  GPT-2 small at batch 8 x 512 (``gpt2_s512``) and 2 x 2048 (``gpt2_s2048``), issue 30's comparison, whose
  ``inference``, ``afgfw_lean_k1`` and ``afgfw_activity`` are this script's ``forward``, ``afgfw_lean`` and
  ``afgfw_activity_recompute``.

The language models take random tokens and the next-token cross-entropy; dropout is 0 and the KV cache
off (MeZO's two forwards and ``recompute_inputs`` need a deterministic closure). One step of each method:

=========================  ===========================================================================
``forward``                the loss under ``torch.no_grad()``: the yardstick of time and memory
``adam``                   ``torch.optim.Adam``, forward + backward
``backprop_adamw``         ``torch.optim.AdamW(fused=True)``, forward + backward (issue 30's yardstick)
``frankwolfe``             ``fgfw.FrankWolfe``, momentum 0.9, forward + backward: the backprop reference
``frankwolfe_ckpt``        the same with activation checkpointing (``torch.utils.checkpoint`` around each
                           Transformer block / residual block; non-reentrant)
``afgfw_lean``             ``fgfw.AFGFW``, the paper's weight estimator, lean engine, K = 1
``afgfw_lean_k4``          the same, K = 4 tangents in one pass (K passes where BatchNorm in train mode
                           forbids one)
``afgfw_forward_ad``       the weight estimator on torch's stock forward AD (``engine="forward_ad"``)
``afgfw_activity``         ``estimator="activity"`` (tangents on every layer's output), K = 1
``afgfw_activity_recompute``  the same with ``recompute_inputs=True`` (one more plain forward)
``mezo``                   ``bench/mezo.py``: two forwards at theta +- eps z, z drawn again from a seed
=========================  ===========================================================================

The fgfw optimizers take one L1 ball per row, ``relative_to_init(2)`` (README's setting; zero-initialised
tensors take the radius rule of draws of their module's initialisation or its unit-L2 stand-in).

How memory is measured
----------------------
Every case runs in a fresh Python process (``--case``), ``--rounds`` times round robin (every case once,
then every case again): build the model and the batch, run one no_grad forward (the one-time
initialisation every method shares), then take the baseline; build the optimizer, run one warm-up step
and one more step. "Memory above the weights" = peak - baseline: the
optimizer's state, the step's activations, tangents, gradients and workspaces, and any initialisation a
method adds beyond an inference forward (code and tables paged in at its first step). "Transient" = the
peak of the timed steps above what was held after the warm-up step: the step's own working memory,
without the state and the one-time initialisation.

* CPU: the process's resident set (``/proc/self/statm``) is the baseline; the peak RSS (VmHWM) is reset
  through ``/proc/self/clear_refs`` (Linux >= 4.0). glibc is told to serve every block of 64 KiB or more
  by mmap (``MALLOC_MMAP_THRESHOLD_=65536``), so freed memory leaves the process and cannot hide a peak.
  One torch thread (``--threads``).
* GPU: the caching allocator's ``memory_allocated()`` is the baseline and ``max_memory_allocated()`` the
  peak.

A case's memory is the largest of its rounds'.

How time is measured
--------------------
On the CPU (``--timing round-robin``) one more fresh process per model, with glibc's default allocator
settings (returning every block to the system would make each step pay its page faults again),
holds every method on its own copy of the model and times ``--repeats`` steps of each, interleaved
(one step of every method, then again), after one warm-up step each: load from other work on a shared
machine falls on all methods alike. The time is the median. On a GPU (``--timing per-case``) each
memory case times ``--repeats`` steps itself (CUDA synchronised): ten copies of a 1 B model do not fit.
Ratios are taken against ``forward``, ``frankwolfe`` (one backprop step) and ``mezo``.

    python bench/real_models.py                                   # CPU sizes; bench/results, bench/figures
    python bench/real_models.py --preset gpu --device cuda        # the GPU presets, bfloat16
    python bench/real_models.py --models gpt2 --methods forward,frankwolfe,mezo,afgfw_lean --rounds 1

Writes ``<name>.csv`` into ``--out`` and ``<name>.png`` into ``--figures`` (``--name``, default
``real_models_<preset>``).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from mezo import MeZO  # noqa: E402
from train_step import _hwm_bytes, _reset_hwm, _rss_bytes  # noqa: E402  (process memory, one definition)

METHODS = ("forward", "adam", "backprop_adamw", "frankwolfe", "frankwolfe_ckpt", "afgfw_lean", "afgfw_lean_k4", "afgfw_forward_ad",
           "afgfw_activity", "afgfw_activity_recompute", "mezo")
FGFW_OPTIONS = {  # AFGFW's keyword arguments per method
    "afgfw_lean": dict(engine="lean"),
    "afgfw_lean_k4": dict(engine="lean", num_tangents=4, tangents_in_one_pass=True),
    "afgfw_forward_ad": dict(engine="forward_ad"),
    "afgfw_activity": dict(estimator="activity"),
    "afgfw_activity_recompute": dict(estimator="activity", recompute_inputs=True),
}

# name -> (kind, architecture, batch size, sequence length or image side); per preset
PRESETS = {
    "cpu": {
        "resnet18": ("resnet", {}, 64, 32),
        "gpt2": ("gpt2", dict(n_layer=4, n_embd=256, n_head=4, vocab_size=1000), 16, 256),
        "llama": ("llama", dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=4, intermediate_size=688,
                                vocab_size=1000), 16, 256),
    },
    "gpu": {
        "gpt2_124m": ("gpt2", dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257), 8, 1024),
        "llama_1b": ("llama", dict(num_hidden_layers=16, hidden_size=2048, num_attention_heads=16,
                                   intermediate_size=5632, vocab_size=32000), 4, 1024),
    },
    # issue 30's GPU comparison: GPT-2 small, float32 by default, 4,096 tokens per batch at sequence 512 and 2048
    "gpt2": {
        "gpt2_s512": ("gpt2", dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=2048), 8, 512),
        "gpt2_s2048": ("gpt2", dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=2048), 2, 2048),
    },
    "tiny": {  # the smoke test's
        "resnet18": ("resnet", {}, 2, 32),
        "gpt2": ("gpt2", dict(n_layer=1, n_embd=32, n_head=2, vocab_size=64), 2, 16),
        "llama": ("llama", dict(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                                vocab_size=64), 2, 16),
    },
}


# -- models ------------------------------------------------------------------------------------------------------------
class Checkpointed(nn.Module):
    """A block whose activations are recomputed in the backward pass instead of kept."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


def build_model(kind: str, arch: dict, length: int) -> nn.Module:
    if kind == "resnet":
        import torchvision
        return torchvision.models.resnet18(num_classes=10)
    if kind == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel
        # arch may set n_positions above the sequence length (preset gpt2's 2048, GPT-2 small's 1024)
        config = GPT2Config(**{"n_positions": length, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
                               "use_cache": False, "bos_token_id": 0, "eos_token_id": 0, **arch})
        return GPT2LMHeadModel(config)
    from transformers import LlamaConfig, LlamaForCausalLM
    # as many key/value heads as query heads: grouped-query attention would route around the lean attention rule
    config = LlamaConfig(max_position_embeddings=length, num_key_value_heads=arch["num_attention_heads"],
                         attention_dropout=0.0, use_cache=False, tie_word_embeddings=False, bos_token_id=0,
                         eos_token_id=0, pad_token_id=None, **arch)
    return LlamaForCausalLM(config)


def enable_checkpointing(model: nn.Module, kind: str) -> None:
    if kind == "resnet":
        for name in ("layer1", "layer2", "layer3", "layer4"):
            layer = getattr(model, name)
            for i, block in enumerate(layer):
                layer[i] = Checkpointed(block)
    else:  # Hugging Face wraps each decoder block in torch.utils.checkpoint.checkpoint
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def make_batch(kind: str, arch: dict, batch: int, length: int, device, dtype):
    g = torch.Generator().manual_seed(1)
    if kind == "resnet":
        return (torch.randn(batch, 3, length, length, generator=g).to(device, dtype),
                torch.randint(0, 10, (batch,), generator=g).to(device))
    tokens = torch.randint(0, arch["vocab_size"], (batch, length + 1), generator=g).to(device)
    return tokens[:, :-1], tokens[:, 1:]


def make_loss(model: nn.Module, kind: str, x, y, per_example: bool):
    """The closure's loss: the mean cross-entropy, or each example's (the activity estimator's closure)."""
    reduction = "none" if per_example else "mean"
    if kind == "resnet":
        return lambda: F.cross_entropy(model(x), y, reduction=reduction)
    extra = {}
    if per_example and kind == "gpt2":
        # GPT-2 embeds the positions once for the batch, (1, T, d); the activity estimator takes batch-first
        # layer outputs only, so its cases give every example its positions
        extra["position_ids"] = torch.arange(x.shape[1], device=x.device).expand_as(x)

    def loss():
        logits = model(input_ids=x, **extra).logits
        ce = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction=reduction)
        return ce.view(x.shape).mean(1) if per_example else ce
    return loss


# -- one case, in its own process --------------------------------------------------------------------------------------
def make_step(method: str, model: nn.Module, kind: str, x, y):
    """(step function, optimizer or None) of one method on ``model``."""
    import fgfw

    if method == "forward":
        closure = make_loss(model, kind, x, y, False)

        def step():
            with torch.no_grad():
                return closure()
        return step, None
    if method in ("adam", "backprop_adamw", "frankwolfe", "frankwolfe_ckpt"):
        if method == "frankwolfe_ckpt":
            enable_checkpointing(model, kind)
        closure = make_loss(model, kind, x, y, False)
        if method == "adam":
            opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        elif method == "backprop_adamw":  # issue 30's yardstick: backprop + torch.optim.AdamW(fused=True)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        else:
            opt = fgfw.FrankWolfe(model, constraint=fgfw.L1Ball.relative_to_init(2.0, scope="row"), step_size=1e-3,
                                  momentum=0.9)

        def step():
            loss = closure()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)  # the gradients are the step's memory, as the tangents are AFGFW's
            return loss.detach()
        return step, opt
    if method == "mezo":
        closure = make_loss(model, kind, x, y, False)
        opt = MeZO(model.parameters(), lr=1e-6, eps=1e-3, seed=0)
        return (lambda: opt.step(closure)), opt
    options = dict(FGFW_OPTIONS[method])
    if options.get("tangents_in_one_pass") and fgfw.activity.couples_examples(model):
        options["tangents_in_one_pass"] = False  # BatchNorm in train mode updates buffers: K passes
    closure = make_loss(model, kind, x, y, options.get("estimator") == "activity")
    opt = fgfw.AFGFW(model, constraint=fgfw.L1Ball.relative_to_init(2.0, scope="row"), step_size=1e-3,
                     averaging_weight=0.1, seed=0, **options)
    return (lambda: opt.step(closure)), opt


def state_bytes(opt) -> int:
    """Bytes of the optimizer's tensors kept between steps (Adam's moments, fgfw's momentum and master copies)."""
    if opt is None or not hasattr(opt, "state"):
        return 0
    return sum(t.nbytes for s in opt.state.values() for t in s.values()
               if isinstance(t, torch.Tensor) and t.numel() > 1)


def setup(preset: str, model_name: str, device: str, dtype: str, threads: int | None):
    """(kind, model, x, y, sync) of a case: the model as seed 0 initialises it, its batch."""
    if threads:
        torch.set_num_threads(threads)
    kind, arch, batch, length = PRESETS[preset][model_name]
    dev, dt = torch.device(device), getattr(torch, dtype)
    torch.manual_seed(0)
    with dev:
        model = build_model(kind, arch, length).to(dt)
    model.train()
    x, y = make_batch(kind, arch, batch, length, dev, dt)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    return kind, model, x, y, sync


def describe(preset: str, model_name: str, model: nn.Module, dtype: str) -> dict:
    _, _, batch, length = PRESETS[preset][model_name]
    return dict(preset=preset, model=model_name, batch=batch, length=length, dtype=dtype,
                parameters=sum(p.numel() for p in model.parameters()),
                weights_mib=sum(p.nbytes for p in model.parameters()) / 2**20)


def run_case(preset: str, model_name: str, method: str, device: str, dtype: str, steps: int,
             threads: int | None) -> dict:
    """Memory (and the median time of ``steps`` steps after a warm-up one) of one method, in this process."""
    kind, model, x, y, sync = setup(preset, model_name, device, dtype, threads)
    dev = torch.device(device)
    with torch.no_grad():  # what every method shares: one inference forward's initialisation
        make_loss(model, kind, x, y, False)()
    gc.collect()
    sync()
    if dev.type == "cuda":
        baseline = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    else:
        baseline = _rss_bytes()
        _reset_hwm()
    step, opt = make_step(method, model, kind, x, y)
    step()  # warm-up: lazily made state and kernels
    sync()
    if dev.type == "cuda":
        first_peak, settled = torch.cuda.max_memory_allocated(dev), torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    else:
        first_peak, settled = _hwm_bytes(), _rss_bytes()
        _reset_hwm()
    times = []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else _hwm_bytes()
    return dict(describe(preset, model_name, model, dtype), method=method,
                above_weights_mib=max(first_peak - baseline, peak - baseline, 0) / 2**20,
                transient_mib=max(peak - settled, 0) / 2**20, state_mib=state_bytes(opt) / 2**20,
                baseline_mib=baseline / 2**20, time_s=statistics.median(times))


def run_timing(preset: str, model_name: str, methods: list[str], device: str, dtype: str, repeats: int,
               threads: int | None) -> dict:
    """Median seconds per step of every method, in ONE process, the steps interleaved round robin (each method
    on its own copy of the model): load from other work on a shared machine falls on all methods alike."""
    import copy

    kind, model, x, y, sync = setup(preset, model_name, device, dtype, threads)
    steps = {method: make_step(method, copy.deepcopy(model), kind, x, y)[0] for method in methods}
    for step in steps.values():  # warm-up
        step()
    times = {method: [] for method in methods}
    for _ in range(repeats):
        for method, step in steps.items():
            sync()
            start = time.perf_counter()
            step()
            sync()
            times[method].append(time.perf_counter() - start)
    return {method: statistics.median(t) for method, t in times.items()}


def spawn(spec: dict, args, memory: bool):
    """One case (``memory``) or the round-robin timing in a fresh process; its JSON result."""
    env = dict(os.environ)
    if memory:
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"  # freed blocks leave the process: RSS follows what is live
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    flag = "--case" if memory else "--timing-case"
    result = subprocess.run([sys.executable, os.path.abspath(__file__), flag, json.dumps(spec)], env=env,
                            capture_output=True, text=True, timeout=args.case_timeout)
    if result.returncode != 0:
        raise RuntimeError(f"{flag} {spec} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


# -- the table and the plot --------------------------------------------------------------------------------------------
def summarise(runs: list[dict], timing: dict[str, dict[str, float]] | None) -> list[dict]:
    """One row per (model, method): memory the largest of the rounds' (and the smallest, to show the spread);
    time from the round-robin ``timing`` where given, else the median of the cases' own medians; ratios
    against forward, frankwolfe (one backprop step) and mezo of the same model."""
    rows = {}
    for r in runs:
        key = (r["model"], r["method"])
        row = rows.setdefault(key, dict(r, rounds=0, memory_min_mib=r["above_weights_mib"], times=[]))
        row["rounds"] += 1
        for k in ("above_weights_mib", "transient_mib"):
            row[k] = max(row[k], r[k])
        row["memory_min_mib"] = min(row["memory_min_mib"], r["above_weights_mib"])
        row["times"].append(r["time_s"])
    for (model, method), row in rows.items():
        times = row.pop("times")
        row["time_s"] = timing[model][method] if timing else statistics.median(times)
    for (model, method), row in rows.items():
        for ref in ("forward", "frankwolfe", "mezo"):
            other = rows.get((model, ref))
            if other:
                row[f"memory_vs_{ref}"] = row["above_weights_mib"] / max(other["above_weights_mib"], 1e-9)
                row[f"time_vs_{ref}"] = row["time_s"] / other["time_s"]
    return list(rows.values())


def print_table(rows: list[dict]) -> None:
    print(f"{'model':<10} {'method':<25} {'MiB above w.':>12} {'(min)':>7} {'state':>7} {'trans.':>7} {'x fwd':>7} "
          f"{'x bp':>6} {'x MeZO':>7} {'time s':>8} {'t x fwd':>8} {'t x bp':>7}")
    for r in rows:
        ratios = "".join(f" {r[k]:{w}.2f}" if k in r else f" {'':>{w}}" for k, w in
                         (("memory_vs_forward", 7), ("memory_vs_frankwolfe", 6), ("memory_vs_mezo", 7)))
        times = "".join(f" {r[k]:{w}.2f}" if k in r else f" {'':>{w}}" for k, w in
                        (("time_vs_forward", 8), ("time_vs_frankwolfe", 7)))
        print(f"{r['model']:<10} {r['method']:<25} {r['above_weights_mib']:12.1f} {r['memory_min_mib']:7.1f} "
              f"{r['state_mib']:7.1f} {r['transient_mib']:7.1f}{ratios} {r['time_s']:8.3f}{times}", flush=True)


def plot(path: str, rows: list[dict], title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    index = {(r["model"], r["method"]): r for r in rows}
    fig, axes = plt.subplots(2, 1, figsize=(max(9, 1.6 * len(models) * len(methods) / 4), 7.5), sharex=True)
    width = 0.85 / len(methods)
    for ax, key, label in ((axes[0], "above_weights_mib", "peak memory above the weights (MiB)"),
                           (axes[1], "time_vs_forward", "time per step / one no_grad forward")):
        for j, method in enumerate(methods):
            values = [index[(m, method)].get(key, 0) if (m, method) in index else 0 for m in models]
            ax.bar([i + (j - (len(methods) - 1) / 2) * width for i in range(len(models))],
                   [max(v, 1e-2) for v in values], width, label=method)
        ax.set(yscale="log", ylabel=label)
        ax.grid(alpha=0.3, axis="y")
    axes[0].set_title(title, fontsize=10)
    axes[0].legend(fontsize=7, ncol=min(5, len(methods)))
    axes[1].set_xticks(range(len(models)), models)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def machine(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name()
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{name}, {os.cpu_count()} cores"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", help=argparse.SUPPRESS)  # internal: one memory case, printed as JSON
    parser.add_argument("--timing-case", help=argparse.SUPPRESS)  # internal: the round-robin timing of a model
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="float32, but bfloat16 for preset gpu on a GPU, by default")
    parser.add_argument("--models", default=None, help="comma-separated (default: every model of the preset)")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated from {','.join(METHODS)}")
    parser.add_argument("--timing", choices=("round-robin", "per-case"), default=None,
                        help="round-robin (the CPU's default): one process times every method's steps interleaved; "
                             "per-case (a GPU's default): each memory case times its own steps")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per method (after one warm-up step)")
    parser.add_argument("--rounds", type=int, default=2, help="fresh processes per memory case, round robin")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of a case process (0: torch's default)")
    parser.add_argument("--case-timeout", type=float, default=1200, help="seconds before a case process is stopped")
    parser.add_argument("--name", default=None, help="output file stem (default: real_models_<preset>)")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--figures", default=os.path.join(HERE, "figures"))
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(**json.loads(args.case))))
        return
    if args.timing_case:
        print(json.dumps(run_timing(**json.loads(args.timing_case))))
        return
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") and args.preset == "gpu" else "float32")
    args.timing = args.timing or ("per-case" if args.device.startswith("cuda") else "round-robin")
    models = args.models.split(",") if args.models else list(PRESETS[args.preset])
    methods = args.methods.split(",")
    unknown = [m for m in models if m not in PRESETS[args.preset]] + [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"unknown model or method {unknown}; preset {args.preset!r} has models "
                     f"{sorted(PRESETS[args.preset])}, methods are {list(METHODS)}")

    from fgfw.experiments import write_csv

    common = dict(preset=args.preset, device=args.device, dtype=args.dtype, threads=args.threads)
    per_case = args.timing == "per-case"
    runs, timing = [], {}
    for model_name in models:
        for round_ in range(args.rounds):
            for method in methods:
                runs.append(spawn(dict(common, model_name=model_name, method=method,
                                       steps=args.repeats if per_case else 1), args, memory=True))
                print(f"  memory, round {round_ + 1}: {model_name} {method}: "
                      f"{runs[-1]['above_weights_mib']:.1f} MiB above the weights", file=sys.stderr, flush=True)
        if not per_case:
            timing[model_name] = spawn(dict(common, model_name=model_name, methods=methods, repeats=args.repeats),
                                       args, memory=False)
            print(f"  time, round robin: {model_name}: " + ", ".join(
                f"{m} {t * 1e3:.0f} ms" for m, t in timing[model_name].items()), file=sys.stderr, flush=True)
    rows = summarise(runs, timing or None)
    where = machine(args.device)
    threads = f"{args.threads} thread(s)" if args.threads else "torch's default threads"
    print(f"\n{where}; {threads}; torch {torch.__version__}; {args.dtype}; preset {args.preset}; memory: "
          f"{args.rounds} fresh process(es) per case; time: {args.timing}, median of {args.repeats} steps\n")
    print_table(rows)
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.figures, exist_ok=True)
    name = args.name or f"real_models_{args.preset}"
    write_csv(os.path.join(args.out, f"{name}.csv"), rows)
    plot(os.path.join(args.figures, f"{name}.png"), rows,
         f"one training step, {args.dtype}, {where}, {threads}")


if __name__ == "__main__":
    main()
