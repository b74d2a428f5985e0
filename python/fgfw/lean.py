"""The lean forward-gradient engine: just-in-time tangents and lean forward-mode rules.

``c = <grad f(theta), u>`` as in :mod:`fgfw.forward_grad`, computed so that a step costs about what an
inference forward costs.

Just-in-time tangents, carried beside the primals
-------------------------------------------------
The one-tangent engine runs the closure under a ``TorchFunctionMode`` that sees every torch call
(:class:`fgfw.tangent_carrier.TangentCarrier`). When a call takes one of the given parameters (directly, in a
list such as an RNN's flat weights, or as ``self`` of a method or property such as ``W.T``), the parameter's
tangent ``make_tangent(j)`` is materialised *for that call only*; when the call returns, nothing refers to
it any more and it is freed (unless the call returned a view of the parameter: the view keeps its tangent
as long as it lives, which is exactly what forward mode needs). So tangent memory is one layer's
parameters, not the whole model's, and every use of a parameter gets its tangent: attribute access, tied
weights, parametrizations, parameters the closure captured itself. A parameter used in two calls
regenerates the same values (the tangent stream is a pure function of (seed, step, index)). Metadata
reads (``p.shape``, ``p.dtype``, ``p.size()`` ...) pass through without a tangent. The activations' tangents
are kept beside them in the carrier's table, not as forward-AD duals: a dual made, unpacked or viewed costs
torch's bookkeeping ops on every call, which made the pass host-bound (see :mod:`fgfw.tangent_carrier` for
how each call is carried; calls without a carried rule take torch's own forward-mode rule on duals made for
that call alone).

Lean rules
----------
Torch's stock forward-mode rules are correct but not lean: the linear rule materialises a zero tangent
for an input without one (input-sized) and adds terms apart (five output-sized buffers where two
suffice). The calls below are routed to ``torch.autograd.Function`` subclasses with a ``jvp``
staticmethod that accumulate in place; they work under ``torch.autograd.forward_ad`` and
``torch.func.jvp`` / ``vmap`` (``generate_vmap_rule``), and so compose with the stock rules of
everything else. The one-tangent engine runs a rule's ``forward``, ``setup_context`` and ``jvp`` itself
on the primals and tangents (:func:`_apply`): ``Function.apply``'s per-call machinery costs more than a
small layer's kernels; a rule with a ``fused_forward_and_jvp`` (layer_norm with the forward's own row
statistics, attention's Triton kernel) gives both at once there. Buffers beyond ``y`` and ``y_dot``, per rule:

* ``F.linear`` (``nn.Linear``): none (``F.linear`` of the weight tangent, then ``addmm_`` into it).
* ``torch.addmm`` (Hugging Face GPT-2's ``Conv1D``, weight stored (in, out)): none, likewise; torch's rule
  computes the three products apart and adds them (two more output-sized buffers, five kernels instead of three).
* ``torch.mul`` and ``*`` (two floating tensors of one dtype, or a tensor and a Python number: GELU's
  polynomial, scalings): none (``a_dot b``, then ``addcmul_`` of ``a b_dot`` into it); torch's rule materialises
  a zero tangent for a factor without one and converts a number to a tensor first.
* ``F.conv2d`` (``nn.Conv2d``): one 1/8-output chunk (the input-tangent term is added batch chunk by
  batch chunk).
* ``F.layer_norm``: the normalised input ``x_hat`` (row statistics by batched dot products, no
  product temporaries; the one-tangent engine takes the forward's statistics instead, with one more
  transient of the input's size).
* ``F.softmax`` and ``F.cross_entropy`` (class-index targets, no class weights or label smoothing):
  one logits-sized buffer (the softmax), the loss tangent is ``<softmax(z), z_dot> - z_dot[y]``.
* ``F.scaled_dot_product_attention``: the primal runs on any backend (flash / memory-efficient kernels
  have no forward-mode rule, but the rule never differentiates through them); the tangent
  ``dO = dP V + P dV`` with ``dP = P * (dS - rowsum(P * dS))`` is computed chunk by chunk of query rows,
  so no (L x L) tangent, and no (L x L) primal beyond one chunk, is ever stored. Its products are one ``bmm``
  each over the flattened heads, on operands made contiguous once per call (heads split off a fused projection
  are strided views that ``torch.matmul`` would copy chunk after chunk). On CUDA, without ``attn_mask``, in
  bfloat16 or float16 (float32 where torch allows TF32) with head dim 16, 32, 64 or 128, one Triton kernel
  (``fgfw.triton.attention_jvp``) gives the primal and the tangent in a single flash-style pass instead: none
  (nothing of (L x L) size, not even a chunk; :func:`fused_attention_jvp_applies` decides). The batched engine
  (``vmap``) keeps the chunks.
* ``F.multi_head_attention_forward`` (``nn.MultiheadAttention`` with ``need_weights=False``, hence
  ``nn.TransformerEncoderLayer``): in-projection, attention and out-projection by the rules above.

``F.relu`` and ``F.gelu`` need no rule here: the carrier takes torch's one-kernel derivative ops for them
(``threshold_backward`` / ``gelu_backward``), and so does torch's own rule under ``vmap``. Anything else
(other layers, unsupported variants such as dropout inside attention or class weights) runs with torch's
own forward-mode rules: correct, not lean.

Several tangents in one pass
----------------------------
:func:`lean_directional_derivatives` pushes K tangents through ONE forward: the primal is computed once,
every tangent carries a leading K dimension (``torch.func.vmap`` over ``torch.func.jvp``; the just-in-time
tangents enter as batched tensors). Memory is linear in K for the tangents only. functorch refuses
in-place updates of state captured by the closure, so modules that update buffers during the forward
(BatchNorm in train mode) need the one-tangent engine, called K times.

Limits shared with the ``forward_ad`` engine: one process-wide dual level (no nesting, one thread), the
closure must not call ``backward()``, buffers get no tangent.
"""
from __future__ import annotations

import functools
import math
from typing import Callable, Sequence

import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch import nn
from torch._C._functorch import (_add_batch_dim, get_unwrapped, is_batchedtensor, is_functorch_wrapped_tensor,
                                  maybe_current_level, maybe_get_bdim, maybe_get_level)
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

