"""The Triton kernels compiled for sm_90 (H100) without a GPU: no spills, bounded registers, and each
Philox call made once per thread and stream row.

Triton compiles for an explicit target without a device, and its wheel ships ptxas, whose -v report
gives the counts. The compiling runs in a child process (this file run as a script): conftest.py sets
TRITON_INTERPRET=1 on a machine without a GPU, and under it fgfw's kernels are defined as interpreted
functions, which triton.compile does not take.
"""
import json
import os
import re
import subprocess
import sys
import tempfile

import pytest

triton = pytest.importorskip("triton")

CAPABILITY = 90  # H100 / H200
# sm_90 has 64K 32-bit registers per SM: up to 128 per thread, two 8-warp step programs (or four
# 4-warp fill programs) fit on an SM at once, which the memory-bound step needs to hide latency.
MAX_REGISTERS = 128
# Philox4x32-10 makes two 32-bit high multiplies per round; a thread owns ceil(ROWS / threads) rows.
PHILOX_MULTIPLIES_PER_CALL = 20

# name: (kernel, torch dtype of the parameters, constexpr flags). All aligned (the vectorised path).
VARIANTS = {
    "afgfw_gaussian_fp32": ("blocks", "float32", dict(HAS_GRAD=False, HAS_MOMENTUM=True, GAUSSIAN=True)),
    "fgfw_rademacher_fp32": ("blocks", "float32", dict(HAS_GRAD=False, HAS_MOMENTUM=False, GAUSSIAN=False)),
    "backprop_momentum_fp32": ("blocks", "float32", dict(HAS_GRAD=True, HAS_MOMENTUM=True, GAUSSIAN=False)),
    "afgfw_gaussian_bf16": ("blocks", "bfloat16", dict(HAS_GRAD=False, HAS_MOMENTUM=True, GAUSSIAN=True)),
    "afgfw_gaussian_fp64": ("blocks", "float64", dict(HAS_GRAD=False, HAS_MOMENTUM=True, GAUSSIAN=True)),
    # short balls (rows of 1024, two per program: the 12 x 1024 MLP benchmark's layout)
    "rows_afgfw_gaussian_fp32": ("rows", "float32", dict(HAS_GRAD=False, HAS_MOMENTUM=True, GAUSSIAN=True)),
    "fill_gaussian_fp32": ("fill", "float32", dict(GAUSSIAN=True, STEP_IN_MEMORY=False)),
    # the optimizers' form: the step counter read from device memory
    "fill_gaussian_fp32_step_in_memory": ("fill", "float32", dict(GAUSSIAN=True, STEP_IN_MEMORY=True)),
}

# As the launchers pass them: tensors (16-byte aligned by torch's allocator) and integer scalars.
_BLOCKS_SIGNATURE = dict(block_tensor="*i32", meta="*i64", schedule="*fp64", tangent_coeffs="*fp64",
                         block_factor="*fp64", partial_d="*fp64", partial_index="*i64", partial_dot="*fp64",
                         partial_units="*i64", key_lo="i32", key_hi="i32", n_tangents="i32")
_ROWS_SIGNATURE = dict(program_group="*i32", meta="*i64", schedule="*fp64", tangent_coeffs="*fp64", radii="*fp64",
                       factors="*fp64", ball_gap="*fp64", key_lo="i32", key_hi="i32", n_tangents="i32")
_ROW_SEG = 1024  # the rows variants' ball length
_FILL_SIGNATURE = dict(numel="i32", stream_base="i64", key_lo="i32", key_hi="i32", step="i32", tangent_id="i32")
_FILL_WARPS = 4  # as fill_tangent_


def _ptxas_report(ptxas: str, arch: str, ptx: str) -> dict:
    """Registers and spill bytes from ptxas -v on ``ptx``, with the flags Triton uses for these kernels.

    Not CompiledKernel.n_spills: that needs a GPU, and it counts the whole local frame, including the
    array that libdevice's sin/cos keep there for large arguments, which is not a spill.
    """
    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, "kernel.ptx")
        with open(source, "w") as f:
            f.write(ptx)
        log = subprocess.run([ptxas, "-v", "--fmad=false", f"--gpu-name={arch}", source, "-o",
                              os.path.join(tmp, "kernel.cubin")], check=True, capture_output=True, text=True).stderr
    registers = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if registers is None or spills is None:
        raise RuntimeError(f"unexpected ptxas -v report:\n{log}")
    return dict(registers=int(registers[1]), spill_stores=int(spills[1]), spill_loads=int(spills[2]))


