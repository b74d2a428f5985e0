"""The op layer: one entry point per kernel, and the one place that chooses among backends.

Backends (all implement the signatures of ``fgfw.reference``):

* ``cuda``   - the compiled CUDA kernels in ``fgfw._C`` (CUDA tensors).
* ``triton`` - the Triton kernels in ``fgfw.triton`` (CUDA tensors; CPU tensors under TRITON_INTERPRET=1).
* ``cpu``    - the compiled C++ kernels in ``fgfw._C`` (CPU tensors).
* ``torch``  - ``fgfw.reference``, the pure-torch spec (any device; slow).

``resolve_backend(None, device)`` picks the fastest available one for the device; a name given to an
optimizer (``backend=``) or in the ``FGFW_BACKEND`` environment variable is honoured or refused with an
error, never replaced silently.
"""
from __future__ import annotations

import functools
import os

import torch

from . import reference

BACKENDS = ("cuda", "triton", "cpu", "torch")
BACKEND_ENV_VAR = "FGFW_BACKEND"


# Why ``fgfw._C`` did not import (None once it has): kept for the errors and reports that need it, since
# without the module the 'cpu' and 'cuda' backends are simply missing and the reason would be lost.
_extension_error: ImportError | None = None
_extension_module = None


class ExtensionBuildMismatch(ImportError):
    """fgfw._C was built against another torch (or with CUDA kernels for a torch without CUDA)."""


def build_mismatch(torch_version: str, cuda_version: str | None, built: object) -> str:
    """Why an extension built as ``built`` (the generated module fgfw._build_info) cannot load into a torch
    of ``torch_version`` / ``cuda_version``, or '' when it can. Versions compare without local labels
    (2.14.1+cu130 is 2.14.1): the C++ ABI follows the release."""
    wanted = getattr(built, "TORCH_VERSION", "").split("+")[0]
    if wanted and wanted != torch_version.split("+")[0]:
        return (f"fgfw._C was built for torch {wanted}, this process has torch {torch_version}: install the fgfw "
                f"built for torch {torch_version.split('+')[0]} (a wheel whose version ends in "
                f"+torch{torch_version.split('+')[0]}...), or build it from source against this torch with: "
                f"pip install --no-build-isolation .")
    if getattr(built, "CUDA_VERSION", "") and not cuda_version:
        return (f"fgfw._C has CUDA kernels (built with CUDA {built.CUDA_VERSION}), this torch {torch_version} is a "
                f"CPU-only build: install the CPU wheel of fgfw, or build from source with FGFW_CUDA=OFF")
    return ""


@functools.lru_cache(maxsize=None)
def _compiled_extension() -> bool:
    global _extension_error, _extension_module
    try:
        from . import _build_info  # generated at build time: absent in a source tree that was never built
    except ImportError:
        _build_info = None
    mismatch = build_mismatch(torch.__version__, torch.version.cuda, _build_info)
    if mismatch:
        _extension_error = ExtensionBuildMismatch(mismatch)
        return False
    try:
        from . import _C  # (loaded for its side effect: registering the fgfw ops)
    except ImportError as err:
        _extension_error = err
        return False
    _extension_module = _C
    from . import _fake  # noqa: F401  (their fake implementations, for torch.compile)
    return True


def extension_import_error() -> ImportError | None:
    """The ImportError that ``import fgfw._C`` raised, or None when the compiled extension is loaded."""
    _compiled_extension()
    return _extension_error


def extension_file() -> str | None:
    """The file the compiled extension ``fgfw._C`` was loaded from, or None when it is not loaded."""
    return getattr(_extension_module, "__file__", None) if _compiled_extension() else None


def extension_not_built(err: ImportError | None) -> bool:
    """Whether ``err`` (from :func:`extension_import_error`) says the module is absent, not broken."""
    return isinstance(err, ModuleNotFoundError) and err.name == f"{__package__}._C"


