"""Every Triton kernel variant the fused steps can launch, compiled ahead of time for a GPU without one.

A GPU run found kernels that a newer Triton compiled and an older one did not (a bitcast it refused, spills on
sm_90), in variants no test had compiled. Here the launchers themselves run, in ``compile_only`` mode, over a
matrix of the arguments the optimizers and the op API pass (``launch_cases``): every set, parameter dtype,
direction (backprop or forward gradient, Gaussian or Rademacher tangents, with and without momentum), ball
layout (tensor, rows of every tile width, global; aligned or not), the schedule with its skip element (the
optimizers' default, check_finite: SKIPPABLE kernels) and without, the unconstrained groups' gradient step and the
tangent fills, and the lean engine's fused attention JVP (``_attention_plan``). Each launch compiles
for the target instead of running, exactly as it would specialise on a GPU (constexprs, the alignment of the
CPU tensors' addresses standing for device addresses, integers of 1), and each distinct kernel is then checked
with ptxas's register and spill report (``check``).

    python -m fgfw.triton.aot --capability 90 --max-registers 128 --jobs 2 --report aot.json

Exits non-zero when a variant fails to compile, spills, or uses more registers than allowed. It runs in a
process without ``TRITON_INTERPRET`` (the interpreter's kernels do not compile). Compiled kernels land in
Triton's cache (``TRITON_CACHE_DIR``) and the ptxas reports in ``--report-cache``, so a second run with
unchanged kernels only replays the launchers.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Callable, Iterator

import torch
import triton

from .. import reference
from . import attention_jvp, gradient_step, ksparse_fw_step, l1_fw_step, linf_fw_step, lp_fw_step, tangent

CAPABILITY = 90  # H100 / H200
# sm_90 has 64K 32-bit registers per SM: up to 128 per thread keeps two 8-warp step programs on an SM at once,
# which the memory-bound step needs to hide latency.
MAX_REGISTERS = 128
# Compute-bound kernels that hold their tiles in registers: the attention JVP keeps two float32 accumulators and
# the score tiles of a 64-row block live across its loop and runs one or two programs per SM, as flash attention
# kernels do; only spills fail it.
REGISTER_LIMITS = {"_attention_jvp_kernel": 255}
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
# (name, gradient or forward gradient, Gaussian tangents, momentum)
DIRECTIONS = (("backprop", True, False, False), ("backprop_momentum", True, False, True),
              ("rademacher", False, False, False), ("rademacher_momentum", False, False, True),
              ("gaussian", False, True, False), ("gaussian_momentum", False, True, True))
# One p per branch of the Lp kernels' powers (set_step._pow of q, q - 1 and 1/q): p = 2 (q = 2, q - 1 = 1,
# 1/q = 1/2), p = 3 (q - 1 = 1/2), p = 1.5 (q - 1 = 2), p = 1.01 (the general exp-log power everywhere).
LP_EXPONENTS = (2.0, 3.0, 1.5, 1.01)


class _CompileOnlyDriver:
    """Triton's driver as far as compiling needs it: the target, a device index and a stream."""

    def __init__(self, target):
        self.target = target

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


@dataclasses.dataclass
class Compiled:
    """One distinct compiled kernel: its name, options, constexprs, the first launch case that made it, its PTX."""
    name: str
    num_warps: int
    constants: dict
    case: str
    ptx: str
    hash: str


