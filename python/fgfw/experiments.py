"""Training runs shared by the demo and the paper reproduction: one method, one seed, one history.

:data:`PRESETS` holds the settings the reproduction offers: ``"paper"`` (Section V of the paper, read
literally) and ``"tuned"`` (what trains on this network; see bench/RESULTS.md for the sweeps behind it).
"""
from __future__ import annotations

import csv
import math
import resource
import sys
import time
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from .constraints import L1Ball
from .forward_grad import DEFAULT_ENGINE
from .optim import AFGFW, FGFW, FrankWolfe

METHODS = ("fw", "fgfw", "afgfw", "adam", "sgd")
FORWARD_GRADIENT_METHODS = ("fgfw", "afgfw")
UNCONSTRAINED_METHODS = ("adam", "sgd")

# Section V: "l1-norm constraint on the parameters in all layers, whose bound is set at 1e-4";
# Algorithm 2 with gamma_k = 1/sqrt(k), alpha_k = 1/k; Algorithm 1 (and the FW baseline, whose step the
# paper does not state) with the standard alpha_k = 2/(k+2); k counts steps; one Gaussian tangent.
PAPER = {
    "fw": dict(radius="1e-4", scope="tensor", step_size="2/(k+2)"),
    "fgfw": dict(radius="1e-4", scope="tensor", step_size="2/(k+2)"),
    "afgfw": dict(radius="1e-4", scope="tensor", step_size="1/k", averaging_weight="1/sqrt(k)"),
    "adam": dict(lr=1e-3),
    "sgd": dict(lr=0.05, momentum=0.9),
}
# What trains the paper's 784-10-10-10-10-10 network (sweeps in bench/RESULTS.md): one L1 ball per
# unit (scope "row") of 5x the unit's initial L1 norm, so the dense initialisation is feasible and every
# unit keeps learning; small steps decayed linearly over the run ("linear:a" = a * (1 - k/K), see
# LinearDecay). The forward-gradient methods use the activity-perturbed estimator (fgfw.activity) with 16
# tangents per step carried through one pass: the paper's weight-perturbed estimate has ~sqrt(8,290)
# noise per coordinate and leaves AFGFW at ~55 % (the "weight" columns in bench/RESULTS.md).
_FORWARD = dict(radius="init:5", scope="row", step_size="linear:0.004", num_tangents=16, estimator="activity",
                tangents_in_one_pass=True)
TUNED = {
    "fw": dict(radius="init:5", scope="row", step_size="linear:0.004", momentum=0.9),
    "fgfw": dict(_FORWARD),
    "afgfw": dict(_FORWARD, averaging_weight=0.1),
    "adam": dict(lr=1e-3),
    "sgd": dict(lr=0.05, momentum=0.9),
}
PRESETS = {"paper": PAPER, "tuned": TUNED}


def parse_radius(spec: str | float, scope: str = "tensor") -> L1Ball:
    """``"init:2"`` -> 2 x the initial L1 norm (per ball); a number -> that radius."""
    if isinstance(spec, str) and spec.startswith("init:"):
        return L1Ball.relative_to_init(float(spec.split(":", 1)[1]), scope=scope)
    try:
        radius = float(spec)
    except (TypeError, ValueError):
        raise ValueError(f"radius must be a number or 'init:SCALE' (SCALE x the initial L1 norm), got {spec!r}") from None
    return L1Ball(radius=radius, scope=scope)


class LinearDecay:
    """alpha_k = alpha_0 * max(1 - k / total_steps, floor): a constant step decayed linearly over the run.

    A Frank-Wolfe step both moves towards the vertex and shrinks every weight by (1 - alpha_k); with a
    constant alpha the last steps' vertices stay visible as jitter in the weights. Decaying alpha_k
    averages them out (on the paper's MNIST network: +2 to +3 points of test accuracy for FW, see
    bench/RESULTS.md). Like any callable schedule, ``state_dict`` records it by name only; an optimizer
    built with the same schedule takes it back on ``load_state_dict``.
    """

    def __init__(self, initial: float, total_steps: int, floor: float = 0.02):
        if not (0 < initial <= 1):
            raise ValueError(f"the initial step of a linear decay must be in (0, 1], got {initial!r}")
        if total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {total_steps!r}")
        self.initial, self.total_steps, self.floor = float(initial), int(total_steps), float(floor)

    def __call__(self, k: int) -> float:
        return self.initial * max(1.0 - k / self.total_steps, self.floor)

    def __repr__(self) -> str:
        return f"linear:{self.initial:g}"


