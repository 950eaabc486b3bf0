"""`transcribe`: speech to text with whisper.cpp (pywhispercpp)."""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any

from appliance.tools.models import ModelError, resolve_model, threads

GGML_MAGIC = 0x67676D6C


@dataclass(frozen=True)
class Transcript:
    text: str
    segments: tuple[tuple[float, float, str], ...]   # (start s, end s, text)

    def __str__(self) -> str:
        return self.text


def load_whisper(model: str | os.PathLike[str], **params: Any) -> Any:
    """A pywhispercpp Model for a ggml whisper file in the models directory."""
    real = resolve_model(model)
    _check_header(real, os.fspath(model))
    from pywhispercpp.model import Model

    params.setdefault("n_threads", threads())
    params.setdefault("print_progress", False)
    params.setdefault("print_realtime", False)
    try:
        return Model(real, redirect_whispercpp_logs_to=None, **params)
    except (RuntimeError, ValueError, OSError) as exc:
        raise ModelError(f"whisper.cpp could not load {os.fspath(model)!r}: {exc}") from None


def transcribe(audio_path_or_array: Any, model: str | os.PathLike[str] = "ggml-base.en.bin",
               **params: Any) -> Transcript:
    """Transcribe a 16 kHz audio file path (in the jail) or a float32 mono numpy array."""
    whisper = load_whisper(model, **params)
    media = audio_path_or_array
    if isinstance(media, (str, os.PathLike)):
        media = os.fspath(media)
        if not os.path.isfile(media):
            raise ModelError(f"no audio file {media!r}")
    segments = whisper.transcribe(media)
    parts = tuple((s.t0 / 100.0, s.t1 / 100.0, str(s.text)) for s in segments)
    return Transcript(text="".join(p[2] for p in parts).strip(), segments=parts)


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
