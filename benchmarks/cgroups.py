"""The cost of a cgroup per jail, side by side in one run (issue 13; target: under 5 ms a jail).

    python -m benchmarks.cgroups [--quick] [--out DIR]

Measured here, interleaved so the machine's load falls on both sides alike:

- spawn: `JailFactory.launch()` + `Jail.destroy()` of the same jail, alternately without and
  with its cgroup (made, limited, joined before firejail's first instruction, removed after);
- the cgroup's own part of that, without a jail around it: make + limit + open the join fds
  + remove an empty group (what every jail adds);
- the take path: a warm jail handed out (idle -> run limits: one write);
- the cell path: the counters read at a cell's start and end (and the peak reset);
- a warm `print(2+2)` end to end on two real servers, SANDBOX_CGROUPS=off and =require,
  alternately (each sample taken with the pool full and idle).

Writes cgroups.json and cgroups.md (quick: cgroups_quick.*) into --out (default
benchmarks/results).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from appliance.sandbox import cgroups
from appliance.sandbox.jail import JailFactory
from appliance_client.client import AsyncClient
from benchmarks.appliance_server import REPO, BenchError, start_appliance, wait_pool_idle
from benchmarks.jails import open_factory
from benchmarks.stats import summarize

RESULTS = REPO / "benchmarks" / "results"
TARGET_MS = 5.0


def _commit() -> str:
    out = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=False
    )
    return out.stdout.strip() or "unknown"


def _micro(fn: Any, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1000)
    return out


def group_costs(tree: cgroups.Hierarchy, limits: cgroups.GroupLimits, n: int) -> dict[str, list[float]]:
    """Per-jail cgroup work without a jail: the group's life, a handout, one cell's reads."""

    def life() -> None:
        g = tree.group("b-" + secrets.token_hex(6), limits.idle())
        g.remove()

    g = tree.group("b-" + secrets.token_hex(6), limits.idle())
    try:
        flip = [limits.idle(), limits]

        def handout() -> None:
            g.set_limits(flip[1])
            flip.reverse()

        def cell() -> None:
            base = g.counters(pids=False)  # as appliance.sandbox.cell does
            g.reset_peak()
            g.counters(pids=False), g.peak_mb(), base

        return {"group_life": _micro(life, n), "handout": _micro(handout, n), "cell": _micro(cell, n)}
    finally:
        g.remove()


async def spawn_side_by_side(plain: JailFactory, grouped: JailFactory, reps: int) -> dict[str, list[float]]:
    """launch, and destroy, alternating without / with the cgroup (destroy is a teardown that
    runs after the run's `done`; launch is on a cold start's path)."""
    out: dict[str, list[float]] = {"without": [], "with": [], "destroy_without": [], "destroy_with": []}
    for i in range(2 * reps):
        key, factory = ("without", plain) if i % 2 == 0 else ("with", grouped)
        t0 = time.perf_counter()
        jail = await factory.launch()
        t1 = time.perf_counter()
        await jail.destroy()
        out[key].append((t1 - t0) * 1000)
        out[f"destroy_{key}"].append((time.perf_counter() - t1) * 1000)
        if key == "with" and jail.cgroup is None:
            raise BenchError("the grouped factory made a jail without a cgroup")
    return out


async def warm_side_by_side(work: Path, reps: int) -> dict[str, list[float]]:
    """Warm print(2+2), request to done, alternating a server without and one with cgroups."""
    servers = {
        k: start_appliance(
            f"cg-{k}", work / k, SANDBOX_CGROUPS=mode, SANDBOX_PRELOAD="", SANDBOX_POOL_SIZE="1"
        )
        for k, mode in (("warm_without", "off"), ("warm_with", "require"))
    }
    out: dict[str, list[float]] = {k: [] for k in servers}
    try:
        for _ in range(reps):
            for key, srv in servers.items():
                for each in servers.values():  # neither server's refill may compete with the sample
                    await wait_pool_idle(each, 1)
                async with AsyncClient(srv.url) as c:
                    t0 = time.perf_counter()
                    ex = await c.execute("print(2+2)")
                    out[key].append((time.perf_counter() - t0) * 1000)
                if ex.stdout != "4\n":
                    raise BenchError(f"{key}: print(2+2) gave {ex.status} {ex.stdout!r}")
    finally:
        for srv in servers.values():
            srv.stop()
    return out


async def main_async(quick: bool, out_dir: Path) -> dict[str, Any]:
    tree, missing = cgroups.detect()
    if tree is None:
        raise BenchError("no writable cgroup hierarchy: " + "; ".join(missing))
    tree.prepare()
    jails = await asyncio.to_thread(open_factory, {"SANDBOX_PRELOAD": ""})
    try:
        f = jails.factory
        grouped = JailFactory(f.settings, f.host, f.runtime, f.dirs, cgroups=tree)
        costs = group_costs(tree, grouped.run_limits, 30 if quick else 300)
        spawn = await spawn_side_by_side(f, grouped, 2 if quick else 8)
    finally:
        jails.close()
        tree.close()
    with tempfile.TemporaryDirectory(prefix="bench-cgroups-") as work:
        spawn.update(await warm_side_by_side(Path(work), 3 if quick else 20))
    return await asyncio.to_thread(report, quick, out_dir, tree.version, costs, spawn)


def report(
    quick: bool, out_dir: Path, version: int, costs: dict[str, list[float]], spawn: dict[str, list[float]]
) -> dict[str, Any]:
    """Summaries, cgroups.json and cgroups.md (quick: cgroups_quick.*); printed too."""
    spawn = {k if k.startswith("warm") else f"spawn_{k}": v for k, v in spawn.items()}
    s = {k: summarize(v) for k, v in {**costs, **spawn}.items()}
    doc: dict[str, Any] = {
        "quick": quick,
        "machine": platform.node(),
        "cpus": os.cpu_count(),
        "commit": _commit(),
        "load_average": " ".join(Path("/proc/loadavg").read_text().split()[:3]),
        "cgroup_version": version,
        "target_ms": TARGET_MS,
        "summary": {k: v.__dict__ for k, v in s.items()},
        "samples": {**costs, **spawn},
        "warm_delta_p50_ms": s["warm_with"].p50_ms - s["warm_without"].p50_ms,
        "spawn_delta_p50_ms": s["spawn_with"].p50_ms - s["spawn_without"].p50_ms,
        "destroy_delta_p50_ms": s["spawn_destroy_with"].p50_ms - s["spawn_destroy_without"].p50_ms,
        "group_life_p50_ms": s["group_life"].p50_ms,
        "within_target": s["group_life"].p50_ms < TARGET_MS,
    }
    name = "cgroups_quick" if quick else "cgroups"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(doc, indent=1))
    rows = [
        ("jail launch, without cgroup", s["spawn_without"]),
        ("jail launch, with cgroup", s["spawn_with"]),
        ("jail destroy (after done), without cgroup", s["spawn_destroy_without"]),
        ("jail destroy (after done), with cgroup", s["spawn_destroy_with"]),
        ("cgroup per jail (make, limit, join fds, remove)", s["group_life"]),
        ("take path: idle -> run limits", s["handout"]),
        ("cell path: counters at start and end", s["cell"]),
        ("warm print(2+2), SANDBOX_CGROUPS=off", s["warm_without"]),
        ("warm print(2+2), SANDBOX_CGROUPS=require", s["warm_with"]),
    ]
    md = [
        f"# cgroup per jail (cgroup v{version}, {doc['cpus']} CPUs, commit {doc['commit']}"
        f"{', quick' if quick else ''}; load average {doc['load_average']})",
        "",
        "| what | n | p50 ms | p90 ms |",
        "| --- | --- | --- | --- |",
    ]
    md += [f"| {label} | {x.n} | {x.p50_ms:.3f} | {x.p90_ms:.3f} |" for label, x in rows]
    md += [
        "",
        f"Launch with minus without (p50): {doc['spawn_delta_p50_ms']:.1f} ms, destroy: "
        f"{doc['destroy_delta_p50_ms']:.1f} ms; the cgroup's own work "
        f"per jail: {doc['group_life_p50_ms']:.2f} ms (target < {TARGET_MS} ms: "
        f"{'met' if doc['within_target'] else 'NOT met'}); warm print(2+2) with minus without "
        f"(p50): {doc['warm_delta_p50_ms']:.2f} ms.",
    ]
    (out_dir / f"{name}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return doc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=Path, default=RESULTS)
    a = p.parse_args(argv)
    try:
        asyncio.run(main_async(a.quick, a.out))
    except BenchError as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
