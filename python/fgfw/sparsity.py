"""Magnitude pruning, zero counts and accuracy-vs-pruning curves (no retraining).

A model trained inside a sparsity-promoting set (the L1 ball, the k-sparse polytope; see
:mod:`fgfw.constraints`) keeps most of its mass in a few weights: zeroing the rest should cost little
accuracy. This module measures that claim.

* :func:`prune_` zeros the fraction ``ratio`` of smallest-magnitude entries of the given tensors, in
  place: over all of them together (``scope="global"``) or ``ratio`` of each tensor (``scope="layer"``).
* :func:`count_zeros` / :func:`sparsity_report`: exact zeros, in total and per tensor.
* :func:`accuracy_curve`: for each ratio, prunes the weights, records ``evaluate(model)``, and restores the
  weights bit for bit, so the model leaves the call as it came in.

Which tensors are pruned: given a module (or ``params=None`` with a module), the parameters of two or
more dimensions (:func:`prunable`), i.e. the weights of Linear, Conv and Embedding layers. Biases and
normalisation scales (1-D) stay dense: they are a tiny fraction of the parameters, and zeroing them
shifts every activation of a unit instead of removing a connection. Pass tensors explicitly to prune
others.

Counting and ties: a ratio q of n entries prunes exactly ``round(q * n)`` entries (Python's ``round``),
``round(q * n_t)`` per tensor under scope "layer". Entries are ranked by ``|x|``; equal magnitudes are
broken by position (the earlier tensor in the list, then the lower flat index, is pruned first), so the
result is deterministic. Entries that are already zero rank first and count among the pruned ones.
"""
from __future__ import annotations

from typing import Callable, Iterable, Sequence

import torch
from torch import nn

SCOPES = ("global", "layer")


