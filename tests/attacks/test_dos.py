"""Denial of service: code trying to exhaust the host or outlive its run. Each attack must end
with exactly one `done`, leave no process or run directory behind, and leave the server serving."""

from __future__ import annotations

import asyncio
import ctypes
import errno
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from appliance_client.client import AsyncClient
from tests.attacks.common import TOKEN, assert_contained, assert_no_secret, assert_one_done, attack, run
from tests.attacks.conftest import hostile_server
from tests.support import Server, run_descendants

Observe = Callable[[str], None]
SHORT = 5000  # ms: the per-request limit most attacks run under
OUTPUT_LIMIT = 262144


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory, tmp_root: Path) -> Iterator[Server]:
    """A hostile server with a longer wall clock (requests lower it) and small file limits."""
    srv = hostile_server(
        tmp_path_factory.mktemp("dos-server"),
        tmp_root,
        SANDBOX_MAX_EXEC_MS="15000",
        SANDBOX_MAX_FILE_MB="16",
        SANDBOX_MAX_PROCS="64",
    )
    yield srv
    srv.stop()


async def hostile(server: Server, code: str, timeout_ms: int = SHORT) -> tuple[str, str]:
    """Run an attack; return (status, a short description) after checking containment."""
    ex = await run(server, code, timeout_ms=timeout_ms, timeout=120)
    note = await assert_contained(server)
    streamed = sum(len(f.get("text", "")) for f in ex.frames if f["type"] == "stream")
    return ex.status, (
        f"done {ex.status} after {ex.duration_ms} ms ({ex.message or 'no message'}); "
        f"{streamed} chars streamed; {note}"
    )


@attack(
    "fork bomb (os.fork in a loop, children fork too)",
    "RLIMIT_NPROC stops it; the run ends (timeout/error) and every process of it is killed",
)
async def test_a_fork_bomb_is_contained(target: Server, observe: Observe) -> None:
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    status, note = await hostile(target, code)
    assert status in ("timeout", "error"), note
    observe(note)


@attack("shell fork bomb :(){ :|:& };:", "contained by RLIMIT_NPROC and the wall clock; nothing survives")
async def test_a_shell_fork_bomb_is_contained(target: Server, observe: Observe) -> None:
    code = "import subprocess\nsubprocess.run(['bash', '-c', ':(){ :|:& };:'])\nimport time\ntime.sleep(30)"
    status, note = await hostile(target, code)
    assert status in ("timeout", "error"), note
    observe(note)


@attack("thread bomb (start threads until it fails)", "thread creation fails at RLIMIT_NPROC; the run ends")
async def test_a_thread_bomb_is_capped(target: Server, observe: Observe) -> None:
    code = """
import threading, time
n = 0
try:
    while True:
        threading.Thread(target=time.sleep, args=(60,), daemon=True).start(); n += 1
except RuntimeError as e:
    print("capped at", n, e)
"""
    ex = await run(target, code, timeout_ms=SHORT)
    note = await assert_contained(target)
    assert ex.stdout.startswith("capped at") and int(ex.stdout.split()[2]) < 64, ex.stdout
    observe(f"{ex.stdout.strip()}; {note}")


@attack("allocate 8 GiB of memory", "MemoryError at RLIMIT_AS; done status memory_limit")
async def test_a_huge_allocation_ends_as_memory_limit(target: Server, observe: Observe) -> None:
    status, note = await hostile(target, "x = bytearray(8 * 1024 ** 3)")
    assert status == "memory_limit", note
    observe(note)


@attack("grow memory slowly in a loop (1 MiB at a time)", "stops at RLIMIT_AS; memory_limit")
async def test_gradual_memory_growth_ends_as_memory_limit(target: Server, observe: Observe) -> None:
    status, note = await hostile(target, "chunks = []\nwhile True:\n    chunks.append(b'x' * (1 << 20))")
    assert status == "memory_limit", note
    observe(note)


@attack("mmap 64 GiB from C (ctypes) and touch it", "mmap fails with ENOMEM under RLIMIT_AS")
async def test_a_native_mmap_is_refused(target: Server, observe: Observe) -> None:
    code = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
