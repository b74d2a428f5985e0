"""Tangents carried beside the primals: the lean engine's one-tangent pass without forward-AD duals.

The lean engine's first form made every tangent-carrying activation a forward-AD dual. That is correct for
any op, but each dual made, unpacked or viewed costs torch's forward-AD bookkeeping (an ``alias``, an
``is_same_size``, a ``_has_same_storage_numel``: about 400 of the 981 aten ops of a lean step on a 2-layer
GPT-2, whose inference forward dispatches 99), and the host time that goes with them. Here the activations
stay plain tensors; a :class:`TangentCarrier` (a ``TorchFunctionMode``) keeps each one's tangent in a table
keyed by the tensor's identity (a weak reference, so an activation's tangent is freed with it), and a torch
call that reads a tangent-carrying tensor computes the output's tangent next to it:

* the lean rules of :mod:`fgfw.lean` (linear, addmm, mul, conv2d, layer_norm, softmax, cross_entropy,
  attention) run their ``forward`` and ``jvp`` on the primals and the table's tangents;
* ops linear in one tensor (views, reshapes, ``contiguous``, dtype casts, sums, ``neg``, ``embedding`` in its
  weight ...) apply themselves to the tangent; ``add``/``sub`` add the tangents, ``cat``/``stack``/``where``
  combine them (a zero where an input has none), ``matmul`` takes its two products, and ``tanh``, ``gelu``,
  ``relu``, ``silu``, ``sigmoid``, ``exp``, ``pow`` and division by a constant take torch's own one-kernel
  derivative ops;
* anything else, and every in-place op, runs once with forward-AD duals made for that call only
  (:meth:`TangentCarrier._with_duals`): torch's own rule, correct, not lean.

Parameters get their tangents just in time, as before (``make_tangent(j)`` when a call first reads
``params[j]``, freed when nothing refers to it). In-place ops on a tangent-carrying tensor update its tangent;
one that would have to update the tangent of a view of it, or of the tensor a view was taken from, is
refused with a ``NotImplementedError`` that names the op (``engine="forward_ad"`` follows views).
"""
from __future__ import annotations

import functools
import inspect
import weakref
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

aten = torch.ops.aten


class _LazyView:
    """The tangent of a view, not made until something reads it: the root tangent, laid out as the primal the view
    was taken from (same shape and strides), and the difference of their storage offsets. A view of a view of ...
    of that primal then has its tangent in one ``as_strided`` with the view's own geometry, however many view ops
    made it (Hugging Face attention's view, split, view, transpose: one op, not four)."""
    __slots__ = ("root", "delta")

    def __init__(self, root: torch.Tensor, delta: int):
        self.root, self.delta = root, delta

    def of(self, view: torch.Tensor) -> torch.Tensor:
        return self.root.as_strided(view.size(), view.stride(), view.storage_offset() + self.delta)


class _Entry:
    __slots__ = ("ref", "tangent", "owned", "aliased")

    def __init__(self, ref, tangent, owned, aliased):
        self.ref = ref
        self.tangent = tangent
        self.owned = owned  # the tangent is this tensor's alone: an in-place op may write it
        self.aliased = aliased  # the tensor is a view, or a view was taken of it


def _name(func) -> str:
    return getattr(func, "__name__", "")


