"""The Triton kernels compiled for sm_90 (H100) without a GPU, through fgfw.triton.aot: the launchers themselves run
in compile-only mode, and each kernel they launch is checked with ptxas's report (no spills, at most 128
registers, each Philox call made once per thread).

Here, on the main stack, a sample: every kernel of the fused steps (L1 rows of every tile width, blocks and
finalize, the gap sum, the set steps' passes, the fills) with float32 parameters, Gaussian tangents and momentum,
the most register-hungry direction, and the optimizers' default schedule (with its skip element, read by every
kernel on the device: an early return); the gradient step (an unconstrained group's) in float32 and float64 with
momentum; the fused attention JVP in bfloat16 (head dims 64 and 128) and float32 as TF32 (64), with every tangent,
causal or not (a compute-bound kernel: up to 255 registers, aot.REGISTER_LIMITS, but no spills). CI's oldest stack (scripts/test_stack.sh oldest, Triton 3.6 as on the GPU
machines) compiles aot's whole "ci" tier. The compiling runs in a child process: conftest.py sets
TRITON_INTERPRET=1 on a machine without a GPU, and under it fgfw's kernels are interpreted functions, which do not
compile.

Also, by reading the source: no Triton function returns from inside an `if` with no `else` (Triton 3.6 compiles
the statements after such a return too, and failed on them: "Cannot bitcast data-type of size 64 to data-type of
size 32" in the float64 row-ball step, on an H200).
"""
import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

TRITON_SOURCES = Path(__file__).resolve().parents[1] / "python" / "fgfw" / "triton"
SAMPLE = (r"^(l1|linf|lp2\.0|ksparse)_.*_float32_gaussian_momentum_aligned$|^fill_gaussian_float32"
          r"|^gradient_float(32|64)_momentum_aligned$|^attention_jvp_(bfloat16|float32)_e64_.*_qkv$"
          r"|^attention_jvp_bfloat16_e128_full_qkv$")
KERNELS = {"_fw_rows_kernel", "_fw_blocks_kernel", "_fw_finalize_kernel", "_gap_sum_kernel", "_set_reduce_kernel",
           "_set_update_kernel", "_lp_finalize_kernel", "_feedback_kernel", "_fill_tangent_kernel",
           "_gradient_step_kernel", "_attention_jvp_kernel"}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """fgfw.triton.aot's JSON report on SAMPLE, from a child process; skips where Triton cannot compile for
    NVIDIA here."""
    try:
        from triton.backends import backends
        if "nvidia" not in backends:
            pytest.skip("this Triton has no NVIDIA backend")
        triton.knobs.nvidia.ptxas.path  # raises RuntimeError when no runnable ptxas is found
    except (AttributeError, ImportError, RuntimeError) as exc:
        pytest.skip(f"cannot compile for sm_90 here: Triton's ptxas is not available ({exc!r})")
    out = tmp_path_factory.mktemp("aot") / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    child = subprocess.run([sys.executable, "-m", "fgfw.triton.aot", "--select", SAMPLE, "--jobs", "2",
                            "--report", str(out)], env=env, capture_output=True, text=True, timeout=900)
    if not out.exists():
        pytest.fail(f"fgfw.triton.aot did not report (exit {child.returncode}):\n{child.stderr[-4000:]}")
    return json.loads(out.read_text())


def test_every_kernel_is_in_the_sample(report):
    assert {k["name"] for k in report["kernels"]} == KERNELS
    # every tile width of the rows kernel
    from fgfw.triton import aot
    assert {k["constants"]["SEG"] for k in report["kernels"] if k["name"] == "_fw_rows_kernel"} == set(aot.SEGS)
    # every step kernel as the optimizers launch it by default: reading the schedule's skip element
    for kernel in report["kernels"]:
        if kernel["name"] not in ("_fill_tangent_kernel", "_attention_jvp_kernel"):
            assert kernel["constants"]["SKIPPABLE"] is True, kernel
    assert {k["constants"]["DTYPE"] for k in report["kernels"] if k["name"] == "_gradient_step_kernel"} == {
        "fp32", "fp64"}


