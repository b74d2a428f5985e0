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

A named schedule gives the same float64 bits on the host (a Python int k, the CPU step) and on a tensor k
(a GPU step, a compiled step), on any machine: each is a fixed sequence of IEEE-754 float64 +, -, *, /
and comparisons, which every backend rounds alike, and of a library square root made correctly rounded
(:func:`_sqrt`). A library's sqrt or pow alone would not do: torch's float64 CPU sqrt is not correctly
rounded on some builds (1.1 % of the integers below 10^5 one ulp off, on an AVX-512 machine), and pow
differs between libm, SLEEF and CUDA. Every product that feeds a sum is exact, so a compiler that fuses a
multiply-add (Triton does) cannot change a result either.
"""
from __future__ import annotations

import math
from typing import Callable, Union

import torch

Schedule = Union[str, float, Callable[[int], float]]


def _where(condition, a, b):
    return torch.where(condition, a, b) if isinstance(condition, torch.Tensor) else a if condition else b


def _neighbours(y):
    """The floats just below and just above y > 0."""
    if isinstance(y, torch.Tensor):
        return torch.nextafter(y, torch.zeros_like(y)), torch.nextafter(y, torch.full_like(y, math.inf))
    return math.nextafter(y, 0.0), math.nextafter(y, math.inf)


def _round_sqrt(x, y):
    """RN(sqrt(x)) for an integer 1 <= x <= 2^53, from y within one ulp of it (a faithful sqrt).

    The midpoints between y and its neighbours decide: sqrt(x) lies above y + h (h half the gap to the
    next float) iff x - (y + h)^2 > 0. With y = a + b split exactly (Veltkamp: a and b of 26 bits, so a^2,
    2ab and b^2 are exact), x - (y + h)^2 = S - b^2 - h^2 with S = x - a^2 - 2ab - 2yh; S and b^2 are
    multiples of ulp(y)^2 and 0 < h^2 < ulp(y)^2, so the test is S > b^2 (S is exact when it is near b^2,
    and far from it when rounded). Below y likewise, with S' = x - a^2 - 2ab + 2yh'."""
    below, above = _neighbours(y)
    c = y * 134217728.0 + y  # (2^27 + 1) y, written so that a fused multiply-add rounds it the same
    a = c - (c - y)
    b = y - a
    rest = (x - a * a) - 2.0 * a * b
    up = rest - y * (above - y) > b * b
    down = rest + y * (y - below) <= b * b
    return _where(up, above, _where(down, below, y))


def _sqrt(k):
    """sqrt(k) correctly rounded, for an int or a float64 tensor k holding integers in [1, 2^53]."""
    return _round_sqrt(k, k.sqrt()) if isinstance(k, torch.Tensor) else _round_sqrt(float(k), math.sqrt(k))


def _cube_root(x):
    """x^(1/3) for 1 <= x < 8^18 = 2^54 (float or float64 tensor), by the same operations everywhere: x = 8^j r
    with r in [1, 8) (exact: 2^j is a product of selects on x), a quadratic within 3.8 % of r^(1/3), then 4
    Newton steps (the error squares at each: 5e-21). Not correctly rounded: ``"4/(k+8)^(2/3)"`` made from it
    lies within 2.5 ulps of its exact value (tests/test_optim.py). Written so that no long chain of values is
    used twice: Inductor inlines a value at each of its uses, and a binary range reduction followed by 7 Newton
    steps from 2 took 8 minutes to compile here."""
    scale = 1.0 + 0.0 * x  # x's type (a float64 tensor; torch.where of two numbers would give float32)
    for j in range(1, 18):  # k + 8 < 8^18 for every k a float64 holds exactly (k <= 2^53)
        scale = scale * _where(x >= 8.0 ** j, 2.0, 1.0)
    r = x / (scale * scale * scale)
    c = 0.8 + r / 4.0 - r / (80.0 / r)  # 0.8 + r/4 - r^2/80 with no inexact product feeding a sum
    for _ in range(4):
        c = (2.0 * c + r / (c * c)) / 3.0
    return scale * c


# Each works on an int k and on a float64 tensor k (see evaluate).
NAMED = {
    "2/(k+2)": lambda k: 2.0 / (k + 2),
    "1/k": lambda k: 1.0 / k,
    "1/sqrt(k)": lambda k: 1.0 / _sqrt(k),
    "4/(k+8)^(2/3)": lambda k: 4.0 * _cube_root(k + 8.0) / (k + 8.0),
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
