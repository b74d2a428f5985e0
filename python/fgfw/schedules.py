"""Step-size (alpha_k) and averaging-weight (gamma_k) schedules. k counts optimizer steps from 1.

A schedule is given as one of:

* a name: ``"2/(k+2)"`` (Algorithm 1), ``"1/k"`` (Algorithm 2's alpha_k), ``"1/sqrt(k)"`` (Algorithm 2's
  gamma_k), ``"4/(k+8)^(2/3)"`` (the momentum weight of stochastic Frank-Wolfe with momentum, Mokhtari,
  Hassani and Karbasi 2018: rho_k = 1 - 4/(k+8)^(2/3) in their notation, i.e. the weight of the new
  gradient; as ``averaging_weight`` of AFGFW it is gamma_k);
* a constant in (0, 1];
* a callable ``k -> value`` (checked to lie in [0, 1] at every step). A callable is code, not data: an
  optimizer's ``state_dict`` cannot save it (``torch.load`` refuses code under its default
  ``weights_only=True``) and records only that the schedule was a callable (:func:`to_state`); the
  optimizer that loads such a state must be built with the callable again (:func:`from_state`).
  Names and constants are saved as they are.
"""
from __future__ import annotations

import math
from typing import Callable, Union

import torch

Schedule = Union[str, float, Callable[[int], float]]


def _sqrt(k):
    # Both square roots are correctly rounded: a float64 tensor k gives the value of the int k.
    return k.sqrt() if isinstance(k, torch.Tensor) else math.sqrt(k)


def _two_thirds_power(k):
    # pow is not correctly rounded, but a 0-dim float64 tensor and a Python float both call libm's pow on
    # the CPU: the same bits (a GPU's pow may differ in the last bit)
    return k.pow(2.0 / 3.0) if isinstance(k, torch.Tensor) else k ** (2.0 / 3.0)


# Each works on an int k and on a float64 tensor k (see evaluate).
NAMED = {
    "2/(k+2)": lambda k: 2.0 / (k + 2),
    "1/k": lambda k: 1.0 / k,
    "1/sqrt(k)": lambda k: 1.0 / _sqrt(k),
    "4/(k+8)^(2/3)": lambda k: 4.0 / _two_thirds_power(k + 8),
}


def check_schedule(spec: Schedule, name: str) -> Schedule:
    """Validates a schedule argument early; returns it unchanged."""
    if isinstance(spec, str):
        if spec not in NAMED:
            raise ValueError(f"{name} must be one of {sorted(NAMED)}, a constant in (0, 1] or a callable k -> value; "
                             f"got unknown schedule {spec!r}")
    elif callable(spec):
        pass
    elif isinstance(spec, (int, float)) and not isinstance(spec, bool):
        if not (0 < spec <= 1) or not math.isfinite(spec):
            raise ValueError(f"{name} must be in (0, 1], got {spec!r}")
    else:
        raise TypeError(f"{name} must be a schedule name, a number or a callable, got {type(spec).__name__}")
    return spec


def evaluate(spec: Schedule, k: int | torch.Tensor, name: str) -> float | torch.Tensor:
    """The value of a schedule at step k (k >= 1), checked to lie in [0, 1].

    k may be a float64 tensor holding an integer (the optimizers' step counter): a named schedule is
    then a float64 tensor computed without reading k on the host, so that torch.compile traces it into
    the step without specialising on k; it lies in (0, 1] for every k >= 1, so it is not checked. A
    callable gets the int k (a host read: under torch.compile, a graph break).
    """
    if isinstance(spec, str):
        value = NAMED[spec](k)
        if isinstance(k, torch.Tensor):
            return value
    elif callable(spec):
        k = int(k)
        value = float(spec(k))
    else:
        value = float(spec)
    if not (0.0 <= value <= 1.0):
        raise ValueError(f"{name} at step k={k} is {value!r}; it must lie in [0, 1]")
    return value


CALLABLE_KIND = "callable"


def to_state(spec: Schedule) -> str | float | dict:
    """What an optimizer's ``state_dict`` holds for a schedule: a name or a number as it is; for a callable,
    ``{"kind": "callable", "name": ...}`` (its name, for the error message of a load that lacks it)."""
    if isinstance(spec, (str, int, float)) and not callable(spec):
        return spec
    name = getattr(spec, "__qualname__", None)
    if isinstance(name, str):
        name = f"{getattr(spec, '__module__', None) or '?'}.{name}"
    else:  # an object with __call__: its repr (a class may give a readable one)
        name = repr(spec)
    return {"kind": CALLABLE_KIND, "name": name}


def from_state(saved: object, current: Schedule, name: str) -> Schedule:
    """The schedule to use after loading ``saved`` (from :func:`to_state`) into an optimizer whose schedule
    is ``current``: a saved name or number, checked; for a saved callable, ``current``, which must then be a
    callable too (a callable object itself, from an older state read with ``weights_only=False``, is used as
    it is). Raises ``ValueError`` naming ``name`` otherwise."""
    if isinstance(saved, dict):
        if saved.get("kind") != CALLABLE_KIND:
            raise ValueError(f"{name} in the state_dict must be a schedule name, a number or "
                             f"{{'kind': 'callable', ...}}, got {saved!r}")
        if not callable(current):
            raise ValueError(f"the state_dict's {name} was a callable ({saved.get('name')}), which state_dict cannot "
                             f"save (code is not data); build the optimizer with that callable ({name}=...) and load "
                             f"the state into it (this optimizer has {name}={current!r})")
        return current
    if callable(saved):  # a state saved before schedules were kept plain, read with weights_only=False
        return saved
    if isinstance(saved, bool) or not isinstance(saved, (str, int, float)):
        raise ValueError(f"{name} in the state_dict must be a schedule name, a number or {{'kind': 'callable', ...}}, "
                         f"got {type(saved).__name__} {saved!r}")
    check_schedule(saved, name)
    return saved
