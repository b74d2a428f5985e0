"""Checkpoints: the optimizers' state_dict in plain types, and its loader, which checks everything before it
changes anything."""
from __future__ import annotations

import warnings
from itertools import chain

import torch

from .. import constraints, reference, schedules
from ..constraints import Constraint, _user_stacklevel
from .settings import check_radii, radii_record, row_radii

STATE_KEY = "fgfw"


def check_extra_state(opt, extra: dict) -> None:
    """Raises ``ValueError`` if the saved extra state (``state_dict()[STATE_KEY]``) cannot be loaded into ``opt``."""
    if extra.get("tangent_stream_version") != reference.TANGENT_STREAM_VERSION:
        raise ValueError(f"state_dict was saved with tangent stream version {extra.get('tangent_stream_version')}"
                         f", this fgfw has {reference.TANGENT_STREAM_VERSION}: the run cannot be resumed exactly")
    kind = extra.get("optimizer")
    if kind is not None and kind != type(opt).__name__:
        raise ValueError(f"state_dict was saved by {kind}, and cannot be loaded into {type(opt).__name__} "
                         f"(another algorithm, other state); load it into a {kind} built like the saved one")
    missing = [key for key in opt._extra_state() if key not in extra and key != "optimizer"]  # older: none
    if missing:
        raise ValueError(f"state_dict's {STATE_KEY!r} entry has no {missing}: it was saved by another kind of "
                         f"optimizer than {type(opt).__name__}")
    step = extra["step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"state_dict's step must be an integer >= 0, got {step!r}")


def checked_groups(opt, saved_groups: object) -> list[dict]:
    """The saved param groups as ``opt`` will hold them (constraints rebuilt, callable schedules
    taken from ``opt``, its own backend kept), or ``ValueError`` if they do not fit its groups."""
    if not isinstance(saved_groups, (list, tuple)) or not all(isinstance(g, dict) for g in saved_groups):
        raise ValueError("state_dict's param_groups must be a list of dicts")
    if len(saved_groups) != len(opt.param_groups):
        raise ValueError(f"state_dict has {len(saved_groups)} param groups, this optimizer has "
                         f"{len(opt.param_groups)}: it was saved for other parameters")
    groups = []
    for g, (saved, group) in enumerate(zip(saved_groups, opt.param_groups)):
        where = f"param group {g} of the state_dict"
        saved_params = saved.get("params")
        if not isinstance(saved_params, (list, tuple)) or len(saved_params) != len(group["params"]):
            count = len(saved_params) if isinstance(saved_params, (list, tuple)) else saved_params
            raise ValueError(f"{where} has {count} parameters, this optimizer's has {len(group['params'])}: it "
                             f"was saved for other parameters")
        saved = dict({"rescale": None}, **saved)  # a state saved before rescale existed: none
        missing = [key for key in (*opt.defaults, "radii") if key not in saved]
        if missing:
            raise ValueError(f"{where} has no {missing}: it was saved by another kind of optimizer than "
                             f"{type(opt).__name__}")
        constraint = saved["constraint"]
        if not isinstance(constraint, Constraint):  # an older checkpoint, read with weights_only=False, has the object
            constraint = constraints.from_dict(constraint)
        new = dict(saved, constraint=constraint, backend=group["backend"])
        for key in opt._SCHEDULE_KEYS:
            new[key] = schedules.from_state(saved[key], group[key], key)
        try:
            opt._check_group_hyperparameters(new)
        except TypeError as err:
            raise ValueError(f"{where}: {err}") from None
        params = group["params"]
        if constraint.global_ball and len({reference.compute_dtype(p.dtype) for p in params}) > 1:
            raise ValueError(f"{where} has a global ball, which cannot mix float64 with other params, got "
                             f"{sorted(map(str, {p.dtype for p in params}))}")
        check_radii(constraint, params, saved["radii"], where)
        if constraint.scope == "row":
            new["radii"] = row_radii(saved["radii"])
        groups.append(new)
    return groups


def check_state(opt, state: object, saved_groups: list[dict]) -> None:
    """Raises ``ValueError`` unless every saved per-parameter state fits its parameter."""
    if not isinstance(state, dict):
        raise ValueError("state_dict's state must be a dict")
    params_of = {}
    for g, (saved, group) in enumerate(zip(saved_groups, opt.param_groups)):
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


def saved(opt, state: dict) -> dict:
    """``state`` (torch.optim.Optimizer.state_dict of ``opt``) in plain types: each group's constraint as its
    to_dict(), schedules by schedules.to_state, and ``opt``'s own entry under STATE_KEY."""
    groups = []
    for group in state["param_groups"]:
        group = dict(group, constraint=group["constraint"].to_dict())
        for key in opt._SCHEDULE_KEYS:
            group[key] = schedules.to_state(group[key])
        groups.append(group)
    state["param_groups"] = groups
    state[STATE_KEY] = dict(opt._extra_state(), tangent_stream_version=reference.TANGENT_STREAM_VERSION)
    return state


def checked(opt, state_dict: dict) -> tuple[dict, dict]:
    """(the state_dict as torch.optim.Optimizer.load_state_dict takes it, ``opt``'s own entry), after every check
    (``ValueError`` with ``opt`` unchanged); warns where a saved constraint replaces ``opt``'s."""
    if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
        raise ValueError(f"state_dict must be a dict with 'state' and 'param_groups' (from "
                         f"{type(opt).__name__}.state_dict()), got {type(state_dict).__name__}")
    state_dict = dict(state_dict)
    extra = state_dict.pop(STATE_KEY, None)
    if not isinstance(extra, dict):
        raise ValueError(f"state_dict has no {STATE_KEY!r} entry: it was not saved by an fgfw optimizer")
    opt._check_extra_state(extra)
    groups = checked_groups(opt, state_dict["param_groups"])
    check_state(opt, state_dict["state"], groups)
    for g, (new, group) in enumerate(zip(groups, opt.param_groups)):
        saved, current = new["constraint"], group["constraint"]
        if saved.to_dict() != current.to_dict():
            warnings.warn(f"param group {g}: the state_dict's constraint {saved!r} replaces this optimizer's "
                          f"{current!r}; the run resumes in the saved set with its saved radii (build the "
                          f"optimizer with {saved!r} to resume without this warning)", UserWarning,
                          stacklevel=_user_stacklevel())
    state_dict["param_groups"] = groups
    return state_dict, extra


def finish_load(opt, state_dict: dict) -> None:
    """After torch.optim.Optimizer.load_state_dict, which casts floating state to the parameter's dtype: momentum,
    the master copy and the centre back in the compute dtype (float32 for bfloat16), the norm feedback's scales
    and the singular vectors in float64, as the step wrote them (a resumed run is bit-identical)."""
    saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
    params = chain.from_iterable(g["params"] for g in opt.param_groups)
    for saved_id, p in zip(saved_ids, params):
        entry = state_dict["state"].get(saved_id, {})
        for key in ("momentum", "master", "center"):
            if key in entry:
                opt.state[p][key] = entry[key].to(device=p.device, dtype=reference.compute_dtype(p.dtype), copy=True)
        for key in ("norm_scale", "singular_vector"):
            if key in entry:
                opt.state[p][key] = entry[key].to(device=p.device, dtype=torch.float64, copy=True)
    opt._radii_source = [radii_record(group) for group in opt.param_groups]  # the saved run's