@contextlib.contextmanager
def compile_only(capability: int = CAPABILITY) -> Iterator[dict[str, Compiled]]:
    """Launches of Triton kernels compile for sm_``capability`` and return without running. Yields (seen, current):
    seen collects the {kernel hash: Compiled} of every distinct kernel launched inside, each tagged with
    current["case"] at its first launch."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    if tangent.INTERPRET:
        raise RuntimeError("compile_only needs compiled kernels: run it in a process without TRITON_INTERPRET=1")
    seen: dict[str, Compiled] = {}
    current = {"case": ""}
    run = JITFunction.run

    def compile_instead(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        if kernel.hash not in seen:
            constants = {k: getattr(v, "name", v) for k, v in kwargs.items() if k.isupper()}
            seen[kernel.hash] = Compiled(kernel.name, kernel.metadata.num_warps, constants, current["case"],
                                         kernel.asm["ptx"], kernel.hash)
        return kernel

    previous = driver._active  # None, or a driver already made; reset_active would make one, and fails without a GPU
    driver.set_active(_CompileOnlyDriver(GPUTarget("cuda", capability, 32)))
    JITFunction.run = compile_instead
    tangent._COMPILE_ONLY[0] = True
    try:
        yield seen, current
    finally:
        tangent._COMPILE_ONLY[0] = False
        JITFunction.run = run
        driver._active = previous


# -- the launch matrix --------------------------------------------------------------------------------------------
def _tensor(numel: int, dtype: torch.dtype, aligned: bool) -> torch.Tensor:
    """A tensor of ``numel`` elements whose address is 16-byte aligned, or (not ``aligned``) one element past an
    aligned one, as a view into a parameter buffer can be."""
    if aligned:
        return torch.zeros(numel, dtype=dtype)
    return torch.zeros(numel + 1, dtype=dtype)[1:]


def _schedule(skippable: bool) -> torch.Tensor:
    """A step's schedule: (step, alpha, gamma, skip) as the optimizers pass it with check_finite (their default;
    the kernels read the skip on the device), or (step, alpha, gamma) without."""
    return torch.tensor([3.0, 0.25, 0.5, 0.0] if skippable else [3.0, 0.25, 0.5], dtype=torch.float64)


def _step_args(shapes: list[tuple[int, int]], dtype: torch.dtype, direction: tuple, aligned: bool,
               global_ball: bool, skippable: bool = True) -> dict:
    """The arguments of a fused step over tensors of ``shapes`` ((rows, row length); row length 0 for a tensor
    ball), as the optimizers pass them: stream offsets at multiples of 4, momentum in the compute dtype,
    gradients in the parameters' dtype, two tangents, the schedule with its skip element (``skippable``) or
    without."""
    _, has_grad, gaussian, has_momentum = direction
    compute = reference.compute_dtype(dtype)
    params = [_tensor(rows * max(n, 1), dtype, aligned) for rows, n in shapes]
    offsets, start = [], 0
    for p in params:
        offsets.append(start)
        start += -(-p.numel() // 4) * 4
    row_numel = [0 if global_ball else n for _, n in shapes]
    balls = 1 if global_ball else sum(rows if n else 1 for rows, n in shapes)
    args = dict(params=params, momentum=[_tensor(p.numel(), compute, aligned) for p in params] if has_momentum else [],
                grads=[_tensor(p.numel(), dtype, aligned) for p in params] if has_grad else [],
                schedule=_schedule(skippable),
                tangent_coeffs=torch.tensor([0.5, -1.0], dtype=torch.float64), radii=[1.0] * balls,
                global_ball=global_ball, offsets=offsets, seed=7,
                distribution=reference.GAUSSIAN if gaussian else reference.RADEMACHER,
                gap=torch.zeros((), dtype=torch.float64), row_numel=row_numel)
    return args


# Row lengths whose tiles take every width the rows kernels compile (SEG = 4 ... l1_fw_step._MAX_ROW_SEG, one ball
# per tile row) and one longer than a tile (the blocks path, one ball per row), two rows each. Aligned: lengths
# that are multiples of 4 (full tile rows); not aligned: one less (a lead and a masked tail in every row).
SEGS = tuple(4 << i for i in range((l1_fw_step._MAX_ROW_SEG // 4).bit_length()))
LONG = "long"


def _row_shapes(aligned: bool, widths) -> list[tuple[int, int]]:
    return [(2, 3 * tangent.BLOCK + (0 if aligned else 1)) if w == LONG else (2, w if aligned else w - 1)
            for w in widths]


def _tensor_shapes(aligned: bool) -> list[tuple[int, int]]:
    """Tensor balls ((numel, 0)): a short one (a rows tile), a long one (blocks, then the finalize), a third (the
    gap sum over several balls)."""
    return [(36 if aligned else 37, 0), (5 * tangent.BLOCK + (0 if aligned else 3), 0), (7, 0)]


HEAVY = ("backprop_momentum", "gaussian_momentum")  # the most live values of each source
_F32, _F64, _BF16, _F16 = torch.float32, torch.float64, torch.bfloat16, torch.float16
_SAMPLE = (4, 256, 1024, LONG)  # the narrowest tile, a [8, 256] one, the MLP benchmark's rows, a long row


def _ci_plan():
    """The "ci" tier as (sets, dtype, direction names, aligned, row widths, with tensor and global balls)."""
    every = tuple(name for name, *_ in DIRECTIONS)
    light = tuple(name for name in every if name not in HEAVY)
    l1, sets = ("l1",), ("linf", "lp2.0", "ksparse")
    return [
        # the L1 step, the optimizers' default: every tile width with the heavy directions in float32 and float64
        (l1, (_F32, _F64), HEAVY, True, SEGS + (LONG,), True),
        (l1, (_F32, _F64), light, True, _SAMPLE, True),
        (l1, (_F32, _F64), HEAVY, False, _SAMPLE, True),
        (l1, (_F32,), light, False, (4, LONG), False),
        (l1, (_BF16, _F16), HEAVY, True, (256, LONG), True),
        # the set steps, about five times slower to compile
        (sets, (_F32,), HEAVY, True, _SAMPLE, True),
        (sets, (_F32,), ("rademacher", "gaussian"), True, (256,), False),
        (sets, (_F64, _BF16), ("gaussian_momentum",), True, (256, LONG), True),
        (sets, (_F32,), ("gaussian_momentum",), False, (256,), False),
        (tuple(f"lp{p}" for p in LP_EXPONENTS[1:]), (_F32,), ("gaussian_momentum",), True, (256, LONG), True),
    ]


def _ci_noskip_plan():
    """The "ci" tier's samples of the steps without a skip element (check_finite=False: kernels that read none)."""
    return [(("l1",), (_F32,), HEAVY, True, _SAMPLE, True),
            (("linf", "lp2.0", "ksparse"), (_F32,), ("gaussian_momentum",), True, (256,), True)]


