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

from . import _ops, activity, constraints, distributed, forward_grad, reference, schedules
from .constraints import Constraint, L1Ball, _user_stacklevel

STATE_KEY = "fgfw"
# "weight": the paper's projected forward gradient, u over the parameters; "activity": u over the outputs
# of nn.Linear layers (fgfw.activity), far less variance, per-example losses needed.
ESTIMATORS = ("weight", "activity")


def _called_autograd(error: BaseException) -> bool:
    """Whether ``error`` was raised inside ``torch.autograd.backward`` or ``torch.autograd.grad``."""
    tb = error.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_globals.get("__name__") == "torch.autograd" and frame.f_code.co_name in ("backward", "grad"):
            return True
        tb = tb.tb_next
    return False


def _batch_weight(batch_size: object) -> float:
    """A rank's weight in the data-parallel mean: its batch size, or 1 (equal weights) when not given."""
    if batch_size is None:
        return 1.0
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be None or an integer >= 1 (this rank's number of examples), got "
                         f"{batch_size!r}")
    return float(batch_size)


def _param_tensors(params: Iterable) -> tuple[list, list[torch.Tensor]]:
    """``params`` (tensors, or param-group dicts) as a list, with every tensor they hold; an iterator inside
    a group is read once, into a list."""
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    out, tensors = [], []
    for item in params:
        if isinstance(item, dict):
            members = item.get("params", [])
            members = [members] if isinstance(members, torch.Tensor) else list(members)
            item = dict(item, params=members)
            tensors.extend(t for t in members if isinstance(t, torch.Tensor))
        elif isinstance(item, torch.Tensor):
            tensors.append(item)
        out.append(item)
    return out, tensors


def _row_radii(radii: list) -> list[tuple]:
    """A row ball's radii as stored in its group: one tuple per tensor, so that none changes in place."""
    return [tuple(r) for r in radii]


def _check_radii(constraint: Constraint, params: list[torch.Tensor], radii: object, where: str) -> None:
    """``radii`` must fit ``constraint`` over ``params``: one radius for a global ball, one per tensor, or one
    list per tensor with one radius per row (scope "row"); each finite and > 0."""
    def numbers(values, expected: int, what: str) -> None:
        if not isinstance(values, (list, tuple)) or len(values) != expected:
            got = f"{len(values)}" if isinstance(values, (list, tuple)) else type(values).__name__
            raise ValueError(f"{where}: radii must hold {expected} {what}, got {got}: it was saved for other "
                             f"parameters or another constraint")
        for r in values:
            # comparisons, not math.isfinite: a compiled step that recompiled for other radii traces them as
            # symbolic floats, which math.isfinite turns into a torch op that breaks the graph
            if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r < math.inf:
                raise ValueError(f"{where}: radii must be finite numbers > 0, got {r!r}")

    if constraint.global_ball:
        numbers(radii, 1, "radius (one global ball)")
    elif constraint.scope == "row":
        if not isinstance(radii, (list, tuple)) or len(radii) != len(params):
            numbers(radii, len(params), "lists of row radii (one per tensor)")
        for p, per_tensor in zip(params, radii):
            numbers(per_tensor, len(L1Ball.rows(p)), f"radii for the rows of a tensor of shape {tuple(p.shape)}")
    else:
        numbers(radii, len(params), "radii (one per tensor)")


def _gradient_step(call: "_Call", grads: list[torch.Tensor], schedule: torch.Tensor) -> None:
    """reference.gradient_step_ for an unconstrained call, in device ops that read nothing on the host (so a
    compiled or captured step keeps it whole), with the reference's roundings (tests/test_unconstrained.py):
    each product rounded on its own, then the sum. Multi-tensor ops, so that the number of ops (GPU launches)
    does not grow with the number of tensors: tests/test_op_count.py."""
    _, alpha, gamma = schedule.to(call.dtype).unbind()  # one cast, as the reference's of each number
    d = grads
    if call.moms:
        torch._foreach_mul_(call.moms, 1 - gamma)
        torch._foreach_add_(call.moms, torch._foreach_mul(grads, gamma))
        d = call.moms
    torch._foreach_sub_(call.targets, torch._foreach_mul(d, alpha))


# Parameter dtypes stepped through a float32 master copy (see _FrankWolfeBase._master).
_HALF_DTYPES = (torch.float16, torch.bfloat16)
CENTERS = (None, "init")  # where a group's balls are centred: 0, or the parameters' values when it is added


def _device_scalar(x: float | torch.Tensor, device: torch.device) -> torch.Tensor:
    """x as a float64 0-dim tensor on device: a tensor is moved (a no-op where it lies), a number is
    written by a fill kernel rather than copied from the host."""
    if isinstance(x, torch.Tensor):
        return x.to(device, torch.float64)
    return torch.full((), float(x), dtype=torch.float64, device=device)


def _describe(i: int, p: torch.Tensor) -> str:
    return f"parameter {i} (shape {tuple(p.shape)}, dtype {p.dtype}, device {p.device})"


def _constraint_spec(constraint: Constraint) -> tuple:
    """What a group's radii and balls are made from: the constraint's settings (its to_dict values). A change of
    any (radius, scope, rule, p, k, ...) between steps is applied in full (_apply_setting_changes)."""
    return tuple(constraint.to_dict().items())


def _feasibility(constraint: Constraint) -> reference.Feasibility | None:
    """How a step in torch ops (reference.fw_step_) keeps the constraint's set: the fused sets' Feasibility, the L1
    ball's (stepped there only with rescale=), or None for the sets stepped with Constraint.SHRINK_STEP."""
    if isinstance(constraint, L1Ball):
        return reference.set_feasibility("l1")
    fused = constraint.fused_step()
    return None if fused is None else reference.set_feasibility(*fused)


def _spec_key(spec) -> object:
    """A schedule as a dict key: names and numbers by value, callables by identity."""
    return spec if isinstance(spec, (str, int, float)) else ("callable", id(spec))


class _Call:
    """One fused op call of a step, prepared once per plan (see _FrankWolfeBase._prepared): which tensors it
    steps and with what constants. Only the gradients, the schedule and the gap are made per step."""

    __slots__ = ("device", "dtype", "backend", "momentum", "global_ball", "group", "params", "targets", "moms",
                 "radii", "starts", "row_numel", "halves", "zero_grads", "constraint", "fused_set", "feasibility",
                 "scales", "centers")

    def __init__(self, device, dtype, backend, momentum, global_ball, group):
        self.device, self.dtype, self.backend = device, dtype, backend
        self.momentum, self.global_ball, self.group = momentum, global_ball, group  # group: its schedules
        self.params: list[torch.Tensor] = []   # the parameters, whose gradients are read
        # what the op steps: the parameter, or its float32 master copy (None until the first step, _make_state)
        self.targets: list[torch.Tensor] | None = None
        self.moms: list[torch.Tensor] = []
        self.radii: list[float] = []
        self.starts: list[int] = []
        self.row_numel: list[int] = []
        self.halves: list[tuple[torch.Tensor, torch.Tensor]] = []
        # a global ball's parameters without a gradient: a zero gradient (its update scales every parameter)
        self.zero_grads: dict[int, torch.Tensor] = {}
        self.constraint: Constraint | None = None  # a set other than the L1 ball: stepped by its vertex
        self.fused_set = None  # (kind, parameter) when a fused kernel steps that set (Constraint.fused_step)
        # how a step in torch ops keeps the set (reference.Feasibility; None: Constraint.SHRINK_STEP)
        self.feasibility: reference.Feasibility | None = None
        # the norm feedback's scale of every ball (state "norm_scale", _make_state) where the set has one
        self.scales: list[torch.Tensor] = []
        # a group with center="init": its balls are centred at the start (state "center"), the op steps theta - c
        self.centers: list[torch.Tensor] = []


