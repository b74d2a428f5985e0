"""The torch.optim face of the Frank-Wolfe optimizers: arguments, param groups, state_dict, the step counter; the
plan (plan.py) and the step (functional.py) live beside it. FrankWolfe, the backprop baseline, is here; FGFW and
AFGFW are in forward_gradient.py."""
from __future__ import annotations

import math
from typing import Callable, Iterable

import torch
from torch import nn

from .. import _ops, constraints, reference, schedules
from ..constraints import Constraint
from . import checkpoint, functional, plan as planning, settings


class _FrankWolfeBase(torch.optim.Optimizer):
    """What all three optimizers share: validation, radii, the step counter and the fused update."""

    # the group entries that hold schedules (state_dict saves a callable as a marker, see schedules.to_state)
    _SCHEDULE_KEYS: tuple[str, ...] = ("step_size",)

    def __init__(self, params, defaults: dict, *, constraint: Constraint, backend: str | None, check_finite: bool,
                 rescale: str | None = None):
        if constraint is None:  # the default group is unconstrained: a gradient step
            constraint = constraints.Unconstrained()
        if not isinstance(constraint, Constraint):
            raise TypeError(f"constraint must be an fgfw constraint such as fgfw.L1Ball(radius=...), or None "
                            f"(unconstrained), got {type(constraint).__name__}")
        if isinstance(params, nn.Module):
            # a model: its trainable parameters, its modules known to the radius rules (zero-initialised balls)
            constraints.register_modules(params)
            params = [p for p in params.parameters() if p.requires_grad]
        # k of the last step taken (the next step is k + 1): a tensor advanced in place on the device of the
        # first parameter, so that a torch.compile'd step reads and advances it inside one graph (a Python
        # int would be specialised, one compilation per k), the kernels read it where it lies (no host
        # synchronisation) and a CUDA graph that replays a step advances it too.
        self._step_count_k = torch.zeros((), dtype=torch.int64)
        self.check_finite = bool(check_finite)
        # The deferred finite check (check_finite): "first" is the step k of the first non-finite direction not yet
        # reported (0: none), on the counter's device; while it is set every step is skipped on the device (the ops
        # read it as the schedule's skip element). On a GPU each step copies it to "host" (pinned) and records
        # "event", so that a later step() reads it once the GPU is past it, without waiting.
        self._nonfinite: dict = {"first": torch.zeros((), dtype=torch.float64), "host": None, "event": None}
        # What a step reports goes into a dict: torch.compile (dynamo) drops attribute assignments to an
        # optimizer made inside a compiled step, but keeps the mutations of a container it holds.
        self._step_results: dict[str, torch.Tensor | None] = {"gap": None}
        self._frozen_left_out = 0  # frozen parameters add_param_group left out
        self._plan_cache: dict[str, planning.Plan | None] = {"plan": None}  # see _prepared
        # per param group, what its radii were resolved from: (constraint, its settings, radii); see
        # settings.apply_setting_changes
        self._radii_source: list[tuple] = []
        defaults = dict(defaults, constraint=constraint, backend=backend, rescale=rescale, center=None)
        params, _ = settings.param_tensors(params)
        # every group's start is checked before any group's is rescaled into its ball
        groups = [item["params"] for item in params] if params and all(isinstance(i, dict) for i in params) \
            else [params]
        for g, members in enumerate(groups):
            settings.check_finite_start(self, members, g)
        super().__init__(params, defaults)
        first = next((p for g in self.param_groups for p in g["params"]), None)
        if first is None and self._frozen_left_out:
            raise ValueError(f"every parameter given to {type(self).__name__} is frozen (requires_grad=False): there "
                             f"is nothing to optimize; pass the parameters to train, with requires_grad=True")
        if first is not None:
            self._step_count_k = self._step_count_k.to(first.device)
            self._nonfinite["first"] = self._nonfinite["first"].to(first.device)

    @property
    def last_gap(self) -> torch.Tensor | None:
        """The Frank-Wolfe gap ``<d, theta - s>`` of the last step, d its direction, theta the pre-step
        parameters, s the vertex, summed over all balls (float64 tensor); None before the first step. It is
        the true gap ``max_{s in C} <d, theta - s>`` (up to rounding) where :attr:`exact_gap` says so.

        Reading it raises the ``ValueError`` of a non-finite step not yet reported (see ``check_finite``): it waits
        for the device, as reading the gap's value would."""
        self._report_nonfinite(wait=True)
        return self._step_results["gap"]

    @last_gap.setter
    def last_gap(self, gap: torch.Tensor | None) -> None:
        self._step_results["gap"] = gap

    @property
    def exact_gap(self) -> bool:
        """Whether :attr:`last_gap` is the true Frank-Wolfe gap of the step's direction: True unless some ball's
        vertex is computed approximately (a :class:`fgfw.NuclearNormBall` over a matrix whose smaller side
        exceeds its ``full_svd_max``: ``Constraint.exact_lmo``), where it is an estimate from below (at most
        the true gap). For FGFW and AFGFW the direction is the gradient estimate, not the gradient."""
        for group in self.param_groups:
            constraint, params = group["constraint"], group["params"]
            if constraint.global_ball:
                shapes = [(sum(p.numel() for p in params),)]
            elif constraint.scope == "row":
                shapes = [(math.prod(p.shape[1:]) if p.dim() >= 2 else p.numel(),) for p in params]
            else:
                shapes = [tuple(p.shape) for p in params]
            if not all(constraint.exact_lmo(shape) for shape in shapes):
                return False
        return True

    # -- construction -------------------------------------------------------------------------------------------
    def _param_name(self, p: torch.Tensor) -> str | None:
        """p's name for messages, where the optimizer knows one (the forward-gradient ones know the module)."""
        return None

    def add_param_group(self, param_group: dict) -> None:
        """Adds a group after checking its parameters; sets its radii and makes the start feasible.

        Frozen parameters (``requires_grad=False``) are left out of the group, with a warning that names
        them: the optimizer never reads, rescales nor updates them.
        """
        group = settings.checked_group(self, param_group)
        super().add_param_group(group)
        if settings.centred(group):
            for p in group["params"]:  # in the compute dtype, as the step's arithmetic (theta - c is stepped there)
                self.state[p]["center"] = p.detach().to(reference.compute_dtype(p.dtype), copy=True)
        self._radii_source.append(settings.radii_record(group))
        self._plan_cache["plan"] = None

    def _check_group_hyperparameters(self, group: dict) -> None:
        schedules.check_schedule(group["step_size"], "step_size")
        if group["rescale"] is not None and group["rescale"] not in reference.RESCALES:
            raise ValueError(f"rescale must be None or one of {reference.RESCALES}, got {group['rescale']!r}")

    # -- persistence (checkpoint.py) ----------------------------------------------------------------------------
    def _extra_state(self) -> dict:
        return {"optimizer": type(self).__name__, "step": int(self._step_count_k)}

    def _check_extra_state(self, extra: dict) -> None:
        checkpoint.check_extra_state(self, extra)

    def _load_extra_state(self, extra: dict) -> None:
        self._step_count_k.fill_(int(extra["step"]))

    def state_dict(self) -> dict:
        """The optimizer's state in plain types only (numbers, strings, lists, dicts and tensors), so that
        ``torch.load`` reads it with its default ``weights_only=True``.

        Each group's constraint is saved as its ``to_dict()``. A callable schedule (``step_size`` or
        ``averaging_weight``) cannot be saved: it is recorded as ``{"kind": "callable", "name": ...}`` and
        the optimizer that loads the state must be built with that callable (see :meth:`load_state_dict`).
        Schedule names and numbers are saved as they are.

        It raises the ``ValueError`` of a non-finite step not yet reported (see ``check_finite``) first.
        """
        self._report_nonfinite(wait=True)
        return checkpoint.saved(self, super().state_dict())

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads a state saved by :meth:`state_dict` of the same optimizer class over parameters of the same
        shapes (in the same param groups).

        Everything is checked before anything changes: a state of another optimizer class, of parameters
        of other shapes or counts, of another tangent stream version, or with invalid values raises
        ``ValueError`` and leaves the optimizer as it was. A schedule saved as a callable is taken from
        this optimizer, which must then have been built with a callable there. The optimizer keeps its
        own ``backend`` (a checkpoint may move between machines); everything else comes from the state.

        That includes each group's constraint and radii: a state saved with another set, radius, scope or
        rule than this optimizer was built with replaces them, with a ``UserWarning`` that names both. A
        warning, not an error: the state is the run's record (the parameters saved with it lie in the saved
        balls, and the saved set and radii are what resume the run bit-identically), and building an optimizer
        with any constraint and then loading a checkpoint is the usual way to resume one; the warning catches
        a checkpoint loaded into a run that meant another set.
        """
        state_dict, extra = checkpoint.checked(self, state_dict)
        super().load_state_dict(state_dict)
        checkpoint.finish_load(self, state_dict)
        self._load_extra_state(extra)
        # a non-finite step not yet reported belongs to the run this state replaces
        self._nonfinite["first"].zero_()
        self._nonfinite["event"] = None
        self._plan_cache["plan"] = None  # new state tensors

    # -- the plan (plan.py) -------------------------------------------------------------------------------------
    def _master(self, p: torch.Tensor) -> torch.Tensor:
        """The float32 master copy of a float16/bfloat16 parameter (made at its first step).

        The step's arithmetic keeps a float32 iterate inside its set (docs/feasibility.md); stepping the
        half-precision values themselves would round them every step, and alpha |theta_i|
        below half an ulp would stop an element from shrinking while the vertex element grows: the
        iterate drifts out of the ball. The optimizer owns the parameter's value from then on: a value
        written into the parameter from outside is overwritten by the next step (load it through
        load_state_dict, or build a new optimizer).
        """
        return planning.master(self.state, p)

    _uses_tangent_stream = False  # the forward-gradient optimizers: tensors get places in the tangent stream

    def _takes_part(self, group: dict) -> list[bool]:
        """Which parameters of ``group`` this step updates: all but those frozen since construction."""
        return [p.requires_grad for p in group["params"]]

    def _missing_gradient(self, p: torch.Tensor) -> bool:
        """Whether p has no gradient to read (FrankWolfe: ``p.grad is None``); a global ball then reads zeros."""
        return False

    def _uses_momentum(self, group: dict) -> bool:
        return False

    def _averaging_weight(self, group: dict, k: int | torch.Tensor) -> float | torch.Tensor:
        return 0.0

    def _schedule_key(self, group: dict) -> tuple:
        """What makes two groups' steps differ besides radius and scope: groups with equal keys share one
        fused call (their alpha_k and gamma_k are the same)."""
        return (settings.spec_key(group["step_size"]),)

    def _plan_key(self) -> list:
        """What the plan is built from: compared with the cached plan's key at every step. Radii are copied
        (a radius changed in place is seen); a row ball's radii are tuples (see settings.check_groups). The
        constraint's settings are read too (a radius set on the object is seen): see apply_setting_changes."""
        # state cleared: momentum tensors made anew (load_state_dict drops the plan itself). Not id(self.state):
        # torch.compile of torch 2.11 cannot trace id() of a dict (fullgraph steps failed there, on an H200).
        key: list = [len(self.state)]  # index 0: updated by the step that makes the state (_make_state)
        # groups by position, not id(group): torch 2.11's dynamo cannot trace id() of a dict either
        for g, group in enumerate(self.param_groups):
            constraint = group["constraint"]
            key.append((g, tuple(map(id, group["params"])), constraint, settings.constraint_spec(constraint),
                        group["backend"], self._schedule_key(group), group["rescale"], list(group["radii"]),
                        tuple(self._takes_part(group)), group.get("center")))
        return key

    def _prepared(self) -> planning.Plan:
        """The plan of this step: the cached one unless the groups changed since it was built.

        A compiled step builds its own while it is traced, and neither reads nor stores the cache: a graph that
        reached the parameters through a cached plan kept references to their gradients, and dynamo dropped the
        graph whenever zero_grad() freed them (a recompilation per step). Storing it failed on torch 2.11 too,
        whose dynamo refuses an attribute assignment to an optimizer inside a compiled step."""
        if torch.compiler.is_compiling():
            return self._build_plan()
        plan = self._plan_cache["plan"]
        if plan is None or plan.key != self._plan_key():
            plan = self._plan_cache["plan"] = self._build_plan()
        return plan

    def _build_plan(self) -> planning.Plan:
        """The groups checked again (their settings may have changed since the last step), then planned."""
        settings.check_groups(self)
        return planning.build_plan(self.param_groups, key=self._plan_key(), takes_part=self._takes_part,
                                   uses_momentum=self._uses_momentum, schedule_key=self._schedule_key,
                                   missing_gradient=self._missing_gradient, tangent_stream=self._uses_tangent_stream)

    # -- the step (functional.py) -------------------------------------------------------------------------------
    def _schedules(self, plan: planning.Plan, k: torch.Tensor, skip: torch.Tensor | None) -> list[torch.Tensor]:
        return functional.schedules_of(plan, k, schedule_key=self._schedule_key,
                                       averaging_weight=self._averaging_weight, skip=skip)

    # -- the deferred finite check ------------------------------------------------------------------------------
    def _direction_name(self) -> str:
        """What a step's direction is, for the error of a non-finite one."""
        return "a gradient"

    def _skip_flag(self, nonfinite: torch.Tensor | None, k: torch.Tensor) -> torch.Tensor | None:
        """The schedules' skip element of step k, on the counter's device: with check_finite, the step of the first
        non-finite direction not yet reported (``nonfinite``: this step's, a 0-dim bool tensor), else None. Device
        ops only: while the counter stays at that step's k - 1 (the step is skipped), k cannot exceed it."""
        if nonfinite is None:
            return None
        first = self._nonfinite["first"]
        if nonfinite.device != first.device:
            nonfinite = nonfinite.to(first.device)
        # k, not max(first, k): the counter stays at a skipped step's k - 1, so k >= first (one op, not three)
        torch.where(nonfinite, k, first, out=first)
        return first

    def _after_step(self, skip: torch.Tensor | None) -> None:
        """On a GPU, the skip flag's copy to the host, read by a later step() once the GPU is past this one; then
        the check of :meth:`_report_nonfinite` (on the CPU: this step's own)."""
        if skip is None or torch.compiler.is_compiling():
            return
        if skip.device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
            if self._nonfinite["host"] is None:
                self._nonfinite["host"] = torch.empty((), dtype=torch.float64, pin_memory=True)
            self._nonfinite["host"].copy_(skip, non_blocking=True)
            event = self._nonfinite["event"] = torch.cuda.Event()
            event.record()
        self._report_nonfinite(wait=False)

    def _report_nonfinite(self, wait: bool) -> None:
        """Raises ``ValueError`` for a non-finite step the host has not reported yet, and clears it (the next step
        runs). ``wait=False`` (step()): only where the answer is at hand, the CPU's flag or a GPU copy whose event
        has completed; ``wait=True`` (last_gap, state_dict): reads the flag, waiting for the device."""
        if not self.check_finite or torch.compiler.is_compiling():
            return
        state = self._nonfinite
        first = state["first"]
        if first.device.type == "cpu" or wait:
            if first.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return
            value = float(first)
        else:
            event = state["event"]
            if event is None or not event.query():
                return
            value = float(state["host"])
        if value:
            first.zero_()
            state["event"] = None
            raise ValueError(
                f"{self._direction_name()} was not finite at step k={int(value)}: that step, and any step since, "
                f"left the parameters and the optimizer state as they were before it (they were skipped on the "
                f"device; the check reads no value on the host during a step). Check the loss and the step size, or "
                f"pass check_finite=False")

    def _make_state(self, plan: planning.Plan, call: planning.Call) -> None:
        planning.make_state(call, self.state)
        plan.key[0] = len(self.state)  # the state this plan made is its own (see _plan_key)

    def _apply(self, plan: planning.Plan, k: torch.Tensor, nonfinite: torch.Tensor | None, *,
               grads: list[list[torch.Tensor]] | None, tangent_coeffs: torch.Tensor | None, seed: int,
               distribution: int) -> None:
        """The step (functional.fw_step) with its schedules, then the gap and the counter (which a skipped step
        leaves), then the finite check's report (_after_step). ``nonfinite``: whether this step's direction is not
        finite (a 0-dim bool tensor), None without check_finite. Into the container itself, not through the
        last_gap property: torch 2.11's dynamo refuses a property's setattr inside a compiled step."""
        skip = self._skip_flag(nonfinite, k)
        schedule = self._schedules(plan, k, skip)
        self._step_results["gap"] = functional.fw_step(
            plan, schedule, k, grads=grads, tangent_coeffs=tangent_coeffs, seed=seed, distribution=distribution,
            state=self.state, make_state=lambda call: self._make_state(plan, call))
        if skip is None:
            self._step_count_k.copy_(k)
        else:
            self._step_count_k.add_(skip == 0)
        self._after_step(skip)


