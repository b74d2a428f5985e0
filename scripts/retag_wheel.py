"""Gives a built fgfw wheel the torch it was built against: a local version tag (0.1.0+torch2.14.1.cpu)
and an exact torch requirement (torch==2.14.1).

The compiled extension calls torch's C++ API, which has no stable ABI: it loads only into the torch it
was compiled with. pip cannot know that from the static metadata of pyproject.toml (a range, so that a
source build works with any supported torch), so each wheel gets it written in. Rewrites METADATA,
renames the .dist-info folder and regenerates RECORD (hashes and sizes), as the wheel format asks.

    python scripts/retag_wheel.py dist/fgfw-0.1.0-*.whl --local torch2.14.1.cpu --torch 2.14.1 --out dist/
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import re
import sys
import zipfile
from pathlib import Path


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def retag(wheel: Path, local: str, torch_version: str, out_dir: Path) -> Path:
    if not re.fullmatch(r"[A-Za-z0-9]+(\.[A-Za-z0-9]+)*", local):
        raise ValueError(f"--local must be a PEP 440 local version label such as torch2.14.1.cpu, got {local!r}")
    name, version, *tags = wheel.name[:-len(".whl")].split("-")
    if "+" in version:
        raise ValueError(f"{wheel.name} already has a local version ({version})")
    new_version = f"{version}+{local}"
    old_info, new_info = f"{name}-{version}.dist-info/", f"{name}-{new_version}.dist-info/"
    files: dict[str, bytes] = {}
    with zipfile.ZipFile(wheel) as zin:
        for item in zin.infolist():
            if item.filename == old_info + "RECORD":
                continue  # written anew below
            data = zin.read(item)
            target = new_info + item.filename[len(old_info):] if item.filename.startswith(old_info) else item.filename
            files[target] = data
    metadata = files[new_info + "METADATA"].decode()
    metadata, versions = re.subn(r"^Version: .*$", f"Version: {new_version}", metadata, count=1, flags=re.M)
    metadata, torches = re.subn(r"^Requires-Dist: torch\b[^;\n]*", f"Requires-Dist: torch=={torch_version}", metadata,
                                count=1, flags=re.M)
    if versions != 1 or torches != 1:
        raise ValueError(f"{wheel.name}: METADATA has no Version or no torch requirement to rewrite")
    files[new_info + "METADATA"] = metadata.encode()
    record = [f"{path},{_record_hash(data)},{len(data)}" for path, data in files.items()]
    record.append(f"{new_info}RECORD,,")
    files[new_info + "RECORD"] = ("\n".join(record) + "\n").encode()
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / ("-".join([name, new_version, *tags]) + ".whl")
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED) as zout:
        for path, data in files.items():
            zout.writestr(path, data)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wheel", type=Path)
    parser.add_argument("--local", required=True, help="local version label, e.g. torch2.14.1.cu130")
    parser.add_argument("--torch", required=True, help="the torch version the wheel requires exactly, e.g. 2.14.1")
    parser.add_argument("--out", type=Path, required=True, help="folder for the retagged wheel")
    args = parser.parse_args(argv)
    print(retag(args.wheel, args.local, args.torch, args.out))


if __name__ == "__main__":
    sys.exit(main())