def _compile_variants() -> dict:
    """Compiles every variant for sm_90 and measures it (runs in the child, without the interpreter)."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import sm_arch_from_capability
    from triton.compiler import ASTSource

    from fgfw import reference
    from fgfw.triton import fw_step, tangent

    target = GPUTarget("cuda", CAPABILITY, 32)
    ptxas = triton.knobs.nvidia.ptxas.path
    results = {}
    for name, (kernel, dtype_name, flags) in VARIANTS.items():
        dtype = getattr(torch, dtype_name)
        if kernel == "blocks":
            fn, warps, signature = fw_step._fw_blocks_kernel, fw_step._BLOCK_WARPS, dict(_BLOCKS_SIGNATURE)
            constexprs = dict(flags, PARAM_DTYPE=tangent.TL_DTYPES[dtype], GRAD_DTYPE=tangent.TL_DTYPES[dtype],
                              COMPUTE_DTYPE=tangent.TL_DTYPES[reference.compute_dtype(dtype)], ALIGNED=True)
        elif kernel == "rows":
            fn, warps, signature = fw_step._fw_rows_kernel, fw_step._BLOCK_WARPS, dict(_ROWS_SIGNATURE)
            constexprs = dict(flags, PARAM_DTYPE=tangent.TL_DTYPES[dtype], GRAD_DTYPE=tangent.TL_DTYPES[dtype],
                              COMPUTE_DTYPE=tangent.TL_DTYPES[reference.compute_dtype(dtype)], ALIGNED=True,
                              SEG=_ROW_SEG, BALLS=tangent.BLOCK // _ROW_SEG)
        else:
            fn, warps = tangent._fill_tangent_kernel, _FILL_WARPS
            signature = dict(out=f"*{tangent.TL_DTYPES[dtype].name}", **_FILL_SIGNATURE)
            if flags["STEP_IN_MEMORY"]:
                signature["step"] = "*i64"
            constexprs = dict(flags, LEAD=0)
        if kernel != "rows":  # the rows kernel's tile is BALLS x SEG (ROWS Philox calls)
            constexprs["ROWS"] = tangent.ROWS
        signature.update((key, "constexpr") for key in constexprs)
        pointers = {(fn.arg_names.index(key),): [["tt.divisibility", 16]]
                    for key, kind in signature.items() if kind.startswith("*")}
        compiled = triton.compile(ASTSource(fn=fn, signature={key: signature[key] for key in fn.arg_names},
                                            constexprs=constexprs, attrs=pointers),
                                  target=target, options=dict(num_warps=warps, enable_fp_fusion=False))
        ptx = compiled.asm["ptx"]
        rows_per_thread = -(-tangent.ROWS // (32 * warps))
        results[name] = dict(_ptxas_report(ptxas, sm_arch_from_capability(CAPABILITY), ptx),
                             philox_multiplies=len(re.findall(r"\bmul\.hi\.u32\b", ptx)),
                             philox_multiplies_max=PHILOX_MULTIPLIES_PER_CALL * rows_per_thread)
    return results


def compile_in_child(script: str, what: str) -> dict:
    """{variant name: ptxas counts}, from a child process running ``script`` (a test file whose __main__
    compiles its kernels for sm_CAPABILITY and prints the counts as JSON on its last line); skips where
    Triton cannot compile for NVIDIA here. A child, because the tests run under TRITON_INTERPRET=1."""
    try:
        from triton.backends import backends
        if "nvidia" not in backends:
            pytest.skip("this Triton has no NVIDIA backend")
        triton.knobs.nvidia.ptxas.path  # raises RuntimeError when no runnable ptxas is found
    except (AttributeError, ImportError, RuntimeError) as exc:
        pytest.skip(f"cannot compile for sm_{CAPABILITY} here: Triton's ptxas is not available ({exc!r})")
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    child = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=600)
    if child.returncode != 0:
        pytest.fail(f"compiling {what} for sm_{CAPABILITY} failed:\n{child.stderr[-4000:]}")
    return json.loads(child.stdout.splitlines()[-1])  # the last line: anything printed before is not ours


@pytest.fixture(scope="module")
def compiled():
    """{variant name: ptxas counts}, from one child process that compiles them all."""
    return compile_in_child(__file__, "the kernels")


@pytest.mark.parametrize("name", list(VARIANTS))
def test_compiles_without_spills_within_register_bound(compiled, name):
    report = compiled[name]
    assert report["spill_stores"] == 0 and report["spill_loads"] == 0, f"{name} spills on sm_{CAPABILITY}: {report}"
    assert report["registers"] <= MAX_REGISTERS, f"{name} needs more than {MAX_REGISTERS} registers: {report}"
    # More multiplies than calls per thread means the tile repeats Philox work per column.
    assert report["philox_multiplies"] <= report["philox_multiplies_max"], f"{name} repeats Philox calls: {report}"


if __name__ == "__main__":
    print(json.dumps(_compile_variants()))