def _extension_problem(backend: str) -> str:
    """Why the compiled kernels of ``backend`` ('cpu' or 'cuda') are missing, for an error message, or ''."""
    err = extension_import_error()
    if err is None:
        if backend == "cuda" and not _has_kernel("l1_fw_step_", "CUDA"):
            return "fgfw._C was built without CUDA kernels (FGFW_CUDA=OFF, or no nvcc at build time)"
        return ""
    if extension_not_built(err):
        return (f"fgfw._C is not built ({type(err).__name__}: {err}); build it with: "
                f"pip install --no-build-isolation .")
    if isinstance(err, ExtensionBuildMismatch):
        return str(err)
    return (f"fgfw._C failed to import ({type(err).__name__}: {err}); rebuild it against the torch in use "
            f"({torch.__version__}) with: pip install --no-build-isolation .")


def _has_kernel(op: str, dispatch_key: str) -> bool:
    return _compiled_extension() and torch._C._dispatch_has_kernel_for_dispatch_key(f"fgfw::{op}", dispatch_key)


@functools.lru_cache(maxsize=None)
def _triton_module():
    try:
        from . import triton as fgfw_triton
    except ImportError:
        return None
    return fgfw_triton if fgfw_triton.is_available() else None


def backend_available(backend: str, device: torch.device) -> bool:
    """Whether ``backend`` can run on tensors of ``device``."""
    device = torch.device(device)
    if backend == "torch":
        return True
    if backend == "cpu":
        return device.type == "cpu" and _has_kernel("l1_fw_step_", "CPU")
    if backend == "cuda":
        return device.type == "cuda" and _has_kernel("l1_fw_step_", "CUDA")
    if backend == "triton":
        module = _triton_module()
        return module is not None and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")
    return False


def available_backends(device) -> list[str]:
    """The backends that can run on ``device``, fastest first."""
    return [b for b in BACKENDS if backend_available(b, device)]


# Under torch.compile the choice is made once, when the step is traced (dynamo cannot trace the
# dispatcher queries and environment reads it needs), and baked into the graph: set FGFW_BACKEND
# before the first compiled step.
@torch.compiler.assume_constant_result
def resolve_backend(backend: str | None, device) -> str:
    """The backend to use on ``device``: ``backend``, else $FGFW_BACKEND, else the fastest available."""
    # Every step asks, for every param group: the answer is remembered (what is built and installed does
    # not change in a process; the environment variable is part of the question).
    return _resolve_backend(backend, torch.device(device), os.environ.get(BACKEND_ENV_VAR) or None)


@functools.lru_cache(maxsize=None)
def _resolve_backend(backend: str | None, device: torch.device, from_env: str | None) -> str:
    source = "backend"
    if backend is None and from_env:
        backend, source = from_env, BACKEND_ENV_VAR
    if backend is None or backend == "auto":
        for candidate in ("cuda", "cpu", "triton", "torch"):
            # triton on the CPU runs in the (slow) interpreter: only when asked for by name
            if candidate == "triton" and device.type != "cuda":
                continue
            if backend_available(candidate, device):
                return candidate
    if backend not in BACKENDS:
        raise ValueError(f"{source} must be one of {BACKENDS} or 'auto', got {backend!r}")
    if not backend_available(backend, device):
        problem = _extension_problem(backend) if backend in ("cpu", "cuda") else ""
        raise ValueError(
            f"{source}={backend!r} is not available for {device.type} tensors; available here: "
            f"{available_backends(device)} (the 'cpu' and 'cuda' backends need the compiled extension fgfw._C, "
            f"'triton' needs triton and a GPU or TRITON_INTERPRET=1)" + (f"; {problem}" if problem else ""))
    return backend


def _require_triton() -> None:
    """Imports fgfw.triton, which registers torch.ops.fgfw_triton, before a launcher is called by name."""
    if _triton_module() is None:
        raise ValueError("backend='triton' needs triton, and a GPU or TRITON_INTERPRET=1 set before fgfw.triton "
                         "is imported")


