"""The fused attention JVP (fgfw.triton.attention_jvp) against torch.func.jvp of F.scaled_dot_product_attention on
the math backend in float64, and the lean engine's choice between it and the chunked rule (lean.AttentionJvp).

Without a GPU the kernel runs in Triton's interpreter on CPU tensors, small: at most 64 rows, head dims 16 and 32,
blocks of 16 so that the online softmax streams over several key blocks and a partial last one. With a GPU the
same tests run compiled on CUDA tensors, and the GPU test checks sequence 2048 and that memory is linear in it.
"""
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

# set before fgfw.triton is imported, as in test_triton.py (Triton chooses to interpret when a kernel is defined)
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")

from fgfw import lean  # noqa: E402
from fgfw import triton as fgfw_triton  # noqa: E402
from fgfw.triton import attention_jvp as kernel  # noqa: E402

if not fgfw_triton.is_available():
    pytest.skip("Triton kernels cannot run here: no CUDA device, and fgfw.triton was imported before "
                "TRITON_INTERPRET=1 was set", allow_module_level=True)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# float32: the kernel sums at most a few hundred float32 products per output in another order than the float64
# reference (about 1e-6 relative here, 5e-7 measured); 1e-5 leaves room, and a wrong term (a missing rescale or
# rowsum) is off by O(1). On a GPU float32 multiplies in IEEE float32 (torch's default: no TF32).
# bfloat16 / float16: the inputs are rounded first (the reference gets the rounded values), so the error is the
# kernel's own: p and p dS rounded to the dtype before their products with V (2^-9 relative for bfloat16) and the
# outputs rounded (2^-9; the interpreter truncates, 2^-8): a few bfloat16 ulps at values up to 3, 2.3e-2 measured
# for the tangent in bfloat16 (1e-3 in float16, 10 bits instead of 7).
# TF32 (float32 where torch.backends.cuda.matmul.allow_tf32, as the lean engine takes the kernel on a GPU) rounds
# both factors to 10 mantissa bits (about 1e-3 relative per product); scores of 64-term sums, then p dS and the
# products with V chain three such roundings: 1e-2 at values of order 1
TF32_TOL = dict(rtol=1e-2, atol=1e-2)
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=3e-2, atol=3e-2),
       torch.float16: dict(rtol=5e-3, atol=5e-3)}


def _operands(batch, heads, q_len, k_len, head_dim, dtype, seed=0):
    """query, key, value and their tangents, of order 1, already rounded to ``dtype``, in float64 for the
    reference and ``dtype`` on DEVICE for the kernel."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(batch, heads, q_len, head_dim), (batch, heads, k_len, head_dim), (batch, heads, k_len, head_dim)] * 2
    exact = [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype).double() for s in shapes]
    return exact, [x.to(dtype).to(DEVICE) for x in exact]


def _reference(query, key, value, query_t, key_t, value_t, is_causal=False, scale=None):
    """(O, dO) by torch.func.jvp of torch's own attention (math backend), absent tangents as zeros."""
    tangents = tuple(torch.zeros_like(p) if t is None else t for p, t in ((query, query_t), (key, key_t),
                                                                          (value, value_t)))
    with sdpa_kernel(SDPBackend.MATH):
        return torch.func.jvp(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=is_causal,
                                                                             scale=scale), (query, key, value), tangents)


def _check(out, expected, dtype, tol=None):
    assert out.dtype == dtype and out.device.type == DEVICE.type
    torch.testing.assert_close(out.double().cpu(), expected.cpu(), **(tol or TOL[dtype]))


# (causal, query length, key length, tangents present): lengths not multiples of the 16-row blocks, query length
# below and above the key length (causal is top-left aligned, as torch's is_causal), each tangent alone and all
CASES = [(False, 37, 37, "qkv"), (True, 37, 37, "qkv"), (False, 20, 45, "qkv"), (False, 45, 20, "qkv"),
         (True, 20, 45, "qkv"), (True, 45, 20, "qkv"), (False, 37, 29, "q"), (True, 37, 37, "k"),
         (False, 37, 29, "v"), (True, 37, 37, "kv"), (False, 16, 16, "")]


