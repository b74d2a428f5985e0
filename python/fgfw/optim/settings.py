"""The rules of the torch.optim face: what a param group may hold and how its radii are checked, shared by the
optimizers' construction (add_param_group), the plan's checks before a step and the checkpoint's loader."""
from __future__ import annotations

import math
import warnings
from typing import Iterable

import torch

from .. import _ops, constraints, reference
from ..constraints import Constraint, L1Ball, _user_stacklevel

# Parameter dtypes stepped through a float32 master copy (see _FrankWolfeBase._master).
HALF_DTYPES = (torch.float16, torch.bfloat16)
CENTERS = (None, "init")  # where a group's balls are centred: 0, or the parameters' values when it is added


def param_tensors(params: Iterable) -> tuple[list, list[torch.Tensor]]:
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


def row_radii(radii: list) -> list[tuple]:
    """A row ball's radii as stored in its group: one tuple per tensor, so that none changes in place."""
    return [tuple(r) for r in radii]


def check_radii(constraint: Constraint, params: list[torch.Tensor], radii: object, where: str) -> None:
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
            numbers(per_tensor, L1Ball.row_count(p), f"radii for the rows of a tensor of shape {tuple(p.shape)}")
    else:
        numbers(radii, len(params), "radii (one per tensor)")


def describe(i: int, p: torch.Tensor) -> str:
    return f"parameter {i} (shape {tuple(p.shape)}, dtype {p.dtype}, device {p.device})"


def constraint_spec(constraint: Constraint) -> tuple:
    """What a group's radii and balls are made from: the constraint's settings (its to_dict values). A change of
    any (radius, scope, rule, p, k, ...) between steps is applied in full (apply_setting_changes)."""
    return tuple(constraint.to_dict().items())


def spec_key(spec) -> object:
    """A schedule as a dict key: names and numbers by value, callables by identity."""
    return spec if isinstance(spec, (str, int, float)) else ("callable", id(spec))


def radii_record(group: dict) -> tuple:
    """What a group's radii were made from (see apply_setting_changes): its constraint, the constraint's
    settings and the radii."""
    return group["constraint"], constraint_spec(group["constraint"]), list(group["radii"])


def centred(group: dict) -> bool:
    """Whether the group's balls are centred at its starting values (an unconstrained group has none)."""
    return group.get("center") == "init" and not isinstance(group["constraint"], constraints.Unconstrained)


def check_finite_start(opt, params: list, group_index: int) -> None:
    """``ValueError`` naming the first trainable parameter that holds NaN or inf: rescaling it into its ball
    would spread them (a NaN made the whole tensor NaN, an inf gave [nan, 0, 0]). Frozen parameters are
    left out of the optimizer, and other bad input gets its own error from add_param_group."""
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor) or not p.requires_grad or p.layout != torch.strided or p.is_meta \
                or not p.is_floating_point():
            continue
        bad = int((~torch.isfinite(p.detach())).sum())
        if bad:
            name = opt._param_name(p)
            what = f"parameter {name!r} (shape {tuple(p.shape)})" if name else describe(i, p)
            raise ValueError(f"{what} of param group {group_index} holds {bad} non-finite value(s) (NaN or inf) "
                             f"of {p.numel()}: a Frank-Wolfe start must be finite; initialise it to finite values "
                             f"before giving it to {type(opt).__name__} (nothing was changed)")


def checked_group(opt, param_group: dict) -> dict:
    """``param_group`` checked and completed as ``opt`` will hold it: its parameters checked, the frozen ones left
    out with a warning that names them, the defaults filled in, its radii set and its start made feasible
    (unless the group is centred at its start). _FrankWolfeBase.add_param_group then adds it."""
    params = param_group["params"]
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"params must be tensors, got {type(p).__name__} at position {i}")
        if p.layout != torch.strided:
            raise TypeError(f"{describe(i, p)} has layout {p.layout}: Frank-Wolfe needs dense (strided) tensors")
        if not p.is_floating_point():
            raise TypeError(f"{describe(i, p)} is not floating point; only float16/bfloat16/float32/float64 "
                            f"parameters can be optimized")
        if not p.is_contiguous():
            raise ValueError(f"{describe(i, p)} is not contiguous; the fused kernels walk parameters as flat "
                             f"memory (make it contiguous before creating the optimizer)")
    check_finite_start(opt, params, len(opt.param_groups))
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise ValueError(f"params of one param group must share a device, got {sorted(map(str, devices))}; "
                         f"put each device's parameters in its own group")
    frozen = [(i, p) for i, p in enumerate(params) if not p.requires_grad]
    if frozen:
        names = ", ".join(repr(opt._param_name(p)) if opt._param_name(p) else describe(i, p) for i, p in frozen)
        warnings.warn(f"{type(opt).__name__} left out {len(frozen)} of the {len(params)} params of a param group, "
                      f"frozen (requires_grad=False): {names}. They are never read, rescaled nor updated; set "
                      f"requires_grad=True before creating the optimizer to train them",
                      UserWarning, stacklevel=_user_stacklevel())
        opt._frozen_left_out += len(frozen)
        params = [p for p in params if p.requires_grad]
    group = dict(param_group, params=params)
    for key, value in opt.defaults.items():
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
    opt._check_group_hyperparameters(group)
    if params:
        _ops.resolve_backend(group["backend"], next(iter(devices)))  # fail now, not at the first step
    group.setdefault("radii", constraint.resolve_radii(params))
    if constraint.scope == "row":
        group["radii"] = row_radii(group["radii"])
    if group["center"] not in CENTERS:
        raise ValueError(f"center must be one of {CENTERS} (None: the set's balls are centred at 0; 'init': at "
                         f"the parameters' values when the group is added, for fine-tuning), got "
                         f"{group['center']!r}")
    if not centred(group):  # a centred group starts at its centre: theta - c = 0 is in every ball
        constraint.make_feasible_(params, group["radii"])
    return group


