"""The tangent stream in Triton: Philox4x32-10 on uint32 words, floats derived by hand (reference.py;
the spec is docs/tangent_stream.md).

Triton's own ``tl.rand``/``tl.randn`` are not used: their float conversion has changed between Triton
releases, and the stream must never change (TANGENT_STREAM_VERSION). The rounds are written out here
(Random123 constants, key = seed (lo, hi), counter = (q lo, q hi, step, tangent id)) so the words are
the reference's by construction; the known-answer vectors in the tests pin them.

A block of the stream is generated as a [ROWS, 4] tile: row r is one Philox call (q = first + r), column
c its word c, so stream index 4 q + c lands at tile position (r, c): each call is made once per block
(not once per element) and the tile's row-major order is the stream's order.
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from .. import reference

# Triton decides between compiling and interpreting when a kernel is defined, i.e. when this module
# is imported: TRITON_INTERPRET must be set before that.
INTERPRET = triton.knobs.runtime.interpret

# fgfw.triton.aot's compile-only mode: launches compile for a GPU target and return without running, so CPU
# tensors stand for device tensors and the launchers take their GPU paths (see device_path).
_COMPILE_ONLY = [False]


def device_path(tensor: torch.Tensor) -> bool:
    """Whether a launch for ``tensor`` takes the GPU path: a CUDA tensor, or any tensor in compile-only mode."""
    return tensor.is_cuda or _COMPILE_ONLY[0]

# Stream indices per program: 512 Philox calls of four words each.
ROWS = 512
BLOCK = 4 * ROWS

_TWO_PI_F32 = tl.constexpr(6.2831853071795864769)  # rounded to float32 in the kernel, as in the reference
_TWO_POW_MINUS_24 = tl.constexpr(2.0**-24)

TL_DTYPES = {torch.float32: tl.float32, torch.float64: tl.float64, torch.bfloat16: tl.bfloat16,
             torch.float16: tl.float16}


def as_int32(word: int) -> int:
    """A 32-bit word as the signed int32 with the same bits: every word then reaches the kernel as i32
    (bit-cast back to uint32 there), so a seed >= 2^31 does not compile a second i64 variant."""
    word &= 0xFFFFFFFF
    return word - (1 << 32) if word >= (1 << 31) else word


def key_words(seed: int) -> tuple[int, int]:
    """The Philox key of ``seed`` as two int32 kernel arguments (lo, hi)."""
    lo, hi = reference.seed_to_key(seed)
    return as_int32(lo), as_int32(hi)


@triton.jit
def _philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 (Salmon et al. 2011) on uint32 values; the low product wraps, the high uses umulhi."""
    for _ in tl.static_range(10):
        hi0 = tl.umulhi(c0, 0xD2511F53)
        lo0 = c0 * 0xD2511F53
        hi1 = tl.umulhi(c2, 0xCD9E8D57)
        lo1 = c2 * 0xCD9E8D57
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return c0, c1, c2, c3


@triton.jit
def _uniform(word):
    """float32 in (0, 1] from a word: (float32(w >> 8) + 0.5) * 2^-24, as reference.uniform_from_word."""
    return ((word >> 8).to(tl.float32) + 0.5) * _TWO_POW_MINUS_24


@triton.jit
def _box_muller(word_radius, word_angle):
    # sqrt_rn: tl.sqrt compiles to sqrt.approx on NVIDIA, which is further from the reference than
    # the libdevice log/sin/cos that tl.log/tl.sin/tl.cos compile to.
    radius = tl.sqrt_rn(-2.0 * tl.log(_uniform(word_radius)))
    angle = _TWO_PI_F32 * _uniform(word_angle)
    return radius * tl.cos(angle), radius * tl.sin(angle)


@triton.jit
def _rademacher(word):
    return tl.where((word >> 31) != 0, -1.0, 1.0)


@triton.jit
def tangent_tile(stream_base, key_lo, key_hi, step, tangent_id, GAUSSIAN: tl.constexpr, ROWS: tl.constexpr):
    """float32 tangent of stream indices stream_base + 4 r + c as a [ROWS, 4] tile; stream_base % 4 == 0.

    key_lo, key_hi, step, tangent_id are uint32 scalars (the counter's and key's words).
    """
    q = (stream_base >> 2) + tl.arange(0, ROWS).to(tl.int64)
    w0, w1, w2, w3 = _philox4x32_10(q.to(tl.uint32), (q >> 32).to(tl.uint32), step, tangent_id, key_lo, key_hi)
    if GAUSSIAN:
        x0, x1 = _box_muller(w0, w1)
        x2, x3 = _box_muller(w2, w3)
    else:
        x0 = _rademacher(w0)
        x1 = _rademacher(w1)
        x2 = _rademacher(w2)
        x3 = _rademacher(w3)
    # tl.join adds a new last dimension, so the outer join's operand is the last index: [r, j, i] holds
    # word 2 j + i and the row-major reshape puts word c in column c. Selecting columns with tl.where
    # instead made Triton 3.6 redo each row's Philox and Box-Muller for every column: four times the
    # code and, on sm_90, 128 registers plus spills (float32) or 155 (bfloat16) instead of 64.
    return tl.reshape(tl.join(tl.join(x0, x2), tl.join(x1, x3)), [ROWS, 4])


