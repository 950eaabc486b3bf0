"""Stateful sessions: state persists across requests and connections; bounded and owned."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import websockets

from appliance_client.client import AsyncClient
from tests.support import Server, jail_processes, start_server, until_async


@pytest.fixture(scope="module")
def sessions(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(
        tmp_path_factory.mktemp("sess"),
        # Long enough that no session of these tests expires while one runs, however loaded
        # the machine: expiry has a server of its own (test_an_idle_session_expires).
        SANDBOX_SESSION_IDLE_S="600",
        SANDBOX_MAX_SESSIONS="3",
        SANDBOX_MAX_EXEC_MS="5000",
    )
    yield srv
    srv.stop()


async def test_a_session_keeps_variables_across_two_connections(sessions: Server) -> None:
    async with AsyncClient(sessions.url) as c:
        first = await c.execute("x = 21\nimport math\nopen('notes.txt', 'w').write('kept')", session="new")
    assert first.status == "ok" and first.session and len(first.session) == 32  # 128 bits, hex
    async with AsyncClient(sessions.url) as c:
        second = await c.execute(
            "print(open('notes.txt').read())\nmath.floor(x * 2.5)", session=first.session
        )
        await c.close_session(first.session)
    assert second.status == "ok" and second.stdout == "kept\n" and second.text == "52"


async def test_the_client_session_object_reuses_its_session(sessions: Server) -> None:
    async with AsyncClient(sessions.url) as c, c.session() as s:
        await s.execute("counter = 1")
        await s.execute("counter += 1")
        ex = await s.execute("counter")
        assert ex.text == "2" and ex.session == s.id


async def test_a_second_cell_while_one_runs_is_rejected_as_busy(sessions: Server) -> None:
    async with AsyncClient(sessions.url) as c:
        opened = await c.execute("import time", session="new")
        sid = opened.session
        # The first cell runs until it reads a line, sent once the second has been turned away.
        up = asyncio.Event()
        slow = asyncio.create_task(
            c.execute(
                "print('up', flush=True)\ninput()\n'slow done'",
                session=sid,
                id="slow",
                on_stdout=lambda _: up.set(),
            )
        )
        await up.wait()
        second = await c.execute("1", session=sid)
        assert second.status == "rejected" and "busy" in (second.message or "")
        await c.stdin("slow", "\n")
        assert (await slow).text == "'slow done'"
        assert sid is not None
        await c.close_session(sid)


async def test_close_session_ends_it_and_later_use_is_rejected(sessions: Server) -> None:
    async with AsyncClient(sessions.url) as c:
        sid = (await c.execute("y = 1", session="new")).session
        assert sid is not None
        closed = await c.close_session(sid)
        assert closed["status"] == "ok"
        again = await c.execute("y", session=sid)
    assert again.status == "rejected" and "no such session" in (again.message or "")


async def test_an_unknown_session_id_is_rejected(sessions: Server) -> None:
    async with AsyncClient(sessions.url) as c:
        ex = await c.execute("1", session="0" * 32)
    assert ex.status == "rejected" and "no such session" in (ex.message or "")


async def test_an_idle_session_expires(tmp_path: Path) -> None:
    srv = start_server(tmp_path, SANDBOX_SESSION_IDLE_S="1")
    try:
        async with AsyncClient(srv.url) as c:
            sid = (await c.execute("z = 1", session="new")).session
            # The registry drops it (the only one open) once idle a second.
            await until_async(
                lambda: json.loads(srv.get("/readyz")[1])["sessions"]["open"] == 0, 30, "expiry"
            )
            ex = await c.execute("z", session=sid)
        assert ex.status == "rejected"
    finally:
        srv.stop()


async def test_the_number_of_sessions_is_capped(sessions: Server) -> None:
    async with AsyncClient(sessions.url) as c:
        ids = [(await c.execute("1", session="new")).session for _ in range(3)]
        over = await c.execute("1", session="new")
        assert over.status == "rejected" and "SANDBOX_MAX_SESSIONS" in (over.message or "")
        for sid in ids:
            assert sid is not None
            await c.close_session(sid)


async def test_a_timeout_stops_the_cell_but_keeps_the_session(sessions: Server) -> None:
    async with AsyncClient(sessions.url) as c:
        sid = (await c.execute("kept = 'yes'", session="new")).session
        spin = await c.execute("while True: pass", session=sid, timeout_ms=1000)
        assert spin.status == "timeout"
        after = await c.execute("kept", session=sid)
        assert after.text == "'yes'"
        assert sid is not None
        await c.close_session(sid)


async def test_a_cell_that_ignores_interrupts_ends_the_session_and_says_so(sessions: Server) -> None:
    async with AsyncClient(sessions.url) as c:
        sid = (await c.execute("import signal", session="new")).session
        stuck = await c.execute(
            "signal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True: pass", session=sid, timeout_ms=1000
        )
        assert stuck.status == "timeout" and "session has ended" in (stuck.message or "")
        after = await c.execute("1", session=sid)
        assert after.status == "rejected"


async def test_sessions_leave_no_process_behind_once_closed(tmp_path_factory: pytest.TempPathFactory) -> None:
    srv = start_server(tmp_path_factory.mktemp("sessgone"), SANDBOX_POOL_SIZE="0")
    try:
        async with AsyncClient(srv.url) as c:
            sid = (
                await c.execute("import subprocess\nsubprocess.Popen(['sleep', '300'])", session="new")
            ).session
            assert sid and jail_processes(srv)
            await c.close_session(sid)
        assert jail_processes(srv) == []
    finally:
        srv.stop()


async def test_close_session_over_a_raw_websocket(sessions: Server) -> None:
    async with AsyncClient(sessions.url) as c:
        sid = (await c.execute("1", session="new")).session
    async with websockets.connect(sessions.url) as ws:
        await ws.send(json.dumps({"type": "close_session", "session": sid, "id": "bye"}))
        done = json.loads(await ws.recv())
    assert done["type"] == "done" and done["id"] == "bye" and done["status"] == "ok"
