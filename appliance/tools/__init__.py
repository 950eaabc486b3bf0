"""Model tools for jailed code: `load_llm` (llama.cpp) and `transcribe` (whisper.cpp).

Imported inside the jail as `appliance.tools` (the server stages a copy into the jail's
runtime directory). Standard library plus llama-cpp-python / pywhispercpp only; the
model libraries are imported when first used. Models load only from the read-only
models directory (SANDBOX_MODELS_DIR), never from the network.

    from appliance.tools import load_llm, transcribe
    llm = load_llm("tiny-llama.gguf")
    print(llm("Hello", max_tokens=16))
    print(transcribe("speech.wav", model="ggml-base.en.bin").text)
    print([m.name for m in models()])   # what the models directory offers
"""

from typing import Any

from appliance.inside.tools import catalogue as _catalogue
from appliance.inside.tools import llm as _llm
from appliance.inside.tools import whisper as _whisper
from appliance.inside.tools.catalogue import ModelInfo
from appliance.inside.tools.llm import Llm, load_llm
from appliance.inside.tools.models import ModelError, gpu_grant, models_dir, resolve_model
from appliance.inside.tools.whisper import Transcript, load_whisper, transcribe


def models() -> list[ModelInfo]:
    """The models this appliance offers, read from their headers (the list GET /v1/models gives)."""
    return _catalogue.catalogue(models_dir())


def cache_info() -> dict[str, Any]:
    """How often this process loaded a model and how often it reused one: {"llm": ..., "whisper": ...}."""
    return {"llm": _llm.cache_info(), "whisper": _whisper.cache_info()}


__all__ = [
    "Llm",
    "ModelError",
    "ModelInfo",
    "Transcript",
    "cache_info",
    "gpu_grant",
    "load_llm",
    "load_whisper",
    "models",
    "models_dir",
    "resolve_model",
    "transcribe",
]
