"""Create + first run through the E2B SDK, beside the native protocol, in one run.

    python -m benchmarks.e2b [--quick] [--out DIR]

One server; three sides take turns, each sample taken with the warm pool full and idle:

- e2b: `AsyncSandbox.create()` then `run_code("print(2 + 2)")`, the SDK's own client (two
  HTTP calls: the sandbox's session is opened from the warm pool, then its first cell runs);
  the two calls are also reported apart (create, first run_code);
- e2b-http: the same two calls as bare HTTP requests on one kept-alive httpx client (the
  server's share of the SDK's time: what is left is the SDK's own);
- e2b-js: the JavaScript SDK's `Sandbox.create()` + `runCode(...)`, timed in a node process
  the benchmark paces (tests/js/e2b/bench.mjs; left out, and said so, where `make js` has
  not installed the SDK);
- native: on an open WebSocket, `{"session": "new", "code": "print(2 + 2)"}` to its `done`
  (one round trip opens the session and runs the cell).

Teardown (kill, close_session) is not timed. Published figures for comparison (E2B's cloud,
create to first command): median 0.44 s, p95 0.85 s; Daytona's: 0.11 s. Writes e2b.json and
e2b.md (quick: e2b_quick.*) into --out (default benchmarks/results), with the load average
before and after (the machine may be shared: compare the ratios, taken in one run).
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

import httpx
from e2b_code_interpreter import AsyncSandbox

from benchmarks.appliance_server import REPO, BenchError, execute, open_ws, start_appliance, wait_pool_idle
from benchmarks.stats import summarize

RESULTS = REPO / "benchmarks" / "results"
JS_DIR = REPO / "tests" / "js" / "e2b"
JS_NODE = JS_DIR / "node_modules" / ".bin" / "node"  # pinned with the SDK (make js)
CALLER = "any"  # the API key: the server has no token (as the native side), so any key is taken


def _commit() -> str:
    out = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=False
    )
    return out.stdout.strip() or "unknown"


async def sample(base: str, url: str, reps: int, server: Any) -> dict[str, list[float]]:
    keys = ("e2b", "e2b_create", "e2b_first_run", "e2b_http", "e2b_js", "e2b_js_create", "native")
    out: dict[str, list[float]] = {k: [] for k in keys}
    ws = await open_ws(url)
    opts = {"api_key": CALLER, "api_url": base, "sandbox_url": base}
    node = await _start_node(base)
    sides = 4 if node is not None else 3
    try:
        async with httpx.AsyncClient() as http:
            for i in range(sides * reps):
                await wait_pool_idle(server, 1)
                side = i % sides
                if side == 3 and node is not None:
                    total, create = await _js_sample(node)
                    out["e2b_js"].append(total)
                    out["e2b_js_create"].append(create)
                    continue
                if side == 0:
                    t0 = time.perf_counter()
                    sb = await AsyncSandbox.create(**opts)
                    t1 = time.perf_counter()
                    execution = await sb.run_code("print(2 + 2)")
                    t2 = time.perf_counter()
                    await sb.kill()
                    if execution.logs.stdout != ["4\n"]:
                        raise BenchError(f"the SDK's run printed {execution.logs.stdout!r}")
                    out["e2b"].append((t2 - t0) * 1000)
                    out["e2b_create"].append((t1 - t0) * 1000)
                    out["e2b_first_run"].append((t2 - t1) * 1000)
                elif side == 1:
                    out["e2b_http"].append(await _bare_http(http, base))
                else:
                    t0 = time.perf_counter()
                    reply = await execute(ws, f"r{i}", "print(2 + 2)", session="new")
                    took = time.perf_counter() - t0
                    if reply.status != "ok" or reply.stdout != "4\n" or reply.session is None:
                        raise BenchError(f"the native run ended {reply.status}: {reply.stdout!r}")
                    await ws.send(
                        json.dumps({"type": "close_session", "id": f"c{i}", "session": reply.session})
                    )
                    while json.loads(await ws.recv()).get("id") != f"c{i}":
                        pass
                    out["native"].append(took * 1000)
    finally:
        await ws.close()
        if node is not None and node.stdin is not None:
            node.stdin.close()
            await node.wait()
    return out


async def _start_node(base: str) -> asyncio.subprocess.Process | None:
    """The JavaScript SDK's driver (tests/js/e2b/bench.mjs), or None where it is not installed."""
    if not (JS_NODE.exists() and (JS_DIR / "node_modules" / "@e2b" / "code-interpreter").is_dir()):
        print(f"e2b-js left out: the JavaScript SDK is not installed in {JS_DIR} (make js)", file=sys.stderr)
        return None
    env = {**os.environ, "E2B_API_URL": base, "E2B_SANDBOX_URL": base, "E2B_API_KEY": CALLER}
    return await asyncio.create_subprocess_exec(
        str(JS_NODE),
        "bench.mjs",
        cwd=JS_DIR,
        env=env,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )


