"""`load_llm`: a llama.cpp model (llama-cpp-python) shaped to the run's GPU budget, loaded once per process."""

from __future__ import annotations

import os
import warnings
from typing import Any

from appliance.inside.tools import backends, shaping
from appliance.inside.tools.models import ModelCache, ModelError, gpu_grant, resolve_model, threads

_CACHE: ModelCache[Llm] = ModelCache()


class Llm:
    """A loaded model; call it with a prompt to get the completion text."""

    def __init__(self, model: Any, path: str, shape: shaping.LlamaShape) -> None:
        self.model = model  # the llama_cpp.Llama, for anything beyond plain completion
        self.path = path
        self.shape = shape  # n_gpu_layers / n_ctx chosen for the run's budget

    def __call__(self, prompt: str, max_tokens: int = 64, temperature: float = 0.0, **kwargs: Any) -> str:
        out = self.model(prompt, max_tokens=max_tokens, temperature=temperature, **kwargs)
        return str(out["choices"][0]["text"])

    def __repr__(self) -> str:
        return (
            f"Llm({os.path.basename(self.path)!r}, n_gpu_layers={self.shape.n_gpu_layers}, "
            f"n_ctx={self.shape.n_ctx})"
        )


def load_llm(
    path: str | os.PathLike[str],
    *,
    n_ctx: int | None = None,
    n_gpu_layers: int | None = None,
    seed: int = 0,
    **kwargs: Any,
) -> Llm:
    """Load a GGUF model from the models directory (the same model and parameters: the one already loaded).

    Without explicit values, `n_gpu_layers` and `n_ctx` come from the run's GPU budget
    and the model's metadata (no GPU granted: everything on the CPU). An explicit
    `n_gpu_layers` is capped at what the budget allows; a negative one (llama.cpp's "all
    layers") asks for every layer that fits. Asking for GPU layers from a llama.cpp build
    that cannot offload is a ModelError naming the fix; when the layers came from the
    budget alone, a warning says so and the model runs on the CPU.
    """
    real = resolve_model(path)
    try:
        info = shaping.read_gguf(real)
    except shaping.GgufError as exc:
        raise ModelError(f"cannot load {os.fspath(path)!r}: {exc}") from None
    grant = gpu_grant()
    shape = shaping.shape_llama(info, grant["memory_mb"] if grant else None, n_ctx, n_gpu_layers)
    if shape.n_gpu_layers > 0 and not backends.llama_cpp()["gpu_offload"]:
        if n_gpu_layers is not None:
            raise ModelError(
                f"n_gpu_layers={n_gpu_layers}: this llama-cpp-python build cannot offload to a GPU "
                f"(llama_supports_gpu_offload() is False); "
                + backends.CUDA_FIX.format(package="llama-cpp-python")
                + ", or pass n_gpu_layers=0"
            )
        warnings.warn(
            "this llama-cpp-python build cannot offload to a GPU, so the model runs on the CPU; "
            + backends.CUDA_FIX.format(package="llama-cpp-python"),
            RuntimeWarning,
            stacklevel=2,
        )
        shape = shaping.LlamaShape(0, shape.n_ctx, 0)
    kwargs.setdefault("verbose", False)
    kwargs.setdefault("n_threads", threads())
    key = (shape.n_ctx, shape.n_gpu_layers, seed, tuple(sorted((k, repr(v)) for k, v in kwargs.items())))

    def load() -> Llm:
        import llama_cpp

        try:
            model = llama_cpp.Llama(
                model_path=real, n_ctx=shape.n_ctx, n_gpu_layers=shape.n_gpu_layers, seed=seed, **kwargs
            )
        except (ValueError, RuntimeError, OSError) as exc:
            raise ModelError(f"llama.cpp could not load {os.fspath(path)!r}: {exc}") from None
        return Llm(model, real, shape)

    return _CACHE.get(real, key, load)


def cache_info() -> dict[str, int]:
    """{"loads", "hits", "held"} of load_llm in this process."""
    return _CACHE.info()
