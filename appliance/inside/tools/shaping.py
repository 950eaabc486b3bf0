"""Shaping for llama.cpp: `n_gpu_layers` and `n_ctx` chosen from a GPU budget and GGUF metadata.

Standard library only (it runs inside the jail). The GGUF reader parses only the header,
the key/value metadata and the tensor table; it never reads tensor data.

The estimate, in MiB: overhead (CUDA context, compute buffers) + the offloaded layers'
weights + their share of the KV cache (f16 K and V for n_ctx tokens) + the output
layer when every layer is offloaded. It is an estimate: the watchdog, not this, enforces
the budget.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any, BinaryIO

MIB = 1024 * 1024
GGUF_MAGIC = b"GGUF"
OVERHEAD_MB = 320
MIN_CTX = 256
_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
MAX_STRING = 1 << 24
MAX_ITEMS = 1 << 24


class GgufError(ValueError):
    """The file is not a readable GGUF model."""


@dataclass(frozen=True)
class GgufInfo:
    """What shaping needs from a GGUF file."""

    architecture: str
    n_layer: int
    n_ctx_train: int
    n_embd: int
    n_head: int
    n_head_kv: int
    layer_bytes: int  # weights of one repeating block (average)
    other_bytes: int  # embeddings, output layer, norms
    file_bytes: int
    n_params: int = 0  # elements of every tensor together
    quantisation: str = ""  # general.file_type's name, else the blocks' most common tensor type


@dataclass(frozen=True)
class LlamaShape:
    n_gpu_layers: int
    n_ctx: int
    estimate_mb: int


def read_gguf(path: str) -> GgufInfo:
    """Parse a GGUF header; GgufError with a clear reason if it is not one (or is cut short)."""
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        try:
            return _read(fh, size)
        except (struct.error, UnicodeDecodeError, EOFError) as exc:
            raise GgufError(
                f"{os.path.basename(path)} is not a valid GGUF file (truncated or corrupt: {exc})"
            ) from None


def _read(fh: BinaryIO, size: int) -> GgufInfo:  # noqa: C901, PLR0912 (the GGUF header in file order; each branch a bound check on untrusted bytes)
    if fh.read(4) != GGUF_MAGIC:
        raise GgufError("not a GGUF file (bad magic)")
    (version,) = _unpack(fh, "<I")
    if version not in (2, 3):
        raise GgufError(f"unsupported GGUF version {version}")
    n_tensors, n_kv = _unpack(fh, "<QQ")
    if n_tensors > MAX_ITEMS or n_kv > MAX_ITEMS:
        raise GgufError("corrupt GGUF header (absurd counts)")
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = _string(fh)
        (vtype,) = _unpack(fh, "<I")
        meta[key] = _value(fh, vtype)
    tensors: list[tuple[str, int]] = []
    n_params = 0
    block_types: dict[int, int] = {}
    for _ in range(n_tensors):
        name = _string(fh)
        (n_dims,) = _unpack(fh, "<I")
        if n_dims > 8:
            raise GgufError("corrupt GGUF tensor table")
        elements = 1
        for dim in _unpack(fh, f"<{n_dims}Q"):
            elements *= dim
        n_params += elements
        (ggml_type,) = _unpack(fh, "<I")
        if name.startswith("blk."):
            block_types[ggml_type] = block_types.get(ggml_type, 0) + 1
        (offset,) = _unpack(fh, "<Q")
        tensors.append((name, offset))
    align = int(meta.get("general.alignment", 32)) or 32
    data_start = -(-fh.tell() // align) * align
    if data_start > size:
        raise GgufError("truncated GGUF file (no tensor data)")
    ordered = sorted(tensors, key=lambda t: t[1])
    layer_total = other_total = 0
    for i, (name, offset) in enumerate(ordered):
        end = ordered[i + 1][1] if i + 1 < len(ordered) else size - data_start
        nbytes = max(0, end - offset)
        if name.startswith("blk."):
            layer_total += nbytes
        else:
            other_total += nbytes
    arch = str(meta.get("general.architecture", ""))
    if not arch:
        raise GgufError("GGUF file names no architecture")
    n_layer = int(meta.get(f"{arch}.block_count", 0))
    n_head = int(meta.get(f"{arch}.attention.head_count", 1)) or 1
    return GgufInfo(
        architecture=arch,
        n_layer=n_layer,
        n_ctx_train=int(meta.get(f"{arch}.context_length", 2048)),
        n_embd=int(meta.get(f"{arch}.embedding_length", 0)),
        n_head=n_head,
        n_head_kv=int(meta.get(f"{arch}.attention.head_count_kv", n_head)) or n_head,
        layer_bytes=layer_total // n_layer if n_layer else 0,
        other_bytes=other_total,
        file_bytes=size,
        n_params=n_params,
        quantisation=_quantisation(meta.get("general.file_type"), block_types),
    )


# llama.cpp's LLAMA_FTYPE_* (general.file_type) and ggml's tensor types, by number.
FILE_TYPES = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    7: "Q8_0",
    8: "Q5_0",
    9: "Q5_1",
    10: "Q2_K",
    11: "Q3_K_S",
    12: "Q3_K_M",
    13: "Q3_K_L",
    14: "Q4_K_S",
    15: "Q4_K_M",
    16: "Q5_K_S",
    17: "Q5_K_M",
    18: "Q6_K",
    19: "IQ2_XXS",
    20: "IQ2_XS",
    21: "Q2_K_S",
    22: "IQ3_XS",
    23: "IQ3_XXS",
    24: "IQ1_S",
    25: "IQ4_NL",
    26: "IQ3_S",
    27: "IQ3_M",
    28: "IQ2_S",
    29: "IQ2_M",
    30: "IQ4_XS",
    31: "IQ1_M",
    32: "BF16",
}
GGML_TYPES = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    6: "Q5_0",
    7: "Q5_1",
    8: "Q8_0",
    9: "Q8_1",
    10: "Q2_K",
    11: "Q3_K",
    12: "Q4_K",
    13: "Q5_K",
    14: "Q6_K",
    15: "Q8_K",
    30: "BF16",
}


def _quantisation(file_type: object, block_types: dict[int, int]) -> str:
    if isinstance(file_type, int) and not isinstance(file_type, bool) and file_type in FILE_TYPES:
        return FILE_TYPES[file_type]
    if not block_types:
        return "unknown"
    common = max(block_types, key=lambda t: block_types[t])
    return GGML_TYPES.get(common, f"type {common}")


def _unpack(fh: BinaryIO, fmt: str) -> tuple[Any, ...]:
    n = struct.calcsize(fmt)
    data = fh.read(n)
    if len(data) != n:
        raise EOFError("unexpected end of file")
    return struct.unpack(fmt, data)


def _string(fh: BinaryIO) -> str:
    (n,) = _unpack(fh, "<Q")
    if n > MAX_STRING:
        raise GgufError("corrupt GGUF string length")
    data = fh.read(n)
    if len(data) != n:
        raise EOFError("unexpected end of file")
    return data.decode("utf-8")


def _value(fh: BinaryIO, vtype: int) -> Any:
    if vtype in _SCALARS:
        return _unpack(fh, _SCALARS[vtype])[0]
    if vtype == 8:
        return _string(fh)
    if vtype == 9:
        item_type, count = _unpack(fh, "<IQ")
        if count > MAX_ITEMS:
            raise GgufError("corrupt GGUF array length")
        items = [_value(fh, item_type) for _ in range(count)]
        return items if count <= 64 else None  # long arrays (vocab) are not needed
    raise GgufError(f"unknown GGUF value type {vtype}")


def kv_mb_per_layer(info: GgufInfo, n_ctx: int) -> float:
    """f16 K and V cache of one layer for n_ctx tokens, in MiB."""
    n_embd_kv = info.n_embd * info.n_head_kv // info.n_head
    return 2 * n_ctx * n_embd_kv * 2 / MIB


def estimate_mb(info: GgufInfo, n_gpu_layers: int, n_ctx: int) -> int:
    """GPU memory llama.cpp is expected to take with this shape (MiB)."""
    if n_gpu_layers <= 0:
        return 0
    layers = min(n_gpu_layers, info.n_layer)
    total = OVERHEAD_MB + layers * (info.layer_bytes / MIB + kv_mb_per_layer(info, n_ctx))
    if n_gpu_layers > info.n_layer:  # llama.cpp offloads the output layer as layer n_layer + 1
        total += info.other_bytes / MIB
    return int(total + 0.999)


def choose(info: GgufInfo, budget_mb: int | None, n_ctx: int | None = None) -> LlamaShape:
    """The largest offload that fits budget_mb at the requested context (else a shorter one).

    No budget (no GPU granted) -> everything on the CPU.
    """
    ctx = min(n_ctx or min(info.n_ctx_train, 4096), info.n_ctx_train) if info.n_ctx_train else (n_ctx or 512)
    if not budget_mb or budget_mb <= OVERHEAD_MB:
        return LlamaShape(n_gpu_layers=0, n_ctx=ctx, estimate_mb=0)
    while True:
        for layers in range(info.n_layer + 1, 0, -1):
            need = estimate_mb(info, layers, ctx)
            if need <= budget_mb:
                return LlamaShape(n_gpu_layers=layers, n_ctx=ctx, estimate_mb=need)
        if n_ctx is not None or ctx <= MIN_CTX:  # an explicit context is kept: go to the CPU
            return LlamaShape(n_gpu_layers=0, n_ctx=ctx, estimate_mb=0)
        ctx = max(MIN_CTX, ctx // 2)


def shape_llama(
    info: GgufInfo, budget_mb: int | None, n_ctx: int | None = None, n_gpu_layers: int | None = None
) -> LlamaShape:
    """`choose`, with an explicit n_gpu_layers capped at what fits; negative means all layers
    (llama.cpp's -1), which is every layer that fits, not -1 passed through unshaped."""
    shape = choose(info, budget_mb, n_ctx)
    if n_gpu_layers is None:
        return shape
    wanted = info.n_layer + 1 if n_gpu_layers < 0 else n_gpu_layers
    layers = min(wanted, shape.n_gpu_layers)
    return LlamaShape(layers, shape.n_ctx, estimate_mb(info, layers, shape.n_ctx))


# whisper.cpp on a GPU: the weights, plus its compute buffers and KV caches (a few hundred
# MiB for the small models), plus the CUDA context. An estimate, like estimate_mb.
WHISPER_BUFFERS_MB = 256


@dataclass(frozen=True)
class WhisperPlacement:
    use_gpu: bool
    n_threads: int
    estimate_mb: int  # GPU memory expected when use_gpu (0 on the CPU)
    reason: str  # why it runs where it runs


def place_whisper(
    file_bytes: int, budget_mb: int | None, can_offload: bool, n_threads: int, use_gpu: bool | None = None
) -> WhisperPlacement:
    """GPU when granted, offload-capable, wanted (use_gpu not False) and within the budget; else CPU."""
    need = int(OVERHEAD_MB + WHISPER_BUFFERS_MB + file_bytes / MIB + 0.999)
    if use_gpu is False:
        return WhisperPlacement(False, n_threads, 0, "use_gpu=False")
    if not budget_mb:
        return WhisperPlacement(False, n_threads, 0, "no GPU granted to this run")
    if not can_offload:
        return WhisperPlacement(False, n_threads, 0, "this whisper.cpp build has no GPU backend")
    if need > budget_mb:
        return WhisperPlacement(
            False, n_threads, 0, f"needs about {need} MiB of GPU memory; the budget is {budget_mb}"
        )
    return WhisperPlacement(True, n_threads, need, f"about {need} MiB of the {budget_mb} MiB budget")
