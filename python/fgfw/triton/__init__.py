"""Triton backend of the fgfw ops: the same functions and signatures as fgfw.reference.

Kernels compile for CUDA devices; with TRITON_INTERPRET=1 set in the environment before this package
is imported, they run in Triton's interpreter on CPU tensors instead (slow; for tests).

``fill_tangent_``, ``l1_fw_step_`` and ``gradient_step_`` here are the plain launchers; importing the package also
registers them as the custom ops ``torch.ops.fgfw_triton.*`` (see ``ops.py``), which torch.compile
can trace and which the optimizers call.
"""
from __future__ import annotations

try:
    import triton
except ImportError:
    triton = None

__all__ = ["is_available"]
if triton is not None:
    from . import ops  # noqa: F401  (registers torch.ops.fgfw_triton)
    from .l1_fw_step import l1_fw_step_
    from .gradient_step import gradient_step_
    from .tangent import INTERPRET, fill_tangent_, fill_tangent_at_step_

    __all__ += ["fill_tangent_", "fill_tangent_at_step_", "gradient_step_", "l1_fw_step_"]


def is_available() -> bool:
    """True when Triton imports and its kernels can run here: a CUDA device, or interpreter mode."""
    if triton is None:
        return False
    import torch

    return torch.cuda.is_available() or INTERPRET
