"""Where a warm `print(2+2)` run's time goes inside the server: a timeline of its phases.

    python -m benchmarks.phases [--runs 100] [--code 'print(2+2)'] [--out FILE.md]

Starts one appliance whose server process marks, with a monotonic clock, where each run
passes: the frame read, the parse, the pool handout, the op written to the jail, each event
read back from it, the disk check (its bound on memfds, and its search for held files where
that bound does not settle it), each frame sent. One
run at a time, each after the pool is idle and SETTLE_S of quiet, as `python -m benchmarks`
does. The report gives the median time between consecutive marks, and the median whole
(frame read to `done` sent). The marks are wrappers around the named functions, installed
in the server process before it starts (`serve`, below). They are not free: here the 30
marks of a run added about 0.25 ms to its round trip (4.32 ms marked, 4.08 ms unmarked by
`python -m benchmarks.hotpath`, same machine, minutes apart), so the table is a map of the
path, not its exact cost: `python -m benchmarks` gives the round trip, `benchmarks.hotpath`
the CPU time. A py-spy profile of the same
path gets too few samples to read (the run is 3 ms of a poll loop); this is the profile.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
from benchmarks.hotpath import POOL_FLOOR, SETTLE_S

OUT_ENV = "APPLIANCE_PHASES_OUT"  # where the server writes its table on SIGUSR1

Marks = list[tuple[str, int]]


class Timeline:
    """The marks of the run in flight, and those of every finished run (server side)."""

    def __init__(self) -> None:
        self.current: Marks = []
        self.runs: list[Marks] = []

    def mark(self, label: str) -> None:
        self.current.append((label, time.perf_counter_ns()))

    def wrap(self, owner: Any, name: str, label: str) -> None:
        """Mark entry (`label>`) and exit (`label<`) of owner.name, a function or coroutine."""
        inner: Callable[..., Any] = getattr(owner, name)
        mark = self.mark
        if asyncio.iscoroutinefunction(inner):

            @functools.wraps(inner)
            async def timed_async(*args: Any, **kwargs: Any) -> Any:
                mark(f"{label}>")
                try:
                    return await inner(*args, **kwargs)
                finally:
                    mark(f"{label}<")

            setattr(owner, name, timed_async)
        else:

            @functools.wraps(inner)
            def timed(*args: Any, **kwargs: Any) -> Any:
                mark(f"{label}>")
                try:
                    return inner(*args, **kwargs)
                finally:
                    mark(f"{label}<")

            setattr(owner, name, timed)

    def table(self, skip: int = 1) -> str:
        """Median gap between consecutive marks, over the runs whose marks came in the same
        order as most runs' (a run that took another path, e.g. a cold jail, is left out)."""
        runs = self.runs[skip:]
        if not runs:
            return "no runs were marked\n"
        shapes: dict[tuple[str, ...], list[Marks]] = defaultdict(list)
        for run in runs:
            shapes[tuple(label for label, _ in run)].append(run)
        shape, same = max(shapes.items(), key=lambda item: len(item[1]))
        rows = [
            f"{len(same)} of {len(runs)} runs took this path; median µs between marks.",
            "",
            "| # | from | to | p50 µs |",
            "|---:|---|---|---:|",
        ]
        for i in range(1, len(shape)):
            gap = statistics.median((run[i][1] - run[i - 1][1]) / 1000 for run in same)
            rows.append(f"| {i} | `{shape[i - 1]}` | `{shape[i]}` | {gap:.0f} |")
        # Up to `done` sent: the marks after it (the run's end, the kill) are not the round trip.
        end = shape.index("send done<") if "send done<" in shape else len(shape) - 1
        whole = statistics.median((run[end][1] - run[0][1]) / 1000 for run in same)
        rows.append(f"| | **frame read** | **`done` sent** | **{whole:.0f}** |")
        return "\n".join(rows) + "\n"