from .forward_ad_engine import _check_loss, _check_params, _check_tangent, directional_derivative
from .tangent_carrier import TangentCarrier, _Ctx

# the input-tangent term of a convolution is added in this many batch chunks: its temporary is 1/8 output
_CONV_CHUNKS = 8
# the attention tangent's chunks of query rows hold at least this many scores per head (64 KiB in float32)
_CHUNK_SCORES = 1 << 14


def _rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum(a * b, -1, keepdim=True) as a batched matrix product: no elementwise-product temporary. One bmm over
    the rows (matmul on N-D operands adds expands, views and, for some strides, copies)."""
    shape = torch.broadcast_shapes(a.shape, b.shape)
    if a.shape != shape or b.shape != shape:
        return (a.unsqueeze(-2) @ b.unsqueeze(-1)).squeeze(-1)
    size = shape[-1]
    return torch.bmm(a.reshape(-1, 1, size), b.reshape(-1, size, 1)).view(*shape[:-1], 1)


def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b for operands with the same leading dims, as one bmm over their flattened leading dims: torch.matmul
    on 4-D operands expands and reshapes both, and copies a transposed operand it could have viewed."""
    if a.dim() < 3 or a.shape[:-2] != b.shape[:-2]:
        return a @ b
    lead = a.shape[:-2]
    out = torch.bmm(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]))
    return out.view(*lead, *out.shape[-2:])


def _batched_storage(x: torch.Tensor) -> torch.Tensor | None:
    """The tensor under ``x``'s functorch wrappers if that is vmap-batched (inside a Function's jvp under
    vmap(jvp), tangents arrive as grad-level wrappers of batched tensors), else None."""
    while is_functorch_wrapped_tensor(x) and not is_batchedtensor(x):
        x = get_unwrapped(x)
    return x if is_batchedtensor(x) else None


def _physical(batched: torch.Tensor, *others):
    """``batched``'s storage with the batch dimension first, and ``others`` likewise (unbatched ones
    expanded over the batch), so that an in-place op can run on them as one kernel. functorch has no
    batching rule for ``addmm_`` / ``addcmul_`` and would otherwise loop over the K tangents."""
    level = maybe_get_level(batched)
    t = get_unwrapped(batched).movedim(maybe_get_bdim(batched), 0)

    def lift(x):  # (K, *x.shape) with x's logical dims right-aligned to t's, as broadcasting aligns them
        shape = x.shape
        pad = (1,) * (t.dim() - 1 - len(shape))
        inner = _batched_storage(x)
        if inner is not None and maybe_get_level(inner) == level:
            return get_unwrapped(inner).movedim(maybe_get_bdim(inner), 0).reshape(t.shape[0], *pad, *shape)
        while is_functorch_wrapped_tensor(x):  # an unbatched primal under the jvp level's wrapper
            x = get_unwrapped(x)
        return x.reshape(1, *pad, *shape).expand(t.shape[0], *pad, *shape)

    return t, [lift(x) for x in others]


