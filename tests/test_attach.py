"""Reattachable runs (appliance.api.runlog): every frame of a run carries `seq`; a run whose
client drops goes on to its end; `attach` (WebSocket) and GET /v1/runs/{run}/frames (REST)
send its frames after a seq, then the live ones, to its done; another tenant's, an expired
and an unknown run get one answer; what the store keeps stays within its bounds.

One module server (two tenants, two finished runs kept per tenant) and, for expiry, one of
its own. The runs wait on stdin where a test needs them alive: nothing sleeps to synchronise.
"""

from __future__ import annotations

import asyncio
import hashlib
import http.client
import json
import os
import re
import secrets
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import pytest
import websockets

from appliance.api.runlog import Bounds, RunStore
from appliance.core.errors import Cancelled
from appliance.core.events import Done, Output, Started
from appliance.core.tasks import TaskScope
from appliance_client.client import AsyncClient, Client, ConnectionLost, DoneEvent, Event, StdoutEvent
from tests.core_fakes import FakeMetrics
from tests.support import Server, scaled, start_server, until_async

ALICE = "alice-" + secrets.token_hex(12)
BOB = "bob-" + secrets.token_hex(12)
TOKENS_FILE = f"""
[[tenant]]
name = "alice"
token = "{ALICE}"

[[tenant]]
name = "bob"
token_sha256 = "{hashlib.sha256(BOB.encode()).hexdigest()}"
"""
# Prints 40 lines, waits for a line of stdin, prints 40 more and what it read, and ends.
TWO_PARTS = (
    "import sys\n"
    "for i in range(40):\n    print(f'first {i}', flush=True)\n"
    "got = sys.stdin.readline().strip()\n"
    "for i in range(40):\n    print(f'second {i}', flush=True)\n"
    "print('read', got)\n"
)
TWO_PARTS_OUT = (
    "".join(f"first {i}\n" for i in range(40)) + "".join(f"second {i}\n" for i in range(40)) + "read go\n"
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("attach")
    path = tmp / "tokens.toml"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(TOKENS_FILE)
    srv = start_server(
        tmp,
        SANDBOX_AUTH_TOKENS_FILE=str(path),
        SANDBOX_POOL_SIZE="0",
        SANDBOX_MAX_EXEC_MS="60000",
        SANDBOX_REATTACH_RUNS="2",
    )
    yield srv
    srv.stop()


async def connect(server: Server, token: str) -> Any:
    return await websockets.connect(server.url, additional_headers={"Authorization": f"Bearer {token}"})


async def recv(ws: Any) -> dict[str, Any]:
    frame: dict[str, Any] = json.loads(await asyncio.wait_for(ws.recv(), scaled(60)))
    return frame


async def until_done(ws: Any, rid: str | None = None) -> list[dict[str, Any]]:
    frames: list[dict[str, Any]] = []
    while not frames or frames[-1]["type"] != "done":
        frame = await recv(ws)
        if rid is None or frame["id"] == rid:
            frames.append(frame)
    return frames


def stdout(frames: list[dict[str, Any]]) -> str:
    return "".join(f["text"] for f in frames if f["type"] == "stream" and f["name"] == "stdout")


def seqs(frames: list[dict[str, Any]]) -> list[int]:
    return [int(f["seq"]) for f in frames]


async def started(ws: Any, code: str, rid: str, **fields: Any) -> list[dict[str, Any]]:
    """Send an execute and read up to its first stdout frame: the run is alive, in its jail."""
    await ws.send(json.dumps({"type": "execute", "id": rid, "code": code, **fields}))
    frames = [await recv(ws)]
    assert frames[0]["type"] == "start", frames
    while frames[-1]["type"] != "stream":
        frames.append(await recv(ws))
        assert frames[-1]["type"] != "done", frames
    return frames


def refused(frame: dict[str, Any]) -> tuple[str, str, str | None]:
    return frame["type"], frame["status"], frame["message"]


async def test_a_client_killed_mid_cell_reattaches_with_no_frame_lost_or_repeated(server: Server) -> None:
    ws = await connect(server, ALICE)
    first = await started(ws, TWO_PARTS, "r1")
    run = first[0]["run"]
    ws.transport.abort()  # killed: no Close frame, frames it never read are lost with it

    # A new connection resumes after the last frame it had; a second follows from the start.
    again, watcher = await connect(server, ALICE), await connect(server, ALICE)
    await again.send(json.dumps({"type": "attach", "run": run, "after": first[-1]["seq"], "id": "back"}))
    await watcher.send(json.dumps({"type": "attach", "run": run}))
    await again.send(json.dumps({"type": "stdin", "id": "back", "data": "go\n"}))
    rest = await until_done(again)
    whole = await until_done(watcher)
    assert rest[-1]["status"] == "ok", rest[-1]
    assert all(f["id"] == "back" for f in rest), "an attach's frames carry its id"
    assert all(f["id"] == "r1" for f in whole), "an attach without id: the run's own"
    assert seqs(first + rest) == list(range(len(first) + len(rest))), "a frame lost or repeated"
    assert stdout(first + rest) == TWO_PARTS_OUT
    assert seqs(whole) == seqs(first + rest) and stdout(whole) == TWO_PARTS_OUT
    assert [f["type"] for f in whole].count("start") == 1 and whole[0]["type"] == "start"
    for sock in (again, watcher):
        await sock.close()


async def test_an_attach_takes_stdin_and_interrupt_for_the_run_it_follows(server: Server) -> None:
    ws = await connect(server, ALICE)
    first = await started(ws, TWO_PARTS, "r2")
    ws.transport.abort()  # the run waits on stdin, with nobody following it
    again = await connect(server, ALICE)
    await again.send(json.dumps({"type": "attach", "run": first[0]["run"], "after": 1_000_000, "id": "a2"}))
    await again.send(json.dumps({"type": "interrupt", "id": "a2"}))
    frames = await until_done(again)
    # After a seq past the end, only the live frames: here none but the done.
    assert [f["type"] for f in frames] == ["done"] and frames[0]["status"] == "cancelled", frames
    assert frames[0]["seq"] > first[-1]["seq"]
    await again.close()


async def test_a_session_outlives_its_clients_dropped_connection(server: Server) -> None:
    ws = await connect(server, ALICE)
    code = "import sys\nx = 41\nprint('set', flush=True)\nsys.stdin.readline()\nprint('cell done')"
    first = await started(ws, code, "s1", session="new")
    session, run = first[0]["session"], first[0]["run"]
    ws.transport.abort()  # mid-cell: the cell waits on stdin
    again = await connect(server, ALICE)
    await again.send(json.dumps({"type": "attach", "run": run, "after": first[-1]["seq"], "id": "s1"}))
    await again.send(json.dumps({"type": "stdin", "id": "s1", "data": "\n"}))
    rest = await until_done(again)
    assert rest[-1]["status"] == "ok" and rest[-1]["session"] == session, rest
    assert stdout(first + rest) == "set\ncell done\n"
    await again.send(json.dumps({"type": "execute", "id": "s2", "code": "x + 1", "session": session}))
    nxt = await until_done(again)
    assert nxt[-1]["status"] == "ok", nxt
    assert [f["data"]["text/plain"] for f in nxt if f["type"] == "result"] == ["42"]
    assert seqs(nxt) == list(range(len(nxt))), "each cell is a run of its own, numbered from 0"
    await again.send(json.dumps({"type": "close_session", "session": session}))
    await recv(again)
    await again.close()


async def test_another_tenants_run_is_refused_as_an_unknown_one(server: Server) -> None:
    alice = await connect(server, ALICE)
    first = await started(alice, TWO_PARTS, "t1")
    run = first[0]["run"]
    bob = await connect(server, BOB)
    await bob.send(json.dumps({"type": "attach", "run": run, "id": "steal"}))
    stolen = await recv(bob)
    await bob.send(json.dumps({"type": "attach", "run": "0" * 16, "id": "guess"}))
    guessed = await recv(bob)
    assert refused(stolen) == refused(guessed) == ("done", "rejected", "no such run"), (stolen, guessed)
    assert "seq" not in stolen
    status, body = server.request("GET", f"/v1/runs/{run}/frames", BOB)
    unknown = server.request("GET", f"/v1/runs/{'0' * 16}/frames", BOB)
    assert (status, json.loads(body)["message"]) == (unknown[0], json.loads(unknown[1])["message"])
    assert status == 404 and json.loads(body)["status"] == "rejected"
    # Bob's stdin cannot reach it either; alice's run is untouched and ends as it should.
    await bob.send(json.dumps({"type": "stdin", "id": "t1", "data": "bad\n"}))
    assert (await recv(bob))["status"] == "rejected"
    await alice.send(json.dumps({"type": "stdin", "id": "t1", "data": "go\n"}))
    assert stdout(first + await until_done(alice)) == TWO_PARTS_OUT
    await bob.close()
    await alice.close()


async def test_the_client_resumes_a_run_its_dropped_connection_had_started(server: Server) -> None:
    code = "import time\nprint('before', flush=True)\ntime.sleep(0.5)\nfor i in range(30):\n    print(i, flush=True)"
    expected = "before\n" + "".join(f"{i}\n" for i in range(30))
    seen: list[Event] = []
    async with AsyncClient(server.url, ALICE) as c:

        async def read_then_drop() -> None:
            async for ev in c.stream(code):
                seen.append(ev)
                if isinstance(ev, StdoutEvent):
                    assert c._ws is not None
                    c._ws.transport.abort()

        with pytest.raises(ConnectionLost, match=r"attach\('[0-9a-f]+'\) follows it again") as lost:
            await read_then_drop()
        run = lost.value.run
        assert run is not None and run == seen[0]["run"]
        assert lost.value.seq == seen[-1].seq == c.last_seq(run)
        rest = [ev async for ev in c.attach(run)]  # after the last seq it had: nothing again
    assert isinstance(rest[-1], DoneEvent) and rest[-1].ok
    assert [ev.seq for ev in seen + rest] == list(range(len(seen) + len(rest)))
    assert stdout(seen + rest) == expected  # type: ignore[arg-type]

    def whole() -> list[Event]:
        with Client(server.url, ALICE) as sync:
            return list(sync.attach(run, after=-1))

    again = await asyncio.to_thread(whole)
    assert [dict(ev) | {"id": ""} for ev in again] == [dict(ev) | {"id": ""} for ev in seen + rest]
    async with AsyncClient(server.url, BOB) as bob:
        refusal = [ev async for ev in bob.attach(run)]
    assert [(ev.type, ev["status"], ev["message"]) for ev in refusal] == [("done", "rejected", "no such run")]


def ndjson(
    server: Server, method: str, path: str, token: str, body: object = None
) -> Generator[dict[str, Any], None, None]:
    """An HTTP request's NDJSON reply, line by line as it streams."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=scaled(60))
    headers = {"Authorization": f"Bearer {token}"}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    conn.request(method, path, body=data, headers=headers)
    response = conn.getresponse()
    assert response.status == 200, (response.status, response.read()[:300])
    try:
        for line in response:
            if line.strip():
                yield json.loads(line)
    finally:
        conn.close()


async def test_rest_follows_a_live_run_as_ndjson_and_a_dropped_rest_run_goes_on(server: Server) -> None:
    # POST /v1/exec, read to the first output, and drop the connection: the run goes on.
    posted = ndjson(server, "POST", "/v1/exec", ALICE, {"id": "n1", "code": TWO_PARTS})
    first = [await asyncio.to_thread(next, posted)]
    while first[-1]["type"] != "stream":
        first.append(await asyncio.to_thread(next, posted))
    posted.close()
    run = first[0]["run"]

    def follow(after: int) -> list[dict[str, Any]]:
        return list(ndjson(server, "GET", f"/v1/runs/{run}/frames?after={after}", ALICE))

    following = asyncio.create_task(asyncio.to_thread(follow, first[-1]["seq"]))
    ws = await connect(server, ALICE)
    await ws.send(json.dumps({"type": "attach", "run": run, "id": "feed"}))
    await ws.send(json.dumps({"type": "stdin", "id": "feed", "data": "go\n"}))
    rest = await asyncio.wait_for(following, scaled(60))
    assert rest[-1]["type"] == "done" and rest[-1]["status"] == "ok", rest[-1]
    assert seqs(first + rest) == list(range(len(first) + len(rest)))
    assert stdout(first + rest) == TWO_PARTS_OUT
    assert (await until_done(ws))[-1]["status"] == "ok"
    await ws.close()
    # Finished and kept: the whole run again, ending with the same done.
    again = await asyncio.to_thread(follow, -1)
    assert again == first + rest
    status, body = server.request("GET", f"/v1/runs/{run}/frames?after=x", ALICE)
    assert status == 400 and "'after' must be an integer" in json.loads(body)["message"]
    # A session opened over REST: its first cell's frames are numbered and kept like any run's.
    status, body = server.request("POST", "/v1/sessions", ALICE, {"code": "print('opened')"})
    assert status == 201, body
    opened = json.loads(body)
    assert seqs(opened["frames"]) == list(range(len(opened["frames"])))
    kept = await asyncio.to_thread(
        lambda: list(ndjson(server, "GET", f"/v1/runs/{opened['frames'][0]['run']}/frames", ALICE))
    )
    assert kept == opened["frames"] and stdout(kept) == "opened\n"
    assert server.request("DELETE", f"/v1/sessions/{opened['session']}", ALICE)[0] == 204


def evicted(server: Server, reason: str) -> float:
    status, text = server.get("/metrics", ALICE)
    assert status == 200
    match = re.search(rf'^appliance_run_logs_evicted_total{{reason="{reason}"}} (\S+)$', text, re.M)
    return float(match.group(1)) if match else 0.0


async def test_finished_runs_past_a_tenants_count_are_evicted_oldest_first(server: Server) -> None:
    before = evicted(server, "runs")
    runs = []

    def posted(code: str) -> list[dict[str, Any]]:
        return list(ndjson(server, "POST", "/v1/exec", BOB, {"code": code}))

    for i in range(3):
        frames = await asyncio.to_thread(posted, f"print({i})")
        assert frames[-1]["status"] == "ok", frames
        runs.append(frames)
    assert evicted(server, "runs") >= before + 1
    status, _ = server.request("GET", f"/v1/runs/{runs[0][0]['run']}/frames", BOB)
    assert status == 404, "the oldest finished run went first"
    kept = await asyncio.to_thread(
        lambda: list(ndjson(server, "GET", f"/v1/runs/{runs[2][0]['run']}/frames", BOB))
    )
    assert kept == runs[2]


async def test_an_expired_run_is_refused(tmp_path: Path) -> None:
    srv = start_server(tmp_path, SANDBOX_AUTH_TOKEN=ALICE, SANDBOX_POOL_SIZE="0", SANDBOX_REATTACH_S="1")
    try:
        ws = await connect(srv, ALICE)
        await ws.send(json.dumps({"type": "execute", "id": "e1", "code": "print('soon gone')"}))
        frames = await until_done(ws)
        assert frames[-1]["status"] == "ok"

        def expired() -> bool:
            status, text = srv.get("/metrics", ALICE)
            return status == 200 and 'appliance_run_logs_evicted_total{reason="expired"} 1.0' in text

        await until_async(expired, 30, "the finished run's expiry")
        await ws.send(json.dumps({"type": "attach", "run": frames[0]["run"], "id": "late"}))
        late = await recv(ws)
        assert (late["id"], *refused(late)) == ("late", "done", "rejected", "no such run"), late
        await ws.close()
    finally:
        srv.stop()


# -- the store alone: its bounds, without a server ------------------------------------------------


class FakeRun:
    def __init__(self, task: asyncio.Task[None]) -> None:
        self.task = task
        self.id = "r"


class FakeService:
    """A RunService's submit: each run emits a start, `lines` streams of `size` chars, a done."""

    def __init__(self, lines: int = 4, size: int = 1000) -> None:
        self.lines, self.size, self.gate = lines, size, asyncio.Event()
        self.gate.set()

    def submit(self, req: Any, owner: str, emit: Any, tasks: TaskScope) -> FakeRun:
        async def body() -> None:
            await emit(Started(secrets.token_hex(8), None, 0, 1000))
            for _ in range(self.lines):
                await self.gate.wait()
                await emit(Output("stdout", "x" * self.size))
            await emit(Done("ok"))

        return FakeRun(tasks.spawn(body()))


class Req:
    def __init__(self, rid: str) -> None:
        self.id = rid


async def test_many_runs_never_attached_stay_within_the_stores_bounds() -> None:
    bounds = Bounds(keep_s=60, run_bytes=3000, tenant_runs=5, tenant_bytes=12000, tenants=2)
    metrics = FakeMetrics()
    store = RunStore(bounds, metrics)
    service = FakeService(lines=4, size=1000)
    await store.open()
    try:
        for i in range(500):
            owner = f"tenant-{i % 3}"  # three owners: more than the tenants the totals allow for
            log = store.start(service, Req(f"r{i}"), owner, None)  # type: ignore[arg-type]
            assert log.task is not None
            await log.task
            assert log.bytes <= bounds.run_bytes, "one run keeps at most its own bound"
            assert store.bytes <= bounds.total_bytes
            assert len(store._finished) <= bounds.total_runs
            for tenant in store._tenants.values():
                assert len(tenant.finished) <= bounds.tenant_runs and tenant.bytes <= bounds.tenant_bytes
        assert sum(len(t.finished) for t in store._tenants.values()) == len(store._finished) <= 10
        assert store.bytes == sum(log.bytes for log in store._finished)
        # Each run wrote more than its bound: its oldest frames went, never its done.
        last = next(reversed(store._finished))
        assert last.frames[-1][1].startswith('{"type":"done"') and last.frames[0][0] > 0
    finally:
        await store.close()


async def test_a_reader_gets_every_frame_once_whether_it_comes_before_during_or_after_the_run() -> None:
    store = RunStore(Bounds(keep_s=60, run_bytes=10**6, tenant_runs=5, tenant_bytes=10**7), FakeMetrics())
    service = FakeService(lines=30, size=10)
    service.gate.clear()
    await store.open()
    try:
        log = store.start(service, Req("r"), "me", None)  # type: ignore[arg-type]
        await until_async(lambda: log.run is not None, 5)
        assert log.run is not None and store.find(log.run, "someone else") is None

        async def read(after: int) -> list[int]:
            return [json.loads(t)["seq"] async for t in log.follow(after)]

        early = asyncio.create_task(read(-1))
        mid = asyncio.create_task(read(0))
        service.gate.set()
        assert log.task is not None
        await log.task
        assert await early == list(range(32)) and await mid == list(range(1, 32))
        assert await read(15) == list(range(16, 32))
        assert await read(31) == [31] and await read(10**9) == [31], "past the end: the done alone"
    finally:
        await store.close()


async def test_a_done_goes_out_before_the_store_files_its_run_and_is_found_meanwhile() -> None:
    """The store's bookkeeping of a finished run (filing it, letting older runs go) waits
    until its `done` is sent; while a slow client takes the done, the run is found, done,
    and not expired; a done whose client is gone mid-send is filed all the same."""
    store = RunStore(Bounds(keep_s=60, run_bytes=10**6, tenant_runs=1, tenant_bytes=10**7), FakeMetrics())
    await store.open()
    try:
        first = store.start(FakeService(lines=0), Req("first"), "me", None)  # type: ignore[arg-type]
        assert first.task is not None
        await first.task
        assert first.run is not None and store.find(first.run, "me") is first
        taking, release = asyncio.Event(), asyncio.Event()
        seen: list[str] = []

        async def slow(text: str) -> None:
            frame = json.loads(text)
            if frame["type"] == "done":
                seen.append("filed" if log in store._finished else "not filed")
                taking.set()
                await release.wait()
                raise Cancelled("the client went as its done was sent")

        log = store.start(FakeService(lines=0), Req("second"), "me", slow)  # type: ignore[arg-type]
        await taking.wait()
        assert seen == ["not filed"], "the done went out before the store filed its run"
        assert log.run is not None and store.find(log.run, "me") is log and log.done
        assert store.find(first.run, "me") is first, "nothing was let go before the done went out"
        release.set()
        assert log.task is not None
        await log.task
        assert log in store._finished and store.find(log.run, "me") is log
        assert store.find(first.run, "me") is None, "filed: the tenant keeps one finished run"
    finally:
        await store.close()


async def test_a_queued_run_nobody_follows_is_cancelled_a_started_one_goes_on() -> None:
    store = RunStore(Bounds(keep_s=60, run_bytes=10**6, tenant_runs=5, tenant_bytes=10**7), FakeMetrics())
    await store.open()
    try:
        started, queued = asyncio.Event(), asyncio.Event()

        class Service(FakeService):
            def submit(self, req: Any, owner: str, emit: Any, tasks: TaskScope) -> FakeRun:
                async def body() -> None:
                    if req.id == "queued":
                        queued.set()
                        await asyncio.Event().wait()  # waits for a slot that never comes
                    await emit(Started("run-" + req.id, None, 0, 1000))
                    started.set()
                    await self.gate.wait()
                    await emit(Done("ok"))

                return FakeRun(tasks.spawn(body()))

        service = Service()
        service.gate.clear()

        async def gone(text: str) -> None:
            raise Cancelled("the client disconnected")

        async def sink(text: str) -> None:
            return None

        running = store.start(service, Req("running"), "me", gone)  # type: ignore[arg-type]
        waiting = store.start(service, Req("queued"), "me", sink)  # type: ignore[arg-type]
        await started.wait()
        await queued.wait()
        waiting.detach(sink)
        assert waiting.task is not None and running.task is not None
        with pytest.raises(asyncio.CancelledError):
            await waiting.task
        assert not running.task.done(), "a started run goes on when its client goes"
        service.gate.set()
        await running.task
        assert store.find("run-running", "me") is running and running.done
    finally:
        await store.close()
