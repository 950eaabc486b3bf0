"""Slim a llama-cpp-python wheel built here for the GPU kit (scripts/cuda-wheel.sh calls it).

    python scripts/wheel_slim.py IN.whl OUT.whl PATCHELF
    python scripts/wheel_slim.py --installed OUT.whl -     # the running Python's own install

The second form packs this Python's installed llama-cpp-python (the venv's CPU build) into a
slim wheel, for the kit in simulation where no CUDA build was made (scripts/gpu-kit.sh,
GPU_KIT_LLAMA=venv); "-" leaves each RUNPATH as it is, which must then be `$ORIGIN` already.

A wheel cannot hold symbolic links, so the build's `libX.so -> libX.so.0 -> libX.so.0.25.3`
become three copies of each library: with a 67 MB libggml-cuda that is three times over the
kit's 64 MiB (and CMake's install puts them at the wheel's top level once more). Kept: only
the llama_cpp package and its metadata; each library under its SONAME (`libX.so.0`: what the others' DT_NEEDED
name) and, for the two that llama_cpp opens by file name (`libllama.so`, `libggml.so`), that
name too. Every library's RUNPATH is set to `$ORIGIN` alone: the build links cuBLAS from a
temporary folder under /tmp, and a RUNPATH into /tmp would let whoever creates that folder on
the target have their library loaded by the appliance. Fails unless every llama/ggml library a
kept one needs is kept.
"""

from __future__ import annotations

import base64
import hashlib
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

LIB = "llama_cpp/lib/"
OPENED_BY_NAME = {"libllama.so", "libggml.so"}  # llama_cpp/_ctypes_extensions.load_shared_library


def keep(name: str) -> bool:
    if not name.startswith("llama_cpp/"):
        # CMake's install also lands at the wheel's top level (lib/, include/, bin/: the same
        # libraries again, headers, cmake files); llama_cpp loads only from llama_cpp/lib.
        return ".dist-info/" in name
    if not name.startswith(LIB):
        return True
    base = name[len(LIB) :]
    if re.search(r"\.so\.\d+\.\d+\.\d+$", base):  # the real file behind the SONAME
        return False
    if base.endswith(".so"):
        return base in OPENED_BY_NAME
    return True


def objdump(path: Path) -> str:
    return subprocess.run(["objdump", "-p", str(path)], capture_output=True, text=True, check=True).stdout


def needed(path: Path) -> list[str]:
    return re.findall(r"^\s+NEEDED\s+(\S+)$", objdump(path), re.M)


def installed_wheel(path: Path) -> None:
    """The installed llama-cpp-python as a wheel (tagged like the CUDA one: ctypes only)."""
    from importlib import metadata

    dist = metadata.distribution("llama-cpp-python")
    root = Path(str(dist.locate_file("")))
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for item in dist.files or []:
            name = str(item)
            if name.startswith("..") or "__pycache__" in name or name.endswith(("RECORD", "INSTALLER", "REQUESTED")):
                continue
            if name.endswith("direct_url.json"):
                continue
            data = (root / name).read_bytes()
            if name.endswith(".dist-info/WHEEL"):
                data = b"Wheel-Version: 1.0\nGenerator: wheel_slim\nRoot-Is-Purelib: false\nTag: py3-none-linux_x86_64\n"
            z.writestr(name, data)
        z.writestr(f"llama_cpp_python-{dist.version}.dist-info/RECORD", "")


def main(src: str, dst: str, patchelf: str) -> None:
    if src == "--installed":
        from importlib import metadata

        version = metadata.version("llama-cpp-python")
        raw = Path(tempfile.mkdtemp()) / f"llama_cpp_python-{version}-py3-none-linux_x86_64.whl"
        installed_wheel(raw)
        src = str(raw)
    rows = []
    with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(src) as zin:
        kept = [n for n in zin.namelist() if keep(n) and not n.endswith(".dist-info/RECORD")]
        record = next(n for n in zin.namelist() if n.endswith(".dist-info/RECORD"))
        libs = {n[len(LIB) :] for n in kept if n.startswith(LIB)}
        with zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
            for name in kept:
                data = zin.read(name)
                if name.startswith(LIB) and ".so" in name:
                    path = Path(tmp) / Path(name).name
                    path.write_bytes(data)
                    if patchelf != "-":
                        subprocess.run([patchelf, "--set-rpath", "$ORIGIN", str(path)], check=True)
                    runpath = re.findall(r"^\s+(?:RUNPATH|RPATH)\s+(\S+)$", objdump(path), re.M)
                    if runpath not in ([], ["$ORIGIN"]):
                        sys.exit(f"wheel_slim: {name} has RUNPATH {runpath}, not $ORIGIN")
                    missing = [n for n in needed(path) if n.startswith(("libggml", "libllama", "libmtmd")) and n not in libs]
                    if missing:
                        sys.exit(f"wheel_slim: {name} needs {missing}, which the slim wheel would lack")
                    data = path.read_bytes()
                info = zin.getinfo(name)
                out = zipfile.ZipInfo(name, info.date_time)
                out.external_attr = info.external_attr
                out.compress_type = zipfile.ZIP_DEFLATED
                zout.writestr(out, data)
                digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
                rows.append(f"{name},sha256={digest},{len(data)}")
            rows.append(f"{record},,")
            zout.writestr(record, "\n".join(rows) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:4])
