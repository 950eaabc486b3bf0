"""appliance.tools inside a real jail: real llama.cpp and whisper.cpp inference on tiny models."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from appliance_client.client import AsyncClient
from tests.models import write_corrupt_model, write_tiny_llama, write_tiny_whisper
from tests.support import Server, scaled, start_server


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
    code = (
        "from appliance.tools import load_llm\nllm = load_llm('tiny-llama.gguf')\n"
        "text = llm('hello world', max_tokens=8)\n"
        "print(type(text).__name__, llm.shape.n_gpu_layers, llm.shape.n_ctx)\n"
        "print(llm.model.n_tokens > 2)"
    )
    async with AsyncClient(tools_server.url) as c:
        ex = await c.execute(code)
    assert ex.status == "ok", (ex.error, ex.stderr)
    assert ex.stdout.splitlines() == ["str 0 256", "True"]  # no GPU granted: all on the CPU


async def test_whisper_transcribes_an_array_and_a_file_inside_the_jail(tools_server: Server) -> None:
    code = (
        "import numpy as np, wave\nfrom appliance.tools import transcribe\n"
        "t = transcribe(np.zeros(16000, dtype=np.float32), model='tiny-whisper.bin')\n"
        "print(type(t).__name__, isinstance(t.text, str), isinstance(t.segments, tuple))\n"
        "with wave.open('a.wav', 'wb') as w:\n"
        "    w.setnchannels(1); w.setsampwidth(2); w.setframerate(16000); w.writeframes(b'\\0\\0' * 8000)\n"
        "print(type(transcribe('a.wav', model='tiny-whisper.bin').text).__name__)"
    )
    async with AsyncClient(tools_server.url) as c:
        ex = await c.execute(code, timeout_ms=15000)
    assert ex.status == "ok", (ex.error, ex.stderr)
    assert ex.stdout.splitlines() == ["Transcript True True", "str"]


@pytest.mark.parametrize(
    ("call", "needle"),
    [
        ("load_llm('/etc/passwd')", "outside the models directory"),
        ("load_llm('../../etc/passwd')", "outside the models directory"),
        ("load_llm('missing.gguf')", "no model file"),
        ("load_llm('corrupt.gguf')", "corrupt.gguf"),
        ("transcribe('a.wav', model='corrupt-whisper.bin')", "not a whisper ggml model"),
        ("transcribe('a.wav', model='tiny-llama.gguf')", "not a whisper ggml model"),
    ],
)
async def test_bad_model_paths_and_corrupt_models_end_with_a_clear_error(
    tools_server: Server, call: str, needle: str
) -> None:
    async with AsyncClient(tools_server.url) as c:
        ex = await c.execute(f"from appliance.tools import load_llm, transcribe\n{call}")
        after = await c.execute("print('still fine')")
    assert ex.status == "error" and ex.error is not None
    assert ex.error["ename"] == "ModelError" and needle in ex.error["evalue"]
    assert after.status == "ok" and after.stdout == "still fine\n"


async def test_the_models_directory_is_read_only_in_the_jail(tools_server: Server, models: Path) -> None:
    code = (
        f"import os\ntry:\n    open({str(models / 'x')!r}, 'w')\nexcept OSError as e:\n    print(type(e).__name__)\n"
        f"print(sorted(os.listdir({str(models)!r})))"
    )
    async with AsyncClient(tools_server.url) as c:
        ex = await c.execute(code)
    assert ex.status == "ok" and ex.stdout.splitlines()[0] in ("OSError", "PermissionError")
    assert not (models / "x").exists()


async def test_the_tools_package_is_the_only_part_of_the_appliance_the_jail_can_import(
    tools_server: Server,
) -> None:
    # appliance.inside (the driver, its channel, the tools' parts) and appliance.tools, their
    # public face, are all of the package the jail sees.
    code = (
        "import appliance, appliance.tools, appliance.inside.channel\n"
        "print(sorted(n for n in dir(appliance) if not n.startswith('_')))\n"
        "for m in ('appliance.core.service', 'appliance.sandbox.jail', 'appliance.settings'):\n"
        "    try:\n        __import__(m)\n    except ImportError:\n        print('no', m)"
    )
    async with AsyncClient(tools_server.url) as c:
        ex = await c.execute(code)
    assert ex.status == "ok", ex
    assert ex.stdout.splitlines() == [
        "['inside', 'tools']",
        "no appliance.core.service",
        "no appliance.sandbox.jail",
        "no appliance.settings",
    ]


async def test_without_a_models_directory_the_tools_say_so(server: Server) -> None:
    async with AsyncClient(server.url) as c:
        ex = await c.execute("from appliance.tools import load_llm\nload_llm('tiny-llama.gguf')")
    assert ex.status == "error" and ex.error is not None and "SANDBOX_MODELS_DIR" in ex.error["evalue"]


async def test_transcribe_reuses_its_model_and_runs_with_the_runs_threads_on_the_cpu(
    tools_server: Server,
) -> None:
    code = (
        "import json, os, numpy as np\nfrom appliance import tools\n"
        "a = tools.transcribe(np.zeros(8000, dtype=np.float32), model='tiny-whisper.bin')\n"
        "b = tools.transcribe(np.zeros(8000, dtype=np.float32), model='tiny-whisper.bin')\n"
        "m = tools.load_whisper('tiny-whisper.bin')\n"
        "print(json.dumps({'cache': tools.cache_info()['whisper'], 'gpu': a.placement.use_gpu,\n"
        "  'threads': a.placement.n_threads, 'omp': os.environ['OMP_NUM_THREADS'],\n"
        "  'lib_use_gpu': m._context_params.use_gpu, 'lib_threads': m.get_params()['n_threads']}))\n"
        "del m  # the cache drops its old model; nothing else may hold it (one whisper fits RLIMIT_AS)\n"
        "c = tools.transcribe(np.zeros(8000, dtype=np.float32), model='tiny-whisper.bin',\n"
        "    n_threads=int(os.environ['OMP_NUM_THREADS']) + 1)\n"
        "print(json.dumps(tools.cache_info()['whisper']))"
    )
    async with AsyncClient(tools_server.url) as c:
        ex = await c.execute(code, timeout_ms=30000)
    assert ex.status == "ok", (ex.error, ex.stderr)
    first, after = (json.loads(line) for line in ex.stdout.splitlines())
    assert first["cache"] == {"loads": 1, "hits": 2, "held": 1}  # one load for three calls
    # No GPU granted: whisper.cpp is told so (its own default is use_gpu=True), threads from the run.
    assert first["gpu"] is False and first["lib_use_gpu"] is False
    assert first["threads"] == int(first["omp"]) == first["lib_threads"]
    assert after == {"loads": 2, "hits": 2, "held": 1}  # other parameters: loaded again, the old one dropped


async def test_load_llm_reuses_its_model_for_the_same_parameters(tools_server: Server) -> None:
    code = (
        "from appliance import tools\na = tools.load_llm('tiny-llama.gguf')\nb = tools.load_llm('tiny-llama.gguf')\n"
        "c = tools.load_llm('tiny-llama.gguf', n_ctx=128)\nprint(a is b, a is c, tools.cache_info()['llm'])"
    )
    async with AsyncClient(tools_server.url) as c:
        ex = await c.execute(code, timeout_ms=30000)
    assert ex.status == "ok", (ex.error, ex.stderr)
    assert ex.stdout.strip() == "True False {'loads': 2, 'hits': 1, 'held': 1}"


async def test_readyz_reports_what_each_model_binding_can_do(tools_server: Server) -> None:
    deadline = time.monotonic() + scaled(60)
    while True:
        status, body = tools_server.get("/readyz")
        tools = json.loads(body)["tools"]
        if not tools.get("probing") or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    assert status == 200
    assert tools["llama_cpp"]["available"] is True and tools["llama_cpp"]["gpu_offload"] is False
    assert tools["whisper"]["available"] is True and tools["whisper"]["gpu_offload"] is False
    assert tools["ggml_conflicts"] == []


@pytest.fixture(scope="module")
def gpu_tools_server(tmp_path_factory: pytest.TempPathFactory, models: Path) -> Iterator[Server]:
    """GPU mode (simulated devices) with the GPU preload: warm jails import llama.cpp and whisper.cpp."""
    srv = start_server(
        tmp_path_factory.mktemp("gpu-tools"),
        SANDBOX_MODELS_DIR=str(models),
        SANDBOX_GPU="1",
        SANDBOX_GPU_BACKEND="simulated",
        SANDBOX_GPU_SIMULATE="8192",
        SANDBOX_PRELOAD="llama_cpp,pywhispercpp.model,appliance.tools",
    )
    yield srv
    srv.stop()


async def test_a_warm_gpu_jail_runs_llama_and_whisper_in_one_process(gpu_tools_server: Server) -> None:
    code = (
        "import sys, json, warnings, numpy as np\npreloaded = 'llama_cpp' in sys.modules and "
        "'pywhispercpp.model' in sys.modules\nfrom appliance import tools\nfrom appliance.inside.tools import backends\n"
        "with warnings.catch_warnings(record=True) as seen:\n    warnings.simplefilter('always')\n"
        "    llm = tools.load_llm('tiny-llama.gguf')\n"
        "text = llm('hello', max_tokens=4)\nt = tools.transcribe(np.zeros(8000, dtype=np.float32), model='tiny-whisper.bin')\n"
        "print(json.dumps({'preloaded': preloaded, 'layers': llm.shape.n_gpu_layers, 'text': isinstance(text, str),\n"
        "  'warned': [str(w.message) for w in seen], 'whisper_gpu': t.placement.use_gpu, 'why': t.placement.reason,\n"
        "  'conflicts': backends.probe()['ggml_conflicts']}))"
    )
    async with AsyncClient(gpu_tools_server.url) as c:
        ex = await c.execute(code, gpu={"memory_mb": 2048}, timeout_ms=30000)
    assert ex.status == "ok", (ex.error, ex.stderr)
    out = json.loads(ex.stdout)
    assert out["preloaded"] is True and out["text"] is True and out["conflicts"] == []
    # A CPU build of llama.cpp with a GPU budget: on the CPU, and the run is told why and how to fix it.
    assert out["layers"] == 0 and any("-DGGML_CUDA=on" in w for w in out["warned"]), out
    assert out["whisper_gpu"] is False and "no GPU backend" in out["why"]


@pytest.mark.parametrize(
    "call",
    [
        "load_llm('tiny-llama.gguf', n_gpu_layers=-1)",
        "load_llm('tiny-llama.gguf', n_gpu_layers=2)",
        "transcribe('a.wav', model='tiny-whisper.bin', use_gpu=True)",
    ],
)
async def test_asking_a_cpu_build_for_gpu_work_is_a_clear_error_naming_the_fix(
    gpu_tools_server: Server, call: str
) -> None:
    async with AsyncClient(gpu_tools_server.url) as c:
        ex = await c.execute(
            f"from appliance.tools import load_llm, transcribe\n{call}", gpu={"memory_mb": 2048}
        )
    assert ex.status == "error" and ex.error is not None and ex.error["ename"] == "ModelError", ex.frames
    assert (
        'CMAKE_ARGS="-DGGML_CUDA=on"' in ex.error["evalue"] and "cannot offload" in ex.error["evalue"]
    ) or "no GPU backend" in ex.error["evalue"]


def probed_readyz(server: Server) -> tuple[int, str, dict[str, Any]]:
    """/readyz once the startup probe of the model tools has answered (or a minute is over):
    status, body, and the body parsed."""
    deadline = time.monotonic() + scaled(60)
    while True:
        status, body = server.get("/readyz")
        ready: dict[str, Any] = json.loads(body)
        if not ready["tools"].get("probing") or time.monotonic() > deadline:
            return status, body, ready
        time.sleep(0.2)


async def test_gpu_readyz_says_whether_shaping_can_offload(gpu_tools_server: Server) -> None:
    status, body, ready = await asyncio.to_thread(probed_readyz, gpu_tools_server)
    assert status == 200, body
    assert (
        ready["gpu"]["shaping"]["gpu_offload"] is False
        and ready["tools"]["llama_cpp"]["gpu_offload"] is False
    )


def test_gpu_readyz_calls_shaping_unavailable_where_llama_cpp_does_not_import(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    # The jails' Python finds llama_cpp but cannot import it (a CUDA build missing its
    # libraries, say), while the server's own Python imports it fine: shaping is load_llm's,
    # in the jail, so it is not available, whatever this process can find.
    root = Path(tempfile.mkdtemp(prefix="appliance-broken-llama-", dir="/tmp"))
    try:
        os.chmod(root, 0o755)
        subprocess.run(["/usr/bin/python3", "-m", "venv", "--without-pip", str(root / "venv")], check=True)
        site = next((root / "venv" / "lib").glob("python3*/site-packages"))
        (site / "llama_cpp").mkdir()
        (site / "llama_cpp" / "__init__.py").write_text(
            'raise ImportError("libggml-cuda.so: cannot open shared object file")\n'
        )
        subprocess.run(["chmod", "-R", "a+rX", str(root)], check=True)
        srv = start_server(
            tmp_path_factory.mktemp("gpu-broken-llama"),
            SANDBOX_PYTHON=str(root / "venv" / "bin" / "python"),
            SANDBOX_GPU="1",
            SANDBOX_GPU_BACKEND="simulated",
            SANDBOX_GPU_SIMULATE="8192",
        )
        try:
            status, body, ready = probed_readyz(srv)
        finally:
            srv.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert status == 200, body
    assert ready["tools"]["llama_cpp"]["available"] is False
    assert "libggml-cuda.so" in ready["tools"]["llama_cpp"]["error"]
    assert ready["gpu"]["shaping"]["available"] is False, ready["gpu"]["shaping"]


BIG_MODEL_MB = 226  # write_tiny_llama(n_embd=1024, n_layer=8, n_ff=1024): F32 weights, mmapped by llama.cpp
SMALL_MEMORY_MB = 128


@pytest.fixture(scope="module")
def big_model_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """GPU mode (simulated devices) with SANDBOX_MEMORY_MB below the size of the one model it serves."""
    root = Path(tempfile.mkdtemp(prefix="appliance-big-model-", dir="/tmp"))
    os.chmod(root, 0o755)
    model = write_tiny_llama(root / "big-llama.gguf", n_embd=1024, n_layer=8, n_head=8, n_ff=1024)
    os.chmod(model, 0o644)
    assert model.stat().st_size > BIG_MODEL_MB * 2**20 > SMALL_MEMORY_MB * 2**20
    srv = start_server(
        tmp_path_factory.mktemp("big-model"),
        SANDBOX_MODELS_DIR=str(root),
        SANDBOX_GPU="1",
        SANDBOX_GPU_BACKEND="simulated",
        SANDBOX_GPU_SIMULATE="8192",
        SANDBOX_GPU_POLL_MS="50",
        SANDBOX_MEMORY_MB=str(SMALL_MEMORY_MB),
    )
    yield srv
    srv.stop()
    shutil.rmtree(root, ignore_errors=True)


async def test_a_gpu_run_loading_a_model_larger_than_its_host_memory_cap_ends_ok(
    big_model_server: Server,
) -> None:
    # Issue 14, defect 1: the watchdog capped resident memory (statm), which counts the mmapped
    # GGUF, so loading a real model in a GPU jail ended memory_limit. It caps what the run owns.
    code = (
        "import time, warnings\nfrom appliance.tools import load_llm\n"
        "warnings.simplefilter('ignore')  # a CPU build with a GPU budget: on the CPU, and warned\n"
        "llm = load_llm('big-llama.gguf')\ntext = llm('hello world', max_tokens=4)\n"
        "time.sleep(1.0)  # the model stays mapped and resident across many watchdog polls\n"
        "page = 4096\nrss = int(open('/proc/self/statm').read().split()[1]) * page // 2**20\n"
        "print(isinstance(text, str), llm.shape.n_gpu_layers, rss)"
    )
    async with AsyncClient(big_model_server.url) as c:
        ex = await c.execute(code, gpu={"memory_mb": 2048}, timeout_ms=120000)
    assert ex.status == "ok", (ex.status, ex.error, ex.stderr)
    is_text, layers, rss = ex.stdout.split()
    assert is_text == "True" and layers == "0"
    # The run really held more resident memory than SANDBOX_MEMORY_MB: the model's file pages.
    assert int(rss) > SMALL_MEMORY_MB, ex.stdout
