"""GPU sessions: a session opened with a GPU budget holds one device and that budget for its
whole life; its cells keep their state; the watchdog holds between cells; per-tenant GPU
quotas. A real server and real jails on the simulated GPU backend (no GPU here).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from appliance.core import tenants
from appliance.core.errors import Busy
from appliance.sandbox.proctree import descendants
from appliance_client.client import AsyncClient
from tests.models import write_tiny_llama
from tests.support import Server, reachable_tmp_root, scaled, start_server, until_async
from tests.test_gpu_server import simulate

MARGIN_MB = 128
ALICE = "alice-" + secrets.token_hex(12)
BOB = "bob-" + secrets.token_hex(12)
TOKENS = f"""
[[tenant]]
name = "alice"
token = "{ALICE}"
max_gpu_mb = 1500

[[tenant]]
name = "bob"
token = "{BOB}"
"""


def gpu_env(control: Path) -> dict[str, str]:
    return {
        "SANDBOX_GPU": "1",
        "SANDBOX_GPU_BACKEND": "simulated",
        "SANDBOX_GPU_SIMULATE": "1x4096",
        "SANDBOX_GPU_SIMULATE_FILE": str(control),
        "SANDBOX_GPU_MARGIN_MB": str(MARGIN_MB),
        "SANDBOX_GPU_DEFAULT_MB": "512",
        "SANDBOX_GPU_POLL_MS": "100",
        "SANDBOX_GPU_QUEUE_MS": "60000",
        "SANDBOX_PRELOAD": "",
    }


IDLE_S = 5  # the session server's SANDBOX_SESSION_IDLE_S: each test's cells come well within it


@pytest.fixture(scope="module")
def gpu_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    tmp = tmp_path_factory.mktemp("gpu-sessions")
    control = tmp / "sim.json"
    with reachable_tmp_root("appliance-gpu-models-") as models:
        write_tiny_llama(models / "tiny.gguf")
        srv = start_server(
            tmp / "srv",
            SANDBOX_MODELS_DIR=str(models),
            SANDBOX_SESSION_IDLE_S=str(IDLE_S),
            SANDBOX_SNAPSHOT_DIR=str(tmp / "snapshots"),
            settings=gpu_env(control),
        )
        yield srv, control
        srv.stop()


def readyz(server: Server) -> dict[str, Any]:
    _status, body = server.get("/readyz")
    found: dict[str, Any] = json.loads(body)
    return found


def reserved_mb(server: Server) -> int:
    return sum(int(d["reserved_mb"]) for d in readyz(server)["gpu"]["devices"])


async def until_reclaimed(server: Server, timeout: float = 15) -> int:
    """Reserved MiB once the ledger gave every ended grant back (it waits for NVML to show the
    memory freed first), or what is still reserved at the timeout."""
    deadline = time.monotonic() + scaled(timeout)
    while reserved_mb(server) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return reserved_mb(server)


def pid_named(server: Server, comm: str, timeout: float = 10) -> int:
    """The host PID of the server's descendant whose /proc comm is `comm`."""
    deadline = time.monotonic() + scaled(timeout)
    while time.monotonic() < deadline:
        for pid in descendants(server.proc.pid):
            try:
                if Path(f"/proc/{pid}/comm").read_text().strip() == comm:
                    return pid
            except OSError:
                continue
        time.sleep(0.05)
    raise AssertionError(f"no process named {comm!r} under the server")


# The interpreter renames itself (prctl PR_SET_NAME) so the test can find its host PID.
RENAME = "import ctypes\nctypes.CDLL(None).prctl(15, b'{name}', 0, 0, 0)\n"


async def test_a_gpu_session_keeps_its_state_and_its_grant_across_cells(
    gpu_server: tuple[Server, Path],
) -> None:
    srv, _ = gpu_server
    async with AsyncClient(srv.url) as c:
        first = await c.execute(
            "import os\nx = 41\nprint(os.environ['CUDA_VISIBLE_DEVICES'])",
            session="new",
            gpu={"memory_mb": 1000},
        )
        assert first.status == "ok", first.frames
        sid = str(first.session)
        assert first.frames[0]["gpu"]["memory_mb"] == 1000
        # Between cells the grant stays held: the ledger and /readyz count it like a run.
        assert reserved_mb(srv) == 1000
        assert readyz(srv)["sessions"] == {"open": 1, "gpu": 1, "gpu_memory_mb": 1000}
        _, text = srv.get("/metrics")
        samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
        assert float(samples["appliance_gpu_sessions_active"]) == 1
        assert float(samples["appliance_gpu_session_memory_bytes"]) == 1000 * 1024 * 1024
        later = [
            await c.execute("x += 1\nprint(x, os.environ['CUDA_VISIBLE_DEVICES'])", session=sid)
            for _ in range(3)
        ]
        assert [e.status for e in later] == ["ok"] * 3, [e.frames for e in later]
        device = first.stdout.strip()
        assert [e.stdout for e in later] == [f"{n} {device}\n" for n in (42, 43, 44)]
        same = await c.execute("print('same budget')", session=sid, gpu={"memory_mb": 1000})
        assert same.status == "ok"
        other = await c.execute("print('ran')", session=sid, gpu={"memory_mb": 2000})
        assert other.status == "rejected" and other.stdout == ""
        assert "1000 MiB for its whole life" in (other.message or "")
        assert await c.close_session(sid)
    assert await until_reclaimed(srv) == 0, "closing the session gave its GPU budget back"
    assert readyz(srv)["sessions"]["gpu"] == 0


