"""Transport and time: clients that stop reading (WebSocket and REST), vanish after a
half-close, flood stdin, send frames that are costly to parse, or come too early; sessions
whose cells leave work running; metrics read without a token. Each must end within the
run's limits, keep the server's memory and event loop bounded and leave other clients served."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import socket
import struct
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from appliance_client.client import AsyncClient
from tests.attacks.common import TOKEN, assert_contained, attack, run
from tests.attacks.conftest import hostile_server
from tests.support import Server, run_descendants, scaled, start_server

Observe = Callable[[str], None]
STALL_MS = 3000


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory, tmp_root: Path) -> Iterator[Server]:
    srv = hostile_server(
        tmp_path_factory.mktemp("transport-server"),
        tmp_root,
        SANDBOX_MAX_EXEC_MS="15000",
        SANDBOX_CLIENT_STALL_MS=str(STALL_MS),
        SANDBOX_MAX_QUEUE="100",
        SANDBOX_MAX_MESSAGE_BYTES="2097152",
        SANDBOX_MAX_OUTPUT_BYTES="16777216",
    )  # the client, not the output limit, must be what stops the runs
    yield srv
    srv.stop()


def slow_socket(server: Server) -> socket.socket:
    """A TCP connection to the server with a 4 KiB receive buffer, that reads only when told to."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", server.port))
    return sock


