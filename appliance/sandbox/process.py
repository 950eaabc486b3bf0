"""The one place that starts, reads, writes, signals and reaps a firejail process tree.

A jail's output arrives on three pipes: the code's stdout and stderr, and the
driver's event lines. `JailProcess` turns them into one ordered stream of items that
only it holds: before handling an event line it drains whatever stdout/stderr already
holds, so output the code wrote before a `display`, `error` or `done` is delivered first.

Backpressure: at most HIGH_WATER_BYTES of output wait in the server for a consumer. Past
that the pipes are not read, so the jail's writes block in the jail, and the server's
memory stays bounded whatever the code writes and however slowly the client reads.
Limits (`stop`) and interrupts jump the line: they are taken before any waiting output.

Writes to the driver (`write`) are buffered and flushed as the pipe takes them, by the
control pipe's own class (appliance/sandbox/control.py); a caller that may be fed without
bound (stdin from a client) passes a limit.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import errno
import os
import select
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from appliance.core.errors import JailExited, RunLimit
from appliance.core.tasks import within
from appliance.sandbox import channel, proctree, signals
from appliance.sandbox.control import ControlPipe

READ_CHUNK = 65536
HIGH_WATER_BYTES = 256 * 1024  # stop reading the jail's pipes above this much waiting output ...
LOW_WATER_BYTES = 64 * 1024  # ... and read again below this


@dataclass(frozen=True)
class Stream:
    """Bytes the code wrote to fd 1/2 (C code, subprocesses, `.buffer`), decoded."""

    name: str  # "stdout" | "stderr"
    text: str
    nbytes: int


@dataclass(frozen=True)
class Event:
    """One validated event line from the driver."""

    body: channel.Event
    nbytes: int


@dataclass(frozen=True)
class Overflow:
    """The driver sent an event line longer than allowed."""

    nbytes: int


@dataclass(frozen=True)
class Exited:
    """The driver's event pipe closed: the jail's interpreter is gone."""


@dataclass(frozen=True)
class Violation:
    """A watchdog's verdict (`stop`): the run broke a limit."""

    error: RunLimit


@dataclass(frozen=True)
class InterruptRequest:
    """The client sent `interrupt` (or the server is stopping)."""

    reason: str = "the run was interrupted"


Output = Stream | Event | Overflow | Exited
Item = Output | Violation | InterruptRequest


