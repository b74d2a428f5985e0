"""What every backend's fused set steps (linf_fw_step_, lp_fw_step_, ksparse_fw_step_) are checked with: the
same inputs through the kernel and through fgfw.reference, and the comparison. Used by the CPU, CUDA and
Triton tests (each passes its op and device).

What must agree, and how exactly:
* momentum: bit for bit wherever no transcendental is involved (backprop gradients, Rademacher tangents),
  and for Gaussian tangents when the reference runs on the backend's own tangents (``backend=``: its
  fill_tangent_ in place of reference.tangent; the kernels' log/sin/cos are not torch's, so an ulp of u
  could otherwise flip a selection between near-equal |d|);
* the L-infinity and k-sparse steps: theta bit for bit as well (the vertex is -r sign(d) on a selection, the
  update reference.dense_update's roundings), and the k-sparse scales (integer norm sums); the k-sparse selection
  exactly;
* the Lp steps: within a few ulps of the compute dtype (the norm is a float64 sum in another order, and
  pow differs in the last bit between libraries);
* the gap: a float64 sum in another order, relative tolerance.
"""
import contextlib
import math
import re
from unittest import mock

import pytest
import torch

from fgfw import _ops
from fgfw import reference as ref

GAUSSIAN, RADEMACHER = ref.GAUSSIAN, ref.RADEMACHER

# kind -> (the reference step, the keyword of the set's parameter, values of it to test)
SETS = {
    "linf": (ref.linf_fw_step_, None, [None]),
    "lp": (ref.lp_fw_step_, "p", [2.0, 1.5, 3.0, 1.01]),
    "ksparse": (ref.ksparse_fw_step_, "k", [1, 3, 40, 10_000]),
}
CASES = [(kind, param) for kind, (_, _, params) in SETS.items() for param in params]
SCOPES = ["tensor", "row", "global"]
SOURCES = ["grad", "rademacher", "gaussian"]
# shapes with rows of 33 and 20, a vector, an empty tensor, and a tensor longer than a CPU segment (2^14)
SHAPES = [(7, 33), (5,), (3, 4, 5), (0,), (40_000,)]
ROW_NUMEL = [33, 0, 20, 0, 0]


def set_extra(kind: str, param, scales=()) -> dict:
    """The keywords of a set step after row_numel: none for L-infinity; p or k and the norm feedback's scales (every
    op requires them: a tensor list argument cannot have a default)."""
    keyword = SETS[kind][1]
    return {} if keyword is None else {keyword: param, "scales": list(scales)}


