"""A trainer-shaped load: many generated stdlib programs with asserts, many clients at once.

    python -m benchmarks.trainer [--quick] [--programs N] [--clients 16,64,256] [--out DIR]

What an RL trainer or eval harness does: N programs (10,000 in the full run; `--quick` 200)
sent as one-shot runs by C concurrent HTTP clients, for C in 16, 64 and 256, against one
appliance at default settings (SANDBOX_MAX_CONCURRENCY 2 x CPUs, SANDBOX_MAX_QUEUE 256). A
request refused 429 is sent again after the server's hint, with the appliance client's own
policy (appliance_client.retry: jittered exponential backoff, never before Retry-After).
Per level: runs/s, p50/p99 of each request's time from its first send to its answer
(retries included), errors (a wrong answer or a status but ok), lost requests (no answer, or
a run the server did not count), runs counted twice, 429s, and runs/s as a share of the
jail-spawn capacity measured in the same run (JailFactory.launch + destroy of a bare jail).

The share is measured in slices (`--slices`, 5; quick 2): each level's programs go in that
many parts, with a capacity window before the first and after each, so every part is
bracketed by two windows a few seconds from it. A part's share is its runs/s (from its first
answer to its last, as the capacity counts spawns from the first to the last) over the mean of
its two windows; the level's is the median of its parts'. The report also gives each part's
share over the higher of its two windows (the strictest reading). Why: this machine's spawn
capacity moves by 10-25% between windows a minute apart (a shared VM), so one window before
all the levels, as earlier runs used, made the share read whatever that window happened to be.

Routes: `POST /run_code` (SandboxFusion's shape) where the server has it, else `POST /v1/exec`
(NDJSON); the report says which. Baseline in the same run: a naive server, one firejail
process per request with the appliance's flags (benchmarks.jails.naive_run), at the lowest
client count, on a share of the programs.

The issue's targets are reported as met or missed, never asserted: >= 0.9 of spawn capacity
at 64 clients; 0 errors and 0 lost at 256 (429s retried); p99 <= 3 s at 256. Writes
trainer.json and trainer.md (quick: trainer_quick.*) into --out (default benchmarks/results),
with the commit and the machine's load average (`uptime`) when it ran.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from appliance_client.retry import BusyRetry, hint_of_done, hint_of_header
from benchmarks.appliance_server import REPO, ApplianceServer, BenchError, start_appliance, wait_pool_idle
from benchmarks.evals import programs
from benchmarks.jails import BenchJails, naive_run, open_factory, spawn_capacity
from benchmarks.stats import percentile

RESULTS = REPO / "benchmarks" / "results"
FULL_PROGRAMS, QUICK_PROGRAMS = 10_000, 200
FULL_SLICES, QUICK_SLICES = 5, 2
# A capacity window: seconds, and jails at least (full, quick).
WINDOW = {False: (8.0, 40), True: (4.0, 20)}
LEVELS = (16, 64, 256)
# A trainer waits as long as it takes: the deadline only bounds a request the server keeps
# refusing (a lost server), far past any queue this load builds.
RETRY = BusyRetry(deadline_s=600.0, attempts=1000)
REQUEST_TIMEOUT_S = 600.0


@dataclass
class Level:
    """What one client count measured."""

    clients: int
    route: str
    programs: int = 0
    seconds: float = 0.0
    latencies_ms: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    lost: int = 0
    refused_429: int = 0
    counted_ok: float = 0.0  # runs the server counted ok during this level
    server_cpu_s: float = 0.0  # the server process's own CPU (its event loop and threads, not the jails)
    done_at: list[float] = field(default_factory=list)  # when each answer came (perf_counter)

    def sustained(self) -> float:
        """Runs/s between the first answer and the last, as `spawn_capacity` counts spawns (the
        ramp-up before anything completes is not what the machine sustains); over the whole
        level where fewer than two answers came."""
        if len(self.done_at) > 1 and max(self.done_at) > min(self.done_at):
            return (len(self.done_at) - 1) / (max(self.done_at) - min(self.done_at))
        return self.programs / self.seconds if self.seconds else 0.0

    def summary(self, spawns_per_s: float) -> dict[str, Any]:
        runs_per_s = self.programs / self.seconds if self.seconds else 0.0
        lat = self.latencies_ms or [0.0]
        answered_ok = len(self.latencies_ms) - len(self.errors)
        return {
            "clients": self.clients,
            "route": self.route,
            "programs": self.programs,
            "seconds": round(self.seconds, 2),
            "runs_per_s": round(runs_per_s, 2),
            "share_of_spawn_capacity": round(runs_per_s / spawns_per_s, 3) if spawns_per_s else None,
            "p50_ms": round(percentile(lat, 50), 1),
            "p99_ms": round(percentile(lat, 99), 1),
            "errors": len(self.errors),
            "error_examples": self.errors[:5],
            "lost": self.lost,
            "server_counted_ok": int(self.counted_ok),
            "ran_twice": max(0, int(self.counted_ok) - answered_ok),
            "refused_429": self.refused_429,
            "server_cpu_ms_per_run": round(self.server_cpu_s * 1000 / self.programs, 1)
            if self.programs
            else None,
        }


class Outcome:
    """One request's answer: ok with this stdout, or why not; `refused` when it was 429."""

    def __init__(self, status: str, stdout: str = "", hint_s: float | None = None) -> None:
        self.status, self.stdout, self.hint_s = status, stdout, hint_s


