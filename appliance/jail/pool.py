"""A pool of started, verified, single-use jails, refilled in the background.

A run takes a ready jail (its driver is up and the preload imported), uses it once
and destroys it. When the pool is empty a run starts a cold jail instead; it never
fails for want of a pooled one. A jail that dies while idle is dropped and replaced.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque

from appliance.errors import JailFailure
from appliance.jail.jail import Jail, JailFactory

log = logging.getLogger("appliance.pool")


class JailPool:
    """Keeps `size` ready jails (0 turns pooling off)."""

    def __init__(self, factory: JailFactory, size: int, max_starting: int = 1) -> None:
        self.factory = factory
        self.size = size
        self.max_starting = max_starting
        self.ready: deque[Jail] = deque()
        self.starting = 0
        self.cold_starts = 0
        self.replaced = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._watchers: set[asyncio.Task[None]] = set()
        self._closing = False

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._refill_loop(), name="pool-refill")

    async def take(self) -> Jail:
        """A ready jail from the pool, or a cold-started one when none is ready."""
        while self.ready:
            jail = self.ready.popleft()
            self._wake.set()
            if jail.alive:
                return jail
            await jail.destroy()
        self._wake.set()
        self.cold_starts += 1
        return await self.factory.launch()

    async def _refill_loop(self) -> None:
        failures = 0
        while not self._closing:
            while not self._closing and len(self.ready) + self.starting < self.size:
                if self.starting >= self.max_starting:
                    break
                self.starting += 1
                try:
                    jail = await self.factory.launch()
                except JailFailure as exc:
                    failures += 1
                    log.error("pool refill failed", extra={"error": exc.message, "failures": failures})
                    await asyncio.sleep(min(30.0, 0.5 * 2 ** min(failures, 6)))
                    continue
                finally:
                    self.starting -= 1
                failures = 0
                if self._closing:
                    await jail.destroy()
                    return
                self.ready.append(jail)
                watcher = asyncio.create_task(self._watch(jail))
                self._watchers.add(watcher)
                watcher.add_done_callback(self._watchers.discard)
            self._wake.clear()
            await self._wake.wait()

    async def _watch(self, jail: Jail) -> None:
        # A jail's driver exiting while it waits in the pool means it is no longer usable.
        await jail.process.wait()
        if jail in self.ready:
            self.ready.remove(jail)
            self.replaced += 1
            log.warning("idle jail died; replacing it", extra={"jail": jail.id})
            await jail.destroy()
            self._wake.set()

    async def close(self) -> None:
        self._closing = True
        self._wake.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for watcher in list(self._watchers):
            watcher.cancel()
        while self.ready:
            await self.ready.popleft().destroy()