def parse_schedule(spec: str | float | None, total_steps: int | None = None):
    """A schedule from the command line or a preset.

    A name (``"1/k"``) stays a name, ``"0.002"`` becomes a number, ``"linear:0.004"`` a
    :class:`LinearDecay` from 0.004 over ``total_steps``.
    """
    if spec is None or not isinstance(spec, str):
        return spec
    if spec.startswith("linear:"):
        if total_steps is None:
            raise ValueError(f"schedule {spec!r} needs the run's number of steps")
        try:
            return LinearDecay(float(spec.split(":", 1)[1]), total_steps)
        except ValueError as err:
            raise ValueError(f"schedule {spec!r}: {err}") from None
    try:
        return float(spec)
    except ValueError:
        return spec


@dataclass
class RunConfig:
    method: str
    epochs: int = 20
    batch_size: int = 64
    radius: str | float = "init:2"
    scope: str = "tensor"
    step_size: str | float | None = None  # None: the optimizer's own (paper) default
    averaging_weight: str | float | None = None
    momentum: float | None = None
    num_tangents: int = 1
    tangent: str = "gaussian"
    estimator: str = "weight"  # FGFW / AFGFW: "weight" (the paper's) or "activity" (fgfw.activity)
    tangents_in_one_pass: bool = False
    seed: int = 0
    backend: str | None = None
    engine: str | None = None  # forward-mode engine (fgfw.forward_grad.ENGINES); None: the default
    lr: float | None = None  # Adam / SGD only
    device: str = "cpu"

    def describe(self) -> dict:
        """The settings that apply to this method (JSON-ready; engine None = the default, named)."""
        keys = {"method", "epochs", "batch_size", "seed", "device"}
        if self.method in UNCONSTRAINED_METHODS:
            keys |= {"lr"} | ({"momentum"} if self.method == "sgd" else set())
        else:
            keys |= {"radius", "scope", "step_size", "backend"}
            if self.method == "fw":
                keys |= {"momentum"}
            else:
                keys |= {"num_tangents", "tangent", "estimator", "tangents_in_one_pass"}
                keys |= {"engine"} if self.estimator == "weight" else set()
            keys |= {"averaging_weight"} if self.method == "afgfw" else set()
        settings = {k: v for k, v in asdict(self).items() if k in keys and v is not None}
        if "engine" in keys and self.engine is None:
            settings["engine"] = DEFAULT_ENGINE
        return settings


def config_from_preset(method: str, preset: str, **overrides) -> RunConfig:
    """The preset's settings for ``method``, with every override that is not None applied on top."""
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    cfg = replace(RunConfig(method), **PRESETS[preset][method])
    return replace(cfg, **{k: v for k, v in overrides.items() if v is not None})


def build_optimizer(cfg: RunConfig, model: nn.Module, steps_per_epoch: int = 1):
    """The optimizer ``cfg`` asks for; ``steps_per_epoch`` sizes the "linear:" schedules."""
    if cfg.method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {cfg.method!r}")
    if cfg.method == "adam":
        return torch.optim.Adam(model.parameters(), lr=cfg.lr or 1e-3)
    if cfg.method == "sgd":
        return torch.optim.SGD(model.parameters(), lr=cfg.lr or 0.05, momentum=cfg.momentum or 0.0)
    constraint = parse_radius(cfg.radius, cfg.scope)
    total = cfg.epochs * steps_per_epoch
    schedule = {} if cfg.step_size is None else {"step_size": parse_schedule(cfg.step_size, total)}
    if cfg.method == "fw":
        return FrankWolfe(model.parameters(), constraint=constraint, momentum=cfg.momentum, backend=cfg.backend,
                          **schedule)
    common = dict(constraint=constraint, seed=cfg.seed, tangent=cfg.tangent, num_tangents=cfg.num_tangents,
                  engine=cfg.engine, backend=cfg.backend, estimator=cfg.estimator,
                  tangents_in_one_pass=cfg.tangents_in_one_pass, **schedule)
    if cfg.method == "fgfw":
        return FGFW(model, **common)
    if cfg.averaging_weight is not None:
        common["averaging_weight"] = parse_schedule(cfg.averaging_weight, total)
    return AFGFW(model, **common)


def write_csv(path, rows: list[dict]) -> None:
    """``rows`` as CSV with a header; the columns are every key in order of first appearance."""
    fields = list(dict.fromkeys(k for row in rows for k in row))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) on (x, y)."""
    logits = model(x)
    return float(F.cross_entropy(logits, y)), float((logits.argmax(1) == y).double().mean())


def zero_count(model: nn.Module) -> tuple[int, int]:
    """(exactly-zero parameters, all parameters)."""
    params = [p.detach() for p in model.parameters()]
    return int(sum(int((p == 0).sum()) for p in params)), int(sum(p.numel() for p in params))


def peak_memory_mib(device: torch.device) -> float:
    """Peak memory so far: the CUDA allocator's peak on a GPU, else the process's peak RSS (never reset)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes on macOS, KiB on Linux