def scales_for(scope: str, device, seed: int = 3) -> list[torch.Tensor]:
    """A norm feedback scale for every ball of the SHAPES (float64, one tensor per shape; one of one element for
    the global ball), each within the band next_norm_scale keeps (1 +- 16 u of float32), not all 1: the step must
    apply them, and write the next."""
    counts = [1] if scope == "global" else [
        (torch.Size(s).numel() // n if n else 1) if scope == "row" else 1 for s, n in zip(SHAPES, ROW_NUMEL)]
    gen = torch.Generator().manual_seed(seed)
    return [(1 + torch.randint(-16, 17, (c,), generator=gen).double() * 2.0 ** -24).to(device) for c in counts]


def radii_for(scope: str) -> list[float]:
    return {"global": [0.3], "row": [0.3] * 7 + [0.2] + [0.4] * 3 + [0.5, 0.25],
            "tensor": [0.3, 0.2, 0.4, 0.5, 0.25]}[scope]


def inputs(dtype, momentum: bool, source: str, scope: str, device, *, ties: bool = False, seed: int = 7):
    """(params, momentum, grads, coeffs, row_numel, radii, offsets) for one step. ``ties``: gradients made of a
    few repeated magnitudes, so that the k-sparse selection must break ties by index."""
    gen = torch.Generator().manual_seed(seed)
    cdt = ref.compute_dtype(dtype)
    params = [((torch.rand(s, generator=gen) * 2 - 1) * 0.01).to(dtype) for s in SHAPES]
    if source == "grad":
        grads = [torch.randn(s, generator=gen) for s in SHAPES]
        if ties:
            grads = [torch.round(g * 2) / 2 for g in grads]
        grads = [g.to(dtype) for g in grads]
    else:
        grads = []
    moms = [torch.randn(s, generator=gen).to(cdt) for s in SHAPES] if momentum else []
    if ties and momentum:
        moms = [torch.round(m * 2) / 2 for m in moms]
    coeffs = (torch.tensor([0.7, -1.1], dtype=torch.float64) if source != "grad"
              else torch.zeros(0, dtype=torch.float64))
    offsets, start = [], 0
    for s in SHAPES:
        offsets.append(start)
        start += -(-torch.Size(s).numel() // 4) * 4
    move = lambda xs: [x.to(device) for x in xs]  # noqa: E731
    return (move(params), move(moms), move(grads), coeffs.to(device), ROW_NUMEL if scope == "row" else [],
            radii_for(scope), offsets)


def backend_tangent(backend: str, kernel_device):
    """reference.tangent as ``backend``'s fill_tangent_ computes it (float32, on the kernel's device)."""
    def tangent(numel, seed, step, tangent_id, offset=0, distribution=GAUSSIAN, device="cpu"):
        out = torch.empty(numel, dtype=torch.float32, device=kernel_device)
        return _ops.fill_tangent_(out, seed, step, tangent_id, offset, distribution, backend).to(device)
    return tangent


def run_set_step(step, kind: str, param, dtype, momentum: bool, source: str, scope: str, device, *,
                 schedule=(3.0, 0.2, 0.4), ties: bool = False, backend: str | None = None):
    """The reference and then ``step`` (an op with the reference's signature) on the same inputs; returns
    [(params, momentum, gap, scales)] for each, on the CPU (scales: the norm feedback's, written by the Lp and
    k-sparse steps; empty for L-infinity). ``backend`` (the step's: 'cpu', 'cuda', 'triton'): with
    Gaussian tangents the reference draws them through that backend's fill_tangent_, so the two steps see
    the same u and must then agree as exactly as with Rademacher ones (assert_set_step_matches(own_tangents))."""
    ref_step, keyword, _ = SETS[kind]
    params, moms, grads, coeffs, row_numel, radii, offsets = inputs(dtype, momentum, source, scope, device,
                                                                    ties=ties)
    scales = scales_for(scope, device) if keyword is not None else []
    own = source == "gaussian" and backend is not None
    runs = []
    for fn in (ref_step, step):
        ps, ms, xs = [p.clone() for p in params], [m.clone() for m in moms], [x.clone() for x in scales]
        gap = torch.full((), float("nan"), dtype=torch.float64, device=device)
        patch = (mock.patch.object(ref, "tangent", backend_tangent(backend, device)) if own and fn is ref_step
                 else contextlib.nullcontext())
        with patch:
            fn(ps, ms, [g.clone() for g in grads], torch.tensor(schedule, dtype=torch.float64, device=device),
               coeffs, radii, scope == "global", offsets, 5, RADEMACHER if source == "rademacher" else GAUSSIAN, gap,
               row_numel, **set_extra(kind, param, xs))
        runs.append(([p.cpu() for p in ps], [m.cpu() for m in ms], float(gap), [x.cpu() for x in xs]))
    return runs


def assert_set_step_matches(runs, kind: str, dtype, source: str, *, own_tangents: bool = False) -> None:
    """``own_tangents``: the runs come from run_set_step(backend=...), so Gaussian steps compare as exactly as
    Rademacher ones."""
    (p_ref, m_ref, gap_ref, *x_ref), (p, m, gap, *x) = runs
    exact_momentum = source != "gaussian" or own_tangents
    for t, (a, b) in enumerate(zip(m, m_ref)):
        if exact_momentum:
            assert torch.equal(a, b), f"momentum[{t}] differs"
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda s: f"momentum[{t}]: {s}")
    cdt = ref.compute_dtype(dtype)
    for t, (a, b) in enumerate(zip(p, p_ref)):
        if kind in ("linf", "ksparse") and exact_momentum:
            assert torch.equal(a, b), f"params[{t}] differs: max {float((a.double() - b.double()).abs().max())}"
        elif source == "gaussian" and not own_tangents:
            # tangents an ulp apart: momentum-close values; k-sparse is not compared this way (it would accept
            # any selection: a near-tie may flip), callers give it own_tangents
            assert kind != "ksparse", "compare k-sparse Gaussian steps on the backend's own tangents"
            torch.testing.assert_close(a.double(), b.double(), rtol=2e-2 if dtype in (torch.bfloat16, torch.float16)
                                       else 1e-4, atol=1e-5, msg=lambda s: f"params[{t}]: {s}")
        elif dtype in (torch.bfloat16, torch.float16):
            # the Lp vertex is an ulp off in the parameter's dtype
            torch.testing.assert_close(a.double(), b.double(), rtol=2e-2, atol=1e-5, msg=lambda s: f"params[{t}]: {s}")
        else:
            eps = torch.finfo(cdt).eps
            torch.testing.assert_close(a, b, rtol=8 * eps, atol=8 * eps * 0.5, msg=lambda s: f"params[{t}]: {s}")
    assert gap == pytest.approx(gap_ref, rel=1e-6 if (source == "gaussian" and not own_tangents) or cdt == torch.float32
                                else 1e-10)
    # the next step's scales: k-sparse's come from integer norm sums (bit for bit); Lp's from float64 sums of powers
    for t, (a, b) in enumerate(zip(x[0] if x else [], x_ref[0] if x_ref else [])):
        if kind == "ksparse" and exact_momentum:
            assert torch.equal(a, b), f"scales[{t}] differs: {a.tolist()} {b.tolist()}"
        else:
            torch.testing.assert_close(a, b, rtol=1e-12, atol=0, msg=lambda s: f"scales[{t}]: {s}")


def check_ksparse_selection_exact(step, device, dtype=torch.float32) -> None:
    """Ties broken by index: with gradients of a few repeated magnitudes, the k-sparse step moves exactly the
    reference's elements (bit for bit), for every scope and several k (5,000: the 40,000-element tensor and the
    global ball select among thousands of equal keys)."""
    for scope in SCOPES:
        for k in (1, 3, 40, 5_000):
            runs = run_set_step(step, "ksparse", k, dtype, False, "grad", scope, device, ties=True)
            for a, b in zip(runs[1][0], runs[0][0]):
                assert torch.equal(a, b), f"scope {scope}, k {k}"


def check_nonfinite_directions(step, device, kind: str, param) -> None:
    """NaN and infinite directions give the reference's values, NaN where it has NaN (torch.sign(NaN) is 0: a
    NaN direction's L-infinity or k-sparse vertex element is 0, its gap NaN), in every scope. The optimizers
    refuse such steps before they run (check_finite); the op itself must still not disagree with its spec."""
    ref_step, keyword, _ = SETS[kind]
    extra = set_extra(kind, param)
    for scope in SCOPES:
        for bad in (float("nan"), float("inf")):
            params, _, grads, coeffs, row_numel, radii, offsets = inputs(torch.float32, False, "grad", scope, device)
            grads[0].view(-1)[5] = bad  # row 0 of the first matrix
            grads[2].view(-1)[-1] = -bad
            outs = []
            for fn in (ref_step, step):
                ps = [p.clone() for p in params]
                gap = torch.zeros((), dtype=torch.float64, device=device)
                fn(ps, [], grads, torch.tensor([1.0, 0.2, 0.0], dtype=torch.float64, device=device), coeffs, radii,
                   scope == "global", offsets, 5, GAUSSIAN, gap, row_numel, **extra)
                outs.append(([p.cpu() for p in ps], float(gap)))
            for t, (a, b) in enumerate(zip(outs[1][0], outs[0][0])):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, equal_nan=True,
                                           msg=lambda s: f"{kind} {scope} {bad}: params[{t}]: {s}")
            assert math.isnan(outs[0][1]) == math.isnan(outs[1][1]), (kind, scope, bad, outs[0][1], outs[1][1])


def check_errors_name_the_op(step, name: str, extra: dict, device) -> None:
    """An argument error of a step op starts with the op's name (they share one argument check), and nothing
    moves."""
    p = [torch.zeros(4, device=device)]
    schedule = torch.tensor([1.0, 0.1, 0.0], dtype=torch.float64, device=device)
    coeffs = torch.zeros(0, dtype=torch.float64, device=device)
    gap = torch.zeros((), dtype=torch.float64, device=device)
    grads = [torch.ones(4, device=device)]
    with pytest.raises(RuntimeError, match=re.escape(f"{name}: momentum[0] must have dtype")):
        step(p, [torch.zeros(4, dtype=torch.float64, device=device)], grads, schedule, coeffs, [1.0], False, [0], 0,
             GAUSSIAN, gap, [], **extra)
    with pytest.raises(RuntimeError, match=re.escape(f"{name}: radii must hold one radius per ball")):
        step(p, [], grads, schedule, coeffs, [1.0, 2.0], False, [0], 0, GAUSSIAN, gap, [], **extra)
    assert torch.equal(p[0].cpu(), torch.zeros(4))


# Directions near the limits of their dtype: the largest finite values, the smallest normal ones and subnormals.
EXTREME_MAGNITUDES = {torch.float64: (1.7976931348623157e308, 1e308, 2.2250738585072014e-308, 4e-320),
                      torch.float32: (3.4028234663852886e38, 1.1754943508222875e-38, 1e-45)}


def check_lp_directions_near_the_limits(step, device) -> None:
    """The Lp step of directions whose every |d_i| is near the largest or the smallest value of the dtype: the
    reference's vertex, -r sign(d) n^(-1/p) for n equal |d_i| (x = |d| / max|d| is 1 everywhere, ||x||_q = n^(1/q)),
    and the kernel's within the Lp tolerance. Before, the compiled CPU step scaled by 1 / (max|d| ||x||_q), which
    overflows to a zero vertex (s = 0, gap 0) for float64 |d| ~ 1e308 and is infinite for subnormal |d|."""
    alpha, radius, n = 0.5, 0.7, 8
    for dtype, magnitudes in EXTREME_MAGNITUDES.items():
        cdt = ref.compute_dtype(dtype)
        rtol = 8 * torch.finfo(cdt).eps
        for magnitude in magnitudes:
            grad = torch.full((n,), magnitude, dtype=dtype)
            grad[3] = -grad[3]
            grad[6] = -grad[6]
            for p in (2.0, 1.5, 3.0, 1.01):
                outs = []
                for fn in (ref.lp_fw_step_, step):
                    params = [torch.zeros(n, dtype=dtype, device=device)]
                    gap = torch.full((), float("nan"), dtype=torch.float64, device=device)
                    fn(params, [], [grad.to(device)], torch.tensor([1.0, alpha, 0.0], dtype=torch.float64, device=device),
                       torch.zeros(0, dtype=torch.float64, device=device), [radius], False, [], 0, GAUSSIAN, gap, [],
                       **set_extra("lp", p))
                    outs.append((params[0].cpu().double(), float(gap)))
                expected = -alpha * radius * torch.sign(grad.double()) * n ** (-1 / p)
                where = f"{dtype}, |d| = {magnitude:g}, p = {p}"
                torch.testing.assert_close(outs[0][0], expected, rtol=rtol, atol=0, msg=lambda s: f"reference, {where}: {s}")
                torch.testing.assert_close(outs[1][0], outs[0][0], rtol=rtol, atol=0, msg=lambda s: f"kernel, {where}: {s}")
                # <d, -s> = n |d| r n^(-1/p): finite, or inf as the reference's float64 sum overflows
                assert outs[1][1] == pytest.approx(outs[0][1], rel=1e-6), where
