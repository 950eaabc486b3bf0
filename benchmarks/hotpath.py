"""A probe of the warm hot path: `print(2+2)` round trips, with the CPU each one costs.

    python -m benchmarks.hotpath [--runs 200] [--tree DIR ...] [--code 'print(2+2)'] [--floor] [--session]

Starts one appliance per `--tree` (a checkout; default: this one), each in its own cpuacct
cgroup, and sends one-shot runs to them in turn (interleaved, so a load that comes and goes
on the machine falls on every tree alike), each after the pool is idle and SETTLE_S of
quiet, as `python -m benchmarks` does. For each tree it reports the wall time from the
frame sent to the `done` received (p50/p90), and what each run cost in CPU time within
that window: the server process's own (its threads' schedstat run time, nanoseconds) and
the whole cgroup's (server, firejail and the jail: cpuacct.usage), and the server's minor
page faults (copy-on-write faults after a fork of the server show there). CPU time is far
less sensitive than wall time to other work on the machine, so it is the figure to compare
changes by on a busy host. `--floor` adds `benchmarks.floor` to the rotation: the same
exchange of frames with a warm child and nothing of a sandbox, the least a run can cost
here. `--session` sends every run as a cell of one session per tree instead (what a session's
cell costs: since the freeze between cells, its thaw at the start and its freeze before `done`).
Needs root (cgroups).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from appliance.runtime import local
from benchmarks.appliance_server import (
    REPO,
    ApplianceServer,
    BenchError,
    execute,
    open_ws,
    unwind_on_sigterm,
    wait_pool_idle,
)
from benchmarks.stats import percentile

CPUACCT = Path("/sys/fs/cgroup/cpuacct")
SETTLE_S = 0.1  # as benchmarks.suite: a warm jail has idled before its run
POOL_FLOOR = 2


def thread_ns(pid: int) -> int:
    """Run time of every thread of process pid so far, in nanoseconds (schedstat)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as fh:
                total += int(fh.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return total


def minor_faults(pid: int) -> int:
    """Minor page faults of every thread of process pid so far (/proc stat field 10). A run
    that follows a fork() of the server pays one for each page it writes: the count shows
    whether jails are spawned without forking the server."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as fh:
                total += int(fh.read().rsplit(")", 1)[1].split()[7])
        except (OSError, ValueError, IndexError):
            continue
    return total


@dataclass
class Target:
    """One tree's server and what its runs measured."""

    name: str
    server: ApplianceServer
    cgroup: Path
    wall_ms: list[float] = field(default_factory=list)
    server_us: list[float] = field(default_factory=list)
    group_us: list[float] = field(default_factory=list)
    faults: list[float] = field(default_factory=list)

    def usage_ns(self) -> int:
        return int((self.cgroup / "cpuacct.usage").read_text())


def remove_group(cgroup: Path) -> None:
    """Move what is left in the cgroup to the root, then remove it and what the server made
    under it (its per-run groups), deepest first."""
    below = sorted((p for p in cgroup.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True)
    for group in [*below, cgroup]:
        with contextlib.suppress(OSError):
            for pid in (group / "cgroup.procs").read_text().split():
                (CPUACCT / "cgroup.procs").write_text(pid)
        with contextlib.suppress(OSError):
            group.rmdir()


def own_group(name: str) -> tuple[Path, list[str]]:
    """A new cpuacct cgroup for one target, and the command prefix that makes a process join
    it before it starts: so every process it makes (an appliance's jails) is counted there."""
    cgroup = CPUACCT / f"appliance-hotpath-{os.getpid()}-{name}"
    cgroup.mkdir()
    return cgroup, ["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$@"', "sh"]


def start(name: str, tree: Path, work: Path) -> Target:
    cgroup, wrap = own_group(name)
    try:
        server = local.start(work / name, {}, name=name, wrap=wrap, timeout_s=120, cwd=tree)
    except BaseException as exc:  # a failed start, or SIGTERM (`unwind_on_sigterm`) during it
        remove_group(cgroup)
        if isinstance(exc, local.ServerStartError):
            raise BenchError(str(exc)) from exc
        raise
    return Target(name, ApplianceServer(server.proc, server.port, server.log, server.env, name), cgroup)


def start_floor(work: Path) -> Target:
    """`benchmarks.floor` in its own cpuacct cgroup, as `start` does an appliance."""
    cgroup, wrap = own_group("floor")
    port_file, log = work / "floor.port", work / "floor.log"
    with open(log, "wb") as log_fh:
        proc = subprocess.Popen(
            [*wrap, sys.executable, "-m", "benchmarks.floor", str(port_file)],
            cwd=REPO,
            stdout=log_fh,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 30
        while not port_file.exists() or not port_file.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise BenchError(f"the floor server did not start: {log.read_text()[-2000:]}")
            time.sleep(0.05)
    except BaseException:  # as above: failed, or SIGTERM while it starts
        proc.kill()
        proc.wait()
        remove_group(cgroup)
        raise
    server = ApplianceServer(proc, int(port_file.read_text()), log, {}, "floor")
    return Target("floor", server, cgroup)


async def probe(
    targets: list[Target], runs: int, code: str, expect: str | None, session: bool = False
) -> None:
    sockets = {t.name: await open_ws(t.server.url) for t in targets}
    sessions: dict[str, str | None] = {}
    for t in targets:  # one unmeasured run each: the first round trip of a connection is not warm
        reply = await execute(sockets[t.name], "warmup", code, "new" if session else None)
        if session and reply.session is None:
            raise BenchError(f"{t.name}: the session did not open ({reply.status})")
        sessions[t.name] = reply.session if session else None
    for i in range(runs):
        order = list(targets)
        random.shuffle(order)
        for t in order:
            if t.name != "floor":  # it has no pool, and no /metrics
                await wait_pool_idle(t.server, POOL_FLOOR)
            await asyncio.sleep(SETTLE_S)
            pid = t.server.proc.pid
            cpu0, grp0, flt0 = thread_ns(pid), t.usage_ns(), minor_faults(pid)
            t0 = time.perf_counter()
            reply = await execute(sockets[t.name], f"p{i}", code, sessions[t.name])
            t1 = time.perf_counter()
            cpu1, grp1, flt1 = thread_ns(pid), t.usage_ns(), minor_faults(pid)
            if reply.status != "ok" or (expect is not None and reply.stdout != expect):
                raise BenchError(f"{t.name}: run {i} ended {reply.status} with {reply.stdout!r}")
            t.wall_ms.append((t1 - t0) * 1000)
            t.server_us.append((cpu1 - cpu0) / 1000)
            t.group_us.append((grp1 - grp0) / 1000)
            t.faults.append(flt1 - flt0)
    for ws in sockets.values():
        await ws.close()


def report(targets: list[Target]) -> str:
    rows = [
        "| tree | runs | wall p50 ms | wall p90 ms | server CPU µs p50 / mean | cgroup CPU µs p50 / mean "
        "| server page faults p50 / mean |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for t in targets:
        rows.append(
            f"| {t.name} | {len(t.wall_ms)} | {percentile(t.wall_ms, 50):.2f} | {percentile(t.wall_ms, 90):.2f} "
            f"| {percentile(t.server_us, 50):.0f} / {sum(t.server_us) / len(t.server_us):.0f} "
            f"| {percentile(t.group_us, 50):.0f} / {sum(t.group_us) / len(t.group_us):.0f} "
            f"| {percentile(t.faults, 50):.0f} / {sum(t.faults) / len(t.faults):.0f} |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument(
        "--tree",
        type=Path,
        action="append",
        help="a checkout to start a server from (repeat to compare; default: this one)",
    )
    parser.add_argument("--code", default="print(2+2)")
    parser.add_argument("--expect", default="4\n", help="the stdout every run must print ('' for any)")
    parser.add_argument("--floor", action="store_true", help="measure benchmarks.floor beside the trees")
    parser.add_argument("--session", action="store_true", help="every run a cell of one session per tree")
    args = parser.parse_args()
    unwind_on_sigterm()
    trees: list[Path] = [tree.resolve() for tree in args.tree or [REPO]]
    names = [
        tree.name if [p.name for p in trees].count(tree.name) == 1 else f"{tree.name}{i}"
        for i, tree in enumerate(trees)
    ]
    work = Path(tempfile.mkdtemp(prefix="appliance-hotpath-"))
    targets: list[Target] = []
    try:
        for name, tree in zip(names, trees, strict=True):
            targets.append(start(name, tree, work))
        if args.floor:
            targets.append(start_floor(work))
        if args.session and args.floor:
            parser.error("--session: the floor has no sessions")
        asyncio.run(probe(targets, args.runs, args.code, args.expect or None, args.session))
    finally:
        for t in targets:
            t.server.stop()
        for t in targets:
            remove_group(t.cgroup)
        shutil.rmtree(work, ignore_errors=True)
    print(f"load average at the end: {os.getloadavg()[0]:.2f} (1 min)")
    print(report(targets))


if __name__ == "__main__":
    main()
