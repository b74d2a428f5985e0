"""The activity-perturbed forward gradient: tangents on the outputs of the layers that hold the parameters.

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
layers), so the memory is of backprop's order, not of inference's (bench/activity.py); the tangents
are not kept but drawn again from the stream for the estimate; the estimate is a dense gradient handed
to the fused step like a backprop gradient.

Tangents come from the library's stream (``fill_tangent_``), so a run is reproducible: the t-th tangent
of step k for the i-th perturbed call of the forward lives at offset ``sum of the earlier calls' output
sizes`` (each rounded up to a multiple of 4), ``tangent_id`` t.

Layers: every module that directly holds one of the parameters is perturbed (each of them, for a weight
tied between two modules). ``nn.Linear`` takes the closed form above; any other layer (convolutions,
embeddings, normalisation layers, Hugging Face's ``Conv1D``, ...) takes the same chain rule through the
vector-Jacobian product of its own forward at the recorded inputs, ``g_hat(theta_l) = (dz_l/dtheta_l)^T
dz_hat_l`` with ``dz_hat_l = 1/(K N) sum_k c_k u_{k,l}`` (autograd through the layer alone, its buffers
copied so that a BatchNorm's running statistics move once per step, as in a plain forward).
The layer's output must be one tensor whose first dimension is the batch of the per-example losses, or 1
for an output shared by the whole batch (a position embedding broadcast over it: its tangent moves every
example's loss, so its share takes the batch's sum of the directional derivatives).
A model with a layer that mixes the examples of a batch (BatchNorm in train mode) takes the whole batch's
directional derivative in place of each example's (:func:`couples_examples`): per-example ones would be
biased there.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.autograd.forward_ad as fwAD
from torch import nn
from torch._C._functorch import _add_batch_dim, _unwrap_for_grad, maybe_current_level
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from .forward_ad_engine import _attention_with_forward_ad
from .lean import _reads_metadata_only
from .reference import compute_dtype


def perturbed_layers(module: nn.Module, params: Sequence[torch.Tensor]) -> dict[nn.Module, None]:
    """The modules of ``module`` that directly hold any of ``params`` (every holder of a tied parameter), in
    ``module.modules()`` order: the layers whose outputs the activity estimator perturbs.

    Raises ``ValueError`` naming a parameter that no module of ``module`` holds.
    """
    wanted = {id(p) for p in params}
    layers: dict[nn.Module, None] = {}
    held = set()
    for layer in module.modules():
        for p in layer.parameters(recurse=False):
            if id(p) in wanted:
                layers[layer] = None
                held.add(id(p))
    names = {id(p): n for n, p in module.named_parameters()}
    for p in params:
        if id(p) not in held:
            raise ValueError(f"estimator='activity' perturbs the outputs of the modules that hold the parameters; "
                             f"parameter {names.get(id(p), '?')!r} (shape {tuple(p.shape)}) is held by no module of "
                             f"the module given to the optimizer (use estimator='weight')")
    return layers


def couples_examples(module: nn.Module) -> bool:
    """Whether a layer of ``module`` mixes the examples of a batch in its forward (a BatchNorm in train mode
    normalises by the batch's statistics).

    Then example b's loss depends on every example's activations, and ``c_b u_b`` (example b's directional
    derivative times b's tangent) misses the other examples' losses' share of the gradient at b: biased.
    The estimator uses the whole batch's directional derivative for every example instead, ``(sum_b' c_b')
    u_b``: unbiased again, with more variance."""
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training for m in module.modules())


def _batch_coupled(c: torch.Tensor, coupled: bool) -> torch.Tensor:
    """c (per example along its last dimension), or each row's sum in every place when examples are coupled."""
    return c.sum(-1, keepdim=True).expand_as(c).contiguous() if coupled else c


def _check_losses(losses: object) -> torch.Tensor:
    if not isinstance(losses, torch.Tensor) or not losses.is_floating_point() or losses.dim() != 1:
        described = (f"a tensor of shape {tuple(losses.shape)}, dtype {losses.dtype}" if isinstance(losses, torch.Tensor)
                     else type(losses).__name__)
        raise ValueError(f"with estimator='activity' the closure must return the per-example losses (a 1-D "
                         f"floating-point tensor, e.g. F.cross_entropy(logits, y, reduction='none')), got {described}")
    return losses


class _Perturbation(TorchFunctionMode):
    """Forward hooks that add a tangent to each call of the perturbed layers and record the call's input.

    As a torch-function mode it also refuses any use of a perturbed layer's parameter outside that layer's
    forward (a tied weight used through ``F.linear``, a penalty in the closure): the estimate is built from
    the layers' outputs only, so such a use would be silently missing from it.
    """

    def __init__(self, layers, tangents: Callable[[torch.Tensor, int], torch.Tensor],
                 primal_of: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        # primal_of: the input's value without its tangent (keeping the dual would keep the tangent alive)
        self.layers, self.tangents, self.primal_of = layers, tangents, primal_of
        # (layer, its inputs (args, kwargs) without tangents, output meta, offset) per perturbed call
        self.calls: list[tuple[nn.Module, tuple, tuple, int]] = []
        self.offset = 0
        self.inside = 0  # depth of perturbed-layer forwards being run
        self.params = {id(p) for layer in layers for p in layer.parameters(recurse=False)}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.inside and not _reads_metadata_only(func):
            for a in (*args, *kwargs.values()):
                for t in (a if isinstance(a, (list, tuple)) else (a,)):
                    if isinstance(t, torch.Tensor) and id(t) in self.params:
                        raise ValueError(
                            f"estimator='activity': a parameter of shape {tuple(t.shape)} of a perturbed layer is "
                            f"used outside that layer's forward (by {getattr(func, '__name__', func)}), a use the "
                            f"estimate cannot see; use estimator='weight', or leave that layer out of params")
        return func(*args, **kwargs)

    def _enter_layer(self, layer, args, kwargs):
        self.inside += 1

    def _hook(self, layer, args, kwargs, out):
        self.inside -= 1
        if not isinstance(out, torch.Tensor) or not out.is_floating_point():
            raise ValueError(f"estimator='activity' perturbs the output of every layer that holds a parameter; "
                             f"{type(layer).__name__} returned {type(out).__name__}, not one floating-point tensor "
                             f"(use estimator='weight', or leave that layer's parameters out of params)")
        meta = (out.shape, out.dtype, out.device)
        self.calls.append((layer, _map_tensors(self.primal_of, (args, kwargs)), meta, self.offset))
        u = self.tangents(out, self.offset)
        self.offset += -(-out.numel() // 4) * 4
        return out + fwAD.make_dual(torch.zeros(out.shape, dtype=out.dtype, device=out.device), u)

    def __enter__(self):
        self.handles = [layer.register_forward_hook(self._hook, with_kwargs=True) for layer in self.layers]
        self.handles += [layer.register_forward_pre_hook(self._enter_layer, with_kwargs=True) for layer in self.layers]
        return super().__enter__()

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        return super().__exit__(*exc)


def _map_tensors(fn, inputs):
    """(args, kwargs) with ``fn`` applied to every tensor among them (lists and tuples looked into)."""
    def one(x):
        if isinstance(x, torch.Tensor):
            return fn(x)
        if isinstance(x, (list, tuple)):
            return type(x)(one(v) for v in x)
        return x
    args, kwargs = inputs
    return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}


def _first_input(inputs) -> torch.Tensor:
    args, kwargs = inputs
    return args[0] if args else kwargs["input"]


def _layer_vjp(layer: nn.Module, inputs, dz: torch.Tensor, acc: torch.dtype) -> dict[int, torch.Tensor]:
    """``(dz_l/dtheta)^T dz`` for each parameter theta the layer holds directly, by the vector-Jacobian product
    of the layer's own forward at its recorded inputs (its buffers copied: a second run must not move a
    BatchNorm's running statistics)."""
    names = [n for n, p in layer.named_parameters(recurse=False)]
    # plain autograd, not torch.func.vjp: a BatchNorm in train mode updates its (copied) buffers in place
    weights = [getattr(layer, n).detach().requires_grad_() for n in names]
    buffers = {n: b.clone() for n, b in layer.named_buffers(recurse=False)}
    args, kwargs = inputs
    with torch.enable_grad():
        out = torch.func.functional_call(layer, {**dict(zip(names, weights)), **buffers}, args, kwargs)
        grads = torch.autograd.grad(out, weights, dz.to(out.dtype), allow_unused=True)
    return {id(getattr(layer, n)): (torch.zeros_like(w) if g is None else g).detach().to(acc)
            for n, w, g in zip(names, weights, grads)}


def _add_call_estimate(layer, inputs, meta, offset, c: torch.Tensor, tangent_ids: Sequence[int], make_tangent,
                       num_tangents: int, grads: dict[int, torch.Tensor]) -> None:
    """Adds one layer call's share of g_hat to ``grads``. Row r of c (shape (k, N)) belongs to tangent
    ``tangent_ids[r]``, whose values are drawn again from the stream (nothing tangent-sized was kept)."""
    shape, dtype, device = meta
    n = c.shape[1]
    if len(shape) < 1 or shape[0] not in (n, 1):
        raise ValueError(f"estimator='activity': a {type(layer).__name__} output of shape {tuple(shape)} does not "
                         f"start with the batch dimension of the {n} per-example losses (batch-first layouts only)")
    # an output of batch 1 is shared by every example (GPT-2's position embedding, broadcast over the batch):
    # its tangent perturbs all of them, so its share takes the batch's sum of c
    shared = shape[0] == 1 and n > 1
    acc = compute_dtype(dtype)  # float32 sums for float16 / bfloat16 layers, as the fused step keeps v
    dz = torch.zeros(shape, dtype=acc, device=device)
    for row, t in enumerate(tangent_ids):
        u = make_tangent(torch.empty(shape, dtype=dtype, device=device), offset, t)
        c_row = c[row].sum(0, keepdim=True) if shared else c[row]
        dz.addcmul_(c_row.to(acc).view(shape[0], *[1] * (len(shape) - 1)), u.to(acc))
    dz.div_(num_tangents * n)
    if type(layer) is not nn.Linear:
        for key, g in _layer_vjp(layer, inputs, dz, acc).items():
            grads[key] = grads[key].add_(g) if key in grads else g
        return
    h = _first_input(inputs)
    dz = dz.reshape(-1, shape[-1])
    weight = grads.setdefault(id(layer.weight), torch.zeros_like(layer.weight, dtype=acc))
    weight.add_(dz.T @ h.reshape(-1, h.shape[-1]).to(acc))
    if layer.bias is not None:
        bias = grads.setdefault(id(layer.bias), torch.zeros_like(layer.bias, dtype=acc))
        bias.add_(dz.sum(0))


def _recompute_estimate(layers, closure, calls, losses: torch.Tensor, c: torch.Tensor, make_tangent,
                        num_tangents: int, grads: dict[int, torch.Tensor]) -> None:
    """The estimate from a second, plain forward: each layer's input is used when that layer runs, then freed.

    The second pass must repeat the first (same calls, same losses); a closure that does not (dropout in
    train mode, data-dependent randomness) raises ``ValueError`` rather than mixing two different passes.
    """
    seen = [0]
    estimating = [False]  # a layer's own vjp runs its forward again (and its children's): not a call of the pass

    def hook(layer, args, kwargs, out):
        if estimating[0]:
            return
        i = seen[0]
        if i >= len(calls) or calls[i][0] is not layer or tuple(out.shape) != tuple(calls[i][2][0]):
            raise ValueError("recompute_inputs=True: the second forward pass called the perturbed layers differently "
                             "from the first; the closure must be deterministic (no dropout in train mode)")
        estimating[0] = True
        try:
            _add_call_estimate(layer, (args, kwargs), calls[i][2], calls[i][3], c, range(num_tangents), make_tangent,
                               num_tangents, grads)
        finally:
            estimating[0] = False
        seen[0] += 1

    handles = [layer.register_forward_hook(hook, with_kwargs=True) for layer in layers]
    try:
        again = _check_losses(closure())
    finally:
        for h in handles:
            h.remove()
    scale = float(losses.abs().max()) if losses.numel() else 0.0
    if seen[0] != len(calls) or again.shape != losses.shape or not torch.allclose(again, losses, rtol=1e-4,
                                                                                    atol=1e-6 * max(1.0, scale)):
        raise ValueError("recompute_inputs=True: the second forward pass gave other losses than the first; the "
                         "closure must be deterministic (no dropout in train mode, no random augmentation inside)")


# Eager always: a compiled caller graph-breaks here (dynamo would trace the hooks and the torch-function mode
# in an order that breaks both), and the closure it runs is not compiled either.
@torch.compiler.disable
def activity_gradients(module: nn.Module, params: Sequence[torch.Tensor], closure: Callable[[], torch.Tensor],
                       make_tangent: Callable[[torch.Tensor, int, int], torch.Tensor], num_tangents: int,
                       in_one_pass: bool = False, recompute_inputs: bool = False,
                       ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Mean loss and the activity-perturbed gradient estimate of every parameter in ``params``.

    ``make_tangent(out, offset, t)`` fills the buffer ``out`` (the shape, dtype and device of a linear
    output) with tangent t from ``offset`` of the stream and returns it; it must give the same values
    every time. ``closure`` returns per-example losses. With ``in_one_pass`` the K tangents travel
    through one forward (``torch.func.vmap`` over ``torch.func.jvp``: the primal runs once; not for
    closures that update captured state in place, such as BatchNorm in train mode); otherwise one
    forward-mode pass per tangent. With ``recompute_inputs`` nothing activation-sized is kept through
    the forward-mode pass(es): a second, plain forward supplies each layer's input when the estimate
    needs it (one more forward; the closure must be deterministic). Returns ``(loss, {id(p): g_hat})``;
    a parameter the forward never used gets a zero estimate (its exact gradient).
    """
    params = list(params)
    layers = perturbed_layers(module, params)
    coupled = couples_examples(module)
    grads: dict[int, torch.Tensor] = {}
    keep = not recompute_inputs
    with torch.inference_mode(False), torch.no_grad(), _attention_with_forward_ad():
        if in_one_pass:
            losses, c, calls, inputs = _one_pass(layers, closure, make_tangent, num_tangents, keep)
            c = _batch_coupled(c, coupled)
            for call, h in zip(calls, inputs if keep else ()):
                _add_call_estimate(call[0], h, call[2], call[3], c, range(num_tangents), make_tangent,
                                   num_tangents, grads)
        else:
            rows = []
            for t in range(num_tangents):
                def tangent(out, offset, t=t):
                    return make_tangent(torch.empty(out.shape, dtype=out.dtype, device=out.device), offset, t)

                primal_of = (lambda x: fwAD.unpack_dual(x).primal) if keep else (lambda x: None)
                with fwAD.dual_level(), _Perturbation(layers, tangent, primal_of) as pert:
                    out = _check_losses(closure())
                    primal, c_t = fwAD.unpack_dual(out)
                    c_t = _batch_coupled(torch.zeros_like(primal) if c_t is None else c_t, coupled)
                losses = primal if t == 0 else losses
                calls = pert.calls
                if keep:  # this pass's share now, so that its inputs go
                    for layer, h, meta, offset in calls:
                        _add_call_estimate(layer, h, meta, offset, c_t[None], [t], make_tangent, num_tangents, grads)
                rows.append(c_t)
            c = torch.stack(rows)
        if recompute_inputs:
            _recompute_estimate(layers, closure, calls, losses, c, make_tangent, num_tangents, grads)
    # the fused step takes gradients in the parameter's dtype
    return losses.mean().detach(), {id(p): grads[id(p)].to(p.dtype) if id(p) in grads else torch.zeros_like(p)
                                    for p in params}


def _one_pass(layers, closure, make_tangent, num_tangents, keep_inputs=True):
    records = {}

    def one_pass(_):
        level = maybe_current_level()

        def tangents(out, offset):  # the K tangents as one batched tensor of the vmap level
            with torch._C._DisableFuncTorch():
                u = torch.empty((num_tangents, *out.shape), dtype=out.dtype, device=out.device)
                for t in range(num_tangents):
                    make_tangent(u[t], offset, t)
            return _add_batch_dim(u, 0, level)

        def run(_):
            jvp_level = maybe_current_level()
            primal_of = (lambda x: _unwrap_for_grad(x, jvp_level)) if keep_inputs else (lambda x: None)
            with _Perturbation(layers, tangents, primal_of) as pert:
                losses = _check_losses(closure())
            records["calls"] = pert.calls
            if not keep_inputs:
                return losses, []
            # vmap returns tensors only: the inputs' tensors go out, the rest of their structure stays here
            flat, records["spec"] = tree_flatten([inputs for _, inputs, _, _ in pert.calls])
            records["flat"] = flat
            return losses, [x for x in flat if isinstance(x, torch.Tensor)]

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
    if not keep_inputs:
        return losses, c, records["calls"], []
    tensors = iter(inputs)
    flat = [next(tensors) if isinstance(x, torch.Tensor) else x for x in records["flat"]]
    return losses, c, records["calls"], tree_unflatten(flat, records["spec"])
