"""GPU contention benchmark: N = 1, 2, 4, 8, 16 concurrent runs of a fixed mix sharing GPUs.

Two modes, one report format (JSON + Markdown + PNG chart under benchmarks/results/):

- `--simulated` (default; any machine): the appliance's real GpuLedger and GpuWatchdog
  against the simulated backend (one 16 GiB device). Each run is a real process tree
  (`sleep`), whose host PID the simulated backend reports as using GPU memory, so the
  watchdog maps PIDs to runs exactly as in production. What is simulated: the GPU and the
  models' memory curves. What is real: admission, the FIFO queue, reconciliation, the
  PID-tree mapping and the kills.
- `--server ws://HOST:PORT/exec` (a real GPU host, see benchmarks/gpu_real.sh): the same
  mix as real requests to a running appliance with SANDBOX_GPU=1; each run allocates its
  GPU memory through the CUDA driver API (libcuda via ctypes) inside its jail.

The mix, per 8 runs: 3 llama (3.5 GiB budget, uses 3 GiB), 1 llama that overruns (uses
budget + margin + 512 MiB -> gpu_memory_limit), 2 whisper (1 GiB, uses 800 MiB), 1 CPU-only
(no GPU), 1 oversized (20 GiB -> rejected). Admitted budgets of N=16 sum to 2x the device.
Samples of device memory are taken at 4 Hz.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import time
from collections.abc import Callable, Coroutine
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
DEVICE_MB = 16384
MARGIN_MB = 256
MIX = [  # (kind, budget MiB, uses MiB, seconds)
    ("llama", 3584, 3072, 2.0),
    ("whisper", 1024, 800, 1.0),
    ("llama", 3584, 3072, 2.0),
    ("cpu", 0, 0, 0.5),
    ("llama-overrun", 3584, 3584 + MARGIN_MB + 512, 2.0),
    ("whisper", 1024, 800, 1.0),
    ("llama", 3584, 3072, 2.0),
    ("oversized", 20480, 0, 0.5),
]
LEVELS = (1, 2, 4, 8, 16)


@dataclass
class RunRecord:
    n: int
    kind: str
    budget_mb: int
    queued_ms: float
    run_ms: float
    outcome: str
    device: int | None


def pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


async def simulated_level(n: int, samples: list[dict[str, Any]]) -> list[RunRecord]:  # noqa: PLR0915 (one benchmark level, its setup, runs and tally in order)
    from appliance.core.errors import RequestRejected, RunLimit
    from appliance.core.tasks import TaskScope
    from appliance.gpu.ledger import GpuLedger
    from appliance.gpu.simulated import SimulatedBackend
    from appliance.gpu.watchdog import GpuWatchdog

    backend = SimulatedBackend((DEVICE_MB,))
    ledger = GpuLedger(backend.devices(), margin_mb=MARGIN_MB, max_wait_ms=120_000)
    watchdog = GpuWatchdog(backend, ledger, margin_mb=MARGIN_MB, host_memory_mb=None, interval_s=0.1)
    tasks = await TaskScope("benchmark").open()
    watchdog.start(tasks)
    t0 = time.monotonic()

    async def sampler() -> None:
        while True:
            dev = backend.devices()[0]
            snap = ledger.snapshot()[0]
            samples.append(
                {
                    "n": n,
                    "t": round(time.monotonic() - t0, 3),
                    "used_mb": dev.used_mb,
                    "reserved_mb": snap["reserved_mb"],
                    "queued": ledger.waiting,
                }
            )
            await asyncio.sleep(0.25)

    async def one(i: int) -> RunRecord:
        kind, budget, uses, secs = MIX[i % len(MIX)]
        asked = time.monotonic()
        if budget == 0:
            await asyncio.sleep(secs)
            return RunRecord(n, kind, 0, 0.0, secs * 1000, "ok", None)
        try:
            grant = await ledger.acquire(budget)
        except RequestRejected:
            return RunRecord(n, kind, budget, (time.monotonic() - asked) * 1000, 0.0, "rejected", None)
        queued = (time.monotonic() - asked) * 1000
        started = time.monotonic()
        proc = await asyncio.create_subprocess_exec("sleep", str(secs), start_new_session=True)
        stopped: list[RunLimit] = []

        def stop(error: RunLimit) -> None:
            stopped.append(error)
            os.killpg(proc.pid, signal.SIGKILL)

        watchdog.watch(f"r{i}", proc.pid, grant, stop)
        try:
            await asyncio.sleep(0.2)  # the model loads, then holds its memory
            backend.set_usage(proc.pid, grant.index, uses)
            await proc.wait()
        finally:
            backend.set_usage(proc.pid, grant.index, 0)
            watchdog.unwatch(f"r{i}")
            ledger.release(grant)
        outcome = stopped[0].status if stopped else "ok"
        return RunRecord(n, kind, budget, queued, (time.monotonic() - started) * 1000, outcome, grant.index)

    sample_task = asyncio.create_task(sampler())
    try:
        records = await asyncio.gather(*(one(i) for i in range(n)))
    finally:
        sample_task.cancel()
        await watchdog.close()
        await tasks.close()
    over = [s for s in samples if s["n"] == n and s["used_mb"] > DEVICE_MB]
    if over:  # a device over its memory is an out-of-memory failure for whoever allocated last
        for r in records:
            if r.outcome == "ok" and r.device is not None:
                r.outcome = "oom"
    return list(records)


# The primary context, as the CUDA runtime (llama.cpp, whisper.cpp) uses it: under MPS it is
# the client the appliance armed with the run's budget before the code started.
CUDA_CODE = """
import ctypes, os, time
cuda = ctypes.CDLL(os.environ.get('APPLIANCE_LIBCUDA', 'libcuda.so.1'))
dev, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_void_p()
assert cuda.cuInit(0) == 0 and cuda.cuDeviceGet(ctypes.byref(dev), 0) == 0
rc = cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)
if rc == 2:  # a context takes device memory too: on a full device it is out of memory
    raise MemoryError('cuDevicePrimaryCtxRetain failed with CUDA error 2 (out of memory)')
