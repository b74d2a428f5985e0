"""The "forward_ad" engine: the directional derivative c = <grad f(theta), u> in one forward pass by torch's
stock forward-mode AD (the reference engine), and the argument checks every engine shares.

The paper's projected forward gradient (Definition 1) is g_hat = <grad f(theta), u> u. Its only
model-dependent part is the scalar

    c = <grad f(theta), u> = d/d eps f(theta + eps u) |_{eps=0} = sum_j <grad_{theta_j} f, u_j>,

a Jacobian-vector product, which forward-mode AD evaluates alongside the ordinary forward pass: every
intermediate value carries its own tangent, nothing is stored for a backward pass, and each
activation's tangent is freed together with the activation.

An engine is a function with the signature of :func:`directional_derivative`; the registry of engines by
name is :data:`fgfw.forward_grad.ENGINES` (with the lean engine of :mod:`fgfw.lean`, which imports its
checks from here: the modules read top-down, forward_grad -> lean -> forward_ad_engine).

Why the reference engine is ``"forward_ad"`` (``torch.autograd.forward_ad``), not ``torch.func.jvp``
------------------------------------------------------------------------------------------------------
* The user's closure calls the real module object, so the parameters themselves must carry the
  tangents while it runs. ``torch.func.jvp`` is a functional transform: it would still need the
  parameters swapped inside the module, and it refuses in-place updates of captured tensors, which
  rules out BatchNorm in train mode (``num_batches_tracked.add_(1)`` raises "attempted to call
  in-place operation ... that would mutate a captured Tensor").
* With ``forward_ad`` the tangent is attached to each Parameter object *in place*
  (``p.copy_(make_dual(p.detach(), u))``: copy_ onto the same memory moves no data, and forward AD
  gives ``p`` the tangent of the source). Every path by which the closure reaches a parameter then
  sees the tangent: attribute access, tied weights (one object registered twice), RNN flat-weight
  lists, parametrizations, and references the closure captured itself (e.g. a penalty on
  ``model.fc.weight``). Swapping the entries of the modules' ``_parameters`` dicts, as
  ``torch.func.functional_call`` does, would silently miss the last kind and give a wrong ``c``.
* Leaving the dual level clears every tangent of that level, also when the closure raises, so the
  parameters are the same objects with the same values afterwards and carry no tangent.

Observable costs of that choice: each call bumps every given parameter's version counter once, and
forward AD copies ``u_j`` into the parameter's own tangent (one tangent-sized copy per parameter and
call; the tangent returned by ``make_tangent`` can be freed as soon as it is attached).

Behaviour worth knowing
-----------------------
* Buffers get no tangent. BatchNorm in train mode updates its running statistics inside the native
  kernel from the primal values, exactly as one ordinary forward does. A buffer that a module
  updates in place from an activation (an EMA, say) gets the primal values, and the tangent it picks
  up meanwhile is dropped when the dual level closes.
* Attention runs on kernels that have forward-mode rules during the pass: scaled dot-product
  attention on its math backend (the flash, memory-efficient and cuDNN kernels have none and raise
  NotImplementedError; the math backend materialises the attention matrix), and the fused "fast
  path" of nn.MultiheadAttention / nn.TransformerEncoderLayer, which eval mode takes under no_grad,
  is switched off (``torch.backends.mha``, a process-wide flag, restored afterwards).
* Memory: torch's stock forward-mode rules hold a few activation-sized temporaries per layer (the
  linear rule computes ``x_t W^T + x W_t^T`` apart), so the peak is a small multiple of one layer's
  activations, independent of depth, whereas backprop keeps every layer's activations.
* Forward AD has one process-wide dual level: the engine cannot run inside another
  ``forward_ad.dual_level()`` (torch raises "Nested forward mode AD is not supported") nor in two
  threads at once.
* The closure must not call ``backward()``: there is no graph (the pass runs under ``no_grad``).
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Sequence

import torch
import torch.autograd.forward_ad as fwAD
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

DirectionalDerivative = Callable[
    [nn.Module, Sequence[torch.Tensor], Callable[[int], torch.Tensor], Callable[[], torch.Tensor]],
    tuple[torch.Tensor, torch.Tensor],
]


@contextlib.contextmanager
def _attention_with_forward_ad() -> Iterator[None]:
    """Routes attention to kernels that have forward-mode rules, for the duration of the pass."""
    # torch.compile cannot trace setting the process-wide fast-path flag: a compiled pass leaves it as it
    # is, so an eval-mode nn.MultiheadAttention needs torch.backends.mha.set_fastpath_enabled(False) from
    # the caller (its fast path has no forward-mode rule).
    toggle_fastpath = not torch.compiler.is_compiling()
    if toggle_fastpath:
        fastpath = torch.backends.mha.get_fastpath_enabled()
        torch.backends.mha.set_fastpath_enabled(False)
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        if toggle_fastpath:
            torch.backends.mha.set_fastpath_enabled(fastpath)


def _registered_param_ids(module: nn.Module) -> set[int]:
    """ids of the parameters registered in ``module`` and its submodules: what ``module.parameters()``
    yields, read from the registries directly (the check runs every step; parameters()'s named generators
    cost twice as much)."""
    ids, seen, stack = set(), set(), [module]
    while stack:
        m = stack.pop()
        if m is None or id(m) in seen:  # an empty slot, or a module registered twice (or in a cycle)
            continue
        seen.add(id(m))
        ids.update(map(id, m._parameters.values()))
        stack.extend(m._modules.values())
    return ids


def _check_params(module: nn.Module, params: Sequence[torch.Tensor]) -> None:
    """Each entry of ``params`` must be a distinct parameter of ``module``."""
    owned = _registered_param_ids(module)
    seen: dict[int, int] = {}
    for j, p in enumerate(params):
        if id(p) in seen:
            raise ValueError(
                f"params[{j}] is the same tensor as params[{seen[id(p)]}]; each parameter must appear once "
                f"(a tied parameter is passed once and gets one tangent)")
        seen[id(p)] = j
        if id(p) not in owned:  # a module may yield more than it registers: ask it
            owned = {id(q) for q in module.parameters()}
        if id(p) not in owned:
            raise ValueError(
                f"params[{j}] (shape {tuple(p.shape)}) is not a parameter of module "
                f"({type(module).__name__}); pass parameters of the module the closure runs, not of a copy")


def _check_tangent(j: int, param: torch.Tensor, tangent: torch.Tensor) -> None:
    """``make_tangent(j)`` must match ``params[j]`` in shape, dtype and device."""
    if not isinstance(tangent, torch.Tensor):
        raise TypeError(f"make_tangent({j}) must return a torch.Tensor, got {type(tangent).__name__}")
    if (tangent.shape, tangent.dtype, tangent.device) != (param.shape, param.dtype, param.device):
        raise ValueError(
            f"make_tangent({j}) returned shape {tuple(tangent.shape)}, {tangent.dtype} on {tangent.device}; "
            f"params[{j}] needs shape {tuple(param.shape)}, {param.dtype} on {param.device}")


def _check_loss(loss: object) -> torch.Tensor:
    """The closure's result must be a real floating tensor with one element."""
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"closure must return the loss as a torch.Tensor, got {type(loss).__name__}")
    if not loss.is_floating_point():
        raise TypeError(f"closure must return a floating-point loss, got dtype {loss.dtype}")
    if loss.numel() != 1:
        raise ValueError(f"closure must return a scalar loss, got shape {tuple(loss.shape)}")
    return loss