class _Plan:
    """What a step does that does not change from step to step: the fused calls, and (forward-gradient
    optimizers) the parameters that get tangents with their places in the tangent stream."""

    __slots__ = ("key", "calls", "stream_params", "offsets", "tangent_backends", "no_coeffs")

    def __init__(self, key, calls, stream_params, offsets, tangent_backends):
        self.key, self.calls, self.stream_params, self.offsets = key, calls, stream_params, offsets
        # the tangents on a device are drawn by the backend of the first group there (one named for another
        # device's group may not run on this one); the update of each group regenerates them with its own
        self.tangent_backends = tangent_backends
        self.no_coeffs: dict[torch.device, torch.Tensor] = {}  # the gradient path's empty tangent_coeffs


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
        # What a step reports goes into a dict: torch.compile (dynamo) drops attribute assignments to an
        # optimizer made inside a compiled step, but keeps the mutations of a container it holds.
        self._step_results: dict[str, torch.Tensor | None] = {"gap": None}
        self._frozen_left_out = 0  # frozen parameters add_param_group left out
        self._plan_cache: dict[str, _Plan | None] = {"plan": None}  # see _prepared
        # per param group, what its radii were resolved from: (constraint, its _constraint_spec, radii); see
        # _apply_setting_changes
        self._radii_source: list[tuple] = []
        defaults = dict(defaults, constraint=constraint, backend=backend, rescale=rescale, center=None)
        params, _ = _param_tensors(params)
        # every group's start is checked before any group's is rescaled into its ball
        groups = [item["params"] for item in params] if params and all(isinstance(i, dict) for i in params) \
            else [params]
        for g, members in enumerate(groups):
            self._check_finite_start(members, g)
        super().__init__(params, defaults)
        first = next((p for g in self.param_groups for p in g["params"]), None)
        if first is None and self._frozen_left_out:
            raise ValueError(f"every parameter given to {type(self).__name__} is frozen (requires_grad=False): there "
                             f"is nothing to optimize; pass the parameters to train, with requires_grad=True")
        if first is not None:
            self._step_count_k = self._step_count_k.to(first.device)

    @property
    def last_gap(self) -> torch.Tensor | None:
        """The Frank-Wolfe gap ``<d, theta - s>`` of the last step, d its direction, theta the pre-step
        parameters, s the vertex, summed over all balls (float64 tensor); None before the first step. It is
        the true gap ``max_{s in C} <d, theta - s>`` (up to rounding) where :attr:`exact_gap` says so."""
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

    def _check_finite_start(self, params: list, group_index: int) -> None:
        """``ValueError`` naming the first trainable parameter that holds NaN or inf: rescaling it into its ball
        would spread them (a NaN made the whole tensor NaN, an inf gave [nan, 0, 0]). Frozen parameters are
        left out of the optimizer, and other bad input gets its own error from add_param_group."""
        for i, p in enumerate(params):
            if not isinstance(p, torch.Tensor) or not p.requires_grad or p.layout != torch.strided or p.is_meta \
                    or not p.is_floating_point():
                continue
            bad = int((~torch.isfinite(p.detach())).sum())
            if bad:
                name = self._param_name(p)
                what = f"parameter {name!r} (shape {tuple(p.shape)})" if name else _describe(i, p)
                raise ValueError(f"{what} of param group {group_index} holds {bad} non-finite value(s) (NaN or inf) "
                                 f"of {p.numel()}: a Frank-Wolfe start must be finite; initialise it to finite values "
                                 f"before giving it to {type(self).__name__} (nothing was changed)")

    def add_param_group(self, param_group: dict) -> None:
        """Adds a group after checking its parameters; sets its radii and makes the start feasible.

        Frozen parameters (``requires_grad=False``) are left out of the group, with a warning that names
        them: the optimizer never reads, rescales nor updates them.
        """
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
        self._check_finite_start(params, len(self.param_groups))
        devices = {p.device for p in params}
        if len(devices) > 1:
            raise ValueError(f"params of one param group must share a device, got {sorted(map(str, devices))}; "
                             f"put each device's parameters in its own group")
        frozen = [(i, p) for i, p in enumerate(params) if not p.requires_grad]
        if frozen:
            names = ", ".join(repr(self._param_name(p)) if self._param_name(p) else _describe(i, p) for i, p in frozen)
            warnings.warn(f"{type(self).__name__} left out {len(frozen)} of the {len(params)} params of a param group, "
                          f"frozen (requires_grad=False): {names}. They are never read, rescaled nor updated; set "
                          f"requires_grad=True before creating the optimizer to train them",
                          UserWarning, stacklevel=_user_stacklevel())
            self._frozen_left_out += len(frozen)
            params = [p for p in params if p.requires_grad]
        group = dict(param_group, params=params)
        for key, value in self.defaults.items():
            group.setdefault(key, value)
        if group["constraint"] is None:  # an unconstrained group: a gradient step (constraints.Unconstrained)
            group["constraint"] = constraints.Unconstrained()
        constraint = group["constraint"]
        if not isinstance(constraint, Constraint):
            raise TypeError(f"constraint must be an fgfw constraint such as fgfw.L1Ball(radius=...), or None "
                            f"(unconstrained), got {type(constraint).__name__}")
        if isinstance(constraint, constraints.Unconstrained) and group["rescale"] is not None:
            raise ValueError(f"rescale={group['rescale']!r} scales a Frank-Wolfe step; an unconstrained group takes "
                             f"a gradient step: leave rescale=None for it")
        if constraint.global_ball and len({reference.compute_dtype(p.dtype) for p in params}) > 1:
            raise ValueError(f"a {type(constraint).__name__} with scope='global' cannot mix float64 with other params (one compute dtype "
                             f"per ball), got {sorted(map(str, {p.dtype for p in params}))}; split them into groups")
        self._check_group_hyperparameters(group)
        if params:
            _ops.resolve_backend(group["backend"], next(iter(devices)))  # fail now, not at the first step
        group.setdefault("radii", constraint.resolve_radii(params))
        if constraint.scope == "row":
            group["radii"] = _row_radii(group["radii"])
        if group["center"] not in CENTERS:
            raise ValueError(f"center must be one of {CENTERS} (None: the set's balls are centred at 0; 'init': at "
                             f"the parameters' values when the group is added, for fine-tuning), got "
                             f"{group['center']!r}")
        centred = self._centred(group)
        if not centred:  # a centred group starts at its centre: theta - c = 0 is in every ball
            constraint.make_feasible_(params, group["radii"])
        super().add_param_group(group)
        if centred:
            for p in params:  # in the compute dtype, as the step's arithmetic (theta - c is stepped there)
                self.state[p]["center"] = p.detach().to(reference.compute_dtype(p.dtype), copy=True)
        self._radii_source.append(self._radii_record(group))
        self._plan_cache["plan"] = None

    @staticmethod
    def _centred(group: dict) -> bool:
        """Whether the group's balls are centred at its starting values (an unconstrained group has none)."""
        return group.get("center") == "init" and not isinstance(group["constraint"], constraints.Unconstrained)

    def _centers_of(self, group: dict) -> list[torch.Tensor] | None:
        """The centres of a centred group's parameters (state "center"), or None for balls centred at 0."""
        return [self.state[p]["center"] for p in group["params"]] if self._centred(group) else None

    def _check_center(self, group: dict, g: int) -> None:
        """center is fixed when a group is added (its centre is the parameters' values then)."""
        wants = self._centred(group)
        has = [p for p in group["params"] if p in self.state and "center" in self.state[p]]
        if group.get("center") not in CENTERS or (wants and len(has) != len(group["params"])) \
                or (not wants and has and not isinstance(group["constraint"], constraints.Unconstrained)):
            raise ValueError(f"param group {g}: center was changed to {group.get('center')!r} after the group was "
                             f"added; a group's centre is set when it is added (center='init' keeps the values "
                             f"then): create the optimizer again, or add a new group")

    @staticmethod
    def _radii_record(group: dict) -> tuple:
        return group["constraint"], _constraint_spec(group["constraint"]), list(group["radii"])

    def _apply_setting_changes(self) -> None:
        """Applies what changed in a group's constraint or radii since its radii were made, as construction does.

        A new constraint object, or a change of its settings (radius, scope, rule, its own parameters), makes
        the group's radii again from it (an explicit radius, or the rule measured on the current parameters);
        a new ``group["radii"]`` is taken as given. Either way the parameters are then moved into the new balls
        (rescaled, with a warning beyond rounding; a float16/bfloat16 parameter through its float32 master
        copy). Every group is checked before any changes: invalid settings raise ``ValueError`` (``TypeError``
        for a constraint that is not one) naming the group, with nothing changed."""
        changes = []
        for g, group in enumerate(self.param_groups):
            self._check_center(group, g)
            source, spec, radii = self._radii_source[g]
            if group["constraint"] is None:  # made unconstrained: a gradient step from now on
                group["constraint"] = constraints.Unconstrained()
            constraint, params = group["constraint"], group["params"]
            new_set = constraint is not source or _constraint_spec(constraint) != spec
            if not new_set and list(group["radii"]) == radii:
                continue
            where = f"param group {g}"
            if not isinstance(constraint, Constraint):
                raise TypeError(f"{where}: constraint must be an fgfw constraint such as fgfw.L1Ball(radius=...), "
                                f"got {type(constraint).__name__}")
            targets = [self.state[p]["master"] if p in self.state and "master" in self.state[p] else p
                       for p in params]
            if new_set:
                try:
                    constraint.check()
                except (TypeError, ValueError) as err:
                    raise ValueError(f"{where}: its constraint was changed to invalid settings: {err}") from None
                if constraint.global_ball and len({reference.compute_dtype(p.dtype) for p in params}) > 1:
                    raise ValueError(f"{where}: a {type(constraint).__name__} with scope='global' cannot mix float64 "
                                     f"with other params, got {sorted(map(str, {p.dtype for p in params}))}")
                new_radii = constraint.resolve_radii(targets)
            else:
                new_radii = group["radii"]
            _check_radii(constraint, params, new_radii, where)
            changes.append((g, group, constraint, targets, _row_radii(new_radii) if constraint.scope == "row"
                            else list(new_radii)))
        for g, group, constraint, targets, new_radii in changes:
            centers = self._centers_of(group)
            if centers is not None:  # the balls are around the centre: theta - c is moved into them
                deltas = [t.detach().to(c.dtype) - c for t, c in zip(targets, centers)]
                constraint.make_feasible_(deltas, new_radii, f"the parameters of param group {g} (its settings "
                                                             f"changed), less their centre")
                with torch.no_grad():
                    for t, c, delta in zip(targets, centers, deltas):
                        t.copy_(c + delta)
            else:
                constraint.make_feasible_(targets, new_radii,
                                          f"the parameters of param group {g} (its settings changed)")
            with torch.no_grad():
                for p, target in zip(group["params"], targets):
                    if target is not p:
                        p.copy_(target)  # the master copy moved: the parameter is its rounding, as after a step
            group["radii"] = new_radii
            self._radii_source[g] = self._radii_record(group)

    def _check_group_hyperparameters(self, group: dict) -> None:
        schedules.check_schedule(group["step_size"], "step_size")
        if group["rescale"] is not None and group["rescale"] not in reference.RESCALES:
            raise ValueError(f"rescale must be None or one of {reference.RESCALES}, got {group['rescale']!r}")

    # -- persistence --------------------------------------------------------------------------------------------
    def _extra_state(self) -> dict:
        return {"optimizer": type(self).__name__, "step": int(self._step_count_k)}

    def _check_extra_state(self, extra: dict) -> None:
        """Raises ``ValueError`` if the saved extra state cannot be loaded into this optimizer."""
        if extra.get("tangent_stream_version") != reference.TANGENT_STREAM_VERSION:
            raise ValueError(f"state_dict was saved with tangent stream version {extra.get('tangent_stream_version')}"
                             f", this fgfw has {reference.TANGENT_STREAM_VERSION}: the run cannot be resumed exactly")
        kind = extra.get("optimizer")
        if kind is not None and kind != type(self).__name__:
            raise ValueError(f"state_dict was saved by {kind}, and cannot be loaded into {type(self).__name__} "
                             f"(another algorithm, other state); load it into a {kind} built like the saved one")
        missing = [key for key in self._extra_state() if key not in extra and key != "optimizer"]  # older: none
        if missing:
            raise ValueError(f"state_dict's {STATE_KEY!r} entry has no {missing}: it was saved by another kind of "
                             f"optimizer than {type(self).__name__}")
        step = extra["step"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"state_dict's step must be an integer >= 0, got {step!r}")

    def _load_extra_state(self, extra: dict) -> None:
        self._step_count_k.fill_(int(extra["step"]))

    def state_dict(self) -> dict:
        """The optimizer's state in plain types only (numbers, strings, lists, dicts and tensors), so that
        ``torch.load`` reads it with its default ``weights_only=True``.

        Each group's constraint is saved as its ``to_dict()``. A callable schedule (``step_size`` or
        ``averaging_weight``) cannot be saved: it is recorded as ``{"kind": "callable", "name": ...}`` and
        the optimizer that loads the state must be built with that callable (see :meth:`load_state_dict`).
        Schedule names and numbers are saved as they are.
        """
        state = super().state_dict()
        groups = []
        for group in state["param_groups"]:
            group = dict(group, constraint=group["constraint"].to_dict())
            for key in self._SCHEDULE_KEYS:
                group[key] = schedules.to_state(group[key])
            groups.append(group)
        state["param_groups"] = groups
        state[STATE_KEY] = dict(self._extra_state(), tangent_stream_version=reference.TANGENT_STREAM_VERSION)
        return state

    def _checked_groups(self, saved_groups: object) -> list[dict]:
        """The saved param groups as this optimizer will hold them (constraints rebuilt, callable schedules
        taken from this optimizer, its own backend kept), or ``ValueError`` if they do not fit its groups."""
        if not isinstance(saved_groups, (list, tuple)) or not all(isinstance(g, dict) for g in saved_groups):
            raise ValueError("state_dict's param_groups must be a list of dicts")
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"state_dict has {len(saved_groups)} param groups, this optimizer has "
                             f"{len(self.param_groups)}: it was saved for other parameters")
        groups = []
        for g, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            where = f"param group {g} of the state_dict"
            saved_params = saved.get("params")
            if not isinstance(saved_params, (list, tuple)) or len(saved_params) != len(group["params"]):
                count = len(saved_params) if isinstance(saved_params, (list, tuple)) else saved_params
                raise ValueError(f"{where} has {count} parameters, this optimizer's has {len(group['params'])}: it "
                                 f"was saved for other parameters")
            saved = dict({"rescale": None}, **saved)  # a state saved before rescale existed: none
            missing = [key for key in (*self.defaults, "radii") if key not in saved]
            if missing:
                raise ValueError(f"{where} has no {missing}: it was saved by another kind of optimizer than "
                                 f"{type(self).__name__}")
            constraint = saved["constraint"]
            if not isinstance(constraint, Constraint):  # an older checkpoint, read with weights_only=False, has the object
                constraint = constraints.from_dict(constraint)
            new = dict(saved, constraint=constraint, backend=group["backend"])
            for key in self._SCHEDULE_KEYS:
                new[key] = schedules.from_state(saved[key], group[key], key)
            try:
                self._check_group_hyperparameters(new)
            except TypeError as err:
                raise ValueError(f"{where}: {err}") from None
            params = group["params"]
            if constraint.global_ball and len({reference.compute_dtype(p.dtype) for p in params}) > 1:
                raise ValueError(f"{where} has a global ball, which cannot mix float64 with other params, got "
                                 f"{sorted(map(str, {p.dtype for p in params}))}")
            _check_radii(constraint, params, saved["radii"], where)
            if constraint.scope == "row":
                new["radii"] = _row_radii(saved["radii"])
            groups.append(new)
        return groups

    def _check_state(self, state: object, saved_groups: list[dict]) -> None:
        """Raises ``ValueError`` unless every saved per-parameter state fits its parameter."""
        if not isinstance(state, dict):
            raise ValueError("state_dict's state must be a dict")
        params_of = {}
        for g, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            for i, (saved_id, p) in enumerate(zip(saved["params"], group["params"])):
                params_of[saved_id] = (g, i, p)
        for saved_id, entry in state.items():
            if saved_id not in params_of:
                raise ValueError(f"state_dict holds state for parameter id {saved_id!r}, which no param group lists")
            g, i, p = params_of[saved_id]
            if not isinstance(entry, dict):
                raise ValueError(f"state_dict's state of parameter {i} of param group {g} must be a dict")
            for key in ("momentum", "master"):
                value = entry.get(key)
                if value is None:
                    continue
                if not isinstance(value, torch.Tensor) or not value.is_floating_point():
                    raise ValueError(f"state_dict's {key} of parameter {i} of param group {g} must be a floating "
                                     f"tensor, got {value!r}")
                if value.shape != p.shape:
                    raise ValueError(f"state_dict's {key} of parameter {i} of param group {g} has shape "
                                     f"{tuple(value.shape)}, the parameter has shape {tuple(p.shape)}: the state "
                                     f"was saved for another model")
            scale = entry.get("norm_scale")
            if scale is not None and (not isinstance(scale, torch.Tensor) or not scale.is_floating_point()
                                      or scale.dim() != 1):
                raise ValueError(f"state_dict's norm_scale of parameter {i} of param group {g} must be a 1-D floating "
                                 f"tensor (one scale per ball), got {scale!r}")
            vector = entry.get("singular_vector")
            if vector is not None:
                columns = p.numel() // p.shape[0] if p.dim() >= 2 and p.shape[0] else p.numel()
                if not isinstance(vector, torch.Tensor) or not vector.is_floating_point() or \
                        vector.shape != (columns,):
                    raise ValueError(f"state_dict's singular_vector of parameter {i} of param group {g} must be a "
                                     f"floating tensor of shape ({columns},) (a nuclear-norm ball's warm start), "
                                     f"got {vector!r}")

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
        if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
            raise ValueError(f"state_dict must be a dict with 'state' and 'param_groups' (from "
                             f"{type(self).__name__}.state_dict()), got {type(state_dict).__name__}")
        state_dict = dict(state_dict)
        extra = state_dict.pop(STATE_KEY, None)
        if not isinstance(extra, dict):
            raise ValueError(f"state_dict has no {STATE_KEY!r} entry: it was not saved by an fgfw optimizer")
        self._check_extra_state(extra)
        groups = self._checked_groups(state_dict["param_groups"])
        self._check_state(state_dict["state"], groups)
        for g, (new, group) in enumerate(zip(groups, self.param_groups)):
            saved, current = new["constraint"], group["constraint"]
            if saved.to_dict() != current.to_dict():
                warnings.warn(f"param group {g}: the state_dict's constraint {saved!r} replaces this optimizer's "
                              f"{current!r}; the run resumes in the saved set with its saved radii (build the "
                              f"optimizer with {saved!r} to resume without this warning)", UserWarning,
                              stacklevel=_user_stacklevel())
        state_dict["param_groups"] = groups
        super().load_state_dict(state_dict)
        # torch casts floating state to the parameter's dtype; momentum and the master copy keep the compute
        # dtype (fp32 for bf16).
        saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        for saved_id, p in zip(saved_ids, params):
            saved = state_dict["state"].get(saved_id, {})
            for key in ("momentum", "master", "center"):
                if key in saved:
                    self.state[p][key] = saved[key].to(device=p.device, dtype=reference.compute_dtype(p.dtype),
                                                       copy=True)
            if "norm_scale" in saved:  # float64, as the step wrote it: resumes bit-identically
                self.state[p]["norm_scale"] = saved["norm_scale"].to(device=p.device, dtype=torch.float64, copy=True)
            if "singular_vector" in saved:  # float64, as the power iterations left it: resumes bit-identically
                self.state[p]["singular_vector"] = saved["singular_vector"].to(device=p.device, dtype=torch.float64,
                                                                               copy=True)
        self._load_extra_state(extra)
        self._radii_source = [self._radii_record(group) for group in self.param_groups]  # the saved run's
        self._plan_cache["plan"] = None  # new state tensors

    # -- the update ---------------------------------------------------------------------------------------------
    def _master(self, p: torch.Tensor) -> torch.Tensor:
        """The float32 master copy of a float16/bfloat16 parameter (made at its first step).

        The step's arithmetic keeps a float32 iterate inside its set (docs/feasibility.md); stepping the
        half-precision values themselves would round them every step, and alpha |theta_i|
        below half an ulp would stop an element from shrinking while the vertex element grows: the
        iterate drifts out of the ball. The optimizer owns the parameter's value from then on: a value
        written into the parameter from outside is overwritten by the next step (load it through
        load_state_dict, or build a new optimizer).
        """
        state = self.state[p]
        if "master" not in state:
            state["master"] = p.detach().to(torch.float32)
        return state["master"]

    # -- the plan of a step -------------------------------------------------------------------------------------
    # A step's plan (which fused calls, over which tensors, with which radii, row lengths and stream offsets)
    # depends only on the param groups, their hyperparameters and which parameters take part; it is built
    # once and kept until one of those changes (_plan_key is read at every step and compared), so that a step
    # runs no per-tensor Python work beyond reading the gradients.
    _uses_tangent_stream = False  # the forward-gradient optimizers: tensors get places in the tangent stream

    def _takes_part(self, group: dict) -> list[bool]:
        """Which parameters of ``group`` this step updates: all but those frozen since construction."""
        return [p.requires_grad for p in group["params"]]

    def _plan_key(self) -> list:
        """What the plan is built from: compared with the cached plan's key at every step. Radii are copied
        (a radius changed in place is seen); a row ball's radii are tuples (see _build_plan). The constraint's
        settings are read too (a radius set on the object is seen): see _apply_setting_changes."""
        # state cleared: momentum tensors made anew (load_state_dict drops the plan itself). Not id(self.state):
        # torch.compile of torch 2.11 cannot trace id() of a dict (fullgraph steps failed there, on an H200).
        key: list = [len(self.state)]  # index 0: updated by the step that makes the state (_apply)
        # groups by position, not id(group): torch 2.11's dynamo cannot trace id() of a dict either
        for g, group in enumerate(self.param_groups):
            constraint = group["constraint"]
            key.append((g, tuple(map(id, group["params"])), constraint, _constraint_spec(constraint),
                        group["backend"], self._schedule_key(group), group["rescale"], list(group["radii"]),
                        tuple(self._takes_part(group)), group.get("center")))
        return key

    def _prepared(self) -> _Plan:
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

    def _build_plan(self) -> _Plan:
        """Checks the groups again (their hyperparameters may have been changed since the last step) and groups
        their parameters into fused calls: one per (device, compute dtype, backend, momentum, schedule).
        Param groups that differ only in radius or scope (per-layer radii, row balls here and tensor balls
        there) share a call, since radii and row lengths travel per ball and per tensor. A global ball is one
        ball over its group: a call of its own. float16/bfloat16 parameters step through their float32
        master copies (_HALF_DTYPES), beside the float32 parameters."""
        self._apply_setting_changes()
        stream_params, offsets, start = [], {}, 0
        if self._uses_tangent_stream:
            # each tensor starts at a multiple of 4, the start of a Philox call, so that the kernels can draw
            # one call per 4 aligned elements of every tensor (vectorised loads and stores); a frozen tensor
            # keeps its place (its share goes unused), so freezing one does not move the others' tangents
            for group in self.param_groups:
                for p in group["params"]:
                    offsets[id(p)] = start
                    start += -(-p.numel() // 4) * 4
                    if p.requires_grad:
                        stream_params.append(p)
        calls: dict[tuple, _Call] = {}
        tangent_backends: dict[torch.device, str] = {}
        for g, group in enumerate(self.param_groups):
            params, constraint = group["params"], group["constraint"]
            self._check_group_hyperparameters(group)
            _check_radii(constraint, params, group["radii"], f"param group {g}")
            if constraint.scope == "row":  # a row radius changed in place would go unseen (see _plan_key)
                group["radii"][:] = _row_radii(group["radii"])
            takes_part = self._takes_part(group)
            if constraint.global_ball and not all(p.requires_grad for p in params):
                frozen = [_describe(i, p) for i, p in enumerate(params) if not p.requires_grad]
                raise ValueError(f"{', '.join(frozen)} of a param group with a global L1 ball has requires_grad="
                                 f"False (frozen after the optimizer was created): a global ball scales all its "
                                 f"parameters together, so it cannot leave one out; create the optimizer again "
                                 f"after freezing (frozen parameters are left out at construction)")
            if not params:
                continue
            device = params[0].device
            momentum = self._uses_momentum(group)
            tangent_backends.setdefault(device, _ops.resolve_backend(group["backend"], device))
            # the L1 ball steps in the fused kernels; another set, or a rescaled step (a step per ball), steps in
            # torch ops through its vertex (reference.fw_step_), in calls of its own for each constraint object
            fused = isinstance(constraint, L1Ball) and group["rescale"] is None
            shared = (_ops.resolve_backend(group["backend"], device), momentum,
                      ("group", g) if constraint.global_ball else None if fused else id(constraint),
                      self._schedule_key(group), group["rescale"], self._centers_of(group) is not None)
            for i, p in enumerate(params):
                # an empty tensor has no ball (rows of nothing): left out, nothing of it moves
                if not takes_part[i] or not p.numel():
                    continue
                dtype = reference.compute_dtype(p.dtype)
                call = calls.get((device, dtype, *shared))
                if call is None:
                    call = calls[(device, dtype, *shared)] = _Call(device, dtype, shared[0], momentum,
                                                                     constraint.global_ball, group)
                    call.constraint = None if fused else constraint
                    # an L-infinity, Lp or k-sparse set, not rescaled, on a backend with its fused kernel; the
                    # 'torch' backend keeps reference.fw_step_, whose row vertices are batched
                    fused_set = constraint.fused_step() if group["rescale"] is None else None
                    if (fused_set is not None and shared[0] != "torch"
                            and _ops.set_fw_step_available(fused_set[0], shared[0])):
                        call.fused_set = fused_set
                    # the L1 op keeps its balls by itself; the other steps by a Feasibility (with state, for some)
                    call.feasibility = None if fused else _feasibility(constraint)
                    if constraint.global_ball:
                        call.radii = [float(r) for r in group["radii"]]
                if constraint.global_ball and self._missing_gradient(p):
                    call.zero_grads[len(call.params)] = torch.zeros_like(p, dtype=dtype)
                call.params.append(p)
                call.starts.append(offsets.get(id(p), 0))
                # rows of a matrix are its balls (L1Ball.rows); a tensor below 2-D is one ball
                call.row_numel.append(math.prod(p.shape[1:]) if constraint.scope == "row" and p.dim() >= 2 else 0)
                if constraint.scope == "row":
                    call.radii.extend(map(float, group["radii"][i]))
                elif not constraint.global_ball:
                    call.radii.append(float(group["radii"][i]))
        for call in calls.values():
            if not any(call.row_numel):
                call.row_numel = []
        return _Plan(self._plan_key(), list(calls.values()), stream_params, offsets, tangent_backends)

    def _make_state(self, call: _Call) -> None:
        """The call's momentum and float32 master copies, made at its first step (not when the plan is built:
        a step that fails before the update leaves no state behind)."""
        call.targets = [self._master(p) if p.dtype in _HALF_DTYPES else p for p in call.params]
        if self._centers_of(call.group) is not None:
            call.centers = [self.state[p]["center"] for p in call.params]
        call.halves = [(p, self._master(p)) for p in call.params if p.dtype in _HALF_DTYPES]
        if call.momentum:
            for p in call.params:
                state = self.state[p]
                if "momentum" not in state:
                    state["momentum"] = torch.zeros_like(p, dtype=call.dtype)
                call.moms.append(state["momentum"])
        if call.feasibility is not None and call.feasibility.p is not None:
            # one scale per ball of each parameter (rows, or the tensor); the global ball's in its first parameter's
            # state. A scale of another layout (the scope changed) starts again from 1.
            holders = call.params[:1] if call.global_ball else call.params
            for p, n in zip(holders, call.row_numel or [0] * len(holders)):
                balls = 1 if call.global_ball or n == 0 else p.numel() // n
                state = self.state[p]
                scale = state.get("norm_scale")
                if scale is None or scale.shape != (balls,) or scale.device != p.device:
                    state["norm_scale"] = torch.ones(balls, dtype=torch.float64, device=p.device)
                call.scales.append(state["norm_scale"])

    def _missing_gradient(self, p: torch.Tensor) -> bool:
        """Whether p has no gradient to read (FrankWolfe: ``p.grad is None``); a global ball then reads zeros."""
        return False

    def _schedules(self, plan: _Plan, k: torch.Tensor) -> list[torch.Tensor]:
        """Each call's (k, alpha_k, gamma_k), a float64 tensor on its device, evaluated before anything is
        modified (a callable schedule out of [0, 1] raises ``ValueError``), once per distinct schedule.

        On the CPU the counter is read on the host (free) and the three numbers are written at once; on a
        GPU, and under torch.compile, they are made on the device from the counter (schedules.evaluate), with
        no host-to-device copy nor synchronisation, so that a step can be captured. Both give the same bits, on
        any machine: a named schedule is the same sequence of IEEE operations either way (fgfw.schedules)."""
        host_k = int(k) if k.device.type == "cpu" and not torch.compiler.is_compiling() else None
        device_k = None
        made: dict[tuple, torch.Tensor] = {}
        out = []
        for call in plan.calls:
            group = call.group
            memo = (call.device, self._schedule_key(group))
            if memo not in made:
                if host_k is not None and call.device.type == "cpu":
                    made[memo] = torch.tensor([host_k, schedules.evaluate(group["step_size"], host_k, "step_size"),
                                               self._averaging_weight(group, host_k)], dtype=torch.float64)
                else:
                    if device_k is None:
                        device_k = k.to(torch.float64)  # named schedules stay on the counter's device
                    values = (device_k, schedules.evaluate(group["step_size"], device_k, "step_size"),
                              self._averaging_weight(group, device_k))
                    made[memo] = torch.stack([_device_scalar(x, call.device) for x in values])
            out.append(made[memo])
        return out

    def _averaging_weight(self, group: dict, k: int | torch.Tensor) -> float | torch.Tensor:
        return 0.0

    def _uses_momentum(self, group: dict) -> bool:
        return False

    def _schedule_key(self, group: dict) -> tuple:
        """What makes two groups' steps differ besides radius and scope: groups with equal keys share one
        fused call (their alpha_k and gamma_k are the same)."""
        return (_spec_key(group["step_size"]),)

    @staticmethod
    def _gradients(plan: _Plan, grads_of: Callable[[torch.Tensor], torch.Tensor | None]) -> list[list[torch.Tensor]]:
        """Each call's gradients as the op takes them: in its compute dtype (the masters' for halves), dense and
        contiguous (the kernels walk them as flat memory in the parameter's order: a non-contiguous one is
        copied), zeros where a global ball's parameter has none. Gathered for every call before any runs."""
        out = []
        for call in plan.calls:
            grads = [grads_of(p) for p in call.params]
            for t, zeros in call.zero_grads.items():
                grads[t] = zeros
            dtype = call.dtype
            if not all([g.layout == torch.strided and g.dtype == dtype and g.is_contiguous() for g in grads]):
                for t, (p, g) in enumerate(zip(call.params, grads)):
                    if g.layout != torch.strided:
                        raise TypeError(f"Frank-Wolfe does not support sparse gradients (parameter of shape "
                                        f"{tuple(p.shape)}, gradient layout {g.layout})")
                    grads[t] = g.to(dtype).contiguous()
            out.append(grads)
        return out

    @staticmethod
    def _forward_gradients(call: _Call, coeffs: torch.Tensor, k: torch.Tensor, seed: int,
                           distribution: int) -> list[torch.Tensor]:
        """The forward-gradient estimate sum_t coeffs[t] u_t of each tensor of a call stepped in torch ops (a set
        other than the L1 ball), with the tangents drawn by the call's backend instead of the pure-torch
        stream that reference.fw_step_ would regenerate them with (the same values; many times faster). The
        arithmetic is reference.direction's, in the compute dtype, summed in tangent order."""
        out = []
        for p, start in zip(call.targets, call.starts):
            g = None
            for t in range(coeffs.numel()):
                u = _ops.fill_tangent_(torch.empty(p.shape, dtype=torch.float32, device=p.device), seed,
                                       k.to(p.device), t, start, distribution, call.backend)
                term = coeffs[t].to(call.dtype) * u.to(call.dtype)
                g = term if g is None else g + term
            out.append(g)
        return out

    def _apply(self, plan: _Plan, schedule: list[torch.Tensor], k: torch.Tensor, *,
               grads: list[list[torch.Tensor]] | None, tangent_coeffs: torch.Tensor | None, seed: int,
               distribution: int) -> None:
        """The fused calls of the plan: the update itself (everything was checked before)."""
        coeffs_on = {} if tangent_coeffs is not None else plan.no_coeffs
        gaps = []
        seed = _ops._int64(int(seed))
        for c, call in enumerate(plan.calls):
            device = call.device
            if device not in coeffs_on:
                coeffs_on[device] = (tangent_coeffs.to(device) if tangent_coeffs is not None
                                     else torch.zeros(0, dtype=torch.float64, device=device))
            if call.targets is None:
                self._make_state(call)
                plan.key[0] = len(self.state)  # the state this plan made is its own (see _plan_key)
            unconstrained = isinstance(call.constraint, constraints.Unconstrained)
            # the op writes it; an unconstrained call has no vertex, no share of the Frank-Wolfe gap
            gap = None if unconstrained else torch.empty((), dtype=torch.float64, device=device)
            if call.centers:  # a centred ball: the step is theta - c <- (1 - alpha)(theta - c) + alpha s
                torch._foreach_sub_(call.targets, call.centers)
            if call.fused_set is not None:
                _ops.set_fw_step_(call.fused_set[0], call.targets, call.moms, grads[c] if grads is not None else [],
                                  schedule[c], coeffs_on[device], call.radii, call.global_ball, call.starts, seed,
                                  distribution, gap, call.backend, call.row_numel, call.fused_set[1], call.scales)
            elif unconstrained:
                call_grads = grads[c] if grads is not None else self._forward_gradients(call, coeffs_on[device], k,
                                                                                         seed, distribution)
                _gradient_step(call, call_grads, schedule[c])
            elif call.constraint is not None:
                call_grads = grads[c] if grads is not None else self._forward_gradients(call, coeffs_on[device], k,
                                                                                         seed, distribution)
                vertex = call.constraint.vertex
                if isinstance(call.constraint, constraints.NuclearNormBall):  # iterations from last step's v_1
                    vertex = call.constraint.warm_started([self.state[p] for p in call.params])
                reference.fw_step_(vertex, call.targets, call.moms, call_grads, schedule[c],
                                   coeffs_on[device], call.radii, call.global_ball, call.starts, seed, distribution,
                                   gap, call.row_numel, shrink=call.constraint.SHRINK_STEP,
                                   rescale=call.group["rescale"], l2_diameter=call.constraint.l2_diameter,
                                   row_vertices=call.constraint.row_vertices, feasibility=call.feasibility,
                                   scales=call.scales, gauge_parts=call.constraint.gauge_parts
                                   if call.constraint.CORRECTS_BY_GAUGE else None,
                                   row_gauges=call.constraint.row_gauges,
                                   batch_vertices=getattr(call.constraint, "batch_vertices", None))
            else:
                _ops.l1_fw_step_(call.targets, call.moms, grads[c] if grads is not None else [], schedule[c],
                                 coeffs_on[device], call.radii, call.global_ball, call.starts, seed, distribution, gap,
                                 backend=call.backend, row_numel=call.row_numel, prepared=True)
            if call.centers:
                torch._foreach_add_(call.targets, call.centers)
            if call.halves:
                # one rounding of a feasible float32 iterate: ||theta||_1 <= r (1 + u) in the half dtype
                torch._foreach_copy_([p for p, _ in call.halves], [m for _, m in call.halves])
            if gap is not None:
                gaps.append(gap)
        # summed where the first call's device is: no host synchronisation. Into the container itself, not through
        # the last_gap property: torch 2.11's dynamo refuses a property's setattr inside a compiled step.
        total = None
        for gap in gaps:
            total = gap if total is None else total + gap.to(total.device)
        if total is None and plan.calls:  # unconstrained calls only: a gap of 0
            total = torch.zeros((), dtype=torch.float64, device=plan.calls[0].device)
        self._step_results["gap"] = total
        self._step_count_k.copy_(k)


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
        check_finite: raise ``ValueError`` on a non-finite gradient before touching anything (one host sync;
            under torch.compile a graph break, so ``fullgraph=True`` needs ``check_finite=False``).

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
        # which parameters of a global ball read zeros (_build_plan keeps a zero tensor for each)
        return super()._plan_key() + [tuple(p.grad is None for group in self.param_groups
                                            if group["constraint"].global_ball for p in group["params"])]

    def _missing_gradient(self, p: torch.Tensor) -> bool:
        return p.grad is None

    def _schedule_key(self, group: dict) -> tuple:
        return (_spec_key(group["step_size"]), group["momentum"] or 0.0)

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
        plan = self._prepared()
        schedule = self._schedules(plan, k)
        grads = self._gradients(plan, lambda p: p.grad)
        if self.check_finite and not _ops.all_finite([g for call_grads in grads for g in call_grads]):
            raise ValueError(f"a gradient is not finite at step k={int(k)}; parameters and optimizer state were "
                             f"left unchanged (pass check_finite=False to skip this check)")
        self._apply(plan, schedule, k, grads=grads, tangent_coeffs=None, seed=0, distribution=0)
        return loss


class _ForwardGradientFrankWolfe(_FrankWolfeBase):
    """FGFW and AFGFW: the gradient estimate comes from forward-mode directional derivatives."""

    def __init__(self, module: nn.Module, params: Iterable | None, defaults: dict, *, constraint: Constraint,
                 seed: int | None, tangent: str, num_tangents: int, engine: str | None, backend: str | None,
                 check_finite: bool, tangents_in_one_pass: bool, estimator: str, recompute_inputs: bool,
                 process_group: object = distributed.AUTO, check_replicas_every: int = 0,
                 rescale: str | None = None):
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
        if isinstance(check_replicas_every, bool) or not isinstance(check_replicas_every, int) \
                or check_replicas_every < 0:
            raise ValueError(f"check_replicas_every must be an integer >= 0 (0: never), got {check_replicas_every!r}")
        explicit_seed = seed is not None
        if seed is None:
            seed = int(torch.empty((), dtype=torch.int64).random_())  # from torch's RNG: manual_seed fixes it
        elif isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
        group = distributed.resolve_group(process_group)
        self._replicas: distributed.Replicas | None = None
        self.check_replicas_every = check_replicas_every
        if params is None:
            params = [p for p in module.parameters() if p.requires_grad]
        constraints.register_modules(module)  # for the radius rules of zero-initialised balls
        params, tensors = _param_tensors(params)
        if group is not None and tensors:
            # the replicas start from the group's first rank's parameters (before radii are resolved from
            # them and the start is made feasible) and draw the same tangents
            self._replicas = distributed.Replicas(group, tensors[0].device)
            self._replicas.broadcast_(tensors)
            seed = self._replicas.agree_seed(seed, explicit_seed)
        self.module = module
        self.seed = seed
        self.tangent = tangent
        self.num_tangents = num_tangents
        self.tangents_in_one_pass = bool(tangents_in_one_pass)
        self.engine = engine
        self.estimator = estimator
        self.recompute_inputs = bool(recompute_inputs)
        super().__init__(params, defaults, constraint=constraint, backend=backend, check_finite=check_finite,
                         rescale=rescale)
        module_params = {id(p) for p in module.parameters()}
        for group in self.param_groups:
            for p in group["params"]:
                if id(p) not in module_params:
                    raise ValueError(f"params must be parameters of module; got a tensor of shape {tuple(p.shape)} "
                                     f"that module does not own (the JVP can only perturb the module's parameters)")
        if estimator == "activity":
            activity.perturbed_layers(module, [p for g in self.param_groups for p in g["params"]])

    _uses_tangent_stream = True

    def _param_name(self, p: torch.Tensor) -> str | None:
        return next((name for name, q in self.module.named_parameters() if q is p), None)

    def _extra_state(self) -> dict:
        return dict(super()._extra_state(), seed=self.seed, tangent=self.tangent, num_tangents=self.num_tangents,
                    estimator=self.estimator)

    def _check_extra_state(self, extra: dict) -> None:
        # a state saved before the estimator existed has none: it is the weight estimator's
        super()._check_extra_state(dict({"estimator": "weight"}, **extra))
        seed, tangent, num_tangents = extra["seed"], extra["tangent"], extra["num_tangents"]
        estimator = extra.get("estimator", "weight")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"state_dict's seed must be an int, got {seed!r}")
        if not isinstance(tangent, str) or tangent not in reference.DISTRIBUTIONS:
            raise ValueError(f"state_dict's tangent must be one of {sorted(reference.DISTRIBUTIONS)}, got {tangent!r}")
        if isinstance(num_tangents, bool) or not isinstance(num_tangents, int) or num_tangents < 1:
            raise ValueError(f"state_dict's num_tangents must be an integer >= 1, got {num_tangents!r}")
        if not isinstance(estimator, str) or estimator not in ESTIMATORS:
            raise ValueError(f"state_dict's estimator must be one of {ESTIMATORS}, got {estimator!r}")
        if estimator != "activity" and self.recompute_inputs:
            raise ValueError(f"state_dict's estimator is {estimator!r}, but this optimizer was built with "
                             f"recompute_inputs=True, which applies to estimator='activity' only")
        if estimator == "activity":  # every parameter must be held by a module (raises ValueError naming it)
            activity.perturbed_layers(self.module, [p for g in self.param_groups for p in g["params"]])

    def _load_extra_state(self, extra: dict) -> None:
        super()._load_extra_state(extra)
        self.seed, self.tangent, self.num_tangents = int(extra["seed"]), extra["tangent"], int(extra["num_tangents"])
        self.estimator = extra.get("estimator", "weight")

    def _guarded(self, closure: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """``closure`` with a clear error if it calls ``backward()`` or ``torch.autograd.grad`` (torch's own
        error, raised deep in the forward-mode pass, names neither the closure nor the way out)."""
        if torch.compiler.is_compiling():  # traced whole: no Python-level exception handling
            return closure
        name = type(self).__name__

        def guarded():
            try:
                return closure()
            except (RuntimeError, ValueError) as err:  # ValueError: the activity estimator's check refused it
                if not _called_autograd(err):
                    raise
                raise RuntimeError(
                    f"the closure passed to {name}.step called backward() (or torch.autograd.grad): {name} needs no "
                    f"backward pass, it runs the closure under forward-mode AD and no_grad, where there is no graph "
                    f"to differentiate. The closure must only compute and return the loss, e.g. "
                    f"opt.step(lambda: F.cross_entropy(model(x), y)); no loss.backward() and no zero_grad() "
                    f"(for backprop gradients use fgfw.FrankWolfe)") from err
        return guarded

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None, *, batch_size: int | None = None) -> torch.Tensor:
        """One step: ``num_tangents`` forward-mode passes of ``closure``, then the fused Frank-Wolfe update.

        ``closure`` (required) runs the model as usual and returns the scalar loss, e.g.
        ``opt.step(lambda: F.cross_entropy(model(x), y))``; it is called under forward-mode AD and no_grad
        (no backward pass, no stored activations), so it must not call ``backward()`` (that raises
        ``RuntimeError`` saying so). With ``estimator="activity"`` it returns the per-example losses instead
        (``reduction="none"``). Returns the (mean) loss at the pre-step parameters.

        Parameters frozen (``requires_grad=False``) since construction get no tangent and do not move (in a
        global ball they raise ``ValueError``); the others keep their place in the tangent stream.

        Data-parallel (a process group, see the class): every rank calls ``step`` with its own batch; the
        directional derivatives (the activity estimator: the estimate) are averaged over the ranks, weighted
        by ``batch_size`` (this rank's number of examples; None: equal weights), and every rank applies the
        same update. The returned loss is this rank's.
        """
        weight = _batch_weight(batch_size)
        if closure is None or not callable(closure):
            got = "no closure" if closure is None else f"a {type(closure).__name__}"
            raise TypeError(f"{type(self).__name__}.step needs a closure that computes the loss with the module, "
                            f"e.g. opt.step(lambda: F.cross_entropy(model(x), y)) (it runs the forward pass only: "
                            f"no loss.backward()); got {got}")
        closure = self._guarded(closure)
        k = self._step_count_k + 1
        plan = self._prepared()
        schedule = self._schedules(plan, k)
        params, offsets = plan.stream_params, plan.offsets
        distribution = reference.DISTRIBUTIONS[self.tangent]

        def fill(out: torch.Tensor, offset: int, tangent_id: int) -> torch.Tensor:
            """``out`` filled with tangent ``tangent_id`` of step k from ``offset`` of the stream."""
            return _ops.fill_tangent_(out, self.seed, k.to(out.device), tangent_id, offset, distribution,
                                      plan.tangent_backends[out.device])

        def tangent_maker(tangent_id: int):
            return lambda j: fill(torch.empty_like(params[j]), offsets[id(params[j])], tangent_id)

        if self.estimator == "activity":
            return self._activity_step(plan, schedule, k, params, closure, fill, weight)
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
        if self._replicas is not None:
            # every rank gets the same mean, non-finite on every rank if on one: they raise (or step) alike
            coeffs = self._replicas.mean_coefficients(coeffs, weight)
        self._coefficient_update(plan, schedule, k, coeffs, loss)
        return loss

    def _coefficient_update(self, plan: _Plan, schedule: list[torch.Tensor], k: torch.Tensor, coeffs: torch.Tensor,
                            loss: torch.Tensor | None) -> None:
        """What a step does after its forward passes: the update from the directional derivatives ``coeffs``
        (float64, one per tangent). Timed alone by bench/optimizer_step.py (method afgfw_update)."""
        if self.check_finite and not bool(torch.isfinite(coeffs).all()):
            raise ValueError(f"the directional derivative <grad f, u> is not finite at step k={int(k)} "
                             f"(values {coeffs.tolist()}, loss {float(loss)}); parameters and optimizer state were left "
                             f"unchanged (check the closure and step size, or pass check_finite=False)")
        self._apply(plan, schedule, k, grads=None, tangent_coeffs=coeffs / self.num_tangents, seed=self.seed,
                    distribution=reference.DISTRIBUTIONS[self.tangent])
        self._check_replicas(k)

    def _check_replicas(self, k: torch.Tensor) -> None:
        """Every check_replicas_every steps, ``RuntimeError`` on every rank if the replicas' parameters differ."""
        if self._replicas is not None and self.check_replicas_every and int(k) % self.check_replicas_every == 0:
            self._replicas.check_identical([p for g in self.param_groups for p in g["params"]], int(k))

    def _activity_step(self, plan: _Plan, schedule: list[torch.Tensor], k: torch.Tensor, params: list[torch.Tensor],
                       closure, fill, weight: float):
        """The step with estimator='activity': tangents on linear outputs (drawn by ``fill``, the stream of
        step k), a dense estimate, the gradient path of the fused op (see fgfw.activity)."""
        loss, grads = activity.activity_gradients(self.module, params, closure, fill, self.num_tangents,
                                                  self.tangents_in_one_pass, self.recompute_inputs)
        if self._replicas is not None:
            self._replicas.mean_dense_(list(grads.values()), weight)
        if self.check_finite and not _ops.all_finite(list(grads.values())):
            raise ValueError(f"the activity-perturbed gradient estimate is not finite at step k={int(k)} (loss "
                             f"{float(loss)}); parameters and optimizer state were left unchanged (check the closure "
                             f"and step size, or pass check_finite=False)")
        self._apply(plan, schedule, k, grads=self._gradients(plan, lambda p: grads[id(p)]), tangent_coeffs=None,
                    seed=0, distribution=0)
        self._check_replicas(k)
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
            Frozen ones (``requires_grad=False``) are left out with a warning: never perturbed nor updated.
            Each group may bring its own ``constraint``, ``step_size`` (and, for AFGFW, ``averaging_weight``);
            the K tangents run through all groups' parameters together (one directional derivative).
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
        process_group: data parallelism over ``torch.distributed`` (see :mod:`fgfw.distributed`):
            ``"auto"`` (default) uses the default group when torch.distributed is initialised with more
            than one process; ``None`` never communicates; or a ``ProcessGroup``. At construction the
            parameters are broadcast from the group's first rank and the seed is agreed (rank 0's; a rank
            given another seed raises ``ValueError`` on every rank). Each step all-reduces the K directional
            derivatives and the rank's batch weight (8 (K + 1) bytes; the activity estimator: its dense
            estimate) and every rank applies the same update: the replicas stay bit-identical. Buffers
            (e.g. BatchNorm statistics) are not synchronised.
        rescale: as in :class:`FrankWolfe`.
        check_replicas_every: with a process group, every this many steps compare a checksum of the
            parameters' bits across ranks and raise ``RuntimeError`` naming the step if they differ
            (0: never; each check is one small all-gather and a host read).
    """

    def __init__(self, module: nn.Module, params: Iterable | None = None, *, constraint: Constraint,
                 step_size: schedules.Schedule = "2/(k+2)", seed: int | None = None, tangent: str = "gaussian",
                 num_tangents: int = 1, engine: str | None = None, backend: str | None = None,
                 check_finite: bool = True, tangents_in_one_pass: bool = False, estimator: str = "weight",
                 recompute_inputs: bool = False, process_group: object = distributed.AUTO,
                 check_replicas_every: int = 0, rescale: str | None = None):
        super().__init__(module, params, dict(step_size=step_size), constraint=constraint, seed=seed,
                         tangent=tangent, num_tangents=num_tangents, engine=engine, backend=backend,
                         check_finite=check_finite, tangents_in_one_pass=tangents_in_one_pass, estimator=estimator,
                         recompute_inputs=recompute_inputs, process_group=process_group,
                         check_replicas_every=check_replicas_every, rescale=rescale)
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
    note alpha_1 = 1 replaces theta by a vertex at the first step). ``averaging_weight`` is gamma_k, the
    weight of the NEW estimate (``v = (1 - gamma) v + gamma g_hat``; FrankWolfe's ``momentum`` rho is the
    weight of the old one, rho = 1 - gamma); ``"4/(k+8)^(2/3)"`` is stochastic Frank-Wolfe's momentum rule
    in this convention. The momentum v is kept in float32 for float16/bfloat16 parameters. Other arguments
    as in :class:`FGFW`.
    """

    def __init__(self, module: nn.Module, params: Iterable | None = None, *, constraint: Constraint,
                 step_size: schedules.Schedule = "1/k", averaging_weight: schedules.Schedule = "1/sqrt(k)",
                 seed: int | None = None, tangent: str = "gaussian", num_tangents: int = 1, engine: str | None = None,
                 backend: str | None = None, check_finite: bool = True, tangents_in_one_pass: bool = False,
                 estimator: str = "weight", recompute_inputs: bool = False, process_group: object = distributed.AUTO,
                 check_replicas_every: int = 0, rescale: str | None = None):
        super().__init__(module, params, dict(step_size=step_size, averaging_weight=averaging_weight),
                         constraint=constraint, seed=seed, tangent=tangent, num_tangents=num_tangents, engine=engine,
                         backend=backend, check_finite=check_finite, tangents_in_one_pass=tangents_in_one_pass,
                         estimator=estimator, recompute_inputs=recompute_inputs, process_group=process_group,
                         check_replicas_every=check_replicas_every, rescale=rescale)

    _SCHEDULE_KEYS = ("step_size", "averaging_weight")

    def _check_group_hyperparameters(self, group: dict) -> None:
        super()._check_group_hyperparameters(group)
        schedules.check_schedule(group["averaging_weight"], "averaging_weight")

    def _schedule_key(self, group: dict) -> tuple:
        return (_spec_key(group["step_size"]), _spec_key(group["averaging_weight"]))

    def _uses_momentum(self, group: dict) -> bool:
        return True

    def _averaging_weight(self, group: dict, k: torch.Tensor) -> float | torch.Tensor:
        return schedules.evaluate(group["averaging_weight"], k, "averaging_weight")