p = libc.mmap(None, ctypes.c_size_t(64 << 30), 3, 0x22, -1, 0)
print("mmap", "failed" if p in (None, 2**64 - 1, -1) else "ok", ctypes.get_errno())
"""
    ex = await run(target, code, timeout_ms=SHORT)
    note = await assert_contained(target)
    assert ex.stdout.startswith("mmap failed 12"), ex.stdout
    observe(f"{ex.stdout.strip()} (ENOMEM); {note}")


@attack(
    "fill the disk from /workspace", "the disk watchdog stops the run: output_limit at SANDBOX_MAX_DISK_MB"
)
async def test_filling_the_workspace_ends_as_output_limit(target: Server, observe: Observe) -> None:
    code = "i = 0\nwhile True:\n    open(f'f{i}', 'wb').write(b'x' * (8 << 20)); i += 1"
    status, note = await hostile(target, code)
    assert status == "output_limit", note
    observe(note)


@attack(
    "fill host memory through the jail's private /tmp (a tmpfs)",
    "the jail's /tmp counts against the disk quota (output_limit) and, with per-run cgroups, against "
    "the run's memory group (memory_limit): whichever trips first ends the run",
)
async def test_filling_the_private_tmp_ends_as_output_limit(target: Server, observe: Observe) -> None:
    code = "i = 0\nwhile True:\n    open(f'/tmp/f{i}', 'wb').write(b'x' * (8 << 20)); i += 1"
    status, note = await hostile(target, code)
    # A tmpfs fills faster than the disk watchdog's 250 ms poll: the memory group's limit may
    # trip first (the kernel counts tmpfs pages), and that is the same containment.
    assert status in ("output_limit", "memory_limit"), note
    if status == "memory_limit":
        assert "/tmp" in note, note
    observe(note)


@attack(
    "exhaust inodes: create empty files as fast as possible",
    "the watchdog counts entries (one per 4 KiB of quota, at most 100,000): output_limit",
)
async def test_an_inode_flood_ends_as_output_limit(target: Server, observe: Observe) -> None:
    code = "import os\nos.mkdir('d')\ni = 0\nwhile True:\n    os.close(os.open(f'd/{i}', os.O_CREAT | os.O_WRONLY)); i += 1"
    status, note = await hostile(target, code, timeout_ms=15000)
    assert status == "output_limit", note
    observe(note)


@attack("one file larger than RLIMIT_FSIZE", "the write is cut off at SANDBOX_MAX_FILE_MB (SIGXFSZ/EFBIG)")
async def test_a_file_over_the_size_limit_is_cut_off(target: Server, observe: Observe) -> None:
    code = "import signal\nsignal.signal(signal.SIGXFSZ, signal.SIG_IGN)\nwith open('big', 'wb') as f:\n    for _ in range(64):\n        f.write(b'x' * (1 << 20))"
    ex = await run(target, code, timeout_ms=SHORT)
    note = await assert_contained(target)
    assert ex.status == "error" and ex.error and "File too large" in ex.error["evalue"], ex
    observe(f"{ex.error['ename']}: {ex.error['evalue']}; {note}")


@attack(
    "stdout flood",
    "output_limit once SANDBOX_MAX_OUTPUT_BYTES is streamed; no more than that reaches the client",
)
async def test_a_stdout_flood_ends_as_output_limit(target: Server, observe: Observe) -> None:
    ex = await run(target, "while True:\n    print('A' * 1000)", timeout_ms=SHORT)
    note = await assert_contained(target)
    streamed = sum(len(f.get("text", "")) for f in ex.frames if f["type"] == "stream")
    assert ex.status == "output_limit" and streamed <= OUTPUT_LIMIT + 65536, (ex.status, streamed)
    observe(f"output_limit; {streamed} chars streamed; {note}")


@attack("stderr flood from a C-level write loop", "output_limit; bounded bytes")
async def test_a_stderr_flood_ends_as_output_limit(target: Server, observe: Observe) -> None:
    ex = await run(target, "import os\nwhile True:\n    os.write(2, b'E' * 65536)", timeout_ms=SHORT)
    note = await assert_contained(target)
    streamed = sum(len(f.get("text", "")) for f in ex.frames if f["type"] == "stream")
    assert ex.status == "output_limit" and streamed <= OUTPUT_LIMIT + 65536, (ex.status, streamed)
    observe(f"output_limit; {streamed} chars streamed; {note}")


@attack(
    "one huge line with no newline (64 MiB)",
    "streamed in chunks, cut at the output limit; the server never buffers it whole",
)
async def test_a_huge_single_line_is_cut_at_the_output_limit(target: Server, observe: Observe) -> None:
    ex = await run(target, "import sys\nsys.stdout.write('L' * (64 << 20))", timeout_ms=SHORT)
    note = await assert_contained(target)
    frames = [f for f in ex.frames if f["type"] == "stream"]
    biggest = max((len(f["text"]) for f in frames), default=0)
    assert ex.status == "output_limit" and biggest <= 65536, (ex.status, biggest)
    observe(f"output_limit; largest stream frame {biggest} chars, {len(frames)} frames; {note}")


@attack(
    "many tiny frames (20,000 flushed one-byte writes)",
    "all delivered in order, the run ends ok, the server keeps up",
)
async def test_many_tiny_writes_are_delivered_in_order(target: Server, observe: Observe) -> None:
    code = "import os\nfor i in range(20000):\n    os.write(1, b'abcdefghij'[i % 10:i % 10 + 1])"
    ex = await run(target, code, timeout_ms=15000)
    note = await assert_contained(target)
    expected = "".join("abcdefghij"[i % 10] for i in range(20000))
    assert ex.status == "ok" and ex.stdout == expected, (ex.status, len(ex.stdout))
    observe(f"ok; {len(ex.stdout)} bytes in {sum(f['type'] == 'stream' for f in ex.frames)} frames; {note}")


@attack("a result whose repr is 500 MB", "the repr is truncated in the jail; the frame stays bounded")
async def test_a_gigantic_repr_is_truncated(target: Server, observe: Observe) -> None:
    code = "class Big:\n    def __repr__(self):\n        return 'R' * (200 << 20)\nBig()"
    ex = await run(target, code, timeout_ms=SHORT)
    note = await assert_contained(target)
    size = len(json.dumps(ex.frames))
    assert ex.status in ("ok", "output_limit", "memory_limit") and size < OUTPUT_LIMIT + 300_000, (
        ex.status,
        size,
    )
    observe(f"done {ex.status}; all frames together {size} bytes; {note}")


@attack("display flood (10,000 rich outputs)", "output_limit: events count against the output budget")
async def test_a_display_flood_ends_as_output_limit(target: Server, observe: Observe) -> None:
    ex = await run(target, "for i in range(10000):\n    display({'k': 'v' * 1000})", timeout_ms=SHORT)
    note = await assert_contained(target)
    assert ex.status == "output_limit", ex.status
    observe(f"output_limit after {sum(f['type'] == 'display' for f in ex.frames)} displays; {note}")


@attack("CPU spin in Python", "timeout at the wall clock")
async def test_a_python_cpu_spin_times_out(target: Server, observe: Observe) -> None:
    status, note = await hostile(target, "while True:\n    pass")
    assert status == "timeout", note
    observe(note)


@attack(
    "CPU spin in C with every signal blocked and SIGTERM/SIGINT ignored (catastrophic regex)",
    "timeout at the wall clock: the server kills the jail with SIGKILL, which cannot be blocked",
)
async def test_a_c_level_spin_that_blocks_signals_times_out(target: Server, observe: Observe) -> None:
    code = """