def _add_matmul_(t: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """t += a @ b in place (2-D a, b, t)."""
    batched = _batched_storage(t)
    if batched is None:
        return t.addmm_(a, b)
    t_phys, (a, b) = _physical(batched, a, b)
    with torch._C._DisableFuncTorch():  # plain tensors now: no transform must see (and refuse) the write
        t_phys.baddbmm_(a, b)
    return t


def _addcmul_(t: torch.Tensor, a: torch.Tensor, b: torch.Tensor, value: float = 1.0) -> torch.Tensor:
    """t += value * a * b in place."""
    batched = _batched_storage(t)
    if batched is None:
        return t.addcmul_(a, b, value=value)
    t_phys, (a, b) = _physical(batched, a, b)
    with torch._C._DisableFuncTorch():
        t_phys.addcmul_(a, b, value=value)
    return t


# -- lean forward-mode rules ----------------------------------------------------------------------------------
class LinearJvp(torch.autograd.Function):
    """y = x W^T + b;  y_dot = x_dot W^T + x W_dot^T + b_dot, accumulated into one buffer."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, weight, bias):
        return F.linear(x, weight, bias)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.set_materialize_grads(False)
        x, weight, _ = inputs
        ctx.save_for_forward(x, weight)

    @staticmethod
    def fused_forward_and_jvp(x, weight, bias, x_t, weight_t, bias_t):
        """(y, y_dot) on plain tensors with x's rows and W^T viewed once for the primal and both tangent products
        (three F.linear calls view them three times). The primal is F.linear's own product: addmm for a 2-D x
        or a contiguous 3-D x with a bias, mm of the flattened rows without a bias (where F.linear's matmul folds
        to it). None under ``vmap``, and where F.linear takes another path (then ``forward`` and ``jvp`` run)."""
        if torch._C._are_functorch_transforms_active() or x.dim() < 2 or not (
                x.dim() == 2 or (x.is_contiguous() and (x.dim() == 3 or bias is None))):
            return None
        x_rows = x if x.dim() == 2 else x.view(-1, x.shape[-1])
        weight_T = weight.t()
        y = torch.mm(x_rows, weight_T) if bias is None else torch.addmm(bias, x_rows, weight_T)
        t = None
        if weight_t is not None:
            t = torch.mm(x_rows, weight_t.t()) if bias_t is None else torch.addmm(bias_t, x_rows, weight_t.t())
            bias_t = None
        if x_t is not None:
            x_t_rows = x_t if x_t.dim() == 2 else x_t.reshape(-1, x_t.shape[-1])
            if t is not None:
                t.addmm_(x_t_rows, weight_T)
            else:
                t = torch.mm(x_t_rows, weight_T) if bias_t is None else torch.addmm(bias_t, x_t_rows, weight_T)
                bias_t = None
        if bias_t is not None:
            t = bias_t.expand(y.shape).clone()
        if x.dim() > 2:
            shape = (*x.shape[:-1], weight.shape[0])
            y, t = y.view(shape), None if t is None else t.view(shape)
        return y, t

    @staticmethod
    def jvp(ctx, x_t, weight_t, bias_t):
        # F.linear, not reshapes around addmm: on small layers each extra view costs as much as a kernel
        x, weight = ctx.saved_tensors
        t = None
        if weight_t is not None:
            t = F.linear(x, weight_t, bias_t)
            bias_t = None
        if x_t is not None:
            if t is None:
                t = F.linear(x_t, weight, bias_t)
                bias_t = None
            elif t.dim() == 2:
                _add_matmul_(t, x_t, weight.t())
            else:  # into a 2-D view of t
                _add_matmul_(t.view(-1, t.shape[-1]), x_t.reshape(-1, x_t.shape[-1]), weight.t())
        if bias_t is not None:
            t = bias_t.expand(*x.shape[:-1], weight.shape[0]).clone()
        return t


class AddmmJvp(torch.autograd.Function):
    """y = b + x W (torch.addmm; Hugging Face GPT-2's Conv1D, W stored (in, out));
    y_dot = b_dot + x W_dot + x_dot W, accumulated into one buffer (torch's rule adds three products apart)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(bias, x, weight):
        return torch.addmm(bias, x, weight)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.set_materialize_grads(False)
        _, x, weight = inputs
        ctx.save_for_forward(x, weight)
        ctx.out_shape = output.shape

    @staticmethod
    def jvp(ctx, bias_t, x_t, weight_t):
        x, weight = ctx.saved_tensors
        t = None
        if weight_t is not None:
            t = x @ weight_t if bias_t is None else torch.addmm(bias_t, x, weight_t)
            bias_t = None
        if x_t is not None:
            if t is None:
                t = x_t @ weight if bias_t is None else torch.addmm(bias_t, x_t, weight)
                bias_t = None
            else:
                _add_matmul_(t, x_t, weight)
        if bias_t is not None:
            t = bias_t.expand(ctx.out_shape).clone()
        return t


class MulJvp(torch.autograd.Function):
    """y = a * b (a tensor times a tensor or a number: GELU's polynomial, scalings);
    y_dot = a_dot b + a b_dot, without the zero tangent torch's rule materialises for an input that has none."""

    generate_vmap_rule = True

    @staticmethod
    def forward(a, b):
        return a * b

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.set_materialize_grads(False)
        a, b = inputs
        if isinstance(b, torch.Tensor):
            ctx.save_for_forward(a, b)
        else:  # a number: an attribute (it has no tangent)
            ctx.save_for_forward(a)
            ctx.number = b

    @staticmethod
    def jvp(ctx, a_t, b_t):
        if len(ctx.saved_tensors) == 1:
            return a_t * ctx.number
        a, b = ctx.saved_tensors
        if a_t is None:
            return a * b_t
        t = a_t * b
        if b_t is not None:
            t = _addcmul_(t, a, b_t)
        return t


class Conv2dJvp(torch.autograd.Function):
    """y = conv(x, W) + b;  y_dot = conv(x, W_dot) + b_dot + conv(x_dot, W), the last term in batch chunks."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, weight, bias, stride, padding, dilation, groups):
        return F.conv2d(x, weight, bias, stride, padding, dilation, groups)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.set_materialize_grads(False)
        x, weight, _, *ctx.conv = inputs
        ctx.save_for_forward(x, weight)
        ctx.out_shape = output.shape

    @staticmethod
    def jvp(ctx, x_t, weight_t, bias_t, *_):
        x, weight = ctx.saved_tensors
        t = None
        if weight_t is not None:
            t = F.conv2d(x, weight_t, bias_t, *ctx.conv)
            bias_t = None
        if x_t is not None:
            if t is None:
                t = F.conv2d(x_t, weight, bias_t, *ctx.conv)
                bias_t = None
            elif x_t.dim() == 4:
                step = max(1, -(-x_t.shape[0] // _CONV_CHUNKS))
                for start in range(0, x_t.shape[0], step):
                    t[start:start + step].add_(F.conv2d(x_t[start:start + step], weight, None, *ctx.conv))
            else:
                t.add_(F.conv2d(x_t, weight, None, *ctx.conv))
        if bias_t is not None:
            bias_t = bias_t.view(-1, 1, 1)
            t = bias_t.expand(ctx.out_shape).clone() if t is None else t.add_(bias_t)
        return t


class LayerNormJvp(torch.autograd.Function):
    """y = x_hat w + b, x_hat = (x - mean) rstd over the last dims;
    y_dot = rstd (x_dot - mean(x_dot) - x_hat mean(x_dot x_hat)) w + x_hat w_dot + b_dot."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, normalized_shape, weight, bias, eps):
        return F.layer_norm(x, normalized_shape, weight, bias, eps)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.set_materialize_grads(False)
        x, normalized_shape, weight, _, ctx.eps = inputs
        ctx.size = math.prod(normalized_shape)
        ctx.save_for_forward(x, weight)

    @staticmethod
    def fused_forward_and_jvp(x, normalized_shape, weight, bias, eps, x_t, _, weight_t, bias_t, __):
        """(y, y_dot) on plain tensors in a few whole-tensor ops, None under ``vmap`` and where the row statistics
        come in another dtype than x's (half precision), where ``jvp`` runs.

        The normalisation's Jacobian, rstd (I - 1 1^T / n - x_hat x_hat^T / n) per row, is symmetric, so its
        product with x_dot is torch's layer-norm backward of x_dot without weight (one kernel, the forward's own
        statistics); x_hat w_dot + b_dot is a layer norm of x with weight w_dot and bias b_dot (one kernel)."""
        if torch._C._are_functorch_transforms_active():
            return None
        y, mean, rstd = torch.native_layer_norm(x, normalized_shape, weight, bias, eps)
        if mean.dtype != x.dtype:
            return None
        t = None
        if x_t is not None:
            t = torch.ops.aten.native_layer_norm_backward(x_t, x, normalized_shape, mean, rstd, None, None,
                                                          [True, False, False])[0]
            if weight is not None:
                t.mul_(weight)
        if weight_t is not None:
            shifted = torch.native_layer_norm(x, normalized_shape, weight_t, bias_t, eps)[0]
            t = shifted if t is None else t.add_(shifted)
        elif bias_t is not None:
            t = bias_t.expand_as(y).clone() if t is None else t.add_(bias_t)
        return y, t

    @staticmethod
    def jvp(ctx, x_t, _, weight_t, bias_t, __):
        x, weight = ctx.saved_tensors
        size = ctx.size
        rows = x.reshape(-1, size)
        var, mean = torch.var_mean(rows, -1, correction=0, keepdim=True)
        rstd = var.add_(ctx.eps).rsqrt_()
        x_hat = rows.sub(mean).mul_(rstd)
        t = None
        if x_t is not None:
            x_t = x_t.reshape(rows.shape)
            t = x_t - x_t.mean(-1, keepdim=True)
            _addcmul_(t, x_hat, _rowdot(x_t, x_hat).div_(size), value=-1).mul_(rstd)
            if weight is not None:
                t.mul_(weight.reshape(size))
        if weight_t is not None:
            # x_hat * w_dot, not in place into x_hat: under vmap x_hat is unbatched and w_dot batched
            t = x_hat * weight_t.reshape(size) if t is None else _addcmul_(t, x_hat, weight_t.reshape(size))
        if bias_t is not None:
            t = bias_t.reshape(size).expand(rows.shape).clone() if t is None else t.add_(bias_t.reshape(size))
        return t.view(x.shape)


class SoftmaxJvp(torch.autograd.Function):
    """y = softmax(x);  y_dot = y (x_dot - <y, x_dot>) along ``dim``."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, dim):
        return torch.softmax(x, dim)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.dim = inputs[1] % max(1, output.dim())
        ctx.save_for_forward(output)

    @staticmethod
    def jvp(ctx, x_t, _):
        (y,) = ctx.saved_tensors
        if ctx.dim == y.dim() - 1:
            dot = _rowdot(y, x_t)
        else:
            dot = (y * x_t).sum(ctx.dim, keepdim=True)
        return (x_t - dot).mul_(y)


class CrossEntropyJvp(torch.autograd.Function):
    """loss_i = logsumexp(z_i) - z_i[y_i];  loss_i_dot = <softmax(z_i), z_i_dot> - z_i_dot[y_i], then reduced."""

    generate_vmap_rule = True

    @staticmethod
    def forward(logits, target, ignore_index, reduction):
        return F.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)

    @staticmethod
    def setup_context(ctx, inputs, output):
        logits, target, ctx.ignore_index, ctx.reduction = inputs
        ctx.save_for_forward(logits, target)

    @staticmethod
    def jvp(ctx, logits_t, *_):
        logits, target = ctx.saved_tensors
        probs = torch.softmax(logits, -1)  # freed here, before the next buffer
        if torch._C._are_functorch_transforms_active():  # a batched tangent cannot be written into probs
            dot = _rowdot(probs, logits_t)
        else:  # in the softmax's own buffer: two ops where the bmm of _rowdot needs four
            dot = probs.mul_(logits_t).sum(-1, keepdim=True)
        del probs
        # nll_loss(a, y) reduces -a_i[y_i] over the rows whose target is not ignored, as the loss does: with
        # a = z_dot - <softmax(z), z_dot> it is the loss tangent, in one kernel (gather, mask, reduction)
        return F.nll_loss(logits_t - dot, target, ignore_index=ctx.ignore_index, reduction=ctx.reduction)


# devices whose tensors take the fused attention kernel (tests add "cpu": Triton's interpreter runs it there)
_FUSED_ATTENTION_DEVICES = {"cuda"}


@functools.lru_cache(maxsize=None)
def _fused_attention():
    """fgfw.triton.attention_jvp, or None where Triton does not import (imported at the first CUDA attention)."""
    try:
        from .triton import attention_jvp
    except ImportError:
        return None
    return attention_jvp


def fused_attention_jvp_applies(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                attn_mask: torch.Tensor | None, *tangents: torch.Tensor | None) -> bool:
    """Whether :class:`AttentionJvp` takes the fused Triton kernel (``fgfw.triton.attention_jvp``) for these
    operands and tangents: CUDA tensors, no ``attn_mask`` (``is_causal`` is the kernel's only mask), plain tensors
    (under ``vmap`` they are functorch's batched tensors, which a kernel cannot read), Triton importable, and
    shapes, dtype and head dim that the kernel takes and compiles without spills (``unsupported``, ``spill_free``:
    bfloat16 and float16 with head dim 16 to 128, float32 as TF32 up to 64)."""
    if attn_mask is not None or query.device.type not in _FUSED_ATTENTION_DEVICES:
        return False
    if any(x is not None and is_functorch_wrapped_tensor(x) for x in (query, key, value, *tangents)):
        return False
    kernel = _fused_attention()
    return (kernel is not None and kernel.unsupported(query, key, value) is None
            and kernel.spill_free(query.dtype, query.shape[-1]))


class AttentionJvp(torch.autograd.Function):
    """O = softmax(Q K^T s + M) V, tangent chunk by chunk of query rows:
    dS = (dQ K^T + Q dK^T) s + dM, dP = P (dS - rowsum(P dS)), dO = dP V + P dV.

    Where :func:`fused_attention_jvp_applies`, one Triton kernel gives O and dO in a single flash-style pass
    instead (``fgfw.triton.attention_jvp``; this rule is its spec): the one-tangent engine takes both from it
    (``fused_forward_and_jvp``), ``jvp`` under ``Function.apply`` the tangent. ``forward`` stays torch's, on any
    backend. Under ``vmap`` (the batched engine) the tangents are batched tensors and the chunks below run."""

    generate_vmap_rule = True

    @staticmethod
    def forward(query, key, value, attn_mask, is_causal, scale):
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, is_causal=is_causal,
                                              scale=scale)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.set_materialize_grads(False)
        query, key, value, attn_mask, ctx.is_causal, scale = inputs
        ctx.scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
        ctx.save_for_forward(query, key, value, attn_mask)
        # rows per chunk: a chunk of scores is about as large as the output, never (L x L), and at least
        # _CHUNK_SCORES per head: below that a chunk's ops cost more host time than its memory is worth
        heads = max(1, math.prod(output.shape[:-2]))
        ctx.rows = max(1, output.numel() // (heads * key.shape[-2]), _CHUNK_SCORES // max(1, key.shape[-2]))
        ctx.layout = (output.shape, output.stride())  # the primal's: the carried tangent takes it too

    @staticmethod
    def fused_forward_and_jvp(query, key, value, attn_mask, is_causal, scale, query_t, key_t, value_t, *_):
        """(O, dO) from the fused kernel where it applies, else None (then ``forward`` and ``jvp`` run)."""
        if not fused_attention_jvp_applies(query, key, value, attn_mask, query_t, key_t, value_t):
            return None
        return _fused_attention().attention_jvp(query, key, value, query_t, key_t, value_t, is_causal, scale)

    @staticmethod
    def jvp(ctx, query_t, key_t, value_t, mask_t, *_):
        query, key, value, mask = ctx.saved_tensors
        if fused_attention_jvp_applies(query, key, value, mask, query_t, key_t, value_t):
            return _fused_attention().attention_jvp(query, key, value, query_t, key_t, value_t, ctx.is_causal,
                                                    ctx.scale)[1]
        if not torch._C._are_functorch_transforms_active():  # plain tensors: the one-tangent pass
            out_t = _attention_tangent_flat(ctx, query, key, value, mask, query_t, key_t, value_t, mask_t)
            shape, stride = ctx.layout
            if _CARRIER is not None and out_t.stride() != stride:
                # laid out as the primal (torch's CPU flash kernel writes (B, T, H, D) and returns it transposed),
                # the carrier follows the model's transpose, contiguous and views of it without an op
                laid_out = torch.empty_strided(shape, stride, dtype=out_t.dtype, device=out_t.device)
                out_t = laid_out.copy_(out_t)
            return out_t
        # heads split off a fused projection are strided views that a bmm over flattened heads would copy, chunk
        # after chunk: one contiguous copy of each here instead (contiguous() of a contiguous tensor is itself)
        query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
        query_t, key_t, value_t = (None if x is None else x.contiguous() for x in (query_t, key_t, value_t))
        length = query.shape[-2]
        key_T = key.transpose(-2, -1)
        key_t_T = None if key_t is None else key_t.transpose(-2, -1)
        chunks = []
        for start in range(0, length, ctx.rows):
            rows = slice(start, min(length, start + ctx.rows))
            q = query[..., rows, :]
            scores = _matmul(q, key_T).mul_(ctx.scale)
            if mask is not None:
                m = mask[..., rows, :] if mask.dim() >= 2 and mask.shape[-2] == length else mask
                scores = scores.masked_fill_(~m, -math.inf) if m.dtype == torch.bool else scores.add_(m)
            if ctx.is_causal:
                causal = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu_(start + 1)
                scores.masked_fill_(causal, -math.inf)
            probs = torch.softmax(scores, -1)
            del scores
            d_scores = None
            if query_t is not None:
                d_scores = _matmul(query_t[..., rows, :], key_T)
            if key_t_T is not None:
                d_scores = _matmul(q, key_t_T) if d_scores is None else d_scores.add_(_matmul(q, key_t_T))
            if d_scores is not None:
                d_scores.mul_(ctx.scale)
            if mask_t is not None:
                m_t = mask_t[..., rows, :] if mask_t.dim() >= 2 and mask_t.shape[-2] == length else mask_t
                d_scores = d_scores.add_(m_t) if d_scores is not None else m_t.expand(probs.shape).clone()
            out_t = None
            if d_scores is not None:
                d_probs = d_scores.sub_(_rowdot(probs, d_scores)).mul_(probs)
                out_t = _matmul(d_probs, value)
            if value_t is not None:
                out_t = _matmul(probs, value_t) if out_t is None else out_t.add_(_matmul(probs, value_t))
            chunks.append(out_t)
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks, -2)


def _score_bias(rows: int, size: int, start: int, causal: bool, dtype, device) -> torch.Tensor:
    """What ``baddbmm`` adds to a chunk's scaled scores: -inf above the causal diagonal (0 below), or a zero it
    scales by beta = 0. Made once per one-tangent pass (the carrier's memo) and shared by every layer."""
    memo = _CARRIER.memo if _CARRIER is not None else {}
    key = ("score_bias", rows, size, start if causal else None, dtype, device)
    bias = memo.get(key)
    if bias is None:
        bias = (torch.full((rows, size), -math.inf, dtype=dtype, device=device).triu_(start + 1) if causal else
                torch.zeros((), dtype=dtype, device=device))
        memo[key] = bias
    return bias


def _attention_tangent_flat(ctx, query, key, value, mask, query_t, key_t, value_t, mask_t):
    """AttentionJvp's tangent on plain tensors, in fewer calls (the one-tangent pass is host-bound on a GPU): the
    heads flattened once per call; the scale folded into the products' ``alpha`` (S = Q K^T s from one ``baddbmm``
    that also adds the causal mask, dO = P dV + s dP' V with dP' the unscaled dP); products accumulated in place;
    ``rowsum(P dS)`` from ``P * dS`` in place. The same chunks of query rows as ``jvp``."""
    lead, length, size = query.shape[:-2], query.shape[-2], key.shape[-2]

    def flat(x):  # (..., rows, cols) -> (heads, rows, cols), made contiguous once (heads are strided views)
        return None if x is None else x.contiguous().view(-1, *x.shape[-2:])

    scale = ctx.scale
    query, key_T, value = flat(query), flat(key).transpose(1, 2), flat(value)
    query_t, value_t = flat(query_t), flat(value_t)
    key_t_T = None if key_t is None else flat(key_t).transpose(1, 2)
    chunks = []
    for start in range(0, length, ctx.rows):
        stop = min(length, start + ctx.rows)
        whole = start == 0 and stop == length  # one chunk: no slices
        q = query if whole else query[:, start:stop]
        bias = _score_bias(stop - start, size, start, ctx.is_causal, query.dtype, query.device)
        scores = torch.baddbmm(bias, q, key_T, beta=1 if ctx.is_causal else 0, alpha=scale)
        if mask is not None:
            m = mask[..., start:stop, :] if mask.dim() >= 2 and mask.shape[-2] == length else mask
            scores_4d = scores.view(*lead, stop - start, size)
            if m.dtype == torch.bool:
                scores_4d.masked_fill_(~m, -math.inf)
            else:
                scores_4d.add_(m)
        probs = torch.softmax(scores, -1)
        del scores
        d_scores = None  # dS / s while d_scale is s (the scale folded into the last product), dS once it is 1
        if query_t is not None:
            d_scores = torch.bmm(query_t if whole else query_t[:, start:stop], key_T)
        if key_t_T is not None:
            d_scores = torch.bmm(q, key_t_T) if d_scores is None else d_scores.baddbmm_(q, key_t_T)
        d_scale = scale
        if mask_t is not None:
            m_t = mask_t[..., start:stop, :] if mask_t.dim() >= 2 and mask_t.shape[-2] == length else mask_t
            if d_scores is None:
                d_scores = m_t.expand(*lead, stop - start, size).reshape(probs.shape).clone()
            else:
                d_scores.mul_(scale).view(*lead, stop - start, size).add_(m_t)
            d_scale = 1.0
        out_t = None if value_t is None else torch.bmm(probs, value_t)
        if d_scores is not None:
            # dP = P dS - P rowsum(P dS), in the buffer of dS
            d_probs = d_scores.mul_(probs)
            d_probs.addcmul_(probs, d_probs.sum(-1, keepdim=True), value=-1)
            out_t = (torch.bmm(d_probs, value).mul_(d_scale) if out_t is None else
                     out_t.baddbmm_(d_probs, value, alpha=d_scale))
        chunks.append(out_t)
    out_t = chunks[0] if len(chunks) == 1 else torch.cat(chunks, 1)
    return out_t.view(*lead, length, out_t.shape[-1])


# -- routing of torch calls to the rules (same signatures as the functions they replace) -------------------------
# the TangentCarrier of the one-tangent pass under way, which the rules below are run by; None outside it
_CARRIER = None


def _apply(rule, *args):
    """``rule.apply(*args)``, run lean in the one-tangent engine's setting.

    ``autograd.Function.apply`` costs tens of microseconds a call (it binds the arguments by
    ``inspect.signature``, makes a graph node, wraps the outputs), more than a small layer's kernels. In a
    forward-AD pass without grad mode or functorch transforms, the rule's own ``forward``,
    ``setup_context`` and ``jvp`` run here instead, on the primals and tangents: the same arithmetic. A rule with a
    ``fused_forward_and_jvp`` (attention) may give the primal and tangent from one kernel instead. Under
    ``torch.func`` (the batched engine, ``vmap`` over ``jvp``) or with grad mode on, ``apply`` it is.
    """
    if _CARRIER is not None:  # the one-tangent pass carries tangents beside the primals (fgfw.tangent_carrier)
        return _CARRIER.apply_rule(rule, args)
    level = fwAD._current_level
    if level < 0 or torch.is_grad_enabled() or torch._C._are_functorch_transforms_active():
        return rule.apply(*args)
    primals, tangents, dual = [], [], False
    for a in args:
        t = None
        if isinstance(a, torch.Tensor):
            a, t = torch._unpack_dual(a, level)  # fwAD.unpack_dual without its per-call wrappers
            dual = dual or t is not None
        primals.append(a)
        tangents.append(t)
    if not dual:  # as apply: no input tangent, no jvp, no output tangent
        return rule.forward(*primals)
    fused = getattr(rule, "fused_forward_and_jvp", None)  # one kernel for the primal and tangent
    if fused is not None:
        both = fused(*primals, *tangents)
        if both is not None:
            return torch._make_dual(*both, level)
    out = rule.forward(*primals)
    ctx = _Ctx()
    rule.setup_context(ctx, tuple(primals), out)
    return torch._make_dual(out, rule.jvp(ctx, *tangents), level)


def linear(input, weight, bias=None):
    return _apply(LinearJvp, input, weight, bias)


def addmm(input, mat1, mat2, *, beta=1, alpha=1, out=None):
    if beta != 1 or alpha != 1 or out is not None or not all(isinstance(a, torch.Tensor) for a in (input, mat1, mat2)):
        return NotImplemented
    return _apply(AddmmJvp, input, mat1, mat2)


def mul(input, other, *, out=None):
    """a * b of two real floating tensors of one dtype, or of such a tensor and a Python number (the product of a
    tangent and the other factor has the output's broadcast shape, so the second term adds into it in place);
    declined otherwise (torch's rule: type promotion, integers, complex)."""
    if out is not None or not isinstance(input, torch.Tensor) or not input.is_floating_point():
        return NotImplemented
    if isinstance(other, torch.Tensor):
        if not other.is_floating_point() or other.dtype != input.dtype:
            return NotImplemented
    elif not isinstance(other, (int, float)) or isinstance(other, bool):
        return NotImplemented
    return _apply(MulJvp, input, other)


def rmul(input, other):
    return mul(input, other)


def conv2d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    return _apply(Conv2dJvp, input, weight, bias, stride, padding, dilation, groups)


def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    return _apply(LayerNormJvp, input, tuple(normalized_shape), weight, bias, eps)


def softmax(input, dim=None, _stacklevel=3, dtype=None):
    if dim is None or dtype is not None:
        return NotImplemented
    return _apply(SoftmaxJvp, input, dim)


def cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                  reduction="mean", label_smoothing=0.0):
    if (weight is not None or size_average is not None or reduce is not None or label_smoothing != 0.0
            or input.dim() not in (1, 2) or target.dim() != input.dim() - 1 or target.is_floating_point()):
        return NotImplemented
    return _apply(CrossEntropyJvp, input, target, ignore_index, reduction)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    if dropout_p != 0.0 or enable_gqa or (is_causal and attn_mask is not None):
        return NotImplemented
    return _apply(AttentionJvp, query, key, value, attn_mask, is_causal, scale)


def multi_head_attention_forward(query, key, value, embed_dim_to_check, num_heads, in_proj_weight, in_proj_bias,
                                 bias_k, bias_v, add_zero_attn, dropout_p, out_proj_weight, out_proj_bias,
                                 training=True, key_padding_mask=None, need_weights=True, attn_mask=None,
                                 use_separate_proj_weight=False, q_proj_weight=None, k_proj_weight=None,
                                 v_proj_weight=None, static_k=None, static_v=None, average_attn_weights=True,
                                 is_causal=False):
    """nn.MultiheadAttention's common case ((L, N, E) inputs, packed projection, no weights returned), with
    torch's mask conventions (a bool ``attn_mask`` marks the positions NOT attended to; the ``is_causal``
    hint replaces the mask)."""
    if (need_weights or bias_k is not None or bias_v is not None or add_zero_attn or use_separate_proj_weight
            or static_k is not None or static_v is not None or key_padding_mask is not None
            or (dropout_p != 0.0 and training) or query.dim() != 3 or in_proj_weight is None
            or (is_causal and attn_mask is None)):  # the stock function raises its own error for the last
        return NotImplemented
    length, batch, embed = query.shape
    if embed != embed_dim_to_check:
        raise ValueError(f"query has embedding size {embed}, the module expects {embed_dim_to_check}")
    if query is key and key is value:
        q, k, v = linear(query, in_proj_weight, in_proj_bias).chunk(3, dim=-1)
    else:
        weights = in_proj_weight.chunk(3)
        biases = (None,) * 3 if in_proj_bias is None else in_proj_bias.chunk(3)
        q, k, v = (linear(x, w, b) for x, w, b in zip((query, key, value), weights, biases))
    head = embed // num_heads
    if is_causal:
        attn_mask = None
    elif attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device).masked_fill_(
                attn_mask, -math.inf)
        if attn_mask.dim() == 3:  # (N * H, L, S) or (1, L, S)
            attn_mask = attn_mask.unsqueeze(0) if attn_mask.shape[0] == 1 else attn_mask.view(
                batch, num_heads, length, -1)

    def heads(x):  # (L, N, E) -> (N, H, L, E/H), a view
        return x.view(x.shape[0], batch, num_heads, head).permute(1, 2, 0, 3)

    out = scaled_dot_product_attention(heads(q), heads(k), heads(v), attn_mask=attn_mask, is_causal=is_causal)
    out = out.permute(2, 0, 1, 3).reshape(length * batch, embed)
    return linear(out, out_proj_weight, out_proj_bias).view(length, batch, embed), None


_RULES = {
    F.linear: linear,
    torch.addmm: addmm,
    torch.mul: mul, torch.Tensor.mul: mul, torch.Tensor.__mul__: mul, torch.Tensor.__rmul__: rmul,
    F.conv2d: conv2d,
    F.layer_norm: layer_norm,
    F.softmax: softmax, torch.softmax: softmax, torch.Tensor.softmax: softmax,
    F.cross_entropy: cross_entropy,
    F.scaled_dot_product_attention: scaled_dot_product_attention,
    F.multi_head_attention_forward: multi_head_attention_forward,
}
# calls whose stock fallback needs attention kernels that have forward-mode rules
_NEEDS_MATH_ATTENTION = {F.scaled_dot_product_attention, F.multi_head_attention_forward}

_METADATA_METHODS = {
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.stride, torch.Tensor.is_contiguous,
    torch.Tensor.data_ptr, torch.Tensor.element_size, torch.Tensor.is_floating_point, torch.Tensor.is_complex,
    torch.Tensor.__len__, torch.Tensor.storage_offset, torch.Tensor.get_device, torch.Tensor.__hash__,
    torch.Tensor.nelement, torch.Tensor.ndimension, torch.Tensor.untyped_storage,
}
_METADATA_PROPERTIES = {
    "shape", "dtype", "device", "ndim", "layout", "requires_grad", "is_leaf", "grad", "grad_fn", "data", "names",
    "is_cuda", "is_cpu", "is_sparse", "is_quantized", "is_meta", "is_nested", "itemsize", "nbytes", "_version",
}


def _reads_metadata_only(func) -> bool:
    if func in _METADATA_METHODS:
        return True
    # property getters arrive as the descriptor's __get__
    return getattr(func, "__name__", None) == "__get__" and getattr(func.__self__, "__name__", None) in \
        _METADATA_PROPERTIES


class _JustInTimeTangents(TorchFunctionMode):
    """Gives each call that uses a tracked parameter a dual of it, and routes calls to the lean rules."""

    def __init__(self, params: Sequence[torch.Tensor], dual_of: Callable[[int], torch.Tensor]):
        super().__init__()
        self._index = {id(p): j for j, p in enumerate(params)}
        self._dual_of = dual_of

    def _uses_params(self, values) -> bool:
        index = self._index  # ids of the tracked parameters, which the engine keeps alive: an id match is one
        for v in values:
            if id(v) in index or (isinstance(v, (list, tuple)) and any(id(x) in index for x in v)):
                return True
        return False

    def _attach(self, value, duals: dict):
        if isinstance(value, torch.Tensor):
            j = self._index.get(id(value))
            if j is None:
                return value
            if j not in duals:
                duals[j] = self._dual_of(j)
            return duals[j]
        if isinstance(value, (list, tuple)) and any(id(v) in self._index for v in value):
            return type(value)(self._attach(v, duals) for v in value)
        return value

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        # every torch call of the pass comes here; most take activations only, which pass as they are
        if (self._uses_params(args) or (kwargs and self._uses_params(kwargs.values()))) and \
                not _reads_metadata_only(func):
            duals = {}
            args = tuple(self._attach(a, duals) for a in args)
            kwargs = {k: self._attach(v, duals) for k, v in kwargs.items()}
        rule = _RULES.get(func)
        if rule is not None:
            out = rule(*args, **kwargs)
            if out is not NotImplemented:
                return out
        if func in _NEEDS_MATH_ATTENTION:
            with sdpa_kernel(SDPBackend.MATH):
                return func(*args, **kwargs)
        return func(*args, **kwargs)


# -- the engines ----------------------------------------------------------------------------------------------
def lean_directional_derivative(module: nn.Module, params: Sequence[torch.Tensor],
                                make_tangent: Callable[[int], torch.Tensor],
                                closure: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss f(theta) and c = <grad f(theta), u> in one lean forward pass (just-in-time tangents).

    Same contract as :func:`fgfw.forward_ad_engine.directional_derivative`; ``make_tangent(j)`` is called when
    a call first needs ``params[j]`` (once per call that uses it, possibly several times per pass, and
    not at all for a parameter the closure never uses), so it must return the same values every time. Where
    ``make_tangent`` also has a method ``many(js)`` (a list of indices -> their tangents, in order), a call that
    reads several parameters (a layer's weight and bias) gets their tangents from one ``many`` instead.
    """
    if torch.compiler.is_compiling():
        # Dynamo guards on the identities the just-in-time mode looks up (a new input batch each step would
        # mean a new graph each step); traced, the stock forward-AD pass is one graph whose buffers
        # Inductor plans itself.
        return directional_derivative(module, params, make_tangent, closure)
    global _CARRIER
    params = list(params)
    _check_params(module, params)
    if _CARRIER is not None:
        raise RuntimeError("lean_directional_derivative cannot run inside another lean pass")

    def check(j: int, tangent) -> torch.Tensor:
        _check_tangent(j, params[j], tangent)
        if not (tangent.is_floating_point() or tangent.is_complex()):  # as fwAD.make_dual checks
            raise ValueError(f"params[{j}] is {tangent.dtype}: forward AD needs floating-point or complex tensors")
        return tangent

    def checked_tangent(j: int) -> torch.Tensor:
        return check(j, make_tangent(j))

    # a maker with a ``many(js)`` method (the optimizers') draws the tangents of one call's parameters at once
    many = getattr(make_tangent, "many", None)
    checked_many = None if many is None else (lambda js: [check(j, t) for j, t in zip(js, many(js))])

    # a dual level stays open for the calls that take torch's own rules (fgfw.tangent_carrier)
    with torch.inference_mode(False), torch.no_grad(), fwAD.dual_level() as level:
        carrier = TangentCarrier(params, checked_tangent, level, _RULES, {F.multi_head_attention_forward},
                                 _NEEDS_MATH_ATTENTION, _reads_metadata_only, make_tangents=checked_many)
        _CARRIER = carrier
        try:
            with carrier:
                loss = _check_loss(closure())
        finally:
            _CARRIER = None
        loss_tangent = carrier.tangent(loss)
        if loss_tangent is None:  # a loss that ended as a dual of torch's rules
            loss, loss_tangent = torch._unpack_dual(loss, level)
        loss = _scalar(loss)
        c = torch.zeros_like(loss) if loss_tangent is None else _scalar(loss_tangent)
    return loss, c


def _scalar(x: torch.Tensor) -> torch.Tensor:
    """x (one element) as a 0-dim tensor outside any graph, with no op where it is one already."""
    x = x.detach() if x.requires_grad else x
    return x if x.dim() == 0 else x.reshape(())


def lean_directional_derivatives(module: nn.Module, params: Sequence[torch.Tensor],
                                 make_tangents: Callable[[int], torch.Tensor], closure: Callable[[], torch.Tensor],
                                 num_tangents: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss and c_k = <grad f(theta), u_k> for K = ``num_tangents`` tangents in ONE lean forward pass.

    ``make_tangents(j)`` returns the K tangents of ``params[j]`` stacked, shape ``(K, *params[j].shape)``.
    Returns ``(loss, c)`` with c of shape (K,). The closure runs once, under ``torch.func.vmap`` over
    ``torch.func.jvp``: it must not update state it captured in place (BatchNorm running statistics in
    train mode); such models raise ``ValueError`` and need :func:`lean_directional_derivative` per tangent.
    """
    params = list(params)
    _check_params(module, params)
    if isinstance(num_tangents, bool) or not isinstance(num_tangents, int) or num_tangents < 1:
        raise ValueError(f"num_tangents must be an integer >= 1, got {num_tangents!r}")

    def one_pass(_):
        level = maybe_current_level()

        def dual_of(j: int) -> torch.Tensor:
            with torch._C._DisableFuncTorch():
                tangents = make_tangents(j)
            p = params[j]
            if not isinstance(tangents, torch.Tensor) or (tangents.shape, tangents.dtype, tangents.device) != (
                    (num_tangents, *p.shape), p.dtype, p.device):
                described = (f"shape {tuple(tangents.shape)}, {tangents.dtype} on {tangents.device}"
                             if isinstance(tangents, torch.Tensor) else type(tangents).__name__)
                raise ValueError(f"make_tangents({j}) returned {described}; params[{j}] needs shape "
                                 f"{(num_tangents, *p.shape)}, {p.dtype} on {p.device}")
            # the K tangents enter as one batched tensor of the vmap level: the primal stays unbatched
            return fwAD.make_dual(p.detach(), _add_batch_dim(tangents, 0, level))

        def run(_):
            with _JustInTimeTangents(params, dual_of):
                return _check_loss(closure()).reshape(())

        anchor = torch.zeros(())  # func.jvp needs an input; the tangents enter through the parameters
        return torch.func.jvp(run, (anchor,), (anchor,))

    with torch.inference_mode(False), torch.no_grad():
        try:
            loss, c = torch.func.vmap(one_pass, out_dims=(None, 0), randomness="same")(torch.zeros(num_tangents))
        except RuntimeError as error:
            if "mutate a captured Tensor" not in str(error):
                raise
            raise ValueError(
                "the closure updates a tensor it captured in place (e.g. BatchNorm running statistics in train "
                "mode), which several tangents in one pass cannot do; use the one-tangent engine per tangent "
                f"(torch: {error})") from None
    return loss.detach(), c.detach()

def measure_peak(fn: Callable[[], object], device="cpu") -> tuple[object, int]:
    """``(fn(), peak bytes allocated during fn above what was allocated before)``: the memory yardstick.

    CUDA: the caching allocator's peak statistics. CPU: torch's profiler with ``profile_memory=True``
    reports every allocation and free of torch's CPU allocator with a timestamp; the peak is the largest
    running sum. Both count tensors (activations, tangents, kernel workspaces that use torch's allocator),
    not the interpreter or allocator caching, so they are stable from run to run, unlike the peak RSS.
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = fn()
        torch.cuda.synchronize(device)
        return result, torch.cuda.max_memory_allocated(device) - before
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return result, peak


# the one-tangent engine names its K-tangents-in-one-pass form, so ENGINES keeps one signature
lean_directional_derivative.batched = lean_directional_derivatives