def _int64(seed: int) -> int:
    """A 64-bit seed as the signed int64 with the same bits: the ops' schemas take int64, and the stream
    keys on the seed's 64 bits (two's complement, reference.seed_to_key), so 2^63 and -2^63 are one key."""
    seed &= (1 << 64) - 1
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def fill_tangent_(out: torch.Tensor, seed: int, step: int | torch.Tensor, tangent_id: int, offset: int,
                  distribution: int, backend: str) -> torch.Tensor:
    """Writes the tangent stream into ``out`` (see ``reference.fill_tangent_``) and returns ``out``.

    ``step`` is an int, or the optimizers' step counter: a 0-dim int64 tensor on ``out``'s device (or on
    the CPU) that the kernel reads where it lies, so that a step needs no host read: no device
    synchronisation, one graph under torch.compile for every step, and a CUDA graph that replays it
    draws the tangents of the step the counter holds then.
    """
    seed = _int64(int(seed))
    at_step = isinstance(step, torch.Tensor)
    if backend in ("cpu", "cuda"):
        op = torch.ops.fgfw.fill_tangent_at_step_ if at_step else torch.ops.fgfw.fill_tangent_
        op(out, seed, step, tangent_id, offset, distribution)
    elif backend == "triton":
        _require_triton()
        op = torch.ops.fgfw_triton.fill_tangent_at_step_ if at_step else torch.ops.fgfw_triton.fill_tangent_
        op(out, seed, step, tangent_id, offset, distribution)
    else:
        reference.fill_tangent_(out, seed, int(step), tangent_id, offset, distribution)  # reads it on the host
    return out


def tangents_at_step(likes: list[torch.Tensor], seed: int, step: torch.Tensor, tangent_ids: list[int],
                     offsets: list[int], distribution: int, backend: str) -> list[torch.Tensor]:
    """New tensors, one per tensor of ``likes`` (its shape, dtype, device, layout), each holding tangent
    ``tangent_ids[i]`` of step ``step`` (the optimizers' counter, a 0-dim int64 tensor) from ``offsets[i]``, as
    :func:`fill_tangent_` writes it into ``torch.empty_like(like)``: one dispatch for them all on the compiled and
    Triton backends."""
    seed = _int64(int(seed))
    if backend in ("cpu", "cuda"):
        return torch.ops.fgfw.tangents_at_step(likes, seed, step, tangent_ids, offsets, distribution)
    if backend == "triton":
        _require_triton()
        return torch.ops.fgfw_triton.tangents_at_step(likes, seed, step, tangent_ids, offsets, distribution)
    return [fill_tangent_(torch.empty_like(like), seed, step, tangent_id, offset, distribution, backend)
            for like, tangent_id, offset in zip(likes, tangent_ids, offsets)]


def l1_fw_step_(params, momentum, grads, schedule, tangent_coeffs, radii, global_ball, offsets, seed, distribution,
                gap, backend: str, row_numel=(), prepared: bool = False) -> None:
    """One fused L1-ball Frank-Wolfe step (see ``reference.l1_fw_step_``) on ``backend``.

    ``prepared=True``: the arguments already have the op's types (lists of tensors, of Python floats and
    ints; the seed as int64, see :func:`_int64`) and are passed as they are: the optimizers prepare them
    once per plan, and converting a row ball's thousands of radii at every step would cost more than a
    small model's step.
    """
    if prepared:
        args = (params, momentum, grads, schedule, tangent_coeffs, radii, global_ball, offsets, seed, distribution,
                gap, row_numel)
    else:
        args = (list(params), list(momentum), list(grads), schedule, tangent_coeffs, [float(r) for r in radii],
                bool(global_ball), [int(o) for o in offsets], _int64(int(seed)), int(distribution), gap,
                [int(n) for n in row_numel])
    if backend in ("cpu", "cuda"):
        torch.ops.fgfw.l1_fw_step_(*args)
    elif backend == "triton":
        _require_triton()
        torch.ops.fgfw_triton.l1_fw_step_(*args)
    else:
        reference.l1_fw_step_(*args)


