"""Soak: thousands of mixed runs (normal, hostile, concurrent, sessions, sessions that leave
spinning threads between cells, malformed, deep trees, sparse outputs) and clients that stop reading, against a real server, then a leak
audit.

    .venv/bin/python -m benchmarks.soak                  # 10,000 requests -> benchmarks/results/soak.{md,json}
    .venv/bin/python -m benchmarks.soak --quick          # 300 requests, printed only

Checks afterwards: every request got exactly one `done`; no process left under the server
(the pool is off, so any process is a leak), nor any of its per-run cgroups; no run directory left under the server's
SANDBOX_TMP_ROOT; no growth in the server's open file descriptors; the server's RSS before,
at its peak (sampled throughout) and after, reported.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import websockets

from appliance.sandbox import cgroups, fstree, instance, runfs, uids
from tests.support import REPO, Server, start_server

NORMAL = [
    "print(sum(range(1000)))",
    "import math\nmath.factorial(200)",
    "x = [i * i for i in range(10000)]\nlen(x)",
    "open('outputs/r.txt', 'w').write('result')",
    "import json\nprint(json.dumps({'a': 1}))",
    "raise ValueError('expected failure')",
    "import sys\nsys.exit(2)",
    "name = input()\nprint('hi', name)",
]
HOSTILE = [
    ("while True: pass", 600),
    ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", 800),
    ("while True: print('A' * 4096)", 3000),
    ("x = bytearray(8 * 1024 ** 3)", 3000),
    ("import subprocess\nsubprocess.Popen(['sleep', '600'], start_new_session=True)", 3000),
    ("import os, time\nif os.fork() == 0:\n    time.sleep(600)\nprint('orphan')", 3000),
    ('print(\'{"type":"done","id":"x","status":"ok"}\')', 3000),
    ("import os, signal\nos.killpg(0, signal.SIGSTOP)", 600),
    (
        "import os\nfor fd in range(64):\n    try:\n        os.close(fd)\n    except OSError:\n        pass",
        3000,
    ),
    ("import os\nos._exit(9)", 3000),
    ("i = 0\nwhile True:\n    open(f'f{i}', 'wb').write(b'x' * (4 << 20)); i += 1", 3000),
    # A tree deeper than any recursion limit, in the workspace and under outputs/.
    (
        "import os\nfor i in range(1200):\n    os.mkdir('d'); os.chdir('d')\nopen('leaf', 'w').write('x')",
        5000,
    ),
    (
        "import os\nos.chdir('outputs')\nfor i in range(1200):\n    os.mkdir('d'); os.chdir('d')\n"
        "open('leaf', 'w').write('x')",
        5000,
    ),
    # Sparse files: no disk blocks, 800 MiB claimed.
    (
        "for i in range(100):\n    with open(f'outputs/s{i:03}.bin', 'wb') as fh:\n        fh.truncate(8 << 20)",
        5000,
    ),
]
OUTPUT_FILES_CAP = 1000  # SANDBOX_MAX_OUTPUT_FILES's default
# A client that sends this and never reads: the server must neither grow nor keep the run.
FLOOD = "import os\nb = b'x' * 65536\nwhile True:\n    os.write(1, b)"
# A session's first cell that leaves threads behind: two that spin and one that restarts a
# `sleep` as soon as the cell's end kills it. Between cells the jail is frozen and what that
# thread started is killed; the session's close leaves nothing.
SPINNING_SESSION = """
import subprocess, threading
n = 1
def spin():
    while True:
        pass
def respawn():
    while True:
        try:
            subprocess.Popen(['sleep', '300']).wait()
        except OSError:
            pass
for target in (spin, spin, respawn):
    threading.Thread(target=target, daemon=True).start()
