"""Admission: bounded concurrency, FIFO queue, `busy` past the queue."""

from __future__ import annotations

import asyncio

import pytest

from appliance.core.admission import Admission
from appliance.core.errors import Busy


async def test_runs_beyond_the_limit_wait_in_order_and_the_queue_overflow_is_busy() -> None:
    adm = Admission(limit=1, max_queue=2)
    order: list[int] = []
    release = asyncio.Event()

    async def run(i: int) -> None:
        async with adm.slot():
            order.append(i)
            await release.wait()

    first = asyncio.create_task(run(0))
    await asyncio.sleep(0)
    waiters = [asyncio.create_task(run(i)) for i in (1, 2)]
    await asyncio.sleep(0)
    assert adm.active == 1 and adm.waiting == 2
    with pytest.raises(Busy, match="queue is full"):
        async with adm.slot():
            pass
    release.set()
    await asyncio.gather(first, *waiters)
    assert order == [0, 1, 2] and adm.active == 0 and adm.waiting == 0


async def test_a_cancelled_waiter_gives_its_place_back() -> None:
    adm = Admission(limit=1, max_queue=5)
    hold = asyncio.Event()

    async def holder() -> None:
        async with adm.slot():
            await hold.wait()

    h = asyncio.create_task(holder())
    await asyncio.sleep(0)
    w = asyncio.create_task(holder())
    await asyncio.sleep(0)
    w.cancel()
    await asyncio.gather(w, return_exceptions=True)
    hold.set()
    await h
    assert adm.active == 0 and adm.waiting == 0
