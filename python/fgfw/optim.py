"""Frank-Wolfe optimizers: backprop FW, FGFW (Algorithm 1) and AFGFW (Algorithm 2).

Each is a ``torch.optim.Optimizer``. They validate the parameters, own the step counter, the seed, the
schedules and the per-parameter momentum ``v``, and call one fused op per (device, dtype) bucket of a
param group; the op layer (``fgfw._ops``) picks the backend.
"""
from __future__ import annotations

import math
import warnings
from itertools import chain
from typing import Callable, Iterable

import torch
from torch import nn

from . import _ops, activity, forward_grad, reference, schedules
from .constraints import L1Ball

STATE_KEY = "fgfw"
# "weight": the paper's projected forward gradient, u over the parameters; "activity": u over the outputs
# of nn.Linear layers (fgfw.activity), far less variance, per-example losses needed.
ESTIMATORS = ("weight", "activity")


def _all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every entry of every tensor is finite: the norms on one device, one host synchronisation."""
    norms = torch._foreach_norm(tensors)
    device = norms[0].device
    return bool(torch.isfinite(torch.stack([n.to(device, torch.float64) for n in norms])).all())


def _device_scalar(x: float | torch.Tensor, device: torch.device) -> torch.Tensor:
    """x as a float64 0-dim tensor on device: a tensor is moved (a no-op where it lies), a number is
    written by a fill kernel rather than copied from the host."""
    if isinstance(x, torch.Tensor):
        return x.to(device, torch.float64)
    return torch.full((), float(x), dtype=torch.float64, device=device)


def _describe(i: int, p: torch.Tensor) -> str:
    return f"parameter {i} (shape {tuple(p.shape)}, dtype {p.dtype}, device {p.device})"


def _row_balls(params, grads, moms, radii, starts):
    """Scope "row": the op's row_numel (each tensor's row length, see ``L1Ball.rows``) and one radius per row.

    Empty tensors have no ball and are left out (nothing of theirs moves).
    """
    keep = [t for t, p in enumerate(params) if p.numel()]
    row_numel = [params[t][0].numel() if params[t].dim() >= 2 else 0 for t in keep]
    pick = lambda xs: [xs[t] for t in keep] if xs else xs  # noqa: E731
    return (pick(params), pick(grads), pick(moms), [r for t in keep for r in radii[t]], pick(starts), row_numel)


class _FrankWolfeBase(torch.optim.Optimizer):
    """What all three optimizers share: validation, radii, the step counter and the fused update."""

    def __init__(self, params, defaults: dict, *, constraint: L1Ball, backend: str | None, check_finite: bool):
        if not isinstance(constraint, L1Ball):
            raise TypeError(f"constraint must be an fgfw constraint such as fgfw.L1Ball(radius=...), "
                            f"got {type(constraint).__name__}")
        # k of the last step taken (the next step is k + 1): a tensor advanced in place on the device of the
        # first parameter, so that a torch.compile'd step reads and advances it inside one graph (a Python
        # int would be specialised, one compilation per k), the kernels read it where it lies (no host
        # synchronisation) and a CUDA graph that replays a step advances it too.
        self._step_count_k = torch.zeros((), dtype=torch.int64)
        self.check_finite = bool(check_finite)
        # What a step reports goes into a dict: torch.compile (dynamo) drops attribute assignments to an
        # optimizer made inside a compiled step, but keeps the mutations of a container it holds.
        self._step_results: dict[str, torch.Tensor | None] = {"gap": None}
        defaults = dict(defaults, constraint=constraint, backend=backend)
        super().__init__(params, defaults)
        first = next((p for g in self.param_groups for p in g["params"]), None)
        if first is not None:
            self._step_count_k = self._step_count_k.to(first.device)

    @property
    def last_gap(self) -> torch.Tensor | None:
        """The Frank-Wolfe gap of the last step (float64 tensor); None before the first step."""
        return self._step_results["gap"]

    @last_gap.setter
    def last_gap(self, gap: torch.Tensor | None) -> None:
        self._step_results["gap"] = gap

    # -- construction -------------------------------------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        """Adds a group after checking its parameters; sets its radii and makes the start feasible."""
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        for i, p in enumerate(params):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"params must be tensors, got {type(p).__name__} at position {i}")
            if p.layout != torch.strided:
                raise TypeError(f"{_describe(i, p)} has layout {p.layout}: Frank-Wolfe needs dense (strided) tensors")
            if not p.is_floating_point():
                raise TypeError(f"{_describe(i, p)} is not floating point; only float16/bfloat16/float32/float64 "
                                f"parameters can be optimized")
            if not p.is_contiguous():
                raise ValueError(f"{_describe(i, p)} is not contiguous; the fused kernels walk parameters as flat "
                                 f"memory (make it contiguous before creating the optimizer)")
        devices = {p.device for p in params}
        if len(devices) > 1:
            raise ValueError(f"params of one param group must share a device, got {sorted(map(str, devices))}; "
                             f"put each device's parameters in its own group")
        group = dict(param_group, params=params)
        for key, value in self.defaults.items():
            group.setdefault(key, value)
        constraint = group["constraint"]
        if not isinstance(constraint, L1Ball):
            raise TypeError(f"constraint must be an fgfw.L1Ball, got {type(constraint).__name__}")
        if constraint.global_ball and len({p.dtype for p in params}) > 1:
            raise ValueError("an L1Ball with scope='global' needs one dtype for all params of the group, got "
                             f"{sorted(map(str, {p.dtype for p in params}))}; split them into groups")
        self._check_group_hyperparameters(group)
        if params:
            _ops.resolve_backend(group["backend"], next(iter(devices)))  # fail now, not at the first step
        group.setdefault("radii", constraint.resolve_radii(params))
        constraint.make_feasible_(params, group["radii"])
        super().add_param_group(group)

    def _check_group_hyperparameters(self, group: dict) -> None:
        schedules.check_schedule(group["step_size"], "step_size")

    # -- persistence --------------------------------------------------------------------------------------------
    def _extra_state(self) -> dict:
        return {"step": int(self._step_count_k)}

    def _load_extra_state(self, extra: dict) -> None:
        self._step_count_k.fill_(int(extra["step"]))

    def state_dict(self) -> dict:
        state = super().state_dict()
        state[STATE_KEY] = dict(self._extra_state(), tangent_stream_version=reference.TANGENT_STREAM_VERSION)
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        extra = state_dict.pop(STATE_KEY, None)
        if extra is None:
            raise ValueError(f"state_dict has no {STATE_KEY!r} entry: it was not saved by an fgfw optimizer")
        if extra.get("tangent_stream_version") != reference.TANGENT_STREAM_VERSION:
            raise ValueError(f"state_dict was saved with tangent stream version {extra.get('tangent_stream_version')}"
                             f", this fgfw has {reference.TANGENT_STREAM_VERSION}: the run cannot be resumed exactly")
        super().load_state_dict(state_dict)
        # torch casts floating state to the parameter's dtype; momentum keeps the compute dtype (fp32 for bf16).
        saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        for saved_id, p in zip(saved_ids, params):
            saved = state_dict["state"].get(saved_id, {})
            if "momentum" in saved:
                self.state[p]["momentum"] = saved["momentum"].to(
                    device=p.device, dtype=reference.compute_dtype(p.dtype), copy=True)
        self._load_extra_state(extra)

    # -- the update ---------------------------------------------------------------------------------------------
    def _plan(self, k: torch.Tensor) -> list[tuple[dict, float | torch.Tensor, float | torch.Tensor]]:
        """(group, alpha_k, gamma_k) for every group, evaluated before anything is modified.

        k is the step counter tensor; named schedules come out as float64 tensors (schedules.evaluate).
        """
        k = k.to(torch.float64)  # on the counter's device: named schedules stay there (schedules.evaluate)
        plan = []
        for group in self.param_groups:
            alpha = schedules.evaluate(group["step_size"], k, "step_size")
            gamma = self._averaging_weight(group, k)
            plan.append((group, alpha, gamma))
        return plan

    def _averaging_weight(self, group: dict, k: torch.Tensor) -> float | torch.Tensor:
        return 0.0

    def _uses_momentum(self, group: dict) -> bool:
        return False

    def _apply(self, plan, k: torch.Tensor, *, grads_of: Callable[[torch.Tensor], torch.Tensor | None] | None,
               tangent_coeffs: torch.Tensor | None, offsets: dict[int, int], seed: int, distribution: int) -> None:
        gaps = []
        for group, alpha, gamma in plan:
            params = group["params"]
            if not params:
                continue
            constraint: L1Ball = group["constraint"]
            device = params[0].device
            backend = _ops.resolve_backend(group["backend"], device)
            momentum = self._uses_momentum(group)
            # Per-tensor balls are independent: one call per dtype. A global ball is one call (one dtype).
            buckets: dict[torch.dtype, list[int]] = {}
            for i, p in enumerate(params):
                buckets.setdefault(p.dtype, []).append(i)
            # (k, alpha_k, gamma_k) made on the device: no host-to-device copy, so a step can be captured
            schedule = torch.stack([_device_scalar(x, device) for x in (k, alpha, gamma)])
            coeffs = (tangent_coeffs.to(device) if tangent_coeffs is not None
                      else torch.zeros(0, dtype=torch.float64, device=device))
            for dtype, indices in buckets.items():
                ps = [params[i] for i in indices]
                grads = []
                if grads_of is not None:
                    grads = [grads_of(p) for p in ps]
                    if any(g is None for g in grads):
                        if not constraint.global_ball:
                            raise AssertionError("parameters without gradients are filtered before _apply")
                        # a global ball scales every parameter; a missing gradient is a zero gradient
                        grads = [torch.zeros_like(p) if g is None else g for p, g in zip(ps, grads)]
                moms = []
                if momentum:
                    for p in ps:
                        state = self.state[p]
                        if "momentum" not in state:
                            state["momentum"] = torch.zeros_like(p, dtype=reference.compute_dtype(p.dtype))
                        moms.append(state["momentum"])
                radii = group["radii"] if constraint.global_ball else [group["radii"][i] for i in indices]
                starts = [offsets.get(id(p), 0) for p in ps]
                row_numel = []
                if constraint.scope == "row":
                    ps, grads, moms, radii, starts, row_numel = _row_balls(ps, grads, moms, radii, starts)
                gap = torch.zeros((), dtype=torch.float64, device=device)
                _ops.l1_fw_step_(ps, moms, grads, schedule, coeffs, radii, constraint.global_ball, starts, seed,
                                 distribution, gap, backend=backend, row_numel=row_numel)
                gaps.append(gap)
        # summed where the first group lives: no host synchronisation
        self.last_gap = None
        for gap in gaps:
            self.last_gap = gap if self.last_gap is None else self.last_gap + gap.to(self.last_gap.device)
        self._step_count_k.copy_(k)


class FrankWolfe(_FrankWolfeBase):
    r"""Stochastic Frank-Wolfe on the backprop gradient (the baseline of the paper's figures).

    .. math::
        v_k &= \rho\, v_{k-1} + (1-\rho)\, \nabla f(\theta_k) \quad (\text{or } v_k = \nabla f(\theta_k) \text{ without momentum})\\
        s_k &= \arg\min_{s \in C} \langle v_k, s \rangle \\
        \theta_{k+1} &= (1-\alpha_k)\,\theta_k + \alpha_k s_k

    Used like any torch optimizer: ``loss.backward(); opt.step(); opt.zero_grad()``.

    Args:
        params: parameters or param groups (all parameters of a group on one device).
        constraint: the feasible set, e.g. ``fgfw.L1Ball(radius=...)``.
        step_size: alpha_k (schedule name, constant or callable; default ``"2/(k+2)"``).
        momentum: rho in [0, 1), or None for none (0 also means none).
        backend: ``"cuda" | "triton" | "cpu" | "torch" | "auto"`` (default: $FGFW_BACKEND, else auto).
        check_finite: raise ``ValueError`` on a non-finite gradient before touching anything (one host sync;
            under torch.compile a graph break, so ``fullgraph=True`` needs ``check_finite=False``).

    Parameters whose ``grad`` is None are skipped (per-tensor balls) or take a zero gradient (a global
    ball, whose update scales every parameter). After a step, ``last_gap`` holds the Frank-Wolfe gap
    ``<v, theta - s>`` at the pre-step parameters (a float64 tensor).
    """

    def __init__(self, params: Iterable, *, constraint: L1Ball, step_size: schedules.Schedule = "2/(k+2)",
                 momentum: float | None = None, backend: str | None = None, check_finite: bool = True):
        super().__init__(params, dict(step_size=step_size, momentum=momentum), constraint=constraint,
                         backend=backend, check_finite=check_finite)

    def _check_group_hyperparameters(self, group: dict) -> None:
        super()._check_group_hyperparameters(group)
        rho = group["momentum"]
        if rho is not None and (isinstance(rho, bool) or not isinstance(rho, (int, float))
                                or not (0 <= rho < 1) or not math.isfinite(rho)):
            raise ValueError(f"momentum must be None or a number in [0, 1), got {rho!r}")

    def _uses_momentum(self, group: dict) -> bool:
        return bool(group["momentum"])

    def _averaging_weight(self, group: dict, k: torch.Tensor) -> float:
        return 1.0 - group["momentum"] if group["momentum"] else 0.0

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None):
        """One Frank-Wolfe step from ``p.grad``. ``closure`` (optional) recomputes the loss with a backward pass."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        k = self._step_count_k + 1
        plan = []
        for group, alpha, gamma in self._plan(k):
            with_grad = [p for p in group["params"] if p.grad is not None]
            for p in with_grad:
                if p.grad.is_sparse:
                    raise TypeError(f"FrankWolfe does not support sparse gradients (parameter of shape "
                                    f"{tuple(p.shape)})")
            if not group["constraint"].global_ball:
                group = dict(group, params=with_grad, radii=[r for p, r in zip(group["params"], group["radii"])
                                                             if p.grad is not None])
            plan.append((group, alpha, gamma))
        if self.check_finite:
            grads = [p.grad for group, _, _ in plan for p in group["params"] if p.grad is not None]
            if grads and not _all_finite(grads):
                raise ValueError(f"a gradient is not finite at step k={int(k)}; parameters and optimizer state were "
                                 f"left unchanged (pass check_finite=False to skip this check)")
        self._apply(plan, k, grads_of=lambda p: p.grad, tangent_coeffs=None, offsets={}, seed=0, distribution=0)
        return loss


class _ForwardGradientFrankWolfe(_FrankWolfeBase):
    """FGFW and AFGFW: the gradient estimate comes from forward-mode directional derivatives."""

    def __init__(self, module: nn.Module, params: Iterable | None, defaults: dict, *, constraint: L1Ball,
                 seed: int | None, tangent: str, num_tangents: int, engine: str | None, backend: str | None,
                 check_finite: bool, tangents_in_one_pass: bool, estimator: str, recompute_inputs: bool):
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be the torch.nn.Module whose forward the closure runs, got "
                            f"{type(module).__name__} (pass the model, and its parameters or groups as params=)")
        if tangent not in reference.DISTRIBUTIONS:
            raise ValueError(f"tangent must be one of {sorted(reference.DISTRIBUTIONS)}, got {tangent!r}")
        if isinstance(num_tangents, bool) or not isinstance(num_tangents, int) or num_tangents < 1:
            raise ValueError(f"num_tangents must be an integer >= 1, got {num_tangents!r}")
        if estimator not in ESTIMATORS:
            raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
        if recompute_inputs and estimator != "activity":
            raise ValueError("recompute_inputs=True applies to estimator='activity' (the weight estimator keeps no "
                             "inputs to recompute)")
        if estimator == "activity" and engine is not None:
            raise ValueError(f"engine selects the forward-mode engine of estimator='weight'; estimator='activity' "
                             f"always runs torch's forward AD (got engine={engine!r})")
        engine = forward_grad.DEFAULT_ENGINE if engine is None else engine
        if engine not in forward_grad.ENGINES:
            raise ValueError(f"engine must be one of {sorted(forward_grad.ENGINES)}, got {engine!r}")
        if tangents_in_one_pass and estimator == "weight" and not hasattr(forward_grad.ENGINES[engine], "batched"):
            raise ValueError(f"tangents_in_one_pass=True needs an engine with a batched form (\"lean\"), got "
                             f"engine={engine!r}")
        if seed is None:
            seed = int(torch.empty((), dtype=torch.int64).random_())  # from torch's RNG: manual_seed fixes it
        elif isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
        self.module = module
        self.seed = seed
        self.tangent = tangent
        self.num_tangents = num_tangents
        self.tangents_in_one_pass = bool(tangents_in_one_pass)
        self.engine = engine
        self.estimator = estimator
        self.recompute_inputs = bool(recompute_inputs)
        if params is None:
            params = [p for p in module.parameters() if p.requires_grad]
        super().__init__(params, defaults, constraint=constraint, backend=backend, check_finite=check_finite)
        module_params = {id(p) for p in module.parameters()}
        for group in self.param_groups:
            for p in group["params"]:
                if id(p) not in module_params:
                    raise ValueError(f"params must be parameters of module; got a tensor of shape {tuple(p.shape)} "
                                     f"that module does not own (the JVP can only perturb the module's parameters)")
        if estimator == "activity":
            activity.linear_owners(module, [p for g in self.param_groups for p in g["params"]])

    def _extra_state(self) -> dict:
        return dict(super()._extra_state(), seed=self.seed, tangent=self.tangent, num_tangents=self.num_tangents,
                    estimator=self.estimator)

    def _load_extra_state(self, extra: dict) -> None:
        super()._load_extra_state(extra)
        self.seed, self.tangent, self.num_tangents = int(extra["seed"]), extra["tangent"], int(extra["num_tangents"])
        self.estimator = extra.get("estimator", "weight")

    def _stream_offsets(self) -> tuple[list[torch.Tensor], dict[int, int]]:
        """All parameters in order and each one's first index in the tangent stream.

        Each tensor starts at a multiple of 4, the start of a Philox call, so that the kernels can draw one
        call per 4 aligned elements of every tensor (vectorised loads and stores).
        """
        params = [p for g in self.param_groups for p in g["params"]]
        offsets, start = {}, 0
        for p in params:
            offsets[id(p)] = start
            start += -(-p.numel() // 4) * 4
        return params, offsets

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor]) -> torch.Tensor:
        """One step: ``num_tangents`` forward-mode passes of ``closure``, then the fused Frank-Wolfe update.

        ``closure`` runs the model as usual and returns the scalar loss, e.g.
        ``opt.step(lambda: F.cross_entropy(model(x), y))``; it is called under forward-mode AD and no_grad
        (no backward pass, no stored activations). With ``estimator="activity"`` it returns the per-example
        losses instead (``reduction="none"``). Returns the (mean) loss at the pre-step parameters.
        """
        if closure is None or not callable(closure):
            raise TypeError(f"{type(self).__name__}.step needs a closure that computes the loss with the module, "
                            f"e.g. opt.step(lambda: F.cross_entropy(model(x), y))")
        k = self._step_count_k + 1
        plan = self._plan(k)
        params, offsets = self._stream_offsets()
        distribution = reference.DISTRIBUTIONS[self.tangent]
        backends = {}

        def fill(out: torch.Tensor, offset: int, tangent_id: int) -> torch.Tensor:
            """``out`` filled with tangent ``tangent_id`` of step k from ``offset`` of the stream."""
            if out.device not in backends:
                backends[out.device] = _ops.resolve_backend(self.param_groups[0]["backend"], out.device)
            return _ops.fill_tangent_(out, self.seed, k.to(out.device), tangent_id, offset, distribution,
                                      backends[out.device])

        def tangent_maker(tangent_id: int):
            return lambda j: fill(torch.empty_like(params[j]), offsets[id(params[j])], tangent_id)

        if self.estimator == "activity":
            return self._activity_step(plan, k, params, closure, fill)
        derivative = forward_grad.ENGINES[self.engine]
        if self.tangents_in_one_pass and self.num_tangents > 1:
            makers = [tangent_maker(t) for t in range(self.num_tangents)]
            loss, coeffs = derivative.batched(self.module, params,
                                              lambda j: torch.stack([make(j) for make in makers]), closure,
                                              self.num_tangents)
            coeffs = coeffs.reshape(-1).to(torch.float64)
        else:
            loss, coeffs = None, []
            for tangent_id in range(self.num_tangents):
                loss_t, c = derivative(self.module, params, tangent_maker(tangent_id), closure)
                loss = loss_t if loss is None else loss
                coeffs.append(c.reshape(()).to(torch.float64))
            coeffs = torch.stack(coeffs)
        if self.check_finite and not bool(torch.isfinite(coeffs).all()):
            raise ValueError(f"the directional derivative <grad f, u> is not finite at step k={int(k)} "
                             f"(values {coeffs.tolist()}, loss {float(loss)}); parameters and optimizer state were left "
                             f"unchanged (check the closure and step size, or pass check_finite=False)")
        self._apply(plan, k, grads_of=None, tangent_coeffs=coeffs / self.num_tangents, offsets=offsets,
                    seed=self.seed, distribution=distribution)
        return loss

    def _activity_step(self, plan, k: torch.Tensor, params: list[torch.Tensor], closure, fill):
        """The step with estimator='activity': tangents on linear outputs (drawn by ``fill``, the stream of
        step k), a dense estimate, the gradient path of the fused op (see fgfw.activity)."""
        loss, grads = activity.activity_gradients(self.module, params, closure, fill, self.num_tangents,
                                                  self.tangents_in_one_pass, self.recompute_inputs)
        if self.check_finite and not _all_finite(list(grads.values())):
            raise ValueError(f"the activity-perturbed gradient estimate is not finite at step k={int(k)} (loss "
                             f"{float(loss)}); parameters and optimizer state were left unchanged (check the closure "
                             f"and step size, or pass check_finite=False)")
        self._apply(plan, k, grads_of=lambda p: grads[id(p)], tangent_coeffs=None, offsets={}, seed=0,
                    distribution=0)
        return loss