def test_the_launch_matrix_covers_the_schedules_and_the_gradient_step():
    """Both schedules (with the skip element: the optimizers' default; without: check_finite=False) and every
    variant of the gradient step are in aot's tiers: "ci" samples the 3-element steps, "full" crosses them all."""
    from fgfw.triton import aot
    for tier in ("ci", "full"):
        names = [name for name, _ in aot.launch_cases(tier)]
        assert len(names) == len(set(names))
        noskip = [n for n in names if n.endswith("_noskip")]
        assert any(n.startswith("l1_") for n in noskip) and any(n.startswith("ksparse_") for n in noskip)
        gradient = {n for n in names if n.startswith("gradient_")}
        assert {f"gradient_{d}_{m}_{a}" for d in ("float32", "float64") for m in ("momentum", "plain")
                for a in ("aligned", "unaligned")} <= gradient
        attention = {n for n in names if n.startswith("attention_jvp_")}
        assert {f"attention_jvp_bfloat16_e{e}_{c}_qkv" for e in (64, 128) for c in ("full", "causal")} <= attention
    full = [name for name, _ in aot.launch_cases("full")]
    steps = [n for n in full if not n.startswith(("fill_", "gradient_", "attention_jvp_"))]
    assert 2 * len([n for n in steps if n.endswith("_noskip")]) == len(steps)


def test_the_sample_compiles_without_spills_within_the_register_bound(report):
    from fgfw.triton import aot
    assert not report["failures"], "\n".join(report["failures"])
    for kernel in report["kernels"]:
        limit = aot.REGISTER_LIMITS.get(kernel["name"], 128)
        assert kernel["spill_stores"] == kernel["spill_loads"] == 0 and kernel["registers"] <= limit, kernel


def test_philox_bound_counts_calls_per_thread():
    from fgfw.triton import aot
    # a [BALLS, SEG] tile of 2048 elements is 512 calls: 2 per thread on 8 warps, 1 on 16; a fill of 512 calls on 4
    assert aot.philox_bound(dict(constants=dict(BALLS=2, SEG=1024), num_warps=8)) == 40
    assert aot.philox_bound(dict(constants=dict(BALLS=8, SEG=256), num_warps=16)) == 20
    assert aot.philox_bound(dict(constants=dict(ROWS=512), num_warps=4)) == 80
    assert aot.philox_bound(dict(constants=dict(RBLOCK=1024), num_warps=4)) is None


def _returns_inside_an_if_without_else(path: Path) -> list[str]:
    """Triton functions in ``path`` with an `if` whose body ends in `return`, no `else`, and statements after it."""
    found = []
    for fn in ast.walk(ast.parse(path.read_text())):
        if not isinstance(fn, ast.FunctionDef) or not any("jit" in ast.unparse(d) for d in fn.decorator_list):
            continue

        def visit(body):
            for i, statement in enumerate(body):
                if isinstance(statement, ast.If):
                    if (statement.body and isinstance(statement.body[-1], ast.Return) and not statement.orelse
                            and i < len(body) - 1):
                        found.append(f"{path.name}:{statement.lineno} in {fn.name}")
                    visit(statement.body)
                    visit(statement.orelse)
                elif isinstance(statement, (ast.For, ast.While, ast.With)):
                    visit(statement.body)

        visit(fn.body)
    return found


def test_no_triton_function_returns_inside_an_if_without_else():
    found = [hit for path in sorted(TRITON_SOURCES.glob("*.py")) for hit in _returns_inside_an_if_without_else(path)]
    assert not found, f"use if/else instead (Triton 3.6 compiles what follows such a return): {found}"


def test_the_scan_finds_the_pattern(tmp_path):
    source = tmp_path / "kernel.py"
    source.write_text("@triton.jit\ndef f(x, F: tl.constexpr):\n    if F:\n        return x\n    return -x\n")
    assert _returns_inside_an_if_without_else(source) == ["kernel.py:3 in f"]
