"""appliance.tools inside a real jail: real llama.cpp and whisper.cpp inference on tiny models."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from appliance.client import AsyncClient
from tests.models import write_corrupt_model, write_tiny_llama, write_tiny_whisper
from tests.support import Server, start_server


@pytest.fixture(scope="module")
def models() -> Iterator[Path]:
    """A models directory the sandbox uid can read (tmp_path's ancestors are root-only)."""
    root = Path(tempfile.mkdtemp(prefix="appliance-models-", dir="/tmp"))
    os.chmod(root, 0o755)
    write_tiny_llama(root / "tiny-llama.gguf")
    write_tiny_whisper(root / "tiny-whisper.bin")
    write_corrupt_model(root / "corrupt.gguf")
    (root / "corrupt-whisper.bin").write_bytes(b"lmgg" + b"\x07" * 30)
    for f in root.iterdir():
        os.chmod(f, 0o644)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def tools_server(tmp_path_factory: pytest.TempPathFactory, models: Path) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp("tools"), SANDBOX_MODELS_DIR=str(models), SANDBOX_PRELOAD="")
    yield srv
    srv.stop()


async def test_llama_generates_text_inside_the_jail(tools_server: Server) -> None:
    code = ("from appliance.tools import load_llm\nllm = load_llm('tiny-llama.gguf')\n"
            "text = llm('hello world', max_tokens=8)\n"
            "print(type(text).__name__, llm.shape.n_gpu_layers, llm.shape.n_ctx)\n"
            "print(llm.model.n_tokens > 2)")
    async with AsyncClient(tools_server.url) as c:
        ex = await c.execute(code)
    assert ex.status == "ok", (ex.error, ex.stderr)
    assert ex.stdout.splitlines() == ["str 0 256", "True"]  # no GPU granted: all on the CPU


async def test_whisper_transcribes_an_array_and_a_file_inside_the_jail(tools_server: Server) -> None:
    code = ("import numpy as np, wave\nfrom appliance.tools import transcribe\n"
            "t = transcribe(np.zeros(16000, dtype=np.float32), model='tiny-whisper.bin')\n"
            "print(type(t).__name__, isinstance(t.text, str), isinstance(t.segments, tuple))\n"
            "with wave.open('a.wav', 'wb') as w:\n"
            "    w.setnchannels(1); w.setsampwidth(2); w.setframerate(16000); w.writeframes(b'\\0\\0' * 8000)\n"
            "print(type(transcribe('a.wav', model='tiny-whisper.bin').text).__name__)")
    async with AsyncClient(tools_server.url) as c:
        ex = await c.execute(code, timeout_ms=15000)
    assert ex.status == "ok", (ex.error, ex.stderr)
    assert ex.stdout.splitlines() == ["Transcript True True", "str"]


@pytest.mark.parametrize("call,needle", [
    ("load_llm('/etc/passwd')", "outside the models directory"),
    ("load_llm('../../etc/passwd')", "outside the models directory"),
    ("load_llm('missing.gguf')", "no model file"),
    ("load_llm('corrupt.gguf')", "corrupt.gguf"),
    ("transcribe('a.wav', model='corrupt-whisper.bin')", "not a whisper ggml model"),
    ("transcribe('a.wav', model='tiny-llama.gguf')", "not a whisper ggml model"),
])
async def test_bad_model_paths_and_corrupt_models_end_with_a_clear_error(
        tools_server: Server, call: str, needle: str) -> None:
    async with AsyncClient(tools_server.url) as c:
        ex = await c.execute(f"from appliance.tools import load_llm, transcribe\n{call}")
        after = await c.execute("print('still fine')")
    assert ex.status == "error" and ex.error is not None
    assert ex.error["ename"] == "ModelError" and needle in ex.error["evalue"]
    assert after.status == "ok" and after.stdout == "still fine\n"


async def test_the_models_directory_is_read_only_in_the_jail(tools_server: Server, models: Path) -> None:
    code = (f"import os\ntry:\n    open({str(models / 'x')!r}, 'w')\nexcept OSError as e:\n    print(type(e).__name__)\n"
            f"print(sorted(os.listdir({str(models)!r})))")
    async with AsyncClient(tools_server.url) as c:
        ex = await c.execute(code)
    assert ex.status == "ok" and ex.stdout.splitlines()[0] in ("OSError", "PermissionError")
    assert not (models / "x").exists()


async def test_the_tools_package_is_the_only_part_of_the_appliance_the_jail_can_import(
        tools_server: Server) -> None:
    # The driver's channel is staged as appliance.jail.channel: it and the tools are all the jail sees.
    code = ("import appliance, appliance.tools, appliance.jail.channel\n"
            "print(sorted(n for n in dir(appliance) if not n.startswith('_')))\n"
            "for m in ('appliance.service', 'appliance.jail.jail', 'appliance.settings'):\n"
            "    try:\n        __import__(m)\n    except ImportError:\n        print('no', m)")
    async with AsyncClient(tools_server.url) as c:
        ex = await c.execute(code)
    assert ex.status == "ok", ex
    assert ex.stdout.splitlines() == ["['jail', 'tools']", "no appliance.service", "no appliance.jail.jail",
                                      "no appliance.settings"]


async def test_without_a_models_directory_the_tools_say_so(server: Server) -> None:
    async with AsyncClient(server.url) as c:
        ex = await c.execute("from appliance.tools import load_llm\nload_llm('tiny-llama.gguf')")
    assert ex.status == "error" and ex.error is not None and "SANDBOX_MODELS_DIR" in ex.error["evalue"]
