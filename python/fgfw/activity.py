"""The activity-perturbed forward gradient: tangents on the outputs of ``nn.Linear`` layers.

The paper's estimator perturbs the weights: ``g_hat = <grad f, u> u`` with u over all d parameters, so
each coordinate's noise is ~sqrt(d) times its signal. Perturbing activations instead (Ren, Kornblith,
Liao, Hinton, "Scaling forward gradient with local losses", ICLR 2023) draws a tangent ``u_l`` for the
output ``z_l = h_{l-1} W_l^T + b_l`` of every perturbed linear layer, per example. One forward-mode pass
gives, for every example b, the directional derivative of its own loss

    c_b = sum_l <dL_b/dz_{l,b}, u_{l,b}>,

and ``c_b u_{l,b}`` is an unbiased estimate of ``dL_b/dz_{l,b}`` (the u's are independent, zero-mean,
unit-variance). The chain rule ``dL/dW_l = sum_b dL/dz_{l,b} h_{l-1,b}^T`` then gives

    g_hat(W_l) = 1/(K N) sum_k sum_b c_{k,b} u_{k,l,b} h_{l-1,b}^T,   g_hat(b_l) = 1/(K N) sum_k sum_b c_{k,b} u_{k,l,b}

for K tangents and N examples: unbiased, no backward pass. The noise of a coordinate now scales with
the number of perturbed activations per example (the sum of the layers' widths), not with d.

Costs against the weight estimator: the closure must return per-example losses (c_b is per example);
each perturbed layer's input h is kept until the loss is known (what backprop keeps for its linear
layers; nothing else: no nonlinearity's saved tensors); the estimate is a dense gradient handed to the
fused step like a backprop gradient.

Tangents come from the library's stream (``fill_tangent_``), so a run is reproducible: the t-th tangent
of step k for the i-th linear call of the forward lives at offset ``sum of the earlier calls' output
sizes`` (each rounded up to a multiple of 4), ``tangent_id`` t.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.autograd.forward_ad as fwAD
from torch import nn
from torch._C._functorch import _add_batch_dim, maybe_current_level

from .forward_grad import _attention_with_forward_ad


def linear_owners(module: nn.Module, params: Sequence[torch.Tensor]) -> dict[nn.Linear, None]:
    """The ``nn.Linear`` layers of ``module`` that own ``params``; every parameter must have one.

    Raises ``ValueError`` naming a parameter that is not the weight or bias of a linear layer (the
    activity estimator perturbs linear outputs, so it has nothing to estimate such a parameter from).
    """
    owner = {}
    for name, layer in module.named_modules():
        if isinstance(layer, nn.Linear):
            for p in layer.parameters(recurse=False):
                owner.setdefault(id(p), (name, layer))
    names = {id(p): n for n, p in module.named_parameters()}
    layers: dict[nn.Linear, None] = {}
    for p in params:
        if id(p) not in owner:
            raise ValueError(f"estimator='activity' estimates the gradients of nn.Linear weights and biases only; "
                             f"parameter {names.get(id(p), '?')!r} (shape {tuple(p.shape)}) belongs to no nn.Linear "
                             f"of the module (use estimator='weight', or a param group of linear layers)")
        layers[owner[id(p)][1]] = None
    return layers


def _check_losses(losses: object, batch: int | None = None) -> torch.Tensor:
    if not isinstance(losses, torch.Tensor) or not losses.is_floating_point() or losses.dim() != 1:
        described = (f"a tensor of shape {tuple(losses.shape)}, dtype {losses.dtype}" if isinstance(losses, torch.Tensor)
                     else type(losses).__name__)
        raise ValueError(f"with estimator='activity' the closure must return the per-example losses (a 1-D "
                         f"floating-point tensor, e.g. F.cross_entropy(logits, y, reduction='none')), got {described}")
    return losses


class _Perturbation:
    """Forward hooks that add a tangent to each call of the perturbed layers and record the call's input."""

    def __init__(self, layers, make_tangent: Callable[[torch.Tensor, int], torch.Tensor], wrap=lambda u: u):
        self.layers, self.make_tangent, self.wrap = layers, make_tangent, wrap
        self.calls: list[tuple[nn.Linear, torch.Tensor, torch.Tensor]] = []  # (layer, input, tangent)
        self.offset = 0

    def _hook(self, layer, args, out):
        x = args[0]
        u = self.make_tangent(out, self.offset)
        self.offset += -(-out.numel() // 4) * 4
        self.calls.append((layer, x, u))
        return out + fwAD.make_dual(torch.zeros(out.shape, dtype=out.dtype, device=out.device), self.wrap(u))

    def __enter__(self):
        self.handles = [layer.register_forward_hook(self._hook) for layer in self.layers]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


def _estimate(calls, inputs, c: torch.Tensor, grads: dict[int, torch.Tensor], num_tangents: int) -> None:
    """Adds every call's share of g_hat to ``grads``: c has shape (k, N) and each tangent (k, N, ..., out),
    k of the ``num_tangents`` tangents (all of them in one pass, one per pass otherwise)."""
    k, n = c.shape
    for (layer, _, u), h in zip(calls, inputs):
        if u.shape[1] != n:
            raise ValueError(f"estimator='activity': an nn.Linear output of shape {tuple(u.shape[1:])} does not "
                             f"start with the batch dimension of the {n} per-example losses (batch-first "
                             f"layouts only)")
        dz = torch.einsum("kn,kn...->n...", c.to(u.dtype), u.reshape(k, n, -1, u.shape[-1])) / (num_tangents * n)
        dz = dz.reshape(-1, u.shape[-1])
        weight = grads.setdefault(id(layer.weight), torch.zeros_like(layer.weight))
        weight.add_((dz.T @ h.reshape(-1, h.shape[-1]).to(dz.dtype)).to(weight.dtype))
        if layer.bias is not None:
            bias = grads.setdefault(id(layer.bias), torch.zeros_like(layer.bias))
            bias.add_(dz.sum(0).to(bias.dtype))


def activity_gradients(module: nn.Module, params: Sequence[torch.Tensor], closure: Callable[[], torch.Tensor],
                       make_tangent: Callable[[torch.Tensor, int, int], torch.Tensor], num_tangents: int,
                       in_one_pass: bool = False) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Mean loss and the activity-perturbed gradient estimate of every parameter in ``params``.

    ``make_tangent(out, offset, t)`` returns tangent t for a linear output ``out`` (its shape, dtype and
    device) starting at
    ``offset`` of the stream. ``closure`` returns per-example losses. With ``in_one_pass`` the K tangents
    travel through one forward (``torch.func.vmap`` over ``torch.func.jvp``: the primal runs once; not for
    closures that update captured state in place, such as BatchNorm in train mode); otherwise one
    forward-mode pass per tangent. Returns ``(loss, {id(p): g_hat})``; a parameter the forward never used
    gets a zero estimate (its exact gradient).
    """
    params = list(params)
    layers = linear_owners(module, params)
    grads: dict[int, torch.Tensor] = {}
    with torch.inference_mode(False), torch.no_grad(), _attention_with_forward_ad():
        if in_one_pass:
            loss, c, perturbation, inputs = _one_pass(layers, closure, make_tangent, num_tangents)
            _estimate(perturbation.calls, inputs, c, grads, num_tangents)
        else:
            loss = None
            for t in range(num_tangents):
                with fwAD.dual_level(), _Perturbation(layers, lambda out, off: make_tangent(out, off, t)) as pert:
                    losses = _check_losses(closure())
                    primal, tangent = fwAD.unpack_dual(losses)
                    c = torch.zeros_like(primal) if tangent is None else tangent
                    inputs = [fwAD.unpack_dual(x).primal for _, x, _ in pert.calls]
                    calls = [(layer, None, u[None]) for layer, _, u in pert.calls]
                loss = primal.mean() if loss is None else loss
                _estimate(calls, inputs, c[None], grads, num_tangents)
    return loss.detach(), {id(p): grads[id(p)] if id(p) in grads else torch.zeros_like(p) for p in params}


def _one_pass(layers, closure, make_tangent, num_tangents):
    records = {}

    def one_pass(_):
        level = maybe_current_level()

        def tangents(out, offset):
            like = torch.empty(0).new_empty(out.shape, dtype=out.dtype, device=out.device)
            with torch._C._DisableFuncTorch():
                return torch.stack([make_tangent(like, offset, t) for t in range(num_tangents)])

        def run(_):
            with _Perturbation(layers, tangents, wrap=lambda u: _add_batch_dim(u, 0, level)) as pert:
                losses = _check_losses(closure())
            records["pert"] = pert
            return losses, [x for _, x, _ in pert.calls]

        anchor = torch.zeros(())
        return torch.func.jvp(run, (anchor,), (anchor,), has_aux=True)

    try:
        losses, c, inputs = torch.func.vmap(one_pass, out_dims=(None, 0, None), randomness="same")(
            torch.zeros(num_tangents))
    except RuntimeError as error:
        if "mutate a captured Tensor" not in str(error):
            raise
        raise ValueError("the closure updates a tensor it captured in place (e.g. BatchNorm running statistics in "
                         "train mode), which several tangents in one pass cannot do; use tangents_in_one_pass=False "
                         f"(torch: {error})") from None
    return losses.mean(), c, records["pert"], inputs
