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

from . import _ops, activity, constraints, forward_grad, reference, schedules
from .constraints import L1Ball, _user_stacklevel

STATE_KEY = "fgfw"
# "weight": the paper's projected forward gradient, u over the parameters; "activity": u over the outputs
# of nn.Linear layers (fgfw.activity), far less variance, per-example losses needed.
ESTIMATORS = ("weight", "activity")


def _all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every entry of every tensor is finite: one isfinite reduction per tensor (nothing is summed,
    so no finite tensor can overflow, as a float16 norm would above 65504), the verdicts gathered on one
    device, one host synchronisation."""
    if not tensors:
        return True
    device = tensors[0].device
    return bool(torch.stack([torch.isfinite(t).all().to(device) for t in tensors]).all())


def _called_autograd(error: BaseException) -> bool:
    """Whether ``error`` was raised inside ``torch.autograd.backward`` or ``torch.autograd.grad``."""
    tb = error.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_globals.get("__name__") == "torch.autograd" and frame.f_code.co_name in ("backward", "grad"):
            return True
        tb = tb.tb_next
    return False


def _subset(group: dict, keep: list[bool]) -> dict:
    """The group restricted to the parameters where ``keep`` is true (with their radii; not for a global ball)."""
    return dict(group, params=[p for p, k in zip(group["params"], keep) if k],
                radii=[r for r, k in zip(group["radii"], keep) if k])


def _check_radii(constraint: L1Ball, params: list[torch.Tensor], radii: object, where: str) -> None:
    """``radii`` must fit ``constraint`` over ``params``: one radius for a global ball, one per tensor, or one
    list per tensor with one radius per row (scope "row"); each finite and > 0."""
    def numbers(values, expected: int, what: str) -> None:
        if not isinstance(values, (list, tuple)) or len(values) != expected:
            got = f"{len(values)}" if isinstance(values, (list, tuple)) else type(values).__name__
            raise ValueError(f"{where}: radii must hold {expected} {what}, got {got}: it was saved for other "
                             f"parameters or another constraint")
        for r in values:
            if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r) or r <= 0:
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


# Parameter dtypes stepped through a float32 master copy (see _FrankWolfeBase._master).
_HALF_DTYPES = (torch.float16, torch.bfloat16)


def _device_scalar(x: float | torch.Tensor, device: torch.device) -> torch.Tensor:
    """x as a float64 0-dim tensor on device: a tensor is moved (a no-op where it lies), a number is
    written by a fill kernel rather than copied from the host."""
    if isinstance(x, torch.Tensor):
        return x.to(device, torch.float64)
    return torch.full((), float(x), dtype=torch.float64, device=device)


def _describe(i: int, p: torch.Tensor) -> str:
    return f"parameter {i} (shape {tuple(p.shape)}, dtype {p.dtype}, device {p.device})"


def _spec_key(spec) -> object:
    """A schedule as a dict key: names and numbers by value, callables by identity."""
    return spec if isinstance(spec, (str, int, float)) else ("callable", id(spec))


def _radii_without_empty(members, radii: list) -> list:
    """The radii of a call's balls once its empty tensors are left out: an empty tensor of tensor scope had
    one radius (row scope: none, it has no rows)."""
    out, at = [], 0
    for group, _, _, i in members:
        p = group["params"][i]
        count = len(group["radii"][i]) if group["constraint"].scope == "row" else 1
        if p.numel():
            out.extend(radii[at:at + count])
        at += count
    return out


class _FrankWolfeBase(torch.optim.Optimizer):
    """What all three optimizers share: validation, radii, the step counter and the fused update."""

    # the group entries that hold schedules (state_dict saves a callable as a marker, see schedules.to_state)
    _SCHEDULE_KEYS: tuple[str, ...] = ("step_size",)

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
        self._frozen_left_out = 0  # frozen parameters add_param_group left out
        defaults = dict(defaults, constraint=constraint, backend=backend)
        super().__init__(params, defaults)
        first = next((p for g in self.param_groups for p in g["params"]), None)
        if first is None and self._frozen_left_out:
            raise ValueError(f"every parameter given to {type(self).__name__} is frozen (requires_grad=False): there "
                             f"is nothing to optimize; pass the parameters to train, with requires_grad=True")
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
    def _param_name(self, p: torch.Tensor) -> str | None:
        """p's name for messages, where the optimizer knows one (the forward-gradient ones know the module)."""
        return None

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
        constraint = group["constraint"]
        if not isinstance(constraint, L1Ball):
            raise TypeError(f"constraint must be an fgfw.L1Ball, got {type(constraint).__name__}")
        if constraint.global_ball and len({reference.compute_dtype(p.dtype) for p in params}) > 1:
            raise ValueError("an L1Ball with scope='global' cannot mix float64 with other params (one compute dtype "
                             f"per ball), got {sorted(map(str, {p.dtype for p in params}))}; split them into groups")
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

        Each group's constraint is saved as ``L1Ball.to_dict()``. A callable schedule (``step_size`` or
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
            missing = [key for key in (*self.defaults, "radii") if key not in saved]
            if missing:
                raise ValueError(f"{where} has no {missing}: it was saved by another kind of optimizer than "
                                 f"{type(self).__name__}")
            constraint = saved["constraint"]
            if not isinstance(constraint, L1Ball):  # an older checkpoint, read with weights_only=False, has the object
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

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads a state saved by :meth:`state_dict` of the same optimizer class over parameters of the same
        shapes (in the same param groups).

        Everything is checked before anything changes: a state of another optimizer class, of parameters
        of other shapes or counts, of another tangent stream version, or with invalid values raises
        ``ValueError`` and leaves the optimizer as it was. A schedule saved as a callable is taken from
        this optimizer, which must then have been built with a callable there. The optimizer keeps its
        own ``backend`` (a checkpoint may move between machines); everything else comes from the state.
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
        state_dict["param_groups"] = groups
        super().load_state_dict(state_dict)
        # torch casts floating state to the parameter's dtype; momentum and the master copy keep the compute
        # dtype (fp32 for bf16).
        saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        for saved_id, p in zip(saved_ids, params):
            saved = state_dict["state"].get(saved_id, {})
            for key in ("momentum", "master"):
                if key in saved:
                    self.state[p][key] = saved[key].to(device=p.device, dtype=reference.compute_dtype(p.dtype),
                                                       copy=True)
        self._load_extra_state(extra)

    # -- the update ---------------------------------------------------------------------------------------------
    def _master(self, p: torch.Tensor) -> torch.Tensor:
        """The float32 master copy of a float16/bfloat16 parameter (made at its first step).

        The step's arithmetic keeps a float32 iterate exactly inside its ball (reference.feasibility_shrink);
        stepping the half-precision values themselves would round them every step, and alpha |theta_i|
        below half an ulp would stop an element from shrinking while the vertex element grows: the
        iterate drifts out of the ball. The optimizer owns the parameter's value from then on: a value
        written into the parameter from outside is overwritten by the next step (load it through
        load_state_dict, or build a new optimizer).
        """
        state = self.state[p]
        if "master" not in state:
            state["master"] = p.detach().to(torch.float32)
        return state["master"]

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

    def _without_frozen(self, plan):
        """The plan without the parameters frozen (``requires_grad=False``) since construction: left out of
        per-tensor and row balls; a global ball, whose update scales all its parameters together, raises
        ``ValueError`` (before anything is modified)."""
        out = []
        for group, alpha, gamma in plan:
            keep = [p.requires_grad for p in group["params"]]
            if not all(keep):
                if group["constraint"].global_ball:
                    frozen = [_describe(i, p) for i, p in enumerate(group["params"]) if not p.requires_grad]
                    raise ValueError(f"{', '.join(frozen)} of a param group with a global L1 ball has requires_grad="
                                     f"False (frozen after the optimizer was created): a global ball scales all its "
                                     f"parameters together, so it cannot leave one out; create the optimizer again "
                                     f"after freezing (frozen parameters are left out at construction)")
                group = _subset(group, keep)
            out.append((group, alpha, gamma))
        return out

    def _averaging_weight(self, group: dict, k: torch.Tensor) -> float | torch.Tensor:
        return 0.0

    def _uses_momentum(self, group: dict) -> bool:
        return False

    def _schedule_key(self, group: dict) -> tuple:
        """What makes two groups' steps differ besides radius and scope: groups with equal keys share one
        fused call (their alpha_k and gamma_k are the same)."""
        return (_spec_key(group["step_size"]),)

    def _apply(self, plan, k: torch.Tensor, *, grads_of: Callable[[torch.Tensor], torch.Tensor | None] | None,
               tangent_coeffs: torch.Tensor | None, offsets: dict[int, int], seed: int, distribution: int) -> None:
        # One fused call per (device, compute dtype, backend, momentum, schedule): param groups that differ only
        # in radius or scope (per-layer radii, row balls here and tensor balls there) share it, since radii and
        # row lengths travel per ball and per tensor. A global ball is one ball over its group: a call of its
        # own. float16/bfloat16 parameters step through their float32 master copies (_HALF_DTYPES), beside the
        # float32 parameters.
        calls: dict[tuple, list] = {}
        for group, alpha, gamma in plan:
            params = group["params"]
            if not params:
                continue
            device = params[0].device
            # everything but the dtype is the group's: computed once per group, not per tensor
            shared = (_ops.resolve_backend(group["backend"], device), self._uses_momentum(group),
                      id(group) if group["constraint"].global_ball else None, self._schedule_key(group))
            for i, p in enumerate(params):
                calls.setdefault((device, reference.compute_dtype(p.dtype), *shared), []).append(
                    (group, alpha, gamma, i))
        coeffs_on = {}
        gaps = []
        for (device, dtype, backend, momentum, own_call, _), members in calls.items():
            _, alpha, gamma, _ = members[0]
            # (k, alpha_k, gamma_k) made on the device: no host-to-device copy, so a step can be captured
            schedule = torch.stack([_device_scalar(x, device) for x in (k, alpha, gamma)])
            if device not in coeffs_on:
                coeffs_on[device] = (tangent_coeffs.to(device) if tangent_coeffs is not None
                                     else torch.zeros(0, dtype=torch.float64, device=device))
            global_ball = own_call is not None
            ps, grads, moms, radii, starts, row_numel, halves = [], [], [], [], [], [], []
            for group, _, _, i in members:
                p = group["params"][i]
                if grads_of is not None:
                    g = grads_of(p)
                    if g is None and not global_ball:
                        raise AssertionError("parameters without gradients are filtered before _apply")
                    # a global ball scales every parameter: a missing gradient is a zero gradient. The kernels
                    # walk a gradient as flat memory in the parameter's order: a non-contiguous one is copied;
                    # the op takes the gradients in the dtype of the tensors it steps (the masters' for halves).
                    if g is None:
                        g = torch.zeros_like(p, dtype=dtype)
                    elif g.dtype != dtype or not g.is_contiguous():
                        g = g.to(dtype).contiguous()
                    grads.append(g)
                if momentum:
                    state = self.state[p]
                    if "momentum" not in state:
                        state["momentum"] = torch.zeros_like(p, dtype=dtype)
                    moms.append(state["momentum"])
                if p.dtype in _HALF_DTYPES:
                    halves.append((p, self._master(p)))
                ps.append(self.state[p]["master"] if p.dtype in _HALF_DTYPES else p)
                starts.append(offsets.get(id(p), 0))
                scope = group["constraint"].scope
                if scope == "row":
                    # rows of a matrix are its balls (L1Ball.rows); a tensor below 2-D is one ball
                    row_numel.append(math.prod(p.shape[1:]) if p.dim() >= 2 else 0)
                    radii.extend(group["radii"][i])
                else:
                    row_numel.append(0)
                    if not global_ball:
                        radii.append(group["radii"][i])
            if global_ball:
                radii = list(members[0][0]["radii"])
            # an empty tensor has no ball (rows of nothing): left out, nothing of it moves
            if any(not p.numel() for p in ps):
                keep = [t for t, p in enumerate(ps) if p.numel()]
                ps, grads, moms, starts, row_numel = ([xs[t] for t in keep] if xs else xs
                                                      for xs in (ps, grads, moms, starts, row_numel))
                if not global_ball:
                    radii = _radii_without_empty(members, radii)
            gap = torch.zeros((), dtype=torch.float64, device=device)
            _ops.l1_fw_step_(ps, moms, grads, schedule, coeffs_on[device], radii, global_ball, starts, seed,
                             distribution, gap, backend=backend, row_numel=row_numel if any(row_numel) else [])
            if halves:
                # one rounding of a feasible float32 iterate: ||theta||_1 <= r (1 + u) in the half dtype
                torch._foreach_copy_([p for p, _ in halves], [m for _, m in halves])
            gaps.append(gap)
        # summed where the first call's device is: no host synchronisation
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
        params: parameters or param groups (all parameters of a group on one device). Frozen ones
            (``requires_grad=False``) are left out with a warning, so ``model.parameters()`` of a model
            with frozen layers leaves those layers alone (not even rescaled into the ball).
        constraint: the feasible set, e.g. ``fgfw.L1Ball(radius=...)``.
        step_size: alpha_k (schedule name, constant or callable; default ``"2/(k+2)"``; a callable is not
            saved by ``state_dict``, see :meth:`state_dict`).
        momentum: rho in [0, 1), or None for none (0 also means none).
        backend: ``"cuda" | "triton" | "cpu" | "torch" | "auto"`` (default: $FGFW_BACKEND, else auto).
        check_finite: raise ``ValueError`` on a non-finite gradient before touching anything (one host sync;
            under torch.compile a graph break, so ``fullgraph=True`` needs ``check_finite=False``).

    Parameters whose ``grad`` is None are skipped (per-tensor and row balls: neither they nor their
    momentum move) or take a zero gradient (a global ball, whose update scales every parameter). So are
    parameters frozen after construction; in a global ball those raise ``ValueError``. A non-contiguous
    gradient is used as its contiguous copy. After a step, ``last_gap`` holds the Frank-Wolfe gap
    ``<v, theta - s>`` at the pre-step parameters, summed over all balls of all groups (a float64 tensor).
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
        plan = []
        for group, alpha, gamma in self._without_frozen(self._plan(k)):
            for p in group["params"]:
                if p.grad is not None and p.grad.layout != torch.strided:
                    raise TypeError(f"FrankWolfe does not support sparse gradients (parameter of shape "
                                    f"{tuple(p.shape)}, gradient layout {p.grad.layout})")
            if not group["constraint"].global_ball:
                group = _subset(group, [p.grad is not None for p in group["params"]])
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
        if estimator == "activity":  # every parameter must belong to an nn.Linear (raises ValueError naming it)
            activity.linear_owners(self.module, [p for g in self.param_groups for p in g["params"]])

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
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:
        """One step: ``num_tangents`` forward-mode passes of ``closure``, then the fused Frank-Wolfe update.

        ``closure`` (required) runs the model as usual and returns the scalar loss, e.g.
        ``opt.step(lambda: F.cross_entropy(model(x), y))``; it is called under forward-mode AD and no_grad
        (no backward pass, no stored activations), so it must not call ``backward()`` (that raises
        ``RuntimeError`` saying so). With ``estimator="activity"`` it returns the per-example losses instead
        (``reduction="none"``). Returns the (mean) loss at the pre-step parameters.

        Parameters frozen (``requires_grad=False``) since construction get no tangent and do not move (in a
        global ball they raise ``ValueError``); the others keep their place in the tangent stream.
        """
        if closure is None or not callable(closure):
            got = "no closure" if closure is None else f"a {type(closure).__name__}"
            raise TypeError(f"{type(self).__name__}.step needs a closure that computes the loss with the module, "
                            f"e.g. opt.step(lambda: F.cross_entropy(model(x), y)) (it runs the forward pass only: "
                            f"no loss.backward()); got {got}")
        closure = self._guarded(closure)
        k = self._step_count_k + 1
        plan = self._without_frozen(self._plan(k))
        params, offsets = self._stream_offsets()
        params = [p for p in params if p.requires_grad]  # offsets stay: a frozen tensor's share goes unused
        distribution = reference.DISTRIBUTIONS[self.tangent]
        # the tangents on a device are drawn by the backend of the first group there (one named for another
        # device's group may not run on this one); the update of each group regenerates them with its own
        backend_names: dict[torch.device, str | None] = {}
        for group in self.param_groups:
            for p in group["params"][:1]:
                backend_names.setdefault(p.device, group["backend"])
        backends = {}

        def fill(out: torch.Tensor, offset: int, tangent_id: int) -> torch.Tensor:
            """``out`` filled with tangent ``tangent_id`` of step k from ``offset`` of the stream."""
            if out.device not in backends:
                backends[out.device] = _ops.resolve_backend(
                    backend_names.get(out.device, self.param_groups[0]["backend"]), out.device)
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