async def test_a_gpu_sessions_snapshot_records_its_budget_and_a_restore_asks_for_it_again(
    gpu_server: tuple[Server, Path],
) -> None:
    srv, _ = gpu_server
    async with AsyncClient(srv.url) as c:
        session = c.session()
        first = await session.execute("x = 41", gpu={"memory_mb": 700})
        assert first.status == "ok", first.frames
        taken = await session.snapshot()
        assert taken["gpu_memory_mb"] == 700
        await session.close()
        assert await until_reclaimed(srv) == 0
        # The fork asks for the snapshot's budget again, admitted as a new GPU session is.
        fork = c.session(from_snapshot=taken["snapshot"])
        again = await fork.execute("x + 1")
        assert again.status == "ok" and again.text == "42", again.frames
        assert again.frames[0]["gpu"]["memory_mb"] == 700 and reserved_mb(srv) == 700
        other = await c.execute("1", session="new", from_snapshot=taken["snapshot"], gpu={"memory_mb": 300})
        assert other.status == "rejected" and "700 MiB" in (other.message or ""), other.frames
        await fork.close()
    assert await until_reclaimed(srv) == 0


async def test_a_run_queued_behind_a_gpu_session_starts_once_the_session_closes(
    gpu_server: tuple[Server, Path],
) -> None:
    srv, _ = gpu_server
    big = 4096 - MARGIN_MB - 100
    async with AsyncClient(srv.url) as c:
        opened = await c.execute("y = 1", session="new", gpu={"memory_mb": big})
        assert opened.status == "ok", opened.frames
        waiter = asyncio.create_task(c.execute("print('late')", gpu={"memory_mb": 1000}))
        await until_async(lambda: readyz(srv)["gpu"]["queued"] == 1, 20, "the run in the GPU queue")
        assert not waiter.done(), "the session's budget leaves no room: the run waits in line"
        assert await c.close_session(str(opened.session))
        ex = await asyncio.wait_for(waiter, scaled(20))
    assert ex.status == "ok" and ex.stdout == "late\n" and ex.frames[0]["queued_ms"] > 0


async def test_a_gpu_session_over_its_budget_between_cells_ends_with_a_clear_message(
    gpu_server: tuple[Server, Path],
) -> None:
    srv, control = gpu_server
    async with AsyncClient(srv.url) as c:
        opened = await c.execute(
            RENAME.format(name="gpusess77") + "z = 1", session="new", gpu={"memory_mb": 1000}
        )
        assert opened.status == "ok", opened.frames
        sid = str(opened.session)
        pid = await asyncio.to_thread(pid_named, srv, "gpusess77")
        # The interpreter itself (what a loaded model or a thread keeps) goes over, between cells.
        simulate(control, processes=[{"pid": pid, "gpu": 0, "used_mb": 1000 + MARGIN_MB + 50}])
        try:
            deadline = time.monotonic() + scaled(15)
            while readyz(srv)["sessions"]["open"] and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            later = await c.execute("print(z)", session=sid)
        finally:
            simulate(control)
    assert later.status == "rejected" and later.stdout == ""
    assert "has ended" in (later.message or "") and "between cells" in (later.message or "")
    assert "GPU" in (later.message or "")
    # The registry forgets the session first, then its jail is killed and reaped: a moment later.
    deadline = time.monotonic() + scaled(10)
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert not Path(f"/proc/{pid}").exists(), "the session's interpreter is gone"
    assert await until_reclaimed(srv) == 0


async def test_a_gpu_session_whose_cell_goes_over_budget_ends(gpu_server: tuple[Server, Path]) -> None:
    srv, control = gpu_server
    async with AsyncClient(srv.url) as c:
        opened = await c.execute(
            RENAME.format(name="gpucell66") + "w = 1", session="new", gpu={"memory_mb": 700}
        )
        sid = str(opened.session)
        pid = await asyncio.to_thread(pid_named, srv, "gpucell66")
        up = asyncio.Event()
        cell = asyncio.create_task(
            c.execute(
                "import time\nprint('up', flush=True)\ntime.sleep(30)",
                session=sid,
                on_stdout=lambda _: up.set(),
            )
        )
        await up.wait()
        simulate(control, processes=[{"pid": pid, "gpu": 0, "used_mb": 700 + MARGIN_MB + 1}])
        try:
            ex = await asyncio.wait_for(cell, scaled(15))
        finally:
            simulate(control)
        assert ex.status == "gpu_memory_limit", ex.frames
        assert "session has ended" in (ex.message or "")
        after = await c.execute("print(w)", session=sid)
    assert after.status == "rejected" and "GPU memory budget" in (after.message or "")
    assert await until_reclaimed(srv) == 0