async def via_exec(http: aiohttp.ClientSession, base: str, code: str) -> Outcome:
    """POST /v1/exec: NDJSON frames, the last one `done`; 429 + Retry-After when busy."""
    async with http.post(base + "/v1/exec", json={"code": code}) as resp:
        if resp.status == 429:
            body = await resp.json()
            return Outcome(
                "busy", hint_s=hint_of_done(body) or hint_of_header(resp.headers.get("Retry-After"))
            )
        if resp.status != 200:
            return Outcome(f"http {resp.status}: {(await resp.text())[:200]}")
        stdout, status = "", "lost"
        async for line in resp.content:
            if not line.strip():
                continue
            frame = json.loads(line)
            if frame.get("type") == "stream" and frame.get("name") == "stdout":
                stdout += frame.get("text", "")
            elif frame.get("type") == "done":
                status = str(frame.get("status"))
        return Outcome(status, stdout)


async def via_run_code(http: aiohttp.ClientSession, base: str, code: str) -> Outcome:
    """POST /run_code, SandboxFusion's request and response; 429 + Retry-After when busy."""
    async with http.post(base + "/run_code", json={"code": code, "language": "python"}) as resp:
        if resp.status == 429:
            hint = hint_of_header(resp.headers.get("Retry-After"))
            with_body = await resp.json(content_type=None)
            if isinstance(with_body, dict):
                hint = hint_of_done(with_body) or hint
            return Outcome("busy", hint_s=hint)
        if resp.status != 200:
            return Outcome(f"http {resp.status}: {(await resp.text())[:200]}")
        body = await resp.json()
        run = body.get("run_result") or {}
        ok = body.get("status") == "Success" and run.get("status") == "Finished"
        return Outcome(
            "ok" if ok else f"{body.get('status')}/{run.get('status')}", str(run.get("stdout") or "")
        )


async def has_run_code(http: aiohttp.ClientSession, base: str) -> bool:
    async with http.post(base + "/run_code", json={"code": "print(1)", "language": "python"}) as resp:
        return resp.status != 404


