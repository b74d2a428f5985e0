"""The plan of a step: which fused call steps which tensors, with what constants.

A step's plan (the calls, over which tensors, with which radii, row lengths and stream offsets) depends only on
the param groups, their hyperparameters and which parameters take part; the optimizer builds it once
(:func:`build_plan`) and keeps it until one of those changes (its key is read at every step and compared), so
that a step runs no per-tensor Python work beyond reading the gradients. Each call has one kind, the path that
steps it (functional.fw_step):

* ``"l1"``: the fused L1-ball op (``_ops.l1_fw_step_``);
* ``"set"``: another set's fused op (L-infinity, Lp, k-sparse: ``_ops.set_fw_step_``);
* ``"unconstrained"``: a gradient step, every tensor in one op (``_ops.gradient_step_``);
* ``"torch"``: a set stepped through its vertex in torch ops (``reference.fw_step_``), or a rescaled step.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from .. import _ops, constraints, reference
from ..constraints import Constraint, L1Ball
from .settings import HALF_DTYPES

KINDS = ("l1", "set", "unconstrained", "torch")


class Call:
    """One fused op call of a step, prepared once per plan: which tensors it steps and with what constants.
    Only the gradients, the schedule and the gap are made per step."""

    __slots__ = ("kind", "device", "dtype", "backend", "momentum", "global_ball", "group", "params", "targets",
                 "moms", "radii", "starts", "row_numel", "halves", "zero_grads", "constraint", "fused_set",
                 "feasibility", "scales", "centers", "runs", "flat_targets", "flat_moms")

    def __init__(self, device, dtype, backend, momentum, global_ball, group):
        self.kind = "l1"  # see KINDS; set by build_plan
        self.device, self.dtype, self.backend = device, dtype, backend
        self.momentum, self.global_ball, self.group = momentum, global_ball, group  # group: its schedules
        self.params: list[torch.Tensor] = []   # the parameters, whose gradients are read
        # what the op steps: the parameter, or its float32 master copy (None until the first step, make_state)
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
        # the norm feedback's scale of every ball (state "norm_scale", make_state) where the set has one
        self.scales: list[torch.Tensor] = []
        # a group with center="init": its balls are centred at the start (state "center"), the op steps theta - c
        self.centers: list[torch.Tensor] = []
        # an unconstrained call's tensors as runs of consecutive places in the tangent stream (stream_runs), and
        # its targets and momentum flat (make_state): its forward gradient is drawn one run at a time
        self.runs: list[tuple[int, list[int]]] = []
        self.flat_targets: list[torch.Tensor] = []
        self.flat_moms: list[torch.Tensor] = []


class Plan:
    """What a step does that does not change from step to step: the calls, and (forward-gradient optimizers) the
    parameters that get tangents with their places in the tangent stream."""

    __slots__ = ("key", "calls", "stream_params", "offsets", "tangent_backends", "no_coeffs")

    def __init__(self, key, calls, stream_params, offsets, tangent_backends):
        self.key, self.calls, self.stream_params, self.offsets = key, calls, stream_params, offsets
        # the tangents on a device are drawn by the backend of the first group there (one named for another
        # device's group may not run on this one); the update of each group regenerates them with its own
        self.tangent_backends = tangent_backends
        self.no_coeffs: dict[torch.device, torch.Tensor] = {}  # the gradient path's empty tangent_coeffs


def feasibility_of(constraint: Constraint) -> reference.Feasibility | None:
    """How a step in torch ops (reference.fw_step_) keeps the constraint's set: the fused sets' Feasibility, the L1
    ball's (stepped there only with rescale=), or None for the sets stepped with Constraint.SHRINK_STEP."""
    if isinstance(constraint, L1Ball):
        return reference.set_feasibility("l1")
    fused = constraint.fused_step()
    return None if fused is None else reference.set_feasibility(*fused)


