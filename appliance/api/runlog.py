"""Runs kept for `attach`: every frame of a run numbered (`seq`), kept for a while after its
`done` within bounds, so that a client whose connection dropped finds its run again.

A run's events all go through its `RunLog` (`RunLog.emit` is the emit the run service is
given): each becomes its frame (`appliance.api.frames.frame_of`), numbered, encoded once,
kept, and sent to the sinks that follow the run live
(the connection or REST response that started it). A sink is awaited as the connection was
before, so a slow client slows its own run as it always did; a sink whose client is gone is
let go, and the run goes on to its end within its own limits. A reader that attaches later
(`RunLog.follow`) reads the kept frames, then waits for new ones; it never slows the run.

What a tenant can make the server hold without reading anything is bounded:
- one run keeps at most SANDBOX_MAX_OUTPUT_BYTES of frames (their size in memory): past that
  its oldest frames go (a reader sees the gap in `seq`), its `done` never does;
- a finished run is kept SANDBOX_REATTACH_S after its `done`; a tenant keeps at most
  SANDBOX_REATTACH_RUNS finished runs and SANDBOX_REATTACH_BYTES of frames (its running runs'
  frames counted too), and the server those times the number of tenants: past a bound the
  oldest finished run goes first, counted in /metrics (appliance_run_logs_evicted);
- running runs are bounded by what bounds runs (admission, the tenant's in-flight quota),
  each within its own SANDBOX_MAX_OUTPUT_BYTES.
A run that ended before it had a `start` (refused, busy) has no run id: it is not kept.

An unknown run, an expired one and another tenant's are the same to `find`: None.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import sys
import time
from collections import OrderedDict, deque
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass

from appliance.api.frames import frame_of
from appliance.core.domain import RunRequest
from appliance.core.errors import Cancelled
from appliance.core.events import Done, Event, Started
from appliance.core.ports import Metrics
from appliance.core.service import Run, RunService
from appliance.core.tasks import TaskScope
from appliance.wire import protocol

NO_SUCH_RUN = "no such run"  # unknown, expired, another tenant's: one answer for all three
Sink = Callable[[str], Awaitable[None]]  # sends one encoded frame; Cancelled once its client is gone
# What one kept frame costs beyond its text: the (seq, text) tuple, the int, the deque's slot.
FRAME_OVERHEAD = 96


def frame_cost(text: str) -> int:
    """Bytes of memory one kept frame holds (the str's own size: 1, 2 or 4 bytes a character)."""
    return sys.getsizeof(text) + FRAME_OVERHEAD


@dataclass(frozen=True)
class Bounds:
    """What the store may hold (appliance.settings: SANDBOX_REATTACH_*, SANDBOX_MAX_OUTPUT_BYTES)."""

    keep_s: float  # how long a finished run is kept after its done
    run_bytes: int  # one run's frames
    tenant_runs: int  # finished runs a tenant keeps
    tenant_bytes: int  # frames a tenant keeps (running and finished runs)
    tenants: int = 1  # the server keeps this many tenants' worth

    @property
    def total_runs(self) -> int:
        return self.tenant_runs * self.tenants

    @property
    def total_bytes(self) -> int:
        return self.tenant_bytes * self.tenants


class RunLog:
    """One run's frames, numbered and kept; the sinks following it live."""

    def __init__(self, store: RunStore, owner: str, rid: str, cap: int) -> None:
        self.store = store
        self.owner = owner
        self.rid = rid  # the request's id, which its frames carry
        self.run: str | None = None  # start.run, once the run has one
        self.handle: Run | None = None  # stdin, interrupt, the run's task
        self.frames: deque[tuple[int, str]] = deque()
        self.bytes = 0
        self.next_seq = 0
        self.done_seq: int | None = None
        self.ended_at = 0.0
        self._cap = cap
        self._sinks: list[Sink] = []
        self._changed: asyncio.Event | None = None  # made when a reader waits
        self.kept = True  # counted in the store (until it is forgotten)

    @property
    def done(self) -> bool:
        return self.done_seq is not None

    @property
    def task(self) -> asyncio.Task[None] | None:
        return self.handle.task if self.handle is not None else None

    def follow_live(self, sink: Sink) -> None:
        self._sinks.append(sink)

    def detach(self, sink: Sink) -> None:
        """The sink's client is gone or no longer reads: a run that started goes on without it.
        One that has not started yet (queued: no `start`, so no run id to attach to) and that
        nobody follows any more is cancelled, as every run was when its client went."""
        if sink in self._sinks:
            self._sinks.remove(sink)
        task = self.task
        if not self._sinks and self.run is None and not self.done and task is not None:
            task.cancel()

    async def emit(self, event: Event) -> None:
        """The run service's emit: the event's frame, numbered, kept and sent to the live sinks."""
        seq = self.next_seq
        self.next_seq = seq + 1
        frame = frame_of(self.rid, event)
        frame["seq"] = seq
        text = protocol.encode(frame)
        if isinstance(event, Started):
            self.store._started(self, event.run)
        self._keep(seq, text)
        ended = isinstance(event, Done)
        if ended:
            self.done_seq = seq
            self.ended_at = self.store.clock()
        changed = self._changed
        if changed is not None:
            self._changed = None
            changed.set()
        try:
            for sink in tuple(self._sinks):
                try:
                    await sink(text)
                except Cancelled:
                    self.detach(sink)
        finally:
            # The store files the finished run (and lets older ones go) once its `done` is
            # sent: that bookkeeping is not the client's to wait for. The log reads as done,
            # and is found, from the line above.
            if ended:
                self.store._ended(self)

    def _keep(self, seq: int, text: str) -> None:
        frames = self.frames
        frames.append((seq, text))
        grown = frame_cost(text)
        dropped = 0
        self.bytes += grown
        while self.bytes > self._cap and len(frames) > 1:
            _seq, old = frames.popleft()
            cost = frame_cost(old)
            self.bytes -= cost
            grown -= cost
            dropped += 1
        self.store._grew(self, grown, dropped)

    def kept_after(self, after: int) -> list[tuple[int, str]]:
        """The kept frames whose seq is above `after` (a gap where frames were let go)."""
        frames = self.frames
        if not frames:
            return []
        start = max(0, after + 1 - frames[0][0])
        n = len(frames)
        if start >= n:
            return []
        if start < n // 2:
            return list(itertools.islice(frames, start, None))
        # Near the end (a reader keeping up): indexed from the right, each step O(1).
        return [frames[i] for i in range(start, n)]

    async def follow(self, after: int = -1, rid: str | None = None) -> AsyncGenerator[str, None]:
        """The frames above `after`, then the new ones as they come, ending with the run's
        `done`, which is always sent last, even when `after` is past it. `rid`: the id the
        frames carry for this reader (else the run's own)."""
        cursor = after
        sent_done = False
        while True:
            for seq, text in self.kept_after(cursor):
                yield _relabel(text, rid) if rid is not None and rid != self.rid else text
                cursor = seq
                sent_done = sent_done or seq == self.done_seq
            done_seq = self.done_seq
            if done_seq is not None and (cursor >= done_seq or sent_done):
                if not sent_done:  # asked for what comes after the end: the done, again
                    text = self.frames[-1][1]
                    yield _relabel(text, rid) if rid is not None and rid != self.rid else text
                return
            if done_seq is None:
                changed = self._changed
                if changed is None:
                    changed = self._changed = asyncio.Event()
                await changed.wait()


def _relabel(text: str, rid: str) -> str:
    """A kept frame as one reader's request id carries it."""
    frame = json.loads(text)
    frame["id"] = rid
    return protocol.encode(frame)


@dataclass
class _Tenant:
    finished: OrderedDict[str, RunLog]  # run id -> log, the oldest done first
    bytes: int = 0
    logs: int = 0  # running and finished logs, to know when the entry can go


class RunStore:
    """Every run's log while it runs and for a while after; the runs' task scope."""

    def __init__(self, bounds: Bounds, metrics: Metrics, clock: Callable[[], float] = time.monotonic) -> None:
        self.bounds = bounds
        self.metrics = metrics
        self.clock = clock
        self.scope = TaskScope("runs")  # the runs: they outlive the connection that started them
        self._by_run: dict[str, RunLog] = {}  # started runs, running or finished
        self._running: set[RunLog] = set()
        self._finished: OrderedDict[RunLog, None] = OrderedDict()  # all tenants, oldest done first
        self._tenants: dict[str, _Tenant] = {}
        self.bytes = 0
        self._more = asyncio.Event()  # a run finished: the sweeper has a new expiry to wait for

    # -- lifecycle ---------------------------------------------------------------------------
    async def open(self) -> None:
        await self.scope.open()
        self.scope.spawn(self._sweep(), name="run-log-sweeper")

    async def close(self) -> None:
        """Cancel the runs still going (the shutdown interrupted them already) and the sweeper."""
        await self.scope.close()

    @property
    def running(self) -> list[RunLog]:
        return list(self._running)

    # -- runs ----------------------------------------------------------------------------------
    def start(self, service: RunService, req: RunRequest, owner: str, sink: Sink | None) -> RunLog:
        """Submit req as a task of the store's scope, its frames through a new log; `sink`
        follows it live. RuntimeError once the store is closing."""
        log = RunLog(self, owner, req.id, min(self.bounds.run_bytes, self.bounds.tenant_bytes))
        if sink is not None:
            log.follow_live(sink)
        self._tenant(owner).logs += 1
        self._running.add(log)
        try:
            handle = log.handle = service.submit(req, owner, log.emit, self.scope)
        except BaseException:
            self._forget(log)
            raise
        if handle.task is None:
            raise RuntimeError("RunService.submit returned a run without its task")
        handle.task.add_done_callback(lambda _task: self._task_ended(log))
        return log

    def find(self, run: str, owner: str) -> RunLog | None:
        """The caller's run `run`, running or finished and not yet expired; else None (unknown,
        expired and another tenant's are told apart by nobody)."""
        log = self._by_run.get(run)
        if log is None or not hmac.compare_digest(log.owner, owner):
            return None
        if log.done and self.clock() >= log.ended_at + self.bounds.keep_s:
            self._evict(log, "expired")
            return None
        return log

    def report(self) -> None:
        """Set the gauges (at a /metrics scrape: not on any run's path)."""
        self.metrics.run_logs.set(len(self._running) + len(self._finished))
        self.metrics.run_log_bytes.set(self.bytes)

    # -- what the logs tell the store ----------------------------------------------------------
    def _tenant(self, owner: str) -> _Tenant:
        tenant = self._tenants.get(owner)
        if tenant is None:
            tenant = self._tenants[owner] = _Tenant(OrderedDict())
        return tenant

    def _started(self, log: RunLog, run: str) -> None:
        log.run = run
        self._by_run[run] = log

    def _grew(self, log: RunLog, grown: int, dropped: int) -> None:
        if dropped:
            self.metrics.run_frames_dropped.inc(dropped)
        tenant = self._tenants.get(log.owner)
        if tenant is None or not log.kept:
            return
        tenant.bytes += grown
        self.bytes += grown
        if grown > 0:
            self._within_bounds(tenant)

    def _ended(self, log: RunLog) -> None:
        """The run's done is kept: it is kept for attach from now on, or forgotten."""
        self._running.discard(log)
        if log.run is None:  # it never started: nothing can attach to it
            self._forget(log)
            return
        if self.bounds.keep_s <= 0:
            self._evict(log, "expired")
            return
        tenant = self._tenants[log.owner]
        tenant.finished[log.run] = log
        self._finished[log] = None
        self._more.set()
        self._within_bounds(tenant)

    def _task_ended(self, log: RunLog) -> None:
        # A run cancelled before its done (the shutdown's last step) is not kept.
        if not log.done:
            self._forget(log)

    def _within_bounds(self, tenant: _Tenant) -> None:
        b = self.bounds
        while tenant.finished and (len(tenant.finished) > b.tenant_runs or tenant.bytes > b.tenant_bytes):
            oldest = next(iter(tenant.finished.values()))
            self._evict(oldest, "runs" if len(tenant.finished) > b.tenant_runs else "bytes")
        while self._finished and (len(self._finished) > b.total_runs or self.bytes > b.total_bytes):
            oldest = next(iter(self._finished))
            self._evict(oldest, "runs" if len(self._finished) > b.total_runs else "bytes")

    def _evict(self, log: RunLog, reason: str) -> None:
        """A finished run is no longer kept. A reader following it still holds it to its end."""
        self.metrics.run_logs_evicted.labels(reason=reason).inc()
        self._forget(log)

    def _forget(self, log: RunLog) -> None:
        if not log.kept:
            return
        log.kept = False
        self._running.discard(log)
        self._finished.pop(log, None)
        if log.run is not None and self._by_run.get(log.run) is log:
            del self._by_run[log.run]
        tenant = self._tenants.get(log.owner)
        if tenant is None:
            return
        if log.run is not None:
            tenant.finished.pop(log.run, None)
        tenant.bytes -= log.bytes
        self.bytes -= log.bytes
        log.bytes = 0
        tenant.logs -= 1
        if tenant.logs <= 0:
            del self._tenants[log.owner]

    async def _sweep(self) -> None:
        """Evict finished runs as they expire: the oldest done expires first."""
        keep_s = self.bounds.keep_s
        while True:
            now = self.clock()
            while self._finished:
                oldest = next(iter(self._finished))
                if oldest.ended_at + keep_s > now:
                    break
                self._evict(oldest, "expired")
            if self._finished:
                await asyncio.sleep(next(iter(self._finished)).ended_at + keep_s - now)
            else:
                self._more.clear()
                await self._more.wait()
