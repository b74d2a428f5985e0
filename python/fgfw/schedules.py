"""Step-size (alpha_k) and averaging-weight (gamma_k) schedules. k counts optimizer steps from 1.

A schedule is given as one of:

* a name from the paper: ``"2/(k+2)"`` (Algorithm 1), ``"1/k"`` (Algorithm 2's alpha_k),
  ``"1/sqrt(k)"`` (Algorithm 2's gamma_k);
* a constant in (0, 1];
* a callable ``k -> value`` (checked to lie in [0, 1] at every step; not saved by ``state_dict`` if it
  is a lambda, so prefer names and constants for runs you want to resume).
"""
from __future__ import annotations

import math
from typing import Callable, Union

Schedule = Union[str, float, Callable[[int], float]]

NAMED = {
    "2/(k+2)": lambda k: 2.0 / (k + 2),
    "1/k": lambda k: 1.0 / k,
    "1/sqrt(k)": lambda k: 1.0 / math.sqrt(k),
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


def evaluate(spec: Schedule, k: int, name: str) -> float:
    """The value of a schedule at step k (k >= 1), checked to lie in [0, 1]."""
    if isinstance(spec, str):
        value = NAMED[spec](k)
    elif callable(spec):
        value = float(spec(k))
    else:
        value = float(spec)
    if not (0.0 <= value <= 1.0):
        raise ValueError(f"{name} at step k={k} is {value!r}; it must lie in [0, 1]")
    return value
