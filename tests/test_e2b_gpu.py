"""A GPU budget asked for through the unmodified E2B SDK: metadata `gpu_memory_mb`, on a
GPU-mode server with simulated devices (the CPU server's refusal: tests/test_e2b_pause.py)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest
from e2b import SandboxException
from e2b_code_interpreter import AsyncSandbox, Sandbox

from tests.support import Server, scaled, start_server
from tests.test_e2b_sdk import point_sdk
from tests.test_gpu_sessions import gpu_env


@pytest.fixture(scope="module")
def gpusrv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("e2b-gpu")
    srv = start_server(
        tmp / "srv", SANDBOX_SNAPSHOT_DIR=str(tmp / "snapshots"), settings=gpu_env(tmp / "sim.json")
    )
    yield srv
    srv.stop()


@pytest.fixture(autouse=True)
def sdk_env(gpusrv: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    point_sdk(monkeypatch, gpusrv, "e2b-gpu-key")


def reserved_mb(server: Server) -> int:
    _status, body = server.get("/readyz")
    return sum(int(d["reserved_mb"]) for d in json.loads(body)["gpu"]["devices"])


def until_reserved(server: Server, mb: int, within_s: float = 20.0) -> int:
    """The MiB reserved once it reads `mb` (the ledger gives a grant back once the simulated
    device shows it freed), or what it reads at the deadline."""
    deadline = time.monotonic() + scaled(within_s)
    while reserved_mb(server) != mb and time.monotonic() < deadline:
        time.sleep(0.05)
    return reserved_mb(server)


def test_metadata_asks_for_the_budget_and_a_pause_gives_it_back(gpusrv: Server) -> None:
    sb = Sandbox.create(metadata={"gpu_memory_mb": "1024"}, timeout=600)
    try:
        assert reserved_mb(gpusrv) == 1024  # not the server's default (SANDBOX_GPU_DEFAULT_MB=512)
        sb.run_code("kept = 'on the gpu host'")
        assert sb.get_info().metadata == {"gpu_memory_mb": "1024"}
        assert sb.pause() is True
        assert until_reserved(gpusrv, 0) == 0  # a paused sandbox holds no GPU memory
        again = Sandbox.connect(sb.sandbox_id)
        assert reserved_mb(gpusrv) == 1024  # the resume asks for the same budget again
        assert again.run_code("kept").text == "'on the gpu host'"
    finally:
        sb.kill()
    assert until_reserved(gpusrv, 0) == 0


async def test_a_budget_past_every_device_is_refused_naming_it(gpusrv: Server) -> None:
    with pytest.raises(SandboxException, match="can never fit"):
        await AsyncSandbox.create(metadata={"gpu_memory_mb": "8192"})
    assert reserved_mb(gpusrv) == 0
