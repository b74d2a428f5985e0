"""The Triton launchers as torch custom ops, ``torch.ops.fgfw_triton.*``, so that torch.compile can trace a step.

Registered with ``torch.library.custom_op``: to torch.compile each op is one opaque call that mutates
the arguments named in ``mutates_args``, and runs the launcher unchanged when the graph runs. That
works in both of Triton's modes: compiled kernels on CUDA tensors and the interpreter on CPU tensors.

Why not ``torch.library.triton_op`` (which lets Inductor see and schedule the kernels themselves) on a
GPU: it traces the op's body with fake tensors, and the step's launcher reads tensor addresses
(``data_ptr``) to build its per-tensor table, which fake tensors do not have; under the interpreter
``triton_op`` fails for the same reason ("Cannot access data pointer of Tensor"). One registration
for both modes also keeps the compiled graph the same on the CPU (tested in CI) and on a GPU.
"""
from __future__ import annotations

import torch

from . import gradient_step, ksparse_fw_step, l1_fw_step, linf_fw_step, lp_fw_step, tangent

NAMESPACE = "fgfw_triton"


@torch.library.custom_op(f"{NAMESPACE}::fill_tangent_", mutates_args=("out",))
def fill_tangent_(out: torch.Tensor, seed: int, step: int, tangent_id: int, offset: int, distribution: int) -> None:
    """``fgfw.triton.fill_tangent_`` (the tangent stream written into ``out``) as a custom op."""
    tangent.fill_tangent_(out, seed, step, tangent_id, offset, distribution)


@fill_tangent_.register_fake
def _(out, seed, step, tangent_id, offset, distribution) -> None:
    return None


@torch.library.custom_op(f"{NAMESPACE}::fill_tangent_at_step_", mutates_args=("out",))
def fill_tangent_at_step_(out: torch.Tensor, seed: int, step: torch.Tensor, tangent_id: int, offset: int,
                          distribution: int) -> None:
    """``fgfw.triton.fill_tangent_at_step_`` (the tangent stream at the step held by a tensor) as a custom op."""
    tangent.fill_tangent_at_step_(out, seed, step, tangent_id, offset, distribution)


@fill_tangent_at_step_.register_fake
def _(out, seed, step, tangent_id, offset, distribution) -> None:
    return None


@torch.library.custom_op(f"{NAMESPACE}::tangents_at_step", mutates_args=())
def tangents_at_step(likes: list[torch.Tensor], seed: int, step: torch.Tensor, tangent_ids: list[int],
                     offsets: list[int], distribution: int) -> list[torch.Tensor]:
    """New tensors shaped as ``likes``, each filled by ``fill_tangent_at_step_`` from its offset, as one custom op
    (the C++ op ``fgfw::tangents_at_step``'s contract)."""
    for name, values in (("offset", offsets), ("tangent id", tangent_ids)):
        if len(likes) != len(values):
            raise RuntimeError(f"tangents_at_step: one {name} per tensor of likes, got {len(values)} {name}s for "
                               f"{len(likes)} tensors")
    out = []
    for like, tangent_id, offset in zip(likes, tangent_ids, offsets):
        out.append(torch.empty_like(like))
        tangent.fill_tangent_at_step_(out[-1], seed, step, tangent_id, offset, distribution)
    return out


@tangents_at_step.register_fake
def _(likes, seed, step, tangent_ids, offsets, distribution) -> list[torch.Tensor]:
    return [torch.empty_like(like) for like in likes]


@torch.library.custom_op(f"{NAMESPACE}::l1_fw_step_", mutates_args=("params", "momentum", "gap"))
def l1_fw_step_(params: list[torch.Tensor], momentum: list[torch.Tensor], grads: list[torch.Tensor],
                schedule: torch.Tensor, tangent_coeffs: torch.Tensor, radii: list[float], global_ball: bool,
                offsets: list[int], seed: int, distribution: int, gap: torch.Tensor, row_numel: list[int]) -> None:
    """``fgfw.triton.l1_fw_step_`` (the fused L1-ball Frank-Wolfe step) as a custom op."""
    l1_fw_step.l1_fw_step_(params, momentum, grads, schedule, tangent_coeffs, radii, global_ball, offsets, seed,
                           distribution, gap, row_numel)


