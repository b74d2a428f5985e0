"""Register, spill and stack use of the CUDA kernels, as ptxas reports it: a check that needs nvcc
but no GPU.

csrc/cuda/l1_fw_step.cu, tangent.cu, linf_fw_step.cu, lp_fw_step.cu, ksparse_fw_step.cu, gradient_step.cu and
nonfinite.cu are compiled for sm_90, device code only, with -Xptxas -v. No kernel may spill or keep a stack frame
(local memory), but for the set steps' Gaussian direction kernels' 32-byte frame (below), and each must fit the blocks
per SM that its __launch_bounds__ asks for, 256 threads a block: 4 for the float-accumulating
chunk kernels (64 registers, kMinChunkBlocks in l1_fw_step.cu), 3 for the double ones (80), 8 for the
fill kernels (32, kBlocksPerSm in tangent.cu). The rows kernels run one-warp blocks, as many warps
per SM as the chunk kernels (kMinRowBlocks: 32 or 24 blocks of 32 threads), so the same limits
hold. About 15 s on two cores. Skips without nvcc or a CUDA build of torch.
"""
import concurrent.futures
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ["csrc/cuda/l1_fw_step.cu", "csrc/cuda/tangent.cu", "csrc/cuda/linf_fw_step.cu", "csrc/cuda/lp_fw_step.cu",
           "csrc/cuda/ksparse_fw_step.cu", "csrc/cuda/gradient_step.cu", "csrc/cuda/nonfinite.cu"]
ARCH = "90"
REGS_PER_SM = 65536
THREADS = 256


def _max_registers(blocks_per_sm):
    """The most registers a thread can have for blocks_per_sm blocks: allocation is per warp, in
    units of 256 registers, i.e. a multiple of 8 registers a thread."""
    return REGS_PER_SM // (blocks_per_sm * THREADS) // 8 * 8