async def _js_sample(node: asyncio.subprocess.Process) -> tuple[float, float]:
    """One create + first run through the JavaScript SDK: (total, create) in ms, timed by node."""
    if node.stdin is None or node.stdout is None:
        raise BenchError("the node driver has no pipes")
    node.stdin.write(b"go\n")
    await node.stdin.drain()
    line = await asyncio.wait_for(node.stdout.readline(), 60)
    if not line:
        raise BenchError(f"the JavaScript SDK's driver ended (exit status {await node.wait()})")
    sample = json.loads(line)
    if sample["stdout"] != ["4\n"]:
        raise BenchError(f"the JavaScript SDK's run printed {sample['stdout']!r}")
    return float(sample["total_ms"]), float(sample["create_ms"])


async def _bare_http(http: httpx.AsyncClient, base: str) -> float:
    """The SDK's two calls as bare requests (ms); the sandbox is killed after, untimed."""
    t0 = time.perf_counter()
    created = await http.post(
        f"{base}/sandboxes", json={"templateID": "code-interpreter-v1"}, headers={"X-API-Key": CALLER}
    )
    box = created.json()
    ran = await http.post(
        f"{base}/execute",
        json={"code": "print(2 + 2)"},
        headers={
            "E2b-Sandbox-Id": box["sandboxID"],
            "E2b-Sandbox-Port": "49999",
            "X-Access-Token": box["envdAccessToken"],
        },
    )
    took = time.perf_counter() - t0
    await http.delete(f"{base}/sandboxes/{box['sandboxID']}", headers={"X-API-Key": CALLER})
    lines = [json.loads(line) for line in ran.text.splitlines() if line.strip()]
    if ran.status_code != 200 or {"type": "stdout", "text": "4\n"} not in [
        {k: line.get(k) for k in ("type", "text")} for line in lines
    ]:
        raise BenchError(f"the bare run answered {ran.status_code}: {ran.text[:300]!r}")
    return took * 1000


def _load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


ROWS = (
    ("E2B SDK: AsyncSandbox.create + run_code", "e2b"),
    ("… of which AsyncSandbox.create", "e2b_create"),
    ("… of which the first run_code", "e2b_first_run"),
    ("the same two calls, bare HTTP (httpx, kept alive)", "e2b_http"),
    ("E2B JavaScript SDK: Sandbox.create + runCode", "e2b_js"),
    ("… of which Sandbox.create", "e2b_js_create"),
    ('native: {"session": "new"} + its first cell, one WebSocket round trip', "native"),
)


def report(quick: bool, out_dir: Path, samples: dict[str, list[float]], load_before: str) -> dict[str, Any]:
    s = {k: summarize(v) for k, v in samples.items() if v}
    doc: dict[str, Any] = {
        "quick": quick,
        "machine": platform.node(),
        "cpus": os.cpu_count(),
        "commit": _commit(),
        "load_average": {"before": load_before, "after": _load()},
        "summary": {k: v.__dict__ for k, v in s.items()},
        "samples": samples,
        "ratio_p50": s["e2b"].p50_ms / s["native"].p50_ms,
        "ratio_http_p50": s["e2b_http"].p50_ms / s["native"].p50_ms,
    }
    if "e2b_js" in s:
        doc["ratio_js_p50"] = s["e2b_js"].p50_ms / s["native"].p50_ms
    name = "e2b_quick" if quick else "e2b"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(doc, indent=1))
    md = [
        f"# create + first run: E2B SDK beside the native protocol ({doc['cpus']} CPUs, commit "
        f"{doc['commit']}{', quick' if quick else ''}; load average {load_before} before, "
        f"{doc['load_average']['after']} after)",
        "",
        "| what | n | p50 ms | p90 ms | p99 ms |",
        "| --- | --- | --- | --- | --- |",
        *(
            f"| {label} | {s[k].n} | {s[k].p50_ms:.1f} | {s[k].p90_ms:.1f} | {s[k].p99_ms:.1f} |"
            for label, k in ROWS
            if k in s
        ),
        "",
        f"E2B SDK / native (p50): {doc['ratio_p50']:.2f}x; bare HTTP / native: {doc['ratio_http_p50']:.2f}x"
        + (f"; JavaScript SDK / native: {doc['ratio_js_p50']:.2f}x. " if "ratio_js_p50" in doc else ". ")
        + "Published, create to first command: E2B's cloud median 440 ms (p95 850 ms), Daytona 110 ms.",
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
            load_before = _load()
            samples = await sample(f"http://127.0.0.1:{server.port}/e2b", url, 3 if quick else 30, server)
        finally:
            server.stop()
    return report(quick, out_dir, samples, load_before)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    asyncio.run(main_async(args.quick, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