assert rc == 0 and cuda.cuCtxSetCurrent(ctx) == 0
rc = cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(USES * 1024 * 1024))
if rc != 0:
    raise MemoryError(f'cuMemAlloc failed with CUDA error {rc} (out of memory)')
time.sleep(SECS)
"""


async def nvml_sampler(n: int, samples: list[dict[str, Any]]) -> None:
    """Device 0's used memory from NVML on the host, 4 Hz (a real GPU)."""
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    t0 = time.monotonic()
    while True:
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
        samples.append(
            {
                "n": n,
                "t": round(time.monotonic() - t0, 3),
                "used_mb": mem.used // 2**20,
                "reserved_mb": None,
                "queued": None,
            }
        )
        await asyncio.sleep(0.25)


def readyz_sampler(http: str) -> Sampler:
    """The ledger's reservations and queue from the server's /readyz, 4 Hz (simulated devices)."""
    import urllib.request

    async def sample(n: int, samples: list[dict[str, Any]]) -> None:
        t0 = time.monotonic()
        while True:

            def get() -> dict[str, Any]:
                with urllib.request.urlopen(f"{http}/readyz", timeout=5) as resp:  # noqa: S310 (http:// built here)
                    return dict(json.loads(resp.read()))

            try:
                gpu = (await asyncio.to_thread(get))["gpu"]
            except (OSError, ValueError, KeyError):
                gpu = None
            if gpu is not None:
                samples.append(
                    {
                        "n": n,
                        "t": round(time.monotonic() - t0, 3),
                        "used_mb": None,
                        "reserved_mb": gpu["devices"][0]["reserved_mb"],
                        "queued": gpu["queued"],
                    }
                )
            await asyncio.sleep(0.25)

    return sample


Sampler = Callable[[int, list[dict[str, Any]]], Coroutine[Any, Any, None]]


OVERRUNNERS = ("llama-overrun", "llama-runaway")  # kinds that use more than their budget


