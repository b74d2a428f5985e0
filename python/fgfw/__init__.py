"""fgfw: Frank-Wolfe training under convex constraints, driven by projected forward gradients.

Optimizers: :class:`FrankWolfe` (backprop gradient), :class:`FGFW` (Algorithm 1) and :class:`AFGFW`
(Algorithm 2, variance reduced) of Rostami & Kia, "Projected Forward Gradient-Guided Frank-Wolfe
Algorithm via Variance Reduction". Constraints: :mod:`fgfw.constraints` (L1, L2, L-infinity, Lp balls, the
k-sparse polytope, simplices, the nuclear-norm, group-L1, spectral-norm and column-norm balls).
"""
import torch  # noqa: F401  (the compiled extension links against torch's libraries: load them first)

from . import _ops, distributed, reference
from ._ops import available_backends, resolve_backend
from .constraints import (ColumnNormBall, Constraint, GroupL1Ball, KSparsePolytope, L1Ball, L2Ball, LInfBall, LpBall,
                          NonnegativeL1Ball, NuclearNormBall, Simplex, SpectralNormBall, Unconstrained)
from .groups import param_groups
from .optim import AFGFW, FGFW, FrankWolfe

# Register the compiled ops (torch.ops.fgfw.*) now if the extension was built; without it the reference
# backend serves every device.
HAS_COMPILED_EXTENSION = _ops._compiled_extension()

__version__ = "0.1.0"
__all__ = ["AFGFW", "FGFW", "FrankWolfe", "ColumnNormBall", "Constraint", "GroupL1Ball", "KSparsePolytope", "L1Ball", "L2Ball", "LInfBall", "LpBall",
           "NonnegativeL1Ball", "NuclearNormBall", "Simplex", "SpectralNormBall", "Unconstrained", "available_backends", "param_groups",
           "resolve_backend", "reference"]