class RawSocket:
    """A WebSocket client at the byte level that reads only when told to (4 KiB receive buffer)."""

    def __init__(self, server: Server, token: str = TOKEN) -> None:
        self.sock = slow_socket(server)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall(
            (
                f"GET /exec HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
                f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                f"Sec-WebSocket-Version: 13\r\nAuthorization: Bearer {token}\r\n\r\n"
            ).encode()
        )
        head = b""
        while b"\r\n\r\n" not in head:
            head += self.sock.recv(1)
        assert head.startswith(b"HTTP/1.1 101"), head

    @staticmethod
    def masked(opcode: int, payload: bytes) -> bytes:
        """One client frame on the wire: header, mask, masked payload (XORed as one big integer:
        a byte loop would take seconds for a 16 MB frame)."""
        mask = os.urandom(4)
        size = len(payload)
        if size < 126:
            header = struct.pack("!BB", 0x80 | opcode, 0x80 | size)
        elif size < 65536:
            header = struct.pack("!BBH", 0x80 | opcode, 0x80 | 126, size)
        else:
            header = struct.pack("!BBQ", 0x80 | opcode, 0x80 | 127, size)
        key = (mask * (size // 4 + 1))[:size]
        body = (int.from_bytes(payload, "big") ^ int.from_bytes(key, "big")).to_bytes(size, "big")
        return header + mask + body

    def frame(self, opcode: int, payload: bytes) -> None:
        self.sock.sendall(self.masked(opcode, payload))

    def send(self, obj: dict[str, object]) -> None:
        self.frame(0x1, json.dumps(obj).encode())

    def read_until(self, marker: bytes, timeout: float = 30) -> bytes:
        """Read the server's bytes until `marker` shows (frames unparsed: a marker is enough)."""
        self.sock.settimeout(scaled(timeout))
        seen = b""
        while marker not in seen:
            chunk = self.sock.recv(4096)
            assert chunk, f"the connection closed before {marker!r}"
            seen += chunk
        return seen

    def close_frame(self) -> None:
        self.frame(0x8, struct.pack("!H", 1000))

    def close(self) -> None:
        self.sock.close()


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def jailed(server: Server) -> list[int]:
    """Live processes below the server that run jailed code (firejail and what it started)."""
    return run_descendants(server.proc.pid)


async def wait_until(predicate: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + scaled(timeout)
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.1)
    return predicate()


@attack(
    "a client that never reads while 4 runs write 64 KiB blocks in a loop (timeout_ms 3000)",
    "the pipes are not read past a small buffer: server RSS stays bounded; each run ends at its "
    "limit or when the stalled client is dropped; nothing of the runs survives",
)
async def test_a_client_that_never_reads_cannot_grow_the_server_or_outlive_its_limits(
    target: Server, observe: Observe
) -> None:
    before = rss_mb(target.proc.pid)
    client = RawSocket(target)
    code = "import os\nb = b'x' * 65536\nwhile True:\n    os.write(1, b)"
    for i in range(4):
        client.send({"type": "execute", "id": f"flood-{i}", "code": code, "timeout_ms": 3000})
    peak = before
    started = time.monotonic()
    while time.monotonic() - started < scaled(10):
        peak = max(peak, rss_mb(target.proc.pid))
        await asyncio.sleep(0.2)
    gone = await wait_until(lambda: not jailed(target), 10)
    client.close()
    assert peak - before < 200, f"server RSS grew by {peak - before:.0f} MB (from {before:.0f} MB)"
    assert gone, f"the runs outlived their limits: {jailed(target)}"
    note = await assert_contained(target)
    observe(f"server RSS {before:.0f} -> peak {peak:.0f} MB over 10 s; runs gone; {note}")


@attack(
    "a client that never reads holds 12 runs of print(900 KB) + sleep(3600) (all slots, then queued)",
    "the stalled client is dropped after SANDBOX_CLIENT_STALL_MS: its queued runs are cancelled, its "
    "started ones end at their limit (issue 34: an attach may find them); another client's print "
    "is answered meanwhile",
)
async def test_a_stalled_client_cannot_hold_every_slot(target: Server, observe: Observe) -> None:
    client = RawSocket(target)
    code = "import time\nprint('x' * 900000, flush=True)\ntime.sleep(3600)"
    for i in range(12):
        client.send({"type": "execute", "id": f"hog-{i}", "code": code})
    await asyncio.sleep(1)
    started = time.monotonic()
    ex = await run(target, "print('served')", timeout=60)
    waited = time.monotonic() - started
    client.close()
    # Every slot is held by a run that sleeps an hour: dropping the stalled client (after
    # SANDBOX_CLIENT_STALL_MS) cancels its queued runs, and its started ones end at their 15 s
    # limit (SANDBOX_MAX_EXEC_MS), within run()'s minute.
    assert ex.status == "ok" and ex.stdout == "served\n", ex
    note = await assert_contained(target)
    observe(f"another client's print answered after {waited:.1f} s; {note}")


@attack(
    "half-close (Close frame) with a run in flight, then the TCP connection drops",
    "the run streams on after the half-close; when the transport goes it is neither cancelled "
    "nor left past its own limit: it ends at its timeout (issue 34: an attach may find it)",
)
async def test_a_run_whose_connection_drops_after_a_half_close_ends_at_its_limit(
    target: Server, observe: Observe
) -> None:
    before = runs_with_status(target, "timeout")
    client = RawSocket(target)
    client.send(
        {"type": "execute", "id": "orphan", "code": "import time\ntime.sleep(60)", "timeout_ms": 2000}
    )
    client.read_until(b'"type":"start"')  # started: its run id was sent
    client.close_frame()
    client.close()
    started = time.monotonic()
    gone = await wait_until(lambda: not jailed(target), 15)
    assert gone, f"the run outlived its limit: {jailed(target)}"
    assert runs_with_status(target, "timeout") == before + 1, "the run was cut off, not left to its limit"
    note = await assert_contained(target)
    observe(f"jail gone {time.monotonic() - started:.2f} s after the TCP close, at its limit; {note}")


def runs_with_status(server: Server, status: str) -> float:
    code, text = server.get("/metrics", TOKEN)
    assert code == 200
    for line in text.splitlines():
        if line.startswith(f'appliance_runs_total{{status="{status}"}} '):
            return float(line.split()[-1])
    return 0.0


@attack(
    "a client that attaches to a run writing 8 MB (issue 34) and never reads, beside the client "
    "that started it",
    "the reader neither slows the run nor grows the server: the run's own client gets every "
    "byte and its done; what the server keeps of the run stays within SANDBOX_MAX_OUTPUT_BYTES",
)
async def test_a_reader_that_never_reads_cannot_hold_a_run_or_grow_the_server(
    target: Server, observe: Observe
) -> None:
    before = rss_mb(target.proc.pid)
    code = "import os\nb = b'x' * 65536\nfor _ in range(128):\n    os.write(1, b)\nprint('end')"
    stalled = RawSocket(target)
    peak = before
    async with AsyncClient(target.url, TOKEN) as c:
        got = 0
        async for ev in c.stream(code):
            if ev.type == "start":
                stalled.send({"type": "attach", "run": ev["run"], "id": "never"})
            elif ev.type == "stream":
                got += len(ev["text"])
                peak = max(peak, rss_mb(target.proc.pid))
            done = ev
    stalled.close()
    assert done["status"] == "ok" and got == 128 * 65536 + len("end\n"), (done, got)
    assert peak - before < 200, f"server RSS grew by {peak - before:.0f} MB (from {before:.0f} MB)"
    note = await assert_contained(target)
    observe(f"the run's own client got all {got} bytes; server RSS {before:.0f} -> {peak:.0f} MB; {note}")


@attack(
    "100 stdin frames of 1 MB each for a run that waits in the queue (and one that never reads)",
    "stdin waiting for a run is bounded (SANDBOX_MAX_STDIN_BYTES): the excess is rejected with a "
    "message; server RSS stays bounded; the run itself still works",
)
async def test_stdin_for_a_queued_run_is_bounded(target: Server, observe: Observe) -> None:
    before = rss_mb(target.proc.pid)
    async with AsyncClient(target.url, TOKEN) as blocker:
        hogs = [asyncio.create_task(blocker.execute("import time\ntime.sleep(6)")) for _ in range(4)]
        await asyncio.sleep(1)
        client = RawSocket(target)
        client.send({"type": "execute", "id": "queued", "code": "import sys\nprint(len(sys.stdin.read()))"})
        chunk = "y" * 1_000_000
        for _ in range(100):
            client.send({"type": "stdin", "id": "queued", "data": chunk})
        peak = rss_mb(target.proc.pid)
        client.sock.settimeout(scaled(60))
        received = b""
        while b'"rejected"' not in received:
            received += client.sock.recv(65536)
        client.close()
        await asyncio.gather(*hogs)
    assert b"SANDBOX_MAX_STDIN_BYTES" in received
    assert peak - before < 150, f"server RSS grew by {peak - before:.0f} MB"
    note = await assert_contained(target)
    observe(
        f"excess stdin rejected naming SANDBOX_MAX_STDIN_BYTES; RSS {before:.0f} -> {peak:.0f} MB; {note}"
    )


@attack(
    "a session cell leaves a busy-looping child and a sleeping daemon behind",
    "the driver kills every process a cell left before its `done`: between cells only the "
    "interpreter lives; the next cell sees no leftover",
)
async def test_a_sessions_cell_leaves_no_process_running_between_cells(
    target: Server, observe: Observe
) -> None:
    async with AsyncClient(target.url, TOKEN) as client:
        first = await client.execute(
            "import subprocess, sys\n"
            "subprocess.Popen([sys.executable, '-c', 'while True: pass'])\n"
            "subprocess.Popen(['sleep', '1000'], start_new_session=True)\nprint('left')",
            session="new",
        )
        assert first.status == "ok", first
        sid = first.session
        await asyncio.sleep(1)
        second = await client.execute(
            "import os\nmine = os.getpid()\n"
            "others = sorted(int(p) for p in os.listdir('/proc') if p.isdigit() and int(p) not in (1, mine))\n"
            "print([open(f'/proc/{p}/cmdline').read() for p in others])",
            session=sid,
        )
        assert sid is not None
        await client.close_session(sid)
    assert second.status == "ok" and second.stdout.strip() == "[]", second.stdout
    note = await assert_contained(target)
    observe(f"after the cell: no process but the interpreter ({second.stdout.strip()}); {note}")


@attack(
    "a session's background thread writes past SANDBOX_MAX_DISK_MB between cells",
    "between cells the session is frozen and the thread writes nothing; the next cell thaws it, and "
    "the quota holds at that cell's end: output_limit",
)
async def test_a_sessions_disk_quota_holds_between_cells(target: Server, observe: Observe) -> None:
    async with AsyncClient(target.url, TOKEN) as client:
        first = await client.execute(
            "import threading, time\n"
            "def fill():\n"
            "    time.sleep(0.5)\n"
            "    with open('fill.bin', 'wb') as fh:\n"
            "        for _ in range(200):\n"
            "            fh.write(b'z' * (1 << 20)); fh.flush()\n"
            "threading.Thread(target=fill, daemon=True).start()\nprint('started')",
            session="new",
        )
        assert first.status == "ok", first
        sid = first.session
        await asyncio.sleep(scaled(2))
        later = await client.execute("import time; time.sleep(3); print('still?')", session=sid)
    assert later.status == "output_limit" and "SANDBOX_MAX_DISK_MB" in str(later.message), later
    note = await assert_contained(target)
    observe(f"next request: {later.status} ({later.message}); {note}")


@attack(
    "runs sent the moment /healthz answers on a fresh SANDBOX_TMP_ROOT (the server is still starting)",
    "such runs wait for the appliance to be ready (or get `busy` naming why); never `internal`",
)
async def test_runs_sent_while_the_server_starts_are_not_internal_errors(
    tmp_path: Path, tmp_root: Path, observe: Observe
) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    fresh = tmp_root / f"fresh-{os.getpid()}"
    fresh.mkdir(mode=0o755)
    srv = start_server(
        tmp_path / "srv",
        wait_ready=False,
        port=port,
        wait_started=False,
        SANDBOX_AUTH_TOKEN=TOKEN,
        SANDBOX_TMP_ROOT=str(fresh),
        SANDBOX_PRELOAD="numpy,pandas,matplotlib",
        SANDBOX_POOL_SIZE="2",
    )
    try:
        deadline = time.monotonic() + scaled(60)
        while True:
            try:
                url = f"http://127.0.0.1:{port}/healthz"
                (await asyncio.to_thread(urllib.request.urlopen, url, timeout=1)).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "the server never listened"
                await asyncio.sleep(0.02)
        async with AsyncClient(f"ws://127.0.0.1:{port}/exec", TOKEN) as client:
            results = await asyncio.gather(*(client.execute("print(6*7)") for _ in range(3)))
        statuses = [ex.status for ex in results]
        assert all(s in ("ok", "busy") for s in statuses), [(ex.status, ex.message) for ex in results]
        assert any(ex.status == "ok" and ex.stdout == "42\n" for ex in results)
        observe(f"statuses of runs sent at once: {statuses}")
    finally:
        srv.stop()


@attack(
    "REST: 4 POST /v1/exec of 64 KiB-block writers (timeout_ms 3000) whose client never reads the NDJSON",
    "the same bounds as over WebSocket: server RSS stays bounded; each run ends at its limit or "
    "when the stalled client is dropped; nothing of the runs survives",
)
async def test_a_rest_client_that_never_reads_cannot_grow_the_server_or_outlive_its_limits(
    target: Server, observe: Observe
) -> None:
    before = rss_mb(target.proc.pid)
    body = json.dumps(
        {"code": "import os\nb = b'x' * 65536\nwhile True:\n    os.write(1, b)", "timeout_ms": 3000}
    ).encode()
    socks = []
    for _ in range(4):
        sock = slow_socket(target)
        sock.sendall(
            b"POST /v1/exec HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {TOKEN}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        socks.append(sock)
    assert await wait_until(lambda: bool(jailed(target)), 10), "no run started"
    peak = before
    started = time.monotonic()
    while time.monotonic() - started < scaled(10):
        peak = max(peak, rss_mb(target.proc.pid))
        await asyncio.sleep(0.2)
    gone = await wait_until(lambda: not jailed(target), 10)
    for sock in socks:
        sock.close()
    assert peak - before < 200, f"server RSS grew by {peak - before:.0f} MB (from {before:.0f} MB)"
    assert gone, f"the runs outlived their limits: {jailed(target)}"
    note = await assert_contained(target)
    observe(f"server RSS {before:.0f} -> peak {peak:.0f} MB over 10 s; runs gone; {note}")


# -- frames that are costly to parse, refused frames and rate limits, /metrics --------------------

FLOOD = "flood-tenant-" + "f" * 16  # no quota: only the server-wide bounds hold it
LIMITED = "limited-tenant-" + "l" * 16  # 2 runs, then 1 a minute
METRICS_TOKEN = "metrics-scraper-" + "m" * 16
TENANTS = f"""
[[tenant]]
name = "flood"
token = "{FLOOD}"

[[tenant]]
name = "limited"
token = "{LIMITED}"
runs_per_minute = 1
burst = 2
"""


@pytest.fixture(scope="module")
def tenanted(tmp_path_factory: pytest.TempPathFactory, tmp_root: Path) -> Iterator[Server]:
    """Two tenants, the default 16 MiB frame limit, and a token of its own for /metrics."""
    base = tmp_path_factory.mktemp("tenanted-server")
    path = base / "tokens.toml"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(TENANTS)
    srv = hostile_server(
        base,
        tmp_root,
        SANDBOX_AUTH_TOKEN="",
        SANDBOX_AUTH_TOKENS_FILE=str(path),
        SANDBOX_METRICS_TOKEN=METRICS_TOKEN,
        SANDBOX_MAX_MESSAGE_BYTES="16777216",
        SANDBOX_MAX_UPLOAD_BYTES="8388608",
    )
    yield srv
    srv.stop()


def healthz_latencies(server: Server, stop: threading.Event, found: list[float]) -> None:
    """Time /healthz again and again until told to stop (a stall shows as one long answer)."""
    while not stop.is_set():
        started = time.monotonic()
        try:
            with urllib.request.urlopen(f"{server.http}/healthz", timeout=scaled(30)) as resp:
                resp.read()
        except OSError:
            found.append(float("inf"))
            return
        found.append(time.monotonic() - started)
        time.sleep(0.05)


@pytest.mark.exclusive  # /healthz's latency is measured: no other test's load beside it
@attack(
    "5 connections each send a 15.7 MB execute frame of 540,000 file entries",
    "the frames the tenant's frame budget takes are refused (SANDBOX_MAX_UPLOAD_FILES), the rest "
    "answered busy, without stalling the event loop: /healthz keeps answering while they are processed",
)
async def test_frames_costly_to_parse_do_not_stall_the_server(tenanted: Server, observe: Observe) -> None:
    files = [{"path": f"f{i:06d}", "data": ""} for i in range(540_000)]
    socks = [RawSocket(tenanted, token=FLOOD) for _ in range(5)]
    payloads = [
        json.dumps(
            {"type": "execute", "id": f"heavy-{n}", "code": "print(1)", "files": files}, separators=(",", ":")
        ).encode()
        for n in range(len(socks))
    ]
    assert len(payloads[0]) < 16777216
    wire = [RawSocket.masked(0x1, payload) for payload in payloads]  # built before anything is timed
    stop, latencies = threading.Event(), list[float]()
    watcher = threading.Thread(target=healthz_latencies, args=(tenanted, stop, latencies))
    watcher.start()
    try:
        await asyncio.sleep(0.3)
        await asyncio.gather(
            *(asyncio.to_thread(sock.sock.sendall, data) for sock, data in zip(socks, wire, strict=True))
        )
        answers = await asyncio.gather(*(asyncio.to_thread(read_done, sock, scaled(60)) for sock in socks))
        await asyncio.sleep(0.3)
    finally:
        stop.set()
        await asyncio.to_thread(watcher.join)
        for sock in socks:
            sock.close()
    worst = max(latencies)
    assert worst < scaled(1.0), f"/healthz took {worst:.2f} s to answer while the frames were parsed"
    # The tenant's share of the frame budget (`framebudget`) holds some of the five: those are
    # answered `busy` unparsed; the ones it took were parsed and refused.
    parsed = [a for a in answers if a.get("status") == "rejected"]
    assert parsed, answers
    for answer in parsed:
        assert "SANDBOX_MAX_UPLOAD_FILES" in str(answer.get("message")), answer
    for answer in answers:
        assert answer in parsed or answer.get("status") == "busy", answer
    note = await assert_contained(tenanted, FLOOD)
    observe(
        f"5 frames of {len(payloads[0]) / 1e6:.1f} MB: {len(parsed)} parsed and refused "
        f"({parsed[0]['message']}), the rest busy; /healthz answered "
        f"{len(latencies)} times meanwhile, the slowest in {worst:.2f} s; {note}"
    )


@pytest.mark.exclusive  # /healthz's latency is measured: no other test's load beside it
@attack(
    "3 MCP tools/call bodies of 8.1 MB, each with 540,000 upload entries, POSTed to /mcp at once",
    "each body is refused (400, a JSON-RPC error naming the limit) before the MCP SDK parses it on "
    "the event loop: /healthz keeps answering meanwhile",
)
async def test_mcp_bodies_costly_to_parse_do_not_stall_the_server(tenanted: Server, observe: Observe) -> None:
    files = {f"f{i:06d}": "" for i in range(540_000)}
    call = {"name": "run_python", "arguments": {"code": "print(1)", "files": files}}
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": call}).encode()
    headers = {
        "Authorization": f"Bearer {FLOOD}",
        "Content-Type": "application/json",
        "Accept": "application/json, text/event-stream",
    }

    def post() -> tuple[int, dict[str, object]]:
        req = urllib.request.Request(f"{tenanted.http}/mcp", data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=scaled(60)) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    stop, latencies = threading.Event(), list[float]()
    watcher = threading.Thread(target=healthz_latencies, args=(tenanted, stop, latencies))
    watcher.start()
    try:
        await asyncio.sleep(0.3)
        answers = await asyncio.gather(*(asyncio.to_thread(post) for _ in range(3)))
        await asyncio.sleep(0.3)
    finally:
        stop.set()
        await asyncio.to_thread(watcher.join)
    worst = max(latencies)
    assert worst < scaled(1.0), f"/healthz took {worst:.2f} s to answer while the bodies were parsed"
    for status, answer in answers:
        error = answer.get("error")
        assert status == 400 and isinstance(error, dict) and "JSON values" in str(error.get("message")), (
            answer
        )
    note = await assert_contained(tenanted, FLOOD)
    observe(
        f"3 bodies of {len(body) / 1e6:.1f} MB refused ({answers[0][1]['error']}); /healthz answered "
        f"{len(latencies)} times meanwhile, the slowest in {worst:.2f} s; {note}"
    )


def read_done(raw: RawSocket, timeout: float) -> dict[str, object]:
    """Read server frames from a raw WebSocket until a `done` (server frames are unmasked)."""
    raw.sock.settimeout(timeout)
    buf = b""

    def take(n: int) -> bytes:
        nonlocal buf
        while len(buf) < n:
            chunk = raw.sock.recv(65536)
            if not chunk:
                raise ConnectionError("the server closed the connection")
            buf += chunk
        out, buf = buf[:n], buf[n:]
        return out

    while True:
        first, second = take(2)
        size = second & 0x7F
        if size == 126:
            size = struct.unpack("!H", take(2))[0]
        elif size == 127:
            size = struct.unpack("!Q", take(8))[0]
        payload = take(size)
        if first & 0x0F == 0x8:
            raise ConnectionError(f"the server closed the WebSocket: {payload!r}")
        frame = json.loads(payload)
        if frame.get("type") == "done":
            return dict(frame)


@attack(
    "a rate-limited tenant sends malformed frames, then a run, then a 1 MB frame",
    "each refused frame costs a rate token like a run: once the bucket is empty the run is `busy` "
    "naming the rate limit, and a big frame is refused without being parsed",
)
async def test_refused_frames_are_charged_to_the_tenants_rate_limit(
    tenanted: Server, observe: Observe
) -> None:
    raw = RawSocket(tenanted, token=LIMITED)
    try:
        answers = []
        for bad in (b"{not json", b'{"type": "execute", "code": 5}'):
            raw.frame(0x1, bad)
            answers.append(await asyncio.to_thread(read_done, raw, scaled(30)))
        raw.send({"type": "execute", "id": "after-bad", "code": "print('ran')"})
        run_answer = await asyncio.to_thread(read_done, raw, scaled(60))
        raw.send({"type": "execute", "id": "big", "code": "#" + "x" * 1_000_000})
        big_answer = await asyncio.to_thread(read_done, raw, scaled(30))
    finally:
        raw.close()
    assert [a["status"] for a in answers] == ["rejected", "rejected"], answers
    assert run_answer["status"] == "busy" and "rate limit" in str(run_answer["message"]), run_answer
    assert big_answer["status"] == "busy" and "was not read" in str(big_answer["message"]), big_answer
    async with AsyncClient(tenanted.url, FLOOD) as other:  # another tenant is not held back
        assert (await other.execute("print('other')")).stdout == "other\n"
    note = await assert_contained(tenanted, FLOOD)
    observe(
        f"after 2 refused frames: run {run_answer['status']} ({run_answer['message']}); "
        f"1 MB frame {big_answer['status']}; {note}"
    )


def metrics_status(server: Server, token: str | None) -> int:
    return server.get("/metrics", token)[0]


@attack(
    "GET /metrics without a token, with a wrong one, and (SANDBOX_METRICS_TOKEN set) with a tenant's",
    "with tokens configured /metrics needs one (401 otherwise); with SANDBOX_METRICS_TOKEN it is the "
    "only token accepted; nobody reads the counts unauthenticated",
)
async def test_metrics_are_not_readable_without_the_token(
    target: Server, tenanted: Server, observe: Observe
) -> None:
    single = {
        "none": metrics_status(target, None),
        "wrong": metrics_status(target, "wrong-token-123"),
        "token": metrics_status(target, TOKEN),
    }
    split = {
        "none": metrics_status(tenanted, None),
        "tenant": metrics_status(tenanted, FLOOD),
        "metrics": metrics_status(tenanted, METRICS_TOKEN),
    }
    assert single == {"none": 401, "wrong": 401, "token": 200}, single
    assert split == {"none": 401, "tenant": 401, "metrics": 200}, split
    _status, body = tenanted.get("/metrics", METRICS_TOKEN)
    assert "appliance_runs_total" in body
    observe(f"single token: {single}; tenants + SANDBOX_METRICS_TOKEN: {split}")


# Installed in the server process through PYTHONPATH: writes one line for each `compile` (what
# ast.parse calls) of source carrying the marker, with the process and whether the thread was
# the main one, where the server's event loop runs.
SCAN_MARKER = "scan-hostile-marker"
COMPILE_HOOK = f"""
import os, sys, threading
_LOG = os.environ.get("APPLIANCE_TEST_COMPILE_LOG", "")

def _hook(event, args):
    if event != "compile":
        return
    source = args[0]
    if isinstance(source, (bytes, bytearray)):
        source = bytes(source).decode("utf-8", "replace")
    if isinstance(source, str) and {SCAN_MARKER!r} in source:
        on_loop = threading.current_thread() is threading.main_thread()
        with open(_LOG, "a") as fh:
            fh.write(f"compile {{os.getpid()}} {{on_loop}} {{len(source)}}\\n")

if _LOG:
    with open(_LOG, "a") as fh:
        fh.write(f"hooked {{os.getpid()}}\\n")
    sys.addaudithook(_hook)
"""


def profile_runs(server: Server, profile: str) -> float:
    _status, body = server.get("/metrics", TOKEN)
    for line in body.splitlines():
        if line.startswith(f'appliance_profile_runs_total{{profile="{profile}"}} '):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@attack(
    "import scans costly on the event loop: 12 KiB of `import a.a.a…` (a quadratic shape for "
    "ast.parse) and 600 KB of `import ,,,…`, each sent 3 times",
    "the server never parses client code on its event loop (no `compile` of it in the server's "
    "main thread); the scan is a bounded pattern, and code longer than it takes is not scanned "
    "and gets the largest preload profile",
)
async def test_import_scans_do_no_unbounded_work_on_the_event_loop(
    tmp_path_factory: pytest.TempPathFactory, tmp_root: Path, observe: Observe
) -> None:
    base = tmp_path_factory.mktemp("scan-server")
    hooks = base / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(COMPILE_HOOK)
    log = base / "compiles.log"
    srv = hostile_server(
        base,
        tmp_root,
        PYTHONPATH=str(hooks),
        APPLIANCE_TEST_COMPILE_LOG=str(log),
        SANDBOX_PRELOAD_PROFILES="bare=;std=json",
    )
    try:
        mid = f"# {SCAN_MARKER}\nimport " + "a." * 6000 + "a\n"
        huge = f"# {SCAN_MARKER}\nimport " + "," * 600_000 + "\n"
        small = f"import json  # {SCAN_MARKER}\nprint(json.dumps(1))\n"
        std_before = profile_runs(srv, "std")
        mids = [await run(srv, mid) for _ in range(3)]
        std_after_mid = profile_runs(srv, "std")
        huges = [await run(srv, huge) for _ in range(3)]
        std_after_huge = profile_runs(srv, "std")
        ok = await run(srv, small)
        assert ok.status == "ok" and ok.stdout == "1\n", ok
        # A SyntaxError in the jail (its traceback quotes the long line: output_limit).
        statuses = {ex.status for ex in mids + huges}
        assert statuses <= {"error", "output_limit"}, statuses
        lines = log.read_text().splitlines()
        assert f"hooked {srv.proc.pid}" in lines, f"the compile hook is not in the server: {lines}"
        on_loop = [ln for ln in lines if ln.startswith(f"compile {srv.proc.pid} True ")]
        assert not on_loop, f"the server compiled client code on its event loop: {on_loop}"
        # 12 KiB is within the scan: `a` is no preloaded module, so the bare profile.
        assert std_after_mid == std_before, (std_before, std_after_mid)
        # 600 KB is past it: not scanned, so the largest profile (it preloads the most).
        assert std_after_huge == std_after_mid + 3, (std_after_mid, std_after_huge)
        note = await assert_contained(srv)
    finally:
        srv.stop()
    observe(
        f"3 runs of {len(mid)} and 3 of {len(huge)} chars ended {sorted(statuses)} (a SyntaxError in the jail); "
        f"the server compiled none of them on its loop; the long ones got the largest profile; {note}"
    )


def first_answer(raw: RawSocket, timeout: float) -> tuple[str, object]:
    """The first thing the server sends on a raw WebSocket: ("done", frame) or ("close", code)."""
    try:
        return "done", read_done(raw, timeout)
    except ConnectionError as exc:
        text = str(exc)
        if "closed the WebSocket: b'" in text:
            payload = eval(text.split("WebSocket: ", 1)[1])  # noqa: S307 (a bytes repr we made)
            return "close", struct.unpack("!H", payload[:2])[0] if len(payload) >= 2 else None
        return "close", None


def frame_buffer_bytes(server: Server) -> float:
    _status, body = server.get("/metrics", METRICS_TOKEN)
    for line in body.splitlines():
        if line.startswith("appliance_frame_buffer_bytes "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no appliance_frame_buffer_bytes in /metrics")


@attack(
    "30 connections announce 15 MiB text frames and 5 announce 31 MiB (SANDBOX_MAX_MESSAGE_BYTES 16 MiB), "
    "send all but the last MiB and stall",
    "frames are judged at their headers: the 31 MiB ones are skipped unbuffered and answered `rejected`; "
    "the 15 MiB ones reserve their size in the frame budgets, those past the tenant's are skipped and "
    "answered `busy`; the server grows by less than 300 MiB; the kept ones are closed (1008) at "
    "SANDBOX_FRAME_DEADLINE_MS and everything they held is released; another tenant runs code meanwhile",
)
async def test_unfinished_big_frames_cannot_pin_the_servers_memory(
    tmp_path_factory: pytest.TempPathFactory, tmp_root: Path, observe: Observe
) -> None:
    base = tmp_path_factory.mktemp("frames-server")
    path = base / "tokens.toml"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(TENANTS)
    srv = hostile_server(
        base,
        tmp_root,
        SANDBOX_AUTH_TOKEN="",
        SANDBOX_AUTH_TOKENS_FILE=str(path),
        SANDBOX_METRICS_TOKEN=METRICS_TOKEN,
        SANDBOX_MAX_MESSAGE_BYTES=str(16 << 20),
        SANDBOX_FRAME_DEADLINE_MS="20000",
    )
    socks: list[RawSocket] = []
    try:
        before = rss_mb(srv.proc.pid)

        def unfinished(size: int) -> bytes:
            # A masked text frame (a zero mask: the payload goes as it is) without its last MiB.
            return struct.pack("!BBQ", 0x81, 0x80 | 127, size) + b"\0\0\0\0" + b" " * (size - (1 << 20))

        big, huge = unfinished(15 << 20), unfinished(31 << 20)
        socks = [RawSocket(srv, token=FLOOD) for _ in range(35)]
        wires = [big] * 30 + [huge] * 5
        await asyncio.gather(
            *(asyncio.to_thread(sock.sock.sendall, wire) for sock, wire in zip(socks, wires, strict=True))
        )
        peak = rss_mb(srv.proc.pid)
        held = frame_buffer_bytes(srv)
        # The other tenant is not locked out while the flood holds its share.
        other = await run(srv, "print('other tenant')", token=LIMITED)
        answers = await asyncio.gather(*(asyncio.to_thread(first_answer, sock, scaled(60)) for sock in socks))
        after_close_held = await asyncio.to_thread(
            lambda: wait_for_value(lambda: frame_buffer_bytes(srv), 0.0, scaled(30))
        )
        for sock in socks:
            sock.close()
        after = rss_mb(srv.proc.pid)
        note = await assert_contained(srv, FLOOD)
    finally:
        for sock in socks:
            sock.close()
        srv.stop()
    statuses = [
        a[1]["status"] if a[0] == "done" and isinstance(a[1], dict) else f"close {a[1]}" for a in answers
    ]
    kept = statuses[:30].count("close 1008")
    assert other.status == "ok" and other.stdout == "other tenant\n", other
    assert statuses[30:] == ["rejected"] * 5, statuses[30:]
    assert kept == 2 and statuses[:30].count("busy") == 28, statuses[:30]  # the tenant's half of 4 x 16 MiB
    assert held == 2 * (15 << 20), held
    assert peak - before < 300, f"the server grew from {before:.0f} to {peak:.0f} MiB"
    assert after_close_held == 0.0 and after - before < 300, (after_close_held, before, after)
    observe(
        f"RSS {before:.0f} -> {peak:.0f} MiB with 35 frames unfinished ({held / 2**20:.0f} MiB reserved); "
        f"28 answered busy, 5 rejected, 2 closed with 1008 at the deadline; {after:.0f} MiB after; {note}"
    )


def wait_for_value(read: Callable[[], float], wanted: float, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    value = read()
    while value != wanted and time.monotonic() < deadline:
        time.sleep(0.2)
        value = read()
    return value


def mcp_initialize(server: Server, token: str) -> tuple[int, str | None]:
    """POST an MCP initialize; (HTTP status, the new session's id)."""
    body = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {
            "protocolVersion": "2025-03-26",
            "capabilities": {},
            "clientInfo": {"name": "a", "version": "1"},
        },
    }
    headers = {
        "Authorization": f"Bearer {token}",
        "Content-Type": "application/json",
        "Accept": "application/json, text/event-stream",
    }
    req = urllib.request.Request(
        f"{server.http}/mcp", data=json.dumps(body).encode(), headers=headers, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=scaled(30)) as resp:
            resp.read()
            return resp.status, resp.headers.get("mcp-session-id")
    except urllib.error.HTTPError as exc:
        exc.read()
        return exc.code, None


@attack(
    "with SANDBOX_MAX_SESSIONS=4 and two tenants, one tenant opens 40 MCP sessions as fast as it can",
    "MCP sessions count per tenant: each tenant gets an equal share of the server's 32 (16), past it "
    "`initialize` gets 429 naming the share; the other tenant still opens sessions; ending one frees a place",
)
async def test_one_tenant_cannot_take_every_mcp_session(
    tmp_path_factory: pytest.TempPathFactory, tmp_root: Path, observe: Observe
) -> None:
    base = tmp_path_factory.mktemp("mcp-sessions-server")
    path = base / "tokens.toml"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(TENANTS)
    srv = hostile_server(
        base, tmp_root, SANDBOX_AUTH_TOKEN="", SANDBOX_AUTH_TOKENS_FILE=str(path), SANDBOX_MAX_SESSIONS="4"
    )
    try:
        flood = [await asyncio.to_thread(mcp_initialize, srv, FLOOD) for _ in range(40)]
        other = [await asyncio.to_thread(mcp_initialize, srv, LIMITED) for _ in range(3)]
        opened = [sid for status, sid in flood if status == 200 and sid]
        deleted, _ = await asyncio.to_thread(
            srv.request, "DELETE", "/mcp", FLOOD, headers={"mcp-session-id": opened[0]}
        )
        again = await asyncio.to_thread(mcp_initialize, srv, FLOOD)
    finally:
        srv.stop()
    statuses = [status for status, _sid in flood]
    assert statuses == [200] * 16 + [429] * 24, statuses
    assert [status for status, _sid in other] == [200] * 3, other
    assert deleted == 200 and again[0] == 200, (deleted, again)
    observe(
        "the flooding tenant opened 16 sessions, then 24 x 429; the other tenant opened 3; after a DELETE "
        "the first opened one more"
    )