import re, signal
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(s, signal.SIG_IGN)
signal.pthread_sigmask(signal.SIG_BLOCK, set(signal.Signals) - {signal.SIGKILL, signal.SIGSTOP})
re.match(r"(a+)+$", "a" * 64 + "b")
"""
    status, note = await hostile(target, code)
    assert status == "timeout", note
    observe(note)


@attack("SIGSTOP its own process group", "the wall clock still ends it: timeout")
async def test_stopping_its_own_group_still_times_out(target: Server, observe: Observe) -> None:
    status, note = await hostile(
        target, "import os, signal\nprint('stopping', flush=True)\nos.killpg(0, signal.SIGSTOP)"
    )
    assert status == "timeout", note
    observe(note)


@attack(
    "SIGSTOP / SIGKILL the jail's init (pid 1 in its namespace)",
    "the run still ends with one done; nothing survives",
)
async def test_signalling_the_jails_init_is_contained(target: Server, observe: Observe) -> None:
    code = "import os, signal\nfor s in (signal.SIGSTOP, signal.SIGKILL):\n    try:\n        os.kill(1, s); print(s, 'sent', flush=True)\n    except OSError as e:\n        print(s, e, flush=True)\nimport time\ntime.sleep(1)"
    status, note = await hostile(target, code)
    assert status in ("ok", "timeout", "error"), note
    observe(note)


@attack(
    "orphaned children (double fork, parent exits)", "killed with the jail: no process of the run is left"
)
async def test_orphaned_children_do_not_survive_the_run(target: Server, observe: Observe) -> None:
    code = "import os, time\nif os.fork() == 0:\n    if os.fork() == 0:\n        time.sleep(600)\n    os._exit(0)\nprint('parent done')"
    status, note = await hostile(target, code)
    assert status == "ok", note
    observe(note)


@attack("setsid daemon (new session, stdio to /dev/null)", "killed with the jail")
async def test_a_setsid_daemon_does_not_survive_the_run(target: Server, observe: Observe) -> None:
    code = "import subprocess\nsubprocess.Popen(['sleep', '600'], start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\nprint('daemon started')"
    status, note = await hostile(target, code)
    assert status == "ok", note
    observe(note)


@attack("daemon that ignores SIGTERM/SIGHUP and blocks signals", "SIGKILL of the namespace takes it anyway")
async def test_a_signal_ignoring_daemon_does_not_survive(target: Server, observe: Observe) -> None:
    code = """