def _nvcc():
    for candidate in (os.environ.get("CUDACXX"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


@pytest.fixture(scope="module")
def ptxas_report():
    """{kernel's mangled name: (registers, stack frame bytes, spill store bytes, spill load bytes)}."""
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("no nvcc (set CUDACXX or put nvcc on PATH)")
    if not torch.version.cuda:
        pytest.skip(f"torch {torch.__version__} is a CPU-only build: the CUDA kernels are not built")
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    nvcc_major = re.search(r"release (\d+)\.", version).group(1)
    if nvcc_major != torch.version.cuda.split(".")[0]:
        # CMakeLists.txt refuses this pair too
        pytest.skip(f"nvcc {nvcc_major}.x does not match torch's CUDA {torch.version.cuda}")

    torch_dir = Path(torch.__file__).parent
    flags = ["-O3", "-DNDEBUG", "-std=c++20", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
             f"-I{ROOT / 'csrc'}", "-isystem", str(torch_dir / "include"),
             "-isystem", str(torch_dir / "include/torch/csrc/api/include"),
             f"-gencode=arch=compute_{ARCH},code=sm_{ARCH}", "--cubin", "-Xptxas", "-v", "-o", os.devnull]

    def compile_one(source):
        done = subprocess.run([nvcc, *flags, str(ROOT / source)], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"nvcc failed on {source}:\n{done.stdout}{done.stderr}"
        return done.stdout + done.stderr

    with concurrent.futures.ThreadPoolExecutor(len(SOURCES)) as pool:
        logs = list(pool.map(compile_one, SOURCES))

    report = {}
    for log in logs:
        entry, properties = None, None
        for line in log.splitlines():
            if m := re.search(r"Compiling entry function '([^']+)'", line):
                entry, properties = m.group(1), None
            elif m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line):
                properties = tuple(int(x) for x in m.groups())
            elif (m := re.search(r"Used (\d+) registers", line)) and entry:
                assert properties is not None, f"no stack/spill line for {entry}"
                report[entry] = (int(m.group(1)), *properties)
                entry = None
    return report


def _readable(names):
    """The kernels' names demangled (where c++filt is there), without their parameter lists, one a line."""
    filt = shutil.which("c++filt")
    if not filt:
        return "\n".join(names)
    names = subprocess.run([filt], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    return "\n".join(n.split(">(")[0].replace("void ", "").replace("fgfw::(anonymous namespace)::", "") + ">"
                     for n in names)


def _kernels(report, stem):
    return {name: usage for name, usage in report.items() if stem in name}


def test_every_kernel_was_reported(ptxas_report):
    # 4 parameter dtypes x (3 sources x 2 momentum chunk and rows kernels + 1 finalize) + 1 gap sum
    # + 4 fill kernels
    assert len(_kernels(ptxas_report, "16fw_chunks_kernel")) >= 24
    assert len(_kernels(ptxas_report, "14fw_rows_kernel")) >= 24
    assert len(_kernels(ptxas_report, "18fw_finalize_kernel")) >= 4
    assert len(_kernels(ptxas_report, "20fw_sum_shares_kernel")) >= 1
    assert len(_kernels(ptxas_report, "19fill_tangent_kernel")) >= 4


# The set steps' kernels that regenerate Gaussian tangents keep a 32-byte stack frame: sincosf's buffer for
# the reduction of large arguments, a path never taken (the Box-Muller angle is below 2 pi), so it costs no
# memory traffic. l1_fw_step.cu's kernels have ptxas keep it in registers; these do not, at the same register
# budget. A frame of any other size, or in any other kernel, or any spill, fails.
SINCOS_FRAME = 32
SINCOS_FRAME_KERNELS = ("11linf_kernel", "16lp_reduce_kernel", "16lp_update_kernel", "24ksparse_direction_kernel")
GAUSSIAN_MANGLING = "LNS_6SourceE0E"


def _allowed_frame(name, stack):
    return stack == SINCOS_FRAME and GAUSSIAN_MANGLING in name and any(k in name for k in SINCOS_FRAME_KERNELS)


def test_every_set_step_kernel_was_reported(ptxas_report):
    # 4 parameter dtypes x 3 sources x 2 momentum variants of each direction-computing kernel
    for stem in SINCOS_FRAME_KERNELS:
        assert len(_kernels(ptxas_report, stem)) >= 24, stem


def test_no_kernel_spills_or_has_a_stack_frame(ptxas_report):
    bad = [name for name, (_, stack, stores, loads) in ptxas_report.items()
           if (stack and not _allowed_frame(name, stack)) or stores or loads]
    assert not bad, "kernels with local memory (stack frame, spill stores, spill loads in bytes):\n" + "\n".join(
        f"{line}: {ptxas_report[name][1:]}" for name, line in zip(bad, _readable(bad).splitlines()))


@pytest.mark.parametrize("stem,dtype_mangling,blocks_per_sm", [
    ("16fw_chunks_kernel", ("IN3c104Half", "IN3c108BFloat16", "If"), 4),
    ("16fw_chunks_kernel", ("Id",), 3),
    # 32 (24) one-warp blocks hold the registers of 4 (3) blocks of 256 threads
    ("14fw_rows_kernel", ("IN3c104Half", "IN3c108BFloat16", "If"), 4),
    ("14fw_rows_kernel", ("Id",), 3),
    ("19fill_tangent_kernel", ("IN3c104Half", "IN3c108BFloat16", "If", "Id"), 8),
])
def test_kernels_fit_their_blocks_per_sm(ptxas_report, stem, dtype_mangling, blocks_per_sm):
    limit = _max_registers(blocks_per_sm)
    kernels = {name: usage for name, usage in ptxas_report.items()
               if any(f"{stem}{m}" in name for m in dtype_mangling)}
    assert kernels
    over = [name for name, (registers, *_) in kernels.items() if registers > limit]
    assert not over, f"kernels over {limit} registers ({blocks_per_sm} blocks of {THREADS} threads per SM):\n" + \
        "\n".join(f"{line}: {kernels[name][0]}" for name, line in zip(over, _readable(over).splitlines()))