class FrankWolfe(_FrankWolfeBase):
    r"""Stochastic Frank-Wolfe on the backprop gradient (the baseline of the paper's figures).

    .. math::
        v_k &= \rho\, v_{k-1} + (1-\rho)\, \nabla f(\theta_k) \quad (\text{or } v_k = \nabla f(\theta_k) \text{ without momentum})\\
        s_k &= \arg\min_{s \in C} \langle v_k, s \rangle \\
        \theta_{k+1} &= (1-\alpha_k)\,\theta_k + \alpha_k s_k

    Used like any torch optimizer: ``loss.backward(); opt.step(); opt.zero_grad()``.

    Args:
        params: parameters or param groups (all parameters of a group on one device), or a model (an
            ``nn.Module``: its trainable parameters, in one group). Frozen ones (``requires_grad=False``) are
            left out with a warning, so ``model.parameters()`` of a model with frozen layers leaves those
            layers alone (not even rescaled into the ball). Given a model (or groups from
            :func:`fgfw.param_groups`), the radius rules draw a zero-initialised tensor's radius from its
            module's initialisation (:meth:`Constraint.resolve_radii`).
        constraint: the feasible set, e.g. ``fgfw.L1Ball(radius=...)``.
        step_size: alpha_k (schedule name, constant or callable; default ``"2/(k+2)"``; a callable is not
            saved by ``state_dict``, see :meth:`state_dict`).
        momentum: rho in [0, 1), or None for none (0 also means none). rho weighs the OLD momentum:
            ``v = rho v + (1 - rho) g`` (torch.optim.SGD's ``momentum`` weighs the old buffer too, but adds
            the whole gradient; other Frank-Wolfe libraries call the new gradient's weight "momentum").
            The new gradient's weight ``1 - rho`` is AFGFW's ``averaging_weight`` gamma.
        rescale: None (default: every ball steps by alpha_k), ``"diameter"`` (each ball by
            ``min(alpha_k / D, 1)``, D its L2 diameter: a step moves theta by at most alpha_k, whatever the
            set's size) or ``"gradient"`` (``min(alpha_k ||d|| / ||theta - s||, 1)`` per ball: the step's
            length is alpha_k ||d||, as SGD's with learning rate alpha_k). A rescaled step, even on the L1
            ball, runs in torch ops (reference.fw_step_), not in the fused kernels.
        backend: ``"cuda" | "triton" | "cpu" | "torch" | "auto"`` (default: $FGFW_BACKEND, else auto).
        check_finite: a step whose gradient has a NaN or inf changes nothing, and raises ``ValueError``
            later, without a host synchronisation in the step: the check runs on the device (one multi-tensor
            reduction) and the fused ops skip the step there (parameters, momentum and state keep their bits; in a
            centred ball a -0.0 may become +0.0). Every step after it is skipped too, until the error is raised
            (the counter stays). The error comes from the first of: a ``step()`` call once the device has
            finished the bad step (on the CPU, that step itself; on a GPU, usually the next step()); reading
            ``last_gap``; ``state_dict()``. Under torch.compile or CUDA-graph capture the step stays whole (no
            graph break) and the error comes from ``last_gap``, ``state_dict()`` or an eager step(). The sets
            stepped in torch ops (the spectral, nuclear-norm and other non-fused sets) read their schedule on
            the host, as they always did. ``False``: no check (a NaN then spreads into the parameters).

    Parameters whose ``grad`` is None are skipped (per-tensor and row balls: neither they nor their
    momentum move) or take a zero gradient (a global ball, whose update scales every parameter). So are
    parameters frozen after construction; in a global ball those raise ``ValueError``. A non-contiguous
    gradient is used as its contiguous copy. After a step, ``last_gap`` holds the Frank-Wolfe gap
    ``<v, theta - s>`` at the pre-step parameters, summed over all balls of all groups (a float64 tensor):
    the true gap of v unless ``exact_gap`` is False (a large nuclear-norm ball).
    """

    def __init__(self, params: Iterable | nn.Module, *, constraint: Constraint,
                 step_size: schedules.Schedule = "2/(k+2)", momentum: float | None = None, rescale: str | None = None,
                 backend: str | None = None, check_finite: bool = True):
        super().__init__(params, dict(step_size=step_size, momentum=momentum), constraint=constraint,
                         backend=backend, check_finite=check_finite, rescale=rescale)

    def _check_group_hyperparameters(self, group: dict) -> None:
        super()._check_group_hyperparameters(group)
        rho = group["momentum"]
        if rho is not None and (isinstance(rho, bool) or not isinstance(rho, (int, float))
                                or not (0 <= rho < 1) or not math.isfinite(rho)):
            raise ValueError(f"momentum must be None or a number in [0, 1), got {rho!r}")

    def _uses_momentum(self, group: dict) -> bool:
        return bool(group["momentum"])

    def _takes_part(self, group: dict) -> list[bool]:
        # a parameter without a gradient is skipped, but a global ball steps all its parameters (reading zeros)
        if group["constraint"].global_ball:
            return [p.requires_grad for p in group["params"]]
        return [p.requires_grad and p.grad is not None for p in group["params"]]

    def _plan_key(self) -> list:
        # which parameters of a global ball read zeros (build_plan keeps a zero tensor for each)
        return super()._plan_key() + [tuple(p.grad is None for group in self.param_groups
                                            if group["constraint"].global_ball for p in group["params"])]

    def _missing_gradient(self, p: torch.Tensor) -> bool:
        return p.grad is None

    def _schedule_key(self, group: dict) -> tuple:
        return (settings.spec_key(group["step_size"]), group["momentum"] or 0.0)

    def _averaging_weight(self, group: dict, k: torch.Tensor) -> float:
        return 1.0 - group["momentum"] if group["momentum"] else 0.0

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None):
        """One Frank-Wolfe step from ``p.grad``. ``closure`` (optional) recomputes the loss with a backward pass."""
        self._report_nonfinite(wait=False)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        k = self._step_count_k + 1
        plan = self._prepared()
        grads = functional.gradients(plan, lambda p: p.grad)
        nonfinite = (_ops.nonfinite([g for call_grads in grads for g in call_grads], k.device)
                     if self.check_finite else None)
        self._apply(plan, k, nonfinite, grads=grads, tangent_coeffs=None, seed=0, distribution=0)
        return loss