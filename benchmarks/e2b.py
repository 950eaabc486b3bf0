"""Create + first run through the E2B SDK, beside the native protocol, in one run.

    python -m benchmarks.e2b [--quick] [--out DIR]

One server; the two sides alternate, each sample taken with the warm pool full and idle:

- e2b: `AsyncSandbox.create()` then `run_code("print(2 + 2)")` (two HTTP calls: the
  sandbox's session is opened, then its first cell runs), the SDK's own client;
- native: on an open WebSocket, `{"session": "new", "code": "print(2 + 2)"}` to its `done`
  (one round trip opens the session and runs the cell).

Teardown (kill, close_session) is not timed. Published figures for comparison (E2B's cloud,
create to first command): median 0.44 s, p95 0.85 s. Writes e2b.json and e2b.md (quick:
e2b_quick.*) into --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from e2b_code_interpreter import AsyncSandbox

from benchmarks.appliance_server import REPO, BenchError, execute, open_ws, start_appliance, wait_pool_idle
from benchmarks.stats import summarize

RESULTS = REPO / "benchmarks" / "results"
CALLER = "any"  # the API key: the server has no token (as the native side), so any key is taken


def _commit() -> str:
    out = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=False
    )
    return out.stdout.strip() or "unknown"


async def sample(base: str, url: str, reps: int, server: Any) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"e2b": [], "native": []}
    ws = await open_ws(url)
    opts = {"api_key": CALLER, "api_url": base, "sandbox_url": base}
    try:
        for i in range(2 * reps):
            await wait_pool_idle(server, 1)
            if i % 2 == 0:
                t0 = time.perf_counter()
                sb = await AsyncSandbox.create(**opts)
                execution = await sb.run_code("print(2 + 2)")
                took = time.perf_counter() - t0
                await sb.kill()
                if execution.logs.stdout != ["4\n"]:
                    raise BenchError(f"the SDK's run printed {execution.logs.stdout!r}")
                out["e2b"].append(took * 1000)
            else:
                t0 = time.perf_counter()
                reply = await execute(ws, f"r{i}", "print(2 + 2)", session="new")
                took = time.perf_counter() - t0
                if reply.status != "ok" or reply.stdout != "4\n" or reply.session is None:
                    raise BenchError(f"the native run ended {reply.status}: {reply.stdout!r}")
                await ws.send(json.dumps({"type": "close_session", "id": f"c{i}", "session": reply.session}))
                while json.loads(await ws.recv()).get("id") != f"c{i}":
                    pass
                out["native"].append(took * 1000)
    finally:
        await ws.close()
    return out


def report(quick: bool, out_dir: Path, samples: dict[str, list[float]]) -> dict[str, Any]:
    s = {k: summarize(v) for k, v in samples.items()}
    doc: dict[str, Any] = {
        "quick": quick,
        "machine": platform.node(),
        "cpus": os.cpu_count(),
        "commit": _commit(),
        "load_average": " ".join(Path("/proc/loadavg").read_text().split()[:3]),
        "summary": {k: v.__dict__ for k, v in s.items()},
        "samples": samples,
        "ratio_p50": s["e2b"].p50_ms / s["native"].p50_ms,
    }
    name = "e2b_quick" if quick else "e2b"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(doc, indent=1))
    md = [
        f"# create + first run: E2B SDK beside the native protocol ({doc['cpus']} CPUs, commit "
        f"{doc['commit']}{', quick' if quick else ''}; load average {doc['load_average']})",
        "",
        "| what | n | p50 ms | p90 ms | p99 ms |",
        "| --- | --- | --- | --- | --- |",
        *(
            f"| {label} | {x.n} | {x.p50_ms:.1f} | {x.p90_ms:.1f} | {x.p99_ms:.1f} |"
            for label, x in (
                ("E2B SDK: AsyncSandbox.create + run_code", s["e2b"]),
                ('native: {"session": "new"} + its first cell, one WebSocket round trip', s["native"]),
            )
        ),
        "",
        f"E2B SDK / native (p50): {doc['ratio_p50']:.2f}x. E2B's cloud, published: median 440 ms, p95 850 ms.",
        "",
    ]
    (out_dir / f"{name}.md").write_text("\n".join(md))
    print("\n".join(md))
    return doc


async def main_async(quick: bool, out_dir: Path) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-e2b-") as tmp:
        server = await asyncio.to_thread(
            start_appliance, "e2b", Path(tmp), SANDBOX_PRELOAD="", SANDBOX_POOL_SIZE="2"
        )
        try:
            url = f"ws://127.0.0.1:{server.port}/exec"
            samples = await sample(f"http://127.0.0.1:{server.port}/e2b", url, 3 if quick else 30, server)
        finally:
            server.stop()
    return report(quick, out_dir, samples)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    asyncio.run(main_async(args.quick, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
