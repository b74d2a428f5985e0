"""Kernel benchmark: the fused L1-ball Frank-Wolfe step against eager PyTorch, torch.compile and a copy.

For each size (and two many-tensor cases: a realistic model's 200 shapes with per-tensor balls, and a
12 x 1024 MLP with one ball per row) it times one optimizer step on one (device, dtype) group, in three
modes: ``afgfw`` (forward gradient with momentum v: reads and writes theta and v, 16 B/param in
float32), ``fgfw`` (forward gradient, no momentum: theta, 8 B/param) and ``fw`` (backprop gradient, no
momentum: theta read and written, the gradient read, 12 B/param) and ``fw_momentum`` (FrankWolfe's default with
momentum: the gradient read, theta and v read and written, 20 B/param):

* ``fused``   - fgfw's compiled kernel (``cuda`` on a GPU, ``cpu`` on the CPU): u regenerated in
                registers from the Philox stream, one pass over theta (and v).
* ``triton``  - fgfw's Triton kernel (opt-in: ``--backends ...,triton``).
* ``eager``   - the same step written as plain per-tensor torch ops, the way a user would write it.
                torch has no eager way to draw fgfw's tangent stream, so the eager step draws its
                tangents with ``torch.randn`` each step (generated, written and read back: the cost a
                user pays). Its LMO is torch.argmax per tensor, its gap a float32 torch.dot.
* ``compile`` - ``torch.compile`` of that eager step (Inductor fuses the randn into its kernels), with its
                argmax in two stages (argmax_rows: Inductor runs an unsplit argmax over a row in one thread
                block); the ``graphs`` column counts the graphs dynamo compiled for it (1: no recompilation).
* ``copy``    - the roofline: a device-to-device copy of the bytes the step must move (the mode's
                bytes per parameter above), measured in the same run.

``--sets`` times the fused rows (``fused``, ``triton``) of the other sets' steps too, each case against its own copy
(eager and compile exist for the L1 ball only): ``l1`` (``l1_fw_step_``, radius 1 as always), ``linf``
(``linf_fw_step_``), ``lp`` (``lp_fw_step_`` at p = 2, the L2 ball) and ``ksparse`` (``ksparse_fw_step_``, k = 1 % of
the largest ball). The other sets' radii are twice the start's norm (as ``relative_to_init(2.0)``: the start is
inside), and the Lp and k-sparse steps get the norm feedback's scales, as the optimizers pass them in float32.

``--quick`` is CI's CPU speed gate (scripts/test.sh): one row per fused set, one thread, float32, a FrankWolfe step
with momentum (``fw_momentum``) on one 1e7-parameter tensor, each against a copy of the same bytes timed
interleaved with it; ``--gate`` (CPU_GATE's thresholds under --quick) exits 1 when the copy's best time over a
fused row's best time is below its threshold, naming the row. Best times (the minimum over the repeats), since the
medians of a shared machine move with its load; in the thread's CPU time (``--clock thread``), which a call
preempted by another process does not lengthen; a row below is timed again (``--gate-retries``).

Reported per row: time per step (median and best of the repeats), effective bandwidth (bytes per
parameter x parameters / median time), the fraction of the copy's bandwidth, and speed-ups (of
medians) over eager and compile. Writes a CSV and a PNG (bandwidth vs size) and prints a Markdown
table.

  python bench/kernel_bench.py                           # GPU if there is one, else the CPU
  python bench/kernel_bench.py --device cpu --sizes 1e4 1e5 1e6 1e7
  python bench/kernel_bench.py --backends fused,triton,eager,compile,copy
  python bench/kernel_bench.py --sizes 1e6 1e7 1e8 --modes afgfw fgfw fw --mlp-rows   # scripts/gpu_check.sh
  python bench/kernel_bench.py --quick                   # the CPU speed gate (scripts/test.sh)
  python bench/kernel_bench.py --quick --sizes 4e6 --gate 0.5 --gate ksparse=0.3   # other thresholds
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import fgfw
from fgfw import _ops
from fgfw.experiments import write_csv

HERE = Path(__file__).resolve().parent
# mode -> (with momentum, with a backprop gradient, bytes moved per float32 parameter)
MODES = {"afgfw": (True, False, 16), "fgfw": (False, False, 8), "fw": (False, True, 12),
         "fw_momentum": (True, True, 20)}
DEFAULT_MODES = ["afgfw", "fgfw", "fw"]  # what every script names; fw_momentum on request
ALL_BACKENDS = ("fused", "triton", "eager", "compile", "copy")
# The sets a fused row steps (--sets): the L1 ball's own op, else the key of _ops.SET_STEPS.
SETS = ("l1", "linf", "lp", "ksparse")
LP_P = 2.0  # the lp rows' p: the L2 ball (lp_fw_step_'s closed-form powers)
KSPARSE_FRACTION = 0.01  # the ksparse rows' k: 1 % of the group's largest ball
# CI's CPU speed gate (--quick): the least ratio of the copy's best time to the fused row's best time, per set, on
# one float32 tensor of QUICK's size, one thread, fw_momentum. Measured on the 2-core CI VM (bench/RESULTS.md, "The
# CPU speed gate"): L1 0.83-0.95 since its pass runs AVX2 loops where the CPU has them (0.48-0.62 before),
# L-infinity 0.51-0.66, L2 0.17-0.22, k-sparse 0.12-0.16, the spread mostly the copy's (5.8-7.4 ms). Each threshold is
# below the lowest ratio measured and above half the highest, so a halving fails in any of those runs. Raise them
# when a kernel gets faster.
CPU_GATE = {"l1": 0.6, "linf": 0.4, "lp": 0.13, "ksparse": 0.1}
# --quick's settings (each one given on the command line wins). 1e7 parameters: theta, v and g are 120 MB, the
# copy's buffers 200 MB, far beyond the caches (32 MiB of L3 on the CI VM's EPYC), so both sides stream from memory
# as a large model's step does; a round of the four sets and their copies takes about 0.3 s on one thread.
QUICK = dict(device="cpu", threads=1, sizes=[1e7], modes=["fw_momentum"], sets=list(SETS), backends="fused,copy",
             model_width=0, min_time=1.0, figure=Path("none"), clock="thread", gate_retries=2)


def _code_version() -> str:
    """The commit measured (from FGFW_CODE, else git), for the CSV's code column."""
    if os.environ.get("FGFW_CODE"):
        return os.environ["FGFW_CODE"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


CODE = _code_version()


def model_shapes(width: int, layers: int = 16, vocab: int = 32_000, context: int = 1024) -> list[tuple[int, ...]]:
    """200 parameter shapes of a GPT-style transformer: embeddings, 16 blocks of 12 tensors, final norm,
    pooler and head."""
    shapes = [(vocab, width), (context, width)]
    for _ in range(layers):
        shapes += [(width,), (width,), (3 * width, width), (3 * width,), (width, width), (width,),
                   (width,), (width,), (4 * width, width), (4 * width,), (width, 4 * width), (width,)]
    return shapes + [(width,), (width,), (width, width), (width,), (vocab, width), (vocab,)]


def mlp_shapes(width: int = 1024, layers: int = 12) -> list[tuple[int, ...]]:
    """A width x width MLP of `layers` layers: weight and bias of each (24 tensors, 12.6 M parameters)."""
    return [s for _ in range(layers) for s in ((width, width), (width,))]


class Group:
    """One (device, float32) parameter group with its momentum / gradients and the op's per-step arguments.

    rows=True: one L1 ball per row of every matrix (``L1Ball(scope="row")``), given to the op as whole tensors
    with their row length (``row_numel``), as the optimizer does.
    """

    def __init__(self, shapes, device, mode: str, tangents: int, rows: bool = False, kind: str = "l1"):
        momentum, with_grad, _ = MODES[mode]
        gen = torch.Generator(device=device).manual_seed(0)
        self.params = [0.01 * torch.randn(s, device=device, generator=gen) for s in shapes]
        self.moms = [torch.zeros(s, device=device) for s in shapes] if momentum else []
        self.grads = [torch.randn(s, device=device, generator=gen) for s in shapes] if with_grad else []
        self.rows = rows
        self.numel = sum(p.numel() for p in self.params)
        self.offsets, start = [], 0
        for p in self.params:
            # as the optimizer: every tensor starts at a Philox call (a multiple of 4) of the stream
            self.offsets.append(start)
            start += -(-p.numel() // 4) * 4
        # alpha is small so that hundreds of timed steps keep the parameters far from denormals
        self.schedule = torch.tensor([1.0, 1e-3, 0.1], dtype=torch.float64, device=device)
        self.coeffs = torch.linspace(0.5, -0.5, tangents, dtype=torch.float64, device=device)
        self.radii = [1.0] * len(self.params)
        self.gap = torch.zeros((), dtype=torch.float64, device=device)
        # the other sets (kind, a key of SETS): radii twice the start's norm per ball, the Lp and k-sparse steps' param
        # (p, k) and norm feedback scales (one per ball, as the optimizers keep them for float32)
        self.kind, self.param, self.ball_radii, self.scales = kind, None, None, []
        if kind != "l1":
            balls = [p.view(p.shape[0], -1) if rows and p.dim() >= 2 else p.view(1, -1) for p in self.params]
            if kind == "lp":
                self.param = LP_P
            elif kind == "ksparse":
                self.param = max(1, round(KSPARSE_FRACTION * max(b.shape[1] for b in balls)))
            self.ball_radii = [2 * float(r) for b in balls for r in ball_norms(kind, b, self.param)]
            if kind in ("lp", "ksparse"):
                self.scales = [torch.ones(b.shape[0], dtype=torch.float64, device=device) for b in balls]

    def op_args(self):
        """(params, momentum, grads, radii, offsets, row_numel) as the optimizer passes them to the fused op
        (prepared: lists of tensors, Python floats and ints). Row balls: whole tensors with row_numel, one
        radius per row of a matrix and one per vector, as ``L1Ball(scope="row")`` gives."""
        if not self.rows:
            radii = self.radii if self.ball_radii is None else self.ball_radii
            return self.params, self.moms, self.grads, radii, self.offsets, []
        row_numel = [math.prod(p.shape[1:]) if p.dim() >= 2 else 0 for p in self.params]
        radii = [1.0] * sum(p.shape[0] if p.dim() >= 2 else 1 for p in self.params)
        if self.ball_radii is not None:
            radii = self.ball_radii
        return self.params, self.moms, self.grads, radii, self.offsets, row_numel


def ball_norms(kind: str, balls: torch.Tensor, param) -> list[float]:
    """The norm of each row of ``balls`` (one ball per row) that the set ``kind`` bounds by its radius: max |x|
    (linf), ||x||_p (lp), max(max |x|, ||x||_1 / k) (ksparse: |x_i| <= r and ||x||_1 <= k r)."""
    a = balls.detach().abs().double()
    if kind == "linf":
        return a.amax(1).tolist()
    if kind == "lp":
        return a.pow(param).sum(1).pow(1 / param).tolist()
    return torch.maximum(a.amax(1), a.sum(1) / param).tolist()


def fused_step(group: Group, backend: str):
    params, moms, grads, radii, offsets, row_numel = group.op_args()
    seed = _ops._int64(0)

    if group.kind == "l1":
        def step():
            _ops.l1_fw_step_(params, moms, grads, group.schedule, group.coeffs, radii, False, offsets, seed,
                             fgfw.reference.GAUSSIAN, group.gap, backend=backend, row_numel=row_numel, prepared=True)
    else:
        def step():
            _ops.set_fw_step_(group.kind, params, moms, grads, group.schedule, group.coeffs, radii, False, offsets,
                              seed, fgfw.reference.GAUSSIAN, group.gap, backend, row_numel, group.param, group.scales)
    return step


ARGMAX_BLOCK = 4096


def argmax_rows(a: torch.Tensor, blocked: bool) -> torch.Tensor:
    """The index of the largest entry of each row of ``a`` (the lowest on ties), shape (rows, 1).

    blocked=True: in two stages, the largest of each block of ARGMAX_BLOCK entries, then the best block.
    Inductor never splits an argmax over blocks (torch/_inductor/ir.py, num_splits: arg reductions are not split
    reductions), so torch.compile of torch.argmax over one row of 1e8 entries runs in ONE thread block: 85 ms on
    an H200, 47x eager. The blocked form gives it a reduction it spreads over the GPU (the compile rows)."""
    n = a.shape[1]
    if not blocked or n < 2 * ARGMAX_BLOCK:
        return torch.argmax(a, dim=1, keepdim=True)
    whole = n - n % ARGMAX_BLOCK
    values, within = a[:, :whole].reshape(a.shape[0], -1, ARGMAX_BLOCK).max(dim=2)
    block = torch.argmax(values, dim=1, keepdim=True)
    best, i = torch.gather(values, 1, block), block * ARGMAX_BLOCK + torch.gather(within, 1, block)
    if whole < n:  # the tail, shorter than a block: it wins only if strictly larger (it comes last)
        tail_value, tail_index = a[:, whole:].max(dim=1, keepdim=True)
        i = torch.where(tail_value > best, tail_index + whole, i)
    return i


def eager_step(params, moms, grads, coeffs: list[float], radii: list[float], alpha: float, gamma: float,
               rows: bool, blocked_argmax: bool = False):
    """The step in per-tensor torch ops (AFGFW with moms, FW with grads, else FGFW); returns the gap.

    rows=True: one ball per row of each matrix, its argmax a per-row reduction (vectorised over rows).
    blocked_argmax: the argmax in two stages (argmax_rows), as the compile rows take it."""
    gap = params[0].new_zeros(())
    for t, (p, r) in enumerate(zip(params, radii)):
        if grads:
            g = grads[t]
        else:
            g = None
            for c in coeffs:
                term = c * torch.randn_like(p)
                g = term if g is None else g + term
        if moms:
            d = moms[t].mul_(1 - gamma).add_(g, alpha=gamma)
        else:
            d = g
        by_row = rows and p.dim() >= 2
        # one ball per row of a matrix (rows=True), else the whole tensor as one row
        d2, p2 = (d.view(d.shape[0], -1), p.view(p.shape[0], -1)) if by_row else (d.view(1, -1), p.view(1, -1))
        i = argmax_rows(d2.abs(), blocked_argmax)
        d_i = torch.gather(d2, 1, i)
        gap = gap + torch.sum(d2 * p2) + r * d_i.abs().sum()
        p.mul_(1 - alpha)
        p2.scatter_add_(1, i, alpha * (-r * torch.sign(d_i)))
    return gap


def torch_step(group: Group, compiled: bool):
    coeffs = group.coeffs.tolist()
    _, alpha, gamma = group.schedule.tolist()
    fn = torch.compile(eager_step) if compiled else eager_step

    def step():
        fn(group.params, group.moms, group.grads, coeffs, group.radii, alpha, gamma, group.rows, compiled)
    # the graphs dynamo compiles from here on (make_row: compiled_graphs): recompilations would show there
    step.graphs_before = _compiled_graphs() if compiled else None
    return step


def _compiled_graphs() -> int:
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


def copy_step(group: Group, mode: str):
    # the bytes the step must move (MODES), as one float32 buffer copied: half read, half written
    src = torch.empty(group.numel * MODES[mode][2] // 8, device=group.params[0].device)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def time_gpu(step, min_time: float, warmup: int) -> list[float]:
    """Seconds per call (CUDA events) over repeats of at least min_time seconds in total."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    step()
    torch.cuda.synchronize()
    repeats = max(5, min(1000, int(min_time / max(time.perf_counter() - start, 1e-6))))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for begin, end in events:
        begin.record()
        step()
        end.record()
    torch.cuda.synchronize()
    return [begin.elapsed_time(end) / 1e3 for begin, end in events]


def time_cpu(steps: dict, min_time: float, warmup: int, clock=time.perf_counter) -> dict[str, list[float]]:
    """Seconds per call of every step, timed round-robin (one call of each in turn) so that the load
    of a shared machine falls on all of them alike. clock: wall time, or time.thread_time (the calling thread's CPU
    time: right for one thread only, and blind to the time the thread waits while other processes run)."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    start = time.perf_counter()
    for step in steps.values():
        step()
    repeats = max(5, min(1000, int(min_time / max(time.perf_counter() - start, 1e-6))))
    times = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            begin = clock()
            step()
            times[name].append(clock() - begin)
    return times


def fits(numel: int, device: str, mode: str, backends) -> bool:
    """Whether a group of numel float32 parameters and the baselines' temporaries fit in memory."""
    state = 4 * (1 + MODES[mode][0] + MODES[mode][1])
    # the CPU times every backend's group side by side, the GPU one at a time
    groups = len(backends) if device == "cpu" else 1
    # eager/compile temporaries (randn, g, |d|) and the copy's two buffers
    temporaries = 4 * 3 * any(b in backends for b in ("eager", "compile")) + 2 * state * ("copy" in backends)
    need = numel * (state * groups + temporaries)
    if device == "cuda":
        free, _ = torch.cuda.mem_get_info()
        return need < 0.85 * free
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return True
    return need < 0.7 * available


def machine(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"{os.cpu_count()}-core CPU ({torch.get_num_threads()} threads)" + \
        ("" if torch.cuda.is_available() else ", no GPU")


def make_step(backend: str, group: Group, device: str, mode: str):
    if backend == "fused":
        return fused_step(group, "cuda" if device == "cuda" else "cpu")
    if backend == "triton":
        return fused_step(group, "triton")
    if backend in ("eager", "compile"):
        return torch_step(group, compiled=backend == "compile")
    return copy_step(group, mode)


def make_row(device, case, mode, backend, samples, step=None) -> dict:
    """One CSV row: a case's time (median and best of samples, seconds) on one backend; the ratios to the
    copy, eager and compile rows of the same case are filled in by add_ratios. compiled_graphs (compile rows):
    the graphs dynamo compiled for the step, warm-up and timed calls together (1 means no recompilation)."""
    seconds = statistics.median(samples)
    graphs = getattr(step, "graphs_before", None)
    return dict(device=machine(device), code=CODE, case=case.name, set=case.kind, mode=mode, tangents=case.tangents,
                params=case.numel, tensors=len(case.shapes), bytes_per_param=MODES[mode][2], backend=backend,
                median_ms=seconds * 1e3, best_ms=min(samples) * 1e3,
                gbps=case.numel * MODES[mode][2] / seconds / 1e9,
                compiled_graphs="" if graphs is None else _compiled_graphs() - graphs)


def add_ratios(rows) -> None:
    """frac_copy (of medians), best_frac_copy (the copy's best time over the row's), vs_eager and vs_compile of every
    row from the rows of its case (same case, set, mode, K and size) measured so far; NaN where that baseline has not
    been measured."""
    def key(r):
        return r["case"], r.get("set", "l1"), r["mode"], r["tangents"], r["params"]
    by_case = {}
    for r in rows:
        by_case.setdefault(key(r), {})[r["backend"]] = r
    for r in rows:
        same = by_case[key(r)]
        r["frac_copy"] = r["gbps"] / same["copy"]["gbps"] if "copy" in same else math.nan
        r["best_frac_copy"] = same["copy"]["best_ms"] / r["best_ms"] if "copy" in same else math.nan
        for base in ("eager", "compile"):
            r[f"vs_{base}"] = same[base]["median_ms"] / r["median_ms"] if base in same else math.nan


class Case:
    def __init__(self, name, shapes, rows_scope=False, tangents=1, kind="l1"):
        self.name, self.shapes, self.rows_scope, self.tangents, self.kind = name, shapes, rows_scope, tangents, kind
        self.numel = sum(math.prod(s) for s in shapes)

    def group(self, device, mode):
        return Group(self.shapes, device, mode, self.tangents, rows=self.rows_scope, kind=self.kind)


def time_case_alone(case, device, mode, backend, min_time, warmup, clock=time.perf_counter):
    """The row (make_row) of one backend on one case, its group alone on the device, or None (the failure
    printed) if it fails."""
    # compile's first calls compile (and may recompile once): keep them out of the timing
    warmup = max(warmup, 3) if backend == "compile" else warmup
    try:
        step = make_step(backend, case.group(device, mode), device, mode)
        samples = (time_gpu(step, min_time, warmup) if device == "cuda"
                   else time_cpu({backend: step}, min_time, warmup, clock)[backend])
        return make_row(device, case, mode, backend, samples, step)
    except (RuntimeError, ValueError, NotImplementedError) as exc:  # reported, and the run goes on
        print(f"FAILED {case.name} {mode} K={case.tangents} {backend}: {type(exc).__name__}: "
              f"{str(exc).splitlines()[0]}", file=sys.stderr, flush=True)
        return None
    finally:
        if device == "cuda":
            torch.cuda.empty_cache()


def markdown(rows) -> str:
    lines = ["| case | set | mode | K | params | tensors | backend | median (ms) | best (ms) | GB/s | of copy | "
             "of copy (best) | vs eager | vs compile | graphs |",
             "|---|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        def num(x, fmt):
            return "" if isinstance(x, float) and math.isnan(x) else format(x, fmt)
        lines.append(f"| {r['case']} | {r.get('set', 'l1')} | {r['mode']} | {r['tangents']} | {r['params']:.3g} | "
                     f"{r['tensors']} | {r['backend']} | {num(r['median_ms'], '.4g')} | {num(r['best_ms'], '.4g')} | "
                     f"{num(r['gbps'], '.1f')} | {num(r['frac_copy'], '.0%')} | {num(r['best_frac_copy'], '.0%')} | "
                     f"{num(r['vs_eager'], '.2f')} | {num(r['vs_compile'], '.2f')} | {r.get('compiled_graphs', '')} |")
    return "\n".join(lines)


def plot(rows, path: Path, title: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.get("set", "l1") == "l1"]  # the L1 ball's rows: the only set with every backend
    if not rows:
        return
    modes = sorted({r["mode"] for r in rows})
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4.2), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        for backend in ALL_BACKENDS:
            pts = sorted((r["params"], r["gbps"]) for r in rows
                         if r["mode"] == mode and r["backend"] == backend and r["case"] == "single")
            many = [(r["params"], r["gbps"]) for r in rows
                    if r["mode"] == mode and r["backend"] == backend and r["case"] != "single"]
            color = None
            if pts:
                (line,) = ax.plot(*zip(*pts), marker="o", label=backend, linestyle="--" if backend == "copy" else "-")
                color = line.get_color()
            if many:
                ax.scatter(*zip(*many), marker="*", s=120, color=color, label=None if pts else backend)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("parameters")
        ax.set_ylabel(f"effective GB/s ({MODES[mode][2]} B/param)")
        ax.set_title(f"{mode.upper()} step" + (" (stars: many-tensor cases)" if any(
            r["case"] != "single" for r in rows) else ""))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None,
                        help="default: cuda if there is a GPU, else cpu")
    parser.add_argument("--sizes", nargs="+", type=float, default=None,
                        help="parameter counts of the single-tensor cases (default: 1e4 .. 1e9 on a GPU as "
                             "memory allows, 1e4 .. 1e7 on the CPU)")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=None,
                        help=f"default {' '.join(DEFAULT_MODES)}")
    parser.add_argument("--sets", nargs="+", choices=SETS, default=None,
                        help="the sets of the fused (and triton) rows, each case timed once per set against its own "
                             "copy (default l1; eager and compile time the L1 ball only)")
    parser.add_argument("--backends", default=None,
                        help=f"comma-separated subset of {','.join(ALL_BACKENDS)} (default: fused,eager,compile,copy "
                             "on a GPU; fused,eager,copy on the CPU); one that is not available here is skipped "
                             "with a warning")
    parser.add_argument("--tangents", type=int, default=1, help="tangents per step (K) of every case, default 1")
    parser.add_argument("--more-tangents", type=int, default=None, metavar="K",
                        help="add an AFGFW case of the largest single size with K tangents")
    parser.add_argument("--model-width", type=int, default=None,
                        help="width of the 200-tensor model case (default 768 on a GPU, 128 on the CPU; 0 skips it)")
    parser.add_argument("--mlp-rows", action="store_true",
                        help="add the 12 x 1024 MLP with one L1 ball per row (scope='row')")
    parser.add_argument("--compile-modes", nargs="+", choices=list(MODES), default=DEFAULT_MODES,
                        help=f"modes to time torch.compile in (default: {' '.join(DEFAULT_MODES)})")
    parser.add_argument("--compile-sizes", nargs="+", type=float, default=None,
                        help="time torch.compile only on the single-tensor cases of these sizes (each size "
                             "compiles anew; the many-tensor steps take minutes to compile; default: every case)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's default)")
    parser.add_argument("--min-time", type=float, default=None, help="seconds of timed steps per measurement")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--backend-by-backend", action="store_true",
                        help="time one backend at a time over every case, copy first and compile last (always on "
                             "a GPU; on the CPU the default times a case's backends round-robin)")
    parser.add_argument("--deadline", type=float, default=None,
                        help="seconds from the start after which no new measurement begins (the rows measured "
                             "by then are all written)")
    parser.add_argument("--out", type=Path, default=None,
                        help="CSV path (default bench/figures/kernel_<device>.csv, next to the PNG); rewritten "
                             "after every row, so a run that is stopped keeps what it measured")
    parser.add_argument("--append", action="store_true",
                        help="keep the rows already in the CSV (--out) and add this run's after them")
    parser.add_argument("--figure", type=Path, default=None,
                        help="PNG path (default bench/figures/kernel_<device>.png; 'none' skips it)")
    parser.add_argument("--quick", action="store_true",
                        help="the CPU speed gate that CI runs (QUICK): --device cpu --threads 1 --sizes 1e7 --modes "
                             "fw_momentum --sets l1 linf lp ksparse --backends fused,copy --model-width 0 --min-time 1 "
                             "--figure none --clock thread --gate-retries 2 --out results/kernel_gate_cpu.csv "
                             "(options given win), gated at CPU_GATE's thresholds (--gate adds to them)")
    parser.add_argument("--clock", choices=["wall", "thread"], default=None,
                        help="what the CPU rows time: wall time (default), or the thread's CPU time (one thread only: "
                             "a call preempted by another process is not counted longer; the default under --quick)")
    parser.add_argument("--gate-retries", type=int, default=None, metavar="N",
                        help="time a gated CPU case below its threshold up to N more times, keeping its best attempt "
                             "(default 0; 2 under --quick)")
    parser.add_argument("--gate", action="append", default=None, metavar="[SET=]RATIO",
                        help="exit 1 when a fused (or triton) row's best_frac_copy (the copy's best time over the "
                             "row's, same case and set) is below RATIO: of every set (RATIO), or of one (SET=RATIO); "
                             "repeatable, applied in order (after CPU_GATE's under --quick)")
    args = parser.parse_args(argv)
    began = time.monotonic()
    if args.quick:
        if args.device == "cuda":
            parser.error("--quick is the CPU gate: it takes no --device cuda")
        for key, value in QUICK.items():
            if getattr(args, key) is None:
                setattr(args, key, value)
        if args.out is None:
            args.out = HERE.parent / "results" / "kernel_gate_cpu.csv"
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.modes = args.modes or DEFAULT_MODES
    args.sets = args.sets or ["l1"]
    args.gate_retries = args.gate_retries or 0
    if args.clock == "thread" and (args.device != "cpu" or args.threads != 1):
        parser.error("--clock thread times one thread: it needs --device cpu --threads 1")
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    try:
        thresholds = gate_thresholds(args.gate, args.sets, CPU_GATE if args.quick else {})
    except ValueError as err:
        parser.error(str(err))

    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a GPU")
    if args.threads:
        torch.set_num_threads(args.threads)
    backends = (args.backends or ("fused,eager,compile,copy" if device == "cuda" else "fused,eager,copy")).split(",")
    unknown = set(backends) - set(ALL_BACKENDS)
    if unknown:
        parser.error(f"--backends: unknown {sorted(unknown)}; choose from {ALL_BACKENDS}")
    fused_backend = {"fused": "cuda" if device == "cuda" else "cpu", "triton": "triton"}
    for b in list(backends):
        if b in fused_backend and not _ops.backend_available(fused_backend[b], torch.device(device)):
            print(f"WARNING: skipping backend {b} ({fused_backend[b]}): not available on {device} "
                  f"(available: {_ops.available_backends(device)})", file=sys.stderr, flush=True)
            backends.remove(b)
    sizes = [int(s) for s in (args.sizes or ([1e4, 1e5, 1e6, 1e7, 1e8, 1e9] if device == "cuda" else
                                             [1e4, 1e5, 1e6, 1e7]))]
    width = args.model_width if args.model_width is not None else (768 if device == "cuda" else 128)
    min_time = args.min_time if args.min_time is not None else (0.5 if device == "cuda" else 1.0)

    cases = [(mode, Case("single", [(n,)], tangents=args.tangents, kind=kind))
             for mode in args.modes for n in sizes for kind in args.sets]
    if width:
        cases += [(mode, Case(f"model-{len(model_shapes(width))}", model_shapes(width), tangents=args.tangents,
                              kind=kind)) for mode in args.modes for kind in args.sets]
    if args.mlp_rows:
        cases += [(mode, Case("mlp12x1024-rows", mlp_shapes(), True, args.tangents, kind))
                  for mode in args.modes for kind in args.sets]
    if args.more_tangents:
        cases += [("afgfw", Case("single", [(max(sizes),)], tangents=args.more_tangents, kind=kind))
                  for kind in args.sets]
    fitting = []
    for mode, case in cases:
        if fits(case.numel, device, mode, backends):
            fitting.append((mode, case))
        else:
            print(f"skip {case.name} {mode} {case.numel:.3g} params: not enough memory", file=sys.stderr)
    compile_sizes = None if args.compile_sizes is None else {int(x) for x in args.compile_sizes}

    def compiled_here(mode, case):
        return mode in args.compile_modes and (
            compile_sizes is None or (case.name == "single" and case.numel in compile_sizes))

    def timed_here(backend, mode, case):
        """Whether the backend times this case: eager and compile step the L1 ball only."""
        if backend in ("eager", "compile") and case.kind != "l1":
            return False
        return backend != "compile" or compiled_here(mode, case)

    steps_named = ", ".join(f"{kind}_fw_step_" for kind in args.sets)
    title = f"fgfw {steps_named} on {machine(device)}"
    print(f"# {title}; torch {torch.__version__}; code {CODE}; eager/compile tangents: torch.randn per step",
          file=sys.stderr)
    out = args.out or HERE / "figures" / f"kernel_{device}.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    earlier = []
    if args.append and out.exists():
        with open(out, newline="") as f:
            earlier = list(csv.DictReader(f))
    rows = []

    def record(new_rows):
        rows.extend(new_rows)
        add_ratios(rows)
        write_csv(out, earlier + rows)
        for r in new_rows:
            print(f"{r['case']:>15} {r['set']:>7} {r['mode']:>6} K={r['tangents']} {r['params']:>11.3g} "
                  f"{r['backend']:>8} {r['median_ms']:10.4f} ms {r['gbps']:8.1f} GB/s  copy {r['frac_copy']:5.0%} "
                  f"(best {r['best_frac_copy']:5.0%})  x eager {r['vs_eager']:6.2f}", file=sys.stderr, flush=True)

    def out_of_time(what):
        if args.deadline is not None and time.monotonic() - began > args.deadline:
            print(f"DEADLINE: {what} not measured ({args.deadline:g} s passed)", file=sys.stderr, flush=True)
            return True
        return False

    if device == "cuda" or args.backend_by_backend:
        # Backend by backend (one group on the device at a time: the largest sizes fit only alone), the copy
        # first and torch.compile (slow to compile) last, so a run cut short keeps the rows that matter.
        order = [b for b in ("copy", "eager", "fused", "triton", "compile") if b in backends]
        for backend in order:
            for mode, case in fitting:
                if not timed_here(backend, mode, case):
                    continue
                if out_of_time(f"{case.name} {case.kind} {mode} K={case.tangents} {backend}"):
                    continue
                row = time_case_alone(case, device, mode, backend, min_time, args.warmup, clock)
                if row is not None:
                    record([row])
    else:
        # The CPU times every backend of a case round-robin (time_cpu), so that a shared machine's load
        # falls on all of them alike.
        for mode, case in fitting:
            if out_of_time(f"{case.name} {case.kind} {mode} K={case.tangents}"):
                continue
            case_backends = [b for b in backends if timed_here(b, mode, case)]
            warmup = max(args.warmup, 3) if "compile" in case_backends else args.warmup
            steps = {b: make_step(b, case.group(device, mode), device, mode) for b in case_backends}
            times = time_cpu(steps, min_time, warmup, clock)
            # a gated case below its threshold is timed again (--gate-retries) and keeps its best attempt: a real
            # slow-down stays below in every attempt, a burst of load on the shared machine does not
            for attempt in range(args.gate_retries):
                ratio = gated_ratio(times)
                if case.kind not in thresholds or not ratio < thresholds[case.kind]:
                    break
                print(f"gate: {case.name} {case.kind} {mode}: {ratio:.2f} of copy, below {thresholds[case.kind]:g}: "
                      f"timing it again ({attempt + 1} of {args.gate_retries})", file=sys.stderr, flush=True)
                again = time_cpu(steps, min_time, 1, clock)
                if not gated_ratio(again) <= ratio:
                    times = again
            record([make_row(device, case, mode, b, samples, steps[b]) for b, samples in times.items()])

    figure = args.figure or HERE / "figures" / f"kernel_{device}.png"
    if str(figure) != "none":
        plot(rows, figure, title)
    print(f"\n{title}\n\n{markdown(rows)}\n\nCSV: {out}\nPNG: {figure}")
    if thresholds:
        return 1 if gate(rows, thresholds) else 0
    return 0


def gated_ratio(times: dict[str, list[float]]) -> float:
    """The lowest ratio of the copy's best time to a fused (or triton) row's best time in one case's timings, NaN
    without a copy or a fused row."""
    ratios = [min(times["copy"]) / min(t) for b, t in times.items() if b in ("fused", "triton") and "copy" in times]
    return min(ratios) if ratios else math.nan


def gate_thresholds(specs, sets, defaults) -> dict[str, float]:
    """The gate's least best_frac_copy per set measured (``sets``): ``defaults`` (of those sets), then each spec in
    order, 'RATIO' for every set or 'SET=RATIO' for one. Raises ValueError on a bad spec."""
    thresholds = {kind: ratio for kind, ratio in defaults.items() if kind in sets}
    for spec in specs or []:
        kind, _, ratio = spec.rpartition("=")
        try:
            value = float(ratio)
        except ValueError:
            raise ValueError(f"--gate {spec!r}: want RATIO or SET=RATIO, e.g. 0.5 or ksparse=0.3") from None
        if not kind:
            thresholds.update(dict.fromkeys(sets, value))
        elif kind in sets:
            thresholds[kind] = value
        else:
            raise ValueError(f"--gate {spec!r}: set {kind!r} is not measured (--sets {' '.join(sets)})")
    return thresholds


def gate(rows, thresholds: dict[str, float]) -> list[str]:
    """Checks every fused and triton row against its set's threshold (best_frac_copy >= threshold), prints one line
    per row and per set that has no row, and returns the failures' lines."""
    failures = []
    gated = [r for r in rows if r["backend"] in ("fused", "triton") and r.get("set", "l1") in thresholds]
    for r in gated:
        ratio, least = r["best_frac_copy"], thresholds[r["set"]]
        copy_best = r["best_ms"] * ratio if ratio == ratio else math.nan
        line = (f"{r['case']} {r['set']} {r['mode']} K={r['tangents']} {r['params']:.3g} params {r['backend']}: best "
                f"{r['best_ms']:.3f} ms (median {r['median_ms']:.3f}), copy best {copy_best:.3f} ms: "
                f"{ratio:.2f} of copy, gate {least:g}")
        ok = ratio >= least  # False for NaN: no copy row to compare with
        print(f"gate: {'ok  ' if ok else 'FAIL'} {line}" + ("" if ok or ratio == ratio else " (no copy row)"))
        if not ok:
            failures.append(line)
    for kind in sorted(set(thresholds) - {r["set"] for r in gated}):
        line = f"{kind}: no fused row measured (skipped, not available, or past --deadline)"
        print(f"gate: FAIL {line}")
        failures.append(line)
    if failures:
        print(f"gate: FAILED: {len(failures)} of {len(gated)} rows below their set's ratio to copy", file=sys.stderr)
    else:
        print(f"gate: passed ({len(gated)} rows)")
    return failures


if __name__ == "__main__":
    sys.exit(main())
