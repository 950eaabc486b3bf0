"""GPU memory reservations per device (by UUID), with a strict FIFO queue.

A run asks for `memory_mb`. It is admitted to a device where

    reserved (all grants on it) + margin per running run + memory_mb + margin + foreign <= total

(`foreign` = memory used on the device by anything that is not a run's reservation,
learned by reconciling with the backend); among the devices that fit, the one with the
most room left wins. Otherwise it waits in one FIFO queue: the head blocks those behind
it, so a big request is never starved by small ones. A request that could not fit even
on an empty device is rejected at once, never queued; a wait longer than `max_wait_ms`
ends `busy`.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from appliance.core.errors import Busy, RequestRejected
from appliance.core.events import GpuShare
from appliance.core.tasks import within
from appliance.gpu.backend import Device, ProcessUsage


@dataclass(frozen=True)
class Grant:
    """A reservation: `memory_mb` on device `index`/`uuid` (node /dev/nvidia<minor>)."""

    ticket: int
    index: int
    uuid: str
    minor: int
    memory_mb: int
    queued_ms: int

    def share(self) -> GpuShare:
        """What the run is told it holds (its `Started` event's `gpu`)."""
        return GpuShare(self.index, self.uuid, self.memory_mb)


@dataclass
class _Reclaim:
    memory_mb: int
    ids: frozenset[int]  # the run's process and thread IDs, as last seen
    released: float  # monotonic time of the release
    deadline: float


@dataclass
class DeviceBook:
    index: int
    uuid: str
    minor: int
    total_mb: int
    foreign_mb: int = 0
    over_grant_mb: int = 0  # what running runs hold beyond their grants (until the watchdog stops them)
    grants: dict[int, int] = field(default_factory=dict)  # ticket -> MiB
    # Released grants still held until NVML no longer lists their run's IDs (frees are late).
    reclaiming: dict[int, _Reclaim] = field(default_factory=dict)
    reclaim_timeouts: int = 0
    reclaim_note: str | None = None

    @property
    def reserved_mb(self) -> int:
        return sum(self.grants.values()) + sum(r.memory_mb for r in self.reclaiming.values())

    def room_mb(self, margin_mb: int) -> int:
        # The watchdog stops a run only past grant + margin, so each running run may hold its
        # margin too: that slack is kept for it, or two runs each within their limits could
        # together take memory a third run was granted. What they hold beyond all of it (an
        # overrunner until the watchdog stops it) is kept as well; the new run needs its own.
        beyond = max(self.over_grant_mb, margin_mb * len(self.grants))
        return self.total_mb - self.reserved_mb - self.foreign_mb - beyond - margin_mb


@dataclass
class _Waiter:
    ticket: int
    memory_mb: int
    started: float
    future: asyncio.Future[Grant]


class GpuLedger:
    """Reservations for every device; all methods run on the event loop (no locking needed)."""

    def __init__(
        self, devices: Iterable[Device], margin_mb: int, max_wait_ms: int, reclaim_ms: int = 0
    ) -> None:
        self.margin_mb = margin_mb
        self.reclaim_ms = reclaim_ms
        self.reclaim_waits_s: list[float] = []  # finished reclaim waits, drained by /metrics
        self.max_wait_ms = max_wait_ms
        self.books: dict[str, DeviceBook] = {}
        self._queue: deque[_Waiter] = deque()
        self._tickets = itertools.count(1)
        self.reconciles = 0
        self.load(devices, processes=(), ours=())

    # -- state -------------------------------------------------------------------------------
    @property
    def waiting(self) -> int:
        return len(self._queue)

    def load(
        self,
        devices: Iterable[Device],
        processes: Iterable[ProcessUsage],
        ours: Iterable[int],
        taken_at: float | None = None,
    ) -> None:
        """Reconcile with what the backend reports: totals, and memory used by non-runs.

        `ours` are the host PIDs of running runs: their usage is covered by their grants, up to
        the grants' sum; everything else a device reports as used is foreign.
        """
        ours_set = set(ours)
        ours_used: dict[str, int] = {}
        processes = list(processes)
        if taken_at is not None:
            self._reclaim(processes, taken_at)
        for proc in processes:
            if proc.pid in ours_set and proc.used_mb is not None:  # unknown: stays foreign (kept off)
                ours_used[proc.uuid] = ours_used.get(proc.uuid, 0) + proc.used_mb
        seen = set()
        for dev in devices:
            seen.add(dev.uuid)
            book = self.books.get(dev.uuid)
            if book is None:
                book = self.books[dev.uuid] = DeviceBook(dev.index, dev.uuid, dev.minor, dev.total_mb)
            book.index, book.minor, book.total_mb = dev.index, dev.minor, dev.total_mb
            # Our runs' usage is covered by their grants only up to the grants: what they hold
            # beyond (an overrunner between polls, until the watchdog stops it) is memory no
            # grant reserves, so it admits nobody, though it is not foreign.
            ours_mb = ours_used.get(dev.uuid, 0)
            book.foreign_mb = max(0, dev.used_mb - ours_mb)
            book.over_grant_mb = max(0, ours_mb - sum(book.grants.values()))
        for uuid in list(self.books):
            if uuid not in seen and not self.books[uuid].grants and not self.books[uuid].reclaiming:
                del self.books[uuid]  # a device that vanished takes no new runs
            elif uuid not in seen:
                self.books[uuid].total_mb = 0
        self.reconciles += 1
        self._pump()

    def snapshot(self) -> list[dict[str, int | str]]:
        """Per-device totals for /metrics, /readyz and the benchmark."""
        return [
            {
                "index": b.index,
                "uuid": b.uuid,
                "total_mb": b.total_mb,
                "reserved_mb": b.reserved_mb,
                "foreign_mb": b.foreign_mb,
                "runs": len(b.grants),
                "reclaiming": len(b.reclaiming),
                "reclaim_timeouts": b.reclaim_timeouts,
                **({"over_grant_mb": b.over_grant_mb} if b.over_grant_mb else {}),
                **({"note": b.reclaim_note} if b.reclaim_note else {}),
            }
            for b in self._ordered()
        ]

    # -- admission ---------------------------------------------------------------------------
    async def acquire(self, memory_mb: int) -> Grant:
        """A grant for memory_mb, now or after waiting in line; RequestRejected / Busy otherwise."""
        if memory_mb <= 0:
            raise RequestRejected("'gpu.memory_mb' must be a positive integer")
        largest = max((b.total_mb for b in self.books.values()), default=0)
        if memory_mb + self.margin_mb > largest:
            raise RequestRejected(
                f"gpu.memory_mb={memory_mb} can never fit: the largest GPU has {largest} MiB "
                f"and {self.margin_mb} MiB are kept as margin (SANDBOX_GPU_MARGIN_MB)"
            )
        waiter = _Waiter(
            next(self._tickets), memory_mb, time.monotonic(), asyncio.get_running_loop().create_future()
        )
        self._queue.append(waiter)
        self._pump()
        try:
            return await within(asyncio.shield(waiter.future), self.max_wait_ms / 1000)
        except TimeoutError:
            self._abandon(waiter)
            raise Busy(
                f"no GPU had {memory_mb} MiB free within {self.max_wait_ms} ms "
                f"(SANDBOX_GPU_QUEUE_MS); try again later"
            ) from None
        except BaseException:
            self._abandon(waiter)
            raise

    def release(self, grant: Grant, ids: Iterable[int] = ()) -> None:
        """Return a grant's memory and admit whoever now fits.

        With `ids` (the run's process and thread IDs) and a reclaim wait configured, the
        memory stays reserved until a backend reading taken after this release lists none
        of them (GPU memory is freed asynchronously after a kill), or until `reclaim_ms`
        passes: then the device is marked, and what NVML still shows counts as foreign.
        """
        book = self.books.get(grant.uuid)
        if book is not None:
            mb = book.grants.pop(grant.ticket, None)
            id_set = frozenset(ids)
            if mb is not None and id_set and self.reclaim_ms > 0:
                now = time.monotonic()
                book.reclaiming[grant.ticket] = _Reclaim(mb, id_set, now, now + self.reclaim_ms / 1000)
        self._pump()

    def _reclaim(self, processes: list[ProcessUsage], taken_at: float) -> None:
        """Drop held grants whose run no longer shows in a reading taken after their release."""
        listed = {p.pid for p in processes}
        now = time.monotonic()
        for book in self.books.values():
            for ticket, r in list(book.reclaiming.items()):
                if taken_at < r.released:
                    continue  # the reading predates the kill: it proves nothing
                if not r.ids & listed:
                    del book.reclaiming[ticket]
                    self.reclaim_waits_s.append(now - r.released)
                elif now >= r.deadline:
                    del book.reclaiming[ticket]
                    book.reclaim_timeouts += 1
                    book.reclaim_note = (
                        f"{r.memory_mb} MiB of a finished run still listed by NVML after "
                        f"{self.reclaim_ms} ms (SANDBOX_GPU_RECLAIM_MS); counted as foreign"
                    )
                    self.reclaim_waits_s.append(now - r.released)

    def _abandon(self, waiter: _Waiter) -> None:
        if waiter in self._queue:
            self._queue.remove(waiter)
        elif waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
            self.release(waiter.future.result())  # granted just as we gave up: hand it back
        if not waiter.future.done():
            waiter.future.cancel()
        self._pump()

    def _pump(self) -> None:
        """Admit from the head of the queue while the head fits; reject heads that never can."""
        largest = max((b.total_mb for b in self.books.values()), default=0)
        while self._queue:
            head = self._queue[0]
            if head.future.done():
                self._queue.popleft()
                continue
            if head.memory_mb + self.margin_mb > largest:  # devices shrank or vanished
                self._queue.popleft()
                head.future.set_exception(
                    RequestRejected(f"gpu.memory_mb={head.memory_mb} can no longer fit on any GPU")
                )
                continue
            book = self._best_fit(head.memory_mb)
            if book is None:
                return
            self._queue.popleft()
            book.grants[head.ticket] = head.memory_mb
            head.future.set_result(
                Grant(
                    ticket=head.ticket,
                    index=book.index,
                    uuid=book.uuid,
                    minor=book.minor,
                    memory_mb=head.memory_mb,
                    queued_ms=int((time.monotonic() - head.started) * 1000),
                )
            )

    def _best_fit(self, memory_mb: int) -> DeviceBook | None:
        fitting = [b for b in self._ordered() if b.room_mb(self.margin_mb) >= memory_mb]
        if not fitting:
            return None
        return max(fitting, key=lambda b: (b.room_mb(self.margin_mb), -b.index))

    def _ordered(self) -> list[DeviceBook]:
        return sorted(self.books.values(), key=lambda b: b.index)
