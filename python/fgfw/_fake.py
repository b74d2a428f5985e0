"""Fake (meta) implementations of the C++ ops of ``fgfw._C``, so that torch.compile can trace them.

The step ops only mutate their arguments in place: their schemas return ``()`` and mark every written
tensor with ``(a!)``, which is all that functionalization and Inductor need to know. A fake call has
no data to write and no output to describe, so it does nothing; the arguments are checked by the
kernels themselves when the compiled graph runs (csrc/op_args.cpp), with the same errors as eager.
(torch 2.14 infers this same trivial fake for a mutating op that returns nothing; registering it
states the contract instead of relying on that inference, and is where an op with outputs would
describe them: ``nonfinite`` and ``tangents_at_step``, the ops that return tensors.)

Imported by ``fgfw._ops`` right after ``fgfw._C``, whose ``TORCH_LIBRARY`` defines the ops.
"""
from __future__ import annotations

import torch


@torch.library.register_fake("fgfw::fill_tangent_")
def _fill_tangent_fake(out, seed, step, tangent_id, offset, distribution) -> None:
    return None


@torch.library.register_fake("fgfw::fill_tangent_at_step_")
def _fill_tangent_at_step_fake(out, seed, step, tangent_id, offset, distribution) -> None:
    return None


@torch.library.register_fake("fgfw::l1_fw_step_")
def _l1_fw_step_fake(params, momentum, grads, schedule, tangent_coeffs, radii, global_ball, offsets, seed,
                     distribution, gap, row_numel=()) -> None:
    return None


@torch.library.register_fake("fgfw::linf_fw_step_")
def _linf_fw_step_fake(params, momentum, grads, schedule, tangent_coeffs, radii, global_ball, offsets, seed,
                       distribution, gap, row_numel=()) -> None:
    return None


@torch.library.register_fake("fgfw::lp_fw_step_")
def _lp_fw_step_fake(params, momentum, grads, schedule, tangent_coeffs, radii, global_ball, offsets, seed,
                     distribution, gap, row_numel, p, scales) -> None:
    return None


@torch.library.register_fake("fgfw::ksparse_fw_step_")
def _ksparse_fw_step_fake(params, momentum, grads, schedule, tangent_coeffs, radii, global_ball, offsets, seed,
                          distribution, gap, row_numel, k, scales) -> None:
    return None


@torch.library.register_fake("fgfw::gradient_step_")
def _gradient_step_fake(params, momentum, grads, schedule) -> None:
    return None


@torch.library.register_fake("fgfw::tangents_at_step")
def _tangents_at_step_fake(likes, seed, step, tangent_ids, offsets, distribution) -> list[torch.Tensor]:
    # new tensors shaped, typed and laid out as likes
    return [torch.empty_like(like) for like in likes]


@torch.library.register_fake("fgfw::nonfinite")
def _nonfinite_fake(tensors) -> torch.Tensor:
    # the one op with an output: a 0-dim bool on the tensors' device
    return torch.empty((), dtype=torch.bool, device=tensors[0].device)