def instrument(timeline: Timeline) -> None:
    """Install the marks in this (server) process."""
    from appliance.api import server, transport
    from appliance.core import service
    from appliance.sandbox import cell, outputs, process
    from appliance.sandbox import lease as jail_lease

    frame_in = server.Connection.handle_frame

    async def handle_frame(self: server.Connection, data: str | bytes) -> None:
        timeline.current = []
        timeline.mark("frame read")
        await frame_in(self, data)

    # A run's frames reach the socket as text, through its run log (appliance.api.runlog), so
    # the kind is read back from the text: the parse is outside the marked send.
    send = server.Connection.send_text

    async def timed_send(self: server.Connection, text: str) -> None:
        kind = str(json.loads(text).get("type"))
        timeline.mark(f"send {kind}>")
        await send(self, text)
        timeline.mark(f"send {kind}<")
        if kind == "done":
            timeline.runs.append(timeline.current)

    item_in = process.JailProcess.next

    async def timed_next(self: process.JailProcess) -> process.Item:
        item = await item_in(self)
        event = item.body.get("ev") if isinstance(item, process.Event) else None
        if event != "ready":  # a refilled pool jail starting, after the run: not on its path
            timeline.mark(f"read {type(item).__name__}" + (f" {event}" if event else ""))
        return item

    setattr(server.Connection, "handle_frame", handle_frame)  # noqa: B010 (mypy: no method assignment)
    setattr(server.Connection, "send_text", timed_send)  # noqa: B010
    setattr(process.JailProcess, "next", timed_next)  # noqa: B010
    timeline.wrap(transport.FrameParser, "parse", "parse")
    timeline.wrap(service.RunService, "execute", "execute")
    timeline.wrap(service.RunService, "_one_shot", "one-shot")
    timeline.wrap(jail_lease.PoolLease, "take", "pool take")
    timeline.wrap(process.JailProcess, "write", "op write")
    timeline.wrap(process.JailProcess, "signal_kill", "kill")
    timeline.wrap(cell, "disk_violation", "disk check")
    timeline.wrap(cell, "_memfds_fit", "memfd bound")
    timeline.wrap(cell, "held_bytes", "held files")
    timeline.wrap(outputs, "has_any", "outputs?")


def serve(argv: list[str]) -> int:
    """`appliance serve` with the marks in; SIGUSR1 writes the table to $APPLIANCE_PHASES_OUT."""
    from appliance.cli import main as cli_main

    timeline = Timeline()
    instrument(timeline)
    out = Path(os.environ[OUT_ENV])

    def dump(_signum: int, _frame: object) -> None:
        # Written beside and renamed: the client polls for the file, and must never read it
        # half written (a CI run read it empty under load).
        part = out.with_name(out.name + ".part")
        part.write_text(timeline.table())
        part.replace(out)

    signal.signal(signal.SIGUSR1, dump)
    return cli_main(argv)


async def probe(server: ApplianceServer, runs: int, code: str, table: Path) -> str:
    ws = await open_ws(server.url)
    wall: list[float] = []
    try:
        for i in range(runs + 1):  # the first is not warm (the table skips it too)
            await wait_pool_idle(server, POOL_FLOOR)
            await asyncio.sleep(SETTLE_S)
            t0 = time.perf_counter()
            reply = await execute(ws, f"p{i}", code)
            if i:
                wall.append((time.perf_counter() - t0) * 1000)
            if reply.status != "ok":
                raise BenchError(f"run {i} ended {reply.status}")
    finally:
        await ws.close()
    server.proc.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + 10
    while not await asyncio.to_thread(table.exists):
        if time.monotonic() > deadline:
            raise BenchError("the server wrote no table")
        await asyncio.sleep(0.05)
    marks = await asyncio.to_thread(table.read_text)
    return f"Round trip seen by the client: p50 {statistics.median(wall):.2f} ms over {len(wall)} runs.\n\n{marks}"


def commit() -> str:
    proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return proc.stdout.strip() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--code", default="print(2+2)")
    parser.add_argument("--out", type=Path, help="also write the report here (Markdown)")
    args = parser.parse_args()
    unwind_on_sigterm()
    work = Path(tempfile.mkdtemp(prefix="appliance-phases-"))
    table = work / "phases.md"
    # The server is this module's `serve`: the shell drops `-m appliance` from the command
    # appliance.runtime.local runs and starts this module with the rest of it.
    wrap = ["sh", "-c", 'shift 2; exec "$0" -m benchmarks.phases "$@"']
    try:
        started = local.start(work, {OUT_ENV: str(table)}, name="phases", wrap=wrap, timeout_s=120, cwd=REPO)
        server = ApplianceServer(started.proc, started.port, started.log, started.env, "phases")
        try:
            body = asyncio.run(probe(server, args.runs, args.code, table))
        finally:
            server.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    report = (
        f"# Phases of a warm `{args.code}` run\n\n"
        f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())} · commit {commit()} · "
        f"{os.cpu_count()} CPUs · load average after {load} · `python -m benchmarks.phases --runs {args.runs}`\n\n"
        f"{body}"
    )
    print(report)
    if args.out is not None:
        args.out.write_text(report)


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        sys.exit(serve(sys.argv[1:]))
    main()
