"""Bounded concurrency with a bounded FIFO queue: run now, wait in line, or `busy`."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from appliance.errors import Busy


class Admission:
    """At most `limit` runs at once; at most `max_queue` waiting; the rest are refused."""

    def __init__(self, limit: int, max_queue: int) -> None:
        self.limit = limit
        self.max_queue = max_queue
        self.active = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[int]:
        """Hold one run slot; yields the milliseconds spent queued."""
        started = time.monotonic()
        if self.active >= self.limit or self._waiters:
            if len(self._waiters) >= self.max_queue:
                raise Busy(f"the run queue is full ({self.max_queue} waiting); try again later")
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            try:
                await fut
            except BaseException:
                if fut in self._waiters:
                    self._waiters.remove(fut)
                elif fut.done() and not fut.cancelled():
                    self._release()  # we were handed a slot we will not use
                raise
        else:
            self.active += 1
        try:
            yield int((time.monotonic() - started) * 1000)
        finally:
            self._release()

    def _release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # hand our slot over; `active` stays the same
                return
        self.active -= 1
