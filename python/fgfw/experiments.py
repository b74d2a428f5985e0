"""Training runs shared by the demo and the paper reproduction: one method, one seed, one history."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .constraints import L1Ball
from .optim import AFGFW, FGFW, FrankWolfe

METHODS = ("fw", "fgfw", "afgfw", "adam")


def parse_radius(spec: str | float, scope: str = "tensor") -> L1Ball:
    """``"init:2"`` -> 2 x the initial L1 norm (per tensor or global); a number -> that radius."""
    if isinstance(spec, str) and spec.startswith("init:"):
        return L1Ball.relative_to_init(float(spec.split(":", 1)[1]), scope=scope)
    return L1Ball(radius=float(spec), scope=scope)


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
    seed: int = 0
    backend: str | None = None
    extra: dict = field(default_factory=dict)

    def describe(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None and v != {}}


def build_optimizer(cfg: RunConfig, model: nn.Module):
    if cfg.method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {cfg.method!r}")
    if cfg.method == "adam":
        return torch.optim.Adam(model.parameters(), lr=float(cfg.step_size or 1e-3))
    constraint = parse_radius(cfg.radius, cfg.scope)
    schedule = {} if cfg.step_size is None else {"step_size": cfg.step_size}
    if cfg.method == "fw":
        return FrankWolfe(model.parameters(), constraint=constraint, momentum=cfg.momentum, backend=cfg.backend,
                          **schedule)
    common = dict(constraint=constraint, seed=cfg.seed, tangent=cfg.tangent, num_tangents=cfg.num_tangents,
                  backend=cfg.backend, **schedule)
    if cfg.method == "fgfw":
        return FGFW(model, **common)
    if cfg.averaging_weight is not None:
        common["averaging_weight"] = cfg.averaging_weight
    return AFGFW(model, **common)


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) on (x, y)."""
    logits = model(x)
    return float(F.cross_entropy(logits, y)), float((logits.argmax(1) == y).double().mean())


def zero_count(model: nn.Module) -> tuple[int, int]:
    """(exactly-zero parameters, all parameters)."""
    params = [p.detach() for p in model.parameters()]
    return int(sum(int((p == 0).sum()) for p in params)), int(sum(p.numel() for p in params))


def train(cfg: RunConfig, model: nn.Module, train_data, test_data, progress=None) -> list[dict]:
    """Trains ``model`` in place; returns one record per epoch (epoch 0 is the initial model)."""
    torch.manual_seed(cfg.seed)
    opt = build_optimizer(cfg, model)
    x_train, y_train = train_data
    batches = torch.Generator().manual_seed(cfg.seed)
    history = []

    def record(epoch, train_loss, elapsed):
        test_loss, test_acc = evaluate(model, *test_data)
        zeros, total = zero_count(model)
        gap = getattr(opt, "last_gap", None)
        history.append(dict(method=cfg.method, seed=cfg.seed, epoch=epoch, train_loss=train_loss,
                            test_loss=test_loss, test_accuracy=test_acc,
                            fw_gap=None if gap is None else float(gap), zeros=zeros, zero_fraction=zeros / total,
                            wall_time_s=elapsed))

    record(0, evaluate(model, x_train, y_train)[0], 0.0)
    start = time.perf_counter()
    for epoch in range(1, cfg.epochs + 1):
        order = torch.randperm(len(y_train), generator=batches)
        total, count = 0.0, 0
        for i in range(0, len(order), cfg.batch_size):
            idx = order[i:i + cfg.batch_size]
            x, y = x_train[idx], y_train[idx]
            if cfg.method in ("fgfw", "afgfw"):
                loss = opt.step(lambda: F.cross_entropy(model(x), y))
            else:
                opt.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
            total += float(loss) * len(idx)
            count += len(idx)
            if progress is not None:
                progress.update(1)
        record(epoch, total / count, time.perf_counter() - start)
    return history
