"""The model catalogue: what the models directory holds, read from the files' own headers.

Standard library only and pure apart from reading headers: the server uses it for
`GET /v1/models` and jailed code gets the same list from `appliance.tools.models()`, so
both give the same answer. Only headers are read (never tensor data), every count in
them is bounded by the GGUF reader, and a file that cannot be read is listed with its
error rather than breaking the list. Links are followed only where they stay inside the
directory, as `resolve_model` does when a model is loaded.
"""

from __future__ import annotations

import os
import struct
from dataclasses import asdict, dataclass
from typing import Any

from appliance.inside.tools import shaping

GGML_MAGIC = 0x67676D6C
MAX_DEPTH = 4  # subdirectories deep
MAX_ENTRIES = 10000  # entries looked at in all: a huge directory cannot stall the caller
# whisper.cpp's models by their encoder's width and depth, with their parameter counts.
WHISPER_SIZES = {
    (384, 4): ("tiny", 39_000_000),
    (512, 6): ("base", 74_000_000),
    (768, 12): ("small", 244_000_000),
    (1024, 24): ("medium", 769_000_000),
    (1280, 32): ("large", 1_550_000_000),
}
WHISPER_FTYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1"}


@dataclass(frozen=True)
class ModelInfo:
    """One model file of the catalogue."""

    name: str  # path inside the models directory: what load_llm/transcribe take
    kind: str  # "llm" (GGUF, llama.cpp) or "whisper" (ggml, whisper.cpp)
    file_bytes: int
    architecture: str | None = None
    quantisation: str | None = None
    parameters: int | None = None
    gpu_mb_full_offload: int | None = None  # estimate: every layer on the GPU, default context
    error: str | None = None  # why the header could not be read (the file is listed anyway)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def catalogue(root: str) -> list[ModelInfo]:  # noqa: C901 (one directory walk; each branch refuses an unsafe or unreadable entry)
    """Every GGUF and whisper ggml file under root (sorted by name); [] when root is missing."""
    real_root = os.path.realpath(root)
    if not os.path.isdir(real_root):
        return []
    found: list[ModelInfo] = []
    seen = 0
    stack: list[tuple[str, int]] = [(real_root, 0)]
    while stack and seen < MAX_ENTRIES:
        folder, depth = stack.pop()
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError:
            continue
        for entry in entries:
            seen += 1
            if seen > MAX_ENTRIES:
                break
            real = os.path.realpath(entry.path)
            if os.path.commonpath([real, real_root]) != real_root:
                continue  # a link out of the directory: load_llm would refuse it too
            if os.path.isdir(real):
                if depth < MAX_DEPTH and not entry.is_symlink():
                    stack.append((real, depth + 1))
                continue
            if os.path.isfile(real):
                info = describe(real, os.path.relpath(entry.path, real_root))
                if info is not None:
                    found.append(info)
    return sorted(found, key=lambda m: m.name)


def describe(path: str, name: str) -> ModelInfo | None:
    """One file's entry, or None when it is no model (neither GGUF nor whisper ggml)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as fh:
            head = fh.read(4 + 11 * 4)
    except OSError as exc:
        return ModelInfo(name, "unknown", 0, error=f"cannot read: {exc.strerror}")
    if head[:4] == shaping.GGUF_MAGIC:
        try:
            gguf = shaping.read_gguf(path)
        except (shaping.GgufError, OSError) as exc:
            return ModelInfo(name, "llm", size, error=str(exc))
        full = shaping.choose(gguf, budget_mb=1 << 30)
        return ModelInfo(
            name,
            "llm",
            size,
            architecture=gguf.architecture,
            quantisation=gguf.quantisation,
            parameters=gguf.n_params,
            gpu_mb_full_offload=full.estimate_mb,
        )
    if len(head) >= 4 and struct.unpack("<I", head[:4])[0] == GGML_MAGIC:
        if len(head) < 4 + 11 * 4:
            return ModelInfo(name, "whisper", size, error="truncated whisper header")
        hparams = struct.unpack("<11i", head[4:])
        audio_state, audio_layers, ftype = hparams[2], hparams[4], hparams[10]
        size_name, params = WHISPER_SIZES.get((audio_state, audio_layers), ("custom", None))
        return ModelInfo(
            name,
            "whisper",
            size,
            architecture=f"whisper-{size_name}",
            quantisation=WHISPER_FTYPES.get(ftype, f"ftype {ftype}"),
            parameters=params,
            gpu_mb_full_offload=-(-size // shaping.MIB) + shaping.WHISPER_BUFFERS_MB,
        )
    return None
