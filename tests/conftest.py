"""Shared fixtures: the compiled ops, or a skip that says why they cannot run here."""
import os

import torch

# Without a GPU the Triton kernels run in Triton's interpreter, which must be chosen before triton is
# first imported (its standard library is built at import); importing fgfw (torch.library) imports
# triton, so this is set here, before any test module is collected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def fgfw_ops():
    """torch.ops.fgfw with the compiled kernels of fgfw._C loaded; skips when the extension is not built."""
    try:
        import fgfw._C  # noqa: F401  (registers the ops with the dispatcher)
    except ImportError as exc:
        pytest.skip(f"fgfw._C is not built ({exc}); build it with: pip install --no-build-isolation -e .")
    return torch.ops.fgfw


@pytest.fixture(scope="session")
def fgfw_cuda_ops(fgfw_ops):
    """torch.ops.fgfw for CUDA tensors; skips without a GPU or when fgfw._C was built without CUDA."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if not torch._C._dispatch_has_kernel_for_dispatch_key("fgfw::fill_tangent_", "CUDA"):
        pytest.skip("fgfw._C was built without CUDA kernels (FGFW_CUDA=OFF, or no nvcc at build time)")
    return fgfw_ops
