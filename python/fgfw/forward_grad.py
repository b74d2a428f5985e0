"""The forward-gradient engines by name: the directional derivative c = <grad f(theta), u> in one forward
pass, which the forward-gradient optimizers (FGFW, AFGFW) take from ``ENGINES[engine]``.

* ``"forward_ad"``: torch's stock forward-mode AD (:mod:`fgfw.forward_ad_engine`), the reference;
* ``"lean"`` (the default): just-in-time tangents and lean JVP rules (:mod:`fgfw.lean`).

Every engine has the signature of :func:`directional_derivative` (see its docstring for the contract). The
modules read top-down: this registry imports both engines, the lean engine imports the shared checks
from the forward_ad engine, and nothing imports back.
"""
from __future__ import annotations

from .forward_ad_engine import DirectionalDerivative, directional_derivative
from .lean import lean_directional_derivative

ENGINES: dict[str, DirectionalDerivative] = {"forward_ad": directional_derivative,
                                             "lean": lean_directional_derivative}
# The lean engine is the default: just-in-time tangents and lean rules (see fgfw.lean and bench/RESULTS.md).
# "forward_ad" stays selectable as the reference engine.
DEFAULT_ENGINE = "lean"

__all__ = ["DEFAULT_ENGINE", "ENGINES", "DirectionalDerivative", "directional_derivative"]
