"""What the installed llama.cpp and whisper.cpp bindings can do: import, GPU offload, one ggml each.

Standard library plus the bindings (it runs inside the jail, and in the server's startup
probe as `python -m appliance.inside.tools.backends`, which prints the report as JSON).

- llama-cpp-python says whether its build can offload: `llama_supports_gpu_offload()`, which
  needs a device the CUDA runtime can see; `llama_print_system_info()` lists the ggml backends
  compiled in ("CUDA : ARCHS = 900 | ...") whether or not a device is there (an image build).
- pywhispercpp has no such call; `whisper_print_system_info()` lists every ggml backend
  registered in its build ("CPU : SSE3 = 1 | ...", "CUDA : ARCHS = 900 | ..."), and a
  GPU backend among them is what offload needs.
- Both ship a ggml. PyPI's pywhispercpp wheel renames its copies (`libggml-base-<hash>.so`);
  a source build keeps the plain SONAMEs (`libggml-base.so.0`) that llama-cpp-python also
  uses, for another ggml version. The dynamic loader satisfies a SONAME once per process,
  so whichever binding loads second silently runs on the other's ggml. `ggml_conflicts`
  finds that: a ggml library a binding ships whose SONAME was taken by another file.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import os
import re
import struct
from collections.abc import Iterable, Mapping
from typing import Any

# ggml backends that put work on a GPU (ggml_backend_reg_name of each).
GPU_BACKENDS = frozenset({"CUDA", "HIP", "ROCm", "Vulkan", "Metal", "MTL", "SYCL", "CANN", "MUSA", "OpenCL"})
CUDA_FIX = (
    'reinstall it with CUDA: CMAKE_ARGS="-DGGML_CUDA=on" pip install --force-reinstall '
    '--no-cache-dir {package} (needs nvcc; see docs/gpu.md, "A CUDA build on a host")'
)
_SONAME = re.compile(r"^(lib[A-Za-z0-9_+-]*?)(-[0-9a-f]{8})?\.so(\.\d+)?")


def ggml_backends(system_info: str) -> list[str]:
    """The ggml backend names in whisper_print_system_info()'s (or llama_print_system_info()'s)
    text, in order ("WHISPER" is not one)."""
    names = []
    for part in system_info.split("|"):
        if " : " in part:
            name = part.split(" : ", 1)[0].strip()
            if name and name != "WHISPER" and name not in names:
                names.append(name)
    return names


@functools.lru_cache(maxsize=1)
def llama_cpp() -> dict[str, Any]:
    """{"available", "version", "gpu_offload", "backends", "error"} for llama-cpp-python (imported once)."""
    try:
        mod = importlib.import_module("llama_cpp")
        offload = bool(mod.llama_supports_gpu_offload())
        info = mod.llama_print_system_info()
    except Exception as exc:  # noqa: BLE001 (a native import fails in many ways; each is the finding)
        return {
            "available": False,
            "version": None,
            "gpu_offload": False,
            "backends": [],
            "error": f"{type(exc).__name__}: {exc}",
        }
    text = info.decode(errors="replace") if isinstance(info, bytes) else str(info)
    return {
        "available": True,
        "version": getattr(mod, "__version__", None),
        "gpu_offload": offload,
        "backends": ggml_backends(text),
        "error": None,
    }


@functools.lru_cache(maxsize=1)
def whisper() -> dict[str, Any]:
    """{"available", "version", "gpu_offload", "backends", "error"} for pywhispercpp."""
    try:
        importlib.import_module("pywhispercpp.model")
        native = importlib.import_module("_pywhispercpp")
        info = str(native.whisper_print_system_info())
    except Exception as exc:  # noqa: BLE001 (a native import fails in many ways; each is the finding)
        return {
            "available": False,
            "version": None,
            "gpu_offload": False,
            "backends": [],
            "error": f"{type(exc).__name__}: {exc}",
        }
    backends = ggml_backends(info)
    version = None
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        version = dist_version("pywhispercpp")
    except PackageNotFoundError:  # metadata is optional; the binding works without it
        version = None
    return {
        "available": True,
        "version": version,
        "gpu_offload": any(b in GPU_BACKENDS for b in backends),
        "backends": backends,
        "error": None,
    }


def soname_key(filename: str) -> str | None:
    """`libggml-base.so.0.13.1` -> `libggml-base.so`; a wheel-repaired `libggml-base-319ad4fb.so.0`
    keeps its hash (it cannot collide); None for a file that is not a ggml/whisper/llama library."""
    m = _SONAME.match(filename)
    if not m or not m.group(1).startswith(("libggml", "libwhisper", "libllama")):
        return None
    return m.group(1) + (m.group(2) or "") + ".so"


def ggml_conflicts(mapped: Iterable[str], shipped: Mapping[str, Iterable[str]]) -> list[str]:
    """Libraries a binding ships whose SONAME was taken in this process by another binding's file.

    mapped: real paths of the shared objects this process has mapped (/proc/self/maps).
    shipped: binding name -> real paths of the ggml libraries it ships. Pure: no I/O.
    """
    loaded: dict[str, str] = {}
    for path in mapped:
        key = soname_key(os.path.basename(path))
        if key is not None:
            loaded.setdefault(key, path)
    found = []
    for binding, files in sorted(shipped.items()):
        for path in sorted(set(files)):
            key = soname_key(os.path.basename(path))
            if key is None or key not in loaded:
                continue
            if loaded[key] != path and not _same_file(loaded[key], path):
                found.append(
                    f"{binding} ships {os.path.basename(path)} but this process runs it on "
                    f"{loaded[key]} (same SONAME, another build)"
                )
    return found


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def mapped_libraries() -> list[str]:
    """Real paths of the shared objects mapped into this process."""
    paths = []
    try:
        with open("/proc/self/maps") as fh:
            for line in fh:
                parts = line.split(None, 5)
                if len(parts) == 6 and ".so" in parts[5]:
                    paths.append(os.path.realpath(parts[5].strip()))
    except OSError:
        return []
    return sorted(set(paths))


def elf_dynamic(path: str) -> tuple[list[str], list[str]]:  # noqa: C901 (one ELF walk; each branch a bound check on untrusted bytes)
    """(DT_NEEDED names, DT_RUNPATH/DT_RPATH entries) of a 64-bit little-endian ELF file."""
    with open(path, "rb") as fh:
        data = fh.read()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return [], []
    (phoff,) = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    loads, dynamic = [], None
    for i in range(phnum):
        p_type, _, p_offset, p_vaddr, _, p_filesz = struct.unpack_from("<IIQQQQ", data, phoff + i * phentsize)
        if p_type == 1:
            loads.append((p_vaddr, p_offset, p_filesz))
        elif p_type == 2:
            dynamic = (p_offset, p_filesz)
    if dynamic is None:
        return [], []
    entries = []
    for off in range(dynamic[0], dynamic[0] + dynamic[1], 16):
        tag, val = struct.unpack_from("<qQ", data, off)
        if tag == 0:
            break
        entries.append((tag, val))
    strtab = next((v for t, v in entries if t == 5), None)  # DT_STRTAB: a virtual address
    if strtab is None:
        return [], []
    base = next((off + strtab - va for va, off, size in loads if va <= strtab < va + size), None)
    if base is None:
        return [], []

    def string(at: int) -> str:
        end = data.index(b"\0", base + at)
        return data[base + at : end].decode(errors="replace")

    needed = [string(v) for t, v in entries if t == 1]
    paths = [p for t, v in entries if t in (15, 29) for p in string(v).split(":") if p]
    return needed, paths


def expected_libraries(native: str) -> list[str]:
    """The ggml-family libraries `native` (a binding's shared object) should load: its
    DT_NEEDED names found through its own RPATH/RUNPATH, followed the same way, as real paths."""
    found: list[str] = []
    todo = [os.path.realpath(native)]
    seen: set[str] = set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        try:
            needed, paths = elf_dynamic(path)
        except (OSError, struct.error, ValueError, IndexError):
            continue
        origin = os.path.dirname(path)
        dirs = [p.replace("$ORIGIN", origin).replace("${ORIGIN}", origin) for p in paths] + [origin]
        for name in needed:
            if soname_key(name) is None:
                continue
            for d in dirs:
                candidate = os.path.join(d, name)
                if os.path.exists(candidate):
                    real = os.path.realpath(candidate)
                    if real not in found:
                        found.append(real)
                    todo.append(real)
                    break
    return sorted(found)


def shipped_libraries() -> dict[str, list[str]]:
    """binding -> the ggml libraries its native code should load (where its build put them)."""
    found: dict[str, list[str]] = {}
    try:
        llama = importlib.util.find_spec("llama_cpp")
        if llama is not None and llama.origin:
            lib = os.path.join(os.path.dirname(llama.origin), "lib")
            natives = [os.path.join(lib, n) for n in sorted(os.listdir(lib)) if n.startswith("libllama.so")]
            found["llama_cpp"] = sorted({p for n in natives[:1] for p in expected_libraries(n)})
    except (ImportError, ValueError, OSError):
        pass
    try:
        whisper_ext = importlib.util.find_spec("_pywhispercpp")
        if whisper_ext is not None and whisper_ext.origin:
            found["whisper"] = expected_libraries(whisper_ext.origin)
    except (ImportError, ValueError):
        pass
    return found


def probe() -> dict[str, Any]:
    """Import both bindings in this one process and report what each can do, and any ggml clash."""
    report: dict[str, Any] = {"llama_cpp": llama_cpp(), "whisper": whisper()}
    report["ggml_conflicts"] = ggml_conflicts(mapped_libraries(), shipped_libraries())
    return report


if __name__ == "__main__":  # the server's startup probe: python -m appliance.inside.tools.backends
    print(json.dumps(probe()))