import os, signal, time
if os.fork() == 0:
    os.setsid()
    for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(s, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, set(signal.Signals) - {signal.SIGKILL, signal.SIGSTOP})
    while True:
        time.sleep(1)
print("spawned")
"""
    status, note = await hostile(target, code)
    assert status == "ok", note
    observe(note)


@attack(
    "close the driver's pipes (stdout, stderr, stdin and the event fd)",
    "the run still ends with exactly one done",
)
async def test_closing_the_drivers_pipes_still_ends_with_one_done(target: Server, observe: Observe) -> None:
    code = "import os\nfor fd in range(0, 64):\n    try:\n        os.close(fd)\n    except OSError:\n        pass\nimport time\ntime.sleep(0.5)"
    status, note = await hostile(target, code)
    assert status in ("ok", "error"), note
    observe(note)


@attack("exhaust file descriptors", "EMFILE at RLIMIT_NOFILE; the run ends")
async def test_exhausting_file_descriptors_stops_at_the_limit(target: Server, observe: Observe) -> None:
    code = "import os\nfds = []\ntry:\n    while True:\n        fds.append(os.open('/dev/null', os.O_RDONLY))\nexcept OSError as e:\n    print(len(fds), e.errno)"
    ex = await run(target, code, timeout_ms=SHORT)
    note = await assert_contained(target)
    count, err = ex.stdout.split()
    assert err == "24" and int(count) <= 1024, ex.stdout
    observe(f"EMFILE after {count} fds; {note}")


@attack(
    "sleep forever / wait on stdin forever (no CPU used)", "the wall clock, not CPU time, ends it: timeout"
)
async def test_idle_waits_still_time_out(target: Server, observe: Observe) -> None:
    status, note = await hostile(target, "input()\nimport time\ntime.sleep(3600)")
    assert status == "timeout", note
    observe(note)


@attack(
    "ignore the client's interrupt in a session (SIGINT ignored, busy loop)",
    "done cancelled; the session's jail is killed and the session ended",
)
async def test_an_interrupt_ignoring_cell_is_cancelled(target: Server, observe: Observe) -> None:
    async with AsyncClient(target.url, TOKEN) as c:
        first = await c.execute("x = 1", session="new")
        sid = first.session
        rid = c.new_id()
        frames = []
        async for frame in c.stream(
            "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nprint('go', flush=True)\nwhile True:\n    pass",
            id=rid,
            session=sid,
        ):
            frames.append(frame)
            if frame["type"] == "stream":
                await c.interrupt(rid)
        after = await c.execute("print(x)", session=sid)
    assert_no_secret(frames)
    assert_one_done(frames)
    note = await assert_contained(target)
    assert frames[-1]["status"] == "cancelled" and after.status == "rejected", (frames[-1], after.message)
    observe(f"done cancelled ({frames[-1]['message']}); next cell: {after.message}; {note}")


@attack(
    "12 concurrent CPU spins on one connection (over SANDBOX_MAX_CONCURRENCY=4)",
    "each gets exactly one done (queued then timeout); /healthz answers throughout",
)
async def test_a_burst_of_spinning_runs_is_queued_and_all_end(target: Server, observe: Observe) -> None:
    async with AsyncClient(target.url, TOKEN) as c:
        tasks = [asyncio.create_task(c.execute("while True: pass", timeout_ms=1500)) for _ in range(12)]
        await asyncio.sleep(0.5)
        health = await asyncio.to_thread(target.get, "/healthz")
        results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
    note = await assert_contained(target)
    for ex in results:
        assert_one_done(ex.frames)
    statuses = sorted({ex.status for ex in results})
    assert health[0] == 200 and statuses in (["timeout"], ["busy", "timeout"]), (health, statuses)
    observe(f"statuses {statuses}; /healthz {health[0]} mid-burst; {note}")


@attack(
    "burst 2 MB of output and exit at once (so the limit would be judged after `done`)",
    "output_limit all the same: a limit found while reading is handled before the queued done",
)
async def test_an_output_burst_followed_by_exit_is_still_output_limit(
    target: Server, observe: Observe
) -> None:
    ex = await run(
        target,
        "import os, sys\nsys.stdout.write('B' * 2_000_000)\nsys.stdout.flush()\nos._exit(0)",
        timeout_ms=SHORT,
    )
    note = await assert_contained(target)
    streamed = sum(len(f.get("text", "")) for f in ex.frames if f["type"] == "stream")
    assert ex.status == "output_limit" and streamed <= OUTPUT_LIMIT + 65536, (ex.status, streamed)
    observe(f"output_limit; {streamed} chars streamed; {note}")


SOCKET_MEMORY_MB = 128
# Queue data on loopback until `target` MiB sit in kernel socket buffers or nothing more is
# taken; report what the kernel holds (SO_MEMINFO: receive queue + send queue of every socket).
QUEUE_SOCKETS = """
import errno, json, socket, struct
MIB = 1 << 20
kind, target = {kind!r}, {target} * MIB
SO_MEMINFO = 55
def held(s):
    v = struct.unpack("9I", s.getsockopt(socket.SOL_SOCKET, SO_MEMINFO, 36))
    return v[0] + v[5]  # rmem_alloc + wmem_queued