@pytest.mark.parametrize("causal,q_len,k_len,tangents", CASES)
def test_triton_attention_jvp_matches_torch(causal, q_len, k_len, tangents):
    exact, inputs = _operands(2, 2, q_len, k_len, 32, torch.float32)
    present = lambda xs: [x if name in tangents else None for name, x in zip("qkv", xs[3:])]
    expected = _reference(*exact[:3], *present(exact), is_causal=causal)
    out, out_t = kernel.attention_jvp(*inputs[:3], *present(inputs), is_causal=causal, block_m=16, block_n=16)
    _check(out, expected[0], torch.float32)
    _check(out_t, expected[1], torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_triton_attention_jvp_half_precision(dtype, causal):
    exact, inputs = _operands(1, 2, 45, 45, 16, dtype, seed=1)
    expected = _reference(*exact, is_causal=causal)
    out, out_t = kernel.attention_jvp(*inputs, is_causal=causal, block_m=16, block_n=16)
    _check(out, expected[0], dtype)
    _check(out_t, expected[1], dtype)


def test_triton_attention_jvp_default_blocks_scale_and_layouts():
    """The launcher's own blocks (one partial block here), an explicit scale, heads split off a fused projection
    (strided views), and inputs without a batch dim (3-D)."""
    gen = torch.Generator().manual_seed(2)
    packed = torch.randn(2, 50, 3, 2, 16, generator=gen, dtype=torch.float64)  # (batch, length, qkv, heads, dim)
    packed_t = torch.randn(packed.shape, generator=gen, dtype=torch.float64)
    heads = lambda x: [x[:, :, i].transpose(1, 2) for i in range(3)]  # (batch, heads, length, dim) views
    expected = _reference(*heads(packed), *heads(packed_t), is_causal=True, scale=0.3)
    out, out_t = kernel.attention_jvp(*heads(packed.float().to(DEVICE)), *heads(packed_t.float().to(DEVICE)),
                                      is_causal=True, scale=0.3)
    _check(out, expected[0], torch.float32)
    _check(out_t, expected[1], torch.float32)
    exact, inputs = _operands(1, 3, 20, 24, 16, torch.float32, seed=3)
    expected = _reference(*(x[0] for x in exact))
    out, out_t = kernel.attention_jvp(*(x[0] for x in inputs))
    _check(out, expected[0], torch.float32)
    _check(out_t, expected[1], torch.float32)


def test_triton_attention_jvp_refuses_what_it_cannot_take():
    x = torch.zeros(1, 1, 8, 16, device=DEVICE)
    with pytest.raises(ValueError, match="head dims"):
        kernel.attention_jvp(x[..., :12], x[..., :12], x[..., :12], None, None, None)
    with pytest.raises(ValueError, match="one dtype"):
        kernel.attention_jvp(x.double(), x.double(), x.double(), None, None, None)
    with pytest.raises(ValueError, match="query_t"):
        kernel.attention_jvp(x, x, x, x[..., :4, :], None, None)


# -- which inputs take the fused kernel ---------------------------------------------------------------------------
@pytest.fixture
def fused_here(monkeypatch):
    """The lean rule takes the fused kernel for tensors on DEVICE (the CPU runs it in Triton's interpreter), and
    float32 as TF32 may take it (the interpreter multiplies in float32 whatever the precision asked)."""
    monkeypatch.setattr(lean, "_FUSED_ATTENTION_DEVICES", {"cuda", DEVICE.type})
    calls = []
    launcher = kernel.attention_jvp
    monkeypatch.setattr(kernel, "attention_jvp", lambda *a, **k: calls.append(a[0].shape) or launcher(*a, **k))
    allow_tf32 = torch.backends.cuda.matmul.allow_tf32  # a property of torch's module: monkeypatch cannot set it
    torch.backends.cuda.matmul.allow_tf32 = True
    yield calls
    torch.backends.cuda.matmul.allow_tf32 = allow_tf32


def test_attention_jvp_dispatch_on_cpu_is_the_chunked_rule():
    x = torch.zeros(1, 2, 8, 16)
    assert not lean.fused_attention_jvp_applies(x, x, x, None, x, x, x)  # CPU tensors: the exact chunked rule


def test_triton_attention_jvp_dispatch(fused_here, monkeypatch):
    applies = lean.fused_attention_jvp_applies
    x = torch.zeros(1, 2, 8, 64, device=DEVICE)
    half = x.bfloat16()
    assert applies(x, x, x, None, x, None, None)
    assert applies(half, half, half, None, half, half, half)
    assert applies(half[0], half[0], half[0], None)  # no batch dim
    assert applies(half[..., :16], half[..., :16], half[..., :16], None)
    wide = torch.zeros(1, 2, 8, 128, device=DEVICE)
    assert applies(wide.half(), wide.half(), wide.half(), None)
    assert not applies(wide, wide, wide, None)  # float32 at head dim 128 spills on sm_90
    assert not applies(x, x, x, torch.zeros(8, 8, device=DEVICE))  # a float mask
    assert not applies(x, x, x, torch.ones(8, 8, dtype=torch.bool, device=DEVICE))  # a bool mask
    odd = torch.zeros(1, 2, 8, 48, device=DEVICE).bfloat16()
    assert not applies(odd, odd, odd, None)  # head dim not a power of two
    tiny = torch.zeros(1, 2, 8, 8, device=DEVICE).bfloat16()
    assert not applies(tiny, tiny, tiny, None)  # below tl.dot's 16
    assert not applies(x.double(), x.double(), x.double(), None)
    assert not applies(x, half, half, None)  # mixed dtypes
    assert not applies(x, x[:, :1], x[:, :1], None)  # broadcast heads
    assert not applies(x, x[..., :0, :], x[..., :0, :], None)  # no keys
    many = half[:1, :1].expand(65536, 1, 8, 64)
    assert not applies(many, many, many, None)  # more batch x heads than the grid's second axis holds
    torch.backends.cuda.matmul.allow_tf32 = False  # the fixture restores it
    assert not applies(x, x, x, None)  # exact float32 products: the chunked rule
    assert applies(half, half, half, None)
    monkeypatch.setattr(lean, "_FUSED_ATTENTION_DEVICES", {"cuda"})
    assert applies(half, half, half, None) == (DEVICE.type == "cuda")


def test_triton_attention_jvp_in_the_lean_engine(fused_here):
    """The one-tangent engine takes O and dO from one launch; Function.apply's jvp (grad mode on) its dO; vmap over
    jvp (the batched engine) the chunked rule, whose batched tangents no kernel can read."""
    import torch.autograd.forward_ad as fwAD

    exact, inputs = _operands(1, 2, 24, 24, 16, torch.float32, seed=4)
    expected = _reference(*exact, is_causal=True)
    tol = TF32_TOL if DEVICE.type == "cuda" else None  # the interpreter multiplies in float32 whatever is asked
    with torch.no_grad(), fwAD.dual_level():
        duals = [fwAD.make_dual(p, t) for p, t in zip(inputs[:3], inputs[3:])]
        out, out_t = fwAD.unpack_dual(lean.scaled_dot_product_attention(*duals, is_causal=True))
    assert len(fused_here) == 1
    _check(out, expected[0], torch.float32, tol)
    _check(out_t, expected[1], torch.float32, tol)
    with torch.enable_grad(), fwAD.dual_level():
        duals = [fwAD.make_dual(p, t) for p, t in zip(inputs[:3], inputs[3:])]
        out, out_t = fwAD.unpack_dual(lean.scaled_dot_product_attention(*duals, is_causal=True))
    assert len(fused_here) == 2
    _check(out_t, expected[1], torch.float32, tol)

    tangents = [torch.stack([t, 2 * t]) for t in inputs[3:]]
    jvp = lambda *ts: torch.func.jvp(lambda q, k, v: lean.scaled_dot_product_attention(q, k, v, is_causal=True),
                                     tuple(inputs[:3]), ts)[1]
    out_t = torch.func.vmap(jvp)(*tangents)
    assert len(fused_here) == 2
    _check(out_t[0], expected[1], torch.float32, tol)
    torch.testing.assert_close(out_t[1], 2 * out_t[0])


def test_triton_attention_jvp_in_a_lean_pass(fused_here):
    """c = <grad f, u> of causal self-attention (nn.MultiheadAttention, head dim 16) by the lean engine through the
    fused kernel, against torch.func.jvp of the same model in float64 on the math backend."""
    torch.manual_seed(7)
    attn = nn.MultiheadAttention(32, 2, batch_first=True).double()  # in training mode: not MHA's own fast path
    x = torch.randn(2, 24, 32, dtype=torch.float64)
    mask = torch.ones(24, 24, dtype=torch.bool).triu(1)
    loss = lambda call, x: call(x, x, x, attn_mask=mask.to(x.device), need_weights=False,
                                is_causal=True)[0].square().mean()
    names = [name for name, _ in attn.named_parameters()]
    tangents = [torch.randn_like(p) for p in attn.parameters()]
    with sdpa_kernel(SDPBackend.MATH):
        functional = lambda *ps: loss(lambda *a, **k: torch.func.functional_call(attn, dict(zip(names, ps)), a, k), x)
        _, expected = torch.func.jvp(functional, tuple(p.detach() for p in attn.parameters()), tuple(tangents))
    model = attn.float().to(DEVICE)
    tangents = [t.float().to(DEVICE) for t in tangents]
    _, c = lean.lean_directional_derivative(model, list(model.parameters()), tangents.__getitem__,
                                            lambda: loss(model, x.float().to(DEVICE)))
    assert len(fused_here) == 1
    # float32 against float64: 1e-4 relative; TF32 on a GPU (TF32_TOL's reasons): 2e-2
    assert abs(float(c) - float(expected)) <= (2e-2 if DEVICE.type == "cuda" else 1e-4) * abs(float(expected))


# -- on a GPU: sequence 2048, memory linear in it -----------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (compiled Triton at sequence 2048)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_attention_jvp_cuda_long_sequence(dtype):
    """The kernels the lean engine launches: bfloat16, and float32 as TF32 (in IEEE float32 it spills)."""
    exact, inputs = _operands(1, 2, 2048, 2048, 64, dtype, seed=5)
    allow_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        for causal in (False, True):
            expected = _reference(*(x.to(DEVICE) for x in exact), is_causal=causal)
            out, out_t = kernel.attention_jvp(*inputs, is_causal=causal)
            tol = TF32_TOL if dtype == torch.float32 else None
            _check(out, expected[0], dtype, tol)
            _check(out_t, expected[1], dtype, tol)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allow_tf32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (peak CUDA memory)")
def test_triton_attention_jvp_cuda_memory_is_linear_in_the_sequence():
    peaks = {}
    for length in (1024, 2048):
        _, inputs = _operands(8, 12, length, length, 64, torch.bfloat16, seed=6)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        kernel.attention_jvp(*inputs, is_causal=True)
        torch.cuda.synchronize()
        peaks[length] = torch.cuda.max_memory_allocated() - base
        # the two outputs, no (L x L) buffer: 8 x 12 heads of 2048 x 2048 bfloat16 scores would be 800 MB
        assert peaks[length] <= 2 * inputs[0].nbytes + (1 << 20)
    assert peaks[2048] < 3 * peaks[1024]