async def server_level(  # noqa: PLR0913 (one benchmark level's parameters)
    url: str,
    n: int,
    samples: list[dict[str, Any]],
    scale: float,
    sampler: Sampler = nvml_sampler,
    mix: list[tuple[str, int, int, float]] = MIX,
    limits_enforced: bool = False,
    context_mb: int = 0,
    slack_mb: int = 0,
) -> list[RunRecord]:
    """Budgets and uses are scaled to the device (the mix is written for 16 GiB).

    limits_enforced: the server enforces MPS limits (/readyz gpu.mps.enforcing), so an
    overrunner's failed allocation is its own budget refused, not a full device.
    context_mb: what NVML counts for a run's CUDA context beyond its allocations (the
    acceptance kit measures it). NVML's reading of a run is its context plus what it
    allocates, so a run that is not an overrunner allocates its use less the context, and at
    most its budget less the context and slack_mb: it stays within its grant as NVML counts it."""
    from appliance_client.client import AsyncClient

    async def one(c: Any, i: int) -> RunRecord:
        kind, budget, uses, secs = mix[i % len(mix)]
        budget, uses = (
            int(budget * scale),
            int(uses * scale) if kind != "llama-overrun" else int((budget * scale) + MARGIN_MB + 512),
        )
        if uses and kind not in OVERRUNNERS:
            uses = max(1, min(uses, budget - slack_mb) - context_mb)
        code = (
            CUDA_CODE.replace("USES", str(uses)).replace("SECS", str(secs))
            if uses
            else f"import time; time.sleep({secs})"
        )
        fields: dict[str, Any] = {"gpu": {"memory_mb": budget}} if budget else {}
        asked = time.monotonic()
        ex = await c.execute(code, **fields)
        start = next((f for f in ex.frames if f["type"] == "start"), None)
        queued = float(start["queued_ms"]) if start else (time.monotonic() - asked) * 1000
        outcome = ex.status
        if ex.error and ex.error.get("ename") == "MemoryError":
            # The overrunner refused past its own budget (MPS limit) is containment working;
            # an out-of-memory anywhere else is a neighbour pushed out.
            outcome = "budget_refused" if limits_enforced and kind in OVERRUNNERS else "oom"
        device = start["gpu"]["index"] if start and start.get("gpu") else None
        # done.duration_ms counts from the request, queue included; run time is what follows it.
        return RunRecord(
            n, kind, budget, queued, max(0.0, float(ex.duration_ms or 0) - queued), outcome, device
        )

    sample_task = asyncio.create_task(sampler(n, samples))
    try:
        async with AsyncClient(url) as c:
            return list(await asyncio.gather(*(one(c, i) for i in range(n))))
    finally:
        sample_task.cancel()


def summarise(records: list[RunRecord]) -> list[dict[str, Any]]:
    rows = []
    for n in sorted({r.n for r in records}):
        rs = [r for r in records if r.n == n]
        gpu = [r for r in rs if r.budget_mb and r.outcome != "rejected"]
        q = [r.queued_ms for r in gpu]
        t = [r.run_ms for r in gpu]
        outcomes: dict[str, int] = {}
        for r in rs:
            outcomes[r.outcome] = outcomes.get(r.outcome, 0) + 1
        rows.append(
            {
                "n": n,
                "outcomes": outcomes,
                "budget_sum_mb": sum(r.budget_mb for r in rs if r.outcome != "rejected"),
                "queue_p50_ms": round(pct(q, 50)),
                "queue_p95_ms": round(pct(q, 95)),
                "queue_p99_ms": round(pct(q, 99)),
                "run_p50_ms": round(pct(t, 50)),
                "run_p95_ms": round(pct(t, 95)),
                "run_p99_ms": round(pct(t, 99)),
                "mean_run_ms": round(statistics.mean(t)) if t else 0,
            }
        )
    return rows