@triton.jit
def to_storage(x, DTYPE: tl.constexpr):
    """Rounds ``x`` (float32, or float64 for float64 storage) to DTYPE, to nearest even as torch does.

    float32 -> bfloat16 is rounded by hand because Triton's interpreter truncates that conversion
    (compiled Triton rounds to nearest even); NaN becomes torch's quiet NaN 0x7FC0.
    """
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = tl.where(x != x, 0x7FC0, (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DTYPE)


@triton.jit(do_not_specialize=["key_lo", "key_hi", "step", "tangent_id"])
def _fill_tangent_kernel(out, numel, stream_base, key_lo, key_hi, step, tangent_id,
                         LEAD: tl.constexpr, GAUSSIAN: tl.constexpr, ROWS: tl.constexpr,
                         STEP_IN_MEMORY: tl.constexpr = False):
    # Program b covers stream indices stream_base + [b * 4 ROWS, (b + 1) * 4 ROWS), stream_base being
    # the offset rounded down to a multiple of 4; out element j sits LEAD positions later in the stream.
    # LEAD is a constexpr so that, when it is 0, the compiler sees aligned, vectorisable stores.
    # STEP_IN_MEMORY: step points to the int64 step counter on the device (read there: no host sync).
    first = tl.program_id(0).to(tl.int64) * (4 * ROWS)
    if STEP_IN_MEMORY:
        step_word = tl.load(step).to(tl.uint32)  # the counter modulo 2^32, as the stream takes it
    else:
        step_word = step.to(tl.uint32, bitcast=True)
    u = tangent_tile(stream_base + first, key_lo.to(tl.uint32, bitcast=True), key_hi.to(tl.uint32, bitcast=True),
                     step_word, tangent_id.to(tl.uint32, bitcast=True), GAUSSIAN, ROWS)
    j = first - LEAD + 4 * tl.arange(0, ROWS)[:, None] + tl.arange(0, 4)[None, :]
    mask = j < numel
    if LEAD:
        mask = mask & (j >= 0)
    tl.store(out + j, to_storage(u, out.dtype.element_ty), mask=mask)


def device_of(tensor: torch.Tensor):
    """Makes ``tensor``'s CUDA device current: Triton launches on the current device."""
    return torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()


def check_distribution(distribution: int) -> None:
    if distribution not in (reference.GAUSSIAN, reference.RADEMACHER):
        raise ValueError(f"distribution must be {reference.GAUSSIAN} (gaussian) or {reference.RADEMACHER} "
                         f"(rademacher), got {distribution}")


def fill_tangent_at_step_(out: torch.Tensor, seed: int, step: torch.Tensor, tangent_id: int, offset: int,
                          distribution: int) -> None:
    """``fill_tangent_`` at the step held by ``step``, a 0-dim int64 tensor on ``out``'s device (read by the
    kernel: no host synchronisation, so CUDA graphs replay it) or on the CPU."""
    if step.dtype != torch.int64 or step.numel() != 1:
        raise ValueError(f"step must be an int64 tensor of one element (the step counter), got {step.dtype} of "
                         f"shape {tuple(step.shape)}")
    if (step.device.type == "cpu" and not _COMPILE_ONLY[0]) or INTERPRET:
        fill_tangent_(out, seed, int(step), tangent_id, offset, distribution)
    elif step.device != out.device:
        raise ValueError(f"step must be on {out.device} like out, or on the CPU, got {step.device}")
    else:
        fill_tangent_(out, seed, step, tangent_id, offset, distribution)


def fill_tangent_(out: torch.Tensor, seed: int, step: int | torch.Tensor, tangent_id: int, offset: int,
                  distribution: int) -> None:
    """Writes the tangent of ``out``'s elements (flat order, stream index offset + j) into ``out``.

    Same contract as reference.fill_tangent_: float32 values, cast to ``out``'s dtype. ``step`` may be a
    device tensor (see fill_tangent_at_step_).
    """
    check_distribution(distribution)
    if out.dtype not in TL_DTYPES:
        raise TypeError(f"out must be float32, float64, bfloat16 or float16, got {out.dtype}")
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")
    if not device_path(out) and not INTERPRET:
        raise ValueError(f"the Triton backend runs on CUDA tensors (or on CPU tensors with TRITON_INTERPRET=1 set "
                         f"before importing fgfw.triton), got out on {out.device}")
    if out.numel() == 0:
        return
    if not out.is_contiguous():
        dense = torch.empty(out.shape, dtype=out.dtype, device=out.device)
        fill_tangent_(dense, seed, step, tangent_id, offset, distribution)
        out.copy_(dense)
        return
    lead = offset % 4
    key_lo, key_hi = key_words(seed)
    grid = (triton.cdiv(out.numel() + lead, BLOCK),)
    # No FMA contraction, as in the step kernel, so a tangent has the same bits from either kernel.
    in_memory = isinstance(step, torch.Tensor)
    with device_of(out):
        _fill_tangent_kernel[grid](out, out.numel(), offset - lead, key_lo, key_hi,
                                   step if in_memory else as_int32(step), as_int32(tangent_id), LEAD=lead,
                                   GAUSSIAN=distribution == reference.GAUSSIAN, ROWS=ROWS, STEP_IN_MEMORY=in_memory,
                                   num_warps=4, enable_fp_fusion=False)
