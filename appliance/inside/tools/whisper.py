"""`transcribe`: speech to text with whisper.cpp (pywhispercpp), under the run's budget, loaded once per process."""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any

from appliance.inside.tools import backends, shaping
from appliance.inside.tools.models import ModelCache, ModelError, gpu_grant, resolve_model, threads

GGML_MAGIC = 0x67676D6C
_CACHE: ModelCache[Any] = ModelCache()


@dataclass(frozen=True)
class Transcript:
    text: str
    segments: tuple[tuple[float, float, str], ...]  # (start s, end s, text)
    placement: shaping.WhisperPlacement | None = None  # where the model ran (GPU or CPU, threads)

    def __str__(self) -> str:
        return self.text


def load_whisper(model: str | os.PathLike[str], *, use_gpu: bool | None = None, **params: Any) -> Any:
    """A pywhispercpp Model for a ggml whisper file in the models directory, placed by the run's
    budget (see `shaping.place_whisper`); the same file and parameters: the one already loaded."""
    return _load(model, use_gpu, params)[0]


def _load(model: str | os.PathLike[str], use_gpu: bool | None, params: dict[str, Any]) -> tuple[Any, Any]:
    real = resolve_model(model)
    _check_header(real, os.fspath(model))
    grant = gpu_grant()
    offload = bool(backends.whisper()["gpu_offload"])
    if use_gpu and grant and not offload:
        raise ModelError(
            "use_gpu=True: this pywhispercpp build has no GPU backend "
            f"(ggml backends: {', '.join(backends.whisper()['backends']) or 'none'}); "
            + backends.CUDA_FIX.format(package="pywhispercpp")
            + ", or pass use_gpu=False"
        )
    placement = shaping.place_whisper(
        os.path.getsize(real), grant["memory_mb"] if grant else None, offload, threads(), use_gpu
    )
    params.setdefault("n_threads", placement.n_threads)
    params.setdefault("print_progress", False)
    params.setdefault("print_realtime", False)
    context: dict[str, Any] = {"use_gpu": placement.use_gpu}
    if placement.use_gpu:
        context["gpu_device"] = 0  # CUDA_VISIBLE_DEVICES shows the jail its one device as 0
    key = (tuple(sorted(context.items())), tuple(sorted((k, repr(v)) for k, v in params.items())))

    def load() -> Any:
        from pywhispercpp.model import Model

        try:
            return Model(real, redirect_whispercpp_logs_to=None, context_params=context, **params)  # type: ignore[arg-type]
        except (RuntimeError, ValueError, OSError, TypeError) as exc:
            raise ModelError(f"whisper.cpp could not load {os.fspath(model)!r}: {exc}") from None

    return _CACHE.get(real, key, load), placement


def transcribe(
    audio_path_or_array: Any,
    model: str | os.PathLike[str] = "ggml-base.en.bin",
    *,
    use_gpu: bool | None = None,
    **params: Any,
) -> Transcript:
    """Transcribe a 16 kHz audio file path (in the jail) or a float32 mono numpy array.

    The model runs where the run's budget puts it: on the granted GPU when the build can
    offload and the model fits the budget, else on the CPU; with the run's thread count.
    """
    whisper, placement = _load(model, use_gpu, params)
    media = audio_path_or_array
    if isinstance(media, (str, os.PathLike)):
        media = os.fspath(media)
        if not os.path.isfile(media):
            raise ModelError(f"no audio file {media!r}")
    segments = whisper.transcribe(media)
    parts = tuple((s.t0 / 100.0, s.t1 / 100.0, str(s.text)) for s in segments)
    return Transcript(text="".join(p[2] for p in parts).strip(), segments=parts, placement=placement)


def cache_info() -> dict[str, int]:
    """{"loads", "hits", "held"} of transcribe/load_whisper in this process."""
    return _CACHE.info()


def _check_header(real: str, shown: str) -> None:
    # whisper.cpp aborts the process on some malformed files; refuse them here first.
    try:
        with open(real, "rb") as fh:
            head = fh.read(4 + 11 * 4)
    except OSError as exc:
        raise ModelError(f"cannot read {shown!r}: {exc}") from None
    if len(head) < 48 or struct.unpack("<I", head[:4])[0] != GGML_MAGIC:
        raise ModelError(f"{shown!r} is not a whisper ggml model (bad magic or truncated)")
    hparams = struct.unpack("<11i", head[4:48])
    if any(v <= 0 for v in hparams[:10]) or hparams[9] not in (80, 128):
        raise ModelError(f"{shown!r} is not a whisper ggml model (implausible header)")
