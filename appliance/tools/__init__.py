"""Model tools for jailed code: `load_llm` (llama.cpp) and `transcribe` (whisper.cpp).

Imported inside the jail as `appliance.tools` (the server stages a copy into the jail's
runtime directory). Standard library plus llama-cpp-python / pywhispercpp only; the
model libraries are imported when first used. Models load only from the read-only
models directory (SANDBOX_MODELS_DIR), never from the network.

    from appliance.tools import load_llm, transcribe
    llm = load_llm("tiny-llama.gguf")
    print(llm("Hello", max_tokens=16))
    print(transcribe("speech.wav", model="ggml-base.en.bin").text)
"""

from typing import Any

from appliance.tools import llm as _llm
from appliance.tools import whisper as _whisper
from appliance.tools.llm import Llm, load_llm
from appliance.tools.models import ModelError, gpu_grant, models_dir, resolve_model
from appliance.tools.whisper import Transcript, load_whisper, transcribe


def cache_info() -> dict[str, Any]:
    """How often this process loaded a model and how often it reused one: {"llm": ..., "whisper": ...}."""
    return {"llm": _llm.cache_info(), "whisper": _whisper.cache_info()}


__all__ = [
    "Llm", "ModelError", "Transcript", "cache_info", "gpu_grant", "load_llm", "load_whisper",
    "models_dir", "resolve_model", "transcribe",
]
