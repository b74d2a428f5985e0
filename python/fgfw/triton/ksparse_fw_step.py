"""The fused Frank-Wolfe step over k-sparse polytopes in Triton: the Triton backend of reference.ksparse_fw_step_. The
reduction pass of set_step.py writes every element's magnitude key, torch ops on the device select each ball's k-th
largest (``_select``), then the update pass (set_step.py's docstring has the design; docs/set_steps.md, "Triton
kernels")."""
from __future__ import annotations

from typing import Sequence

import torch

from .set_step import KSPARSE, _set_step


def _select(keys: torch.Tensor, classes: tuple, k: int, n_stats: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(threshold, last_tie) per k-sparse ball, on the device, with no host synchronisation: the k-th largest
    key T of the ball, and the position of the last element taken among those equal to T (the lowest
    positions win the ties: k minus the count above T of them)."""
    thresholds = torch.empty(n_stats, dtype=keys.dtype, device=keys.device)
    last_ties = torch.empty(n_stats, dtype=torch.int64, device=keys.device)
    for key_start, balls, n, stat_start in classes:
        ball_keys = keys[key_start:key_start + balls * n].view(balls, n)
        kk = min(k, n)
        threshold = ball_keys.topk(kk, dim=1, sorted=False).values.amin(dim=1, keepdim=True)
        ties_taken = kk - (ball_keys > threshold).sum(dim=1, keepdim=True)  # >= 1
        # the ties before the last one taken: its position
        last_tie = ((ball_keys == threshold).cumsum(dim=1, dtype=torch.int32) < ties_taken).sum(dim=1)
        thresholds[stat_start:stat_start + balls] = threshold.view(-1)
        last_ties[stat_start:stat_start + balls] = last_tie
    return thresholds, last_ties


def ksparse_fw_step_(params: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor],
                     grads: Sequence[torch.Tensor], schedule: torch.Tensor, tangent_coeffs: torch.Tensor,
                     radii: Sequence[float], global_ball: bool, offsets: Sequence[int], seed: int, distribution: int,
                     gap: torch.Tensor, row_numel: Sequence[int] = (), k: int = 1,
                     scales: Sequence[torch.Tensor] = ()) -> None:
    """One Frank-Wolfe step over k-sparse polytope(s), in place; same contract as reference.ksparse_fw_step_.
    A pass writing the keys, the selection in torch ops on the device, the update pass, then (with scales) the
    norm feedback's per ball."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")

    def selection(plan, part_max, part_sum, keys, schedule, skip):
        return _select(keys, plan.classes, int(k), plan.n_stats)

    _set_step(KSPARSE, params, momentum, grads, schedule, tangent_coeffs, radii, global_ball, offsets, seed,
              distribution, gap, row_numel, k=int(k), scales=scales, statistics=selection)
