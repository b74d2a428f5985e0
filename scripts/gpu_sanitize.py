"""The fused kernels on the layouts most likely to read or write out of bounds, for compute-sanitizer.

Launches only fgfw's kernels (no reference, no comparison: the test suite compares; under the sanitizer every
launch is slow, so this is a few hundred small launches):

* every fused set (L1, L2, Lp, L-infinity, k-sparse) stepped through the optimizers, with tensor, row and
  global balls, float32 and bfloat16 parameters, backprop gradients (FrankWolfe, momentum) and Gaussian
  tangents (AFGFW), on tensors across a chunk boundary, rows at the rows kernels' limit and one over it, a single
  element and an empty tensor;
* the ops called directly where the optimizers never go: unaligned views (the scalar path), 600 tensors over
  several launches, NaN directions, fill_tangent_ into strided and offset views.

Exits 0 when every launch returned; compute-sanitizer (memcheck, racecheck) reports what they touched.

  PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck python3 scripts/gpu_sanitize.py
  python3 scripts/gpu_sanitize.py --device cpu     # the same calls on the CPU kernels (CI: the script stays current)
"""
import argparse
import random
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import kernel_cases as kc  # noqa: E402
import set_cases as sc  # noqa: E402

WARP_BALL = 4096  # csrc/cuda/l1_fw_step.cu kMaxWarpBall
# Shapes through the optimizers: across a 4096 chunk, rows at the warp-ball limit and one over it, short odd rows,
# one element, an empty tensor.
SHAPES = [(4097,), (2, WARP_BALL), (2, WARP_BALL + 1), (5, 7), (1,), (0,)]


def _sets():
    import fgfw

    return {"l1": lambda scope: fgfw.L1Ball(radius=1.0, scope=scope),
            "l2": lambda scope: fgfw.L2Ball(radius=1.0, scope=scope),
            "lp": lambda scope: fgfw.LpBall(radius=1.0, p=3.0, scope=scope),
            "linf": lambda scope: fgfw.LInfBall(radius=0.1, scope=scope),
            "ksparse": lambda scope: fgfw.KSparsePolytope(radius=0.1, k=3, scope=scope)}


class _Tensors(nn.Module):
    """SHAPES as parameters; the loss <w, theta> with fixed random w (a direction for every element)."""

    def __init__(self, dtype, device, seed):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.weights = nn.ParameterList(
            nn.Parameter((1e-5 * torch.randn(s, generator=gen)).to(dtype).to(device)) for s in SHAPES)
        self.directions = [torch.randn(s, generator=gen).to(device) for s in SHAPES]

    def forward(self):
        return sum((p.float() * w).sum() for p, w in zip(self.weights, self.directions))


def through_optimizers(device, backend) -> int:
    """A step of FrankWolfe (backprop, momentum: made zero, then read and written in the same step) and one of AFGFW
    (two Gaussian tangents, momentum) per set, scope and dtype: one launch of every kernel variant they use, few
    enough for the sanitizer's slowed launches."""
    import fgfw

    steps = 0
    for name, make in _sets().items():
        for scope in ("tensor", "row", "global"):
            for dtype in (torch.float32, torch.bfloat16):
                model = _Tensors(dtype, device, seed=steps)
                opt = fgfw.FrankWolfe(model.parameters(), constraint=make(scope), momentum=0.9, backend=backend)
                model().backward()
                opt.step()
                model = _Tensors(dtype, device, seed=steps + 1)
                opt = fgfw.AFGFW(model, constraint=make(scope), num_tangents=2, tangent="gaussian", seed=5,
                                 backend=backend)
                opt.step(model)
                steps += 2
    return steps


def _step(ops, params, moms, grads, **kw):
    kw.setdefault("schedule", (7, 0.1, 0.3))
    kw.setdefault("coeffs", (0.7, -0.2))
    kw.setdefault("radii", [1.0] * len(params))
    kw.setdefault("global_ball", False)
    kw.setdefault("offsets", kc.flat_offsets(params))
    kw.setdefault("seed", 5)
    kw.setdefault("distribution", kc.GAUSSIAN)
    kc.run_step(ops.l1_fw_step_, params, moms, grads, **kw)