def directional_derivative(module: nn.Module, params: Sequence[torch.Tensor],
                           make_tangent: Callable[[int], torch.Tensor],
                           closure: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss f(theta) and c = <grad f(theta), u> by forward-mode AD, in one forward pass.

    Args:
        module: the module whose forward ``closure`` runs; every entry of ``params`` must be one of
            its parameters.
        params: the parameters theta_j that get a tangent, each once. The module's other parameters
            and all buffers are constants.
        make_tangent: ``make_tangent(j)`` returns u_j for ``params[j]`` (same shape, dtype, device).
        closure: computes and returns the scalar loss by calling ``module``; it must not call
            ``backward()``.

    Returns:
        ``(loss, c)``: the loss as a 0-dim tensor (the closure's value, no grad_fn) and c as a 0-dim
        tensor of the loss's dtype on its device. When the loss does not depend on any of ``params``
        (forward AD leaves it without a tangent), c is 0, the exact directional derivative.

    The pass runs under ``no_grad`` (no backward graph, no activations kept); inference mode is
    switched off for it, since it also switches off forward AD and would make every c zero.
    """
    params = list(params)
    _check_params(module, params)
    with torch.inference_mode(False), torch.no_grad(), fwAD.dual_level(), _attention_with_forward_ad():
        for j, p in enumerate(params):
            tangent = make_tangent(j)
            _check_tangent(j, p, tangent)
            # in place, so that every path to p sees the tangent (see the module docstring); the
            # source aliases p's memory, so copy_ moves no data
            p.copy_(fwAD.make_dual(p.detach(), tangent))
        loss = _check_loss(closure())
        primal, loss_tangent = fwAD.unpack_dual(loss)
        loss = primal.detach().reshape(())
        if loss_tangent is None:
            c = torch.zeros((), dtype=loss.dtype, device=loss.device)
        else:
            c = loss_tangent.detach().reshape(())
    return loss, c
