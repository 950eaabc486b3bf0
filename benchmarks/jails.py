"""Jails made by the benchmark process itself: the naive baseline and the spawn capacity.

Both use the appliance's own `JailFactory` (same settings, host facts, runtime and
`render_argv`) so the baseline is the same jail, only started the naive way:

- naive: `setpriv --reuid=UID ... firejail <the appliance's hardening flags> python -I -c CODE`,
  one process per run, nothing pre-started, nothing preloaded;
- spawn capacity: how many `JailFactory.launch()` (start firejail, import the preload,
  pass the self-check) + `Jail.destroy()` cycles per second this machine sustains.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from appliance import settings as settings_mod
from appliance.sandbox import runfs
from appliance.sandbox.cell import disk_entries
from appliance.sandbox.firejail import launcher_env, render_argv
from appliance.sandbox.host import inspect
from appliance.sandbox.jail import JailFactory
from appliance.sandbox.workdir import RunDirs, stage_runtime
from benchmarks.appliance_server import BenchError

PLACEHOLDER_FD = 3  # render_argv needs an events fd; the naive argv drops it again


@dataclass
class BenchJails:
    """A JailFactory owned by the benchmark process, with its own run directory."""

    factory: JailFactory
    dirs: RunDirs

    def close(self) -> None:
        self.dirs.remove_instance()


def open_factory(env: dict[str, str] | None = None) -> BenchJails:
    """A factory configured exactly as `appliance serve` would be from the same SANDBOX_* env."""
    full = {"SANDBOX_PYTHON": sys.executable, **(env or {})}
    config = settings_mod.from_env(full)
    host = inspect(config.firejail, config.uid, config.python)
    sizes = runfs.for_server(config.max_disk_mb, disk_entries(config.max_disk_mb))
    dirs = RunDirs(config.tmp_root, host.uid, host.gid, sizes)
    # As a server prepares its own directory: the jails' accounts and (root) prepared /etc. Not
    # dirs.prepare(): that also purges other servers' stale directories, a server's job.
    dirs.prepare_own()
    runtime = stage_runtime(config.tmp_root, config.python)
    return BenchJails(JailFactory(config, host, runtime, dirs), dirs)


def naive_argv(jails: BenchJails, workdir: Path, code: str) -> list[str]:
    """The naive per-run command: the appliance's firejail flags around `python -I -c CODE`."""
    factory = jails.factory
    spec = factory.spec(workdir)
    argv = render_argv(spec, PLACEHOLDER_FD, factory.host.firejail)
    driver_tail = [str(spec.python), "-I", "-u", str(spec.driver), str(PLACEHOLDER_FD)]
    if argv[-len(driver_tail) :] != driver_tail:
        raise BenchError("render_argv changed its tail; update benchmarks/jails.py")
    flags = [a for a in argv[: -len(driver_tail)] if not a.startswith("--keep-fd=")]
    host = factory.host
    drop = ["setpriv", f"--reuid={host.uid}", f"--regid={host.gid}", "--clear-groups"]
    if os.geteuid() == host.uid:
        drop = []
    return drop + flags + [str(spec.python), "-I", "-c", code]


async def naive_run(jails: BenchJails, code: str) -> str:
    """Run code once in a brand-new jail the naive way; returns its stdout, raises on failure."""
    workdir = await asyncio.to_thread(jails.dirs.create, "naive-" + secrets.token_hex(6))
    try:
        env = {**launcher_env(), "container": "docker"}
        proc = await asyncio.create_subprocess_exec(
            *naive_argv(jails, workdir, code),
            env=env,
            cwd="/",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await proc.communicate()
    finally:
        await asyncio.to_thread(shutil.rmtree, workdir, True)
    if proc.returncode != 0:
        raise BenchError(
            f"naive firejail run exited {proc.returncode}: {err.decode(errors='replace')[-800:]}"
        )
    return out.decode(errors="replace")


@dataclass(frozen=True)
class SpawnCapacity:
    spawns_per_s: float
    parallel: int
    spawns: int
    seconds: float
    launch_ms: list[float]
    pss_mb: float


async def spawn_capacity(
    jails: BenchJails, parallel: int, seconds: float, minimum: int, tick: Callable[[], None] | None = None
) -> SpawnCapacity:
    """Launch and destroy jails `parallel` at a time for `seconds` (and at least `minimum`)."""
    launch_ms: list[float] = []
    finished: list[float] = []
    pss_kb: list[int] = []
    done = 0
    started = time.monotonic()
    stop_at = started + seconds

    async def worker() -> None:
        nonlocal done
        while time.monotonic() < stop_at or done + parallel <= minimum:
            t0 = time.perf_counter()
            jail = await jails.factory.launch()
            launch_ms.append((time.perf_counter() - t0) * 1000)
            try:
                if len(pss_kb) < 3:  # a sample of the idle PSS, not on every cycle's path
                    pss_kb.append(await asyncio.to_thread(jail.process.pss_kb))
            finally:
                await jail.destroy()
            done += 1
            finished.append(time.monotonic())
            if tick is not None:
                tick()

    await asyncio.gather(*(worker() for _ in range(parallel)))
    elapsed = time.monotonic() - started
    pss = sorted(pss_kb)[len(pss_kb) // 2] / 1024 if pss_kb else 0.0
    # The rate between the first and the last completion: the ramp-up (every worker's first
    # launch, before anything completes) is not what the machine sustains.
    finished.sort()
    span = finished[-1] - finished[0] if len(finished) > 1 else elapsed
    rate = (len(finished) - 1) / span if len(finished) > 1 and span > 0 else done / elapsed
    return SpawnCapacity(rate, parallel, done, elapsed, launch_ms, pss)
