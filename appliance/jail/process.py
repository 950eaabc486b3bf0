"""The one place that starts, reads, signals and reaps a firejail process tree.

A jail's output arrives on three pipes: the code's stdout and stderr, and the
driver's event lines. `JailProcess` turns them into one ordered queue of items:
before handling an event line it drains whatever stdout/stderr already holds, so
output the code wrote before a `display`, `error` or `done` is delivered first.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import errno
import json
import os
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from appliance.jail import proctree

READ_CHUNK = 65536


@dataclass(frozen=True)
class Stream:
    name: str  # "stdout" | "stderr"
    text: str
    nbytes: int


@dataclass(frozen=True)
class Event:
    body: dict[str, Any]
    nbytes: int


@dataclass(frozen=True)
class Overflow:
    """The driver sent an event line longer than allowed."""

    nbytes: int


@dataclass(frozen=True)
class Exited:
    """The driver's event pipe closed: the jail's interpreter is gone."""


Item = Stream | Event | Overflow | Exited


class JailProcess:
    """A running firejail with its pipes; `kill()` always leaves nothing behind."""

    def __init__(
        self, proc: asyncio.subprocess.Process, control_fd: int, out_fd: int, err_fd: int,
        events_fd: int, max_event_bytes: int,
    ) -> None:
        self._proc = proc
        self._control_fd = control_fd
        self._fds = {"stdout": out_fd, "stderr": err_fd}
        self._events_fd = events_fd
        self._decoders = {
            name: codecs.getincrementaldecoder("utf-8")(errors="replace") for name in self._fds
        }
        self._event_buf = bytearray()
        self._max_event_bytes = max_event_bytes
        self.items: asyncio.Queue[Item] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self._closed_fds: set[int] = set()
        self._exited = False
        for fd in (out_fd, err_fd, events_fd):
            os.set_blocking(fd, False)
            self._loop.add_reader(fd, self._on_readable, fd)
        os.set_blocking(control_fd, False)
        self._write_buf = bytearray()
        self._writer_waiters: list[asyncio.Future[None]] = []

    @classmethod
    async def spawn(
        cls, argv_for_fd: Any, *, uid: int | None, gid: int | None, env: Mapping[str, str],
        max_event_bytes: int,
    ) -> JailProcess:
        """Start firejail. `argv_for_fd(events_fd)` renders the argv once the fd number is known."""
        ctl_r, ctl_w = os.pipe2(os.O_CLOEXEC)
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        ev_r, ev_w = os.pipe2(os.O_CLOEXEC)
        child_ends = (ctl_r, out_w, err_w, ev_w)
        try:
            argv: Sequence[str] = argv_for_fd(ev_w)
            extra: dict[str, Any] = {}
            if uid is not None:
                extra = {"user": uid, "group": gid, "extra_groups": []}
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=ctl_r, stdout=out_w, stderr=err_w, pass_fds=(ev_w,),
                env=dict(env), cwd="/", start_new_session=True, **extra,
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

    # -- reading -------------------------------------------------------------------------
    def _on_readable(self, fd: int) -> None:
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
                    self.items.put_nowait(Stream(name, tail, 0))
                return
            text = self._decoders[name].decode(chunk)
            self.items.put_nowait(Stream(name, text, len(chunk)))
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
                self.items.put_nowait(Exited())
            return
        self._event_buf += chunk
        while True:
            idx = self._event_buf.find(b"\n")
            if idx < 0:
                break
            line = bytes(self._event_buf[: idx + 1])
            del self._event_buf[: idx + 1]
            self._drain("stdout")
            self._drain("stderr")
            try:
                body = json.loads(line)
            except ValueError:
                body = None
            if isinstance(body, dict):
                self.items.put_nowait(Event(body, len(line)))
        if len(self._event_buf) > self._max_event_bytes:
            self._event_buf.clear()
            self.items.put_nowait(Overflow(self._max_event_bytes))

    def _close_fd(self, fd: int) -> None:
        if fd in self._closed_fds:
            return
        self._closed_fds.add(fd)
        with contextlib.suppress(Exception):
            self._loop.remove_reader(fd)
        with contextlib.suppress(OSError):
            os.close(fd)

    # -- writing -------------------------------------------------------------------------
    async def send(self, message: dict[str, Any]) -> None:
        """Send one control message to the driver without blocking the event loop."""
        data = (json.dumps(message, separators=(",", ":")) + "\n").encode()
        fd = self._control_fd
        if fd in self._closed_fds:
            raise BrokenPipeError("jail control channel is closed")
        view = memoryview(data)
        while view:
            try:
                written = os.write(fd, view)
                view = view[written:]
            except BlockingIOError:
                await self._writable(fd)

    async def _writable(self, fd: int) -> None:
        ready: asyncio.Future[None] = self._loop.create_future()

        def wake() -> None:
            if not ready.done():
                ready.set_result(None)

        self._loop.add_writer(fd, wake)
        try:
            await ready
        finally:
            self._loop.remove_writer(fd)

    # -- ending --------------------------------------------------------------------------
    def signal_kill(self) -> None:
        """SIGKILL the jail's PID-namespace init (and with it every process of the jail) now,
        without waiting; `kill()` later waits for the teardown and reaps."""
        if self._proc.returncode is not None:
            return
        targets = proctree.children(self.pid) or [self.pid]
        for pid in targets:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)

    async def kill(self, grace_s: float = 0.0) -> None:
        """TERM (when grace_s > 0), wait, then KILL the sandbox's PID-namespace init, which
        takes every process of the jail with it; then reap firejail and close all pipes."""
        proc = self._proc
        if proc.returncode is None and grace_s > 0:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(proc.wait()), grace_s)
        if proc.returncode is None:
            for child in proctree.children(proc.pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(child, signal.SIGKILL)
            try:
                await asyncio.wait_for(asyncio.shield(proc.wait()), 2.0)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        self._close_all()

    def is_running(self) -> bool:
        """Not reaped, not a zombie, and its event pipe still open (checked from /proc)."""
        if self._proc.returncode is not None or self._exited:
            return False
        try:
            with open(f"/proc/{self.pid}/stat") as fh:
                state = fh.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return False
        return state not in ("Z", "X")

    def tree(self) -> list[int]:
        """firejail's PID and every descendant's (the whole jail)."""
        return proctree.tree(self.pid)

    def renice(self, value: int) -> None:
        """Set every process of the jail to this niceness (lowering it needs root)."""
        for pid in self.tree():
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, pid, value)

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
        for fd in (self._fds["stdout"], self._fds["stderr"], self._events_fd, self._control_fd):
            self._close_fd(fd)