class JailProcess:
    """A running firejail with its pipes; `kill()` always leaves nothing behind."""

    def __init__(  # noqa: PLR0913 (the process's pipes and limits, handed over by its launcher)
        self,
        proc: asyncio.subprocess.Process,
        control_fd: int,
        out_fd: int,
        err_fd: int,
        events_fd: int,
        max_event_bytes: int,
    ) -> None:
        self._proc = proc
        self._fds = {"stdout": out_fd, "stderr": err_fd}
        self._events_fd = events_fd
        self._decoders = {name: codecs.getincrementaldecoder("utf-8")(errors="replace") for name in self._fds}
        self._events = channel.EventDecoder(max_event_bytes)
        self._output: deque[Output] = deque()
        self._urgent: deque[Violation | InterruptRequest] = deque()
        self._waiting_bytes = 0
        self._paused = False
        self._wake = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._closed_fds: set[int] = set()
        self._exited = False
        for fd in (out_fd, err_fd, events_fd):
            os.set_blocking(fd, False)
            self._loop.add_reader(fd, self._on_readable, fd)
        self._control = ControlPipe(control_fd, self._loop)
        self._ready_pids: tuple[int, ...] = ()
        self._init_fds: list[int] = []  # pidfds of the jail's PID-namespace init (see pin)
        self._launcher_fd: int | None = None  # pidfd of firejail itself (see pin)
        self._killed = False  # SIGKILL went to the init through its pidfd
        self._init_pids: tuple[int, ...] = ()
        self._alive_poll: select.poll | None = None  # the pidfds of `pin`, to poll

    @classmethod
    async def spawn(
        cls,
        argv_for_fd: Any,
        *,
        env: Mapping[str, str],
        max_event_bytes: int,
    ) -> JailProcess:
        """Start firejail. `argv_for_fd(events_fd)` renders the argv once the fd number is known.

        Nothing runs in the child before exec (no preexec, no uid change: the argv's own
        launcher does those), so Python spawns with vfork: the server's memory is neither
        copied nor write-protected, which a fork() of it would do at every pool refill."""
        ctl_r, ctl_w = os.pipe2(os.O_CLOEXEC)
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        ev_r, ev_w = os.pipe2(os.O_CLOEXEC)
        child_ends = (ctl_r, out_w, err_w, ev_w)
        try:
            argv: Sequence[str] = argv_for_fd(ev_w)
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=ctl_r,
                stdout=out_w,
                stderr=err_w,
                pass_fds=(ev_w,),
                env=dict(env),
                cwd="/",
                start_new_session=True,
            )
        except BaseException:
            for fd in (*child_ends, ctl_w, out_r, err_r, ev_r):
                os.close(fd)
            raise
        for fd in child_ends:
            os.close(fd)
        return cls(proc, ctl_w, out_r, err_r, ev_r, max_event_bytes)

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode

    # -- the item stream ------------------------------------------------------------------
    async def next(self) -> Item:
        """The next item: a pending limit or interrupt first, else the oldest output.
        Waits as long as it takes: the caller bounds it (asyncio.timeout_at in jail.cell)."""
        while True:
            if self.has_pending():
                return self.next_nowait()
            self._wake.clear()
            await self._wake.wait()

    def has_pending(self) -> bool:
        """Whether `next` has an item queued (and would return without waiting)."""
        return bool(self._urgent or self._output)

    def ready_item(self) -> Item | None:
        """The item `next` would return now without waiting, or None.

        What the driver wrote since the event loop last looked is read here, at once: a cell's
        `done` usually follows its output by microseconds, and reading it in place spares the
        run a turn of the event loop (a wait, a poll, a wake-up) between the two."""
        if not (self.has_pending() or self._paused or self._events_fd in self._closed_fds):
            self._read_events()
        return self.next_nowait() if self.has_pending() else None

    def next_nowait(self) -> Item:
        """The next item (IndexError if none is queued)."""
        if self._urgent:
            return self._urgent.popleft()
        item = self._output.popleft()
        self._waiting_bytes -= _size(item)
        if self._paused and self._waiting_bytes <= LOW_WATER_BYTES:
            self._resume()
        return item

    # ASYNC109: the timeout is required on purpose: no caller may wait on a jail unbounded.
    async def wait_event(self, kind: channel.EventKind, timeout: float) -> channel.Event:  # noqa: ASYNC109
        """Skip output until the driver's next `kind` event and return it.

        Raises JailExited (with what the jail wrote) if the driver goes first, TimeoutError,
        or the RunLimit of a `stop` that came meanwhile.
        """
        text: list[str] = []
        async with asyncio.timeout(timeout):
            while True:
                item = await self.next()
                if isinstance(item, Event) and item.body["ev"] == kind:
                    return item.body
                if isinstance(item, Stream):
                    text.append(item.text)
                elif isinstance(item, Violation):
                    raise item.error
                elif isinstance(item, (Exited, Overflow)):
                    raise JailExited("".join(text).strip()[-500:])

    def stop(self, error: RunLimit) -> None:
        """End the current run with `error` (a watchdog's verdict); taken before any output."""
        self._urgent.append(Violation(error))
        self._wake.set()

    def violation(self) -> RunLimit | None:
        """A watchdog's verdict that no cell has taken yet (one that came between cells)."""
        for item in self._urgent:
            if isinstance(item, Violation):
                return item.error
        return None

    def interrupt(self, reason: str) -> None:
        """The client (or the server) asks the current run to stop."""
        self._urgent.append(InterruptRequest(reason))
        self._wake.set()

    def _put(self, item: Output) -> None:
        self._output.append(item)
        self._waiting_bytes += _size(item)
        self._wake.set()
        if not self._paused and self._waiting_bytes > HIGH_WATER_BYTES:
            self._pause()

    def _pause(self) -> None:
        """Stop reading the jail's pipes: its writes block until the consumer catches up."""
        self._paused = True
        for fd in (*self._fds.values(), self._events_fd):
            if fd not in self._closed_fds:
                self._loop.remove_reader(fd)

    def _resume(self) -> None:
        self._paused = False
        for fd in (*self._fds.values(), self._events_fd):
            if fd not in self._closed_fds:
                self._loop.add_reader(fd, self._on_readable, fd)

    # -- reading -------------------------------------------------------------------------
    def _on_readable(self, fd: int) -> None:
        if self._paused:
            return  # a callback already scheduled when reading paused
        if fd == self._events_fd:
            self._read_events()
        else:
            name = "stdout" if fd == self._fds["stdout"] else "stderr"
            self._drain(name, once=True)

    def _drain(self, name: str, once: bool = False) -> None:
        fd = self._fds[name]
        while fd not in self._closed_fds:
            try:
                chunk = os.read(fd, READ_CHUNK)
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno != errno.EBADF:
                    self._close_fd(fd)
                return
            if not chunk:
                self._close_fd(fd)
                tail = self._decoders[name].decode(b"", final=True)
                if tail:
                    self._put(Stream(name, tail, 0))
                return
            text = self._decoders[name].decode(chunk)
            self._put(Stream(name, text, len(chunk)))
            if once:
                return

    def _read_events(self) -> None:
        fd = self._events_fd
        try:
            chunk = os.read(fd, READ_CHUNK)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._close_fd(fd)
            self._drain("stdout")
            self._drain("stderr")
            if not self._exited:
                self._exited = True
                self._put(Exited())
            return
        self._events.feed(chunk)
        while (got := self._events.next()) is not None:
            if isinstance(got, channel.Oversized):
                self._put(Overflow(got.limit))
                continue
            # What the code wrote before this event goes first: the wire keeps program order.
            self._drain("stdout")
            self._drain("stderr")
            self._put(Event(got.event, got.nbytes))

    def _close_fd(self, fd: int) -> None:
        if fd in self._closed_fds:
            return
        self._closed_fds.add(fd)
        with contextlib.suppress(Exception):
            self._loop.remove_reader(fd)
        with contextlib.suppress(Exception):
            self._loop.remove_writer(fd)
        with contextlib.suppress(OSError):
            os.close(fd)

    # -- writing -------------------------------------------------------------------------
    def write(self, data: bytes, limit: int | None = None) -> None:
        """Queue channel bytes for the driver without blocking (see ControlPipe.write)."""
        self._control.write(data, limit)

    async def flushed(self) -> None:
        """Wait until the driver's pipe has taken everything written so far."""
        await self._control.flushed()

    # -- ending --------------------------------------------------------------------------
    def pin(self) -> None:
        """The driver is up and no code has run: remember the jail's processes as they are now.

        The PID-namespace init is held by a pidfd, so a kill can never reach a process that
        reused its PID; the list of processes (and threads) is what `renice` changes."""
        self._ready_pids = tuple(self.tree())
        self._init_pids = tuple(proctree.children(self.pid))
        with contextlib.suppress(OSError):
            self._launcher_fd = os.pidfd_open(self.pid)
        for pid in self._init_pids:
            with contextlib.suppress(OSError):
                self._init_fds.append(os.pidfd_open(pid))
        # Made once: a run asks whether its jail lives as it is handed out.
        self._alive_poll = select.poll()  # not select(): a server's descriptors may be past FD_SETSIZE
        for fd in (*self._init_fds, self._launcher_fd):
            if fd is not None:
                self._alive_poll.register(fd, select.POLLIN)

    def ready_pids(self) -> tuple[int, ...]:
        """The jail's processes as `pin` found them (firejail, the sandbox's init, the driver):
        all a session's jail may hold between cells. Their PIDs stay theirs while they live."""
        return self._ready_pids

    def inits(self) -> list[int]:
        """firejail's child: the sandbox's PID-namespace init, whose mount namespace holds the
        jail's private /tmp. Pinned once the jail is ready: it is the same process for the
        jail's whole life, and held by a pidfd, its PID cannot be another's while we look."""
        return list(self._init_pids) if self._init_pids else proctree.children(self.pid)

    def init_pidfd(self) -> int | None:
        """The pidfd of the jail's PID-namespace init (pinned at `pin`), while it is held: what
        a socket in the jail's network namespace is made through (appliance.sandbox.jailnet)."""
        return self._init_fds[0] if self._init_fds and not self._killed else None

    def signal_kill(self) -> None:
        """SIGKILL the jail's PID-namespace init (and with it every process of the jail) now,
        without waiting; `kill()` later waits for the teardown and reaps."""
        if self._proc.returncode is not None or self._killed:
            return
        if self._init_fds:
            for fd in self._init_fds:
                try:
                    signals.kill_by_pidfd(fd)
                except ProcessLookupError:  # gone already
                    pass
                except OSError:
                    continue  # not known to be going: a later call sends it again
                # SIGKILL cannot be blocked or caught: once it is pending, the init and with it
                # the whole PID namespace is going. Sending it again would only cost a wake-up.
                self._killed = True
            return
        for pid in proctree.children(self.pid) or [self.pid]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                signals.kill(pid)

    async def kill(self) -> None:
        """KILL the sandbox's PID-namespace init, which takes every process of the jail with
        it; then reap firejail and close all pipes. (No TERM first: nothing in a jail is owed
        a clean exit, and a grace period would be time the code keeps running.)"""
        proc = self._proc
        if proc.returncode is None:
            self.signal_kill()
            try:
                # Also in a cleanup after a cancellation: `within`, whose timeout stays a
                # TimeoutError there (appliance.core.tasks).
                await within(proc.wait(), 2.0)
            except TimeoutError:
                signals.kill_child(proc)
                await proc.wait()
        self._close_all()

    def is_running(self) -> bool:
        """Not reaped, its event pipe still open, and its sandbox alive: once pinned, pidfds of
        firejail and of the PID-namespace init that are not readable (a pidfd turns readable
        when its process exits: one poll); before that, firejail's state from /proc (not a zombie)."""
        if self._proc.returncode is not None or self._exited or self._killed:
            return False
        if self._init_fds and self._alive_poll is not None:
            # firejail's pidfd too: killed from outside, it takes the sandbox with it only some
            # milliseconds later (the init's parent-death signal), far longer on a busy host.
            return not self._alive_poll.poll(0)
        return proctree.state(self.pid) not in ("Z", "X", "")

    def tree(self) -> list[int]:
        """firejail's PID and every descendant's (the whole jail)."""
        return proctree.tree(self.pid)

    def renice(self, value: int) -> None:
        """Set every thread of the jail to this niceness (lowering it needs root). Before any
        code ran (a pooled jail being handed out) the processes are the pinned ones."""
        for pid in self._ready_pids or self.tree():
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            for tid in tids:
                with contextlib.suppress(OSError, ValueError):
                    os.setpriority(os.PRIO_PROCESS, int(tid), value)

    def pss_kb(self) -> int:
        """Proportional set size of the jail's processes, in KiB (0 where unreadable)."""
        total = 0
        for pid in self.tree():
            try:
                with open(f"/proc/{pid}/smaps_rollup") as fh:
                    for line in fh:
                        if line.startswith("Pss:"):
                            total += int(line.split()[1])
                            break
            except (OSError, ValueError):
                continue
        return total

    async def wait(self) -> int:
        return await self._proc.wait()

    def _close_all(self) -> None:
        for fd in (self._fds["stdout"], self._fds["stderr"], self._events_fd):
            self._close_fd(fd)
        self._control.close()
        for fd in self._init_fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._init_fds.clear()
        self._alive_poll = None
        if self._launcher_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._launcher_fd)
            self._launcher_fd = None


def _size(item: Output) -> int:
    return item.nbytes if isinstance(item, (Stream, Event)) else 0
