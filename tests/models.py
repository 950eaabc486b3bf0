"""Tiny models made by the tests, so the real llama.cpp / whisper.cpp loading code runs here.

- `write_tiny_llama(path)`: a random 2-layer llama GGUF (SentencePiece-style vocab with
  byte fallback) written with the `gguf` package. It generates gibberish, but through the
  real llama.cpp graph.
- `write_tiny_whisper(path)`: a whisper ggml file in whisper.cpp's legacy layout (magic
  0x67676d6c, 11 int32 hparams, mel filters, vocab) with `n_vocab=51865` and
  `n_audio_ctx=1500`, and no tensors: whisper.cpp's loader accepts it and builds a model
  whose weights are left as allocated (so transcription runs but yields nothing useful).
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

GGML_MAGIC = 0x67676D6C
WHISPER_N_VOCAB = 51865
WHISPER_N_AUDIO_CTX = 1500
WORDS = ("hello", "world", "the", "sandbox", "runs", "code", "gpu", "model", "tiny", "test")


def write_tiny_llama(  # noqa: PLR0913 (the model's shape, keyword-only with defaults)
    path: Path,
    *,
    n_embd: int = 64,
    n_layer: int = 2,
    n_head: int = 4,
    n_ff: int = 128,
    n_ctx: int = 256,
    seed: int = 0,
) -> Path:
    """Write a random llama GGUF to path (about 0.3 MiB) and return path."""
    import gguf

    rng = np.random.default_rng(seed)
    tokens: list[bytes] = [b"<unk>", b"<s>", b"</s>"]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    for b in range(256):
        tokens.append(f"<0x{b:02X}>".encode())
        types.append(gguf.TokenType.BYTE)
    for word in WORDS:
        tokens.append(("\u2581" + word).encode())
        types.append(gguf.TokenType.NORMAL)
    tokens.append("\u2581".encode())
    types.append(gguf.TokenType.NORMAL)
    n_vocab = len(tokens)
    scores = [0.0] * 3 + [-1000.0] * 256 + [-float(i) for i in range(n_vocab - 259)]

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("appliance-tiny-llama")
    writer.add_context_length(n_ctx)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head)
    writer.add_rope_dimension_count(n_embd // n_head)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)

    def tensor(name: str, *shape: int) -> None:
        data = (rng.standard_normal(shape) * 0.02).astype(np.float32)
        writer.add_tensor(name, data)

    def ones(name: str, n: int) -> None:
        writer.add_tensor(name, np.ones(n, dtype=np.float32))

    tensor("token_embd.weight", n_vocab, n_embd)
    for i in range(n_layer):
        ones(f"blk.{i}.attn_norm.weight", n_embd)
        for part in ("q", "k", "v", "output"):
            tensor(f"blk.{i}.attn_{part}.weight", n_embd, n_embd)
        ones(f"blk.{i}.ffn_norm.weight", n_embd)
        tensor(f"blk.{i}.ffn_gate.weight", n_ff, n_embd)
        tensor(f"blk.{i}.ffn_up.weight", n_ff, n_embd)
        tensor(f"blk.{i}.ffn_down.weight", n_embd, n_ff)
    ones("output_norm.weight", n_embd)
    tensor("output.weight", n_vocab, n_embd)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_tiny_whisper(path: Path, *, n_mels: int = 80) -> Path:
    """Write a tensor-less whisper ggml file (whisper.cpp's layout) to path and return path."""
    hparams = (
        WHISPER_N_VOCAB,  # n_vocab
        WHISPER_N_AUDIO_CTX,  # n_audio_ctx
        384,  # n_audio_state
        6,  # n_audio_head
        4,  # n_audio_layer
        448,  # n_text_ctx
        384,  # n_text_state
        6,  # n_text_head
        4,  # n_text_layer
        n_mels,  # n_mels
        1,  # ftype: f16
    )
    n_fft = 201
    filters = np.zeros((n_mels, n_fft), dtype=np.float32)
    for m in range(n_mels):  # a crude triangular filter bank; values only need to be finite
        centre = int((m + 1) * (n_fft - 1) / (n_mels + 1))
        filters[m, max(centre - 1, 0) : centre + 2] = (0.5, 1.0, 0.5)[: min(3, n_fft - max(centre - 1, 0))]
    with open(path, "wb") as fh:
        fh.write(struct.pack("<I", GGML_MAGIC))
        fh.write(struct.pack("<11i", *hparams))
        fh.write(struct.pack("<ii", n_mels, n_fft))
        fh.write(filters.tobytes())
        # The vocab: whisper.cpp reads n_vocab words, then adds the special tokens itself.
        words = [bytes([b]) for b in range(256)] + [f"tok{i}".encode() for i in range(50257 - 256)]
        fh.write(struct.pack("<i", len(words)))
        for word in words:
            fh.write(struct.pack("<I", len(word)))
            fh.write(word)
    return path


def write_corrupt_model(path: Path) -> Path:
    """A file that starts like a GGUF and then stops: loaders must fail cleanly on it."""
    path.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 40)
    return path
