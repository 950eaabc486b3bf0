"""What a jail's start costs in CPU, A/B: the server's jails with firejail's per-jail
--private-etc copy against the same jails with the /etc the server prepared once
(`appliance.sandbox.etcdir`).

    python -m benchmarks.spawn_ab [--rounds N] [--out DIR]

One `JailFactory` configured as `appliance serve` would be (`open_factory`: a root server's
accounts and prepared /etc), each cycle one `launch()` (start firejail, the driver's start
and self-check) and `destroy()`, the two variants alternating cycle by cycle (the order
flipped every round) so that both meet the same load. A cycle's CPU is this process's own
(user + system, all threads) plus its reaped children's (firejail, its helpers, the jail):
on a shared machine the wall time is mostly waiting for a CPU, CPU time is the figure to
read. Spawn capacity on this machine follows from it: cores / CPU per spawn.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.appliance_server import BenchError
from benchmarks.jails import BenchJails, open_factory

VARIANTS = ("private-etc", "prepared-etc")


def _cpu_s() -> float:
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


async def _cycle(jails: BenchJails, variant: str, prepared: Path) -> tuple[float, float]:
    """One launch and destroy; (CPU ms, wall ms)."""
    jails.dirs.etc = prepared if variant == "prepared-etc" else None
    cpu0, t0 = _cpu_s(), time.perf_counter()
    jail = await jails.factory.launch()
    await jail.destroy()
    return (_cpu_s() - cpu0) * 1000, (time.perf_counter() - t0) * 1000


async def measure(rounds: int) -> dict[str, Any]:
    jails = await asyncio.to_thread(open_factory, {"SANDBOX_PRELOAD": ""})
    try:
        prepared = jails.dirs.etc
        if prepared is None:
            raise BenchError("no prepared /etc: the server prepares one only as root")
        samples: dict[str, dict[str, list[float]]] = {v: {"cpu_ms": [], "wall_ms": []} for v in VARIANTS}
        for variant in VARIANTS:  # one unmeasured start each: caches warm for both
            await _cycle(jails, variant, prepared)
        for i in range(rounds):
            for variant in VARIANTS if i % 2 == 0 else VARIANTS[::-1]:
                cpu, wall = await _cycle(jails, variant, prepared)
                samples[variant]["cpu_ms"].append(cpu)
                samples[variant]["wall_ms"].append(wall)
    finally:
        jails.close()
    cores = os.cpu_count() or 1
    summary = {
        v: {
            "cpu_ms": statistics.median(s["cpu_ms"]),
            "wall_ms": statistics.median(s["wall_ms"]),
            "capacity_per_s": cores * 1000 / statistics.median(s["cpu_ms"]),
        }
        for v, s in samples.items()
    }
    return {
        "rounds": rounds,
        "cores": cores,
        "load": os.getloadavg(),
        "summary": summary,
        "cpu_ratio": summary["private-etc"]["cpu_ms"] / summary["prepared-etc"]["cpu_ms"],
        "samples": samples,
    }


def markdown(result: dict[str, Any]) -> str:
    rows = [
        "| variant | CPU ms per spawn (median) | wall ms (median) | cores / CPU per spawn |",
        "| --- | --- | --- | --- |",
    ]
    for variant, s in result["summary"].items():
        rows.append(f"| {variant} | {s['cpu_ms']:.1f} | {s['wall_ms']:.1f} | {s['capacity_per_s']:.1f}/s |")
    load = ", ".join(f"{x:.1f}" for x in result["load"])
    rows.append("")
    rows.append(
        f"{result['rounds']} rounds, interleaved; CPU ratio private-etc / prepared-etc "
        f"{result['cpu_ratio']:.2f}; load average after: {load} on {result['cores']} cores"
    )
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None, help="write spawn_ab.json and spawn_ab.md here")
    args = parser.parse_args(argv)
    result = asyncio.run(measure(args.rounds))
    text = markdown(result)
    sys.stdout.write(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "spawn_ab.json").write_text(json.dumps(result, indent=1))
        (args.out / "spawn_ab.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
