"""GPU mode preloads the model tools in its warm jails: if the jails' Python cannot import
them, the appliance refuses to start and says so (not a log line per jail)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from appliance_client.client import Client
from tests.support import start_server

SIMULATED = {"SANDBOX_GPU": "1", "SANDBOX_GPU_BACKEND": "simulated", "SANDBOX_GPU_SIMULATE": "1x4096"}
TOOLS = "llama_cpp,pywhispercpp.model"
SYSTEM_PYTHON = Path("/usr/bin/python3")


def system_python_lacks_llama_cpp() -> bool:
    return (
        subprocess.run(
            [str(SYSTEM_PYTHON), "-I", "-c", "import llama_cpp"], capture_output=True, check=False
        ).returncode
        != 0
    )


def test_gpu_mode_refuses_to_start_when_the_jails_python_cannot_import_the_tools(tmp_path: Path) -> None:
    assert system_python_lacks_llama_cpp(), "this test needs a Python without llama_cpp"
    with pytest.raises(RuntimeError) as info:
        start_server(tmp_path, SANDBOX_PRELOAD=TOOLS, SANDBOX_PYTHON=str(SYSTEM_PYTHON), settings=SIMULATED)
    log = str(info.value)
    assert "server exited" in log and "cannot import them" in log and "llama_cpp" in log, log[-2000:]
    assert "pip install '.[gpu]'" in log


def test_gpu_mode_with_the_tools_installed_starts_and_its_jails_have_them_loaded(tmp_path: Path) -> None:
    srv = start_server(tmp_path, SANDBOX_PRELOAD=TOOLS, settings=SIMULATED)
    try:
        with Client(srv.url) as client:
            # Code that uses llama.cpp gets the tools' warm jail: whisper's binding is there too,
            # imported before the code came (the code itself imports only llama_cpp).
            ex = client.execute("import sys\nimport llama_cpp\nprint('pywhispercpp.model' in sys.modules)")
        assert ex.status == "ok" and ex.stdout == "True\n", (ex.stdout, ex.stderr, ex.message)
    finally:
        srv.stop()
