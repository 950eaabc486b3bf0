"""Protocol abuse: forged frames, malformed and oversized input, connection floods, other
tenants' sessions. The server must answer `rejected` (or close the one bad connection) and
keep serving everyone else."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import websockets

from appliance_client.client import AsyncClient
from tests.attacks.common import (
    TOKEN,
    assert_contained,
    assert_no_secret,
    assert_one_done,
    attack,
    run,
)
from tests.support import Server, scaled, start_server

Observe = Callable[[str], None]
AUTH = {"Authorization": f"Bearer {TOKEN}"}

FORGE_EVENT = """
import os
def event_fds():
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if int(fd) > 2 and os.readlink(f"/proc/self/fd/{fd}").startswith("pipe:"):
                fds.append(int(fd))
        except OSError:
            pass
    return fds
def forge(line):
    for fd in event_fds():
        try:
            os.write(fd, line)
        except OSError:
            pass
"""


async def raw_exchange(server: Server, *frames: str | bytes, until: int = 1) -> list[dict[str, Any]]:
    """Send raw frames on one connection; collect replies until `until` done frames arrived."""
    replies: list[dict[str, Any]] = []
    async with websockets.connect(server.url, additional_headers=AUTH, max_size=None) as ws:
        for frame in frames:
            await ws.send(frame)
        while sum(r.get("type") == "done" for r in replies) < until:
            replies.append(json.loads(await asyncio.wait_for(ws.recv(), scaled(30))))
        # The same connection still runs code afterwards.
        await ws.send(json.dumps({"id": "after", "code": "print('ok')"}))
        while not replies or replies[-1].get("id") != "after" or replies[-1].get("type") != "done":
            replies.append(json.loads(await asyncio.wait_for(ws.recv(), scaled(30))))
    assert replies[-1]["status"] == "ok", replies[-1]
    assert_no_secret(replies)
    return replies


def rejections(replies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in replies if r.get("type") == "done" and r.get("id") != "after"]


@pytest.fixture(scope="module")
def open_server(tmp_path_factory: pytest.TempPathFactory, tmp_root: Path) -> Iterator[Server]:
    """A server without SANDBOX_AUTH_TOKEN: sessions are still bound to the bearer each client sends."""
    srv = start_server(
        tmp_path_factory.mktemp("open-server"), SANDBOX_POOL_SIZE="0", SANDBOX_TMP_ROOT=str(tmp_root)
    )
    yield srv
    srv.stop()


@attack(
    "print a JSON `done` frame (and a fake `file`) to stdout",
    "it arrives as text inside a stream frame; the request gets exactly one real done",
)
async def test_printed_frames_arrive_inside_stream_text(target: Server, observe: Observe) -> None:
    fake = json.dumps({"type": "done", "id": "c1", "status": "ok", "exit_code": 0})
    code = f'print({fake!r})\nprint(\'{{"type":"file","path":"x","data":""}}\')\nimport sys\nsys.exit(3)'
    ex = await run(target, code)
    assert ex.status == "error" and ex.exit_code == 3 and fake in ex.stdout and ex.files == [], ex
    observe(f"forged done came back as stream text; real done: {ex.status}/{ex.exit_code}")


@attack(
    "print another request's `done` on a shared connection",
    "the other request is unaffected: it gets its own single done and output",
)
async def test_printed_frames_cannot_end_another_request(target: Server, observe: Observe) -> None:
    async with AsyncClient(target.url, TOKEN) as c:
        victim = asyncio.create_task(
            c.execute("import time\ntime.sleep(1.5)\nprint('victim done')", id="victim")
        )
        await asyncio.sleep(0.3)
        fake = json.dumps({"type": "done", "id": "victim", "status": "error", "exit_code": 9})
        attacker = await c.execute(f"print({fake!r}, flush=True)", id="attacker")
        v = await victim
    assert_one_done(v.frames)
    assert v.status == "ok" and v.stdout == "victim done\n" and fake in attacker.stdout, (v, attacker)
    assert c.unrouted == []
    observe(f"victim: {v.status}, stdout {v.stdout!r}; forged frame stayed in attacker's stream")


@attack(
    "write forged driver events (result, error with a foreign id) to the driver's event fd",
    "own run only: the server stamps the run's id on every frame it builds",
)
async def test_forged_driver_events_carry_only_the_runs_own_id(target: Server, observe: Observe) -> None:
    async with AsyncClient(target.url, TOKEN) as c:
        code = (
            FORGE_EVENT
            + """