def _full_plan():
    every = tuple(name for name, *_ in DIRECTIONS)
    sets = ("l1", "linf", *(f"lp{p}" for p in LP_EXPONENTS), "ksparse")
    return [(sets, (_F32, _F64), every, aligned, SEGS + (LONG,), True) for aligned in (True, False)] + [
        (sets, (_BF16, _F16), HEAVY, aligned, SEGS + (LONG,), True) for aligned in (True, False)]


def launch_cases(tier: str = "ci") -> Iterator[tuple[str, Callable[[], None]]]:
    """(name, launch): kernel variants the optimizers launch, each made by a call of its launcher, over float32
    and float64 parameters (float16 and bfloat16 ones step through float32 master copies) and the op API's float16
    and bfloat16 ones; every direction (DIRECTIONS); row balls of the tile widths given, tensor balls, the global
    ball; tiles aligned or not; the set steps with the norm feedback's scales, as the optimizers pass them.

    "full": every set (Lp with one p per branch of its powers, LP_EXPONENTS) crossed with every dtype, direction,
    tile width and alignment: about 2,000 kernels, over half an hour on two cores. "ci" (_ci_plan): 200-odd
    kernels, about five minutes on two cores from an empty cache: every tile width of the L1 step with the heavy
    directions (HEAVY: the most live values, so the most registers) in float32 and float64, and samples of the
    rest. Both: the tangent fills in every dtype (the lean engine draws tangents in the parameters' dtype), the
    step as a number or read from device memory, on and off a Philox call's boundary.

    The steps take the optimizers' default schedule, with a skip element (SKIPPABLE kernels); those without one
    (check_finite=False; cases named ``..._noskip``) are crossed with every case in "full", sampled in "ci"
    (_ci_noskip_plan). The gradient step (an unconstrained group's): float32 and float64, with and without
    momentum, aligned or not, with a skip element; without one, a sample in "ci", all in "full".
    """
    directions = {name: d for d in DIRECTIONS for name in [d[0]]}
    seen = set()
    if tier == "full":
        plan = [(entry, skippable) for entry in _full_plan() for skippable in (True, False)]
    else:
        plan = [(entry, True) for entry in _ci_plan()] + [(entry, False) for entry in _ci_noskip_plan()]
    for (sets, dtypes, names, aligned, widths, balls), skippable in plan:
        for dtype in dtypes:
            for name in names:
                direction = directions[name]
                tag = f"{str(dtype).removeprefix('torch.')}_{name}_{'aligned' if aligned else 'unaligned'}"
                tag += "" if skippable else "_noskip"
                layouts = [("rows", _row_shapes(aligned, widths), False)]
                if balls:
                    layouts += [("tensors", _tensor_shapes(aligned), False), ("global", _tensor_shapes(aligned), True)]
                for layout, shapes, global_ball in layouts:
                    args = functools.partial(_step_args, shapes, dtype, direction, aligned, global_ball, skippable)
                    for kind in sets:
                        case = f"{kind}_{layout}_{tag}"
                        if case in seen:
                            continue
                        seen.add(case)
                        yield case, functools.partial(_launch, kind, args)
    for dtype in (_F32, _F64):
        for momentum in (True, False):
            for aligned in (True, False):
                for skippable in (True, False):
                    if not skippable and tier != "full" and not (momentum and aligned):
                        continue
                    yield (f"gradient_{str(dtype).removeprefix('torch.')}_{'momentum' if momentum else 'plain'}_"
                           f"{'aligned' if aligned else 'unaligned'}{'' if skippable else '_noskip'}",
                           functools.partial(_gradient, dtype, momentum, aligned, skippable))
    for dtype in DTYPES:
        for distribution, name in ((reference.GAUSSIAN, "gaussian"), (reference.RADEMACHER, "rademacher")):
            for lead in (0, 1):
                yield (f"fill_{name}_{str(dtype).removeprefix('torch.')}_lead{lead}",
                       functools.partial(_fill, dtype, distribution, lead))
    for dtype, head_dim, causal, tangents in _attention_plan(tier):
        yield (f"attention_jvp_{str(dtype).removeprefix('torch.')}_e{head_dim}_{'causal' if causal else 'full'}_"
               f"{tangents}", functools.partial(_attention, dtype, head_dim, causal, tangents))