socks, refused, block = [], {{}}, b"q" * 60000
def total():
    return sum(held(s) for s in socks)
for _ in range(200):
    if kind == "tcp":
        lst = socket.socket(); lst.bind(("127.0.0.1", 0)); lst.listen()
        a = socket.socket(); a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 * MIB)
        a.connect(lst.getsockname()); b, _ = lst.accept(); lst.close()
        b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * MIB)
    else:
        a = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); a.bind(("127.0.0.1", 0))
        b = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); b.bind(("127.0.0.1", 0))
        b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * MIB)
        a.connect(b.getsockname())
    a.setblocking(False); socks += [a, b]
    for _ in range(400):
        try:
            a.send(block)
        except OSError as e:
            refused[errno.errorcode.get(e.errno, str(e.errno))] = refused.get(errno.errorcode.get(e.errno, ""), 0) + 1
            break
    if total() >= target:
        break
print(json.dumps({{"pairs": len(socks) // 2, "queued_mib": total() // MIB, "refused": refused}}))
"""


@pytest.fixture(scope="module")
def small_memory(tmp_path_factory: pytest.TempPathFactory, tmp_root: Path) -> Iterator[Server]:
    """A hostile server whose runs have SOCKET_MEMORY_MB of memory."""
    srv = hostile_server(
        tmp_path_factory.mktemp("socket-server"),
        tmp_root,
        SANDBOX_MEMORY_MB=str(SOCKET_MEMORY_MB),
        SANDBOX_MAX_EXEC_MS="60000",
    )
    yield srv
    srv.stop()


@attack(
    f"queue 4x SANDBOX_MEMORY_MB ({SOCKET_MEMORY_MB} MiB) of TCP, then of UDP, in loopback socket "
    "buffers with 4 MiB SO_RCVBUF/SO_SNDBUF",
    "the run's cgroup charges socket buffers: the kernel stops queueing near SANDBOX_MEMORY_MB",
)
@pytest.mark.parametrize("kind", ["tcp", "udp"])
async def test_socket_buffers_count_against_the_run(
    small_memory: Server, observe: Observe, kind: str
) -> None:
    ex = await run(
        small_memory,
        QUEUE_SOCKETS.format(kind=kind, target=4 * SOCKET_MEMORY_MB),
        timeout_ms=50000,
        timeout=180,
    )
    lines = [ln for ln in ex.stdout.splitlines() if ln.startswith("{")]
    assert ex.status == "ok" and lines, (ex.status, ex.message, ex.stderr[-800:])
    report = json.loads(lines[-1])
    note = await assert_contained(small_memory)
    # The group's socket limit is SANDBOX_MEMORY_MB; the kernel may force a little past it.
    assert report["queued_mib"] <= SOCKET_MEMORY_MB * 1.25, report
    observe(f"{kind}: {report}; {note}")


LOOPBACK = """
import json, socket, threading
MIB = 1 << 20
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen()
def echo():
    c, _ = srv.accept()
    while data := c.recv(1 << 16):
        c.sendall(data)
    c.close()
threading.Thread(target=echo, daemon=True).start()
cl = socket.create_connection(srv.getsockname())
got = [0]
def read():
    while got[0] < 32 * MIB:
        got[0] += len(cl.recv(1 << 20))
reader = threading.Thread(target=read); reader.start()
for _ in range(32):
    cl.sendall(b"e" * MIB)
reader.join(60)
u1 = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u1.bind(("127.0.0.1", 0))
u2 = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u2.settimeout(10)
u2.sendto(b"ping", u1.getsockname()); data, peer = u1.recvfrom(64); u1.sendto(data * 2, peer)
print(json.dumps({"tcp_echoed_mib": got[0] // MIB, "udp": u2.recv(64).decode()}))
"""


@attack(
    "ordinary loopback networking in a jail whose socket memory is bounded: a 32 MiB TCP echo and a "
    "UDP round trip",
    "both work: the bound stops hoarding, not use",
)
async def test_loopback_networking_still_works_under_the_socket_bound(
    small_memory: Server, observe: Observe
) -> None:
    ex = await run(small_memory, LOOPBACK, timeout_ms=50000, timeout=120)
    lines = [ln for ln in ex.stdout.splitlines() if ln.startswith("{")]
    assert ex.status == "ok" and lines, (ex.status, ex.message, ex.stderr[-800:])
    report = json.loads(lines[-1])
    assert report == {"tcp_echoed_mib": 32, "udp": "pingping"}, (report, ex.stderr[-1500:])
    observe(f"{report}")


# Four threads that spin; and (another session) one that restarts `sleep 300` as soon as its
# last one is killed: a cell's end kills its processes (end_leftovers) just before `done`, so a
# new one starts just after the cell ended, when no process of the cell is left to be killed.
SPIN = """
import threading
def spin():
    while True:
        pass
for _ in range(4):
    threading.Thread(target=spin, daemon=True).start()
print('spinning')
"""
RESPAWN = """
import subprocess, threading
def respawn():
    while True:
        try:
            subprocess.Popen(['sleep', '300'], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL).wait()
        except OSError:
            pass
threading.Thread(target=respawn, daemon=True).start()
print('respawning')
"""
AGAIN = "import threading\nprint(threading.active_count())"
# Burns 0.3 s of CPU time in a run of its own: the window over which the sessions must not run.
BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3:\n    pass\nprint('burnt')"
V2 = Path("/sys/fs/cgroup/cgroup.controllers").is_file()


def _group_dirs(pid: int) -> tuple[Path, Path]:
    """(the directory whose cgroup.procs lists a process's group, the one that counts its CPU)."""
    lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    if V2:
        path = next(ln.split(":", 2)[2] for ln in lines if ln.startswith("0::"))
        return Path("/sys/fs/cgroup" + path), Path("/sys/fs/cgroup" + path)
    paths = {c: ln.split(":", 2)[2] for ln in lines for c in ln.split(":", 2)[1].split(",")}
    cpuacct = next(p for p in Path("/sys/fs/cgroup").iterdir() if "cpuacct" in p.name.split(","))
    return Path("/sys/fs/cgroup/pids" + paths["pids"]), cpuacct / paths["cpuacct"].lstrip("/")


def _members(procs: Path) -> set[int]:
    return {int(p) for p in (procs / "cgroup.procs").read_text().split()}


def _cpu_ns(group: Path) -> int:
    """The group's CPU time so far, in ns: the kernel's counter, not a clock."""
    if (group / "cpuacct.usage").is_file():
        return int((group / "cpuacct.usage").read_text())
    stat = dict(line.split() for line in (group / "cpu.stat").read_text().splitlines())
    return int(stat["usage_usec"]) * 1000


def _leftovers(procs: Path, own: set[int]) -> tuple[list[int], int]:
    """Processes of the group that are not the jail's own and run on: neither gone, a zombie,
    nor holding a SIGKILL (which a frozen v1 task takes as it thaws). And how many were killed."""
    live, killed = [], 0
    for pid in _members(procs) - own:
        try:
            status = dict(ln.split(":\t", 1) for ln in Path(f"/proc/{pid}/status").read_text().splitlines())
        except (OSError, ValueError):
            continue  # gone meanwhile
        if (int(status["ShdPnd"], 16) | int(status["SigPnd"], 16)) & (1 << (9 - 1)):  # SIGKILL
            killed += 1
        elif not status["State"].startswith("Z"):
            live.append(pid)
    return live, killed


@attack(
    "two sessions' cells leave threads behind and return: 4 that spin; one that restarts `sleep 300`",
    "between cells a session's jail is frozen: its CPU counter stands still while another run burns "
    "0.3 s of CPU, and what a thread started after the cell's end is killed",
)
async def test_a_session_does_no_work_between_cells(target: Server, observe: Observe) -> None:
    notes = []
    async with AsyncClient(target.url, TOKEN) as c:
        groups: dict[str, tuple[Path, Path, set[int]]] = {}
        for _ in ("spin", "respawn"):
            known = set(run_descendants(target.proc.pid))  # pool off: the sessions' jails only
            first = await c.execute("print('ready')", session="new", timeout_ms=SHORT)
            assert first.status == "ok" and first.session, (first.status, first.message)
            jail = [pid for pid in run_descendants(target.proc.pid) if pid not in known]
            procs, cpu = _group_dirs(jail[-1])
            groups[first.session] = (procs, cpu, _members(procs))
        for cells in ((SPIN, RESPAWN), (AGAIN, AGAIN)):
            for sid, code in zip(groups, cells, strict=True):
                ex = await c.execute(code, session=sid, timeout_ms=SHORT)
                assert ex.status == "ok", (ex.status, ex.message, ex.stderr)
            before = {
                sid: (_cpu_ns(cpu), _leftovers(procs, own)) for sid, (procs, cpu, own) in groups.items()
            }
            burnt = await c.execute(BURN, timeout_ms=SHORT)  # a one-shot run: a jail of its own
            assert burnt.status == "ok", (burnt.status, burnt.message)
            for sid, (procs, cpu, own) in groups.items():
                (cpu_before, (live, killed)), cpu_after = before[sid], _cpu_ns(cpu)
                still, _ = _leftovers(procs, own)
                assert not live and not still, f"processes run on after done: {live} {still}"
                assert cpu_after == cpu_before, (
                    f"a session ran {(cpu_after - cpu_before) / 1e6:.1f} ms between cells"
                )
                notes.append(f"CPU {cpu_before} ns -> {cpu_after} ns, {killed} started after done killed")
        for sid in groups:
            await c.close_session(sid)
    contained = await assert_contained(target)
    observe(f"{'; '.join(notes)}; {contained}")


def _may_lower_oom_scores(pid: int) -> bool:
    """Whether process pid holds CAP_SYS_RESOURCE (24), which lowering an oom_score_adj takes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> 24 & 1)
    return False


OOM_PROBE = """
import json, subprocess
def adj():
    return int(open('/proc/self/oom_score_adj').read())
start = adj()
tries = {}
for value in ('0', '-1000', '999'):
    try:
        with open('/proc/self/oom_score_adj', 'w') as fh:
            fh.write(value)
        tries[value] = 'written'
    except OSError as exc:
        tries[value] = type(exc).__name__
child = int(subprocess.run(['cat', '/proc/self/oom_score_adj'], capture_output=True, text=True).stdout)
print(json.dumps({"start": start, "adj": adj(), "tries": tries, "child": child}))
"""


@attack(
    "a global OOM (the host out of memory) picks the server, or jailed code lowers its own oom_score_adj",
    "the server runs at a negative oom_score_adj and every jailed process at 1000, which jailed code "
    "cannot lower (EACCES): the OOM killer's first choice is always a jail",
)
async def test_a_global_oom_picks_a_jail_not_the_server(target: Server, observe: Observe) -> None:
    server_adj = int(Path(f"/proc/{target.proc.pid}/oom_score_adj").read_text())
    ex = await run(target, OOM_PROBE)
    report = json.loads(ex.stdout.strip().splitlines()[-1])
    assert report["start"] == 1000, f"a jail starts at oom_score_adj {report['start']}"
    assert report["tries"]["-1000"] != "written", report
    if _may_lower_oom_scores(target.proc.pid):
        assert server_adj < 0, f"the server runs at oom_score_adj {server_adj}"
        assert report["adj"] == 1000 and report["child"] == 1000, report  # 1000 is the jail's floor
        assert all(v != "written" for v in report["tries"].values()), report
    else:  # no CAP_SYS_RESOURCE (some containers): no floor can be set, nor a negative score
        assert server_adj <= 0 and report["adj"] >= server_adj, (server_adj, report)
        assert "oom_score_adj stays" in target.log.read_text(), (
            "the server did not say it could not lower its score"
        )
    observe(
        f"server {server_adj}; jail {report['adj']}, its child {report['child']}; lowering: {report['tries']}"
    )


# Puts descriptors in flight over unix sockets (SCM_RIGHTS, the same one 253 times a message)
# until the kernel refuses (ETOOMANYREFS: a per-uid count, `user->unix_inflight`, against the
# sender's RLIMIT_NOFILE), keeps them there, and reports; PROBE_INFLIGHT sends one.
HOG_INFLIGHT = """
import array, errno, json, os, socket
PAIRS, refused = [], None
fd = os.open("/workspace", os.O_RDONLY)
while refused is None and len(PAIRS) < 64:
    a, b = socket.socketpair()
    a.setblocking(False)
    PAIRS.append((a, b))
    for _ in range(16):
        try:
            a.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd] * 253))])
        except OSError as exc:
            if exc.errno != errno.EAGAIN:
                refused = errno.errorcode.get(exc.errno, str(exc.errno))
            break
print(json.dumps({"refused": refused, "pairs": len(PAIRS), "uid": os.getuid()}))
"""
PROBE_INFLIGHT = """
import array, errno, json, os, socket
a, b = socket.socketpair()
try:
    a.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [a.fileno()]))])
    got = "sent"
