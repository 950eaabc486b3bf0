"""GPU contention with and without MPS limits, side by side in one run (simulated devices).

    python -m benchmarks.gpu_mps_contention

Two real appliances, one after the other, each with one simulated 16 GiB GPU and a
simulated MPS daemon, run the contention mix of `benchmarks.gpu_contention` (N = 1..16)
through real jails and real WebSockets, with one llama replaced by a runaway that asks for
3.5 GiB and allocates 12 GiB (enough to fill the device under its neighbours). Each run allocates its memory through libcuda
(a stand-in compiled from tests/stub_libcuda.c, the only simulated part besides the GPU):

- "watchdog only": the daemon ignores limits, so the startup probe reports MPS as not
  enforcing; an overrunning run gets its memory and is killed by the watchdog at its next
  poll (`gpu_memory_limit`);
- "watchdog + MPS": the probe proves the limits; every run is armed with its budget, and
  the overrunner's allocation is refused inside the run (`budget_refused`): it never holds
  memory past its budget.

Both run on a simulated host where nothing stands in a jailed client's way (EXCLUSIVE_PROCESS
compute mode, and the daemon's shared memory in its pipe directory, which jails see): no
real MPS daemon is that today (its clients need /dev/shm, which GPU jails do not get), so on
a real GPU layer (b) reads "not enforcing" and only the first configuration applies.

Run time is counted from the run's start (done.duration_ms minus the queue wait).

Printed at the end: outcomes per configuration, how long the overrunner held memory
past its budget (watchdog: until the kill; MPS: never granted), and the cost of arming
(run time p50 with MPS / without). Results: benchmarks/results/gpu_mps_contention_simulated.*
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.appliance_server import REPO, BenchError, start_appliance
from benchmarks.gpu_contention import (
    DEVICE_MB,
    LEVELS,
    MARGIN_MB,
    MIX,
    OVERRUNNERS,
    RESULTS,
    RunRecord,
    outcomes_text,
    pct,
    pyplot,
    readyz_sampler,
    run_meta,
    server_level,
    summarise,
)

POLL_MS = 250
# The shared mix with one llama replaced by a runaway (3.5 GiB budget, allocates 12 GiB).
MIX_MPS = [MIX[0], MIX[1], ("llama-runaway", 3584, 12288, 2.0), *MIX[3:]]
CONFIGS = (("watchdog only", "ignore-limits", False), ("watchdog + MPS", "on", True))


def build_stub(root: Path) -> Path:
    if shutil.which("gcc") is None:
        raise BenchError("gcc is needed to build the stand-in libcuda (tests/stub_libcuda.c)")
    lib = root / "libcuda.so.1"
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-O1", "-o", str(lib), str(REPO / "tests" / "stub_libcuda.c")], check=True
    )
    return lib


async def run_config(  # noqa: PLR0913 (one benchmark configuration's parameters)
    label: str,
    simulate: str,
    enforcing: bool,
    root: Path,
    lib: Path,
    samples: list[dict[str, Any]],
    levels: tuple[int, ...],
) -> list[RunRecord]:
    slug = simulate.replace("-", "_")
    host = root / f"host-{slug}.json"  # the simulated host: see the module docstring
    host.write_text(json.dumps({"compute_mode": {"0": "EXCLUSIVE_PROCESS"}, "mps_shm": "pipe_dir"}))
    server = start_appliance(
        f"mps-{slug}",
        root / "srv",
        SANDBOX_GPU="1",
        SANDBOX_GPU_BACKEND="simulated",
        SANDBOX_GPU_SIMULATE=str(DEVICE_MB),
        SANDBOX_GPU_SIMULATE_MPS=simulate,
        SANDBOX_GPU_SIMULATE_FILE=str(host),
        SANDBOX_GPU_MPS_PIPE_DIR=str(root / f"pipe-{slug}"),
        SANDBOX_GPU_LIBCUDA=str(lib),
        SANDBOX_GPU_MARGIN_MB=str(MARGIN_MB),
        SANDBOX_GPU_POLL_MS=str(POLL_MS),
        SANDBOX_PRELOAD="",
        SANDBOX_POOL_SIZE="2",
        SANDBOX_MAX_CONCURRENCY="16",
        SANDBOX_MAX_EXEC_MS="60000",
        SANDBOX_MEMORY_MB="2048",
        SANDBOX_GPU_QUEUE_MS="120000",
    )
    try:
        mps = json.loads(server.get("/readyz")[1])["gpu"]["mps"]
        if mps["enforcing"] is not enforcing:
            raise BenchError(f"{label}: expected MPS enforcing={enforcing}, /readyz says {mps}")
        records: list[RunRecord] = []
        sampler = readyz_sampler(f"http://127.0.0.1:{server.port}")
        for n in levels:
            level = await server_level(
                server.url, n, samples, 1.0, sampler=sampler, mix=MIX_MPS, limits_enforced=enforcing
            )
            for s in samples:
                s.setdefault("config", label)
            records += level
            print(label, json.dumps(summarise(level)[0]))
        return records
    finally:
        server.stop()


def overrun_ms(records: list[RunRecord]) -> list[float]:
    """How long each overrunner could hold memory past its budget: from its start to the kill
    (an upper bound: it allocates shortly after starting), or never (refused)."""
    return [r.run_ms if r.outcome == "gpu_memory_limit" else 0.0 for r in records if r.kind in OVERRUNNERS]


def write(  # noqa: PLR0913 (the results and their labels)
    out: Path,
    name: str,
    results: dict[str, list[RunRecord]],
    samples: list[dict[str, Any]],
    lines: list[str],
    levels: tuple[int, ...],
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    meta = run_meta(MIX_MPS, levels, poll_ms=POLL_MS)
    (out / f"{name}.json").write_text(
        json.dumps(
            {
                "meta": meta,
                "summary": {k: summarise(v) for k, v in results.items()},
                "runs": {k: [asdict(r) for r in v] for k, v in results.items()},
                "samples": samples,
            },
            indent=1,
        )
    )
    md = [
        "# GPU contention with and without MPS limits (simulated devices, real appliance)",
        "",
        f"Device {DEVICE_MB} MiB, margin {MARGIN_MB} MiB, watchdog poll {POLL_MS} ms; {meta['machine']}; "
        f"{meta['when']}. `python -m benchmarks.gpu_mps_contention`.",
        "",
        "| config | N | outcomes | queue p50/p95 (ms) | run p50/p95 (ms) |",
        "|---|---|---|---|---|",
    ]
    for label, records in results.items():
        for row in summarise(records):
            md.append(
                f"| {label} | {row['n']} | {outcomes_text(row)} | {row['queue_p50_ms']}/{row['queue_p95_ms']} | "
                f"{row['run_p50_ms']}/{row['run_p95_ms']} |"
            )
    md += ["", *[f"- {line}" for line in lines]]
    (out / f"{name}.md").write_text("\n".join(md) + "\n")
    plt = pyplot()
    if plt is None:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for label, records in results.items():
        rows = summarise(records)
        ax1.plot(
            [r["n"] for r in rows], [r["run_p50_ms"] for r in rows], marker="o", label=f"{label}: run p50"
        )
        ax1.plot(
            [r["n"] for r in rows],
            [r["queue_p95_ms"] for r in rows],
            marker="x",
            linestyle="--",
            label=f"{label}: queue p95",
        )
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("concurrent runs (N)")
    ax1.set_ylabel("ms")
    ax1.legend(fontsize=8)
    kinds = ("ok", "gpu_memory_limit", "budget_refused", "oom", "rejected")
    width = 0.38
    for k, (label, records) in enumerate(results.items()):
        counts = [sum(1 for r in records if r.outcome == kind) for kind in kinds]
        ax2.bar([i + k * width for i in range(len(kinds))], counts, width, label=label)
    ax2.set_xticks([i + width / 2 for i in range(len(kinds))], kinds, fontsize=8, rotation=15)
    ax2.set_title("outcomes, all N together")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=100)


async def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="N = 1 and 4 only (a smoke run, ~10 s)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the results go")
    args = parser.parse_args()
    levels = (1, 4) if args.quick else LEVELS
    name = "gpu_mps_contention_simulated" + ("_quick" if args.quick else "")
    root = Path(tempfile.mkdtemp(prefix="appliance-mps-bench-", dir="/tmp"))
    os.chmod(root, 0o755)  # the sandbox uid reads the stand-in libcuda from here
    try:
        lib = build_stub(root)
        samples: list[dict[str, Any]] = []
        results = {
            label: await run_config(label, sim, enforcing, root, lib, samples, levels)
            for label, sim, enforcing in CONFIGS
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    (plain, plain_runs), (armed, armed_runs) = results.items()
    neighbours = {label: sum(1 for r in runs if r.outcome == "oom") for label, runs in results.items()}
    over_plain, over_armed = overrun_ms(plain_runs), overrun_ms(armed_runs)
    gpu_ok = {
        label: [r.run_ms for r in runs if r.outcome == "ok" and r.budget_mb]
        for label, runs in results.items()
    }
    p50_plain, p50_armed = pct(gpu_ok[plain], 50), pct(gpu_ok[armed], 50)
    lines = [
        f"overrunning runs held memory past their budget for at most p50 {pct(over_plain, 50):.0f} ms / max "
        f"{max(over_plain, default=0):.0f} ms ({plain}) vs {max(over_armed, default=0):.0f} ms ({armed}: "
        f"the allocation is refused, {sum(1 for r in armed_runs if r.outcome == 'budget_refused')} runs)",
        f"neighbours out of memory: {neighbours[plain]} ({plain}), {neighbours[armed]} ({armed})",
        f"GPU run time p50 (ok runs): {p50_armed:.0f} ms with MPS arming vs {p50_plain:.0f} ms without "
        f"= {p50_armed / p50_plain if p50_plain else float('nan'):.3f}x",
    ]
    write(args.out, name, results, samples, lines, levels)
    print("\n".join(lines))
    print(f"results: {args.out}/{name}.{{json,md,png}}")


if __name__ == "__main__":
    asyncio.run(main())
