"""Import-light eval load and what each firejail flag costs (issue 18), for benchmarks.suite.

- eval throughput: a few hundred generated stdlib-only programs with asserts (the kind of
  load eval and RL pipelines send), one-shot runs from several clients back to back,
  against the appliance at default settings (import-aware profiles) and with
  SANDBOX_PRELOAD='' (every jail bare), one after the other in the same run; the ratio
  default / no-preload is the figure (target >= 0.8).
- flag costs: `firejail <the appliance's flags> python -I -c pass`, started and waited for,
  with all flags and with one flag left out at a time; wall and CPU time per jail.
"""

from __future__ import annotations

import asyncio
import resource
import secrets
import shutil
import statistics
import time
from typing import Any

from appliance.sandbox.firejail import launcher_env
from benchmarks.appliance_server import ApplianceServer, BenchError, execute, open_ws
from benchmarks.jails import BenchJails, naive_argv

# Each program: a small function, its unit tests as asserts, and one line printed at the end.
TEMPLATES = (
    "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"
    "assert fib({k}) == {fib}\nassert fib(0) == 0\nprint('ok', {k})",
    "import json\nrecord = {{'id': {k}, 'tags': ['a', 'b'], 'score': {k} / 7}}\n"
    "assert json.loads(json.dumps(record)) == record\nprint('ok', {k})",
    "import itertools\npairs = list(itertools.combinations(range({m}), 2))\n"
    "assert len(pairs) == {m} * ({m} - 1) // 2\nprint('ok', {k})",
    "from collections import Counter\nwords = ('x y z x y x ' * {m}).split()\n"
    "assert Counter(words)['x'] == 3 * {m}\nprint('ok', {k})",
    "import re\ntext = 'id-{k} id-{m} other'\nassert re.findall(r'id-(\\d+)', text) == ['{k}', '{m}']\n"
    "print('ok', {k})",
    "from dataclasses import dataclass\n@dataclass\nclass P:\n    x: int\n    y: int\n"
    "p = P({k}, {m})\nassert p.x + p.y == {k} + {m}\nprint('ok', {k})",
    "def is_sorted(xs):\n    return all(a <= b for a, b in zip(xs, xs[1:]))\n"
    "data = sorted(range({m}, 0, -1))\nassert is_sorted(data)\nprint('ok', {k})",
)


def _fib(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


def programs(count: int) -> list[tuple[str, str]]:
    """`count` (code, expected stdout) pairs, the same on every run of the benchmark."""
    out = []
    for i in range(count):
        k, m = 5 + i % 25, 3 + i % 11
        code = TEMPLATES[i % len(TEMPLATES)].format(k=k, m=m, fib=_fib(k))
        out.append((code, f"ok {k}\n"))
    return out


async def eval_throughput(server: ApplianceServer, count: int, clients: int) -> dict[str, Any]:
    """Run `count` programs through `clients` connections; runs/s over the whole batch."""
    work = programs(count)
    queue: asyncio.Queue[tuple[int, str, str]] = asyncio.Queue()
    for i, (code, out) in enumerate(work):
        queue.put_nowait((i, code, out))
    latencies: list[float] = []
    sockets = [await open_ws(server.url) for _ in range(clients)]

    async def client(ws: Any) -> None:
        while not queue.empty():
            i, code, out = queue.get_nowait()
            t0 = time.perf_counter()
            reply = await execute(ws, f"e{i}", code)
            if reply.status != "ok" or reply.stdout != out:
                raise BenchError(f"eval program {i} ended {reply.status} with {reply.stdout!r}")
            latencies.append((time.perf_counter() - t0) * 1000)

    started = time.perf_counter()
    try:
        await asyncio.gather(*(client(ws) for ws in sockets))
    finally:
        for ws in sockets:
            await ws.close()
    seconds = time.perf_counter() - started
    latencies.sort()
    return {
        "programs": count,
        "clients": clients,
        "seconds": round(seconds, 2),
        "runs_per_s": round(count / seconds, 2),
        "p50_ms": round(statistics.median(latencies), 1),
        "p90_ms": round(latencies[int(len(latencies) * 0.9)], 1),
    }


FLAG_VARIANTS = {
    "all flags": (),
    "without --private-etc": ("--private-etc",),
    "without --deterministic-shutdown": ("--deterministic-shutdown",),
    "without --seccomp": ("--seccomp",),
}


async def flag_costs(jails: BenchJails, repeats: int) -> dict[str, Any]:
    """Wall and CPU ms per jail of `python -I -c pass` under each flag variant (interleaved)."""
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in FLAG_VARIANTS}
    for _ in range(repeats):
        for name, drop in FLAG_VARIANTS.items():
            samples[name].append(await _one_jail(jails, drop))
    out: dict[str, Any] = {}
    for name, values in samples.items():
        out[name] = {
            "wall_ms": round(statistics.median(v[0] for v in values), 1),
            "cpu_ms": round(statistics.median(v[1] for v in values), 1),
            "n": len(values),
        }
    return out


async def _one_jail(jails: BenchJails, drop: tuple[str, ...]) -> tuple[float, float]:
    workdir = await asyncio.to_thread(jails.dirs.create, "flags-" + secrets.token_hex(6))
    try:
        argv = [a for a in naive_argv(jails, workdir, "pass") if not a.startswith(drop or ("\0",))]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        proc = await asyncio.create_subprocess_exec(
            *argv,
            env=launcher_env(),
            cwd="/",
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        _, err = await proc.communicate()
        wall = (time.perf_counter() - t0) * 1000
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    finally:
        await asyncio.to_thread(shutil.rmtree, workdir, True)
    if proc.returncode != 0:
        raise BenchError(f"firejail {drop} exited {proc.returncode}: {err.decode(errors='replace')[-400:]}")
    cpu = (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) * 1000
    return wall, cpu
