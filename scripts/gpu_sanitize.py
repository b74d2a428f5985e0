"""The CUDA kernels on the layouts most likely to read or write out of bounds, for compute-sanitizer.

Launches only fgfw's kernels (no reference, no comparison: the test suite compares; under the sanitizer
every launch is slow, so this is a few dozen launches): sizes across a chunk boundary, unaligned views on
the scalar path, 600 tensors over several launches, row balls at the warp-ball limit and one element
over it, the global ball, a single element and empty tensors, NaN directions, every set step (L-infinity,
Lp, k-sparse) in every scope, and fill_tangent_ into strided and offset views. Exits 0 when every launch
returned; compute-sanitizer (memcheck, racecheck) reports what they touched.

  PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck python3 scripts/gpu_sanitize.py
"""
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import kernel_cases as kc  # noqa: E402
import set_cases as sc  # noqa: E402

CUDA = torch.device("cuda")
WARP_BALL = 4096  # csrc/cuda/fw_step.cu kMaxWarpBall


def step(ops, params, moms, grads, **kw):
    kw.setdefault("schedule", (7, 0.1, 0.3))
    kw.setdefault("coeffs", (0.7, -0.2))
    kw.setdefault("radii", [1.0] * len(params))
    kw.setdefault("global_ball", False)
    kw.setdefault("offsets", kc.flat_offsets(params))
    kw.setdefault("seed", 5)
    kw.setdefault("distribution", kc.GAUSSIAN)
    kc.run_step(ops.l1_fw_step_, params, moms, grads, **kw)


def main():
    ops = torch.ops.fgfw
    import fgfw  # noqa: F401  (registers the ops)
    launches = 0
    for dtype in (torch.float32, torch.bfloat16):
        # chunk boundaries and a tail of 1..3 elements
        for n in (1, 4095, 4096, 4097, 65_537):
            params, moms, _ = kc.make_group([(n,)], dtype, momentum=True, grads=False, seed=n, device=CUDA)
            step(ops, params, moms, [])
            step(ops, params, moms, [], global_ball=True, radii=[2.0])
            launches += 2
        # unaligned views: every shift of a flat buffer, forward and backprop gradients
        sizes = [4099, 4101, 3, 10_000, 8]
        buf = torch.randn(sum(sizes) + 8, device=CUDA).to(dtype)
        for shift in (1, 2, 3):
            views, start = [], shift
            for s in sizes:
                views.append(buf[start:start + s])
                start += s
            step(ops, views, [], [], offsets=[1, 3, 5, 7, 9])
            step(ops, views, [], [v.clone() for v in views], offsets=[])
            launches += 2
    # 600 tensors: several launches of the chunks and rows kernels
    rng = random.Random(1)
    shapes = [(rng.randint(1, 300),) for _ in range(600)]
    params, moms, grads = kc.make_group(shapes, torch.float32, momentum=True, grads=True, seed=5, device=CUDA)
    for global_ball in (False, True):
        step(ops, params, moms, grads, global_ball=global_ball, offsets=[],
             radii=[1.0] if global_ball else [1.0] * len(params))
        launches += 1
    # row balls at the warp-ball limit (rows kernel) and one over it (chunks path)
    shapes = [(3, WARP_BALL), (2, WARP_BALL + 1), (WARP_BALL,), (WARP_BALL + 1,), (5, 7)]
    row_numel = [WARP_BALL, WARP_BALL + 1, 0, 0, 7]
    params, moms, _ = kc.make_group(shapes, torch.float32, momentum=True, grads=False, seed=23, device=CUDA)
    step(ops, params, moms, [], radii=kc.row_radii(shapes, row_numel), row_numel=row_numel,
         offsets=[1, 3 * WARP_BALL + 6, 5 * WARP_BALL + 11, 6 * WARP_BALL + 13, 8 * WARP_BALL])
    # single elements, empty tensors, NaN directions
    params = [torch.tensor([0.3], device=CUDA), torch.empty(0, device=CUDA), torch.tensor([[-0.2]], device=CUDA)]
    step(ops, params, [], [], radii=[1.0, 1.0, 1.0])
    nan_grads = [torch.tensor([1.0, float("nan"), 2.0], device=CUDA), torch.tensor([float("nan"), 9.0], device=CUDA)]
    step(ops, [torch.rand(3, device=CUDA), torch.rand(2, device=CUDA)], [], nan_grads, offsets=[], radii=[1.0, 2.0])
    launches += 3
    # every set step in every scope, forward (Gaussian) and backprop gradients
    ops_of = {"linf": ops.linf_fw_step_, "lp": ops.lp_fw_step_, "ksparse": ops.ksparse_fw_step_}
    for kind, param in (("linf", None), ("lp", 3.0), ("ksparse", 3), ("ksparse", 10_000)):
        keyword = sc.SETS[kind][1]
        for scope in sc.SCOPES:
            for source in ("grad", "gaussian"):
                params, moms, grads, coeffs, row_numel, radii, offsets = sc.inputs(torch.float32, True, source, scope,
                                                                                   CUDA)
                gap = torch.zeros((), dtype=torch.float64, device=CUDA)
                ops_of[kind](params, moms, grads, torch.tensor([3.0, 0.2, 0.4], dtype=torch.float64, device=CUDA),
                             coeffs, radii, scope == "global", offsets, 5, kc.GAUSSIAN, gap, row_numel,
                             **({} if keyword is None else {keyword: param}))
                launches += 1
    # fill_tangent_ into a strided view and at an offset
    out = torch.empty(64, 33, device=CUDA)[:, 1:17]
    ops.fill_tangent_(out, 3, 2, 1, 5, kc.GAUSSIAN)
    ops.fill_tangent_(torch.empty(4097, device=CUDA)[1:], 3, 2, 0, 7, kc.RADEMACHER)
    torch.cuda.synchronize()
    print(f"gpu_sanitize: {launches + 2} steps and fills returned")


if __name__ == "__main__":
    main()