def check_center(state, group: dict, g: int) -> None:
    """center is fixed when a group is added (its centre is the parameters' values then); ``state`` is the
    optimizer's."""
    wants = centred(group)
    has = [p for p in group["params"] if p in state and "center" in state[p]]
    if group.get("center") not in CENTERS or (wants and len(has) != len(group["params"])) \
            or (not wants and has and not isinstance(group["constraint"], constraints.Unconstrained)):
        raise ValueError(f"param group {g}: center was changed to {group.get('center')!r} after the group was "
                         f"added; a group's centre is set when it is added (center='init' keeps the values "
                         f"then): create the optimizer again, or add a new group")


def apply_setting_changes(opt) -> None:
    """Applies what changed in a group's constraint or radii since its radii were made, as construction does.

    A new constraint object, or a change of its settings (radius, scope, rule, its own parameters), makes
    the group's radii again from it (an explicit radius, or the rule measured on the current parameters);
    a new ``group["radii"]`` is taken as given. Either way the parameters are then moved into the new balls
    (rescaled, with a warning beyond rounding; a float16/bfloat16 parameter through its float32 master
    copy). Every group is checked before any changes: invalid settings raise ``ValueError`` (``TypeError``
    for a constraint that is not one) naming the group, with nothing changed."""
    changes = []
    for g, group in enumerate(opt.param_groups):
        check_center(opt.state, group, g)
        source, spec, radii = opt._radii_source[g]
        if group["constraint"] is None:  # made unconstrained: a gradient step from now on
            group["constraint"] = constraints.Unconstrained()
        constraint, params = group["constraint"], group["params"]
        new_set = constraint is not source or constraint_spec(constraint) != spec
        if not new_set and list(group["radii"]) == radii:
            continue
        where = f"param group {g}"
        if not isinstance(constraint, Constraint):
            raise TypeError(f"{where}: constraint must be an fgfw constraint such as fgfw.L1Ball(radius=...), "
                            f"got {type(constraint).__name__}")
        targets = [opt.state[p]["master"] if p in opt.state and "master" in opt.state[p] else p
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
        check_radii(constraint, params, new_radii, where)
        changes.append((g, group, constraint, targets, row_radii(new_radii) if constraint.scope == "row"
                        else list(new_radii)))
    for g, group, constraint, targets, new_radii in changes:
        centers = [opt.state[p]["center"] for p in group["params"]] if centred(group) else None
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
        opt._radii_source[g] = radii_record(group)


def check_groups(opt) -> None:
    """What a step checks in every group before its plan is built (the hyperparameters and radii may have been
    changed since the last step), after applying changed settings (apply_setting_changes)."""
    apply_setting_changes(opt)
    for g, group in enumerate(opt.param_groups):
        constraint, params = group["constraint"], group["params"]
        opt._check_group_hyperparameters(group)
        check_radii(constraint, params, group["radii"], f"param group {g}")
        if constraint.scope == "row":  # a row radius changed in place would go unseen (see _plan_key)
            group["radii"][:] = row_radii(group["radii"])
        if constraint.global_ball and not all(p.requires_grad for p in params):
            frozen = [describe(i, p) for i, p in enumerate(params) if not p.requires_grad]
            raise ValueError(f"{', '.join(frozen)} of a param group with a global L1 ball has requires_grad="
                             f"False (frozen after the optimizer was created): a global ball scales all its "
                             f"parameters together, so it cannot leave one out; create the optimizer again "
                             f"after freezing (frozen parameters are left out at construction)")
