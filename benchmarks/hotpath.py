"""A probe of the warm hot path: `print(2+2)` round trips, with the CPU each one costs.

    python -m benchmarks.hotpath [--runs 200] [--tree DIR ...] [--code 'print(2+2)'] [--floor] [--session]
                                 [--throughput CLIENTS [--rounds 10] [--window 6]] [--json PATH]

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
`--throughput CLIENTS` then measures one-shot throughput the same way: in each of `--rounds`
rounds, every tree in a shuffled order gets a window of its own, with every pool full and idle
before it opens, in which CLIENTS connections send one-shot runs back to back; runs/s counts
the `done`s inside the window, after a warm-up that uses up the pool's stock (so it is what
the machine sustains: jail starts included). A round's ratio pairs windows taken seconds
apart, so the median of the per-round ratios holds while the load on the machine moves.
`--json PATH` writes every sample. Needs root (cgroups).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from websockets.asyncio.client import ClientConnection

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
from benchmarks.stats import median_ratio, percentile

CPUACCT = Path("/sys/fs/cgroup/cpuacct")
SETTLE_S = 0.1  # as benchmarks.suite: a warm jail has idled before its run
POOL_FLOOR = 2
WARMUP_S = 2.0  # of a throughput window: long enough to use up the pool's stock


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
    runs_per_s: list[float] = field(default_factory=list)  # one per throughput window

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


async def throughput(targets: list[Target], clients: int, rounds: int, window_s: float, code: str) -> None:
    """`rounds` rounds of one window per tree, in a shuffled order (see the module's doc)."""
    for r in range(rounds):
        order = list(targets)
        random.shuffle(order)
        for t in order:
            for other in targets:  # no refill of any server runs into the window
                await wait_pool_idle(other.server, POOL_FLOOR, timeout_s=120)
            t.runs_per_s.append(await window(t, clients, window_s, code, f"t{r}"))


async def window(t: Target, clients: int, window_s: float, code: str, tag: str) -> float:
    """Runs/s of one-shot `code` that `clients` connections sustain on t's server."""
    sockets = [await open_ws(t.server.url) for _ in range(clients)]
    finished: list[float] = []

    async def client(k: int, ws: ClientConnection) -> None:
        for i in itertools.count():
            reply = await execute(ws, f"{tag}-{k}-{i}", code)
            if reply.status != "ok":
                raise BenchError(f"{t.name}: a throughput run ended {reply.status}")
            finished.append(time.monotonic())

    tasks = [asyncio.create_task(client(k, ws)) for k, ws in enumerate(sockets)]
    try:
        # A benchmark's warm-up, not a synchronisation: the window opens after it either way.
        await asyncio.wait(tasks, timeout=WARMUP_S)
        opened = time.monotonic()
        await asyncio.wait(tasks, timeout=window_s)
        for task in tasks:
            if task.done():
                task.result()  # a failed run is an error of the benchmark, not a figure
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for ws in sockets:
            ws.transport.abort()  # a vanished client: the server cancels what it still queued
    return sum(opened <= at < opened + window_s for at in finished) / window_s


def report_throughput(targets: list[Target], clients: int, window_s: float) -> str:
    base = targets[0]
    rows = [
        f"| tree | windows of {window_s:g} s | runs/s at {clients} clients, median / mean "
        f"| per-round ratio to {base.name}: median [min, max] |",
        "| --- | --- | --- | --- |",
    ]
    for t in targets:
        ratios = [a / b for a, b in zip(t.runs_per_s, base.runs_per_s, strict=True) if b > 0]
        # A window in which the base finished nothing gives no ratio (a machine too busy for it).
        spread = f"{percentile(ratios, 50):.3f} [{min(ratios):.3f}, {max(ratios):.3f}]" if ratios else "n/a"
        rows.append(
            f"| {t.name} | {len(t.runs_per_s)} | {percentile(t.runs_per_s, 50):.2f} / "
            f"{sum(t.runs_per_s) / len(t.runs_per_s):.2f} | {spread} |"
        )
    return "\n".join(rows)


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
    base = targets[0]
    if len(targets) == 1:  # nothing to compare: no ratio table (an empty one ran into the next)
        return "\n".join(rows)
    rows += [
        "",
        f"| tree | p50 ratio to {base.name} [95% bootstrap interval]: wall | server CPU | cgroup CPU |",
        "| --- | --- | --- | --- |",
    ]
    for t in targets[1:]:
        cells = [median_ratio(getattr(t, f), getattr(base, f)) for f in ("wall_ms", "server_us", "group_us")]
        rows.append(
            f"| {t.name} | " + " | ".join(f"{r:.3f} [{lo:.3f}, {hi:.3f}]" for r, lo, hi in cells) + " |"
        )
    return "\n".join(rows)


def arguments() -> argparse.Namespace:
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
    parser.add_argument(
        "--throughput", type=int, default=0, metavar="CLIENTS", help="then one-shot throughput at CLIENTS"
    )
    parser.add_argument("--rounds", type=int, default=10, help="throughput windows per tree")
    parser.add_argument("--window", type=float, default=6.0, help="seconds of a throughput window")
    parser.add_argument("--json", type=Path, help="write every sample here")
    args = parser.parse_args()
    if args.throughput and args.floor:
        parser.error("--throughput: the floor has no pool to start jails from")
    if args.session and args.floor:
        parser.error("--session: the floor has no sessions")
    return args


def print_results(args: argparse.Namespace, targets: list[Target]) -> None:
    print(f"load average at the end: {os.getloadavg()[0]:.2f} (1 min)")
    if args.runs:
        print(report(targets))
    if args.throughput:
        print()  # a table ends at a blank line
        print(report_throughput(targets, args.throughput, args.window))
    if args.json:
        fields = ("wall_ms", "server_us", "group_us", "faults", "runs_per_s")
        samples = {t.name: {f: getattr(t, f) for f in fields} for t in targets}
        args.json.write_text(json.dumps(samples))


def main() -> None:
    args = arguments()
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
        if args.runs:
            asyncio.run(probe(targets, args.runs, args.code, args.expect or None, args.session))
        if args.throughput:
            asyncio.run(throughput(targets, args.throughput, args.rounds, args.window, args.code))
    finally:
        for t in targets:
            t.server.stop()
        for t in targets:
            remove_group(t.cgroup)
        shutil.rmtree(work, ignore_errors=True)
    print_results(args, targets)


if __name__ == "__main__":
    main()
