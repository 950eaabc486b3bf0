"""`load_llm`: a llama.cpp model (llama-cpp-python) shaped to the run's GPU budget."""

from __future__ import annotations

import os
from typing import Any

from appliance.tools import shaping
from appliance.tools.models import ModelError, gpu_grant, resolve_model, threads


class Llm:
    """A loaded model; call it with a prompt to get the completion text."""

    def __init__(self, model: Any, path: str, shape: shaping.LlamaShape) -> None:
        self.model = model          # the llama_cpp.Llama, for anything beyond plain completion
        self.path = path
        self.shape = shape          # n_gpu_layers / n_ctx chosen for the run's budget

    def __call__(self, prompt: str, max_tokens: int = 64, temperature: float = 0.0, **kwargs: Any) -> str:
        out = self.model(prompt, max_tokens=max_tokens, temperature=temperature, **kwargs)
        return str(out["choices"][0]["text"])

    def __repr__(self) -> str:
        return (f"Llm({os.path.basename(self.path)!r}, n_gpu_layers={self.shape.n_gpu_layers}, "
                f"n_ctx={self.shape.n_ctx})")


def load_llm(path: str | os.PathLike[str], *, n_ctx: int | None = None, n_gpu_layers: int | None = None,
             seed: int = 0, **kwargs: Any) -> Llm:
    """Load a GGUF model from the models directory.

    Without explicit values, `n_gpu_layers` and `n_ctx` come from the run's GPU budget
    and the model's metadata (no GPU granted: everything on the CPU). An explicit
    `n_gpu_layers` is capped at what the budget allows.
    """
    real = resolve_model(path)
    try:
        info = shaping.read_gguf(real)
    except shaping.GgufError as exc:
        raise ModelError(f"cannot load {os.fspath(path)!r}: {exc}") from None
    grant = gpu_grant()
    shape = shaping.choose(info, grant["memory_mb"] if grant else None, n_ctx)
    if n_gpu_layers is not None:
        shape = shaping.LlamaShape(min(n_gpu_layers, shape.n_gpu_layers), shape.n_ctx,
                                   shaping.estimate_mb(info, min(n_gpu_layers, shape.n_gpu_layers), shape.n_ctx))
    import llama_cpp

    kwargs.setdefault("verbose", False)
    kwargs.setdefault("n_threads", threads())
    try:
        model = llama_cpp.Llama(model_path=real, n_ctx=shape.n_ctx, n_gpu_layers=shape.n_gpu_layers,
                                seed=seed, **kwargs)
    except (ValueError, RuntimeError, OSError) as exc:
        raise ModelError(f"llama.cpp could not load {os.fspath(path)!r}: {exc}") from None
    return Llm(model, real, shape)