# -- how each torch call is carried, decided once per function ---------------------------------------------------
# ops linear in their first tensor argument: the same call on its tangent gives the output's tangent
_LINEAR_IN_FIRST = {
    "view", "reshape", "permute", "transpose", "swapaxes", "swapdims", "t", "contiguous", "expand", "flatten",
    "unflatten", "unsqueeze", "squeeze", "narrow", "select", "__getitem__", "split", "chunk", "unbind",
    "split_with_sizes", "tensor_split", "movedim", "moveaxis", "repeat", "roll", "flip", "clone", "float", "double",
    "half", "bfloat16", "to", "sum", "mean", "neg", "__neg__", "negative", "diagonal", "tril", "triu", "unfold",
    "narrow_copy", "cumsum", "trace",
    # ops whose other tensor argument gives a shape or dtype only
    "view_as", "reshape_as", "expand_as", "type_as",
}
_SHAPE_ONLY_OTHER = {"view_as", "reshape_as", "expand_as", "type_as", "to"}
# outputs that carry no tangent whatever the inputs' tangents (comparisons, indices, new tensors of a shape)
_NO_TANGENT = {
    "eq", "ne", "lt", "le", "gt", "ge", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "isnan",
    "isinf", "isfinite", "isneginf", "isposinf", "nonzero", "argmax", "argmin", "argsort", "any", "all", "sign",
    "item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__", "__len__", "__repr__",
    "__format__", "is_nonzero", "equal", "allclose", "zeros_like", "ones_like", "empty_like", "full_like",
    "rand_like", "randn_like", "randint_like", "new_zeros", "new_ones", "new_empty", "new_full", "detach",
    "floor", "ceil", "round", "trunc", "bucketize", "searchsorted",
}
_ADD_KINDS = {  # out = ca * a + cb * b for the call's (a, b): (ca, cb), alpha scaling the second
    "add": (1, 1), "__add__": (1, 1), "__radd__": (1, 1), "sub": (1, -1), "subtract": (1, -1),
    "__sub__": (1, -1), "__rsub__": (-1, 1), "rsub": (-1, 1),
}
_PRIMAL_DERIVATIVE = {  # elementwise f: the tangent from torch's one-kernel derivative op, given (t, x, y)
    "tanh": lambda t, x, y, kw: aten.tanh_backward(t, y),
    "sigmoid": lambda t, x, y, kw: aten.sigmoid_backward(t, y),
    "exp": lambda t, x, y, kw: torch.mul(t, y),
    "relu": lambda t, x, y, kw: aten.threshold_backward(t, y, 0),
    "gelu": lambda t, x, y, kw: aten.gelu_backward(t, x, approximate=kw.get("approximate", "none")),
    "silu": lambda t, x, y, kw: aten.silu_backward(t, x),
}
_MATMUL = {"matmul", "__matmul__", "mm", "bmm"}
_TRUEDIV = {"div", "__truediv__", "true_divide", "divide"}
_POW = {"pow", "__pow__"}
_CAT = {"cat", "concat", "concatenate", "stack"}


@functools.lru_cache(maxsize=None)
def _inplace_position(func) -> int | None:
    """Where a torch.nn.functional call takes ``inplace`` positionally (nn.Dropout passes it so), or None."""
    try:
        names = list(inspect.signature(func).parameters)
    except (TypeError, ValueError):
        return None
    return names.index("inplace") if "inplace" in names else None


def _is_inplace(func, name: str, args, kwargs) -> bool:
    if name.endswith("_") and not name.endswith("__"):
        return True
    if name.startswith("__i") and name not in ("__index__", "__int__", "__invert__", "__iter__"):
        return True
    if name == "__setitem__" or kwargs.get("out") is not None or kwargs.get("inplace") is True:
        return True
    if getattr(func, "__module__", None) == "torch.nn.functional":
        position = _inplace_position(func)
        return position is not None and len(args) > position and args[position] is True
    return False


