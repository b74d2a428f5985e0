"""``fgfw info``: what is installed and built here, which backends can run on each device (and why not),
and, with ``--bench``, a 5-second measure of the copy bandwidth and the fused step's fraction of it.

The CUDA architectures of the extension are read from the ``.nv_fatbin`` section of ``fgfw._C``'s shared
object: they are what the binary holds, whatever the build was asked for, and need no tool from the CUDA
toolkit (cuobjdump is not installed everywhere) nor a rebuild of an existing extension.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import statistics
import struct
import time
from collections.abc import Callable

import torch

from . import _ops, reference

FATBIN_MAGIC = 0xBA55ED50
# kinds of the entries of a fatbin: PTX text (JIT-compiled by the driver for newer GPUs) and machine code
FATBIN_PTX, FATBIN_CUBIN = 1, 2
AUTO_ORDER = ("cuda", "cpu", "triton", "torch")  # _ops._resolve_backend's order (the interpreter never)


# -- the extension's CUDA architectures ------------------------------------------------------------------------------
def _elf_section(path: str, name: str) -> bytes | None:
    """The bytes of section ``name`` of a 64-bit little-endian ELF file, None when it has no such section.

    Raises ValueError for another kind of file, OSError or struct.error for an unreadable or truncated one.
    """
    with open(path, "rb") as f:
        head = f.read(64)
        if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
            raise ValueError(f"{path}: not a 64-bit little-endian ELF file")
        (shoff,) = struct.unpack_from("<Q", head, 0x28)
        shentsize, shnum, shstrndx = struct.unpack_from("<HHH", head, 0x3A)
        f.seek(shoff)
        table = f.read(shentsize * shnum)
        # (name offset, type, flags, address, file offset, size) of each section
        sections = [struct.unpack_from("<IIQQQQ", table, i * shentsize) for i in range(shnum)]
        names_at, names_size = sections[shstrndx][4], sections[shstrndx][5]
        f.seek(names_at)
        names = f.read(names_size)
        wanted = name.encode()
        for name_at, _type, _flags, _addr, offset, size in sections:
            if names[name_at:names.find(b"\0", name_at)] == wanted:
                f.seek(offset)
                return f.read(size)
    return None


def fatbin_archs(blob: bytes) -> tuple[list[int], list[int]]:
    """(machine-code, PTX) architectures of the fatbins in ``blob`` (an .nv_fatbin section), as sorted
    ints (80 = sm_80). Layout (CUDA's fatbinary.h): a 16-byte header (magic, version, header size, size of
    what follows), then entries, each a header (kind u16, version u16, header size u32, payload size u32,
    ..., architecture u32 at byte 28) and its payload. Raises ValueError where the bytes do not parse."""
    sass, ptx = set(), set()
    pos = 0
    try:
        while pos + 16 <= len(blob):
            magic, _version, header, size = struct.unpack_from("<IHHQ", blob, pos)
            if magic == 0:  # alignment padding between the fatbins of several objects
                pos += 8
                continue
            if magic != FATBIN_MAGIC:
                raise ValueError(f"no fatbin header at byte {pos} (0x{magic:08x})")
            entry, end = pos + header, pos + header + size
            while entry < end:
                kind, _version, entry_header, payload = struct.unpack_from("<HHII", blob, entry)
                (arch,) = struct.unpack_from("<I", blob, entry + 28)
                if entry_header == 0:
                    raise ValueError(f"empty fatbin entry header at byte {entry}")
                if kind == FATBIN_PTX:
                    ptx.add(arch)
                elif kind == FATBIN_CUBIN:
                    sass.add(arch)
                entry += entry_header + payload
            pos = end
    except struct.error as err:
        raise ValueError(f"truncated fatbin ({err})") from None
    return sorted(sass), sorted(ptx)


def extension_cuda_archs(path: str | None = None) -> tuple[list[int], list[int]] | None:
    """(machine-code, PTX) CUDA architectures compiled into fgfw._C (``path``: its shared object), ([], [])
    for a build without CUDA code, None when the extension is not loaded or its file cannot be read."""
    path = path or _ops.extension_file()
    if path is None:
        return None
    try:
        blob = _elf_section(path, ".nv_fatbin")
        return ([], []) if blob is None else fatbin_archs(blob)
    except (OSError, ValueError, struct.error):
        return None


def describe_archs(archs: tuple[list[int], list[int]] | None) -> str:
    if archs is None:
        return "unknown (the .nv_fatbin section of fgfw._C could not be read)"
    sass, ptx = archs
    if not sass and not ptx:
        return "none"
    parts = [", ".join(f"sm_{a}" for a in sass) + " (machine code)"] if sass else []
    parts += [", ".join(f"compute_{a}" for a in ptx) + " (PTX, JIT-compiled for newer GPUs)"] if ptx else []
    return "; ".join(parts)


def arch_problem(capability: tuple[int, int], archs: tuple[list[int], list[int]] | None) -> str:
    """Why kernels compiled for ``archs`` cannot run on a GPU of compute ``capability``, or '' when they can
    (or when the architectures are unknown: nothing is claimed then). Machine code runs on GPUs of its
    major version and an equal or higher minor one; PTX on any GPU at least as new."""
    if archs is None:
        return ""
    major, minor = capability
    sass, ptx = archs
    if any(a // 10 == major and a % 10 <= minor for a in sass) or any(a <= 10 * major + minor for a in ptx):
        return ""
    return (f"architecture sm_{major}{minor} not compiled (fgfw._C has {describe_archs(archs)}); rebuild with "
            f"TORCH_CUDA_ARCH_LIST={major}.{minor}")


# -- backends ---------------------------------------------------------------------------------------------------------
def _triton_state() -> tuple[str | None, str]:
    """(triton's version or None, why fgfw.triton cannot be used or '')."""
    if importlib.util.find_spec("triton") is None:
        return None, "triton is not installed (pip install triton; Linux with an NVIDIA GPU)"
    try:
        version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown version"
    try:
        from . import triton as fgfw_triton  # noqa: F401
        import triton  # noqa: F401
    except ImportError as err:
        return version, f"triton failed to import ({type(err).__name__}: {err})"
    return version, ""


def _no_gpu_reason() -> str:
    if not torch.version.cuda:
        return f"no GPU: torch {torch.__version__} is a CPU-only build"
    return "no GPU: torch finds no CUDA device"


def backend_status(backend: str, device: torch.device,
                   archs: tuple[list[int], list[int]] | None = None) -> tuple[bool, str]:
    """(whether ``backend`` runs on tensors of ``device`` here, what it is or why it cannot).

    As :func:`fgfw._ops.backend_available`, and stricter on a GPU: CUDA kernels not compiled for its
    architecture, and any backend on a CUDA device when there is no GPU, are unavailable.
    """
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        return False, _no_gpu_reason()
    available = _ops.backend_available(backend, device)
    if backend == "torch":
        return available, "fgfw.reference, the pure-torch spec (slow)"
    if backend in ("cpu", "cuda"):
        if device.type != backend:
            return False, f"{backend.upper()} tensors only"
        if not available:
            return False, _ops._extension_problem(backend) or f"fgfw._C has no {backend.upper()} kernels"
        if backend == "cuda":
            problem = arch_problem(torch.cuda.get_device_capability(device), archs)
            if problem:
                return False, problem
            return True, "CUDA kernels of fgfw._C"
        return True, "C++ kernels of fgfw._C"
    if backend == "triton":
        _version, problem = _triton_state()
        if problem:
            return False, problem
        interpreting = os.environ.get("TRITON_INTERPRET") == "1"
        if device.type == "cpu" and not available:
            return False, ("CPU tensors only in triton's interpreter: set TRITON_INTERPRET=1 before fgfw is "
                           "imported (slow; for tests)")
        if not available:
            return False, f"fgfw.triton cannot run on {device.type} tensors"
        return True, ("triton's interpreter (TRITON_INTERPRET=1; slow, never chosen automatically)" if interpreting
                      else "Triton kernels of fgfw.triton, compiled for the GPU")
    return False, f"unknown backend (one of {_ops.BACKENDS})"


def devices() -> list[torch.device]:
    """The CPU and every GPU; a 'cuda' entry when there is none, to say why nothing runs there."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [torch.device("cpu")] + ([torch.device("cuda", i) for i in range(count)] or [torch.device("cuda")])


def backend_table(device: torch.device, archs) -> list[tuple[str, bool, str]]:
    """(backend, available, what or why) for every backend of _ops.BACKENDS on ``device``."""
    return [(b, *backend_status(b, device, archs)) for b in _ops.BACKENDS]


def auto_choice(table: list[tuple[str, bool, str]], device: torch.device) -> str | None:
    """What backend=None picks on ``device`` (ignoring $FGFW_BACKEND): the first available in AUTO_ORDER."""
    available = {b for b, ok, _ in table if ok}
    for b in AUTO_ORDER:
        if b in available and not (b == "triton" and device.type != "cuda"):
            return b
    return None


# -- the report -------------------------------------------------------------------------------------------------------
def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def cuda_driver_version() -> str | None:
    """The CUDA version the installed NVIDIA driver supports ("13.0"), None without a driver. Asked of
    libcuda directly: torch reports only the CUDA it was built with."""
    try:
        import ctypes

        version = ctypes.c_int()
        if ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version)) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return f"{version.value // 1000}.{version.value % 1000 // 10}"


def _device_name(device: torch.device) -> str:
    if device.type == "cpu":
        return f"cpu ({os.cpu_count()} cores, torch uses {torch.get_num_threads()} threads)"
    if not torch.cuda.is_available():
        return "cuda (no GPU)"
    major, minor = torch.cuda.get_device_capability(device)
    return f"{device} ({torch.cuda.get_device_name(device)}, sm_{major}{minor})"


def report() -> list[str]:
    """The lines ``fgfw info`` prints."""
    import fgfw

    lines = [f"fgfw     {fgfw.__version__} ({os.path.dirname(os.path.abspath(fgfw.__file__))})",
             f"python   {platform.python_version()} ({platform.machine()}, {platform.system()})",
             f"torch    {torch.__version__}"]
    triton_version, triton_problem = _triton_state()
    if triton_version is None:
        lines.append("triton   not installed")
    else:
        if os.environ.get("TRITON_INTERPRET") == "1":
            mode = "interpreter (TRITON_INTERPRET=1)"
        else:
            mode = "compiles for the GPU" if torch.cuda.is_available() else "no GPU to compile for"
        lines.append(f"triton   {triton_version}, {mode}" + (f"; {triton_problem}" if triton_problem else ""))
    driver = cuda_driver_version()
    driver = f"driver {driver}" if driver else "no NVIDIA driver (libcuda.so.1 not found)"
    if torch.cuda.is_available():
        lines.append(f"CUDA     {torch.version.cuda} (torch's build); {driver}")
        for i in range(torch.cuda.device_count()):
            lines.append(f"GPU      {_device_name(torch.device('cuda', i))}")
    else:
        build = f"{torch.version.cuda} (torch's build)" if torch.version.cuda else "none (a CPU-only torch)"
        lines.append(f"CUDA     {build}; {driver}")
        lines.append(f"GPU      none ({_no_gpu_reason().split(': ', 1)[1]})")

    err = _ops.extension_import_error()
    archs = None
    if err is not None:
        lines.append(f"fgfw._C  not loaded: {_ops._extension_problem('cpu')}")
    else:
        lines.append(f"fgfw._C  {_ops.extension_file()}")
        cpu = "yes" if _ops._has_kernel("l1_fw_step_", "CPU") else "no"
        if _ops._has_kernel("l1_fw_step_", "CUDA"):
            archs = extension_cuda_archs()
            cuda = describe_archs(archs)
        else:
            cuda = "none (built without CUDA: FGFW_CUDA=OFF, or no nvcc or a CPU-only torch at build time)"
        lines.append(f"         CPU kernels: {cpu}; CUDA kernels: {cuda}")

    lines.append("backends (auto picks the first available of cuda, cpu, triton, torch; the triton interpreter "
                 "only when named):")
    for device in devices():
        table = backend_table(device, archs)
        auto = auto_choice(table, device)
        lines.append(f"  {_device_name(device)}")
        for backend, ok, why in table:
            lines.append(f"    {backend:<7} {'yes' if ok else 'no ':<4}{why}" + ("  <- auto" if backend == auto else ""))
    chosen = os.environ.get(_ops.BACKEND_ENV_VAR)
    if chosen:
        lines.append(f"${_ops.BACKEND_ENV_VAR}={chosen}: used instead of auto where no backend= is given")
    return lines


# -- --bench ----------------------------------------------------------------------------------------------------------
def _median_per_call(steps: dict[str, Callable[[], object]], seconds: float,
                     sync: Callable[[], None]) -> dict[str, float]:
    """Median seconds per call of each step, timed in turn (one sample of each, round-robin, so that the
    load of a shared machine falls on all alike) until ``seconds`` have passed."""
    deadline = time.perf_counter() + seconds
    calls = {}
    for name, step in steps.items():  # warm-up, and calls per sample: >= 2 ms, which syncs and timers drown less
        step()
        sync()
        start = time.perf_counter()
        step()
        sync()
        calls[name] = max(1, int(2e-3 / max(time.perf_counter() - start, 1e-7)))
    samples = {name: [] for name in steps}
    while not samples[next(iter(steps))] or time.perf_counter() < deadline:
        for name, step in steps.items():
            start = time.perf_counter()
            for _ in range(calls[name]):
                step()
            sync()
            samples[name].append((time.perf_counter() - start) / calls[name])
    return {name: statistics.median(s) for name, s in samples.items()}


def bench(device: torch.device | str | None = None, seconds: float = 5.0, numel: int | None = None) -> dict:
    """The fused AFGFW step (one tangent: theta and v read and written, 16 bytes per float32 parameter)
    against a copy of as many bytes, on the first GPU (else the CPU), with the backend auto picks there.

    Returns device, backend, params, copy_gbps, step_gbps, fraction (step_gbps / copy_gbps), step_ms.
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if numel is None:
        numel = 1 << (26 if device.type == "cuda" else 22)  # 1 GiB and 64 MiB moved per step: past the caches
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            while numel > 1 << 20 and 32 * numel > free // 2:  # theta, v and the copy's two buffers
                numel //= 2
    backend = _ops._resolve_backend(None, device, None)
    bytes_per_param = 16
    gen = torch.Generator(device=device).manual_seed(0)
    theta = 0.01 * torch.randn(numel, device=device, generator=gen)
    v = torch.zeros(numel, device=device)
    # alpha small, so that many steps keep theta far from denormals
    schedule = torch.tensor([1.0, 1e-3, 0.1], dtype=torch.float64, device=device)
    coeffs = torch.tensor([0.5], dtype=torch.float64, device=device)
    gap = torch.zeros((), dtype=torch.float64, device=device)
    src = torch.empty(numel * bytes_per_param // 8, device=device)  # half the bytes read, half written
    dst = torch.empty_like(src)

    def step():
        _ops.l1_fw_step_([theta], [v], [], schedule, coeffs, [1.0], False, [0], 0, reference.GAUSSIAN, gap,
                         backend=backend)

    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    times = _median_per_call({"copy": lambda: dst.copy_(src), "step": step}, seconds, sync)
    moved = numel * bytes_per_param
    copy_gbps, step_gbps = moved / times["copy"] / 1e9, moved / times["step"] / 1e9
    return dict(device=_device_name(device), backend=backend, params=numel, copy_gbps=copy_gbps,
                step_gbps=step_gbps, fraction=step_gbps / copy_gbps, step_ms=times["step"] * 1e3)


def bench_lines(result: dict, seconds: float) -> list[str]:
    return [f"bench    {result['device']}, {seconds:g} s: copy {result['copy_gbps']:.1f} GB/s; fused AFGFW step "
            f"({result['backend']} backend, {result['params']:,} params, 16 B/param) {result['step_ms']:.3g} ms = "
            f"{result['step_gbps']:.1f} GB/s, {100 * result['fraction']:.0f}% of the copy"]


def main(bench_seconds: float | None = None) -> None:
    for line in report():
        print(line, flush=True)
    if bench_seconds:
        print(bench_lines(bench(seconds=bench_seconds), bench_seconds)[0], flush=True)
