"""The cost of a uid per jail and of its per-namespace caps, side by side in one run.

    python -m benchmarks.uids [--quick] [--out DIR]

Measured here, interleaved so the machine's load falls on both sides alike:

- spawn: `JailFactory.launch()` (to a ready, capped jail) and `Jail.destroy()`, alternately
  with every jail on the shared SANDBOX_UID and with a uid of its own from SANDBOX_UID_RANGE
  (taken: one scan of /proc and a flock; given back after destroy: another scan);
- the uid's own part of that, without a jail: `Uids.take` and `Uids.give_back`;
- the per-namespace caps (`nslimits.cap_jail`, every jail pays it): the helper run again on
  a live jail.

A warm jail's handout does none of this: the uid is taken and the caps written when the
jail is made, in the pool's refill, before any run asks for it.

Writes uids.json and uids.md (quick: uids_quick.*) into --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from appliance.sandbox import nslimits, uids
from appliance.sandbox.jail import JailFactory
from benchmarks.appliance_server import REPO, BenchError
from benchmarks.jails import open_factory
from benchmarks.stats import summarize

RESULTS = REPO / "benchmarks" / "results"


def _commit() -> str:
    out = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=False
    )
    return out.stdout.strip() or "unknown"


async def spawn_side_by_side(factory: JailFactory, own: uids.Uids, reps: int) -> dict[str, list[float]]:
    """launch, and destroy, alternating the shared uid and a uid of the jail's own."""
    out: dict[str, list[float]] = {k: [] for k in ("shared", "own", "destroy_shared", "destroy_own", "cap")}
    for i in range(2 * reps):
        key = "shared" if i % 2 == 0 else "own"
        factory.uids = own if key == "own" else None
        t0 = time.perf_counter()
        jail = await factory.launch()
        t1 = time.perf_counter()
        if key == "own" and jail.uid == factory.host.uid:
            await jail.destroy()
            raise BenchError("the jail did not get a uid of its own")
        inits = jail.process.inits()
        t2 = time.perf_counter()
        why = await nslimits.cap_jail(inits[0]) if inits else "no init"
        t3 = time.perf_counter()
        await jail.destroy()
        if why is not None:
            raise BenchError(f"the jail could not be capped: {why}")
        out[key].append((t1 - t0) * 1000)
        out[f"destroy_{key}"].append((time.perf_counter() - t3) * 1000)
        out["cap"].append((t3 - t2) * 1000)
    return out


def uid_costs(own: uids.Uids, n: int) -> dict[str, list[float]]:
    """Uids.take and Uids.give_back alone (no process of the uid runs)."""
    take: list[float] = []
    give: list[float] = []
    for _ in range(n):
        t0 = time.perf_counter()
        held = own.take()
        t1 = time.perf_counter()
        if held is None:
            raise BenchError("no uid of the range was free")
        own.give_back(held)
        take.append((t1 - t0) * 1000)
        give.append((time.perf_counter() - t1) * 1000)
    return {"take": take, "give_back": give}


async def main_async(quick: bool, out_dir: Path) -> dict[str, Any]:
    jails = await asyncio.to_thread(open_factory, {"SANDBOX_PRELOAD": ""})
    try:
        f = jails.factory
        first, last = f.settings.uid_range
        candidates, _ = uids.usable(first, last, f.host.uid)
        if not candidates:
            raise BenchError(f"SANDBOX_UID_RANGE {first}-{last} holds no uid besides SANDBOX_UID")
        # As a root server does (`RunDirs.prepare`, in `open_factory`): every jail gets its minimal
        # accounts, so both sides pay the same launcher; only the uid differs.
        own = uids.Uids(f.settings.tmp_root, f.host.uid, f.host.gid, candidates)
        own.prepare()
        samples = await spawn_side_by_side(f, own, 3 if quick else 20)
        samples.update(uid_costs(own, 10 if quick else 100))
        own.close()
    finally:
        jails.close()
    return await asyncio.to_thread(report, quick, out_dir, samples)


def report(quick: bool, out_dir: Path, samples: dict[str, list[float]]) -> dict[str, Any]:
    """Summaries, uids.json and uids.md (quick: uids_quick.*); printed too."""
    s = {k: summarize(v) for k, v in samples.items()}
    doc: dict[str, Any] = {
        "quick": quick,
        "machine": platform.node(),
        "cpus": os.cpu_count(),
        "commit": _commit(),
        "processes": sum(1 for e in os.listdir("/proc") if e.isdigit()),
        "load_average": " ".join(Path("/proc/loadavg").read_text().split()[:3]),
        "summary": {k: v.__dict__ for k, v in s.items()},
        "samples": samples,
        "spawn_delta_p50_ms": s["own"].p50_ms - s["shared"].p50_ms,
        "spawn_ratio_p50": s["own"].p50_ms / s["shared"].p50_ms,
        "destroy_delta_p50_ms": s["destroy_own"].p50_ms - s["destroy_shared"].p50_ms,
        "cap_p50_ms": s["cap"].p50_ms,
    }
    name = "uids_quick" if quick else "uids"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(doc, indent=1))
    rows = [
        ("jail launch (ready, capped), shared SANDBOX_UID", s["shared"]),
        ("jail launch (ready, capped), a uid of its own", s["own"]),
        ("jail destroy, shared SANDBOX_UID", s["destroy_shared"]),
        ("jail destroy, a uid of its own (given back)", s["destroy_own"]),
        ("Uids.take (scan /proc, flock)", s["take"]),
        ("Uids.give_back (scan /proc, unlock)", s["give_back"]),
        ("nslimits.cap_jail (helper joins the jail's user namespace)", s["cap"]),
    ]
    md = [
        f"# a uid per jail ({doc['cpus']} CPUs, {doc['processes']} processes, commit {doc['commit']}"
        f"{', quick' if quick else ''}; load average {doc['load_average']})",
        "",
        "| what | n | p50 ms | p90 ms |",
        "| --- | --- | --- | --- |",
    ]
    md += [f"| {label} | {x.n} | {x.p50_ms:.3f} | {x.p90_ms:.3f} |" for label, x in rows]
    md += [
        "",
        f"Launch with a uid of its own minus shared (p50): {doc['spawn_delta_p50_ms']:.1f} ms "
        f"(x{doc['spawn_ratio_p50']:.2f}); destroy: {doc['destroy_delta_p50_ms']:.1f} ms; the caps "
        f"every jail gets: {doc['cap_p50_ms']:.1f} ms (p50). A warm jail's handout pays none of it.",
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