def train(cfg: RunConfig, model: nn.Module, train_data, test_data, progress=None, on_epoch=None) -> list[dict]:
    """Trains ``model`` in place; returns one record per epoch (epoch 0 is the initial model).

    Each record: train_loss (mean minibatch loss over the epoch; at epoch 0 the loss on the training
    set), test_loss, test_accuracy, fw_gap (mean over the epoch's steps of the optimizer's Frank-Wolfe
    gap estimate ``<d, theta - s>``; None for Adam/SGD), zeros / zero_fraction (exactly-zero parameters),
    wall_time_s (training time so far, evaluation excluded) and peak_memory_mib (see
    :func:`peak_memory_mib`). ``progress``, if given, gets ``update(1)`` after every step; ``on_epoch``, if
    given, gets each training epoch's record as soon as it is made (the demo's progress lines).
    """
    device = torch.device(cfg.device)
    torch.manual_seed(cfg.seed)
    model.to(device)
    x_train, y_train = (t.to(device) for t in train_data)
    opt = build_optimizer(cfg, model, steps_per_epoch=-(-len(y_train) // cfg.batch_size))
    test_data = tuple(t.to(device) for t in test_data)
    batches = torch.Generator().manual_seed(cfg.seed)
    # the activity estimator needs each example's loss (it minimises their mean)
    reduction = "none" if cfg.estimator == "activity" else "mean"
    history = []

    def record(epoch, train_loss, gap, elapsed):
        test_loss, test_acc = evaluate(model, *test_data)
        zeros, total = zero_count(model)
        history.append(dict(method=cfg.method, seed=cfg.seed, epoch=epoch, train_loss=train_loss,
                            test_loss=test_loss, test_accuracy=test_acc, fw_gap=gap, zeros=zeros,
                            zero_fraction=zeros / total, wall_time_s=elapsed,
                            peak_memory_mib=peak_memory_mib(device)))

    record(0, evaluate(model, x_train, y_train)[0], None, 0.0)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    elapsed = 0.0
    for epoch in range(1, cfg.epochs + 1):
        start = time.perf_counter()
        order = torch.randperm(len(y_train), generator=batches).to(device)
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        gap_sum = torch.zeros((), dtype=torch.float64, device=device)
        steps = 0
        for i in range(0, len(order), cfg.batch_size):
            idx = order[i:i + cfg.batch_size]
            x, y = x_train[idx], y_train[idx]
            if cfg.method in FORWARD_GRADIENT_METHODS:
                loss = opt.step(lambda: F.cross_entropy(model(x), y, reduction=reduction))
            else:
                opt.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
            # accumulated on the device: no host synchronisation per step
            loss_sum += loss.detach().double() * len(idx)
            gap = getattr(opt, "last_gap", None)
            if gap is not None:
                gap_sum += gap.to(device)
            steps += 1
            if progress is not None:
                progress.update(1)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed += time.perf_counter() - start
        mean_loss = float(loss_sum) / len(y_train)
        if not math.isfinite(mean_loss):
            raise FloatingPointError(f"{cfg.method} (seed {cfg.seed}): the training loss became {mean_loss} in epoch "
                                     f"{epoch}; lower the step size")
        record(epoch, mean_loss, None if cfg.method in UNCONSTRAINED_METHODS else float(gap_sum) / steps, elapsed)
        if on_epoch is not None:
            on_epoch(history[-1])
    return history


def summarize(histories: list[list[dict]]) -> dict[str, list[dict]]:
    """Per method and epoch: mean, sample standard deviation, min and max over seeds of each metric."""
    by_method: dict[str, list[list[dict]]] = {}
    for rows in histories:
        by_method.setdefault(rows[0]["method"], []).append(rows)
    summary = {}
    for method, runs in by_method.items():
        epochs = min(len(r) for r in runs)
        summary[method] = []
        for e in range(epochs):
            row = {"epoch": runs[0][e]["epoch"], "seeds": len(runs)}
            for key in ("train_loss", "test_loss", "test_accuracy", "fw_gap", "zeros", "zero_fraction",
                        "wall_time_s", "peak_memory_mib"):
                values = [r[e][key] for r in runs if r[e][key] is not None]
                if not values:
                    continue
                mean = sum(values) / len(values)
                std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
                row.update({f"{key}_mean": mean, f"{key}_std": std, f"{key}_min": min(values),
                            f"{key}_max": max(values)})
            summary[method].append(row)
    return summary
