"""Start a real appliance (`python -m appliance serve`) as a subprocess and talk to it.

The benchmark measures the product as deployed: a separate server process, real
firejail jails, a real WebSocket. This mirrors `tests/support.start_server`, but the
benchmark is an entry point of its own and does not import the test package.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from websockets.asyncio.client import ClientConnection, connect

REPO = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 120.0


class BenchError(RuntimeError):
    """Something the benchmark needs did not work (a server, a baseline, a wrong answer)."""


@dataclass
class ApplianceServer:
    """A running appliance subprocess and where to reach it."""

    name: str
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/exec"

    def get(self, path: str) -> tuple[int, str]:
        """A plain HTTP GET against the server (for /readyz and /metrics)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=10) as resp:
                return int(resp.status), resp.read().decode()
        except OSError as exc:
            code = getattr(exc, "code", 0)
            return int(code or 0), str(exc)

    def metrics(self) -> dict[str, float]:
        """The server's /metrics as {sample name with labels: value} (no parser dependency)."""
        status, body = self.get("/metrics")
        if status != 200:
            raise BenchError(f"{self.name}: /metrics answered {status}")
        samples: dict[str, float] = {}
        for line in body.splitlines():
            if not line or line.startswith("#"):
                continue
            name, _, value = line.rpartition(" ")
            try:
                samples[name] = float(value)
            except ValueError:
                continue
        return samples

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM, wait for the graceful shutdown (which drains the pool), KILL if it hangs."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def tail(self, chars: int = 2000) -> str:
        return self.log.read_text(errors="replace")[-chars:]


def start_appliance(name: str, workdir: Path, **env: str) -> ApplianceServer:
    """Start `appliance serve` on a free loopback port with SANDBOX_* overrides; wait for /readyz."""
    workdir.mkdir(parents=True, exist_ok=True)
    ready = workdir / f"{name}.port"
    ready.unlink(missing_ok=True)
    log = workdir / f"{name}.log"
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SANDBOX_")}
    full_env["SANDBOX_PYTHON"] = sys.executable
    full_env.update(env)
    cmd = [sys.executable, "-m", "appliance", "serve", "--host", "127.0.0.1", "--port", "0",
           "--ready-file", str(ready)]
    with open(log, "wb") as log_fh:
        proc = subprocess.Popen(cmd, env=full_env, stdout=subprocess.DEVNULL, stderr=log_fh, cwd=REPO)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ready.exists() or not ready.read_text().strip():
        if proc.poll() is not None:
            raise BenchError(f"{name}: server exited {proc.returncode}:\n{log.read_text()[-2000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise BenchError(f"{name}: server did not start:\n{log.read_text()[-2000:]}")
        time.sleep(0.05)
    server = ApplianceServer(name, proc, int(ready.read_text()), log)
    while server.get("/readyz")[0] != 200:
        if proc.poll() is not None or time.monotonic() > deadline:
            server.stop()
            raise BenchError(f"{name}: server never became ready:\n{server.tail()}")
        time.sleep(0.1)
    return server


async def wait_pool_idle(server: ApplianceServer, floor: int, timeout_s: float = 60.0,
                         refills_done: bool = True) -> None:
    """Wait until the pool holds `floor` ready jails, starts none, and no run is active.

    Latency samples are taken only then, so no refill competes with the measured run.
    `refills_done=False` does not wait for the refills (throughput levels, where the pool
    may still be topping up to what the previous level's arrival rate asked for).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        m = await asyncio.to_thread(server.metrics)
        if (m.get("appliance_pool_ready", 0) >= floor and (m.get("appliance_pool_starting", 0) == 0 or not refills_done)
                and m.get("appliance_active_runs", 0) == 0):
            return
        if time.monotonic() > deadline:
            raise BenchError(f"{server.name}: the pool did not refill to {floor} in {timeout_s:.0f} s")
        await asyncio.sleep(0.02)


async def open_ws(url: str) -> ClientConnection:
    """A client WebSocket without compression (neither side should measure zlib)."""
    return await connect(url, compression=None, max_size=None, open_timeout=30)


@dataclass
class RunReply:
    """What one request produced, gathered from its frames."""

    status: str
    stdout: str
    frames: list[dict[str, Any]]
    session: str | None


async def execute(ws: ClientConnection, rid: str, code: str, session: str | None = None) -> RunReply:
    """Send one execute request and read frames until its `done`."""
    request: dict[str, Any] = {"type": "execute", "id": rid, "code": code}
    if session is not None:
        request["session"] = session
    await ws.send(json.dumps(request))
    frames: list[dict[str, Any]] = []
    stdout = []
    while True:
        frame = json.loads(await ws.recv())
        if frame.get("id") != rid:
            continue
        frames.append(frame)
        kind = frame.get("type")
        if kind == "stream" and frame.get("name") == "stdout":
            stdout.append(frame.get("text", ""))
        elif kind == "done":
            return RunReply(str(frame.get("status")), "".join(stdout), frames, frame.get("session"))
