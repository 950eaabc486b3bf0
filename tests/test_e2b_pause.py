"""Pause and resume through the unmodified E2B SDK (sync and async), on session snapshots.

A pause keeps the default context as a snapshot (its globals that pickle, its files) and ends
the sandbox's jail; `connect` restores it into a new session under the same id and token.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2b import NotFoundException, SandboxException, SandboxQuery, SandboxState
from e2b_code_interpreter import AsyncSandbox, Sandbox

from tests.support import Server, scaled, start_server
from tests.test_e2b_js import JS_DIR, NODE
from tests.test_e2b_sdk import ALICE, BOB, point_sdk, tenants_file, until


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("e2b-pause-store") / "snapshots"


@pytest.fixture(scope="module")
def e2bsrv(tmp_path_factory: pytest.TempPathFactory, store: Path) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("e2b-pause")
    tokens = tenants_file(tmp)
    srv = start_server(
        tmp, SANDBOX_AUTH_TOKENS_FILE=str(tokens), SANDBOX_SNAPSHOT_DIR=str(store), SANDBOX_POOL_SIZE="2"
    )
    yield srv
    srv.stop()


@pytest.fixture(autouse=True)
def sdk_env(e2bsrv: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    point_sdk(monkeypatch, e2bsrv, ALICE)


def kept_snapshots(store: Path) -> list[Path]:
    """The snapshots the store holds now, of every tenant (`.new-*` ones being written aside)."""
    return [p for tenant in store.glob("t-*") for p in tenant.iterdir() if not p.name.startswith(".")]


def paused_ids() -> set[str]:
    found = Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED])).next_items()
    return {s.sandbox_id for s in found}


def test_pause_then_connect_keeps_the_interpreter_and_files(store: Path) -> None:
    sb = Sandbox.create(timeout=600)
    try:
        sb.run_code("kept = 41")
        sb.files.write("/home/user/notes.txt", "across a pause")
        assert sb.pause() is True
        assert sb.get_info().state == SandboxState.PAUSED
        assert sb.sandbox_id in paused_ids()
        running = Sandbox.list(query=SandboxQuery(state=[SandboxState.RUNNING])).next_items()
        assert sb.sandbox_id not in {s.sandbox_id for s in running}
        assert len(kept_snapshots(store)) == 1
        assert Sandbox.pause(sb.sandbox_id) is False  # the SDK's answer: paused already
        with pytest.raises(NotFoundException):  # no jail to reach while paused
            sb.run_code("kept")

        again = Sandbox.connect(sb.sandbox_id)
        assert again.sandbox_id == sb.sandbox_id
        assert again.get_info().state == SandboxState.RUNNING
        assert again.run_code("kept + 1").text == "42"
        assert sb.run_code("kept").text == "41"  # the old handle: same id, same access token
        assert sb.files.read("notes.txt") == "across a pause"
        assert kept_snapshots(store) == []  # a resume deletes what the pause kept
    finally:
        sb.kill()


async def test_async_pause_then_connect_keeps_a_variable() -> None:
    sb = await AsyncSandbox.create(timeout=600)
    try:
        await sb.run_code("import math\nkept = math.pi")
        assert await sb.pause() is True
        assert (await sb.get_info()).state == SandboxState.PAUSED
        again = await AsyncSandbox.connect(sb.sandbox_id)
        assert (await again.run_code("round(kept, 2)")).text == "3.14"
    finally:
        await sb.kill()


def test_paused_sandbox_is_its_tenants_and_ends_when_killed_or_expired(store: Path) -> None:
    sb = Sandbox.create(timeout=600)
    sb.run_code("secret = 'alice'")
    assert sb.pause() is True
    try:
        # Another tenant reads it as missing, for every call, and cannot resume it.
        with pytest.raises(NotFoundException):
            Sandbox.connect(sb.sandbox_id, api_key=BOB)
        with pytest.raises(NotFoundException):
            Sandbox.get_info(sb.sandbox_id, api_key=BOB)
        assert Sandbox.kill(sb.sandbox_id, api_key=BOB) is False
        assert Sandbox.get_info(sb.sandbox_id).state == SandboxState.PAUSED  # untouched
        # A paused sandbox still ends at its timeout, and its snapshot with it.
        Sandbox.set_timeout(sb.sandbox_id, 1)
        assert until(lambda: sb.sandbox_id not in paused_ids())
        with pytest.raises(NotFoundException):
            Sandbox.connect(sb.sandbox_id)
        assert until(lambda: kept_snapshots(store) == [])
    finally:
        Sandbox.kill(sb.sandbox_id)

    killed = Sandbox.create(timeout=600)
    assert killed.pause() is True
    assert killed.kill() is True
    with pytest.raises(NotFoundException):
        Sandbox.connect(killed.sandbox_id)
    assert kept_snapshots(store) == []


def test_pause_is_refused_while_a_command_runs(store: Path) -> None:
    sb = Sandbox.create(timeout=600)
    try:
        sb.run_code("kept = 'still here'")
        handle = sb.commands.run("sleep 600", background=True)
        with pytest.raises(SandboxException, match="commands are running"):
            sb.pause()
        assert sb.get_info().state == SandboxState.RUNNING
        assert sb.run_code("kept").text == "'still here'"  # nothing was lost
        assert handle.kill() is True
        assert until(lambda: handle.pid not in {p.pid for p in sb.commands.list()})
        assert sb.pause() is True
        assert Sandbox.connect(sb.sandbox_id).run_code("kept").text == "'still here'"
    finally:
        sb.kill()
    assert kept_snapshots(store) == []


def test_a_gpu_budget_is_refused_on_a_cpu_server() -> None:
    with pytest.raises(SandboxException, match="without SANDBOX_GPU"):
        Sandbox.create(metadata={"gpu_memory_mb": "1024"})
    with pytest.raises(SandboxException, match="whole number of MiB"):
        Sandbox.create(metadata={"gpu_memory_mb": "lots"})


def test_the_javascript_sdk_pauses_and_connects_again(e2bsrv: Server, store: Path) -> None:
    if not (NODE.exists() and (JS_DIR / "node_modules" / "@e2b" / "code-interpreter").is_dir()):
        pytest.fail(
            f"the JavaScript SDK is not installed in {JS_DIR}/node_modules: run `make setup` (npm ci)"
        )
    env = {
        **os.environ,
        "E2B_API_URL": e2bsrv.http + "/e2b",
        "E2B_SANDBOX_URL": e2bsrv.http + "/e2b",
        "E2B_API_KEY": ALICE,
    }
    done = subprocess.run(
        [str(NODE), "pause.mjs"],
        cwd=JS_DIR,
        env=env,
        capture_output=True,
        text=True,
        timeout=scaled(120),
        check=False,
    )
    assert done.returncode == 0, (
        f"node exited {done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    )
    assert done.stdout.strip() == "ok"
    assert kept_snapshots(store) == []
