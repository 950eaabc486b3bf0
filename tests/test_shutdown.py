"""SIGTERM: stop accepting, let running runs finish within the grace period, cancel the rest."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
import websockets

from appliance_client.client import AsyncClient
from tests.support import cmdline, jail_processes, scaled, start_server


async def test_a_run_shorter_than_the_grace_period_finishes_after_sigterm(tmp_path: Path) -> None:
    server = start_server(tmp_path, SANDBOX_SHUTDOWN_GRACE_MS="5000")
    async with AsyncClient(server.url) as c:
        # SIGTERM once the run has started (its first line came back), not after a fixed time
        # that a loaded machine may not have spent starting it.
        up = asyncio.Event()
        code = "import time\nprint('started', flush=True)\ntime.sleep(1.5)\nprint('finished')"
        task = asyncio.create_task(c.execute(code, on_stdout=lambda _: up.set()))
        await asyncio.wait_for(up.wait(), scaled(30))
        server.proc.send_signal(signal.SIGTERM)
        ex = await task
    assert ex.status == "ok" and ex.stdout == "started\nfinished\n"
    assert await asyncio.to_thread(server.proc.wait, 30) == 0
    with pytest.raises(ConnectionRefusedError):
        async with websockets.connect(server.url, open_timeout=2):
            pass


async def test_a_run_longer_than_the_grace_period_is_cancelled_with_a_done(tmp_path: Path) -> None:
    server = start_server(tmp_path, SANDBOX_SHUTDOWN_GRACE_MS="1000", SANDBOX_POOL_SIZE="0")
    async with AsyncClient(server.url) as c:
        up = asyncio.Event()
        code = "import time\nprint('started', flush=True)\ntime.sleep(60)"
        task = asyncio.create_task(c.execute(code, on_stdout=lambda _: up.set()))
        await asyncio.wait_for(up.wait(), scaled(30))  # a cold jail: seconds on a loaded machine
        server.proc.send_signal(signal.SIGTERM)
        ex = await asyncio.wait_for(task, 20)
    assert ex.status == "cancelled" and "shutting down" in (ex.message or "")
    assert ex.stdout == "started\n"
    assert await asyncio.to_thread(server.proc.wait, 30) == 0
    assert jail_processes(server) == []
    assert '"msg": "stopped"' in server.logs()


def test_a_start_interrupted_before_the_server_is_ready_leaves_no_server(tmp_path: Path) -> None:
    # Ctrl-C (or a SIGTERM a benchmark turns into an exception) while `appliance.runtime.local.start`
    # waits for the server: the half-started server is stopped, not left running with its pool.
    def interrupt(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.3)  # the server's imports alone take longer
    try:
        with pytest.raises(KeyboardInterrupt):
            start_server(tmp_path, SANDBOX_POOL_SIZE="2")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    # start_server's stop waited for the server itself; the check is that it was stopped at all.
    left = [int(p) for p in os.listdir("/proc") if p.isdigit() and str(tmp_path) in cmdline(int(p))]
    assert left == [], "a half-started server was left running"
