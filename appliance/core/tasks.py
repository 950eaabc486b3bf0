"""Who owns a background task: a `TaskScope`, an asyncio.TaskGroup with a start and an end.

Every task the server starts is a child of one scope (structured concurrency): the
server's (started with the app, closed at its cleanup), the runs' (appliance.api.runlog:
every run, so that it outlives the connection that started it, and the sweeper of kept
frames; closed by the shutdown), a connection's (its attaches and answers), the
lifecycle's (canary, sweeper, pool refills, watchdogs, teardowns), or a scope a coroutine
holds while it runs (a pool's jail starts, a REST request's client watch). Closing a scope cancels its children and waits for all of them: nothing it
started outlives it. `tests/test_tasks.py` keeps raw `create_task`, `call_later` and
kin out of the package but for the owners it names.

Unlike a bare TaskGroup, a child's unexpected error ends that child only: it is logged,
and neither its siblings (other runs, warm jails) nor the scope's holder are cancelled,
as before there were owners (asyncio logs a task's unretrieved error the same way).

A cancelled task must end, or the `close()` that cancelled it waits forever. So: a bounded
wait is `within(aw, seconds)`, never `asyncio.wait_for` (on Python 3.11 it returns its
awaitable's result, dropping the cancellation, when both land in the same turn of the loop;
tests/test_tasks.py checks), nor `asyncio.timeout` in a cleanup (on 3.11, in a task already
cancelled, it raises CancelledError at expiry, not TimeoutError, so a fallback on TimeoutError
never runs); `wait_ended`/`cancel_and_wait` rather than awaiting a task under
`suppress(CancelledError)` (which swallows the caller's own cancellation too); and a long-lived
loop calls `checkpoint()` between its steps, so that a cancellation swallowed below (by code of
ours or a library's) still ends it. A close that has waited CLOSE_REPORT_S logs which
children it still waits on, and where each one is.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Coroutine, Iterable
from types import TracebackType
from typing import Any, TypeVar

T = TypeVar("T")

log = logging.getLogger("appliance.tasks")

CLOSE_REPORT_S = 30.0


def checkpoint() -> None:
    """Raise CancelledError if the current task was asked to stop: for a loop, between its
    steps. A cancellation swallowed somewhere below leaves its request counted
    (`Task.cancelling()`); without this, the loop would go on (to a long sleep, say) and the
    scope closing it would wait on it forever."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def awaiting(task: asyncio.Task[Any]) -> list[str]:
    """Where a suspended task is, outermost first: its chain of awaited coroutines
    (`Task.get_stack` shows only the outermost)."""
    where: list[str] = []
    step: Any = task.get_coro()
    while step is not None:
        frame = getattr(step, "cr_frame", None) or getattr(step, "gi_frame", None)
        if frame is not None:
            where.append(f"{frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}")
        step = getattr(step, "cr_await", None) or getattr(step, "gi_yieldfrom", None)
    return where


async def wait_ended(task: asyncio.Future[Any]) -> None:
    """Wait until `task` has ended, and raise its error if it ended with one (its cancellation
    is not an error here). A cancellation of the caller propagates: awaiting the task under
    `suppress(CancelledError)` would swallow it, as it cannot tell the two apart."""
    await asyncio.wait([task])
    if not task.cancelled():
        task.result()


async def cancel_and_wait(task: asyncio.Future[Any]) -> None:
    """Cancel `task`, then `wait_ended`."""
    task.cancel()
    await wait_ended(task)


async def within(aw: Awaitable[T], timeout_s: float) -> T:
    """`aw`'s result, or TimeoutError once `timeout_s` has passed (`aw` cancelled and ended
    first). A cancellation of the caller propagates (`aw` cancelled and ended first too), even
    one that lands as `aw` completes; and the timeout is a TimeoutError even in a task already
    cancelled (a cleanup's bounded wait). See the module's doc for why not wait_for or timeout."""
    task = asyncio.ensure_future(aw)
    try:
        done, _ = await asyncio.wait([task], timeout=timeout_s)
    except BaseException:
        await _stop(task)
        raise
    if not done:
        await _stop(task)
        raise TimeoutError
    return task.result()


