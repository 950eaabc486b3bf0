"""What a flow's name resolution costs the egress proxy with the host resolver (no
`SANDBOX_EGRESS_DNS`): asked on every flow (HOST_CACHE_S 0, as before answers were kept)
against a kept answer (appliance.sandbox.egressresolve.HOST_CACHE_S).

    python -m benchmarks.egress_resolve [--n N] [--rounds R]

Resolves `localhost` (the host's /etc/hosts: no network) N times a round through the
proxy's Resolver, the two ways alternating; wall time per call (p50) and this process's CPU
per call (the executor's thread included).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

from appliance.sandbox import egressresolve
from appliance.sandbox.egressresolve import Resolver


async def measure(n: int, rounds: int) -> dict[str, list[tuple[float, float]]]:
    got: dict[str, list[tuple[float, float]]] = {"asked each flow": [], "kept": []}
    kept_s = egressresolve.HOST_CACHE_S
    try:
        for r in range(rounds):
            for way in list(got) if r % 2 == 0 else list(reversed(got)):
                egressresolve.HOST_CACHE_S = kept_s if way == "kept" else 0.0
                resolver = Resolver()
                walls: list[float] = []
                cpu = time.process_time()
                for _ in range(n):
                    t = time.perf_counter()
                    await resolver.resolve("localhost")
                    walls.append((time.perf_counter() - t) * 1e6)
                got[way].append((statistics.median(walls), (time.process_time() - cpu) * 1e6 / n))
    finally:
        egressresolve.HOST_CACHE_S = kept_s
    return got


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.egress_resolve")
    parser.add_argument("--n", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args(argv)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    got = asyncio.run(measure(args.n, args.rounds))
    lines = [
        f"the host resolver, {args.n} lookups of localhost a round, {args.rounds} rounds; load {load}",
        "",
        "| way | wall per lookup, p50 of rounds (us) | CPU per lookup, p50 of rounds (us) |",
        "| --- | --- | --- |",
    ]
    for way, rows in got.items():
        wall = statistics.median(w for w, _ in rows)
        cpu = statistics.median(c for _, c in rows)
        lines.append(f"| {way} | {wall:.1f} | {cpu:.1f} |")
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