def prunable(model: nn.Module) -> list[torch.Tensor]:
    """The tensors pruned by default: ``model``'s parameters of two or more dimensions (layer weights)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"prunable takes an nn.Module, got {type(model).__name__}")
    return [p for p in model.parameters() if p.dim() >= 2]


def _tensors(params, what: str = "params") -> list[torch.Tensor]:
    """``params`` (a module, a tensor or an iterable of tensors) as a checked list of distinct tensors."""
    if isinstance(params, nn.Module):
        params = prunable(params)
    elif isinstance(params, torch.Tensor):
        params = [params]
    try:
        tensors = list(params)
    except TypeError:
        raise TypeError(f"{what} must be an nn.Module, a tensor or an iterable of tensors, "
                        f"got {type(params).__name__}") from None
    if not tensors:
        raise ValueError(f"{what} is empty: nothing to prune (a module with no parameter of 2+ dimensions, or an "
                         f"empty list)")
    seen = set()
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}[{i}] must be a tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise ValueError(f"{what}[{i}] has dtype {t.dtype}: only floating-point tensors can be pruned")
        if id(t) in seen:  # the same tensor twice would be counted twice in the ratio
            raise ValueError(f"{what}[{i}] appears more than once")
        seen.add(id(t))
    return tensors


def _check_ratio(ratio) -> float:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)):
        raise TypeError(f"ratio must be a real number in [0, 1), got {type(ratio).__name__} {ratio!r}")
    if not (0.0 <= ratio < 1.0):  # also rejects NaN
        raise ValueError(f"ratio must be in [0, 1) (the fraction of entries to zero), got {ratio!r}")
    return float(ratio)


def _check_scope(scope) -> str:
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
    return scope


def _prune_order(magnitudes: torch.Tensor, count: int) -> torch.Tensor:
    """Flat indices of the ``count`` smallest magnitudes; a stable sort breaks ties by position."""
    if torch.isnan(magnitudes).any():
        raise ValueError("cannot rank weights by magnitude: the tensors hold NaN")
    return torch.sort(magnitudes, stable=True).indices[:count]


def magnitude_masks(params, ratio: float, scope: str = "global") -> list[torch.Tensor]:
    """Boolean masks, one per tensor of ``params``: True for the entries :func:`prune_` keeps."""
    tensors, ratio, scope = _tensors(params), _check_ratio(ratio), _check_scope(scope)
    if scope == "layer":
        masks = []
        for t in tensors:
            mask = torch.ones(t.numel(), dtype=torch.bool, device=t.device)
            mask[_prune_order(t.detach().reshape(-1).abs().double(), round(ratio * t.numel()))] = False
            masks.append(mask.view(t.shape))
        return masks
    # global: rank all entries together; float64 holds every float16/bfloat16/float32 magnitude exactly
    device = tensors[0].device
    flat = torch.cat([t.detach().reshape(-1).abs().double().to(device) for t in tensors])
    mask = torch.ones(flat.numel(), dtype=torch.bool, device=device)
    mask[_prune_order(flat, round(ratio * flat.numel()))] = False
    return [m.view(t.shape).to(t.device) for m, t in zip(mask.split([t.numel() for t in tensors]), tensors)]


def prune_(params, ratio: float, scope: str = "global") -> int:
    """Zeros the ``ratio`` fraction of smallest-magnitude entries of ``params``, in place; returns how many
    entries it pruned (``round(ratio * n)``, summed per tensor under scope "layer").

    Args:
        params: the tensors (a list, one tensor, or a module: its weights of 2+ dimensions, see the module
            docstring).
        ratio: the fraction to zero, in [0, 1).
        scope: ``"global"``: one threshold over all tensors together (layers with small weights lose
            more); ``"layer"``: ``ratio`` of every tensor.
    """
    tensors = _tensors(params)
    masks = magnitude_masks(tensors, ratio, scope)
    with torch.no_grad():
        for t, keep in zip(tensors, masks):
            t.masked_fill_(~keep, 0)
    return int(sum(int((~keep).sum()) for keep in masks))


def count_zeros(params) -> tuple[int, int]:
    """(entries exactly zero, all entries) of ``params`` (a module counts its 2+-dimensional weights)."""
    tensors = _tensors(params)
    return (int(sum(int((t.detach() == 0).sum()) for t in tensors)), int(sum(t.numel() for t in tensors)))


def sparsity_report(model: nn.Module, params: Sequence[torch.Tensor] | None = None) -> list[dict]:
    """One row per tensor (name, shape, numel, zeros, zero_fraction) and a last row named "total".

    ``params`` defaults to :func:`prunable` ``(model)``; tensors that are not ``model``'s parameters are
    named by their position.
    """
    tensors = _tensors(model if params is None else params)
    names = {id(p): n for n, p in model.named_parameters()}
    rows = []
    for i, t in enumerate(tensors):
        zeros = int((t.detach() == 0).sum())
        rows.append(dict(name=names.get(id(t), f"tensor{i}"), shape=tuple(t.shape), numel=t.numel(), zeros=zeros,
                         zero_fraction=zeros / t.numel() if t.numel() else 0.0))
    zeros, total = sum(r["zeros"] for r in rows), sum(r["numel"] for r in rows)
    rows.append(dict(name="total", shape=None, numel=total, zeros=zeros, zero_fraction=zeros / total if total else 0.0))
    return rows


def accuracy_curve(model: nn.Module, params: Iterable[torch.Tensor] | None, ratios: Sequence[float],
                   evaluate: Callable[[nn.Module], float | dict], scope: str = "global") -> list[dict]:
    """The metric against the pruning ratio, without retraining; ``model`` is left exactly as it was.

    For each ratio, prunes ``params`` (default: :func:`prunable` ``(model)``) with :func:`prune_`, calls
    ``evaluate(model)`` and puts the original values back (copied from a snapshot taken once, so the
    restore is bit for bit, also when ``evaluate`` raises). Each ratio starts from the original weights.

    Returns one row per ratio: ``ratio``, ``pruned`` (entries pruned), ``zeros`` / ``total`` (exact zeros of
    ``params`` while pruned) and ``metric`` (``evaluate``'s value; a dict is merged into the row instead).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not callable(evaluate):
        raise TypeError(f"evaluate must be a callable evaluate(model) -> metric, got {type(evaluate).__name__}")
    tensors = _tensors(model if params is None else params)
    scope = _check_scope(scope)
    ratios = [_check_ratio(r) for r in ratios]  # all checked before any weight changes
    if not ratios:
        raise ValueError("ratios is empty: pass at least one ratio in [0, 1), e.g. [0, 0.5, 0.9]")
    snapshot = [t.detach().clone() for t in tensors]
    rows = []
    try:
        for ratio in ratios:
            pruned = prune_(tensors, ratio, scope)
            zeros, total = count_zeros(tensors)
            value = evaluate(model)
            row = dict(ratio=ratio, pruned=pruned, zeros=zeros, total=total)
            row.update(value if isinstance(value, dict) else {"metric": value})
            rows.append(row)
            _restore(tensors, snapshot)
    finally:
        _restore(tensors, snapshot)
    return rows


def _restore(tensors: Sequence[torch.Tensor], snapshot: Sequence[torch.Tensor]) -> None:
    with torch.no_grad():
        for t, saved in zip(tensors, snapshot):
            t.copy_(saved)


__all__ = ["SCOPES", "accuracy_curve", "count_zeros", "magnitude_masks", "prunable", "prune_", "sparsity_report"]