class TangentCarrier(TorchFunctionMode):
    """Computes each tangent-carrying call's output tangent beside its output (see the module docstring)."""

    def __init__(self, params: Sequence[torch.Tensor], make_tangent: Callable[[int], torch.Tensor], level: int,
                 rules: dict, composite: set, needs_math_attention: set, reads_metadata_only: Callable,
                 make_tangents: Callable[[list], list] | None = None):
        """``rules``: torch function -> lean rule (fgfw.lean's, which run their ``forward`` and ``jvp`` through
        :meth:`apply_rule`); ``composite``: the rules written in torch calls, carried call by call;
        ``needs_math_attention``: the calls whose torch rule needs the math attention backend;
        ``make_tangents``: None, or indices -> their tangents at once, for a rule that reads several parameters."""
        super().__init__()
        self._index = {id(p): j for j, p in enumerate(params)}
        self._make_tangent = make_tangent
        self._make_tangents = make_tangents
        self._level = level  # a forward-AD level open for the pass: the calls without a carried rule use it
        self._entries: dict[int, _Entry] = {}
        self._param_tangents: dict[int, torch.Tensor] | None = None  # of the call being carried
        self._rules, self._composite, self._needs_math_attention = rules, composite, needs_math_attention
        self._reads_metadata_only = reads_metadata_only
        self.memo: dict = {}  # what the rules make once per pass and share between layers (a causal mask)

    # -- the table ---------------------------------------------------------------------------------------------
    def tangent(self, x) -> torch.Tensor | None:
        """x's tangent: a parameter's made just in time (once per call), an activation's from the table."""
        j = self._index.get(id(x))
        if j is not None:
            cache = self._param_tangents
            if cache is None:
                return self._make_tangent(j)
            t = cache.get(j)
            if t is None:  # (many: one op where make_tangent allocates and fills in two)
                t = cache[j] = self._make_tangent(j) if self._make_tangents is None else self._make_tangents([j])[0]
            return t
        entry = self._entries.get(id(x))
        if entry is not None and entry.ref() is x:
            if type(entry.tangent) is _LazyView:  # made at its first read, kept for the next
                entry.tangent = entry.tangent.of(x)
            return entry.tangent
        return None

    def _lazy_root(self, x: torch.Tensor) -> _LazyView | None:
        """x's tangent as a lazy view's root: x's own lazy view, or its tangent where that is laid out as x."""
        entry = self._entries.get(id(x))
        if entry is not None and entry.ref() is x and type(entry.tangent) is _LazyView:
            return entry.tangent
        t = self.tangent(x)
        if t is None or t.shape != x.shape or t.stride() != x.stride() or t.dtype != x.dtype:
            return None
        return _LazyView(t, t.storage_offset() - x.storage_offset())

    def _carries(self, values) -> bool:
        index, entries = self._index, self._entries
        for v in values:
            if isinstance(v, torch.Tensor):
                key = id(v)
                if key in index:
                    return True
                entry = entries.get(key)
                if entry is not None and entry.ref() is v:
                    return True
            elif isinstance(v, (list, tuple)) and self._carries(v):
                return True
        return False

    def record(self, out, tangent, owned: bool = True, aliased: bool = False) -> None:
        """Gives each floating tensor of ``out`` (a tensor or a sequence of them) its tangent."""
        if tangent is None:
            return
        if isinstance(out, (list, tuple)):
            for o, t in zip(out, tangent):
                self.record(o, t, owned, aliased)
            return
        if not isinstance(out, torch.Tensor) or not (out.is_floating_point() or out.is_complex()):
            return
        key, entries = id(out), self._entries
        entry = entries.get(key)
        if entry is not None and entry.ref() is out:
            entry.tangent, entry.owned, entry.aliased = tangent, owned, entry.aliased or aliased
            return

        def forget(ref, key=key, entries=entries):
            entry = entries.get(key)
            if entry is not None and entry.ref is ref:
                del entries[key]

        entries[key] = _Entry(weakref.ref(out, forget), tangent, owned, aliased)

    def _mark_aliased(self, x) -> None:
        entry = self._entries.get(id(x))
        if entry is not None and entry.ref() is x:
            entry.aliased = True

    # -- dispatch ------------------------------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if not (self._carries(args) or (kwargs and self._carries(kwargs.values()))) or self._reads_metadata_only(func):
            return func(*args, **kwargs)
        outer, self._param_tangents = self._param_tangents, {}
        try:
            return self._carry(func, args, kwargs)
        finally:
            self._param_tangents = outer

    def _carry(self, func, args, kwargs):
        name = _name(func)
        if _is_inplace(func, name, args, kwargs):
            return self._inplace(func, name, args, kwargs)
        rule = self._rules.get(func)
        if rule is not None:
            if func in self._composite:  # a rule written in torch calls: they are carried one by one
                with self:
                    out = rule(*args, **kwargs)
            else:
                out = rule(*args, **kwargs)  # lean rules reach this carrier through fgfw.lean._apply
            if out is not NotImplemented:
                return out
            return self._with_duals(func, args, kwargs)
        if name in _NO_TANGENT:
            return func(*args, **kwargs)
        x = args[0] if args else None
        if name in _LINEAR_IN_FIRST and isinstance(x, torch.Tensor) and not (
                name == "view" and len(args) == 2 and isinstance(args[1], torch.dtype)):  # a reinterpretation
            others = args[1:] if name not in _SHAPE_ONLY_OTHER else ()
            if not (self._carries(others) or (kwargs and self._carries(kwargs.values()))):
                return self._linear_in_first(func, x, args, kwargs)
        elif name in _ADD_KINDS and len(args) >= 2:
            return self._add(func, name, args, kwargs)
        elif name in _PRIMAL_DERIVATIVE and isinstance(x, torch.Tensor) and len(args) == 1:
            y = func(*args, **kwargs)
            t = self.tangent(x)
            self.record(y, _PRIMAL_DERIVATIVE[name](t, x, y, kwargs))
            return y
        elif name in _MATMUL and len(args) == 2 and not kwargs:
            return self._matmul(func, *args)
        elif name in _TRUEDIV and len(args) == 2 and not kwargs and not self._carries(args[1:]):
            y = func(*args)
            self.record(y, torch.div(self.tangent(x), args[1]))
            return y
        elif name in _POW and len(args) == 2 and not kwargs and isinstance(args[1], (int, float)) \
                and not isinstance(args[1], bool):
            return self._pow(func, x, args[1])
        elif name in _CAT:
            return self._cat(func, args, kwargs)
        elif name == "embedding" and len(args) >= 2 and not self._carries((args[0],)) and \
                (len(args) < 4 or args[3] is None) and kwargs.get("max_norm") is None:
            y = func(*args, **kwargs)
            self.record(y, func(args[0], self.tangent(args[1]), *args[2:], **kwargs))
            return y
        elif name == "dropout" and not (args[2] if len(args) > 2 else kwargs.get("training", True)):
            return func(*args, **kwargs)  # the identity in eval mode: the input, its tangent as it is
        elif name == "masked_fill" and len(args) == 3 and not self._carries(args[1:]) and not kwargs:
            y = func(*args)
            self.record(y, self.tangent(x).masked_fill(args[1], 0))
            return y
        elif func is torch.where and len(args) == 3 and not kwargs and not self._carries(args[:1]):
            return self._where(func, *args)
        return self._with_duals(func, args, kwargs)

    # -- carried rules -----------------------------------------------------------------------------------------
    def apply_rule(self, rule, args):
        """A lean rule of :mod:`fgfw.lean` on the primals and the carried tangents (its ``forward`` and ``jvp``)."""
        cache = self._param_tangents
        if self._make_tangents is not None and cache is not None:  # a layer's weight and bias: drawn together
            wanted = list(dict.fromkeys(j for a in args if isinstance(a, torch.Tensor)
                                        for j in (self._index.get(id(a)),) if j is not None and j not in cache))
            if len(wanted) > 1:
                cache.update(zip(wanted, self._make_tangents(wanted)))
        tangents = [self.tangent(a) if isinstance(a, torch.Tensor) else None for a in args]
        if all(t is None for t in tangents):
            return rule.forward(*args)
        fused = getattr(rule, "fused_forward_and_jvp", None)  # one kernel for the primal and tangent
        if fused is not None:
            with torch._C.DisableTorchFunction():
                both = fused(*args, *tangents)
            if both is not None:
                self.record(both[0], both[1])
                return both[0]
        with torch._C.DisableTorchFunction():  # a rule's own torch calls carry nothing (inside a composite rule too)
            out = rule.forward(*args)
            ctx = _Ctx()
            rule.setup_context(ctx, tuple(args), out)
            t = rule.jvp(ctx, *tangents)
        self.record(out, t)
        return out

    def _linear_in_first(self, func, x, args, kwargs):
        out = func(*args, **kwargs)
        if out is x:  # contiguous() of a contiguous tensor, to() of its own dtype: the tangent stays
            return out
        outs = out if isinstance(out, (list, tuple)) else (out,)
        storage = x.untyped_storage().data_ptr()
        if storage and all(isinstance(o, torch.Tensor) and o._is_view() and o.dtype == x.dtype and
                           o.untyped_storage().data_ptr() == storage for o in outs):
            root = self._lazy_root(x)  # a view of x: its tangent is the same view of x's, made when read
            if root is not None:
                self._mark_aliased(x)
                for o in outs:
                    self.record(o, root, owned=False, aliased=True)
                return out
        t = self.tangent(x)
        try:
            out_t = func(t, *args[1:], **kwargs)
        except RuntimeError:
            if _name(func) != "view":
                raise
            out_t = t.reshape(*args[1:], **kwargs)  # the tangent's strides may not allow the primal's view
        if isinstance(out, torch.Tensor):
            aliased = out._is_view()
            if aliased:
                self._mark_aliased(x)
            self.record(out, out_t, owned=out_t is not t and not out_t._is_view(), aliased=aliased)
        elif isinstance(out, (list, tuple)):  # split, chunk, unbind: views of x
            self._mark_aliased(x)
            self.record(out, out_t, owned=False, aliased=True)
        return out

    def _add(self, func, name, args, kwargs):
        a, b = args[0], args[1]
        alpha = kwargs.get("alpha", args[2] if len(args) > 2 else 1)
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
            return self._with_duals(func, args, kwargs)
        out = func(*args, **kwargs)
        ca, cb = _ADD_KINDS[name]
        if name == "rsub":  # torch.rsub(a, b, alpha) = b - alpha a
            ca *= alpha
        else:
            cb *= alpha
        ta = self.tangent(a) if isinstance(a, torch.Tensor) else None
        tb = self.tangent(b) if isinstance(b, torch.Tensor) else None
        if ta is not None and tb is not None:
            t = torch.add(ta if ca == 1 else ta * ca, tb, alpha=cb)
            owned = True
        else:
            t, c = (ta, ca) if ta is not None else (tb, cb)
            owned = c != 1
            t = t * c if owned else t
            if t.shape != out.shape:
                t = t.expand(out.shape)
            if t.dtype != out.dtype:
                t, owned = t.to(out.dtype), True
        self.record(out, t, owned=owned)
        return out

    def _matmul(self, func, a, b):
        out = func(a, b)
        ta, tb = self.tangent(a), self.tangent(b) if isinstance(b, torch.Tensor) else None
        t = None if ta is None else func(ta, b)
        if tb is not None:
            t = func(a, tb) if t is None else t.add_(func(a, tb))
        self.record(out, t)
        return out

    def _pow(self, func, x, exponent):
        y = func(x, exponent)
        t = self.tangent(x)
        if exponent == 2:
            self.record(y, torch.mul(x, t).mul_(2))
        elif exponent != 0:
            self.record(y, torch.mul(x.pow(exponent - 1), t).mul_(exponent))
        return y

    def _cat(self, func, args, kwargs):
        tensors = args[0] if args else kwargs["tensors"]
        if not isinstance(tensors, (list, tuple)):
            return self._with_duals(func, args, kwargs)
        out = func(*args, **kwargs)
        stack = _name(func) == "stack"
        tangents, sources = [], []
        for x in tensors:
            t = self.tangent(x) if isinstance(x, torch.Tensor) else None
            if t is None:
                if not stack and isinstance(x, torch.Tensor) and x.numel() == 0:
                    continue  # adds nothing along the dimension (an empty key-value cache)
                t = torch.zeros_like(x)
            tangents.append(t)
            sources.append(x)
        if not stack and len(tangents) == 1 and tangents[0].shape == out.shape:
            # the one input that adds anything: its tangent is the output's, shared, so written by neither
            entry = self._entries.get(id(sources[0]))
            if entry is not None and entry.ref() is sources[0]:
                entry.owned = False
            self.record(out, tangents[0], owned=False)
            return out
        rest = dict(kwargs)
        rest.pop("tensors", None)
        self.record(out, func(tangents, *args[1:], **rest))
        return out

    def _where(self, func, condition, a, b):
        out = func(condition, a, b)
        ta = self.tangent(a) if isinstance(a, torch.Tensor) else None
        tb = self.tangent(b) if isinstance(b, torch.Tensor) else None
        t = torch.where(condition, 0.0 if ta is None else ta, 0.0 if tb is None else tb)
        self.record(out, t if t.dtype == out.dtype else t.to(out.dtype))
        return out

    # -- torch's own rules, duals for one call -------------------------------------------------------------------
    def _dual(self, v):
        if isinstance(v, torch.Tensor):
            t = self.tangent(v)
            if t is None:
                return v
            primal = v.detach() if id(v) in self._index else v
            return torch._make_dual(primal, t, self._level)
        if isinstance(v, (list, tuple)) and self._carries(v):
            return type(v)(self._dual(x) for x in v)
        return v

    def _undual(self, out):
        if isinstance(out, torch.Tensor):
            primal, t = torch._unpack_dual(out, self._level)
            if t is None:
                return out
            self.record(primal, t, owned=False, aliased=out._is_view())
            return primal
        if isinstance(out, (list, tuple)) and any(isinstance(o, torch.Tensor) for o in out):
            return type(out)(self._undual(o) for o in out)
        return out

    def _with_duals(self, func, args, kwargs):
        args = tuple(self._dual(a) for a in args)
        kwargs = {k: self._dual(v) for k, v in kwargs.items()}
        if func in self._needs_math_attention:
            with sdpa_kernel(SDPBackend.MATH):
                return self._undual(func(*args, **kwargs))
        return self._undual(func(*args, **kwargs))

    def _inplace(self, func, name, args, kwargs):
        """An in-place op: run on a dual of its target, whose tangent then becomes the target's."""
        in_kwargs = kwargs.get("out") is not None
        target = kwargs["out"] if in_kwargs else args[0]
        if not isinstance(target, torch.Tensor):
            return self._with_duals(func, args, kwargs)
        entry = self._entries.get(id(target))
        if entry is not None and entry.ref() is not target:
            entry = None
        if entry is not None:
            if entry.aliased:
                raise NotImplementedError(
                    f"the lean engine cannot carry the in-place {name or func} on a tensor that is a view or has "
                    f"views (their tangents would not follow); write it out of place, or use engine='forward_ad'")
            if not entry.owned:
                entry.tangent, entry.owned = entry.tangent.clone(), True
            t = entry.tangent
        else:
            # a view, or a base with views (its storage held by more than it and the storage object asked here)
            if target._is_view() or torch._C._storage_Use_Count(target.untyped_storage()._cdata) > 2:
                raise NotImplementedError(
                    f"the lean engine cannot carry the in-place {name or func} that gives a view (or a tensor with "
                    f"views) a tangent; write it out of place, or use engine='forward_ad'")
            if not (target.is_floating_point() or target.is_complex()):
                return self._with_duals(func, args, kwargs)
            t = torch.zeros_like(target)
        dual_target = torch._make_dual(target, t, self._level)
        others_args = tuple(self._dual(a) for a in (args if in_kwargs else args[1:]))
        others_kwargs = {k: self._dual(v) for k, v in kwargs.items() if k != "out"}
        if in_kwargs:
            out = func(*others_args, out=dual_target, **others_kwargs)
        else:
            out = func(dual_target, *others_args, **others_kwargs)
        _, new_t = torch._unpack_dual(dual_target, self._level)
        self.record(target, new_t, owned=new_t is t or not new_t._is_view())
        return target if out is dual_target else self._undual(out)


class _Ctx:
    """The ``ctx`` that a rule's ``setup_context`` and ``jvp`` get when run outside ``Function.apply``."""

    def save_for_forward(self, *tensors):
        self.saved_tensors = tensors

    def set_materialize_grads(self, value):
        # the rules that leave it on have one floating-point tensor input, and jvp runs only when that
        # input has a tangent: nothing to materialise
        pass
