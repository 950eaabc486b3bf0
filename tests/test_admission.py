"""Admission: bounded concurrency, FIFO queue, `busy` past the queue."""

from __future__ import annotations

import asyncio
import math

import pytest

from appliance.core import backpressure
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


async def test_a_refusal_carries_a_hint_from_the_line_and_recent_runs() -> None:
    now = [0.0]
    adm = Admission(limit=2, max_queue=2, clock=lambda: now[0])
    assert adm.retry_after_ms() == 500  # (0/2 + 1) x the 1 s prior / 2 slots, before any run ended
    release = asyncio.Event()

    async def run() -> None:
        async with adm.slot():
            await release.wait()

    tasks = [asyncio.create_task(run()) for _ in range(4)]
    await asyncio.sleep(0)
    assert adm.active == 2 and adm.waiting == 2
    with pytest.raises(Busy) as refused:
        async with adm.slot():
            pass
    assert refused.value.retry_after_ms == adm.retry_after_ms() == 1000  # (2/2 + 1) x 1 s / 2
    now[0] = 4.0  # the runs held their slots 4 s: the running mean follows them
    release.set()
    await asyncio.gather(*tasks)
    assert adm.mean_run_s is not None and adm.mean_run_s > 1.0
    assert adm.retry_after_ms() == max(100, math.ceil(adm.mean_run_s / 2 * 1000))


def test_the_hint_is_bounded_and_grows_with_the_line_and_the_run_time() -> None:
    assert backpressure.retry_after_ms(0, 4, 0.0) == backpressure.FLOOR_MS
    assert backpressure.retry_after_ms(10_000, 1, 60.0) == backpressure.CEILING_MS
    assert backpressure.retry_after_ms(-3, 0, float("nan")) == 1000  # nonsense in: the prior, bounded
    assert backpressure.retry_after_ms(100, 4, 0.2) == 2550  # (50 + 1) x 0.2 s / 4 slots
    assert backpressure.retry_after_ms(100, 4, 0.4) > backpressure.retry_after_ms(20, 4, 0.4)
    assert backpressure.clamp_ms(float("inf")) == backpressure.CEILING_MS
    assert backpressure.clamp_ms(1.2) == backpressure.FLOOR_MS


class ByteLine:
    """One slot held, ten places in line, 100 bytes of request in all; `run` waits in it."""

    def __init__(self) -> None:
        self.adm = Admission(limit=1, max_queue=10, max_queue_bytes=100)
        self.hold = asyncio.Event()

    async def run(self, size: int) -> None:
        async with self.adm.slot(size):
            await self.hold.wait()

    async def start(self, size: int) -> asyncio.Task[None]:
        task = asyncio.create_task(self.run(size))
        await asyncio.sleep(0)
        return task


async def test_the_line_is_bounded_in_bytes_and_gives_them_back_whichever_way_a_waiter_leaves() -> None:
    line = ByteLine()
    adm, hold = line.adm, line.hold
    holder = await line.start(0)
    first = await line.start(60)
    await asyncio.sleep(0)
    assert adm.waiting == 1 and adm.queued_bytes == 60
    with pytest.raises(Busy, match="SANDBOX_MAX_QUEUE_BYTES"):
        async with adm.slot(50):
            pass
    second = await line.start(40)  # fits: 100 in all
    assert adm.waiting == 2 and adm.queued_bytes == 100
    second.cancel()  # a waiter that gives up gives its bytes back
    await asyncio.gather(second, return_exceptions=True)
    assert adm.waiting == 1 and adm.queued_bytes == 60
    hold.set()
    await asyncio.gather(holder, first)
    assert adm.active == 0 and adm.waiting == 0 and adm.queued_bytes == 0


async def test_a_request_over_the_byte_bound_still_waits_when_none_waits_before_it() -> None:
    line = ByteLine()
    adm, hold = line.adm, line.hold
    holder = await line.start(0)
    alone = await line.start(500)
    assert adm.waiting == 1 and adm.queued_bytes == 500
    hold.set()
    await asyncio.gather(holder, alone)
    assert adm.queued_bytes == 0
