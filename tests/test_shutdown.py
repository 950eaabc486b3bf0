"""SIGTERM: stop accepting, let running runs finish within the grace period, cancel the rest."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest
import websockets

from appliance.client import AsyncClient
from tests.support import jail_processes, start_server


async def test_a_run_shorter_than_the_grace_period_finishes_after_sigterm(tmp_path: Path) -> None:
    server = start_server(tmp_path, SANDBOX_SHUTDOWN_GRACE_MS="5000")
    async with AsyncClient(server.url) as c:
        task = asyncio.create_task(c.execute("import time\ntime.sleep(1.5)\nprint('finished')"))
        await asyncio.sleep(0.5)
        server.proc.send_signal(signal.SIGTERM)
        ex = await task
    assert ex.status == "ok" and ex.stdout == "finished\n"
    assert await asyncio.to_thread(server.proc.wait, 30) == 0
    with pytest.raises(ConnectionRefusedError):
        async with websockets.connect(server.url, open_timeout=2):
            pass


async def test_a_run_longer_than_the_grace_period_is_cancelled_with_a_done(tmp_path: Path) -> None:
    server = start_server(tmp_path, SANDBOX_SHUTDOWN_GRACE_MS="1000", SANDBOX_POOL_SIZE="0")
    async with AsyncClient(server.url) as c:
        task = asyncio.create_task(c.execute("import time\nprint('started', flush=True)\ntime.sleep(60)"))
        await asyncio.sleep(1.0)
        server.proc.send_signal(signal.SIGTERM)
        ex = await asyncio.wait_for(task, 20)
    assert ex.status == "cancelled" and "shutting down" in (ex.message or "")
    assert ex.stdout == "started\n"
    assert await asyncio.to_thread(server.proc.wait, 30) == 0
    assert jail_processes(server) == []
    assert '"msg": "stopped"' in server.logs()