@l1_fw_step_.register_fake
def _(params, momentum, grads, schedule, tangent_coeffs, radii, global_ball, offsets, seed, distribution,
      gap, row_numel) -> None:
    return None


@torch.library.custom_op(f"{NAMESPACE}::linf_fw_step_", mutates_args=("params", "momentum", "gap"))
def linf_fw_step_(params: list[torch.Tensor], momentum: list[torch.Tensor], grads: list[torch.Tensor],
                  schedule: torch.Tensor, tangent_coeffs: torch.Tensor, radii: list[float], global_ball: bool,
                  offsets: list[int], seed: int, distribution: int, gap: torch.Tensor, row_numel: list[int]) -> None:
    """``fgfw.triton.linf_fw_step.linf_fw_step_`` (the fused L-infinity-ball Frank-Wolfe step) as a custom op."""
    linf_fw_step.linf_fw_step_(params, momentum, grads, schedule, tangent_coeffs, radii, global_ball, offsets, seed,
                               distribution, gap, row_numel)


@linf_fw_step_.register_fake
def _(params, momentum, grads, schedule, tangent_coeffs, radii, global_ball, offsets, seed, distribution,
      gap, row_numel) -> None:
    return None


# The Lp and k-sparse steps take their set's parameter and the norm feedback's scales, every argument required as
# in the C++ schemas (a tensor list cannot have a default, nor follow arguments that have one).
@torch.library.custom_op(f"{NAMESPACE}::lp_fw_step_", mutates_args=("params", "momentum", "gap", "scales"))
def lp_fw_step_(params: list[torch.Tensor], momentum: list[torch.Tensor], grads: list[torch.Tensor],
                schedule: torch.Tensor, tangent_coeffs: torch.Tensor, radii: list[float], global_ball: bool,
                offsets: list[int], seed: int, distribution: int, gap: torch.Tensor, row_numel: list[int],
                p: float, scales: list[torch.Tensor]) -> None:
    """``fgfw.triton.lp_fw_step.lp_fw_step_`` (the fused Lp-ball Frank-Wolfe step, 1 < p < inf) as a custom op."""
    lp_fw_step.lp_fw_step_(params, momentum, grads, schedule, tangent_coeffs, radii, global_ball, offsets, seed,
                           distribution, gap, row_numel, p, scales)


@lp_fw_step_.register_fake
def _(params, momentum, grads, schedule, tangent_coeffs, radii, global_ball, offsets, seed, distribution,
      gap, row_numel, p, scales) -> None:
    return None


@torch.library.custom_op(f"{NAMESPACE}::ksparse_fw_step_", mutates_args=("params", "momentum", "gap", "scales"))
def ksparse_fw_step_(params: list[torch.Tensor], momentum: list[torch.Tensor], grads: list[torch.Tensor],
                     schedule: torch.Tensor, tangent_coeffs: torch.Tensor, radii: list[float], global_ball: bool,
                     offsets: list[int], seed: int, distribution: int, gap: torch.Tensor, row_numel: list[int],
                     k: int, scales: list[torch.Tensor]) -> None:
    """``fgfw.triton.ksparse_fw_step.ksparse_fw_step_`` (the fused k-sparse-polytope Frank-Wolfe step) as a custom
    op."""
    ksparse_fw_step.ksparse_fw_step_(params, momentum, grads, schedule, tangent_coeffs, radii, global_ball, offsets,
                                     seed, distribution, gap, row_numel, k, scales)


@ksparse_fw_step_.register_fake
def _(params, momentum, grads, schedule, tangent_coeffs, radii, global_ball, offsets, seed, distribution,
      gap, row_numel, k, scales) -> None:
    return None


@torch.library.custom_op(f"{NAMESPACE}::gradient_step_", mutates_args=("params", "momentum"))
def gradient_step_(params: list[torch.Tensor], momentum: list[torch.Tensor], grads: list[torch.Tensor],
                   schedule: torch.Tensor) -> None:
    """``fgfw.triton.gradient_step.gradient_step_`` (an unconstrained group's step, every tensor in one launch) as a
    custom op."""
    gradient_step.gradient_step_(params, momentum, grads, schedule)


@gradient_step_.register_fake
def _(params, momentum, grads, schedule) -> None:
    return None
