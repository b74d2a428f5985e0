"""The primal and tangent of scaled dot-product attention in one flash-style Triton kernel.

``O = softmax(Q K^T s) V`` and its JVP ``dO`` for tangents ``dQ``, ``dK``, ``dV`` (any of them absent), causal
(top-left aligned, as ``F.scaled_dot_product_attention``'s ``is_causal``) or not. The exact chunked rule
``fgfw.lean.AttentionJvp`` is the spec; this kernel never stores a score block beyond registers, so memory is
the inputs and two outputs: linear in the sequence length.

Derivation. Per query row, with scores ``S_j = s q.k_j``, their tangent ``dS_j = s (dq.k_j + q.dk_j)`` and
``p_j = exp(S_j - m)`` for any shift ``m``, ``l = sum_j p_j``, ``P_j = p_j / l``:

    O  = sum_j P_j v_j = acc / l,                       acc = sum_j p_j v_j
    dP_j = P_j (dS_j - sum_k P_k dS_k)                  (softmax's JVP)
    dO = sum_j dP_j v_j + P_j dv_j
       = (sum_j p_j dS_j v_j + p_j dv_j) / l - (sum_j p_j dS_j / l) O
       = acc_t / l - (r / l) O,                         acc_t = sum_j p_j (dS_j v_j + dv_j),  r = sum_j p_j dS_j

``acc``, ``acc_t``, ``r`` and ``l`` are sums of ``p_j`` times terms that do not depend on the shift, so the online
softmax rescales all four by ``exp(m_old - m_new)`` when the running maximum ``m`` grows, as flash attention does
for ``acc`` and ``l``: one pass over the key blocks gives both ``O`` and ``dO``.

Precision: products and sums in float32; bfloat16 / float16 inputs feed the tensor cores in their dtype (``p`` and
``p dS`` are rounded to it before their products with ``V``, as flash attention rounds ``p``); float32 inputs
multiply in IEEE float32, or TF32 where ``torch.backends.cuda.matmul.allow_tf32`` allows it (torch's own rule).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tangent import INTERPRET, device_of, device_path

HEAD_DIMS = (16, 32, 64, 128)  # powers of two that tl.dot takes (at least 16) and the registers hold
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_LOG2_E = tl.constexpr(1.4426950408889634)
# (batch x heads) runs on the grid's second axis, so that a head's query blocks run side by side and share its
# keys and values in L2; CUDA allows this many programs there
_MAX_GRID_Y = 65535


def unsupported(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> str | None:
    """Why the kernel cannot take these operands (shapes (..., L, E), (..., S, E), (..., S, E)), or None."""
    if query.dim() < 2 or key.dim() != query.dim() or value.dim() != query.dim():
        return (f"query, key and value must have one rank of at least 2, got {tuple(query.shape)}, "
                f"{tuple(key.shape)}, {tuple(value.shape)}")
    if not query.shape[:-2] == key.shape[:-2] == value.shape[:-2] or key.shape[-2] != value.shape[-2]:
        return (f"query, key and value must share their batch dims and key and value their length (no "
                f"broadcasting), got {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    if not query.shape[-1] == key.shape[-1] == value.shape[-1] or query.shape[-1] not in HEAD_DIMS:
        return (f"the head dims of query, key and value must be one of {HEAD_DIMS}, got {query.shape[-1]}, "
                f"{key.shape[-1]}, {value.shape[-1]}")
    if query.shape[-2] == 0 or key.shape[-2] == 0:
        return f"the query length and key length must be positive, got {query.shape[-2]} and {key.shape[-2]}"
    if not query.dtype == key.dtype == value.dtype or query.dtype not in DTYPES:
        return f"query, key and value must be one dtype of {DTYPES}, got {query.dtype}, {key.dtype}, {value.dtype}"
    if query.shape[:-2].numel() > _MAX_GRID_Y:
        return f"batch x heads must be at most {_MAX_GRID_Y} (the grid's second axis), got {query.shape[:-2].numel()}"
    if not query.device == key.device == value.device:
        return f"query, key and value must be on one device, got {query.device}, {key.device}, {value.device}"
    return None


def blocks(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(query rows, key rows, warps) per program: tiles whose two float32 accumulators (rows x E each), operands and
    score tiles ptxas keeps in registers on sm_90 without spills (of those tried, with Triton 3.8; fgfw.triton.aot
    checks the ones the lean engine launches). float32 here is TF32 at head dim 64 (``spill_free``)."""
    if dtype == torch.float32:
        return 64, 32, 8
    if head_dim <= 64:
        return 64, 64, 4
    return 64, 16, 8