class FGFW(_ForwardGradientFrankWolfe):
    r"""Projected forward-gradient Frank-Wolfe (the paper's Algorithm 1). No backward pass.

    .. math::
        u_k &\sim \mathcal N(0, I), \qquad \hat g_k = \langle \nabla f(\theta_k), u_k\rangle\, u_k \\
        s_k &= \arg\min_{s \in C} \langle \hat g_k, s \rangle \\
        \theta_{k+1} &= (1-\alpha_k)\,\theta_k + \alpha_k s_k

    The directional derivative ``c = <grad f, u>`` comes from one forward-mode pass per tangent; with
    ``num_tangents = K`` the estimate is the mean of K such terms. FGFW converges only to a neighbourhood
    of the optimum (Theorem 1): its estimate's variance does not vanish. See :class:`AFGFW`.

    Args:
        module: the model the closure runs (its parameters are perturbed by the tangents).
        params: the parameters or param groups to optimize (default: the module's trainable parameters).
        constraint: e.g. ``fgfw.L1Ball(radius=...)``.
        step_size: alpha_k (default the paper's ``"2/(k+2)"``).
        seed: seed of the tangent stream (default: drawn from torch's RNG). Same seed, same run.
        tangent: ``"gaussian"`` (the paper) or ``"rademacher"``.
        num_tangents: K tangents per step (K forward passes; the estimate is their mean).
        tangents_in_one_pass: carry the K tangents through ONE forward pass (vmap over the lean JVP rules:
            the primal is computed once, tangent memory grows with K). Not for modules that update buffers
            in place (BatchNorm in train mode raises ``ValueError``).
        engine: forward-mode engine from ``fgfw.forward_grad.ENGINES``: ``"lean"`` (default: just-in-time
            tangents, lean rules) or ``"forward_ad"`` (torch's stock forward-mode AD, the reference).
        backend, check_finite: as in :class:`FrankWolfe`; a non-finite directional derivative raises
            ``ValueError`` and leaves parameters and state untouched.
        estimator: ``"weight"`` (default, the paper's: tangents over the parameters) or ``"activity"``
            (tangents over the outputs of the ``nn.Linear`` layers, see :mod:`fgfw.activity`: every
            parameter must belong to an ``nn.Linear``, the closure must return per-example losses, e.g.
            ``F.cross_entropy(logits, y, reduction="none")``, whose mean is minimised, and ``engine``
            does not apply). Far lower variance; it keeps each linear layer's input during the pass.
        recompute_inputs: with ``estimator="activity"``, keep no layer input through the forward-mode pass
            and run the closure once more, plainly, to build the estimate layer by layer: memory of an
            inference forward plus a parameter-sized estimate, for one extra forward. The closure must be
            deterministic (no dropout in train mode); a second pass that differs raises ``ValueError``.
    """

    def __init__(self, module: nn.Module, params: Iterable | None = None, *, constraint: L1Ball,
                 step_size: schedules.Schedule = "2/(k+2)", seed: int | None = None, tangent: str = "gaussian",
                 num_tangents: int = 1, engine: str | None = None, backend: str | None = None,
                 check_finite: bool = True, tangents_in_one_pass: bool = False, estimator: str = "weight",
                 recompute_inputs: bool = False):
        super().__init__(module, params, dict(step_size=step_size), constraint=constraint, seed=seed,
                         tangent=tangent, num_tangents=num_tangents, engine=engine, backend=backend,
                         check_finite=check_finite, tangents_in_one_pass=tangents_in_one_pass, estimator=estimator,
                         recompute_inputs=recompute_inputs)
        if tangent == "rademacher" and num_tangents == 1 and estimator == "weight":
            # g_hat = c u has |g_hat_i| = |c| everywhere: the argmax is always a ball's first element
            warnings.warn("FGFW with one Rademacher tangent always picks the first element of each ball (every "
                          "|g_hat_i| is equal); use tangent='gaussian', num_tangents > 1, or AFGFW", stacklevel=2)


