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

Scaled tangents (``tangent_scale="rms"``): the noise of every layer's estimate carries ``Var(c_b) = sum_l
||dL_b/dz_{l,b}||^2`` over all perturbed outputs, and ahead of a LayerNorm a small output has a large gradient
(the normalisation undoes its scale): GPT-2's embeddings, of std 0.02, swamp every other layer's estimate.
Output l's tangent is then ``sigma_l u_l`` with ``sigma_l`` its root mean square in this pass, and its estimate
divides by ``sigma_l``: ``E[c sigma_l u_l] / sigma_l^2 = dL/dz_l``, unbiased, with each output's share of the
variance ``sigma_l^2 ||dL/dz_l||^2``.

Tangents come from the library's stream (``fill_tangent_``), so a run is reproducible: the t-th tangent
of step k for the i-th perturbed call of the forward lives at offset ``sum of the earlier calls' output
sizes`` (each rounded up to a multiple of 4), ``tangent_id`` t.

Layers: every module that directly holds one of the parameters is perturbed (each of them, for a weight
tied between two modules); an ``nn.MultiheadAttention`` also answers for its ``out_proj``'s parameters,
which its forward reads itself (``out_proj``'s own forward never runs). ``nn.Linear`` takes the closed form
above; any other layer (convolutions, embeddings, normalisation layers, attention, Hugging Face's
``Conv1D``, ...) takes the same chain rule through the vector-Jacobian product of its own forward at the
recorded inputs, ``g_hat(theta_l) = (dz_l/dtheta_l)^T dz_hat_l`` with ``dz_hat_l = 1/(K N) sum_k c_k u_{k,l}``
(autograd through the layer alone, its buffers copied so that a BatchNorm's running statistics move once
per step, as in a plain forward). Of a layer that returns a tuple (``nn.MultiheadAttention``'s
``(attn_output, attn_weights)``) the first output is perturbed and the others pass as they are: they must
not reach the loss (the estimate cannot see that path), so a torch call on one of them raises
``ValueError`` (call the attention with ``need_weights=False``, as torchvision's ViT does).

Which directional derivative weights a perturbed output's tangent:

* per example, ``c_b`` on row b, for an output computed from the batch: it must be batch-first (its first
  dimension is the batch of the N per-example losses, row b feeding example b's loss only), else
  ``ValueError`` (a sequence-first layout; ``nn.MultiheadAttention(batch_first=False)`` whatever its
  sizes, while another layer's ``(L, N, .)`` output with L equal to N looks batch-first).
* the batch's sum ``sum_b c_b`` on every entry, for an output shared by the batch: its tangent moves every
  example's loss, and ``E[(sum_b c_b) u] = d(sum_b L_b)/dz`` whatever the output's layout (the per-example
  split is a variance reduction that holds for batch-first outputs only). Shared is an output of first
  dimension 1 (a position embedding broadcast over the batch, as GPT-2's), and an output computed from
  batch-free tensors only, whatever its shape: the module's parameters and buffers, tensors the forward
  makes from sizes (``torch.arange``, ``torch.zeros``, ...) and what is computed from these alone. T5's
  relative-position bias, an ``nn.Embedding`` of a (query, key) grid of buckets built from
  ``torch.arange``, is one, even when the query length equals N. Every other tensor carries the batch:
  those the closure captures (its inputs) and those it makes from data (``torch.tensor(...)``).
* the batch's sum for every output of a model with a layer that mixes the examples of a batch (BatchNorm
  in train mode, :func:`couples_examples`): per-example ones would be biased there.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.autograd.forward_ad as fwAD
from torch import nn
from torch._C._functorch import _add_batch_dim, _unwrap_for_grad, maybe_current_level
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.weak import WeakIdKeyDictionary

from .forward_ad_engine import _attention_with_forward_ad
from .lean import _reads_metadata_only
from .reference import compute_dtype


def _answered_names(layer: nn.Module) -> list[str]:
    """Names (relative to ``layer``) of the parameters whose estimate comes from ``layer``'s output: those it
    holds directly, and an ``nn.MultiheadAttention``'s ``out_proj`` ones, which its forward uses itself."""
    return [n for n, _ in layer.named_parameters(recurse=isinstance(layer, nn.MultiheadAttention))]


def perturbed_layers(module: nn.Module, params: Sequence[torch.Tensor]) -> dict[nn.Module, None]:
    """The modules of ``module`` that answer for any of ``params`` (every holder of a tied parameter), in
    ``module.modules()`` order: the layers whose outputs the activity estimator perturbs. A module answers
    for the parameters it holds directly; an ``nn.MultiheadAttention`` for its ``out_proj``'s as well (its
    forward reads them, never calling ``out_proj``), so ``out_proj`` is not perturbed itself.

    Raises ``ValueError`` naming a parameter that no module of ``module`` holds.
    """
    wanted = {id(p) for p in params}
    read_by_parent = {id(m.out_proj) for m in module.modules() if isinstance(m, nn.MultiheadAttention)}
    layers: dict[nn.Module, None] = {}
    held = set()
    for layer in module.modules():
        if id(layer) in read_by_parent:
            continue
        for name in _answered_names(layer):
            p = layer.get_parameter(name)
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


def _check_losses(losses: object) -> torch.Tensor:
    if not isinstance(losses, torch.Tensor) or not losses.is_floating_point() or losses.dim() != 1:
        described = (f"a tensor of shape {tuple(losses.shape)}, dtype {losses.dtype}" if isinstance(losses, torch.Tensor)
                     else type(losses).__name__)
        raise ValueError(f"with estimator='activity' the closure must return the per-example losses (a 1-D "
                         f"floating-point tensor, e.g. F.cross_entropy(logits, y, reduction='none')), got {described}")
    return losses


# torch calls that make a tensor from data (the batch, built inside the closure), not from sizes alone
_FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray, torch.Tensor.new_tensor}
_IN_PLACE_OPERATORS = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                       "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__"}


def _tensors_among(values) -> list[torch.Tensor]:
    """The tensors among ``values``, lists and tuples looked into (one level, as torch's calls take them)."""
    return [t for v in values for t in (v if isinstance(v, (list, tuple)) else (v,)) if isinstance(t, torch.Tensor)]


def _written_in_place(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors an in-place call writes (its first argument, or ``out=``): they take its result's batch."""
    if "out" in kwargs:
        return _tensors_among([kwargs["out"]])
    name = getattr(func, "__name__", "")
    in_place = (name.endswith("_") and not name.endswith("__")) or name in _IN_PLACE_OPERATORS
    return _tensors_among(args[:1]) if in_place else []


def _first_output(out):
    """A layer's output to perturb: the output itself, or the first of a tuple or list of outputs."""
    return out[0] if type(out) in (tuple, list) and out else out


class _Perturbation(TorchFunctionMode):
    """Forward hooks that add a tangent to each call of the perturbed layers and record the call's input.

    As a torch-function mode it sees every torch call of the pass, and

    * refuses a use of a perturbed layer's parameter anywhere but in the forward of a layer that answers for
      it (a tied weight used through ``F.linear``, a penalty in the closure, a child's weight read by a
      parent that does not answer for it) and a use of the unperturbed outputs of a layer that returns
      several: the estimate is built from the perturbed outputs only, so such a use would be missing from it;
    * follows which tensors are batch-free (the module's parameters and buffers, tensors made from sizes,
      and results of calls on batch-free tensors only): an output of a perturbed layer that is batch-free is
      shared by the batch, and takes the batch's sum of the directional derivatives.
    """

    def __init__(self, module: nn.Module, layers, tangents: Callable[[torch.Tensor, int], torch.Tensor],
                 value_of: Callable[[torch.Tensor], torch.Tensor], keep_inputs: bool, tangent_scale: str):
        super().__init__()
        # value_of: a tensor's value without its tangent (keeping the dual would keep the tangent alive)
        self.layers, self.tangents, self.value_of = layers, tangents, value_of
        self.primal_of = value_of if keep_inputs else (lambda x: None)
        self.tangent_scale = tangent_scale
        # (layer, its inputs (args, kwargs) without tangents, output meta, offset) per perturbed call
        self.calls: list[tuple[nn.Module, tuple, tuple, int]] = []
        self.offset = 0
        self.running: list[nn.Module] = []  # the perturbed-layer forwards being run, innermost last
        self.answered = {layer: {id(layer.get_parameter(n)) for n in _answered_names(layer)} for layer in layers}
        self.params = set().union(*self.answered.values())
        # weak keys: a freed tensor's id may come back on a tensor that carries the batch
        self.batch_free = WeakIdKeyDictionary(dict.fromkeys([*module.parameters(), *module.buffers()]))
        self.unperturbed = WeakIdKeyDictionary()  # the outputs a layer returned besides the one perturbed

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _reads_metadata_only(func):
            return func(*args, **kwargs)
        inputs = _tensors_among((*args, *kwargs.values()))
        for t in inputs:
            if id(t) in self.params and not (self.running and id(t) in self.answered[self.running[-1]]):
                raise ValueError(
                    f"estimator='activity': a parameter of shape {tuple(t.shape)} of a perturbed layer is used "
                    f"outside that layer's forward (by {getattr(func, '__name__', func)}), a use the estimate "
                    f"cannot see; use estimator='weight', or leave that layer out of params")
            if self.unperturbed and t in self.unperturbed:
                raise ValueError(
                    f"estimator='activity' perturbs the first output of a layer that returns several; another "
                    f"of its outputs (shape {tuple(t.shape)}) is used (by {getattr(func, '__name__', func)}), a "
                    f"path the estimate cannot see (for nn.MultiheadAttention pass need_weights=False)")
        out = func(*args, **kwargs)
        batch_free = func not in _FROM_DATA and all(t in self.batch_free for t in inputs)
        for t in (*_tensors_among([out]), *_written_in_place(func, args, kwargs)):
            if batch_free:
                self.batch_free[t] = None
            else:
                self.batch_free.pop(t, None)
        return out

    def _enter_layer(self, layer, args, kwargs):
        self.running.append(layer)

    def _hook(self, layer, args, kwargs, out):
        self.running.pop()
        z = _first_output(out)
        if not isinstance(z, torch.Tensor) or not z.is_floating_point():
            raise ValueError(f"estimator='activity' perturbs the output of every layer that holds a parameter; "
                             f"{type(layer).__name__} returned {type(out).__name__}, neither a floating-point "
                             f"tensor nor a tuple that starts with one (use estimator='weight', or leave that "
                             f"layer's parameters out of params)")
        if isinstance(layer, nn.MultiheadAttention) and not layer.batch_first and z.dim() == 3:
            # (L, N, E) whatever L is: a length equal to N would pass the batch-first check below
            raise ValueError("estimator='activity' takes batch-first layouts only; nn.MultiheadAttention with "
                             "batch_first=False returns (L, N, E), whose rows are not the examples (build it with "
                             "batch_first=True)")
        shared = z in self.batch_free
        with torch._C.DisableTorchFunction():  # drawing the tangent is no call of the model's
            scale = _scale_of(self.value_of(z), self.tangent_scale)
            u = self.tangents(z, self.offset)
            if scale is not None:
                u = u * scale
        meta = (z.shape, z.dtype, z.device, shared, scale)
        self.calls.append((layer, _map_tensors(self.primal_of, (args, kwargs)), meta, self.offset))
        self.offset += -(-z.numel() // 4) * 4
        perturbed = z + fwAD.make_dual(torch.zeros(z.shape, dtype=z.dtype, device=z.device), u)
        if shared:  # the tangent is drawn unseen: the sum would not look batch-free
            self.batch_free[perturbed] = None
        if z is out:
            return perturbed
        for t in _tensors_among(out[1:]):
            if t.is_floating_point():  # what could carry a parameter's gradient to the loss
                self.unperturbed[t] = None
        return type(out)((perturbed, *out[1:]))

    def __enter__(self):
        self.handles = [layer.register_forward_hook(self._hook, with_kwargs=True) for layer in self.layers]
        self.handles += [layer.register_forward_pre_hook(self._enter_layer, with_kwargs=True) for layer in self.layers]
        return super().__enter__()

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        return super().__exit__(*exc)


# the standard deviation of a perturbed output's tangent: 1 (N(0, I)), or the output's root mean square
TANGENT_SCALES = ("unit", "rms")


def _scale_of(z: torch.Tensor, rule: str) -> torch.Tensor | None:
    """sigma of a perturbed output's tangent ``sigma u`` (``None``: 1), a 0-dim tensor of the compute dtype from
    the output's value ``z`` in this pass: its root mean square for ``"rms"`` (1 where z is all zero). It is
    known before the tangent is drawn, so the estimate ``c u / sigma`` stays unbiased."""
    if rule == "unit":
        return None
    with torch._C._DisableFuncTorch():  # a reduction, no output-sized temporary
        rms = torch.linalg.vector_norm(z.detach(), dtype=compute_dtype(z.dtype)) / max(1, z.numel()) ** 0.5
        return torch.where(rms > 0, rms, torch.ones_like(rms))


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
    """``(dz_l/dtheta)^T dz`` for each parameter theta the layer answers for, by the vector-Jacobian product
    of the layer's own forward at its recorded inputs (its buffers copied: a second run must not move a
    BatchNorm's running statistics); z_l is the perturbed output (a tuple's first)."""
    names = _answered_names(layer)
    # plain autograd, not torch.func.vjp: a BatchNorm in train mode updates its (copied) buffers in place
    weights = [layer.get_parameter(n).detach().requires_grad_() for n in names]
    buffers = {n: b.clone() for n, b in layer.named_buffers(recurse=False)}
    args, kwargs = inputs
    with torch.enable_grad():
        out = _first_output(torch.func.functional_call(layer, {**dict(zip(names, weights)), **buffers}, args, kwargs))
        grads = torch.autograd.grad(out, weights, dz.to(out.dtype), allow_unused=True)
    return {id(layer.get_parameter(n)): (torch.zeros_like(w) if g is None else g).detach().to(acc)
            for n, w, g in zip(names, weights, grads)}


def _add_call_estimate(layer, inputs, meta, offset, c: torch.Tensor, coupled: bool, tangent_ids: Sequence[int],
                       make_tangent, num_tangents: int, grads: dict[int, torch.Tensor]) -> None:
    """Adds one layer call's share of g_hat to ``grads``. Row r of c (shape (k, N), per example) belongs to
    tangent ``tangent_ids[r]``, whose values are drawn again from the stream (nothing tangent-sized was kept);
    ``coupled``: the model mixes the examples of a batch."""
    shape, dtype, device, batch_free, scale = meta
    n = c.shape[1]
    # the batch's sum of c for an output shared by the batch (batch-free, or of batch 1 and broadcast as
    # GPT-2's position embedding: its tangent moves every example's loss), and everywhere when coupled
    whole_batch = batch_free or coupled or (len(shape) > 0 and shape[0] == 1)
    if not whole_batch and (len(shape) < 1 or shape[0] != n):
        raise ValueError(f"estimator='activity': a {type(layer).__name__} output of shape {tuple(shape)} is computed "
                         f"from the batch but does not start with the batch dimension of the {n} per-example losses "
                         f"(batch-first layouts only, e.g. nn.MultiheadAttention(batch_first=True))")
    acc = compute_dtype(dtype)  # float32 sums for float16 / bfloat16 layers, as the fused step keeps v
    dz = torch.zeros(shape, dtype=acc, device=device)
    for row, t in enumerate(tangent_ids):
        u = make_tangent(torch.empty(shape, dtype=dtype, device=device), offset, t)
        weight = c[row].sum().view([1] * len(shape)) if whole_batch else c[row].view(n, *[1] * (len(shape) - 1))
        dz.addcmul_(weight.to(acc), u.to(acc))
    dz.div_(num_tangents * n)
    if scale is not None:  # the tangent was sigma u: E[c sigma u] = sigma^2 dL/dz, so c u / sigma is unbiased
        dz.div_(scale.to(acc))
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


def _recompute_estimate(layers, closure, calls, losses: torch.Tensor, c: torch.Tensor, coupled: bool, make_tangent,
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
        z = _first_output(out)
        if i >= len(calls) or calls[i][0] is not layer or tuple(getattr(z, "shape", ())) != tuple(calls[i][2][0]):
            raise ValueError("recompute_inputs=True: the second forward pass called the perturbed layers differently "
                             "from the first; the closure must be deterministic (no dropout in train mode)")
        estimating[0] = True
        try:
            _add_call_estimate(layer, (args, kwargs), calls[i][2], calls[i][3], c, coupled, range(num_tangents),
                               make_tangent, num_tangents, grads)
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
                       in_one_pass: bool = False, recompute_inputs: bool = False, tangent_scale: str = "unit",
                       ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Mean loss and the activity-perturbed gradient estimate of every parameter in ``params``.

    ``make_tangent(out, offset, t)`` fills the buffer ``out`` (the shape, dtype and device of a perturbed
    output) with tangent t from ``offset`` of the stream and returns it; it must give the same values
    every time. ``closure`` returns per-example losses. With ``in_one_pass`` the K tangents travel
    through one forward (``torch.func.vmap`` over ``torch.func.jvp``: the primal runs once; not for
    closures that update captured state in place, such as BatchNorm in train mode); otherwise one
    forward-mode pass per tangent. With ``recompute_inputs`` nothing activation-sized is kept through
    the forward-mode pass(es): a second, plain forward supplies each layer's input when the estimate
    needs it (one more forward; the closure must be deterministic). Returns ``(loss, {id(p): g_hat})``;
    a parameter the forward never used gets a zero estimate (its exact gradient).
    """
    if tangent_scale not in TANGENT_SCALES:
        raise ValueError(f"tangent_scale must be one of {TANGENT_SCALES}, got {tangent_scale!r}")
    params = list(params)
    layers = perturbed_layers(module, params)
    coupled = couples_examples(module)
    grads: dict[int, torch.Tensor] = {}
    keep = not recompute_inputs
    with torch.inference_mode(False), torch.no_grad(), _attention_with_forward_ad():
        if in_one_pass:
            losses, c, calls, inputs = _one_pass(module, layers, closure, make_tangent, num_tangents, keep,
                                                 tangent_scale)
            for call, h in zip(calls, inputs if keep else ()):
                _add_call_estimate(call[0], h, call[2], call[3], c, coupled, range(num_tangents), make_tangent,
                                   num_tangents, grads)
        else:
            rows = []
            for t in range(num_tangents):
                def tangent(out, offset, t=t):
                    return make_tangent(torch.empty(out.shape, dtype=out.dtype, device=out.device), offset, t)

                with fwAD.dual_level(), _Perturbation(module, layers, tangent, lambda x: fwAD.unpack_dual(x).primal,
                                                      keep, tangent_scale) as pert:
                    out = _check_losses(closure())
                    primal, c_t = fwAD.unpack_dual(out)
                    c_t = torch.zeros_like(primal) if c_t is None else c_t
                losses = primal if t == 0 else losses
                calls = pert.calls
                if keep:  # this pass's share now, so that its inputs go
                    for layer, h, meta, offset in calls:
                        _add_call_estimate(layer, h, meta, offset, c_t[None], coupled, [t], make_tangent,
                                           num_tangents, grads)
                rows.append(c_t)
            c = torch.stack(rows)
        if recompute_inputs:
            _recompute_estimate(layers, closure, calls, losses, c, coupled, make_tangent, num_tangents, grads)
    # the fused step takes gradients in the parameter's dtype
    return losses.mean().detach(), {id(p): grads[id(p)].to(p.dtype) if id(p) in grads else torch.zeros_like(p)
                                    for p in params}


def _one_pass(module, layers, closure, make_tangent, num_tangents, keep_inputs=True, tangent_scale="unit"):
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
            with _Perturbation(module, layers, tangents, lambda x: _unwrap_for_grad(x, jvp_level), keep_inputs,
                               tangent_scale) as pert:
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