def spill_free(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the compiled kernel fits in registers on sm_90 for this dtype and head dim: bfloat16 and float16 at
    every head dim; float32 as TF32 (torch.backends.cuda.matmul.allow_tf32) up to head dim 64. float32 as IEEE FMA
    or TF32x3 products spills hundreds of bytes to thousands at every tile size tried (ptxas -v), as does TF32 at
    head dim 128."""
    if dtype != torch.float32:
        return True
    return torch.backends.cuda.matmul.allow_tf32 and head_dim <= 64


# Triton's interpreter (3.8) returns garbage from tl.dot of bfloat16 tiles; there they are multiplied as float32
# after the same rounding to bfloat16. Compiled kernels never take this branch.
_BF16_DOT_AS_F32 = tl.constexpr(INTERPRET)


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr):
    """acc + a @ b, accumulated in float32."""
    if _BF16_DOT_AS_F32 and a.dtype == tl.bfloat16:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _attention_jvp_kernel(query, key, value, query_t, key_t, value_t, out, out_t,
                          q_sb, q_sh, q_sl, k_sb, k_sh, k_sl, v_sb, v_sh, v_sl,
                          qt_sb, qt_sh, qt_sl, kt_sb, kt_sh, kt_sl, vt_sb, vt_sh, vt_sl,
                          o_sb, o_sh, o_sl, ot_sb, ot_sh, ot_sl,
                          heads, q_len, k_len, scale,
                          HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          CAUSAL: tl.constexpr, HAS_QUERY_T: tl.constexpr, HAS_KEY_T: tl.constexpr,
                          HAS_VALUE_T: tl.constexpr, PRECISION: tl.constexpr):
    # program (i, b h): query rows [i BLOCK_M, (i + 1) BLOCK_M) of head h in batch b; rows past q_len and keys past
    # k_len are loaded as zeros, masked out of the softmax, and not stored
    block = tl.program_id(0)
    batch_head = tl.program_id(1)
    b = (batch_head // heads).to(tl.int64)
    h = (batch_head % heads).to(tl.int64)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    row_ok = (rows < q_len)[:, None]
    q = tl.load(query + b * q_sb + h * q_sh + rows[:, None] * q_sl + dims[None, :], mask=row_ok, other=0.0)
    if HAS_QUERY_T:
        q_t = tl.load(query_t + b * qt_sb + h * qt_sh + rows[:, None] * qt_sl + dims[None, :], mask=row_ok,
                      other=0.0)
    key += b * k_sb + h * k_sh
    value += b * v_sb + h * v_sh
    key_t += b * kt_sb + h * kt_sh
    value_t += b * vt_sb + h * vt_sh

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of the scores, in log2 units
    l = tl.zeros([BLOCK_M], tl.float32)
    r = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    acc_t = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    if CAUSAL:  # row i attends to keys 0..i: the blocks past the last row's diagonal hold no weight
        end = tl.minimum(k_len, (block + 1) * BLOCK_M)
    else:
        end = k_len
    for start in range(0, end, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = (cols < k_len)[:, None]
        k = tl.load(key + cols[:, None] * k_sl + dims[None, :], mask=col_ok, other=0.0)
        v = tl.load(value + cols[:, None] * v_sl + dims[None, :], mask=col_ok, other=0.0)
        scores = _dot(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), PRECISION) * (scale * _LOG2_E)
        keep = (cols < k_len)[None, :]
        if CAUSAL:
            keep = keep & (cols[None, :] <= rows[:, None])
        scores = tl.where(keep, scores, float("-inf"))
        # every row keeps key 0 in the first block, so m is finite from then on and no exp2 sees inf - inf
        m_new = tl.maximum(m, tl.max(scores, 1))
        rescale = tl.math.exp2(m - m_new)
        p = tl.math.exp2(scores - m_new[:, None])
        l = l * rescale + tl.sum(p, 1)
        acc = _dot(p.to(v.dtype), v, acc * rescale[:, None], PRECISION)
        acc_t = acc_t * rescale[:, None]
        if HAS_QUERY_T or HAS_KEY_T:
            d_scores = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            if HAS_QUERY_T:
                d_scores = _dot(q_t, tl.trans(k), d_scores, PRECISION)
            if HAS_KEY_T:
                k_t = tl.load(key_t + cols[:, None] * kt_sl + dims[None, :], mask=col_ok, other=0.0)
                d_scores = _dot(q, tl.trans(k_t), d_scores, PRECISION)
            p_d_scores = p * (d_scores * scale)  # 0 where p is: masked keys' finite dS never enter
            r = r * rescale + tl.sum(p_d_scores, 1)
            acc_t = _dot(p_d_scores.to(v.dtype), v, acc_t, PRECISION)
        else:
            r = r * rescale
        if HAS_VALUE_T:
            v_t = tl.load(value_t + cols[:, None] * vt_sl + dims[None, :], mask=col_ok, other=0.0)
            acc_t = _dot(p.to(v_t.dtype), v_t, acc_t, PRECISION)
        m = m_new

    o = acc / l[:, None]
    o_t = acc_t / l[:, None] - (r / l)[:, None] * o
    tl.store(out + b * o_sb + h * o_sh + rows[:, None] * o_sl + dims[None, :], o.to(out.dtype.element_ty),
             mask=row_ok)
    tl.store(out_t + b * ot_sb + h * ot_sh + rows[:, None] * ot_sl + dims[None, :], o_t.to(out_t.dtype.element_ty),
             mask=row_ok)


def _as_4d(x: torch.Tensor) -> torch.Tensor:
    """(..., L, E) as (batch, heads, L, E) with unit stride along E: a view where the strides allow."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 2:
        return x[None, None]
    if x.dim() == 3:
        return x[None]
    return x.reshape(-1, *x.shape[-3:])


def _strides(x: torch.Tensor) -> tuple[int, int, int]:
    return x.stride(0), x.stride(1), x.stride(2)


def attention_jvp(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, query_t: torch.Tensor | None,
                  key_t: torch.Tensor | None, value_t: torch.Tensor | None, is_causal: bool = False,
                  scale: float | None = None, block_m: int | None = None,
                  block_n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(O, dO): ``F.scaled_dot_product_attention(query, key, value, is_causal=is_causal, scale=scale)`` and its
    JVP along the tangents given (None: no tangent), both contiguous in the inputs' dtype, from one kernel.

    ``block_m`` and ``block_n`` (powers of two, at least 16) override the rows per program and per key block
    (``blocks``), so that tests can stream over several blocks of a short sequence."""
    reason = unsupported(query, key, value)
    if reason is not None:
        raise ValueError(f"attention_jvp: {reason}")
    for name, tangent, primal in (("query_t", query_t, query), ("key_t", key_t, key), ("value_t", value_t, value)):
        if tangent is not None and (tangent.shape != primal.shape or tangent.dtype != primal.dtype
                                    or tangent.device != primal.device):
            raise ValueError(f"attention_jvp: {name} must have the shape, dtype and device of its primal "
                             f"{tuple(primal.shape)} {primal.dtype} {primal.device}, got {tuple(tangent.shape)} "
                             f"{tangent.dtype} {tangent.device}")
    if not device_path(query) and not INTERPRET:
        raise ValueError(f"the Triton backend runs on CUDA tensors (or on CPU tensors with TRITON_INTERPRET=1 set "
                         f"before importing fgfw.triton), got query on {query.device}")
    head_dim = query.shape[-1]
    default_m, default_n, warps = blocks(head_dim, query.dtype)
    block_m, block_n = block_m or default_m, block_n or default_n
    scale = head_dim ** -0.5 if scale is None else float(scale)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    out_t = torch.empty_like(out)
    q, k, v, o, o_t = (_as_4d(x) for x in (query, key, value, out, out_t))
    # an absent tangent passes its primal as a placeholder: the HAS_* flags keep the kernel from reading it
    q_t, k_t, v_t = (p if t is None else _as_4d(t) for t, p in ((query_t, q), (key_t, k), (value_t, v)))
    heads, q_len, k_len = q.shape[1], q.shape[2], k.shape[2]
    tf32 = query.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32
    grid = (triton.cdiv(q_len, block_m), q.shape[0] * heads)
    with device_of(query):
        _attention_jvp_kernel[grid](q, k, v, q_t, k_t, v_t, o, o_t, *_strides(q), *_strides(k), *_strides(v),
                                    *_strides(q_t), *_strides(k_t), *_strides(v_t), *_strides(o), *_strides(o_t),
                                    heads, q_len, k_len, scale, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
                                    CAUSAL=bool(is_causal), HAS_QUERY_T=query_t is not None,
                                    HAS_KEY_T=key_t is not None, HAS_VALUE_T=value_t is not None,
                                    PRECISION="tf32" if tf32 else "ieee", num_warps=warps)
    return out, out_t
