"""fgfw: Frank-Wolfe training under convex constraints, driven by projected forward gradients.

Optimizers: :class:`FrankWolfe` (backprop gradient), :class:`FGFW` (Algorithm 1) and :class:`AFGFW`
(Algorithm 2, variance reduced) of Rostami & Kia, "Projected Forward Gradient-Guided Frank-Wolfe
Algorithm via Variance Reduction". Constraint: :class:`L1Ball`.
"""
import torch  # noqa: F401  (the compiled extension links against torch's libraries: load them first)

from . import _ops, distributed, reference
from ._ops import available_backends, resolve_backend
from .constraints import L1Ball
from .optim import AFGFW, FGFW, FrankWolfe

# Register the compiled ops (torch.ops.fgfw.*) now if the extension was built; without it the reference
# backend serves every device.
HAS_COMPILED_EXTENSION = _ops._compiled_extension()

__version__ = "0.1.0"
__all__ = ["AFGFW", "FGFW", "FrankWolfe", "L1Ball", "available_backends", "resolve_backend", "reference"]