def direct_ops(device) -> int:
    """The ops' edge cases that the optimizers never produce."""
    ops = torch.ops.fgfw
    launches = 0
    for dtype in (torch.float32, torch.bfloat16):
        # unaligned views: every shift of a flat buffer, forward and backprop gradients
        sizes = [4099, 4101, 3, 10_000, 8]
        buf = torch.randn(sum(sizes) + 8, device=device).to(dtype)
        for shift in (1, 2, 3):
            views, start = [], shift
            for s in sizes:
                views.append(buf[start:start + s])
                start += s
            _step(ops, views, [], [], offsets=[1, 3, 5, 7, 9])
            _step(ops, views, [], [v.clone() for v in views], offsets=[])
            launches += 2
    # 600 tensors: several launches of the chunks and rows kernels
    rng = random.Random(1)
    shapes = [(rng.randint(1, 300),) for _ in range(600)]
    params, moms, grads = kc.make_group(shapes, torch.float32, momentum=True, grads=True, seed=5, device=device)
    for global_ball in (False, True):
        _step(ops, params, moms, grads, global_ball=global_ball, offsets=[],
              radii=[1.0] if global_ball else [1.0] * len(params))
        launches += 1
    # NaN directions
    nan_grads = [torch.tensor([1.0, float("nan"), 2.0], device=device),
                 torch.tensor([float("nan"), 9.0], device=device)]
    _step(ops, [torch.rand(3, device=device), torch.rand(2, device=device)], [], nan_grads, offsets=[],
          radii=[1.0, 2.0])
    launches += 1
    # every set step in every scope on the shared cases' shapes (an empty tensor among them)
    ops_of = {"linf": ops.linf_fw_step_, "lp": ops.lp_fw_step_, "ksparse": ops.ksparse_fw_step_}
    for kind, param in (("linf", None), ("lp", 3.0), ("ksparse", 3), ("ksparse", 10_000)):
        for scope in sc.SCOPES:
            for source in ("grad", "gaussian"):
                params, moms, grads, coeffs, row_numel, radii, offsets = sc.inputs(torch.float32, True, source, scope,
                                                                                   device)
                gap = torch.zeros((), dtype=torch.float64, device=device)
                scales = sc.scales_for(scope, device) if kind != "linf" else ()
                ops_of[kind](params, moms, grads, torch.tensor([3.0, 0.2, 0.4], dtype=torch.float64, device=device),
                             coeffs, radii, scope == "global", offsets, 5, kc.GAUSSIAN, gap, row_numel,
                             **sc.set_extra(kind, param, scales))
                launches += 1
    # fill_tangent_ into a strided view and at an offset
    ops.fill_tangent_(torch.empty(64, 33, device=device)[:, 1:17], 3, 2, 1, 5, kc.GAUSSIAN)
    ops.fill_tangent_(torch.empty(4097, device=device)[1:], 3, 2, 0, 7, kc.RADEMACHER)
    return launches + 2


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (for the sanitizer), or cpu: the same calls on the CPU "
                                                         "kernels, which keeps this script current without a GPU")
    parser.add_argument("--backend", help="the optimizers' backend: cuda on a GPU, cpu on the CPU (default), or triton")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    import fgfw  # noqa: F401  (registers the ops)
    from fgfw import _ops

    if _ops.extension_import_error() is not None:
        sys.exit(f"gpu_sanitize: fgfw._C does not import ({_ops.extension_import_error()}): build it first")
    backend = args.backend or device.type
    steps = through_optimizers(device, backend)
    launches = direct_ops(device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    print(f"gpu_sanitize: {steps} optimizer steps ({backend} backend) and {launches} direct op calls returned "
          f"on {device}")


if __name__ == "__main__":
    main()