except OSError as exc:
    got = errno.errorcode.get(exc.errno, str(exc.errno))
print(json.dumps({"got": got, "uid": os.getuid()}))
"""


@attack(
    "a session puts descriptors in flight (SCM_RIGHTS) until the kernel's per-uid count refuses "
    "(ETOOMANYREFS) and keeps them; runs on the same server and on another server send one meanwhile",
    "each jail runs as a uid of its own (SANDBOX_UID_RANGE): the others still send theirs",
)
async def test_a_run_cannot_take_another_jails_per_uid_limits(
    target: Server, observe: Observe, tmp_path_factory: pytest.TempPathFactory, tmp_root: Path
) -> None:
    other = hostile_server(tmp_path_factory.mktemp("uid-server"), tmp_root)
    try:
        async with AsyncClient(target.url, TOKEN) as c:
            hog = await c.execute(HOG_INFLIGHT, session="new", timeout_ms=SHORT)
            sid = hog.session
            assert hog.status == "ok" and sid, (hog.status, hog.message, hog.stderr[-800:])
            try:
                took = json.loads(hog.stdout.splitlines()[-1])
                assert took["refused"] == "ETOOMANYREFS", took
                seen = {}
                for name, server in (("same server", target), ("another server", other)):
                    ex = await run(server, PROBE_INFLIGHT, timeout_ms=SHORT)
                    assert ex.status == "ok", (ex.status, ex.message, ex.stderr[-800:])
                    seen[name] = json.loads(ex.stdout.splitlines()[-1])
            finally:
                await c.close_session(sid)
        for name, got in seen.items():
            assert got["got"] == "sent", (
                f"a run on the {name} could not send a descriptor: {got} (the hog: {took})"
            )
            assert got["uid"] != took["uid"], f"a run on the {name} shares the hog's uid {took['uid']}"
        observe(
            f"the session (uid {took['uid']}) filled its in-flight descriptor count (ETOOMANYREFS); runs as "
            f"uids {seen['same server']['uid']} (same server) and {seen['another server']['uid']} "
            f"(another server) each sent one"
        )
    finally:
        other.stop()


# Takes inotify instances until the kernel refuses one, keeps them in a global, and reports;
# PROBE_INOTIFY asks for one.
JAIL_INOTIFY = 16  # nslimits.JAIL_CAPS: a jail's own inotify instances
HOG_INOTIFY = """
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
HELD = []
while len(HELD) < 100000:
    fd = libc.inotify_init1(0)
    if fd < 0:
        break
    HELD.append(fd)
