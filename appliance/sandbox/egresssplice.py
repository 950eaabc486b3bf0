"""The egress proxy's download relay for a plain HTTP request: once the request has gone,
the answer is moved from the far end's socket to the jail's through a pipe with splice(2),
inside the kernel, instead of through the server's memory and event loop a chunk at a time
(which cost a plain download about a third more time than the same allowed by address).

The caller's transports keep the sockets: this relays through duplicates of their
descriptors, only while the far end's transport is not reading and the jail's has nothing
buffered to write, and stops at the far end's end of file, an error, or the idle time.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
from collections.abc import Callable

PIPE_BYTES = 1 << 20  # what the pipe holds between the two sockets (F_SETPIPE_SZ, best effort)
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


class _Waker:
    """The relay's readiness: the far end's socket stays registered for reading while the
    pipe has room, the jail's for writing only while it has refused bytes, so the loop is
    not asked to add and remove them for every part a link delivers; one timer per idle
    period, not one per wait."""

    def __init__(self, loop: asyncio.AbstractEventLoop, src: int, dst: int) -> None:
        self.loop, self.src, self.dst = loop, src, dst
        self.reading = self.writing = False
        self.waiter: asyncio.Future[None] | None = None

    def wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def want(self, read: bool, write: bool) -> None:
        if read != self.reading:
            if read:
                self.loop.add_reader(self.src, self.wake)
            else:
                self.loop.remove_reader(self.src)
            self.reading = read
        if write != self.writing:
            if write:
                self.loop.add_writer(self.dst, self.wake)
            else:
                self.loop.remove_writer(self.dst)
            self.writing = write

    async def wait(self, until: float) -> bool:
        """Until a wanted socket is ready (True) or the loop's clock reaches until (False)."""
        self.waiter = self.loop.create_future()
        timer = self.loop.call_at(until, self.wake)
        try:
            await self.waiter
        finally:
            timer.cancel()
            self.waiter = None
        return self.loop.time() < until

    def close(self) -> None:
        self.want(False, False)


async def relay(src: int, dst: int, idle_s: float, count: Callable[[int], None]) -> None:
    """Move everything the socket src sends to the socket dst until src's end of file (both
    descriptors stay the caller's); `count` is told each part taken from src. TimeoutError
    when nothing moved for idle_s; OSError on a reset."""
    loop = asyncio.get_running_loop()
    src_fd, dst_fd = os.dup(src), os.dup(dst)
    pipe_r, pipe_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    waker = _Waker(loop, src_fd, dst_fd)
    try:
        with contextlib.suppress(OSError):
            fcntl.fcntl(pipe_w, F_SETPIPE_SZ, PIPE_BYTES)
        size = fcntl.fcntl(pipe_w, F_GETPIPE_SZ)  # what it got: a full pipe is not read into
        held, eof, last = 0, False, loop.time()
        while True:
            room = size - held
            taken = _splice(src_fd, pipe_w, room) if not eof and room else -1
            eof = eof or taken == 0
            if taken > 0:
                held += taken
                count(taken)
            given = _splice(pipe_r, dst_fd, held) if held else -1
            held -= max(given, 0)
            if taken > 0 or given > 0:
                last = loop.time()
            if eof and held == 0:
                return
            # Again at once only where more may be waiting: src filled the room it had, or
            # dst took a part of what was held. Otherwise src gave what it had (a socket
            # gives all it holds, up to the room) and the loop says when it has more: its
            # readiness is level-triggered, so nothing that came meanwhile is missed.
            if (taken > 0 and taken == room) or (given > 0 and held > 0):
                continue
            waker.want(read=not eof and held < size, write=held > 0)
            if not await waker.wait(last + idle_s) and loop.time() - last >= idle_s:
                raise TimeoutError
    finally:
        waker.close()
        for fd in (src_fd, dst_fd, pipe_r, pipe_w):
            os.close(fd)