def _attention_plan(tier: str) -> list[tuple[torch.dtype, int, bool, str]]:
    """The fused attention JVP as the lean engine launches it (attention_jvp.spill_free): bfloat16 and float16 at
    head dims 64 and 128, float32 (as TF32) at 64, causal or not, with all three tangents (the most live tiles);
    in "full" also each tangent alone, in "ci" a sample of those."""
    plan = [(dtype, e, causal, "qkv") for dtype, dims in ((_BF16, (64, 128)), (_F16, (64, 128)), (_F32, (64,)))
            for e in dims for causal in (False, True)]
    alone = [(dtype, 64, False, t) for dtype in (_BF16, _F32) for t in ("q", "k", "v")]
    return plan + (alone if tier == "full" else alone[:3])


def _attention(dtype: torch.dtype, head_dim: int, causal: bool, tangents: str) -> None:
    """One launch over (batch 1, 2 heads, 100 rows): several query blocks, a partial last key block."""
    x = torch.zeros(1, 2, 100, head_dim, dtype=dtype)
    allow_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = dtype == torch.float32  # the only float32 products the engine launches
    try:
        attention_jvp.attention_jvp(x, x, x, *(x if name in tangents else None for name in "qkv"), is_causal=causal)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allow_tf32


def _launch(kind: str, args: Callable[[], dict]) -> None:
    if kind == "l1":
        l1_fw_step.l1_fw_step_(**args())
    elif kind == "linf":
        linf_fw_step.linf_fw_step_(**args())
    elif kind == "ksparse":
        _set_step(ksparse_fw_step.ksparse_fw_step_, args(), k=3)
    else:
        _set_step(lp_fw_step.lp_fw_step_, args(), p=float(kind.removeprefix("lp")))