async def level(server: ApplianceServer, clients: int, count: int, route: str, start: int = 0) -> Level:
    """`count` programs (from the `start`th) through `clients` concurrent HTTP clients on `route`."""
    work = programs(start + count)[start:]
    result = Level(clients, route, programs=count)
    send = via_run_code if route == "/run_code" else via_exec
    base = server.http
    next_index = iter(range(count))
    before = await asyncio.to_thread(server.metrics)
    cpu_before = _own_cpu_s(server.proc.pid)
    connector = aiohttp.TCPConnector(limit=clients)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:

        async def client() -> None:
            for i in next_index:
                code, expected = work[i]
                first = time.perf_counter()
                sends = 0
                while True:
                    sends += 1
                    try:
                        got = await send(http, base, code)
                    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as exc:
                        result.lost += 1
                        result.errors.append(f"#{i}: {type(exc).__name__}: {exc}"[:200])
                        break
                    if got.status == "busy":
                        result.refused_429 += 1
                        wait = RETRY.delay(sends, time.perf_counter() - first, got.hint_s)
                        if wait is not None:
                            await asyncio.sleep(wait)
                            continue
                    result.done_at.append(time.perf_counter())
                    result.latencies_ms.append((result.done_at[-1] - first) * 1000)
                    if got.status != "ok" or got.stdout != expected:
                        result.errors.append(f"#{i}: {got.status} {got.stdout[:80]!r}")
                    break

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        result.seconds = time.perf_counter() - started
    after = await asyncio.to_thread(server.metrics)
    result.server_cpu_s = _own_cpu_s(server.proc.pid) - cpu_before
    key = 'appliance_runs_total{status="ok"}'
    result.counted_ok = after.get(key, 0.0) - before.get(key, 0.0)
    answered_ok = len(result.latencies_ms) - len(result.errors)
    result.lost += max(0, answered_ok - int(result.counted_ok))  # answered ok, never counted: impossible
    return result


def merged(parts: list[Level]) -> Level:
    """One level from its slices: counts and seconds added, latencies and errors pooled."""
    out = Level(parts[0].clients, parts[0].route)
    for part in parts:
        out.programs += part.programs
        out.seconds += part.seconds
        out.latencies_ms += part.latencies_ms
        out.errors += part.errors
        out.lost += part.lost
        out.refused_429 += part.refused_429
        out.counted_ok += part.counted_ok
        out.server_cpu_s += part.server_cpu_s
    return out


def sliced_summary(parts: list[Level], windows: list[float]) -> dict[str, Any]:
    """The level's summary, its share the median of its slices' (each slice's sustained runs/s
    over the mean of the capacity windows before and after it: `windows` has one more than
    `parts`)."""
    rows = []
    for part, (before, after) in zip(parts, itertools.pairwise(windows), strict=True):
        runs = part.sustained()
        rows.append(
            {
                "programs": part.programs,
                "sustained_runs_per_s": round(runs, 2),
                "capacity_before": round(before, 2),
                "capacity_after": round(after, 2),
                "share": round(runs / ((before + after) / 2), 3) if before + after else None,
                "share_strict": round(runs / max(before, after), 3) if max(before, after) else None,
            }
        )
    summary = merged(parts).summary(statistics.mean(windows))
    shares = [r["share"] for r in rows if r["share"] is not None]
    strict = [r["share_strict"] for r in rows if r["share_strict"] is not None]
    summary["share_of_spawn_capacity"] = round(statistics.median(shares), 3) if shares else None
    summary["share_strict"] = round(statistics.median(strict), 3) if strict else None
    summary["slices"] = rows
    return summary


async def naive(jails: BenchJails, clients: int, count: int) -> dict[str, Any]:
    """The naive server: each request its own firejail process with the same flags, no pool,
    no queue (`clients` at once)."""
    work = programs(count)
    latencies: list[float] = []
    errors: list[str] = []
    next_index = iter(range(count))

    async def client() -> None:
        for i in next_index:
            code, expected = work[i]
            t0 = time.perf_counter()
            try:
                out = await naive_run(jails, code)
            except BenchError as exc:
                errors.append(str(exc)[:200])
                continue
            latencies.append((time.perf_counter() - t0) * 1000)
            if out != expected:
                errors.append(f"#{i}: {out[:80]!r}")

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    seconds = time.perf_counter() - started
    lat = latencies or [0.0]
    return {
        "clients": clients,
        "programs": count,
        "seconds": round(seconds, 2),
        "runs_per_s": round(count / seconds, 2),
        "p50_ms": round(percentile(lat, 50), 1),
        "p99_ms": round(percentile(lat, 99), 1),
        "errors": len(errors),
        "error_examples": errors[:5],
    }


