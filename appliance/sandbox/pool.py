"""A pool of started, verified, single-use jails, refilled in the background.

A run takes a ready jail (its driver is up and the preload imported), uses it once
and destroys it. When the pool is empty a run starts a cold jail instead; it never
fails for want of a pooled one. A jail that dies, or idles past `max_idle_s`, is
dropped and replaced.

Sizing: `size` is the floor. The target grows with the arrival rate (Little's law:
jails consumed while one is being started, with 50% headroom) up to `max_size`, and
never past what the host's available memory affords at the measured PSS per jail.
Refills start at nice 10 and at most two at a time, so they never starve running work;
a jail is set back to nice 0 once it is ready (and idle), before any run can take it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
from collections import Counter, deque
from collections.abc import Callable

from appliance.core.errors import JailFailure, JailStartFailed
from appliance.core.tasks import TaskScope, cancel_and_wait, checkpoint, within
from appliance.sandbox.jail import Jail, JailFactory
from appliance.sandbox.profiles import Profile, choose, imports_of

log = logging.getLogger("appliance.pool")

REFILL_NICE = 10
RATE_WINDOW_S = 10.0
MEMORY_RESERVE_KB = 512 * 1024  # never let warm jails eat the last 512 MiB
TICK_S = 1.0
REFILL_DELAY_S = 0.05
# A ready jail's PSS is measured again at most this often: the jails of one pool start alike,
# and each measurement reads every process's smaps_rollup, which walks its whole address space.
PSS_EVERY_S = 10.0
MEMINFO_BYTES = 8192  # the whole of /proc/meminfo (MemAvailable is its third line)


def mem_available_kb() -> int:
    """MemAvailable, in KiB (0 where unreadable). One raw read: the pool asks at every refill
    decision, and a buffered text file cost twice as much."""
    try:
        fd = os.open("/proc/meminfo", os.O_RDONLY | os.O_CLOEXEC)
        try:
            text = os.read(fd, MEMINFO_BYTES)
        finally:
            os.close(fd)
    except OSError:
        return 0
    start = text.find(b"MemAvailable:")
    if start < 0 or (start > 0 and text[start - 1 : start] != b"\n"):
        return 0
    try:
        return int(text[start + 13 : text.find(b"\n", start)].split()[0])
    except (ValueError, IndexError):
        return 0


def pool_target(  # noqa: PLR0913 (a pure sizing policy of named, keyword-only inputs)
    *,
    floor: int,
    ceiling: int,
    arrivals_per_s: float,
    start_s: float,
    have: int,
    jail_pss_kb: int,
    mem_available_kb: int,
) -> int:
    """Ready-or-starting jails to aim for. Pure.

    Little's law: while one jail starts (start_s), arrivals_per_s * start_s runs arrive and
    each consumes a jail; 50% headroom on top. Never below the floor, never above the
    ceiling, and growth past the floor only as far as available memory affords at the
    measured PSS per jail, keeping MEMORY_RESERVE_KB free.
    """
    if floor == 0:
        return 0
    wanted = max(floor, min(ceiling, math.ceil(arrivals_per_s * start_s * 1.5)))
    if wanted > floor and jail_pss_kb > 0:
        affordable = max(0, (mem_available_kb - MEMORY_RESERVE_KB) // jail_pss_kb)
        wanted = max(floor, min(wanted, have + affordable))
    return wanted


class JailPool:
    """Keeps between `size` and `max_size` ready jails (size 0 turns pooling off)."""

    def __init__(
        self, factory: JailFactory, size: int, max_size: int | None = None, max_idle_s: float = 600.0
    ) -> None:
        self.factory = factory
        self.size = size
        self.max_size = max(size, max_size if max_size is not None else size)
        self.max_idle_s = max_idle_s
        self.ready: deque[Jail] = deque()
        self.starting = 0
        self.cold_starts = 0
        self.jail_pss_kb = 0
        self._pss_at = -math.inf  # when jail_pss_kb was last measured (`PSS_EVERY_S`)
        self._arrivals: deque[float] = deque()
        self._start_s: deque[float] = deque(maxlen=20)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None  # the refill loop, a child of its owner's scope
        self._nudge: asyncio.TimerHandle | None = None
        self._closing = False
        self._failures = 0

    def start(self, owner: TaskScope) -> None:
        if self._task is None and self.size > 0:
            self._task = owner.spawn(self._refill_loop(), name="pool-refill")

    async def take(self) -> Jail:
        """A ready jail from the pool, or a cold-started one when none is ready."""
        self._arrivals.append(time.monotonic())
        # Refill a moment later: a jail start is CPU-heavy and the run that just took a
        # jail usually finishes within milliseconds; starting now would compete with it.
        # A timer, not a task: it only sets an event, and the pool keeps its handle and
        # cancels it at close (one pending nudge at a time).
        loop = asyncio.get_running_loop()
        if self._nudge is None or self._nudge.when() <= loop.time():
            self._nudge = loop.call_later(REFILL_DELAY_S, self._wake.set)
        while self.ready:
            jail = self.ready.popleft()
            if jail.alive:
                return jail
            await jail.destroy()
        self.cold_starts += 1
        try:
            return await self.factory.launch()
        except JailStartFailed as exc:
            # firejail failed before the driver was up (e.g. host mounts changing under its
            # setup): transient, and nothing was judged or ran; one more try, then give up.
            log.warning("jail start failed; trying once more", extra={"error": exc.message})
            return await self.factory.launch()

    def target(self) -> int:
        """How many jails should be ready or starting now."""
        now = time.monotonic()
        while self._arrivals and now - self._arrivals[0] > RATE_WINDOW_S:
            self._arrivals.popleft()
        return pool_target(
            floor=self.size,
            ceiling=self.max_size,
            arrivals_per_s=len(self._arrivals) / RATE_WINDOW_S,
            start_s=sum(self._start_s) / len(self._start_s) if self._start_s else 0.5,
            have=len(self.ready) + self.starting,
            jail_pss_kb=self.jail_pss_kb,
            mem_available_kb=mem_available_kb() if self.jail_pss_kb else 0,
        )

    async def _refill_loop(self) -> None:
        # The loop's scope owns the jail starts and the idle jails' watchers: cancelling the
        # loop (close) cancels them and waits for them.
        async with TaskScope("pool-jails") as jails:
            while not self._closing:
                await self._retire_stale()
                target = self.target()
                parallel = 2 if target - len(self.ready) > 2 else 1
                while self.starting < parallel and len(self.ready) + self.starting < target:
                    self.starting += 1
                    jails.spawn(self._start_one(jails), name="pool-jail-start")
                while len(self.ready) > target and len(self.ready) > self.size:
                    await self.ready.pop().destroy()  # shrink back once the burst is over
                self._wake.clear()
                checkpoint()
                with contextlib.suppress(TimeoutError):
                    await within(self._wake.wait(), TICK_S)

    async def _start_one(self, jails: TaskScope) -> None:
        started = time.monotonic()
        try:
            if self._closing:
                return
            jail = await self.factory.launch(nice=REFILL_NICE)
        except (JailFailure, OSError) as exc:  # OSError: e.g. the temp root is full or gone
            if self._closing:
                return
            self._failures += 1
            message = exc.message if isinstance(exc, JailFailure) else str(exc)
            log.error("pool refill failed", extra={"error": message, "failures": self._failures})
            await asyncio.sleep(min(30.0, 0.5 * 2 ** min(self._failures, 6)))
            return
        finally:
            self.starting -= 1
            self._wake.set()
        self._failures = 0
        self._start_s.append(time.monotonic() - started)
        if self._closing:
            await jail.destroy()
            return
        now = time.monotonic()
        if not self.jail_pss_kb or now - self._pss_at >= PSS_EVERY_S:
            self._pss_at = now  # before the wait: two starts ending together measure once
            self.jail_pss_kb = await asyncio.to_thread(jail.process.pss_kb) or self.jail_pss_kb
        # Started nice'd and at idle CPU weight so that its startup never competes with running
        # work; ready, it is idle and waits at normal priority and the run's limits, so that
        # taking it costs a run nothing more.
        jail.process.renice(0)
        try:
            jail.make_ready(self.factory.run_limits)
        except OSError as exc:  # fail closed: no code runs under limits that were not set
            log.error("could not give a warm jail its run's cgroup limits", extra={"error": str(exc)})
            await jail.destroy()
            return
        self.ready.append(jail)
        jails.spawn(self._watch(jail), name="pool-jail-watch")

    async def _watch(self, jail: Jail) -> None:
        # A jail's driver exiting while it waits in the pool means it is no longer usable.
        await jail.process.wait()
        if jail in self.ready:
            self.ready.remove(jail)
            log.warning("idle jail died; replacing it", extra={"jail": jail.id})
            await jail.destroy()
            self._wake.set()

    async def _retire_stale(self) -> None:
        now = time.monotonic()
        for jail in [j for j in self.ready if now - j.created > self.max_idle_s]:
            self.ready.remove(jail)
            await jail.destroy()

    async def close(self) -> None:
        self._closing = True
        self._wake.set()
        if self._nudge is not None:
            self._nudge.cancel()
        if self._task is not None:  # its scope cancels and awaits the starts and watchers
            await cancel_and_wait(self._task)
        while self.ready:
            await self.ready.popleft().destroy()


class ProfilePools:
    """One JailPool per preload profile (appliance.sandbox.profiles), each sized from its own
    traffic: a run takes from the pool whose profile fits its code."""

    def __init__(self, pools: dict[Profile, JailPool]) -> None:
        if not pools:
            raise ValueError("no pools")
        self.pools = pools
        self.profiles = tuple(pools)
        self.runs: Counter[str] = Counter()  # profile name -> runs given one of its jails
        self.imported: Counter[str] = Counter()  # preloaded package -> runs whose code imports it
        self._preloaded = frozenset().union(*(p.tops for p in self.profiles))
        self._plain = choose(self.profiles, frozenset())  # code that imports nothing: most runs

    @classmethod
    def build(
        cls,
        profiles: tuple[Profile, ...],
        make_factory: Callable[[Profile], JailFactory],
        size: int,
        max_size: int | None = None,
    ) -> ProfilePools:
        return cls({p: JailPool(make_factory(p), size, max_size=max_size) for p in profiles})

    def profile_for(self, code: str) -> Profile:
        """The profile a run of `code` gets (and what it is counted as having imported)."""
        imports = imports_of(code)
        if imports is not None and not imports:
            profile = self._plain
        else:
            profile = choose(self.profiles, imports)
            if imports is not None:  # code too long to scan is counted as importing nothing
                self.imported.update(imports & self._preloaded)
        self.runs[profile.name] += 1
        return profile

    def start(self, owner: TaskScope) -> None:
        for pool in self.pools.values():
            pool.start(owner)

    async def close(self) -> None:
        for pool in self.pools.values():
            await pool.close()