forge(b'{"ev":"result","id":"victim","data":{"text/plain":"FORGED"}}\\n')
forge(b'{"ev":"error","id":"victim","ename":"X","evalue":"forged","traceback":[]}\\n')
"""
        )
        ex = await c.execute(code, id="attacker")
        await asyncio.sleep(0.2)
    assert_one_done(ex.frames)
    assert {f["id"] for f in ex.frames} == {"attacker"} and c.unrouted == [], ex.frames
    observe(f"forged frames arrived as {[f['type'] for f in ex.frames]} all with id 'attacker'")


@attack(
    "write a forged driver `done` event to end its own run early with status ok",
    "the server builds the only done (own id); the jail is killed at once, nothing survives",
)
async def test_a_forged_done_event_only_ends_the_runs_own_request(target: Server, observe: Observe) -> None:
    code = (
        FORGE_EVENT
        + 'import time\nforge(b\'{"ev":"done","exit_code":0}\\n\')\ntime.sleep(3)\nprint(\'after\')'
    )
    ex = await run(target, code)
    note = await assert_contained(target)
    assert ex.stdout == "" and {f["id"] for f in ex.frames} == {ex.id}, ex
    observe(f"run ended {ex.status} with one server-built done for its own id; {note}")


@attack(
    "an endless line on the driver's event fd (memory exhaustion of the reader)",
    "output_limit once it exceeds the event budget; the server's buffer is bounded",
)
async def test_an_oversized_event_line_ends_as_output_limit(target: Server, observe: Observe) -> None:
    code = FORGE_EVENT + "chunk = b'x' * 65536\nwhile True:\n    forge(chunk)"
    ex = await run(target, code, timeout_ms=5000)
    note = await assert_contained(target)
    assert ex.status == "output_limit", ex
    observe(f"{ex.status}: {ex.message}; {note}")


@attack(
    "frames that are not JSON, not objects, or binary garbage",
    "done rejected for each; connection stays usable",
)
async def test_malformed_frames_are_rejected(target: Server, observe: Observe) -> None:
    bad: list[str | bytes] = [
        "not json",
        "[1,2,3]",
        "42",
        '"str"',
        "null",
        b"\xff\xfe\x00garbage",
        '{"code": "x"',
        "",
    ]
    replies = await raw_exchange(target, *bad, until=len(bad))
    rej = rejections(replies)
    assert [r["status"] for r in rej] == ["rejected"] * len(bad), rej
    observe(f"{len(rej)} rejected: " + "; ".join(sorted({r["message"][:40] for r in rej})))


@attack(
    "unknown types and wrong field types (code as a number, timeout_ms as a string, session as a list)",
    "done rejected naming the field",
)
async def test_wrongly_typed_frames_are_rejected(target: Server, observe: Observe) -> None:
    bad = [
        {"type": "shutdown"},
        {"code": 42},
        {"code": "x", "timeout_ms": "9"},
        {"code": "x", "session": []},
        {"code": "x", "timeout_ms": -1},
        {"code": "x", "files": "all"},
        {"type": 7, "code": "x"},
        {"code": "x", "stdin_eof": "yes"},
        {"type": "stdin", "data": "x"},
    ]
    replies = await raw_exchange(target, *(json.dumps(b) for b in bad), until=len(bad))
    rej = rejections(replies)
    assert [r["status"] for r in rej] == ["rejected"] * len(bad), rej
    observe("; ".join(r["message"] for r in rej))


@attack(
    "JSON nested 100,000 levels deep (decoder recursion bomb)", "done rejected; the server does not crash"
)
async def test_a_deeply_nested_frame_is_rejected(target: Server, observe: Observe) -> None:
    replies = await raw_exchange(
        target, "[" * 100000 + "]" * 100000, '{"code": ' + "[" * 50000 + "]" * 50000 + "}", until=2
    )
    rej = rejections(replies)
    assert [r["status"] for r in rej] == ["rejected", "rejected"], rej
    observe(f"{rej[0]['message']}; {rej[1]['message']}")


@attack("frame just over SANDBOX_MAX_MESSAGE_BYTES", "done rejected naming the limit")
async def test_an_oversized_frame_is_rejected(target: Server, observe: Observe) -> None:
    frame = json.dumps({"id": "big", "code": "#" + "x" * (1024 * 1024 + 10)})
    replies = await raw_exchange(target, frame)
    rej = rejections(replies)
    assert rej[0]["status"] == "rejected" and "SANDBOX_MAX_MESSAGE_BYTES" in rej[0]["message"], rej
    observe(rej[0]["message"])


@attack(
    "frame of 8x SANDBOX_MAX_MESSAGE_BYTES",
    "that connection is closed (1009 too big); the server keeps serving",
)
async def test_a_far_oversized_frame_closes_only_its_connection(target: Server, observe: Observe) -> None:
    code = None
    async with websockets.connect(target.url, additional_headers=AUTH, max_size=None) as ws:
        try:  # the server may close before the client has finished sending: either call can see the 1009
            await ws.send("x" * (8 * 1024 * 1024))
            await asyncio.wait_for(ws.recv(), scaled(30))
        except websockets.ConnectionClosed as exc:
            code = exc.rcvd.code if exc.rcvd else None
    note = await assert_contained(target)
    assert code == 1009, code
    observe(f"connection closed with {code}; {note}")


@attack("bad request ids (a number, 10 KB long, control characters)", "done rejected")
async def test_bad_request_ids_are_rejected(target: Server, observe: Observe) -> None:
    bad = [
        {"id": 5, "code": "x"},
        {"id": "i" * 10000, "code": "x"},
        {"id": "a\nb", "code": "x"},
        {"id": "", "code": "x"},
    ]
    replies = await raw_exchange(target, *(json.dumps(b) for b in bad), until=len(bad))
    rej = rejections(replies)
    assert [r["status"] for r in rej] == ["rejected"] * len(bad), rej
    assert all(len(r["id"]) <= 128 for r in rej)
    observe("; ".join(sorted({r["message"] for r in rej})))


@attack(
    "uploads: invalid base64, over SANDBOX_MAX_UPLOAD_BYTES, a lone-surrogate name, duplicate names",
    "done rejected before anything runs",
)
async def test_bad_uploads_are_rejected(target: Server, observe: Observe) -> None:
    big = "A" * (200 * 1024)
    bad = [
        {"code": "x", "files": [{"path": "a", "data": "!!!"}]},
        {"code": "x", "files": [{"path": "a", "data": big}]},
        {"code": "x", "files": [{"path": "\ud800", "data": ""}]},
        {"code": "x", "files": [{"path": "a", "data": ""}, {"path": "./a", "data": ""}]},
    ]
    replies = await raw_exchange(target, *(json.dumps(b) for b in bad), until=len(bad))
    rej = rejections(replies)
    assert [r["status"] for r in rej] == ["rejected"] * len(bad), rej
    observe("; ".join(r["message"] for r in rej))


@attack(
    "reuse the id of a request that is still running", "the second is rejected; the first completes untouched"
)
async def test_a_duplicate_running_id_is_rejected(target: Server, observe: Observe) -> None:
    replies = await raw_exchange(
        target,
        json.dumps({"id": "dup", "code": "import time\ntime.sleep(1)\nprint('first')"}),
        json.dumps({"id": "dup", "code": "print('second')"}),
        until=2,
    )
    dones = rejections(replies)
    text = "".join(r.get("text", "") for r in replies if r.get("type") == "stream" and r.get("id") == "dup")
    assert [d["status"] for d in dones] == ["rejected", "ok"] and text == "first\n", replies
    observe(f"second: {dones[0]['message']}; first printed {text!r}")


@attack("interleave 8 chatty requests on one connection", "each request's frames carry only its own output")
async def test_interleaved_requests_never_mix_output(target: Server, observe: Observe) -> None:
    async with AsyncClient(target.url, TOKEN) as c:
        results = await asyncio.gather(
            *(
                c.execute(
                    f"import time\nfor j in range(20):\n    print('req{i}-', j, flush=True)\n    time.sleep(0.01)",
                    id=f"r{i}",
                )
                for i in range(8)
            )
        )
    for i, ex in enumerate(results):
        assert_one_done(ex.frames)
        lines = ex.stdout.splitlines()
        assert len(lines) == 20 and all(ln.startswith(f"req{i}-") for ln in lines), ex.stdout
    observe("8 requests x 20 lines, each only its own")


@attack("send stdin and interrupt to a run of another connection", "done rejected: runs are per connection")
async def test_stdin_and_interrupt_cannot_reach_another_connections_run(
    target: Server, observe: Observe
) -> None:
    async with AsyncClient(target.url, TOKEN) as victim:
        task = asyncio.create_task(victim.execute("import time\ntime.sleep(1.5)\nprint('intact')", id="v1"))
        await asyncio.sleep(0.3)
        replies = await raw_exchange(
            target,
            json.dumps({"type": "interrupt", "id": "v1"}),
            json.dumps({"type": "stdin", "id": "v1", "data": "x\n"}),
            until=2,
        )
        ex = await task
    rej = rejections(replies)
    assert (
        [r["status"] for r in rej] == ["rejected", "rejected"]
        and ex.status == "ok"
        and ex.stdout == "intact\n"
    )
    observe(f"{rej[0]['message']}; victim finished {ex.status}")


@attack(
    "guess session ids (500 random 128-bit ids, plus close_session)",
    "every guess: 'no such session', exactly like a missing one",
)
async def test_session_id_guessing_finds_nothing(target: Server, observe: Observe) -> None:
    async with AsyncClient(target.url, TOKEN) as c:
        real = await c.execute("secret = 1", session="new")
        frames = [
            json.dumps({"id": f"g{i}", "code": "print(secret)", "session": secrets.token_hex(16)})
            for i in range(500)
        ]
        closes = [
            json.dumps({"type": "close_session", "id": f"k{i}", "session": secrets.token_hex(16)})
            for i in range(20)
        ]
        replies = await raw_exchange(target, *frames, *closes, until=len(frames) + len(closes))
        still = await c.execute("print(secret)", session=real.session)
        assert real.session is not None
        await c.close_session(real.session)
    rej = rejections(replies)
    assert len(rej) == 520 and {r["status"] for r in rej} == {"rejected"}, rej[:3]
    assert all(r["message"].startswith("no such session") for r in rej)
    assert still.stdout == "1\n"
    observe(f"520 guesses rejected ('{rej[0]['message'][:40]}…'); the real session was untouched")


@attack(
    "use, interrupt or close another token's session",
    "'no such session' for the other token; the owner keeps it",
)
async def test_another_tokens_session_is_invisible(open_server: Server, observe: Observe) -> None:
    async with (
        AsyncClient(open_server.url, "alice-token-1") as alice,
        AsyncClient(open_server.url, "mallory-token-2") as mallory,
        AsyncClient(open_server.url) as anon,
    ):
        opened = await alice.execute("secret = 'ALICE'", session="new")
        sid = opened.session
        stolen = await mallory.execute("print(secret)", session=sid)
        anon_try = await anon.execute("print(secret)", session=sid)
        assert sid is not None
        closed = await mallory.close_session(sid)
        mine = await alice.execute("print(secret)", session=sid)
        assert sid is not None
        await alice.close_session(sid)
    assert stolen.status == "rejected" and anon_try.status == "rejected" and closed["status"] == "rejected"
    assert "ALICE" not in json.dumps(stolen.frames + anon_try.frames) and mine.stdout == "ALICE\n"
    observe(f"mallory: {stolen.message}; close: {closed['message']}; alice still reads her session")


@attack(
    "upgrade without a token, with a wrong one, with Basic auth, or with the token in the query",
    "HTTP 401 before any upgrade",
)
async def test_unauthenticated_upgrades_get_401(target: Server, observe: Observe) -> None:
    codes = {}
    for name, headers, url in (
        ("none", {}, target.url),
        ("wrong", {"Authorization": "Bearer nope-nope-nope"}, target.url),
        ("basic", {"Authorization": f"Basic {TOKEN}"}, target.url),
        ("query", {}, target.url + f"?token={TOKEN}"),
    ):
        try:
            async with websockets.connect(url, additional_headers=headers):
                codes[name] = 101
        except websockets.InvalidStatus as exc:
            codes[name] = exc.response.status_code
    assert set(codes.values()) == {401}, codes
    observe(str(codes))


@attack(
    "slowloris: 200 connections sending an upgrade request one byte at a time",
    "other clients are served normally meanwhile; the server stays up",
)
async def test_slowloris_upgrades_do_not_starve_other_clients(target: Server, observe: Observe) -> None:
    request = (
        b"GET /exec HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
    )
    socks = []
    for _ in range(200):
        s = socket.create_connection(("127.0.0.1", target.port))
        s.setblocking(False)
        socks.append(s)
    try:
        t0 = time.monotonic()
        for i in range(10):  # drip the headers, never finishing them
            for s in socks:
                with contextlib.suppress(OSError):
                    s.send(request[i : i + 1])
            await asyncio.sleep(0.05)
        ex = await run(target, "print('served')", timeout=30)
        took = time.monotonic() - t0
    finally:
        for s in socks:
            s.close()
    note = await assert_contained(target)
    assert ex.stdout == "served\n"
    observe(f"a normal run completed {took:.1f}s into the drip with 200 half-open upgrades; {note}")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@attack(
    "1000 idle WebSocket connections held open",
    "a normal run is still served; the fds are released afterwards",
)
async def test_a_thousand_idle_connections_do_not_block_service(target: Server, observe: Observe) -> None:
    before = open_fds(target.proc.pid)
    conns: list[Any] = []
    t0 = time.monotonic()
    try:
        for batch in range(10):
            conns += await asyncio.wait_for(
                asyncio.gather(
                    *(
                        websockets.connect(target.url, additional_headers=AUTH, ping_interval=None)
                        for _ in range(100)
                    )
                ),
                scaled(60),
            )
            del batch
        during = open_fds(target.proc.pid)
        ex = await run(target, "print('served')", timeout=60)
    finally:
        await asyncio.gather(*(c.close() for c in conns), return_exceptions=True)
    deadline = time.monotonic() + scaled(20)
    while open_fds(target.proc.pid) > before + 5 and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    after = open_fds(target.proc.pid)
    assert len(conns) == 1000 and ex.stdout == "served\n" and after <= before + 5, (before, during, after)
    observe(
        f"1000 connections in {time.monotonic() - t0:.1f}s; server fds {before} -> {during} -> {after}; run served"
    )


@attack(
    "200 execute requests at once on one connection", "each gets exactly one done (ok or busy); nothing leaks"
)
async def test_a_request_flood_gets_one_done_each(target: Server, observe: Observe) -> None:
    async with AsyncClient(target.url, TOKEN, retry_busy_s=0) as c:  # each refusal is its answer
        results = await asyncio.wait_for(
            asyncio.gather(*(c.execute("pass") for _ in range(200))), scaled(300)
        )
    for ex in results:
        assert_one_done(ex.frames)
    note = await assert_contained(target)
    statuses = sorted({ex.status for ex in results})
    assert set(statuses) <= {"ok", "busy"}, statuses
    observe(f"200 requests -> { ({s: sum(e.status == s for e in results) for s in statuses}) }; {note}")


@attack("two requests to the same session at once", "the second is rejected as busy; the first is unaffected")
async def test_a_busy_session_rejects_a_second_request(target: Server, observe: Observe) -> None:
    async with AsyncClient(target.url, TOKEN) as c:
        s = await c.execute("n = 0", session="new")
        # The second is sent once the first cell runs (its line came back), not after a fixed
        # time: on a stalled server both could be handled before the first took the session.
        up = asyncio.Event()
        first = asyncio.create_task(
            c.execute(
                "import time\nprint('in', flush=True)\ntime.sleep(1)\nn += 1\nprint(n)",
                session=s.session,
                on_stdout=lambda _: up.set(),
            )
        )
        await asyncio.wait_for(up.wait(), scaled(30))
        second = await c.execute("n += 100", session=s.session)
        f = await first
        final = await c.execute("print(n)", session=s.session)
        assert s.session is not None
        await c.close_session(s.session)
    assert second.status == "rejected" and f.stdout == "in\n1\n" and final.stdout == "1\n", (second, f, final)
    observe(f"second: {second.message}")


@attack(
    "disconnect abruptly in the middle of a run",
    "the run goes on within its limits (an attach finds it: issue 34); stopped from the new "
    "connection, nothing of it survives",
)
async def test_an_abrupt_disconnect_leaves_the_run_to_its_limits(target: Server, observe: Observe) -> None:
    ws = await websockets.connect(target.url, additional_headers=AUTH)
    await ws.send(
        json.dumps({"id": "x", "code": "import time\nprint('started', flush=True)\ntime.sleep(60)"})
    )
    run = json.loads(await ws.recv())["run"]
    ws.transport.abort()  # no Close frame: the TCP connection just vanishes
    again = await websockets.connect(target.url, additional_headers=AUTH)
    await again.send(json.dumps({"type": "attach", "run": run, "id": "back"}))
    await again.send(json.dumps({"type": "interrupt", "id": "back"}))
    frames = [json.loads(await asyncio.wait_for(again.recv(), scaled(30)))]
    while frames[-1]["type"] != "done":
        frames.append(json.loads(await asyncio.wait_for(again.recv(), scaled(30))))
    await again.close()
    assert frames[0]["type"] == "start" and frames[-1]["status"] in ("cancelled", "timeout"), frames
    note = await assert_contained(target)
    observe(f"reattached, then {frames[-1]['status']}; {note}")


@attack(
    "ask for more time (timeout_ms 10^12) and a GPU on a CPU appliance",
    "timeout_ms capped at SANDBOX_MAX_EXEC_MS; gpu rejected",
)
async def test_timeout_cannot_be_raised_and_gpu_is_rejected(target: Server, observe: Observe) -> None:
    async with AsyncClient(target.url, TOKEN) as c:
        frames = [f async for f in c.stream("print(1)", timeout_ms=10**12)]
        gpu = await c.execute("print(1)", gpu={"memory_mb": 1024})
    assert frames[0]["timeout_ms"] == 6000 and gpu.status == "rejected", (frames[0], gpu.message)
    observe(f"timeout_ms capped to {frames[0]['timeout_ms']}; gpu: {gpu.message}")


@attack(
    "an MCP body under 64 KiB nested 3000 deep, sent in the caller's own MCP session",
    "a JSON-RPC error (400) before the SDK parses it; the server and that MCP session go on",
)
async def test_a_deeply_nested_mcp_body_is_refused_and_the_session_lives_on(
    target: Server, observe: Observe
) -> None:
    import httpx
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with (
        httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(60)) as http,
        streamable_http_client(target.http + "/mcp", http_client=http) as (read, write, session_id),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        sid = session_id()
        assert sid
        body = b"[" * 3000 + b"]" * 3000
        answer = await http.post(
            target.http + "/mcp",
            content=body,
            headers={
                "Content-Type": "application/json",
                "Accept": "application/json, text/event-stream",
                "Mcp-Session-Id": sid,
                "Mcp-Protocol-Version": "2025-06-18",
            },
        )
        assert answer.status_code == 400, (answer.status_code, answer.text[:300])
        error = answer.json()
        assert error["jsonrpc"] == "2.0" and "nested deeper" in error["error"]["message"], error
        tools = await session.list_tools()  # the same MCP session still answers
        assert {t.name for t in tools.tools} >= {"run_python"}
    observe(
        f"{answer.status_code} {error['error']['message']}; the session listed {len(tools.tools)} tools after"
    )
