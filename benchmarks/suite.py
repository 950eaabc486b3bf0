"""`python -m benchmarks` / `appliance bench`: the appliance against its baselines, in one run.

Starts everything itself on loopback, side by side on this machine:
  - the appliance with its warm pool (defaults: SANDBOX_POOL_SIZE=2, preload numpy,pandas,matplotlib),
  - the appliance with the pool off (SANDBOX_POOL_SIZE=0: a cold jail per run),
  - a naive `firejail <the same flags> python -c CODE` per run (benchmarks.jails),
  - a warm Jupyter kernel behind Jupyter Kernel Gateway, TCP_NODELAY on (benchmarks.jupyter),
and measures: `print(2+2)`, a pandas groupby on 100k rows, a matplotlib figure to PNG,
a stateful session cell, sustained throughput at 1..16 clients against the machine's
jail-spawn capacity, and the idle PSS of a warm jail. Writes <stem>.json/.md/.png under
--out and prints the ratios and issue 4's targets (PASS/MISS). Exits non-zero only on
errors (a server that does not start, a wrong answer), never on figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks import evals, report
from benchmarks.appliance_server import (
    REPO,
    ApplianceServer,
    BenchError,
    RunReply,
    execute,
    open_ws,
    start_appliance,
    unwind_on_sigterm,
    wait_pool_idle,
)
from benchmarks.jails import BenchJails, naive_run, open_factory, spawn_capacity
from benchmarks.jupyter import KernelGateway, start_gateway
from benchmarks.stats import summarize

RESULTS = Path(__file__).resolve().parent / "results"
POOL_FLOOR = 2  # the appliance's default SANDBOX_POOL_SIZE, which the warm server runs with
# Every latency sample, whatever the target, starts after this long with nothing sent to it:
# a warm jail has always idled in the pool before its run, so Jupyter's kernel idles too
# (on a busy machine, waking an idle process costs milliseconds of its own).
SETTLE_S = 0.1

PRINT_CODE = "print(2+2)"
PANDAS_CODE = (
    "import numpy as np\n"
    "import pandas as pd\n"
    "df = pd.DataFrame({'k': np.arange(100_000) % 100, 'v': np.arange(100_000, dtype=np.float64)})\n"
    "print(int(df.groupby('k')['v'].sum().sum()))\n"
)
PANDAS_OUT = f"{sum(range(100_000))}\n"
MPL_CODE = (
    "import matplotlib.pyplot as plt\n"
    "fig, ax = plt.subplots(figsize=(4, 3))\n"
    "ax.plot(range(100), [i * i for i in range(100)])\n"
    "plt.show()\n"
)
SESSION_CODE = "x += 1\nprint(x)"


@dataclass(frozen=True)
class Plan:
    """How many samples of each kind; `quick` must stay under two minutes on 2 busy cores."""

    print_fast: int  # warm appliance, naive spawn of print(2+2)
    fast_extra: int  # extra samples for the cheap targets (Jupyter, sessions)
    cold: int  # pool-off appliance samples per scenario
    pandas_warm: int
    pandas_naive: int
    mpl_warm: int
    session: int
    levels: tuple[int, ...]
    level_warmup_s: float
    level_s: float
    spawn_s: float
    spawn_min: int
    spawn_parallel: tuple[int, ...]
    nagle_check: int  # samples of the Jupyter baseline with Nagle left on (0: skip)
    eval_programs: int  # import-light eval programs per server (issue 18)
    eval_clients: int
    flag_repeats: int  # jails per firejail flag variant


# The quick plan is a smoke run (make test runs it beside the other tests): every phase and
# output, with the fewest samples that still give each figure.
QUICK = Plan(
    print_fast=10,
    fast_extra=10,
    cold=3,
    pandas_warm=6,
    pandas_naive=3,
    mpl_warm=5,
    session=10,
    levels=(1, 2, 4, 8, 16),
    level_warmup_s=2.0,
    level_s=3.0,  # no shorter: on a loaded machine a run at 8 or 16 clients takes seconds
    spawn_s=3.0,
    spawn_min=4,
    spawn_parallel=(2 * (os.cpu_count() or 1),),
    nagle_check=0,
    eval_programs=20,
    eval_clients=4,
    flag_repeats=3,
)
FULL = Plan(
    print_fast=60,
    fast_extra=140,
    cold=15,
    pandas_warm=40,
    pandas_naive=12,
    mpl_warm=25,
    session=100,
    levels=(1, 2, 4, 8, 16),
    level_warmup_s=5.0,
    level_s=12.0,
    spawn_s=10.0,
    spawn_min=12,
    spawn_parallel=tuple(k * (os.cpu_count() or 1) for k in (1, 2, 3)),
    nagle_check=20,
    eval_programs=300,
    eval_clients=4,
    flag_repeats=12,
)

Sampler = Callable[[], Awaitable[float]]


def _check(reply: RunReply, what: str, stdout: str | None, png: bool = False) -> None:
    if reply.status != "ok":
        done = reply.frames[-1] if reply.frames else {}
        raise BenchError(f"{what}: the run ended {reply.status}: {done.get('message')}")
    if stdout is not None and reply.stdout != stdout:
        raise BenchError(f"{what}: expected stdout {stdout!r}, got {reply.stdout!r}")
    if png and not any(f.get("type") == "display" and "image/png" in f.get("data", {}) for f in reply.frames):
        raise BenchError(f"{what}: no image/png display frame came back")


class Bench:
    """Everything one run of the suite holds: servers, baselines, progress, results."""

    def __init__(self, plan: Plan, quick: bool, work: Path, progress: bool) -> None:
        self.plan = plan
        self.quick = quick
        self.work = work
        self.ids = itertools.count()
        self.warm: ApplianceServer | None = None
        self.cold: ApplianceServer | None = None
        self.bare: ApplianceServer | None = None
        self.gateway: KernelGateway | None = None
        self.jails: BenchJails | None = None
        self.bar = tqdm(
            total=self._steps(), disable=not progress, unit="run", file=sys.stderr, dynamic_ncols=True
        )
        self.results: dict[str, Any] = {"latency": {}}

    def _steps(self) -> int:
        p = self.plan
        return (
            2 * p.print_fast
            + p.print_fast
            + p.fast_extra
            + 3 * p.cold
            + p.pandas_warm
            + p.pandas_naive
            + p.print_fast
            + p.fast_extra
            + p.mpl_warm
            + 2 * p.session
            + p.spawn_min * len(p.spawn_parallel)
            + len(p.levels)
            + p.nagle_check
            + 2
        )

    def phase(self, text: str) -> None:
        self.bar.set_description(text)

    def rid(self) -> str:
        return f"b{next(self.ids)}"

    # -- setup ---------------------------------------------------------------------------
    async def start(self) -> None:
        # The three appliances and the gateway start side by side (nothing is measured before
        # every one is up); each is kept as soon as it is, so close() stops it whatever fails.
        self.phase("starting the appliances (warm pool, pool off, no preload) and Jupyter Kernel Gateway")

        async def warm() -> None:
            self.warm = await asyncio.to_thread(start_appliance, "warm", self.work)

        async def cold() -> None:
            self.cold = await asyncio.to_thread(start_appliance, "cold", self.work, SANDBOX_POOL_SIZE="0")

        async def bare() -> None:
            self.bare = await asyncio.to_thread(start_appliance, "bare", self.work, SANDBOX_PRELOAD="")

        async def gateway() -> None:
            self.gateway = await start_gateway(self.work / "jupyter")
            # The kernel is warm the way the pool is: the same modules imported before the first cell.
            await self.gateway.execute("import numpy, pandas, matplotlib\nmatplotlib.use('Agg')")

        for failed in await asyncio.gather(warm(), cold(), bare(), gateway(), return_exceptions=True):
            if isinstance(failed, BaseException):
                raise failed
        # The bare profile: the jail a one-shot `print(2+2)` gets from an import-aware pool,
        # so the spawn capacity is the ceiling of the throughput scenario it is compared with.
        self.jails = await asyncio.to_thread(open_factory, {"SANDBOX_PRELOAD": ""})

    async def close(self) -> None:
        for server in (self.warm, self.cold, self.bare):
            if server is not None:
                await asyncio.to_thread(server.stop)
        if self.gateway is not None:
            await self.gateway.close()
        if self.jails is not None:
            self.jails.close()
        self.bar.close()

    # -- samplers ------------------------------------------------------------------------
    def appliance_sampler(
        self, server: ApplianceServer, code: str, stdout: str | None, png: bool = False
    ) -> Sampler:
        ws_holder: list[Any] = []

        async def sample() -> float:
            if not ws_holder:
                ws_holder.append(await open_ws(server.url))
            if self.warm is None:
                raise BenchError("the suite is not started")
            await wait_pool_idle(self.warm, POOL_FLOOR)  # no refill competes with the measured run
            await asyncio.sleep(SETTLE_S)
            started = time.perf_counter()
            reply = await execute(ws_holder[0], self.rid(), code)
            elapsed = (time.perf_counter() - started) * 1000
            _check(reply, f"{server.name} appliance", stdout, png)
            return elapsed

        return sample

    def naive_sampler(self, code: str, stdout: str) -> Sampler:
        async def sample() -> float:
            if self.jails is None or self.warm is None:
                raise BenchError("the suite is not started")
            await wait_pool_idle(self.warm, POOL_FLOOR)
            await asyncio.sleep(SETTLE_S)
            started = time.perf_counter()
            out = await naive_run(self.jails, code)
            elapsed = (time.perf_counter() - started) * 1000
            if out != stdout:
                raise BenchError(f"naive firejail: expected {stdout!r}, got {out!r}")
            return elapsed

        return sample

    def jupyter_sampler(self, code: str, stdout: str) -> Sampler:
        async def sample() -> float:
            if self.gateway is None or self.warm is None:
                raise BenchError("the suite is not started")
            await wait_pool_idle(self.warm, POOL_FLOOR)
            await asyncio.sleep(SETTLE_S)
            started = time.perf_counter()
            out = await self.gateway.execute(code)
            elapsed = (time.perf_counter() - started) * 1000
            if out != stdout:
                raise BenchError(f"jupyter kernel: expected {stdout!r}, got {out!r}")
            return elapsed

        return sample

    async def interleave(self, scenario: str, samplers: dict[str, tuple[Sampler, int]]) -> None:
        """Sample every target round-robin (one unrecorded warm-up each) and summarize."""
        self.phase(f"latency: {scenario}")
        for sample, _ in samplers.values():
            await sample()
        found: dict[str, list[float]] = {name: [] for name in samplers}
        for _ in range(max(n for _, n in samplers.values())):
            for name, (sample, n) in samplers.items():
                if len(found[name]) < n:
                    found[name].append(await sample())
                    self.bar.update()
        self.results["latency"][scenario] = {name: summarize(v).as_dict() for name, v in found.items()}

    # -- phases --------------------------------------------------------------------------
    async def memory(self) -> None:
        """Idle PSS per warm jail: the server's metric and /proc of its idle pool's jails."""
        if self.warm is None:
            raise BenchError("the suite is not started")
        self.phase("memory: idle warm jails")
        await wait_pool_idle(self.warm, POOL_FLOOR)
        await asyncio.sleep(0.5)
        metric = self.warm.metrics().get("appliance_jail_pss_bytes", 0.0) / 2**20
        per_jail = [kb / 1024 for kb in jail_pss_kb(self.warm.proc.pid)]
        if not per_jail:
            raise BenchError("found no idle jail under the warm server to measure")
        per_jail.sort()
        self.results["memory"] = {
            "pss_mb_metric": metric or None,
            "pss_mb_proc": [round(v, 1) for v in per_jail],
            "pss_mb_per_warm_jail": round(per_jail[len(per_jail) // 2], 1),
        }

    async def latency(self) -> None:
        if self.warm is None or self.cold is None:
            raise BenchError("the suite is not started")
        p = self.plan
        await self.interleave(
            "print",
            {
                report.WARM: (self.appliance_sampler(self.warm, PRINT_CODE, "4\n"), p.print_fast),
                report.COLD: (self.appliance_sampler(self.cold, PRINT_CODE, "4\n"), p.cold),
                report.NAIVE: (self.naive_sampler(PRINT_CODE, "4\n"), p.print_fast),
                report.JUPYTER: (self.jupyter_sampler(PRINT_CODE, "4\n"), p.print_fast + p.fast_extra),
            },
        )
        if self.gateway is None:
            raise BenchError("the suite is not started")
        nodelay = self.gateway.nodelay_state()
        if not all(nodelay.values()):
            raise BenchError(f"TCP_NODELAY is off on the Jupyter baseline's connection: {nodelay}")
        self.results["jupyter_nodelay"] = dict(nodelay)
        await self.interleave(
            "pandas",
            {
                report.WARM: (self.appliance_sampler(self.warm, PANDAS_CODE, PANDAS_OUT), p.pandas_warm),
                report.COLD: (self.appliance_sampler(self.cold, PANDAS_CODE, PANDAS_OUT), p.cold),
                report.NAIVE: (self.naive_sampler(PANDAS_CODE, PANDAS_OUT), p.pandas_naive),
                report.JUPYTER: (self.jupyter_sampler(PANDAS_CODE, PANDAS_OUT), p.print_fast + p.fast_extra),
            },
        )
        await self.interleave(
            "matplotlib",
            {
                report.WARM: (self.appliance_sampler(self.warm, MPL_CODE, "", png=True), p.mpl_warm),
                report.COLD: (self.appliance_sampler(self.cold, MPL_CODE, "", png=True), p.cold),
            },
        )
        await self.interleave(
            "session",
            {
                report.SESSION: (await self.session_sampler(), p.session),
                report.JUPYTER: (await self.jupyter_session_sampler(), p.session),
            },
        )

    async def session_sampler(self) -> Sampler:
        if self.warm is None:
            raise BenchError("the suite is not started")
        ws = await open_ws(self.warm.url)
        opened = await execute(ws, self.rid(), "x = 0", session="new")
        _check(opened, "session open", "")
        session = opened.session
        if not session:
            raise BenchError("the session's reply carried no session id")
        counter = itertools.count(1)

        async def sample() -> float:
            if self.warm is None:
                raise BenchError("the suite is not started")
            await wait_pool_idle(self.warm, POOL_FLOOR)
            await asyncio.sleep(SETTLE_S)
            started = time.perf_counter()
            reply = await execute(ws, self.rid(), SESSION_CODE, session=session)
            elapsed = (time.perf_counter() - started) * 1000
            _check(reply, "session cell", f"{next(counter)}\n")
            return elapsed

        return sample

    async def jupyter_session_sampler(self) -> Sampler:
        if self.gateway is None:
            raise BenchError("the suite is not started")
        await self.gateway.execute("x = 0")
        counter = itertools.count(1)

        async def sample() -> float:
            if self.gateway is None or self.warm is None:
                raise BenchError("the suite is not started")
            await wait_pool_idle(self.warm, POOL_FLOOR)
            await asyncio.sleep(SETTLE_S)
            started = time.perf_counter()
            out = await self.gateway.execute(SESSION_CODE)
            elapsed = (time.perf_counter() - started) * 1000
            if out != f"{next(counter)}\n":
                raise BenchError(f"jupyter session cell printed {out!r}")
            return elapsed

        return sample

    async def capacity(self) -> None:
        """Jails per second this machine can start (and destroy), measured with the server idle."""
        if self.jails is None or self.warm is None:
            raise BenchError("the suite is not started")
        best: dict[str, Any] | None = None
        for parallel in self.plan.spawn_parallel:
            self.phase(f"jail-spawn capacity ({parallel} at a time)")
            await wait_pool_idle(self.warm, POOL_FLOOR)
            cap = await spawn_capacity(
                self.jails,
                parallel,
                self.plan.spawn_s,
                self.plan.spawn_min,
                _ticker(self.bar, self.plan.spawn_min),
            )
            entry = {
                "spawns_per_s": round(cap.spawns_per_s, 3),
                "parallel": cap.parallel,
                "spawns": cap.spawns,
                "seconds": round(cap.seconds, 2),
                "launch_p50_ms": round(summarize(cap.launch_ms).p50_ms, 1),
                "pss_mb": round(cap.pss_mb, 1),
            }
            self.results.setdefault("spawn_capacity_runs", []).append(entry)
            if best is None or entry["spawns_per_s"] > best["spawns_per_s"]:
                best = entry
        if best is None:
            raise BenchError("no spawn-capacity run was measured")
        self.results.setdefault("throughput", {})["spawn_capacity"] = best

    async def throughput(self) -> None:
        if self.warm is None:
            raise BenchError("the suite is not started")
        levels = []
        for clients in self.plan.levels:
            self.phase(f"throughput: {clients} clients")
            levels.append(await self.level(self.warm, clients))
            self.bar.update()
        self.results.setdefault("throughput", {})["levels"] = levels

    async def level(self, server: ApplianceServer, clients: int) -> dict[str, Any]:
        """`clients` connections each running one-shot print(2+2) back to back.

        The window opens once the pool's stock is used up (the server's first cold start of
        this level, or after `level_warmup_s` at the latest): runs/s is then what the
        machine sustains, not what the jails pre-started while idle add for a moment.
        At the end the connections are dropped, which cancels what is still queued.
        """
        await wait_pool_idle(server, 1, timeout_s=120, refills_done=False)
        cold_before = server.metrics().get("appliance_cold_starts_total", 0.0)
        sockets = [await open_ws(server.url) for _ in range(clients)]
        records: list[tuple[float, float]] = []

        async def client(ws: Any) -> None:
            while True:
                t0 = time.monotonic()
                reply = await execute(ws, self.rid(), PRINT_CODE)
                _check(reply, f"throughput at {clients} clients", "4\n")
                records.append((t0, time.monotonic()))

        tasks = [asyncio.create_task(client(ws)) for ws in sockets]
        try:
            opened = time.monotonic() + self.plan.level_warmup_s
            while time.monotonic() < opened and not any(t.done() for t in tasks):
                cold = await asyncio.to_thread(server.metrics)
                if cold.get("appliance_cold_starts_total", 0.0) > cold_before:
                    break
                await asyncio.sleep(0.05)
            window = (time.monotonic(), time.monotonic() + self.plan.level_s)
            await asyncio.wait(tasks, timeout=self.plan.level_s)
            for task in tasks:
                if task.done():
                    task.result()  # a failed run is an error of the benchmark, not a figure
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for ws in sockets:
                ws.transport.abort()  # a vanished client: the server cancels its queued runs
        inside = [(t0, t1) for t0, t1 in records if window[0] <= t1 < window[1]]
        latencies = [(t1 - t0) * 1000 for t0, t1 in (inside or records)]
        if not latencies:
            raise BenchError(f"no run finished at {clients} clients in {self.plan.level_s} s")
        s = summarize(latencies)
        return {
            "clients": clients,
            "runs_per_s": round(len(inside) / self.plan.level_s, 3),
            "runs": len(inside),
            "window_s": self.plan.level_s,
            "cold_starts": int(server.metrics().get("appliance_cold_starts_total", 0.0) - cold_before),
            "p50_ms": round(s.p50_ms, 2),
            "p90_ms": round(s.p90_ms, 2),
            "p99_ms": round(s.p99_ms, 2),
        }

    async def evals(self) -> None:
        """Import-light eval load at default settings vs SANDBOX_PRELOAD='' (issue 18), and
        what each firejail flag costs per jail."""
        if self.warm is None or self.bare is None or self.jails is None:
            raise BenchError("the suite is not started")
        runs = {}
        for name, server in (("default", self.warm), ("no_preload", self.bare)):
            self.phase(f"import-light eval load ({name})")
            await wait_pool_idle(server, POOL_FLOOR if name == "default" else 1, timeout_s=120)
            runs[name] = await evals.eval_throughput(server, self.plan.eval_programs, self.plan.eval_clients)
            self.bar.update()
        ratio = runs["default"]["runs_per_s"] / runs["no_preload"]["runs_per_s"]
        self.results["eval"] = {**runs, "ratio": round(ratio, 3)}
        self.phase("firejail flag costs")
        self.results["flags"] = await evals.flag_costs(self.jails, self.plan.flag_repeats)

    async def nagle(self) -> None:
        """The Jupyter baseline once more with Nagle left on, to show what TCP_NODELAY changes."""
        if not self.plan.nagle_check:
            return
        self.phase("Jupyter with Nagle on (for comparison)")
        gateway = await start_gateway(self.work / "jupyter-nagle", nodelay=False)
        try:
            await gateway.execute("print(2+2)")
            samples = []
            for _ in range(self.plan.nagle_check):
                started = time.perf_counter()
                await gateway.execute(PRINT_CODE)
                samples.append((time.perf_counter() - started) * 1000)
                self.bar.update()
            self.results["jupyter_nodelay"]["print_p50_ms_with_nagle"] = round(summarize(samples).p50_ms, 2)
        finally:
            await gateway.close()


def _ticker(bar: Any, limit: int) -> Callable[[], None]:
    """A callback that advances the bar by one, `limit` times at most."""
    ticks = itertools.count(1)

    def tick() -> None:
        if next(ticks) <= limit:
            bar.update()

    return tick


def jail_pss_kb(server_pid: int) -> list[int]:
    """PSS (KiB) of each firejail tree under the server: its idle pool when nothing runs."""
    out = []
    for child in _children(server_pid):
        try:
            comm = Path(f"/proc/{child}/comm").read_text().strip()
        except OSError:
            continue
        if comm != "firejail":
            continue
        total, stack = 0, [child]
        while stack:
            pid = stack.pop()
            stack.extend(_children(pid))
            with contextlib.suppress(OSError, ValueError):
                for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                    if line.startswith("Pss:"):
                        total += int(line.split()[1])
                        break
        out.append(total)
    return out


def _children(pid: int) -> list[int]:
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, ValueError):
                found += [int(p) for p in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
    return found


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def _commit() -> str:
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
            ).stdout.strip()
            or "?"
        )
    except (OSError, subprocess.TimeoutExpired):
        return "?"


async def run(plan: Plan, quick: bool, progress: bool) -> dict[str, Any]:
    """Run every phase and return the results (without targets; report.write adds them)."""
    started = time.monotonic()
    load_before = _loadavg()
    with tempfile.TemporaryDirectory(prefix="appliance-bench-") as tmp:
        bench = Bench(plan, quick, Path(tmp), progress)
        try:
            await bench.start()
            await bench.memory()
            await bench.latency()
            await bench.capacity()
            await bench.throughput()
            await bench.evals()
            await bench.nagle()
        except BenchError as exc:
            logs = "".join(
                f"\n--- {srv.name} server log (tail) ---\n{srv.tail()}"
                for srv in (bench.warm, bench.cold, bench.bare)
                if srv is not None
            )
            raise BenchError(f"{exc}{logs}") from exc
        finally:
            await bench.close()
    results = bench.results
    results["meta"] = {
        "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "quick": quick,
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "commit": _commit(),
        "loadavg_before": load_before,
        "loadavg_after": _loadavg(),
        "seconds": round(time.monotonic() - started, 1),
        "warm_server": {
            "SANDBOX_POOL_SIZE": "default (2)",
            "SANDBOX_PRELOAD": "default (numpy,pandas,matplotlib)",
        },
        "cold_server": {"SANDBOX_POOL_SIZE": "0"},
        "plan": plan.__dict__,
    }
    return results


def print_summary(results: dict[str, Any], paths: list[Path]) -> None:
    print()
    print("p50 / p99 round trip (ms):")
    for scenario, by_target in results["latency"].items():
        for name, s in by_target.items():
            print(
                f"  {scenario:<10} {report.LABELS[name]:<40} {s['p50_ms']:9.2f} / {s['p99_ms']:9.2f}"
                f"   (n={s['n']})"
            )
    tp = results["throughput"]
    print(f"jail-spawn capacity: {tp['spawn_capacity']['spawns_per_s']:.2f} spawns/s")
    for lvl in tp["levels"]:
        print(
            f"  {lvl['clients']:>2} clients: {lvl['runs_per_s']:6.2f} runs/s   p50 {lvl['p50_ms']:8.1f} ms"
            f"   p99 {lvl['p99_ms']:8.1f} ms   cold starts {lvl['cold_starts']}"
        )
    print(f"idle PSS per warm jail: {results['memory']['pss_mb_per_warm_jail']} MB")
    ev = results["eval"]
    print(
        f"import-light eval load: {ev['default']['runs_per_s']:.2f} runs/s at default settings, "
        f"{ev['no_preload']['runs_per_s']:.2f} with SANDBOX_PRELOAD='' (ratio {ev['ratio']:.2f})"
    )
    for name, cost in results["flags"].items():
        print(f"  firejail {name:<36} wall {cost['wall_ms']:7.1f} ms   cpu {cost['cpu_ms']:6.1f} ms per jail")
    print("\nratios (baseline / appliance):")
    for line in report.ratio_lines(results):
        print("  " + line)
    print("\ntargets (issues 4 and 18):")
    for t in report.targets(results):
        print(f"  {t.verdict():<5} {t.name}: {report.fmt(t.value)} (goal {t.goal})")
    print("\nwrote " + ", ".join(str(p) for p in paths))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples; under two minutes (CI)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory for the JSON/Markdown/PNG")
    parser.add_argument("--stem", default=None, help="file name stem (default: bench, or bench_quick)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    unwind_on_sigterm()
    plan = QUICK if args.quick else FULL
    try:
        results = asyncio.run(run(plan, args.quick, not args.no_progress))
    except BenchError as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1
    stem = args.stem or ("bench_quick" if args.quick else "bench")
    paths = report.write(results, args.out, stem)
    print_summary(results, paths)
    return 0
