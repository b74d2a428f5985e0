"""The fused Frank-Wolfe step over Lp balls, 1 < p < inf (p = 2: the L2 ball), in Triton: the Triton backend of
reference.lp_fw_step_. The reduction and update passes of set_step.py (whose docstring has the design;
docs/set_steps.md, "Triton kernels") with, between them, each ball's max|d| and ||x||_q (``_lp_finalize_kernel``).
"""
from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from .l1_fw_step import _nan_f64
from .set_step import _MAX_REGISTERS, LP, _pow, _set_step

# Partial slots reduced per program by the Lp finalize, whose powers call libdevice's exp and log: a [RB, CB] tile of
# 1024 float64 (set_step._RBLOCK, the gap sum's and the feedback's) on 4 warps spilled 48-96 bytes on sm_90 at the
# 128-register ceiling (python -m fgfw.triton.aot); 256 (2 per thread) do not.
_FINALIZE_BLOCK = 256


@triton.jit(do_not_specialize=["n_balls", "chunks", "slot_base", "stat_base"])
def _lp_finalize_kernel(part_max, part_sum, ball_max, ball_norm, schedule, n_balls, chunks, slot_base, stat_base,
                        Q: tl.constexpr, INV_Q: tl.constexpr, RB: tl.constexpr, CB: tl.constexpr,
                        SKIPPABLE: tl.constexpr):
    """Per ball (chunks slots from slot_base + ball chunks): M = max m and ||x||_q = (sum S (m / M)^q)^(1/q),
    0 for an all-zero ball (the vertex is 0 there), NaN when a |d| is NaN. Nothing on a skipped step."""
    if SKIPPABLE:
        if tl.load(schedule + 3) != 0:
            return
    ball = tl.program_id(0) * RB + tl.arange(0, RB)
    live = ball < n_balls
    first = slot_base + ball.to(tl.int64) * chunks
    top = tl.zeros([RB], dtype=tl.float64)
    any_nan = tl.zeros([RB], dtype=tl.int32)
    for c in range(0, chunks, CB):
        j = c + tl.arange(0, CB)
        mask = live[:, None] & (j < chunks)[None, :]
        m = tl.load(part_max + first[:, None] + j[None, :], mask=mask, other=0.0)
        any_nan = tl.maximum(any_nan, tl.max((m != m).to(tl.int32), axis=1))
        top = tl.maximum(top, tl.max(tl.where(m != m, 0.0, m), axis=1))
    top = tl.where(any_nan != 0, _nan_f64(), top)
    scale = tl.where(top > 0, top, 1.0)
    total = tl.zeros([RB], dtype=tl.float64)
    for c in range(0, chunks, CB):
        j = c + tl.arange(0, CB)
        mask = live[:, None] & (j < chunks)[None, :]
        m = tl.load(part_max + first[:, None] + j[None, :], mask=mask, other=0.0)
        s = tl.load(part_sum + first[:, None] + j[None, :], mask=mask, other=0.0)
        total += tl.sum(tl.where(mask, s * _pow(m / scale[:, None], Q), 0.0), axis=1)
    norm = tl.where(top == 0, 0.0, _pow(total, INV_Q))
    tl.store(ball_max + stat_base + ball, top, mask=live)
    tl.store(ball_norm + stat_base + ball, norm, mask=live)


def _finalize(plan, part_max, part_sum, schedule, skip: bool, q: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(max|d|, ||x||_q) of every ball, on the device, from the reduction pass's partials."""
    stat_a = torch.empty(plan.n_stats, dtype=torch.float64, device=part_max.device)
    stat_b = torch.empty_like(stat_a)
    for slot_base, balls, chunks, stat_base in plan.finalize:
        cb = min(_FINALIZE_BLOCK, triton.next_power_of_2(chunks))
        rb = _FINALIZE_BLOCK // cb
        _lp_finalize_kernel[(triton.cdiv(balls, rb),)](
            part_max, part_sum, stat_a, stat_b, schedule, balls, chunks, slot_base, stat_base, Q=q,
            INV_Q=1.0 / q, RB=rb, CB=cb, SKIPPABLE=skip, num_warps=4, maxnreg=_MAX_REGISTERS,
            enable_fp_fusion=False)
    return stat_a, stat_b


def lp_fw_step_(params: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                schedule: torch.Tensor, tangent_coeffs: torch.Tensor, radii: Sequence[float], global_ball: bool,
                offsets: Sequence[int], seed: int, distribution: int, gap: torch.Tensor, row_numel: Sequence[int] = (),
                p: float = 2.0, scales: Sequence[torch.Tensor] = ()) -> None:
    """One Frank-Wolfe step over Lp ball(s), 1 < p < inf, in place; same contract as reference.lp_fw_step_.
    A reduction pass, a per-ball finalize, the update pass, then (with scales) the norm feedback's per ball."""
    if not 1 < p < float("inf"):
        raise ValueError(f"p must satisfy 1 < p < inf, got {p}")
    q = float(p) / (float(p) - 1)  # as reference.lp_vertex

    def ball_norms(plan, part_max, part_sum, keys, schedule, skip):
        return _finalize(plan, part_max, part_sum, schedule, skip, q)

    _set_step(LP, params, momentum, grads, schedule, tangent_coeffs, radii, global_ball, offsets, seed,
              distribution, gap, row_numel, p=float(p), scales=scales, statistics=ball_norms)
