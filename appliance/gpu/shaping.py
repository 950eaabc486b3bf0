"""Shaping (enforcement layer c): llama.cpp `n_gpu_layers`/`n_ctx` from the budget and GGUF metadata.

The logic lives in `appliance.tools.shaping` because it runs inside the jail, where only
the standard library and the model libraries exist; the server side uses it from here.
"""

from __future__ import annotations

from appliance.tools.shaping import GgufError, GgufInfo, LlamaShape, choose, estimate_mb, read_gguf

__all__ = ["GgufError", "GgufInfo", "LlamaShape", "choose", "estimate_mb", "read_gguf"]