print(json.dumps({"held": len(HELD), "errno": ctypes.get_errno(), "uid": os.getuid()}))
"""
PROBE_INOTIFY = """
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.inotify_init1(0)
print(json.dumps({"fd": fd, "errno": ctypes.get_errno(), "uid": os.getuid()}))
"""


@attack(
    "a session takes every inotify instance the kernel gives it and keeps them (a count charged "
    "to root, who owns every jail's user namespace); runs on the same server, on another server "
    "and root on the host ask for one meanwhile",
    "each jail is capped in its own user namespace (16) and the host's limit holds every jail at "
    "its cap: the others still get theirs",
)
async def test_a_run_cannot_take_every_jails_inotify_instances(
    target: Server, observe: Observe, tmp_path_factory: pytest.TempPathFactory, tmp_root: Path
) -> None:
    other = hostile_server(tmp_path_factory.mktemp("inotify-server"), tmp_root)
    try:
        async with AsyncClient(target.url, TOKEN) as c:
            hog = await c.execute(HOG_INOTIFY, session="new", timeout_ms=SHORT)
            sid = hog.session
            assert hog.status == "ok" and sid, (hog.status, hog.message, hog.stderr[-800:])
            try:
                took = json.loads(hog.stdout.splitlines()[-1])
                assert took["errno"] == errno.EMFILE and 0 < took["held"] <= JAIL_INOTIFY, took
                seen = {}
                for name, server in (("same server", target), ("another server", other)):
                    ex = await run(server, PROBE_INOTIFY, timeout_ms=SHORT)
                    assert ex.status == "ok", (ex.status, ex.message, ex.stderr[-800:])
                    seen[name] = json.loads(ex.stdout.splitlines()[-1])
                host = _host_inotify()
            finally:
                await c.close_session(sid)
        for name, got in seen.items():
            assert got["fd"] >= 0, f"a run on the {name} got no inotify instance: {got} (the hog held {took})"
        assert host is None, f"root on the host got no inotify instance: {host} (the hog held {took})"
        observe(
            f"the session held {took['held']} inotify instances, then EMFILE; runs on the same server and "
            "another server, and root on the host, each got one"
        )
    finally:
        other.stop()


def _host_inotify() -> str | None:
    """Whether root on the host can have an inotify instance now: None, or why not."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(0)
    if fd < 0:
        return errno.errorcode.get(ctypes.get_errno(), "?")
    os.close(fd)
    return None
