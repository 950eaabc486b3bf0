"""What the run's sized tmpfs costs: per jail started and per MiB written, side by side per tree.

    python -m benchmarks.diskfs [--runs 15] [--tree DIR ...] [--mib 64]

Starts one appliance per `--tree` (a checkout; default: this one) with no warm pool, so every
run starts a jail of its own (the cost of making, sizing and removing its writable space is
in each), and sends them the same runs in turn, interleaved in a random order each round:

  * `spawn`: `pass` in a fresh jail: a jail's whole life (directory and mounts, firejail, the
    driver's ready, the checks as the cell ends, removal);
  * `write`: the same, writing `--mib` MiB to /workspace in 1 MiB writes;
  * `files`: the same, leaving 2000 empty files (what the disk check as the cell ends looks at).

For each tree and case it reports the wall time from the frame sent to `done` (p50) and the
server process's own CPU time in that window (its threads' schedstat), and per MiB written
(write minus spawn, over `--mib`). Needs root (the servers mount, as in production).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from appliance.runtime import local
from benchmarks.appliance_server import REPO, BenchError, execute, open_ws, unwind_on_sigterm
from benchmarks.hotpath import thread_ns
from benchmarks.stats import percentile

ENV = {
    "SANDBOX_POOL_SIZE": "0",
    "SANDBOX_PRELOAD": "",
    "SANDBOX_MAX_DISK_MB": "256",
    "SANDBOX_MEMORY_MB": "1024",
    "SANDBOX_MAX_EXEC_MS": "60000",
}


def cases(mib: int) -> dict[str, str]:
    return {
        "spawn": "pass",
        "write": f"b = b'w' * (1 << 20)\nwith open('w.bin', 'wb') as fh:\n    for _ in range({mib}):\n        fh.write(b)",
        "files": "for i in range(2000):\n    open(f'f{i}', 'w').close()",
    }


@dataclass
class Target:
    name: str
    commit: str
    server: local.LocalServer
    wall_ms: dict[str, list[float]] = field(default_factory=dict)
    cpu_ms: dict[str, list[float]] = field(default_factory=dict)


def commit_of(tree: Path) -> str:
    out = subprocess.run(
        ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    )
    dirty = subprocess.run(
        ["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
        check=False,
    )
    return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


async def probe(targets: list[Target], runs: int, mib: int) -> None:
    code = cases(mib)
    sockets = {t.name: await open_ws(t.server.url) for t in targets}
    for t in targets:  # one unmeasured run each: the first of a connection is not typical
        await execute(sockets[t.name], "warmup", "pass")
    for i in range(runs):
        order = [(t, case) for t in targets for case in code]
        random.shuffle(order)
        for t, case in order:
            pid = t.server.proc.pid
            cpu0, t0 = thread_ns(pid), time.perf_counter()
            reply = await execute(sockets[t.name], f"{case}{i}", code[case])
            t1, cpu1 = time.perf_counter(), thread_ns(pid)
            if reply.status != "ok":
                raise BenchError(f"{t.name}: {case} run {i} ended {reply.status}")
            t.wall_ms.setdefault(case, []).append((t1 - t0) * 1000)
            t.cpu_ms.setdefault(case, []).append((cpu1 - cpu0) / 1e6)
    for ws in sockets.values():
        await ws.close()


def summary(targets: list[Target], mib: int) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for t in targets:
        row = {f"{case} wall p50 ms": percentile(v, 50) for case, v in t.wall_ms.items()}
        row |= {f"{case} server CPU p50 ms": percentile(v, 50) for case, v in t.cpu_ms.items()}
        row["wall ms per MiB written"] = (row["write wall p50 ms"] - row["spawn wall p50 ms"]) / mib
        out[f"{t.name} ({t.commit})"] = row
    return out


def report(table: dict[str, dict[str, float]], runs: int, mib: int) -> str:
    names = list(table)
    keys = list(table[names[0]])
    lines = [
        f"{runs} rounds, each case once per tree per round in a random order; {mib} MiB written; "
        "no warm pool (every run starts its own jail).",
        "",
        "| figure | " + " | ".join(names) + (" | ratio (last / first) |" if len(names) > 1 else ""),
        "| --- | " + " | ".join("---" for _ in names) + (" | --- |" if len(names) > 1 else ""),
    ]
    for key in keys:
        values = [table[n][key] for n in names]
        ratio = (
            f" | {values[-1] / values[0]:.2f} |"
            if len(names) > 1 and values[0]
            else (" | |" if len(names) > 1 else "")
        )
        lines.append(f"| {key} | " + " | ".join(f"{v:.2f}" for v in values) + ratio)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument(
        "--tree", type=Path, action="append", help="a checkout to start a server from (repeat)"
    )
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    unwind_on_sigterm()
    trees: list[Path] = [tree.resolve() for tree in args.tree or [REPO]]
    work = Path(tempfile.mkdtemp(prefix="appliance-diskfs-"))
    targets: list[Target] = []
    try:
        for i, tree in enumerate(trees):
            name = f"{tree.name}{i}" if [p.name for p in trees].count(tree.name) > 1 else tree.name
            env = dict(ENV)
            try:
                server = local.start(work / name, env, name=name, timeout_s=120, cwd=tree)
            except local.ServerStartError as exc:
                raise BenchError(str(exc)) from exc
            targets.append(Target(name, commit_of(tree), server))
        asyncio.run(probe(targets, args.runs, args.mib))
    finally:
        for t in targets:
            t.server.stop()
        shutil.rmtree(work, ignore_errors=True)
    table = summary(targets, args.mib)
    if args.json is not None:
        args.json.write_text(json.dumps(table, indent=2) + "\n")
    print(report(table, args.runs, args.mib))


if __name__ == "__main__":
    main()