def _gradient(dtype: torch.dtype, momentum: bool, aligned: bool, skippable: bool) -> None:
    """The gradient step over a tensor of full blocks and a tail, and a short one."""
    numels = (3 * gradient_step._BLOCK + 5, 37)
    gradient_step.gradient_step_([_tensor(n, dtype, aligned) for n in numels],
                                 [_tensor(n, dtype, aligned) for n in numels] if momentum else [],
                                 [_tensor(n, dtype, aligned) for n in numels], _schedule(skippable))


def _fill(dtype: torch.dtype, distribution: int, lead: int) -> None:
    tangent.fill_tangent_(torch.zeros(3000, dtype=dtype), 7, 3, 1, 4 + lead, distribution)
    tangent.fill_tangent_at_step_(torch.zeros(3000, dtype=dtype), 7, torch.tensor(3), 1, 4 + lead, distribution)


def _set_step(launcher, args: dict, **parameter) -> None:
    """A set step with the norm feedback's scales, one per ball, as the optimizers pass them."""
    params, row_numel = args["params"], args["row_numel"]
    counts = [1] if args["global_ball"] else [p.numel() // n if n else 1 for p, n in zip(params, row_numel)]
    launcher(**args, scales=[torch.ones(c, dtype=torch.float64) for c in counts], **parameter)


# -- compiling and checking ---------------------------------------------------------------------------------------
def compile_cases(capability: int, worker: int = 0, workers: int = 1, select: str | None = None,
                  tier: str = "ci") -> dict:
    """Runs this worker's share of launch_cases (every ``workers``-th of those whose name ``select`` matches) in
    compile-only mode. Returns {"kernels": {hash: Compiled as a dict}, "cases": n, "failures": {case: error}}."""
    failures: dict[str, str] = {}
    n = 0
    with compile_only(capability) as (seen, current):
        for i, (name, launch) in enumerate(launch_cases(tier)):
            if i % workers != worker or (select is not None and re.search(select, name) is None):
                continue
            n += 1
            current["case"] = name
            try:
                launch()
            except Exception as exc:  # noqa: BLE001  (every failure is reported, with its case)
                failures[name] = f"{type(exc).__name__}: {exc}"[-3000:]
        kernels = {h: dataclasses.asdict(c) for h, c in seen.items()}
    return {"kernels": kernels, "cases": n, "failures": failures}


def ptxas_report(ptx: str, capability: int) -> dict:
    """Registers and spill bytes from ``ptxas -v`` on ``ptx``, with Triton's own ptxas and the flags its
    compiler uses (no FMA contraction: every fgfw launch sets enable_fp_fusion=False).

    Not CompiledKernel.n_spills: that needs a GPU, and it counts the whole local frame, including the array that
    libdevice's sin/cos keep there for large arguments, which is not a spill."""
    from triton.backends.nvidia.compiler import sm_arch_from_capability

    ptxas = triton.knobs.nvidia.ptxas.path
    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, "kernel.ptx")
        with open(source, "w") as f:
            f.write(ptx)
        log = subprocess.run([ptxas, "-lineinfo", "--fmad=false", "-v", f"--gpu-name={sm_arch_from_capability(capability)}",
                              source, "-o", os.path.join(tmp, "kernel.cubin")], check=True, capture_output=True,
                             text=True).stderr
    registers = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if registers is None or spills is None:
        raise RuntimeError(f"unexpected ptxas -v report:\n{log}")
    return dict(registers=int(registers[1]), spill_stores=int(spills[1]), spill_loads=int(spills[2]))


