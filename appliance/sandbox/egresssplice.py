"""The egress proxy's in-kernel relay: bytes moved from one socket to another through a
pipe with splice(2), inside the kernel, instead of through the server's memory and event
loop a chunk at a time (which cost a plain download about a third more time than the same
allowed by address).

Two uses: `relay`, one way, for a plain request's answer (far end to jail) once the request
has gone; `tunnel`, both ways at once, for a CONNECT tunnel once its ClientHello has been
checked and sent on. The caller's transports keep the sockets: this relays through
duplicates of their descriptors, only while no transport reads them and none has bytes
buffered to write to them, and stops at the end of file (each way, in a tunnel), an error,
or the idle time. Each way's pipe is bounded (PIPE_BYTES): a reader that stops holds no more.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import socket
from collections.abc import Callable, Sequence

PIPE_BYTES = 1 << 20  # what a pipe holds between two sockets (F_SETPIPE_SZ, best effort)
F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
F_GETPIPE_SZ = getattr(fcntl, "F_GETPIPE_SZ", 1032)
FLAGS = getattr(os, "SPLICE_F_MOVE", 1) | getattr(os, "SPLICE_F_NONBLOCK", 2)


ENABLED = True  # off: the stream relay (benchmarks/egress.py compares the two)


def available() -> bool:
    return ENABLED and hasattr(os, "splice")


def _splice(src: int, dst: int, size: int) -> int:
    """Bytes moved; -1 when src has nothing or dst takes nothing now."""
    try:
        return os.splice(src, dst, size, flags=FLAGS)
    except BlockingIOError:
        return -1


class _Way:
    """One direction: src's bytes into a pipe, the pipe's into dst."""

    def __init__(self, src: int, dst: int, count: Callable[[int], None], end: Callable[[], None]) -> None:
        self.src, self.dst, self.count, self.end = src, dst, count, end
        self.pipe_r, self.pipe_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        with contextlib.suppress(OSError):
            fcntl.fcntl(self.pipe_w, F_SETPIPE_SZ, PIPE_BYTES)
        self.size = fcntl.fcntl(self.pipe_w, F_GETPIPE_SZ)  # what it got: a full pipe is not read into
        self.held = 0
        self.eof = self.done = False
        self.stalled = False  # src had nothing for the pipe while it held bytes: it may be full
        self.reading = self.writing = False  # registered with the loop for src / dst

    def step(self) -> tuple[bool, bool]:
        """One splice in and one out: (whether a byte moved, whether to go again at once).

        Again at once only where more may be waiting: src filled the room it had, or dst
        took a part of what was held. Otherwise src gave what it had (a socket gives all it
        holds, up to the room) and the loop says when it has more: its readiness is
        level-triggered, so nothing that came meanwhile is missed."""
        room = self.size - self.held
        taken = _splice(self.src, self.pipe_w, room) if not self.eof and room else -1
        self.eof = self.eof or taken == 0
        if taken > 0:
            self.held += taken
            self.count(taken)
        given = _splice(self.pipe_r, self.dst, self.held) if self.held else -1
        self.held -= max(given, 0)
        # A pipe is full at 256 parts however small (a far end's tiny segments fill it long
        # before `size` bytes): src, still readable, would then wake the loop at once, again
        # and again. While the pipe holds bytes and took none, only dst's room wakes it.
        self.stalled = taken < 0 and self.held > 0
        if self.eof and self.held == 0:
            self.done = True
            self.end()
        return taken > 0 or given > 0, (taken > 0 and taken == room) or (given > 0 and self.held > 0)

    def close(self) -> None:
        os.close(self.pipe_r)
        os.close(self.pipe_w)


class _Relay:
    """The ways of one relay, stepped from the loop's readiness callbacks themselves (no task
    is woken per part a link delivers: that would cost a turn of the loop each). A socket
    stays registered for reading while its way's pipe has room, for writing only while it
    has refused bytes, so the loop is not asked to add and remove them for every part; one
    timer per idle period, not one per wait. `done` ends with None once every way is done,
    TimeoutError when no byte moved either way for idle_s, or the OSError of a reset."""

    def __init__(self, loop: asyncio.AbstractEventLoop, ways: Sequence[_Way], idle_s: float) -> None:
        self.loop, self.ways, self.idle_s = loop, ways, idle_s
        self.done: asyncio.Future[None] = loop.create_future()
        self.closed = False
        self.last = loop.time()
        self.timer = loop.call_at(self.last + idle_s, self._idle)

    def step(self, way: _Way | None = None) -> None:
        """Step `way` (the one whose socket is ready; None: all) while it may go on at once,
        then register what it waits for."""
        if self.closed:  # a readiness already queued when it closed: its descriptors may be gone
            return
        ways = self.ways if way is None else (way,)
        try:
            while True:
                moved = again = ended = False
                for each in ways:
                    if not each.done:
                        m, a = each.step()
                        moved, again, ended = moved or m, again or a, ended or each.done
                if moved:
                    self.last = self.loop.time()
                if ended and all(each.done for each in self.ways):
                    self._end(None)
                    return
                if not again:
                    break
            for each in ways:
                self._want(
                    each,
                    not each.done and not each.eof and each.held < each.size and not each.stalled,
                    not each.done and each.held > 0,
                )
        # OSError (a reset, a peer gone) ends every way; anything else too, raised to the
        # relay's awaiter rather than to the loop's handler.
        except Exception as exc:  # noqa: BLE001
            self._end(exc)

    def _want(self, way: _Way, read: bool, write: bool) -> None:
        """A way's source registered for reading, its destination for writing, as asked: the
        readiness of either steps that way alone (a descriptor is one way's source and at
        most one other's destination)."""
        if read != way.reading:
            if read:
                self.loop.add_reader(way.src, self.step, way)
            else:
                self.loop.remove_reader(way.src)
            way.reading = read
        if write != way.writing:
            if write:
                self.loop.add_writer(way.dst, self.step, way)
            else:
                self.loop.remove_writer(way.dst)
            way.writing = write

    def _idle(self) -> None:
        if self.closed:
            return
        until = self.last + self.idle_s
        if self.loop.time() >= until:
            self._end(TimeoutError())
        else:
            self.timer = self.loop.call_at(until, self._idle)

    def _end(self, exc: Exception | None) -> None:
        self.close()
        if self.done.done():
            return
        if exc is None:
            self.done.set_result(None)
        else:
            self.done.set_exception(exc)

    def close(self) -> None:
        """No more readiness, no more steps (before the descriptors are closed)."""
        if not self.closed:
            self.closed = True
            self.timer.cancel()
            for way in self.ways:
                self._want(way, False, False)


async def _run(ways: Sequence[_Way], idle_s: float) -> None:
    """Step every way until all are done; TimeoutError when no byte moved either way for
    idle_s; OSError (a reset, a peer gone) ends them all."""
    relay = _Relay(asyncio.get_running_loop(), ways, idle_s)
    try:
        relay.step()
        await relay.done
    finally:
        relay.close()


def _nothing() -> None:
    pass


async def relay(src: int, dst: int, idle_s: float, count: Callable[[int], None]) -> None:
    """Move everything the socket src sends to the socket dst until src's end of file (both
    descriptors stay the caller's, dst not half-closed); `count` is told each part taken
    from src. TimeoutError when nothing moved for idle_s; OSError on a reset."""
    src_fd, dst_fd = os.dup(src), os.dup(dst)
    try:
        way = _Way(src_fd, dst_fd, count, _nothing)
        try:
            await _run([way], idle_s)
        finally:
            way.close()
    finally:
        os.close(src_fd)
        os.close(dst_fd)


async def tunnel(
    a: int, b: int, idle_s: float, count_ab: Callable[[int], None], count_ba: Callable[[int], None]
) -> None:
    """Relay the sockets a and b both ways until each has sent its end of file, each passed
    on as a half-close (shutdown SHUT_WR) of the other once what it sent before has gone;
    `count_ab`/`count_ba` are told each part taken from a/from b. Both descriptors stay the
    caller's. TimeoutError when nothing moved either way for idle_s; OSError (a reset, a
    peer gone) ends both ways."""
    # Socket objects over duplicates: the half-close is a socket's shutdown, and the
    # duplicates are closed here whatever happens (cancellation included).
    sa = socket.socket(fileno=os.dup(a))
    try:
        sb = socket.socket(fileno=os.dup(b))
    except BaseException:
        sa.close()
        raise
    with sa, sb:

        def end(sock: socket.socket) -> Callable[[], None]:
            def shut() -> None:
                with contextlib.suppress(OSError):  # the peer already gone: the other way says so
                    sock.shutdown(socket.SHUT_WR)

            return shut

        ways: list[_Way] = []
        try:
            ways.append(_Way(sa.fileno(), sb.fileno(), count_ab, end(sb)))
            ways.append(_Way(sb.fileno(), sa.fileno(), count_ba, end(sa)))
            await _run(ways, idle_s)
        finally:
            for way in ways:
                way.close()
