"""Transport and time: clients that stop reading, vanish after a half-close, flood stdin, or
come too early; sessions whose cells leave work running. Each must end within the run's
limits, keep the server's memory bounded and leave other clients served."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import socket
import struct
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from appliance.client import AsyncClient
from tests.attacks.common import TOKEN, assert_contained, attack, descendants, run
from tests.attacks.conftest import hostile_server
from tests.support import Server, scaled, start_server

Observe = Callable[[str], None]
STALL_MS = 3000


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory, tmp_root: Path) -> Iterator[Server]:
    srv = hostile_server(tmp_path_factory.mktemp("transport-server"), tmp_root,
                         SANDBOX_MAX_EXEC_MS="15000", SANDBOX_CLIENT_STALL_MS=str(STALL_MS),
                         SANDBOX_MAX_QUEUE="100", SANDBOX_MAX_MESSAGE_BYTES="2097152",
                         SANDBOX_MAX_OUTPUT_BYTES="16777216")  # the client, not the output limit, must be what stops the runs
    yield srv
    srv.stop()


class RawSocket:
    """A WebSocket client at the byte level that reads only when told to (4 KiB receive buffer)."""

    def __init__(self, server: Server, token: str = TOKEN) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.connect(("127.0.0.1", server.port))
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((f"GET /exec HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
                           f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                           f"Sec-WebSocket-Version: 13\r\nAuthorization: Bearer {token}\r\n\r\n").encode())
        head = b""
        while b"\r\n\r\n" not in head:
            head += self.sock.recv(1)
        assert head.startswith(b"HTTP/1.1 101"), head

    def frame(self, opcode: int, payload: bytes) -> None:
        mask = os.urandom(4)
        size = len(payload)
        if size < 126:
            header = struct.pack("!BB", 0x80 | opcode, 0x80 | size)
        elif size < 65536:
            header = struct.pack("!BBH", 0x80 | opcode, 0x80 | 126, size)
        else:
            header = struct.pack("!BBQ", 0x80 | opcode, 0x80 | 127, size)
        self.sock.sendall(header + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))

    def send(self, obj: dict[str, object]) -> None:
        self.frame(0x1, json.dumps(obj).encode())

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
    return descendants(server.proc.pid)


async def wait_until(predicate: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + scaled(timeout)
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.1)
    return predicate()


@attack("a client that never reads while 4 runs write 64 KiB blocks in a loop (timeout_ms 3000)",
        "the pipes are not read past a small buffer: server RSS stays bounded; each run ends at its "
        "limit or when the stalled client is dropped; nothing of the runs survives")
async def test_a_client_that_never_reads_cannot_grow_the_server_or_outlive_its_limits(
        target: Server, observe: Observe) -> None:
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


@attack("a client that never reads holds 12 runs of print(900 KB) + sleep(3600) (all slots, then queued)",
        "the stalled client is dropped after SANDBOX_CLIENT_STALL_MS and all its runs end; "
        "another client's print is answered meanwhile")
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
    assert ex.status == "ok" and ex.stdout == "served\n", ex
    assert waited < scaled(STALL_MS / 1000 + 12), f"the other client waited {waited:.1f} s"
    note = await assert_contained(target)
    observe(f"another client's print answered after {waited:.1f} s; {note}")


@attack("half-close (Close frame) with a run in flight, then the TCP connection drops",
        "the run is cancelled when the transport goes, not left running to its limit")
async def test_a_run_whose_connection_drops_after_a_half_close_is_cancelled(
        target: Server, observe: Observe) -> None:
    client = RawSocket(target)
    client.send({"type": "execute", "id": "orphan", "code": "import time\ntime.sleep(60)"})
    assert await wait_until(lambda: bool(jailed(target)), 10), "the run never started"
    client.close_frame()
    await asyncio.sleep(0.5)
    assert jailed(target), "the run must keep streaming after a mere half-close"
    client.close()
    started = time.monotonic()
    gone = await wait_until(lambda: not jailed(target), 5)
    assert gone, f"the run outlived its connection: {jailed(target)}"
    note = await assert_contained(target)
    observe(f"jail gone {time.monotonic() - started:.2f} s after the TCP close; {note}")


@attack("100 stdin frames of 1 MB each for a run that waits in the queue (and one that never reads)",
        "stdin waiting for a run is bounded (SANDBOX_MAX_STDIN_BYTES): the excess is rejected with a "
        "message; server RSS stays bounded; the run itself still works")
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
    observe(f"excess stdin rejected naming SANDBOX_MAX_STDIN_BYTES; RSS {before:.0f} -> {peak:.0f} MB; {note}")


@attack("a session cell leaves a busy-looping child and a sleeping daemon behind",
        "the driver kills every process a cell left before its `done`: between cells only the "
        "interpreter lives; the next cell sees no leftover")
async def test_a_sessions_cell_leaves_no_process_running_between_cells(target: Server, observe: Observe) -> None:
    async with AsyncClient(target.url, TOKEN) as client:
        first = await client.execute(
            "import subprocess, sys\n"
            "subprocess.Popen([sys.executable, '-c', 'while True: pass'])\n"
            "subprocess.Popen(['sleep', '1000'], start_new_session=True)\nprint('left')",
            session="new")
        assert first.status == "ok", first
        sid = first.session
        await asyncio.sleep(1)
        second = await client.execute(
            "import os\nmine = os.getpid()\n"
            "others = sorted(int(p) for p in os.listdir('/proc') if p.isdigit() and int(p) not in (1, mine))\n"
            "print([open(f'/proc/{p}/cmdline').read() for p in others])", session=sid)
        await client.close_session(sid)
    assert second.status == "ok" and second.stdout.strip() == "[]", second.stdout
    note = await assert_contained(target)
    observe(f"after the cell: no process but the interpreter ({second.stdout.strip()}); {note}")


@attack("a session's background thread writes past SANDBOX_MAX_DISK_MB between cells",
        "the quota is checked between cells too: the session is ended, and its next request is "
        "told why")
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
            session="new")
        assert first.status == "ok", first
        sid = first.session
        await asyncio.sleep(scaled(6))
        later = await client.execute("print('still?')", session=sid)
    assert later.status == "rejected" and "between cells" in str(later.message), later
    note = await assert_contained(target)
    observe(f"next request: {later.status} ({later.message}); {note}")


@attack("runs sent the moment /healthz answers on a fresh SANDBOX_TMP_ROOT (the server is still starting)",
        "such runs wait for the appliance to be ready (or get `busy` naming why); never `internal`")
async def test_runs_sent_while_the_server_starts_are_not_internal_errors(
        tmp_path: Path, tmp_root: Path, observe: Observe) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    fresh = tmp_root / f"fresh-{os.getpid()}"
    fresh.mkdir(mode=0o755)
    srv = start_server(tmp_path / "srv", wait_ready=False, port=port, wait_started=False,
                       SANDBOX_AUTH_TOKEN=TOKEN, SANDBOX_TMP_ROOT=str(fresh),
                       SANDBOX_PRELOAD="numpy,pandas,matplotlib", SANDBOX_POOL_SIZE="2")
    try:
        deadline = time.monotonic() + scaled(60)
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1):
                    break
            except OSError:
                assert time.monotonic() < deadline, "the server never listened"
                time.sleep(0.02)
        async with AsyncClient(f"ws://127.0.0.1:{port}/exec", TOKEN) as client:
            results = await asyncio.gather(*(client.execute("print(6*7)") for _ in range(3)))
        statuses = [ex.status for ex in results]
        assert all(s in ("ok", "busy") for s in statuses), [(ex.status, ex.message) for ex in results]
        assert any(ex.status == "ok" and ex.stdout == "42\n" for ex in results)
        observe(f"statuses of runs sent at once: {statuses}")
    finally:
        srv.stop()