def _own_cpu_s(pid: int) -> float:
    """A process's own user + system CPU seconds (not its children's: the jails are those)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _commit() -> str:
    out = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=False
    )
    return out.stdout.strip() or "unknown"


def _load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def targets(levels: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """(target, measured, MET/MISSED) for the issue's targets; nothing is asserted."""
    by = {lv["clients"]: lv for lv in levels}
    out: list[tuple[str, str, str]] = []
    if 64 in by and by[64]["share_of_spawn_capacity"] is not None:
        share = by[64]["share_of_spawn_capacity"]
        out.append(
            (">= 0.9 of spawn capacity at 64 clients", f"{share:.2f}", "MET" if share >= 0.9 else "MISSED")
        )
    if 256 in by:
        lv = by[256]
        clean = lv["errors"] == 0 and lv["lost"] == 0 and lv["ran_twice"] == 0
        out.append(
            (
                "0 errors, 0 lost at 256 clients (429s retried)",
                f"{lv['errors']} errors, {lv['lost']} lost, {lv['ran_twice']} ran twice, {lv['refused_429']} 429s",
                "MET" if clean else "MISSED",
            )
        )
        out.append(
            (
                "p99 <= 3 s at 256 clients",
                f"{lv['p99_ms'] / 1000:.2f} s",
                "MET" if lv["p99_ms"] <= 3000 else "MISSED",
            )
        )
    return out


