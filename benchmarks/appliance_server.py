"""Start a real appliance (`python -m appliance serve`) as a subprocess and talk to it.

The benchmark measures the product as deployed: a separate server process, real
firejail jails, a real WebSocket. The server is started by `appliance.runtime.local`, the
same spawner the tests use.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from websockets.asyncio.client import ClientConnection, connect

from appliance.runtime import local
from appliance.runtime.local import LocalServer

REPO = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 120.0


class BenchError(RuntimeError):
    """Something the benchmark needs did not work (a server, a baseline, a wrong answer)."""


@dataclass
class ApplianceServer(LocalServer):
    """A running appliance subprocess (appliance.runtime.local), named for the benchmark's reports."""

    name: str = "server"

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

    def tail(self, chars: int = 2000) -> str:
        return self.logs()[-chars:]


def start_appliance(name: str, workdir: Path, **env: str) -> ApplianceServer:
    """Start `appliance serve` on a free loopback port with SANDBOX_* overrides; wait for /readyz."""
    try:
        server = local.start(workdir, env, name=name, timeout_s=START_TIMEOUT_S, cwd=REPO)
    except local.ServerStartError as exc:
        raise BenchError(str(exc)) from exc
    return ApplianceServer(server.proc, server.port, server.log, server.env, name)


def profiles_full(samples: dict[str, float]) -> bool:
    """Whether every profile's pool holds the jails it aims for. `appliance_pool_ready` and
    `appliance_pool_starting` are sums over the profiles, and a pool starts its refill only
    REFILL_DELAY_S after a run took a jail: right after a run the sums can read "enough ready,
    none starting" while the pool the run took from is one short and about to start a jail,
    which would then compete with the next measured run."""
    ready = "appliance_profile_pool_ready{"
    for name, value in samples.items():
        if name.startswith(ready):
            target = samples.get("appliance_profile_pool_target{" + name[len(ready) :], 0)
            if value < target:
                return False
    return True


async def wait_pool_idle(
    server: ApplianceServer, floor: int, timeout_s: float = 60.0, refills_done: bool = True
) -> None:
    """Wait until the pool holds `floor` ready jails, every profile's pool its target
    (`profiles_full`), it starts none, and no run is active.

    Latency samples are taken only then, so no refill competes with the measured run.
    `refills_done=False` does not wait for the refills (throughput levels, where the pool
    may still be topping up to what the previous level's arrival rate asked for).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        m = await asyncio.to_thread(server.metrics)
        if (
            m.get("appliance_pool_ready", 0) >= floor
            and (not refills_done or (m.get("appliance_pool_starting", 0) == 0 and profiles_full(m)))
            and m.get("appliance_active_runs", 0) == 0
        ):
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


def unwind_on_sigterm() -> None:
    """Make SIGTERM (`timeout`, a cancelled CI job) unwind a benchmark as Ctrl-C does: its
    `finally` blocks stop the servers it started and remove its cgroups. By default the
    signal ended the process on the spot, and they ran on, jails and all."""

    def unwind(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, unwind)