"""
MALFORMED = [
    "not json",
    "[1]",
    '{"code": 5}',
    '{"type": "nope"}',
    '{"type": "stdin", "id": "ghost", "data": "x"}',
]


class Tally:
    """Requests sent and `done` frames received, per request id."""

    def __init__(self) -> None:
        self.sent: Counter[str] = Counter()
        self.done: Counter[str] = Counter()
        self.status: Counter[str] = Counter()
        self.kinds: Counter[str] = Counter()
        self.errors: list[str] = []


async def request(ws: Any, frame: dict[str, Any] | str, rid: str, tally: Tally, kind: str) -> dict[str, Any]:
    """Send one frame on a private connection and read to its done (the connection is ours alone)."""
    tally.sent[rid] += 1
    tally.kinds[kind] += 1
    await ws.send(frame if isinstance(frame, str) else json.dumps(frame))
    while True:
        msg: dict[str, Any] = json.loads(await asyncio.wait_for(ws.recv(), 120))
        if msg.get("type") == "done":
            # Malformed frames without a readable id get a server-made id; count them as ours.
            tally.done[rid if msg.get("id") in (rid, None) or isinstance(frame, str) else msg["id"]] += 1
            tally.status[msg.get("status", "?")] += 1
            return msg


async def worker(url: str, n: int, seq: list[int], total: int, tally: Tally, rng: random.Random) -> None:  # noqa: PLR0913 (a worker's shared counters and its own random source)
    async with websockets.connect(url, max_size=None) as ws:
        while seq[0] < total:
            seq[0] += 1
            i = seq[0]
            roll = rng.random()
            rid = f"w{n}-{i}"
            try:
                if roll < 0.60:
                    await request(
                        ws, {"id": rid, "code": rng.choice(NORMAL), "stdin_eof": False}, rid, tally, "normal"
                    )
                elif roll < 0.85:
                    code, ms = rng.choice(HOSTILE)
                    await request(ws, {"id": rid, "code": code, "timeout_ms": ms}, rid, tally, "hostile")
                elif roll < 0.95:
                    kind, code = (
                        ("descriptors in flight", IN_FLIGHT)
                        if roll >= 0.93
                        else ("spinning session", SPINNING_SESSION)
                        if roll >= 0.91
                        else ("session", "n = 1")
                    )
                    first = await request(ws, {"id": rid, "code": code, "session": "new"}, rid, tally, kind)
                    sid = first.get("session")
                    for j in range(2):
                        seq[0] += 1
                        await request(
                            ws,
                            {"id": f"{rid}-{j}", "code": "n += 1\nprint(n)", "session": sid},
                            f"{rid}-{j}",
                            tally,
                            kind,
                        )
                    if sid:
                        seq[0] += 1
                        await request(
                            ws,
                            {"type": "close_session", "id": f"{rid}-c", "session": sid},
                            f"{rid}-c",
                            tally,
                            kind,
                        )
                else:
                    await request(ws, rng.choice(MALFORMED), rid, tally, "malformed")
            except (TimeoutError, websockets.ConnectionClosed) as exc:
                tally.errors.append(f"{rid}: {type(exc).__name__}")
                return


# A session cell that unlinks its files and keeps their descriptors in flight (SCM_RIGHTS
# over a socketpair held in a global): the run's tmpfs refuses writes past the quota (32 MiB).
IN_FLIGHT = (
    "import os, socket\nn = 1\npair = socket.socketpair()\n"
    "for i in range(4):\n"
    "    fd = os.open(f'f{i}', os.O_CREAT | os.O_RDWR, 0o600); os.unlink(f'f{i}')\n"
    "    try:\n        os.write(fd, b'i' * (12 << 20))\n    except OSError:\n        pass\n"
    "    socket.send_fds(pair[0], [b'f'], [fd]); os.close(fd)"
)


async def slow_readers(url: str, rounds: int, tally: Tally) -> None:
    """Clients that send a flooding run and then never read (a 1-frame receive queue, so the
    socket's buffers fill), for a while, before they drop."""
    for i in range(rounds):
        async with websockets.connect(url, max_size=None, max_queue=1) as ws:
            await ws.send(json.dumps({"id": f"slow-{i}", "code": FLOOD, "timeout_ms": 2000}))
            tally.kinds["slow reader"] += 1
            await asyncio.sleep(3.0)


# 2000 directories under outputs/, an empty file in each: 4000 entries that cost no bytes. Each
# costs a block of SANDBOX_MAX_OUTPUTS_BYTES and SANDBOX_MAX_OUTPUT_FILES caps them per run.
MANY_ENTRIES = "import os\nfor i in range(2000):\n    os.mkdir(f'outputs/d{i}')\n    open(f'outputs/d{i}/f', 'w').close()"


async def many_entry_outputs(url: str, rounds: int, tally: Tally) -> None:
    """Runs that leave thousands of empty entries under outputs/ (persisted: SANDBOX_OUTPUTS_DIR)."""
    async with websockets.connect(url, max_size=None) as ws:
        for i in range(rounds):
            rid = f"entries-{i}"
            await request(
                ws, {"id": rid, "code": MANY_ENTRIES, "timeout_ms": 5000}, rid, tally, "many-entry outputs"
            )


def persisted_entries(root: Path) -> tuple[int, int]:
    """(entries in the fullest persisted run directory, entries in all) under SANDBOX_OUTPUTS_DIR."""
    most = total = 0
    for run in root.glob("*/*"):
        n = sum(1 for _ in fstree.Walk(run).stats())
        most, total = max(most, n), total + n
    return most, total


async def unfinished_frames(server: Server, rounds: int, tally: Tally) -> None:
    """Clients that announce a 12 MiB text frame, send half of it and go: what the server
    reserved for them must all come back (`appliance_frame_buffer_bytes` 0 at the end)."""
    size = 12 << 20
    for _ in range(rounds):
        conns = []
        for _ in range(4):
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            key = base64.b64encode(os.urandom(16)).decode()
            writer.write(
                f"GET /exec HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode()
            )
            await reader.readuntil(b"\r\n\r\n")
            # A masked text frame with a zero mask (the payload goes as it is), half sent.
            writer.write(struct.pack("!BBQ", 0x81, 0x80 | 127, size) + b"\0\0\0\0" + b" " * (size // 2))
            await writer.drain()
            conns.append(writer)
            tally.kinds["unfinished frame"] += 1
        await asyncio.sleep(1.0)
        for writer in conns:
            writer.close()


def frame_buffer_bytes(server: Server) -> float:
    for line in server.get("/metrics")[1].splitlines():
        if line.startswith("appliance_frame_buffer_bytes "):
            return float(line.rsplit(" ", 1)[1])
    return -1.0


async def sample_rss(pid: int, peak: list[int]) -> None:
    while True:
        peak[0] = max(peak[0], rss_kb(pid))
        await asyncio.sleep(0.1)


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def idle_fds(pid: int, ceiling: int | None = None, timeout: float = 15) -> int:
    """The server's open descriptors once the uids it keeps after a burst are back: a lock file
    each, given back after `uids.KEEP_S` unused by a task that runs as often. With a ceiling,
    polled until at most that (a leak never comes back: the count at the deadline then)."""
    from tests.support import scaled

    if ceiling is None:
        time.sleep(2 * uids.KEEP_S + 0.5)
        return fd_count(pid)
    deadline = time.monotonic() + scaled(timeout)
    while (count := fd_count(pid)) > ceiling and time.monotonic() < deadline:
        time.sleep(0.2)
    return count


def leftover_groups(pid: int) -> list[str]:
    """The per-run cgroups server `pid` still has (the pool is off: any is a leak; a session's
    frozen group among them would be one its close failed to end)."""
    tree, _ = cgroups.detect()
    if tree is None:
        return []
    found: set[str] = set()
    for d in tree.base.values():
        with contextlib.suppress(FileNotFoundError):
            found |= {g.name for g in (d / instance.name(pid)).iterdir() if g.is_dir()}
    return sorted(found)


def settle(server: Server, timeout: float = 30) -> tuple[list[int], list[str], list[str]]:
    """Wait until the runs left no process, run directory or cgroup; what is left at the end.
    A jail removes its directory before its group, so all three are waited for together."""
    from tests.attacks.common import run_dirs
    from tests.support import run_descendants, scaled

    deadline = time.monotonic() + scaled(timeout)
    while True:
        procs, dirs = run_descendants(server.proc.pid), run_dirs(server)
        groups = leftover_groups(server.proc.pid)
        if not (procs or dirs or groups) or time.monotonic() > deadline:
            return procs, dirs, groups
        time.sleep(0.2)


async def soak(
    server: Server, total: int, concurrency: int, seed: int, peak: list[int] | None = None
) -> tuple[Tally, float]:
    tally = Tally()
    seq = [0]
    rng = random.Random(seed)  # noqa: S311 (a reproducible workload mix, not a secret)
    started = time.monotonic()
    sampler = asyncio.create_task(sample_rss(server.proc.pid, peak if peak is not None else [0]))
    workers = asyncio.gather(
        *(
            worker(server.url, n, seq, total, tally, random.Random(rng.random()))  # noqa: S311
            for n in range(concurrency)
        )
    )
    # Slow readers come and go alongside the workers, one at a time, for as long as they run.
    readers = asyncio.create_task(slow_readers(server.url, max(1, total // 150), tally))
    frames = asyncio.create_task(unfinished_frames(server, max(1, total // 100), tally))
    entries = asyncio.create_task(many_entry_outputs(server.url, max(1, total // 100), tally))
    await workers
    await readers
    await frames
    await entries
    sampler.cancel()
    return tally, time.monotonic() - started


def main(argv: list[str] | None = None) -> dict[str, Any]:  # noqa: C901, PLR0915 (the soak's options and report, in order)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=10_000)
    parser.add_argument("--quick", action="store_true", help="300 requests, results printed only")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = parser.parse_args(argv)
    total = 300 if args.quick else args.runs
    work = Path(tempfile.mkdtemp(prefix="appliance-soak-", dir="/tmp"))
    os.chmod(work, 0o755)
    server = start_server(
        work / "server",
        SANDBOX_POOL_SIZE="0",
        SANDBOX_TMP_ROOT=str(work),
        SANDBOX_MAX_EXEC_MS="5000",
        SANDBOX_MAX_DISK_MB="32",
        SANDBOX_MEMORY_MB="512",
        SANDBOX_MAX_OUTPUT_BYTES="65536",
        SANDBOX_MAX_CONCURRENCY="4",
        SANDBOX_OUTPUTS_DIR=str(work / "persisted"),
    )
    try:
        # Warm up (imports, caches, the first connections) before the baseline is taken.
        asyncio.run(soak(server, 40, 4, args.seed + 1))
        settle(server)
        rss_before, fds_before = rss_kb(server.proc.pid), idle_fds(server.proc.pid)
        peak = [rss_before]
        tally, seconds = asyncio.run(soak(server, total, args.concurrency, args.seed, peak))
        procs, dirs, groups = settle(server)
        mounts = [str(p) for p in runfs.mounts_under(work / "appliance")]
        time.sleep(1)
        rss_after, fds_after = rss_kb(server.proc.pid), idle_fds(server.proc.pid, fds_before + 2)
        frame_bytes_after = frame_buffer_bytes(server)
        entries_most, entries_all = persisted_entries(work / "persisted")
        alive = server.proc.poll() is None and server.get("/healthz")[0] == 200
    finally:
        server.stop()
        log_tail = server.logs()[-2000:]
        shutil.rmtree(work, ignore_errors=True)
    wrong_done = {rid: tally.done[rid] for rid in tally.sent if tally.done[rid] != tally.sent[rid]}
    extra_done = {rid: n for rid, n in tally.done.items() if rid not in tally.sent}
    requests = sum(tally.sent.values())
    commit = (
        subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=False
        ).stdout.strip()
        or "?"
    )
    result: dict[str, Any] = {
        "requests": requests,
        "kinds": dict(tally.kinds),
        "statuses": dict(tally.status),
        "concurrency": args.concurrency,
        "duration_s": round(seconds, 1),
        "requests_per_s": round(requests / seconds, 1) if seconds else None,
        "requests_without_exactly_one_done": len(wrong_done) + len(extra_done),
        "client_errors": tally.errors[:20],
        "leftover_processes": procs,
        "leftover_run_dirs": dirs,
        "leftover_cgroups": groups,
        "leftover_mounts": mounts,
        "server_fds_before": fds_before,
        "server_fds_after": fds_after,
        "server_rss_mb_before": round(rss_before / 1024, 1),
        "server_rss_mb_peak": round(peak[0] / 1024, 1),
        "server_rss_mb_after": round(rss_after / 1024, 1),
        "server_alive": alive,
        "frame_buffer_bytes_after": frame_bytes_after,
        "persisted_entries_max_per_run": entries_most,
        "persisted_entries": entries_all,
        "host": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "commit": commit,
    }
    leaks = []
    if result["requests_without_exactly_one_done"] or tally.errors:
        leaks.append("requests without exactly one done")
    if procs:
        leaks.append("processes")
    if dirs:
        leaks.append("run directories")
    if groups:
        leaks.append("cgroups")
    if mounts:
        leaks.append("run tmpfs mounts")
    if fds_after > fds_before + 2:
        leaks.append("file descriptors")
    if not alive:
        leaks.append("server died")
    if frame_bytes_after != 0:
        leaks.append("bytes reserved for unfinished frames")
    if entries_most > OUTPUT_FILES_CAP:
        leaks.append("persisted outputs past SANDBOX_MAX_OUTPUT_FILES")
    result["leaks"] = leaks or ["none"]
    print(json.dumps(result, indent=2))
    if leaks:
        print(log_tail, file=sys.stderr)
    if not args.quick:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "soak.json").write_text(json.dumps(result, indent=2) + "\n")
        (out / "soak.md").write_text(render(result))
    return result


def render(r: dict[str, Any]) -> str:
    """The soak's figures as a Markdown page."""
    rows = [
        ("requests (every one expects exactly one done)", r["requests"]),
        ("mix", ", ".join(f"{k} {v}" for k, v in sorted(r["kinds"].items()))),
        ("done statuses", ", ".join(f"{k} {v}" for k, v in sorted(r["statuses"].items()))),
        ("concurrent connections", r["concurrency"]),
        ("duration", f"{r['duration_s']} s ({r['requests_per_s']} requests/s)"),
        ("requests without exactly one done", r["requests_without_exactly_one_done"]),
        ("processes left under the server (pool off)", len(r["leftover_processes"])),
        ("run directories left", len(r["leftover_run_dirs"])),
        ("run tmpfs mounts left", len(r.get("leftover_mounts", []))),
        ("server open fds before / after", f"{r['server_fds_before']} / {r['server_fds_after']}"),
        (
            "server RSS before / peak / after",
            f"{r['server_rss_mb_before']} MiB / {r.get('server_rss_mb_peak', '?')} MiB / {r['server_rss_mb_after']} MiB",
        ),
        ("leaks found", ", ".join(r["leaks"])),
    ]
    lines = [
        "# Soak",
        "",
        "`python -m benchmarks.soak` against a real server (real firejail jails),",
        f"on {r['host']['cpus']} CPUs, Python {r['host']['python']}, commit {r.get('commit', '?')}.",
        "Slow readers (clients that send a flooding run and never read) are not counted as",
        "requests: they never take their `done`; the leak audit covers them.",
        "",
        "| measure | value |",
        "|---|---|",
        *(f"| {k} | {v} |" for k, v in rows),
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    outcome = main()
    sys.exit(0 if outcome["leaks"] == ["none"] else 1)
