"""`fgfw info`: the versions, the extension's CUDA architectures (read from its .nv_fatbin section), every
backend on every device with available/unavailable and the reason, and `--bench`'s measure."""
import math
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fgfw
from fgfw import _ops, cli, info

REPO = Path(__file__).resolve().parents[1]
BACKEND_LINE = re.compile(r"^    (\w+) +(yes|no) +(.+?)(  <- auto)?$")


def run_info(capsys, *argv):
    cli.main(["info", *argv])
    captured = capsys.readouterr()
    assert captured.err == ""
    return captured.out


def backend_blocks(out: str) -> dict[str, dict[str, tuple[bool, str, bool]]]:
    """{device heading: {backend: (available, reason, auto)}} from the backends part of `fgfw info`."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("backends "))
    blocks, device = {}, None
    for line in lines[start + 1:]:
        if line.startswith("  ") and not line.startswith("    "):
            device = line.strip()
            blocks[device] = {}
        elif (match := BACKEND_LINE.match(line)) is not None:
            blocks[device][match[1]] = (match[2] == "yes", match[3], match[4] is not None)
        else:
            break
    return blocks


def test_info_names_the_versions_and_the_extension(capsys):
    out = run_info(capsys)
    assert out.startswith(f"fgfw     {fgfw.__version__} (")
    assert f"torch    {torch.__version__}\n" in out
    try:
        import triton
        assert f"triton   {triton.__version__}, " in out
    except ImportError:
        assert "triton   not installed" in out
    assert f"CUDA     {torch.version.cuda or 'none'} " in out
    if torch.cuda.is_available():
        assert f"GPU      cuda:0 ({torch.cuda.get_device_name(0)}, sm_" in out
    else:
        assert "GPU      none (" in out
    if fgfw.HAS_COMPILED_EXTENSION:
        assert f"fgfw._C  {_ops.extension_file()}\n" in out
        has_cuda = _ops._has_kernel("l1_fw_step_", "CUDA")
        # a build with CUDA kernels names its architectures; one without says so
        assert re.search(r"CUDA kernels: (sm|compute)_\d+", out) if has_cuda else "CUDA kernels: none (built" in out


def test_info_gives_every_backend_on_every_device_as_the_op_layer_does(capsys):
    blocks = backend_blocks(run_info(capsys))
    cpu = next(v for k, v in blocks.items() if k.startswith("cpu "))
    gpus = {k: v for k, v in blocks.items() if k.startswith("cuda")}
    assert len(blocks) == 1 + len(gpus) and len(gpus) == max(1, torch.cuda.device_count())
    for table in blocks.values():
        assert list(table) == list(_ops.BACKENDS)
    for backend, (available, reason, _) in cpu.items():
        assert available == _ops.backend_available(backend, "cpu"), (backend, reason)
        assert reason
    assert [b for b, (_, _, auto) in cpu.items() if auto] == [_ops._resolve_backend(None, torch.device("cpu"), None)]
    assert "CUDA tensors only" in cpu["cuda"][1]
    for heading, table in gpus.items():
        if not torch.cuda.is_available():
            assert heading == "cuda (no GPU)"
            assert all(not ok and reason.startswith("no GPU") for ok, reason, _ in table.values())
            continue
        for backend, (available, reason, _) in table.items():
            # never claimed where the op layer refuses (info is stricter: the GPU's architecture)
            assert not available or _ops.backend_available(backend, heading.split()[0]), (backend, reason)


def test_python_dash_m_fgfw_info_without_the_interpreter():
    """`python -m fgfw info` as a user runs it, without TRITON_INTERPRET: on the CPU triton is unavailable (the
    op layer runs CPU tensors only in the interpreter) and says why."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FGFW_BACKEND")}
    result = subprocess.run([sys.executable, "-m", "fgfw", "info"], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert result.stdout.startswith("fgfw     ")
    cpu = next(v for k, v in backend_blocks(result.stdout).items() if k.startswith("cpu "))
    available, reason, _ = cpu["triton"]
    assert not available
    assert "TRITON_INTERPRET=1" in reason or "triton is not installed" in reason


def test_missing_triton_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton raises, find_spec finds nothing
    available, reason = info.backend_status("triton", torch.device("cpu"))
    assert not available and reason.startswith("triton is not installed")


def test_a_missing_extension_is_reported_as_not_built(tmp_path):
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text('import sys\nsys.modules["fgfw._C"] = None\n')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(shim)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    result = subprocess.run([sys.executable, "-m", "fgfw", "info"], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert "fgfw._C  not loaded: fgfw._C is not built" in result.stdout
    cpu = next(v for k, v in backend_blocks(result.stdout).items() if k.startswith("cpu "))
    assert not cpu["cpu"][0] and "not built" in cpu["cpu"][1]
    assert cpu["torch"][0] and cpu["torch"][2]  # auto falls back to the reference


def test_a_gpu_whose_architecture_is_not_compiled(monkeypatch):
    """A simulated GPU with registered CUDA kernels: available for sm_86 (sm_80 code runs there), not for
    sm_75 or a newer major version without PTX."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_ops, "backend_available", lambda backend, device: True)
    archs = ([80, 90], [])
    for capability, expected in (((8, 6), True), ((9, 0), True), ((7, 5), False), ((12, 0), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        available, reason = info.backend_status("cuda", torch.device("cuda", 0), archs)
        assert available == expected, (capability, reason)
        if not expected:
            sm = f"sm_{capability[0]}{capability[1]}"
            assert reason.startswith(f"architecture {sm} not compiled") and "sm_80, sm_90" in reason
    # PTX runs on any newer GPU; unknown architectures are not held against a GPU
    assert info.arch_problem((12, 0), ([80], [90])) == ""
    assert info.arch_problem((9, 0), ([90], [])) == "" and info.arch_problem((9, 0), ([80], [])) != ""
    assert info.arch_problem((7, 0), None) == ""


def _fatbin(entries) -> bytes:
    """A fatbin as nvcc lays it out: header, then per entry a 64-byte header (kind, arch at byte 28) and payload."""
    body = b""
    for kind, arch in entries:
        payload = bytes(range(24))
        header = bytearray(64)
        struct.pack_into("<HHII", header, 0, kind, 0x101, 64, len(payload))
        struct.pack_into("<I", header, 28, arch)
        body += bytes(header) + payload
    return struct.pack("<IHHQ", info.FATBIN_MAGIC, 1, 16, len(body)) + body


def _elf(sections: dict[str, bytes]) -> bytes:
    """A minimal 64-bit little-endian ELF file holding ``sections`` (and its section name table)."""
    names = b"\0" + b"".join(n.encode() + b"\0" for n in [".shstrtab", *sections])
    data, layout, offset = b"", [], 64
    for payload in [names, *sections.values()]:
        layout.append((offset + len(data), len(payload)))
        data += payload
    shoff = 64 + len(data)
    header = bytearray(64)
    header[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<Q", header, 0x28, shoff)
    struct.pack_into("<HHH", header, 0x3A, 64, 1 + len(layout), 1)
    table = bytes(64)  # section 0: the null section
    name_at = 1
    for name, (at, size) in zip([".shstrtab", *sections], layout):
        table += struct.pack("<IIQQQQIIQQ", name_at, 1, 0, 0, at, size, 0, 0, 1, 0)
        name_at += len(name) + 1
    return bytes(header) + data + table


def test_architectures_are_read_from_the_fatbin_section(tmp_path):
    so = tmp_path / "_C.so"
    # two objects' fatbins (as two .cu files give), 8-byte padding between them
    so.write_bytes(_elf({".text": b"\x90" * 16,
                         ".nv_fatbin": _fatbin([(2, 80), (2, 90), (1, 90)]) + bytes(8) + _fatbin([(2, 80)])}))
    assert info.extension_cuda_archs(str(so)) == ([80, 90], [90])
    assert info.describe_archs(([80, 90], [90])).startswith("sm_80, sm_90 (machine code); compute_90 (PTX")
    cpu_only = tmp_path / "cpu_only.so"
    cpu_only.write_bytes(_elf({".text": b"\x90" * 16}))
    assert info.extension_cuda_archs(str(cpu_only)) == ([], []) and info.describe_archs(([], [])) == "none"
    broken = tmp_path / "broken.so"
    broken.write_bytes(_elf({".nv_fatbin": b"\x01" * 40}))
    not_elf = tmp_path / "not_elf.so"
    not_elf.write_bytes(b"MZ" + bytes(100))
    for path in (broken, not_elf, tmp_path / "missing.so"):
        assert info.extension_cuda_archs(str(path)) is None
    assert info.describe_archs(None).startswith("unknown")


def test_the_built_extension_holds_the_architectures_its_kernels_need():
    if not fgfw.HAS_COMPILED_EXTENSION:
        pytest.skip(f"fgfw._C is not loaded here ({_ops.extension_import_error()})")
    archs = info.extension_cuda_archs()
    assert archs is not None
    if _ops._has_kernel("l1_fw_step_", "CUDA"):
        assert archs[0] or archs[1]
        if torch.cuda.is_available():  # the GPU the tests run on runs the kernels
            assert info.arch_problem(torch.cuda.get_device_capability(0), archs) == ""
    else:
        assert archs == ([], [])


def test_bench_measures_the_copy_and_the_fused_step():
    result = info.bench("cpu", seconds=0.2, numel=1 << 16)
    assert result["backend"] == _ops._resolve_backend(None, torch.device("cpu"), None)
    assert result["params"] == 1 << 16
    for key in ("copy_gbps", "step_gbps", "step_ms"):
        assert math.isfinite(result[key]) and result[key] > 0
    assert result["fraction"] == pytest.approx(result["step_gbps"] / result["copy_gbps"])
    assert result["step_ms"] == pytest.approx(1e3 * (1 << 16) * 16 / (result["step_gbps"] * 1e9))


def test_info_bench_prints_its_line(capsys, monkeypatch):
    monkeypatch.setattr(cli, "BENCH_SECONDS", 0.2)
    real_bench = info.bench
    monkeypatch.setattr(info, "bench", lambda seconds: real_bench(seconds=seconds, numel=1 << 16))
    out = run_info(capsys, "--bench")
    line = out.splitlines()[-1]
    assert re.fullmatch(r"bench    .+, 0\.2 s: copy [\d.]+ GB/s; fused AFGFW step \(\w+ backend, 65,536 params, "
                        r"16 B/param\) [\d.e+-]+ ms = [\d.]+ GB/s, \d+% of the copy", line), line
    assert "bench " not in run_info(capsys)  # only when asked for