# The fused steps of the sets other than the L1 ball: the op of each, and the keyword of its own parameter.
SET_STEPS = {"linf": ("linf_fw_step_", None), "lp": ("lp_fw_step_", "p"), "ksparse": ("ksparse_fw_step_", "k")}


# Asked when a step's plan is built, which under torch.compile is traced: the answer is a constant (what is
# built and registered does not change in a process), as for resolve_backend.
@torch.compiler.assume_constant_result
def set_fw_step_available(kind: str, backend: str) -> bool:
    """Whether ``backend`` has the fused step of ``kind`` (a key of SET_STEPS): the reference ('torch') always,
    the compiled CPU and CUDA kernels and the Triton kernels where they are built and registered."""
    return _set_fw_step_available(kind, backend)


@functools.lru_cache(maxsize=None)
def _set_fw_step_available(kind: str, backend: str) -> bool:
    op = SET_STEPS[kind][0]
    if backend == "torch":
        return True
    if backend in ("cpu", "cuda"):
        return _has_kernel(op, backend.upper())
    if backend == "triton":
        module = _triton_module()
        return module is not None and hasattr(torch.ops.fgfw_triton, op)
    return False


def set_fw_step_(kind: str, params, momentum, grads, schedule, tangent_coeffs, radii, global_ball, offsets, seed,
                 distribution, gap, backend: str, row_numel=(), param=None, scales=()) -> None:
    """One fused Frank-Wolfe step over the balls of set ``kind`` (SET_STEPS: 'linf', 'lp' with ``param`` = p,
    'ksparse' with ``param`` = k; see ``reference.<kind>_fw_step_``), arguments prepared as for
    ``l1_fw_step_(prepared=True)``, on ``backend``. ``scales``: the norm feedback's state of the Lp and k-sparse
    steps (reference.fw_step_), ignored by the L-infinity step, which needs none."""
    op, keyword = SET_STEPS[kind]
    args = (params, momentum, grads, schedule, tangent_coeffs, radii, global_ball, offsets, seed, distribution, gap,
            row_numel)
    if keyword is not None:
        args += (param, list(scales))
    extra = {}
    if backend in ("cpu", "cuda"):
        getattr(torch.ops.fgfw, op)(*args, **extra)
    elif backend == "triton":
        _require_triton()
        getattr(torch.ops.fgfw_triton, op)(*args, **extra)
    elif backend == "torch":
        getattr(reference, op)(*args, **extra)
    else:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


# Asked when a step's plan is built, like set_fw_step_available.
@torch.compiler.assume_constant_result
def gradient_step_available(backend: str) -> bool:
    """Whether ``backend`` has the fused gradient_step_ (an unconstrained group's step): the reference always."""
    return _gradient_step_available(backend)


@functools.lru_cache(maxsize=None)
def _gradient_step_available(backend: str) -> bool:
    if backend == "torch":
        return True
    if backend in ("cpu", "cuda"):
        return _has_kernel("gradient_step_", backend.upper())
    if backend == "triton":
        module = _triton_module()
        return module is not None and hasattr(torch.ops.fgfw_triton, "gradient_step_")
    return False


def gradient_step_(params, momentum, grads, schedule, backend: str) -> None:
    """An unconstrained group's step from the directions ``grads`` (see ``reference.gradient_step_``) on ``backend``,
    every tensor in one op."""
    if backend in ("cpu", "cuda"):
        torch.ops.fgfw.gradient_step_(params, momentum, grads, schedule)
    elif backend == "triton":
        _require_triton()
        torch.ops.fgfw_triton.gradient_step_(params, momentum, grads, schedule)
    elif backend == "torch":
        reference.gradient_step_(params, momentum, grads, schedule)
    else:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


