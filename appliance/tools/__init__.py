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

from appliance.tools.llm import Llm, load_llm
from appliance.tools.models import ModelError, gpu_grant, models_dir, resolve_model
from appliance.tools.whisper import Transcript, load_whisper, transcribe

__all__ = [
    "Llm", "ModelError", "Transcript", "gpu_grant", "load_llm", "load_whisper", "models_dir",
    "resolve_model", "transcribe",
]