LOAD = (
    "import json\nfrom appliance.tools import load_llm, cache_info\nllm = load_llm('tiny.gguf')\n"
    "text = llm('hello', max_tokens=4)\nprint(json.dumps(cache_info()['llm']))"
)


async def test_a_gpu_session_loads_its_model_once_and_later_cells_reuse_it(
    gpu_server: tuple[Server, Path],
) -> None:
    srv, _ = gpu_server
    async with AsyncClient(srv.url) as c:
        first = await c.execute(LOAD, session="new", gpu={"memory_mb": 800})
        assert first.status == "ok", (first.stderr, first.error)
        sid = str(first.session)
        later = [await c.execute(LOAD, session=sid) for _ in range(3)]
        await c.close_session(sid)
    assert [e.status for e in later] == ["ok"] * 3, [(e.stderr, e.error) for e in later]
    counts = [json.loads(e.stdout.splitlines()[-1]) for e in [first, *later]]
    # The loader's own counters in the session's interpreter: one load, then only reuse.
    assert [c["loads"] for c in counts] == [1, 1, 1, 1], counts
    assert [c["hits"] for c in counts] == [0, 1, 2, 3], counts


async def test_an_idle_gpu_session_expires_and_a_queued_run_then_starts(
    gpu_server: tuple[Server, Path],
) -> None:
    srv, _ = gpu_server
    big = 4096 - MARGIN_MB - 100
    async with AsyncClient(srv.url) as c:
        opened = await c.execute("v = 1", session="new", gpu={"memory_mb": big})
        assert opened.status == "ok", opened.frames
        waiter = asyncio.create_task(c.execute("print('after expiry')", gpu={"memory_mb": 1000}))

        def queued() -> dict[str, Any]:
            now = readyz(srv)
            return now if now["gpu"]["queued"] == 1 else {}

        # One look at /readyz: the run waits in line while the idle session still holds the GPU.
        seen = await until_async(queued, 20, "the run in the GPU queue")
        assert seen["sessions"]["gpu"] == 1, seen
        ex = await asyncio.wait_for(waiter, scaled(60))
        late = await c.execute("print(v)", session=str(opened.session))
    assert ex.status == "ok" and ex.stdout == "after expiry\n"
    assert late.status == "rejected" and "idle too long" in (late.message or "")


# -- per-tenant GPU quota ------------------------------------------------------------------------


def test_max_gpu_mb_is_parsed_and_held_until_released() -> None:
    found, _ = tenants.parse(TOKENS)
    assert {t.name: t.max_gpu_mb for t in found} == {"alice": 1500, "bob": None}
    reg = tenants.Tenants(found)
    alice = tenants.owner_of(ALICE)
    release = reg.hold_gpu(alice, 1000)
    with pytest.raises(Busy, match=r"max_gpu_mb=1500: 1000 MiB held .* 1000 MiB asked"):
        reg.hold_gpu(alice, 1000)
    small = reg.hold_gpu(alice, 500)
    release()
    release()  # twice is once
    reg.hold_gpu(alice, 1000)
    small()
    reg.hold_gpu(tenants.owner_of(BOB), 100000)  # no quota: nothing held, nothing refused
    with pytest.raises(Exception, match="max_gpu_mb must be a whole number"):
        tenants.parse(f"[[tenant]]\nname='a'\ntoken='{ALICE}'\nmax_gpu_mb=0")


@pytest.fixture(scope="module")
def tenant_gpu_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("gpu-tenants")
    path = tmp / "tokens.toml"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(TOKENS)
    srv = start_server(tmp / "srv", SANDBOX_AUTH_TOKENS_FILE=str(path), settings=gpu_env(tmp / "sim.json"))
    yield srv
    srv.stop()


async def test_a_tenant_over_its_gpu_quota_gets_busy_while_another_runs(tenant_gpu_server: Server) -> None:
    srv = tenant_gpu_server
    async with AsyncClient(srv.url, ALICE, retry_busy_s=0) as alice, AsyncClient(srv.url, BOB) as bob:
        opened = await alice.execute("a = 1", session="new", gpu={"memory_mb": 1000})
        assert opened.status == "ok", opened.frames
        over = await alice.execute("print('ran')", gpu={"memory_mb": 600})
        assert over.status == "busy" and "max_gpu_mb=1500" in (over.message or "") and over.stdout == ""
        fits = await alice.execute("print('fits')", gpu={"memory_mb": 500})
        assert fits.status == "ok" and fits.stdout == "fits\n"
        other = await bob.execute("print('bob')", gpu={"memory_mb": 2000})
        assert other.status == "ok" and other.stdout == "bob\n"
        assert await alice.close_session(str(opened.session))
        again = await alice.execute("print('again')", gpu={"memory_mb": 1500})
    assert again.status == "ok" and again.stdout == "again\n"
