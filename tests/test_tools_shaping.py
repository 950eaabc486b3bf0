"""Shaping (enforcement layer c): n_gpu_layers / n_ctx from the budget and real GGUF metadata."""

from __future__ import annotations

from pathlib import Path

import pytest

from appliance.inside.tools.shaping import GgufError, choose, estimate_mb, read_gguf
from tests.models import write_corrupt_model, write_tiny_llama


def test_gguf_metadata_is_read_from_a_real_file(tmp_path: Path) -> None:
    info = read_gguf(str(write_tiny_llama(tmp_path / "m.gguf", n_layer=2, n_embd=64, n_ctx=256)))
    assert (info.architecture, info.n_layer, info.n_embd, info.n_ctx_train) == ("llama", 2, 64, 256)
    assert info.layer_bytes > 0 and info.other_bytes > 0


def test_more_budget_never_gives_fewer_layers_and_no_budget_gives_none(tmp_path: Path) -> None:
    info = read_gguf(str(write_tiny_llama(tmp_path / "m.gguf", n_layer=6, n_embd=256, n_ctx=4096)))
    assert choose(info, None).n_gpu_layers == 0
    shapes = [choose(info, mb) for mb in (100, 325, 330, 340, 400, 2000)]
    layers = [s.n_gpu_layers for s in shapes]
    assert layers == sorted(layers) and layers[0] == 0 and layers[-1] == info.n_layer + 1
    for budget, shape in zip((100, 325, 330, 340, 400, 2000), shapes, strict=True):
        assert shape.estimate_mb <= budget
        assert estimate_mb(info, shape.n_gpu_layers, shape.n_ctx) == shape.estimate_mb


def test_a_tight_budget_drops_layers_first_then_shortens_the_context(tmp_path: Path) -> None:
    info = read_gguf(str(write_tiny_llama(tmp_path / "m.gguf", n_layer=4, n_embd=512, n_ctx=4096)))
    full = choose(info, 10_000)
    partial = choose(info, estimate_mb(info, 2, 4096))
    tiny = choose(info, estimate_mb(info, 1, 512))  # not even one layer fits at 4096 tokens
    assert (full.n_gpu_layers, full.n_ctx) == (info.n_layer + 1, 4096)
    assert (partial.n_gpu_layers, partial.n_ctx) == (2, 4096)
    assert tiny.n_gpu_layers >= 1 and tiny.n_ctx < 4096
    assert choose(info, estimate_mb(info, 1, 512), n_ctx=4096).n_gpu_layers == 0  # explicit ctx is kept


def test_corrupt_and_foreign_files_are_refused_with_a_reason(tmp_path: Path) -> None:
    with pytest.raises(GgufError, match=r"corrupt|truncated"):
        read_gguf(str(write_corrupt_model(tmp_path / "c.gguf")))
    (tmp_path / "t.txt").write_text("hello")
    with pytest.raises(GgufError, match="bad magic"):
        read_gguf(str(tmp_path / "t.txt"))
    good = write_tiny_llama(tmp_path / "g.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(good[:2000])
    with pytest.raises(GgufError):
        read_gguf(str(tmp_path / "cut.gguf"))