async def run(  # noqa: PLR0913 (the command line's options, one each)
    quick: bool,
    count: int,
    clients: tuple[int, ...],
    out_dir: Path,
    route: str = "auto",
    slices: int | None = None,
) -> dict[str, Any]:
    load_before, commit = _load(), _commit()  # the code measured: HEAD as the run starts
    jails = await asyncio.to_thread(open_factory, {"SANDBOX_PRELOAD": ""})
    try:
        with tempfile.TemporaryDirectory(prefix="bench-trainer-") as tmp:
            server = await asyncio.to_thread(start_appliance, "trainer", Path(tmp))
            try:
                if route == "auto":
                    async with aiohttp.ClientSession() as http:
                        route = "/run_code" if await has_run_code(http, server.http) else "/v1/exec"
                parallel = 2 * (os.cpu_count() or 1)
                window_s, window_min = WINDOW[quick]
                n_slices = max(1, min(count, slices or (QUICK_SLICES if quick else FULL_SLICES)))

                async def window() -> float:
                    await wait_pool_idle(server, 1)
                    return (await spawn_capacity(jails, parallel, window_s, window_min)).spawns_per_s

                windows = [await window()]
                levels: list[dict[str, Any]] = []
                for c in clients:
                    parts: list[Level] = []
                    for k in range(n_slices):
                        start, end = count * k // n_slices, count * (k + 1) // n_slices
                        await wait_pool_idle(server, 1)
                        parts.append(await level(server, c, end - start, route, start))
                        windows.append(await window())
                    levels.append(sliced_summary(parts, windows[-n_slices - 1 :]))
                    print(json.dumps(levels[-1]), flush=True)
            finally:
                server.stop()
        baseline = await naive(jails, min(clients), max(20, count // 10))
    finally:
        jails.close()
    doc: dict[str, Any] = {
        "quick": quick,
        "machine": platform.node(),
        "cpus": os.cpu_count(),
        "commit": commit,
        "load_average_before": load_before,
        "load_average_after": _load(),
        "route": route,
        "spawn_capacity": {
            "spawns_per_s_before": round(windows[0], 2),
            "spawns_per_s_after": round(windows[-1], 2),
            "windows": [round(w, 2) for w in windows],
            "window_s": window_s,
            "parallel": parallel,
        },
        "slices": n_slices,
        "levels": levels,
        "naive_baseline": baseline,
    }
    doc["targets"] = targets(levels)
    write(doc, out_dir)
    return doc


def write(doc: dict[str, Any], out_dir: Path) -> None:
    name = "trainer_quick" if doc["quick"] else "trainer"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(doc, indent=1))
    cap = doc["spawn_capacity"]
    base = doc["naive_baseline"]
    md = [
        f"# Trainer-shaped load: generated stdlib programs with asserts, one-shot, through "
        f"`{doc['route']}` ({doc['cpus']} CPUs, commit {doc['commit']}{', quick' if doc['quick'] else ''})",
        "",
        f"Load average (`uptime`) before: {doc['load_average_before']}; after: {doc['load_average_after']} "
        "(the machine is shared: other work ran beside this).",
        f"Jail-spawn capacity in the same run ({cap['parallel']} at a time, windows of {cap['window_s']} s "
        f"before each level's first slice and after each slice; {doc['slices']} slices a level): "
        f"{', '.join(str(w) for w in cap['windows'])} "
        "spawns/s. A level's share is the median of its slices' (runs/s over the mean of the two windows "
        "around the slice); strict: over the higher of the two.",
        "",
        "| clients | programs | runs/s | share of spawn capacity (strict) | p50 ms | p99 ms | errors | lost "
        "| ran twice | 429s | server CPU ms/run |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        *(
            f"| {lv['clients']} | {lv['programs']} | {lv['runs_per_s']} | {lv['share_of_spawn_capacity']} "
            f"({lv['share_strict']}) | "
            f"{lv['p50_ms']} | {lv['p99_ms']} | {lv['errors']} | {lv['lost']} | {lv['ran_twice']} | {lv['refused_429']} "
            f"| {lv.get('server_cpu_ms_per_run', '')} |"
            for lv in doc["levels"]
        ),
        "",
        f"Naive baseline (a firejail process per request, the appliance's flags, no pool, no queue), "
        f"{base['clients']} clients, {base['programs']} programs: {base['runs_per_s']} runs/s, "
        f"p50 {base['p50_ms']} ms, p99 {base['p99_ms']} ms, {base['errors']} errors.",
        "",
        "Slices (runs/s from the first answer to the last, as the capacity counts spawns; share, strict):",
        "",
        *(
            f"- {lv['clients']} clients: "
            + "; ".join(
                f"{r['sustained_runs_per_s']} ({r['share']}, {r['share_strict']})" for r in lv["slices"]
            )
            for lv in doc["levels"]
        ),
        "",
        "With C clients each sending its next program as soon as the last is answered, a request's"
        " time is about C / (runs/s) (Little's law): the p99 target at 256 clients needs about"
        " 85 runs/s on this machine, whatever the queue does.",
        "",
        "| target | measured | |",
        "| --- | --- | --- |",
        *(f"| {t} | {m} | {v} |" for t, m, v in doc["targets"]),
        "",
    ]
    (out_dir / f"{name}.md").write_text("\n".join(md))
    print("\n".join(md))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_PROGRAMS} programs a level")
    parser.add_argument(
        "--programs", type=int, default=None, help=f"programs a level (full: {FULL_PROGRAMS})"
    )
    parser.add_argument(
        "--clients", default=",".join(map(str, LEVELS)), help="client counts, comma-separated"
    )
    parser.add_argument(
        "--route",
        choices=("auto", "/run_code", "/v1/exec"),
        default="auto",
        help="auto: /run_code where served",
    )
    parser.add_argument(
        "--slices",
        type=int,
        default=None,
        help=f"parts a level, a capacity window after each (full: {FULL_SLICES}, quick: {QUICK_SLICES})",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    count = args.programs or (QUICK_PROGRAMS if args.quick else FULL_PROGRAMS)
    clients = tuple(int(c) for c in args.clients.split(",") if c.strip())
    if count < 1 or not clients or min(clients) < 1 or (args.slices is not None and args.slices < 1):
        parser.error("--programs, --slices and every --clients count must be at least 1")
    quick = args.quick or count < FULL_PROGRAMS
    asyncio.run(run(quick, count, clients, args.out, args.route, args.slices))
    return 0


if __name__ == "__main__":
    sys.exit(main())