# Whether a CUDA step's finite check runs the fused op (fgfw::nonfinite: one read of each gradient) instead of the
# multi-tensor torch ops. Off until a GPU run measures both in one process (bench/optimizer_step.py's
# fw_l1_nonfinite_op row against fw_l1): the H200 run of 805cda4 measured the torch ops' check at 0.49 ms on one
# 1e8 tensor, where one read at copy speed takes 0.1 ms.
CUDA_NONFINITE_OP = False


def nonfinite(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Whether some entry of ``tensors`` is not finite, as a 0-dim bool tensor on ``device``, with no host read off
    the CPU: the fused op when every tensor is on the CPU (one pass, no temporaries; on CUDA with
    CUDA_NONFINITE_OP), else multi-tensor ops (all_finite_multi_tensor's sums), whose number does not grow with the
    number of tensors. Under torch.compile the reference's reductions, which dynamo traces."""
    if not tensors:
        return torch.zeros((), dtype=torch.bool, device=device)
    if torch.compiler.is_compiling():
        return torch.stack([~torch.isfinite(t).all().to(device) for t in tensors]).any()
    kind = tensors[0].device.type
    if ((kind == "cpu" or (kind == "cuda" and CUDA_NONFINITE_OP)) and _has_kernel("nonfinite", kind.upper())
            and all(t.device == tensors[0].device for t in tensors)):
        found = torch.ops.fgfw.nonfinite([torch.view_as_real(t) if t.is_complex() else t for t in tensors])
        return found if found.device == device else found.to(device)
    return ~_finite_multi_tensor(tensors, device)


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every entry of every tensor is finite (see ``reference.all_finite``): the C++ kernel when the
    tensors are on the CPU (one pass, no temporaries), else multi-tensor torch ops (all_finite_multi_tensor),
    whose number does not grow with the number of tensors. Under torch.compile the reference, which dynamo
    traces (the host read is a graph break either way)."""
    if not tensors:
        return True
    if torch.compiler.is_compiling():
        return reference.all_finite(tensors)
    if _has_kernel("all_finite", "CPU") and all(t.device.type == "cpu" for t in tensors):
        return torch.ops.fgfw.all_finite(tensors)
    return all_finite_multi_tensor(tensors)


def all_finite_multi_tensor(tensors: list[torch.Tensor]) -> bool:
    """``reference.all_finite`` in a few multi-tensor ops per (device, dtype), one host read: the sum of |x| of
    each tensor, accumulated in float64, is finite exactly when every entry is (NaN and inf propagate through a
    sum in any order, and no sum of finite float32 or half values overflows float64). A float64 tensor's sum
    could overflow: it is summed times 0 (0 where x is finite, NaN where not), through a temporary."""
    if any(t.is_complex() for t in tensors):
        return reference.all_finite(tensors)
    return bool(_finite_multi_tensor(tensors, tensors[0].device))


def _finite_multi_tensor(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """all_finite_multi_tensor's verdict as a 0-dim bool tensor on ``device`` (no host read)."""
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        if t.is_complex():
            t = torch.view_as_real(t)
        if t.is_floating_point():  # integers and bools are finite
            by_kind.setdefault((t.device, t.dtype), []).append(t)
    verdicts = []
    for (_, dtype), group in by_kind.items():
        if dtype == torch.float64:
            group = torch._foreach_mul(group, 0.0)
        sums = torch._foreach_norm(group, 1, dtype=torch.float64)
        verdicts.append(torch.stack(sums).isfinite().all().to(device))
    if not verdicts:
        return torch.ones((), dtype=torch.bool, device=device)
    return verdicts[0] if len(verdicts) == 1 else torch.stack(verdicts).all()