async def _stop(task: asyncio.Future[Any]) -> None:
    task.cancel()
    await asyncio.wait([task])
    if not task.cancelled():
        task.exception()  # retrieved: its outcome no longer matters, and asyncio would log it


class TaskScope:
    """Owns a set of tasks from `open()` (or `async with`) to `close()`."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._group = asyncio.TaskGroup()
        self._children: set[asyncio.Task[None]] = set()
        self._state = "new"  # new -> open -> closing -> closed
        self._closed = asyncio.Event()

    async def open(self) -> TaskScope:
        if self._state != "new":
            raise RuntimeError(f"task scope {self.name!r} was opened already")
        await self._group.__aenter__()
        self._state = "open"
        return self

    async def __aenter__(self) -> TaskScope:
        return await self.open()

    async def __aexit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    @property
    def running(self) -> bool:
        """Whether `spawn` is allowed now (opened, not closing)."""
        return self._state == "open"

    def spawn(self, coro: Coroutine[Any, Any, None], *, name: str | None = None) -> asyncio.Task[None]:
        """Start `coro` as a child. A closed (or closing) scope refuses: what asks for a task
        then must do its work itself or not at all, never leave it unowned."""
        if self._state != "open":
            coro.close()
            raise RuntimeError(f"task scope {self.name!r} is {self._state}: it starts no task")
        task = self._group.create_task(self._guarded(coro), name=name)
        self._children.add(task)
        # One callback, not one per chore: each is a step of the loop as the task ends.
        task.add_done_callback(functools.partial(self._ended, coro))
        return task

    def _ended(self, coro: Coroutine[Any, Any, None], task: asyncio.Task[None]) -> None:
        self._children.discard(task)
        # A child cancelled before its first step never awaited `coro`: close it (a no-op for
        # one that ran), as a task made straight from `coro` would have.
        coro.close()

    async def _guarded(self, coro: Coroutine[Any, Any, None]) -> None:
        try:
            await coro
        except Exception:
            log.exception("background task failed", extra={"scope": self.name})

    @property
    def tasks(self) -> frozenset[asyncio.Task[None]]:
        """The children still running."""
        return frozenset(self._children)

    async def wait(
        self, timeout_s: float | None = None, tasks: Iterable[asyncio.Task[None]] | None = None
    ) -> bool:
        """Let `tasks` (default: all children) finish, for at most `timeout_s`; True if they did."""
        pending = set(self._children if tasks is None else tasks)
        if not pending:
            return True
        _done, left = await asyncio.wait(pending, timeout=timeout_s)
        return not left

    async def cancel(self, *tasks: asyncio.Task[None] | None) -> None:
        """Cancel some children (None: skipped) and wait until they have ended."""
        chosen = [t for t in tasks if t is not None]
        for task in chosen:
            task.cancel()
        if chosen:
            await asyncio.wait(chosen)

    async def close(self) -> None:
        """Cancel every child and wait until all have ended (a child's own cleanup included).
        A second caller waits for the first one's close to end."""
        if self._state in ("closing", "closed"):
            await self._closed.wait()
            return
        if self._state == "new":
            self._state = "closed"
            self._closed.set()
            return
        self._state = "closing"
        for task in list(self._children):
            task.cancel()
        # A child that does not end is a bug (a swallowed cancellation): say which, and where.
        report = asyncio.get_running_loop().call_later(CLOSE_REPORT_S, self._report_stuck)
        try:
            # Exited as a TaskGroup is at the end of its block: it waits for every child.
            await self._group.__aexit__(None, None, None)
        finally:
            report.cancel()
            self._state = "closed"
            self._closed.set()

    def _report_stuck(self) -> None:
        stuck = {task.get_name(): awaiting(task) for task in self._children}
        log.error(
            "task scope still waits on cancelled tasks",
            extra={"scope": self.name, "after_s": CLOSE_REPORT_S, "tasks": stuck},
        )