# Philox4x32-10 makes two 32-bit high multiplies per round: 20 per call.
PHILOX_MULTIPLIES_PER_CALL = 20


def philox_bound(kernel: dict) -> int | None:
    """The most mul.hi.u32 a kernel's PTX may hold if each Philox call of its tile is made once per thread: 20 per
    call, ceil(calls / threads) calls a thread, a call per 4 elements of the tile (ROWS calls, or BALLS x SEG
    elements). None for a kernel without a tile of the stream."""
    c = kernel["constants"]
    calls = c["ROWS"] if "ROWS" in c else c["BALLS"] * c["SEG"] // 4 if "BALLS" in c and "SEG" in c else None
    if calls is None:
        return None
    return PHILOX_MULTIPLIES_PER_CALL * -(-calls // (32 * kernel["num_warps"]))


def _known_repeat(kernel: dict) -> bool:
    """The one known case of Philox work repeated across threads: Rademacher tangents on tiles of one call a thread
    (16 warps: the rows kernel, l1_fw_step._rows_warps; the float64 blocks kernel; the Lp passes), where Triton's
    layout passes recompute part of each call in a second layout: 36 multiplies a thread for one call, against 20.
    Two calls a thread, on half the warps, spilled there instead; Gaussian tangents on the same tiles make each
    call once."""
    c = kernel["constants"]
    return c.get("GAUSSIAN") is False and philox_bound(kernel) == PHILOX_MULTIPLIES_PER_CALL


def _worker_main(capability: int, worker: int, workers: int, select: str | None, tier: str, out: str) -> None:
    result = compile_cases(capability, worker, workers, select, tier)
    with open(out, "w") as f:
        json.dump(result, f)


def check(capability: int = CAPABILITY, max_registers: int = MAX_REGISTERS, jobs: int = 1, select: str | None = None,
          report_cache: str | None = None, tier: str = "ci", log: Callable[[str], None] = print) -> dict:
    """Compiles every launch case for sm_``capability`` in ``jobs`` child processes and checks each distinct kernel:
    compiled, no spill, at most ``max_registers`` registers. Returns {"kernels": [...], "cases": n, "failures":
    [...]}; failures lists every case that did not compile and every kernel over a limit."""
    started = time.monotonic()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    with tempfile.TemporaryDirectory() as tmp:
        children = []
        for worker in range(jobs):
            out = os.path.join(tmp, f"worker{worker}.json")
            code = (f"from fgfw.triton import aot; aot._worker_main({capability}, {worker}, {jobs}, {select!r}, "
                    f"{tier!r}, {out!r})")
            children.append((subprocess.Popen([sys.executable, "-c", code], env=env), out))
        results = []
        for child, out in children:
            if child.wait() != 0:
                raise RuntimeError(f"a compile worker failed (exit {child.returncode}); see its output above")
            with open(out) as f:
                results.append(json.load(f))
    kernels: dict[str, dict] = {}
    failures = []
    for result in results:
        for h, kernel in result["kernels"].items():
            kernels.setdefault(h, kernel)
        failures += [f"{case}: does not compile: {error}" for case, error in result["failures"].items()]
    log(f"aot: {sum(r['cases'] for r in results)} launch cases, {len(kernels)} distinct kernels compiled for "
        f"sm_{capability} with Triton {triton.__version__} ({time.monotonic() - started:.0f} s)")

    cache = {}
    if report_cache and os.path.exists(report_cache):
        with open(report_cache) as f:
            cache = json.load(f)
    ptxas_version = subprocess.run([triton.knobs.nvidia.ptxas.path, "--version"], capture_output=True,
                                   text=True).stdout.strip().splitlines()[-1]
    keys = {h: hashlib.sha256(f"{ptxas_version}\n{capability}\n{k['ptx']}".encode()).hexdigest()
            for h, k in kernels.items()}
    missing = {keys[h]: k["ptx"] for h, k in kernels.items() if keys[h] not in cache}
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:  # ptxas runs as a child process: threads suffice
        for key, report in zip(missing, pool.map(lambda ptx: ptxas_report(ptx, capability), missing.values())):
            cache[key] = report
    rows, notes = [], []
    for h, kernel in sorted(kernels.items(), key=lambda item: (item[1]["name"], item[1]["case"])):
        key = keys[h]
        report = dict(cache[key], name=kernel["name"], num_warps=kernel["num_warps"], constants=kernel["constants"],
                      case=kernel["case"])
        rows.append(report)
        if report["spill_stores"] or report["spill_loads"]:
            failures.append(f"{kernel['name']} (first launched by {kernel['case']}) spills on sm_{capability}: {report}")
        limit = REGISTER_LIMITS.get(kernel["name"], max_registers)
        if report["registers"] > limit:
            failures.append(f"{kernel['name']} (first launched by {kernel['case']}) uses {report['registers']} "
                            f"registers, more than {limit}")
        report["philox_multiplies"] = len(re.findall(r"\bmul\.hi\.u32\b", kernel["ptx"]))
        bound = philox_bound(kernel)
        if bound is not None and report["philox_multiplies"] > bound and _known_repeat(kernel):
            notes.append(f"{kernel['name']} {kernel['constants'].get('SEG')} x {kernel['num_warps']} warps: "
                         f"{report['philox_multiplies']} Philox multiplies for {bound // 20} call(s) a thread (known)")
        elif bound is not None and report["philox_multiplies"] > bound:
            # more multiplies than calls per thread: the tile repeats Philox work per column (Triton 3.6 did, for
            # column selects with tl.where: tangent.tangent_tile)
            failures.append(f"{kernel['name']} (first launched by {kernel['case']}) makes {report['philox_multiplies']}"
                            f" Philox multiplies, more than its calls need ({bound})")
    if report_cache:
        os.makedirs(os.path.dirname(os.path.abspath(report_cache)), exist_ok=True)
        with open(report_cache, "w") as f:
            json.dump(cache, f)
    if notes:
        log(f"aot: {len(notes)} kernels repeat part of their Philox work (known, see _known_repeat), e.g. {notes[0]}")
    most = max(rows, key=lambda r: r["registers"]) if rows else None
    log(f"aot: ptxas -v on {len(rows)} kernels: {sum(1 for r in rows if r['spill_stores'] or r['spill_loads'])} "
        f"spill, the most registers {most['registers'] if most else 0} ({most['name'] if most else '-'}, "
        f"{most['case'] if most else '-'}), limit {max_registers} ({time.monotonic() - started:.0f} s in all)")
    return {"kernels": rows, "cases": sum(r["cases"] for r in results), "failures": failures}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fgfw.triton.aot", description=__doc__.split("\n\n")[0])
    parser.add_argument("--capability", type=int, default=CAPABILITY, help="the target's compute capability (90)")
    parser.add_argument("--max-registers", type=int, default=MAX_REGISTERS)
    parser.add_argument("--jobs", type=int, default=1, help="compile worker processes")
    parser.add_argument("--select", help="only the launch cases whose name this regular expression matches")
    parser.add_argument("--tier", choices=("ci", "full"), default="ci", help="launch_cases' tier (see its docstring)")
    parser.add_argument("--report", help="write every kernel's ptxas counts here (JSON)")
    parser.add_argument("--report-cache", help="ptxas reports kept between runs (JSON, keyed by the PTX)")
    args = parser.parse_args(argv)
    result = check(args.capability, args.max_registers, args.jobs, args.select, args.report_cache, args.tier)
    if args.report:
        with open(args.report, "w") as f:
            json.dump(result, f, indent=1)
    for failure in result["failures"]:
        print(f"aot: FAILED {failure}", file=sys.stderr)
    if not result["kernels"] and not result["failures"]:
        print("aot: FAILED no kernel was compiled", file=sys.stderr)
        return 1
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
