"""A run's hold on a jail, from the moment it is admitted until everything is undone.

    async with leases.lease(request) as lease:      # held in line first (GPU memory, FIFO)
        async with admission.slot():
            jail = await lease.take()               # a ready jail, limits armed, watched
            ...run the cell...
    # leaving: the jail is killed, reaped and removed; what it held is handed back

`PoolLeases` (here) hands out pooled CPU jails. `appliance.gpu.lease.GpuLeases` hands out
jails that see one GPU, each under the run's GPU budget; it keeps a `PoolLeases` for runs
that ask for no GPU. A session `keep()`s its lease past the request and `end()`s it when
the session closes.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
from types import TracebackType
from typing import Self

from appliance.core.domain import RunRequest
from appliance.core.events import GpuShare
from appliance.core.tasks import TaskScope
from appliance.sandbox.jail import Jail
from appliance.sandbox.pool import JailPool, ProfilePools


class Lease(abc.ABC):
    """One run's (or session's) jail and what must be undone when it ends."""

    def __init__(self, profile: str, queued_ms: int = 0, gpu: GpuShare | None = None) -> None:
        self.profile = profile  # the preload profile of the jail (appliance.sandbox.profiles)
        self.queued_ms = queued_ms  # time spent in line for the lease (GPU memory), not the slot
        self.gpu = gpu  # the run's GPU share (its `Started` says it); None for a CPU run
        self.jail: Jail | None = None
        self.kept = False
        self._ended = False

    @abc.abstractmethod
    async def take(self) -> Jail:
        """A ready jail for this lease (called once, inside the run's admission slot)."""

    def keep(self) -> None:
        """A session holds this lease past its first request; it calls `end()` itself."""
        self.kept = True

    async def end(self) -> None:
        """Kill, reap and remove the jail and hand back what it held; idempotent."""
        if self._ended:
            return
        self._ended = True
        await self._end()

    @abc.abstractmethod
    async def _end(self) -> None: ...

    # `async with` over a lease gives it, and ends it on leaving unless a session kept it: a
    # class's own methods, not a generator's context manager, on every run's path.
    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if not self.kept:
            await self.end()


class LeaseSource(abc.ABC):
    """What the run service takes jails from."""

    @abc.abstractmethod
    def lease(self, req: RunRequest) -> contextlib.AbstractAsyncContextManager[Lease]:
        """Hold a lease for req: ended on leaving, unless kept by a session."""

    @abc.abstractmethod
    async def close(self) -> None:
        """End every lease's pending teardown and drain the pools."""


class PoolLease(Lease):
    def __init__(self, source: PoolLeases, pool: JailPool, profile: str) -> None:
        super().__init__(profile)
        self._source = source
        self._pool = pool

    async def take(self) -> Jail:
        self.jail = await self._pool.take()
        return self.jail

    async def _end(self) -> None:
        if self.jail is None:
            return
        if self.kept:  # a session closing: its caller expects the jail gone
            await self.jail.destroy()
        else:
            self._source.teardown(self.jail)


class PoolLeases(LeaseSource):
    """Pooled, single-use CPU jails, one pool per preload profile; a run gets the profile its
    code fits. A jail's teardown (SIGKILL, reap, remove) starts as the run's `done` goes out
    (`teardown`)."""

    def __init__(self, pools: ProfilePools, owner: TaskScope) -> None:
        self.pools = pools
        self._owner = owner  # the teardown tasks' owner
        self._teardowns: set[asyncio.Task[None]] = set()
        self._doomed: list[Jail] = []  # ended, their teardown not started yet
        self._soon: asyncio.Handle | None = None

    def lease(self, req: RunRequest) -> contextlib.AbstractAsyncContextManager[Lease]:
        profile = self.pools.profile_for(req.code)
        return PoolLease(self, self.pools.pools[profile], profile.name)

    def teardown(self, jail: Jail) -> None:
        """Kill, reap and remove a one-shot run's jail in a task of its own.

        The task is made at the loop's next turn and its first step SIGKILLs the jail: both
        come once the run's task yields, which is after that task has written its `done` (a
        send waits only for a client that stopped reading). So neither making the task nor
        the kill is on the run's path: the kill falls just after `done` instead of just
        before it, where waking the sleeping jail and waiting for its teardown would add both
        to every warm round trip (benchmarks/results/micro-opts.md). Nothing of the run is
        left to observe the order: its final disk check, outputs and counters were taken
        already (while its processes lived, as a forged `done` event allows anyway), and its
        limits hold until the kill.
        """
        self._doomed.append(jail)
        if self._soon is None:
            self._soon = asyncio.get_running_loop().call_soon(self._start_teardowns)

    def _start_teardowns(self) -> None:
        self._soon = None
        if not self._owner.running:  # closing: `close` destroys them
            return
        doomed, self._doomed = self._doomed, []
        for jail in doomed:
            task = self._owner.spawn(jail.destroy(), name="jail-teardown")
            self._teardowns.add(task)
            task.add_done_callback(self._teardowns.discard)

    async def close(self) -> None:
        if self._soon is not None:
            self._soon.cancel()
            self._soon = None
        doomed, self._doomed = self._doomed, []
        await asyncio.gather(*self._teardowns, *(jail.destroy() for jail in doomed), return_exceptions=True)
        await self.pools.close()
