"""A flame graph of the warm hot path: py-spy records the server while one client sends
`print(2+2)` runs one at a time, each in a fresh warm jail, with time between them for the
pool to refill (the refill shows in the graph: it is part of what each run costs).

    python -m benchmarks.flame [--runs 200] [--out benchmarks/results/flame-warm-print.svg]

Needs root (py-spy attaches to the server) and py-spy (`pip install py-spy`, the `bench`
extra). The graph shows where the server's side of a round trip goes; the jail's side
(the driver) runs as another user in another PID namespace and is left out.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.appliance_server import (
    REPO,
    ApplianceServer,
    BenchError,
    execute,
    open_ws,
    start_appliance,
    wait_pool_idle,
)

DEFAULT_OUT = REPO / "benchmarks" / "results" / "flame-warm-print.svg"


async def drive(server: ApplianceServer, runs: int) -> list[float]:
    """Send `runs` one-shot print(2+2) runs, 0.6 s apart; their round trips in ms."""
    times = []
    ws = await open_ws(server.url)
    try:
        for i in range(runs):
            # Time for the pool to refill between runs (no /metrics polling: the scrape would
            # be most of what the graph shows); the refill itself is a cost of each run.
            await asyncio.sleep(0.6)
            t0 = time.perf_counter()
            reply = await execute(ws, f"r{i}", "print(2+2)")
            times.append((time.perf_counter() - t0) * 1000)
            if reply.status != "ok" or reply.stdout != "4\n":
                raise BenchError(f"run {i}: {reply.status} {reply.stdout!r}")
    finally:
        await ws.close()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    spy = shutil.which("py-spy", path=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    if spy is None:
        raise SystemExit("py-spy is not installed: pip install py-spy (the bench extra)")
    work = Path(tempfile.mkdtemp(prefix="appliance-flame-"))
    server = start_appliance("flame", work, SANDBOX_POOL_SIZE="4")
    try:
        asyncio.run(wait_pool_idle(server, 4))
        rec = subprocess.Popen(
            [
                spy,
                "record",
                "--pid",
                str(server.proc.pid),
                "--rate",
                "250",
                "--format",
                os.environ.get("FLAME_FORMAT", "flamegraph"),
                "--output",
                str(args.out),
                "--nonblocking",
            ]
        )
        time.sleep(1.0)  # py-spy attaches before the first sample we want
        times = asyncio.run(drive(server, args.runs))
        rec.send_signal(2)  # SIGINT: py-spy writes the graph and exits
        rec.wait(60)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    times.sort()
    print(f"{args.runs} runs, p50 {times[len(times) // 2]:.2f} ms; flame graph: {args.out}")


if __name__ == "__main__":
    main()
