"""Bounded concurrency with a bounded FIFO queue: run now, wait in line, or `busy`."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from types import TracebackType

from appliance.core import backpressure
from appliance.core.domain import RunRequest
from appliance.core.errors import Busy


class Admission:
    """At most `limit` runs at once; at most `max_queue` waiting, together holding at most
    `max_queue_bytes` of request (code and files: a waiting request keeps its body, so the
    count alone would let a full line hold max_queue of the largest messages); the rest are
    refused. A request waits whatever its size when none waits before it, so no valid request
    is refused for ever."""

    def __init__(
        self,
        limit: int,
        max_queue: int,
        clock: Callable[[], float] = time.monotonic,
        max_queue_bytes: int | None = None,
    ) -> None:
        self.limit = limit
        self._clock = clock
        self.max_queue = max_queue
        self.max_queue_bytes = max_queue_bytes
        self.active = 0
        self.queued_bytes = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self.mean_run_s: float | None = None  # how long a slot is held, recently (a running mean)

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def must_wait(self) -> bool:
        """Whether a slot asked for now would wait in line (or be refused)."""
        return self.active >= self.limit or bool(self._waiters)

    def retry_after_ms(self) -> int:
        """When a request refused now should come back (appliance.core.backpressure)."""
        mean = self.mean_run_s if self.mean_run_s is not None else backpressure.PRIOR_RUN_S
        return backpressure.retry_after_ms(len(self._waiters), self.limit, mean)

    def slot(self, size: int = 0) -> Slot:
        """Hold one run slot (`async with`) for a request of `size` bytes; entering gives the
        milliseconds spent queued. Leaving folds the time it was held into `mean_run_s`."""
        return Slot(self, size)

    def _held_for(self, seconds: float) -> None:
        self.mean_run_s = backpressure.smoothed(self.mean_run_s, seconds)
        self._release()

    async def _acquire(self, size: int) -> int:
        started = self._clock()
        if self.must_wait():
            if len(self._waiters) >= self.max_queue:
                raise Busy(
                    f"the run queue is full ({self.max_queue} waiting); try again later",
                    retry_after_ms=self.retry_after_ms(),
                )
            limit = self.max_queue_bytes
            if limit is not None and self._waiters and self.queued_bytes + size > limit:
                raise Busy(
                    f"the run queue is full ({self.queued_bytes} bytes of requests waiting, "
                    f"SANDBOX_MAX_QUEUE_BYTES {limit}); try again later",
                    retry_after_ms=self.retry_after_ms(),
                )
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            self.queued_bytes += size
            try:
                await fut
            except BaseException:
                if fut in self._waiters:
                    self._waiters.remove(fut)
                elif fut.done() and not fut.cancelled():
                    self._release()  # we were handed a slot we will not use
                raise
            finally:
                self.queued_bytes -= size  # out of the line, whichever way
            return int((self._clock() - started) * 1000)
        self.active += 1
        return 0

    def _release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # hand our slot over; `active` stays the same
                return
        self.active -= 1


def request_size(req: RunRequest) -> int:
    """What a waiting request holds that its sender chose the size of: its code and files."""
    return len(req.code) + sum(len(f.data) for f in req.files) if req.files else len(req.code)


class Slot:
    """One run slot of an `Admission`, held from `async with` to its end (a class of its own,
    not a generator's context manager: every run enters and leaves one)."""

    __slots__ = ("_admission", "_since", "_size")

    def __init__(self, admission: Admission, size: int) -> None:
        self._admission = admission
        self._size = size
        self._since = 0.0

    async def __aenter__(self) -> int:
        queued_ms = await self._admission._acquire(self._size)
        self._since = self._admission._clock()
        return queued_ms

    async def __aexit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        admission = self._admission
        admission._held_for(admission._clock() - self._since)