def build_plan(param_groups: list[dict], *, key: list, takes_part: Callable[[dict], list[bool]],
               uses_momentum: Callable[[dict], bool], schedule_key: Callable[[dict], tuple],
               missing_gradient: Callable[[torch.Tensor], bool], tangent_stream: bool) -> Plan:
    """The plan of ``param_groups`` (checked by settings.check_groups): their parameters grouped into calls, one
    per (device, compute dtype, backend, momentum, schedule). Param groups that differ only in radius or scope
    (per-layer radii, row balls here and tensor balls there) share a call, since radii and row lengths travel per
    ball and per tensor. A global ball is one ball over its group: a call of its own. float16/bfloat16
    parameters step through their float32 master copies (HALF_DTYPES), beside the float32 parameters.

    ``takes_part``, ``uses_momentum``, ``schedule_key`` and ``missing_gradient`` are the optimizer's rules;
    ``tangent_stream``: the tensors get places in the tangent stream (the forward-gradient optimizers)."""
    stream_params, offsets, start = [], {}, 0
    if tangent_stream:
        # each tensor starts at a multiple of 4, the start of a Philox call, so that the kernels can draw
        # one call per 4 aligned elements of every tensor (vectorised loads and stores); a frozen tensor
        # keeps its place (its share goes unused), so freezing one does not move the others' tangents
        for group in param_groups:
            for p in group["params"]:
                offsets[id(p)] = start
                start += -(-p.numel() // 4) * 4
                if p.requires_grad:
                    stream_params.append(p)
    calls: dict[tuple, Call] = {}
    tangent_backends: dict[torch.device, str] = {}
    for g, group in enumerate(param_groups):
        params, constraint = group["params"], group["constraint"]
        if not params:
            continue
        taking_part = takes_part(group)
        device = params[0].device
        momentum = uses_momentum(group)
        backend = _ops.resolve_backend(group["backend"], device)
        tangent_backends.setdefault(device, backend)
        # the L1 ball steps in the fused kernels; another set, or a rescaled step (a step per ball), steps in
        # torch ops through its vertex (reference.fw_step_), in calls of its own for each constraint object
        fused = isinstance(constraint, L1Ball) and group["rescale"] is None
        centred = group.get("center") == "init" and not isinstance(constraint, constraints.Unconstrained)
        shared = (backend, momentum, ("group", g) if constraint.global_ball else None if fused else id(constraint),
                  schedule_key(group), group["rescale"], centred)
        for i, p in enumerate(params):
            # an empty tensor has no ball (rows of nothing): left out, nothing of it moves
            if not taking_part[i] or not p.numel():
                continue
            dtype = reference.compute_dtype(p.dtype)
            call = calls.get((device, dtype, *shared))
            if call is None:
                call = calls[(device, dtype, *shared)] = Call(device, dtype, backend, momentum,
                                                              constraint.global_ball, group)
                call.constraint = None if fused else constraint
                # an L-infinity, Lp or k-sparse set, not rescaled, on a backend with its fused kernel; the
                # 'torch' backend keeps reference.fw_step_, whose row vertices are batched
                fused_set = constraint.fused_step() if group["rescale"] is None else None
                if fused_set is not None and backend != "torch" and _ops.set_fw_step_available(fused_set[0], backend):
                    call.fused_set = fused_set
                call.kind = ("l1" if fused else "set" if call.fused_set is not None
                             else "unconstrained" if isinstance(constraint, constraints.Unconstrained) else "torch")
                # the L1 op keeps its balls by itself; the other steps by a Feasibility (with state, for some)
                call.feasibility = None if fused else feasibility_of(constraint)
                if constraint.global_ball:
                    call.radii = [float(r) for r in group["radii"]]
            if constraint.global_ball and missing_gradient(p):
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
        if tangent_stream and call.kind == "unconstrained":
            call.runs = stream_runs(call.starts, [p.numel() for p in call.params])
    return Plan(key, list(calls.values()), stream_params, offsets, tangent_backends)


def stream_runs(starts: list[int], numels: list[int]) -> list[tuple[int, list[int]]]:
    """Tensors at places ``starts`` of the tangent stream, in stream order, as runs of consecutive places: (the
    run's first place, the sizes that split it into [tensor, padding, tensor, padding, ..., tensor]). A tensor
    takes its numel rounded up to a multiple of 4 (build_plan's offsets); a gap (a frozen tensor, another call's
    tensors) starts a new run."""
    runs: list[tuple[int, list[int]]] = []
    end = None
    for start, n in zip(starts, numels):
        if runs and start == end:
            first, sizes = runs[-1]
            sizes.extend([start - first - sum(sizes), n])  # the previous tensor's padding, then this tensor
        else:
            runs.append((start, [n]))
        end = start + -(-n // 4) * 4
    return runs


def master(state, p: torch.Tensor) -> torch.Tensor:
    """The float32 master copy of a float16/bfloat16 parameter, made from it at its first step (``state``: the
    optimizer's; see _FrankWolfeBase._master)."""
    entry = state[p]
    if "master" not in entry:
        entry["master"] = p.detach().to(torch.float32)
    return entry["master"]


def make_state(call: Call, state) -> None:
    """The call's momentum and float32 master copies, made at its first step (not when the plan is built: a step
    that fails before the update leaves no state behind); ``state``: the optimizer's."""
    call.targets = [master(state, p) if p.dtype in HALF_DTYPES else p for p in call.params]
    group = call.group
    if group.get("center") == "init" and not isinstance(group["constraint"], constraints.Unconstrained):
        call.centers = [state[p]["center"] for p in call.params]
    call.halves = [(p, master(state, p)) for p in call.params if p.dtype in HALF_DTYPES]
    if call.momentum:
        for p in call.params:
            entry = state[p]
            if "momentum" not in entry:
                entry["momentum"] = torch.zeros_like(p, dtype=call.dtype)
            call.moms.append(entry["momentum"])
    if call.runs:  # flat views, as the forward gradient of a run is drawn
        call.flat_targets = [t.view(-1) for t in call.targets]
        call.flat_moms = [v.view(-1) for v in call.moms]
    if call.feasibility is not None and call.feasibility.p is not None:
        # one scale per ball of each parameter (rows, or the tensor); the global ball's in its first parameter's
        # state. A scale of another layout (the scope changed) starts again from 1.
        holders = call.params[:1] if call.global_ball else call.params
        for p, n in zip(holders, call.row_numel or [0] * len(holders)):
            balls = 1 if call.global_ball or n == 0 else p.numel() // n
            entry = state[p]
            scale = entry.get("norm_scale")
            if scale is None or scale.shape != (balls,) or scale.device != p.device:
                entry["norm_scale"] = torch.ones(balls, dtype=torch.float64, device=p.device)
            call.scales.append(entry["norm_scale"])
