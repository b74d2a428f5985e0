"""The fused Frank-Wolfe step over L-infinity balls in Triton: the Triton backend of reference.linf_fw_step_. One pass
(the update pass of set_step.py, whose docstring has the design; docs/set_steps.md, "Triton kernels")."""
from __future__ import annotations

from typing import Sequence

import torch

from .set_step import LINF, _set_step


def linf_fw_step_(params: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                  schedule: torch.Tensor, tangent_coeffs: torch.Tensor, radii: Sequence[float], global_ball: bool,
                  offsets: Sequence[int], seed: int, distribution: int, gap: torch.Tensor,
                  row_numel: Sequence[int] = ()) -> None:
    """One Frank-Wolfe step over L-infinity ball(s), in place; same contract as reference.linf_fw_step_ (and
    the arguments of l1_fw_step.l1_fw_step_). One pass."""
    _set_step(LINF, params, momentum, grads, schedule, tangent_coeffs, radii, global_ball, offsets, seed,
              distribution, gap, row_numel)