class AFGFW(_ForwardGradientFrankWolfe):
    r"""Averaged (variance-reduced) projected forward-gradient Frank-Wolfe (the paper's Algorithm 2).

    .. math::
        u_k &\sim \mathcal N(0, I), \qquad \hat g_k = \langle \nabla f(\theta_k), u_k\rangle\, u_k \\
        v_k &= (1-\gamma_k)\, v_{k-1} + \gamma_k\, \hat g_k, \qquad v_0 = 0 \\
        s_k &= \arg\min_{s \in C} \langle v_k, s \rangle \\
        \theta_{k+1} &= (1-\alpha_k)\,\theta_k + \alpha_k s_k

    Defaults are the paper's schedules, alpha_k = 1/k and gamma_k = 1/sqrt(k) (k counts steps from 1;
    note alpha_1 = 1 replaces theta by a vertex at the first step). ``averaging_weight`` is gamma_k; the
    momentum v is kept in float32 for float16/bfloat16 parameters. Other arguments as in :class:`FGFW`.
    """

    def __init__(self, module: nn.Module, params: Iterable | None = None, *, constraint: L1Ball,
                 step_size: schedules.Schedule = "1/k", averaging_weight: schedules.Schedule = "1/sqrt(k)",
                 seed: int | None = None, tangent: str = "gaussian", num_tangents: int = 1, engine: str | None = None,
                 backend: str | None = None, check_finite: bool = True, tangents_in_one_pass: bool = False,
                 estimator: str = "weight", recompute_inputs: bool = False):
        super().__init__(module, params, dict(step_size=step_size, averaging_weight=averaging_weight),
                         constraint=constraint, seed=seed, tangent=tangent, num_tangents=num_tangents, engine=engine,
                         backend=backend, check_finite=check_finite, tangents_in_one_pass=tangents_in_one_pass,
                         estimator=estimator, recompute_inputs=recompute_inputs)

    def _check_group_hyperparameters(self, group: dict) -> None:
        super()._check_group_hyperparameters(group)
        schedules.check_schedule(group["averaging_weight"], "averaging_weight")

    def _uses_momentum(self, group: dict) -> bool:
        return True

    def _averaging_weight(self, group: dict, k: torch.Tensor) -> float | torch.Tensor:
        return schedules.evaluate(group["averaging_weight"], k, "averaging_weight")