def run_meta(mix: list[tuple[str, int, int, float]], levels: tuple[int, ...], **extra: Any) -> dict[str, Any]:
    """What a report says about its setup: device, mix, levels, machine, time."""
    return {
        **extra,
        "device_mb": DEVICE_MB,
        "margin_mb": MARGIN_MB,
        "levels": list(levels),
        "mix": [dict(zip(("kind", "budget_mb", "uses_mb", "seconds"), m, strict=True)) for m in mix],
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "python": platform.python_version(),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def outcomes_text(row: dict[str, Any]) -> str:
    """'gpu_memory_limit 1, ok 6' for a summary row."""
    return ", ".join(f"{k} {v}" for k, v in sorted(row["outcomes"].items()))


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend, or None where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def write_report(name: str, mode: str, records: list[RunRecord], samples: list[dict[str, Any]]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    rows = summarise(records)
    meta = run_meta(MIX, LEVELS, mode=mode)
    (RESULTS / f"{name}.json").write_text(
        json.dumps(
            {"meta": meta, "summary": rows, "runs": [asdict(r) for r in records], "samples": samples},
            indent=1,
        )
    )
    lines = [
        f"# GPU contention ({mode})",
        "",
        f"Device {DEVICE_MB} MiB, margin {MARGIN_MB} MiB; {meta['machine']}; {meta['when']}.",
        "",
        "| N | outcomes | budgets admitted (MiB) | queue p50/p95/p99 (ms) | run p50/p95/p99 (ms) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['n']} | {outcomes_text(r)} | {r['budget_sum_mb']} | {r['queue_p50_ms']}/{r['queue_p95_ms']}/"
            f"{r['queue_p99_ms']} | {r['run_p50_ms']}/{r['run_p95_ms']}/{r['run_p99_ms']} |"
        )
    (RESULTS / f"{name}.md").write_text("\n".join(lines) + "\n")
    plt = pyplot()
    if plt is None:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ns = [r["n"] for r in rows]
    for key, label in (
        ("queue_p50_ms", "queue p50"),
        ("queue_p95_ms", "queue p95"),
        ("queue_p99_ms", "queue p99"),
        ("run_p50_ms", "run p50"),
    ):
        ax1.plot(ns, [r[key] for r in rows], marker="o", label=label)
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("concurrent runs (N)")
    ax1.set_ylabel("ms")
    ax1.set_title("queue wait and run time")
    ax1.legend()
    top = [s for s in samples if s["n"] == max(ns)]
    ax2.plot([s["t"] for s in top], [s["used_mb"] for s in top], label="used (backend)")
    if top and top[0]["reserved_mb"] is not None:
        ax2.plot([s["t"] for s in top], [s["reserved_mb"] for s in top], label="reserved (ledger)")
    ax2.axhline(DEVICE_MB, color="red", linestyle="--", label="device total")
    ax2.set_xlabel("s")
    ax2.set_ylabel("MiB")
    ax2.set_title(f"device memory at 4 Hz, N={max(ns)}")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / f"{name}.png", dpi=100)


async def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--server", help="ws://HOST:PORT/exec of an appliance with SANDBOX_GPU=1 (real GPU)")
    parser.add_argument("--name", help="result file name (default gpu_contention_<mode>)")
    args = parser.parse_args()
    mode = "real-gpu" if args.server else "simulated"
    records: list[RunRecord] = []
    samples: list[dict[str, Any]] = []
    scale = 1.0
    if args.server:
        import pynvml

        pynvml.nvmlInit()
        total = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total // 2**20
        scale = total / DEVICE_MB
        print(f"device 0: {total} MiB; mix scaled by {scale:.2f}")
    enforced = False
    if args.server:  # the same port serves /readyz: are MPS limits enforced there?
        import urllib.request

        http = args.server.replace("ws://", "http://", 1).rsplit("/exec", 1)[0]

        def readyz() -> dict[str, Any]:  # urllib blocks: off the event loop
            with urllib.request.urlopen(f"{http}/readyz", timeout=10) as resp:  # noqa: S310 (http:// built here)
                return dict(json.loads(resp.read()))

        enforced = bool((await asyncio.to_thread(readyz)).get("gpu", {}).get("mps", {}).get("enforcing"))
        print(f"MPS limits enforced: {enforced}")
    for n in LEVELS:
        level = await (
            server_level(args.server, n, samples, scale, limits_enforced=enforced)
            if args.server
            else simulated_level(n, samples)
        )
        records += level
        print(json.dumps(summarise(level)[0]))
    write_report(args.name or f"gpu_contention_{mode}", mode, records, samples)


if __name__ == "__main__":
    asyncio.run(main())
