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
import time
from collections.abc import Callable

PIPE_BYTES = 1 << 20  # what the pipe holds between the two sockets (F_SETPIPE_SZ, best effort)
F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
FLAGS = getattr(os, "SPLICE_F_MOVE", 1) | getattr(os, "SPLICE_F_NONBLOCK", 2)


ENABLED = True  # off: the stream relay (benchmarks/egress.py compares the two)


def available() -> bool:
    return ENABLED and hasattr(os, "splice")


async def _ready(
    loop: asyncio.AbstractEventLoop, read_fd: int | None, write_fd: int | None, idle_s: float
) -> None:
    """Until read_fd is readable or write_fd writable (TimeoutError after idle_s)."""
    done = loop.create_future()

    def wake() -> None:
        if not done.done():
            done.set_result(None)

    try:
        if read_fd is not None:
            loop.add_reader(read_fd, wake)
        if write_fd is not None:
            loop.add_writer(write_fd, wake)
        async with asyncio.timeout(idle_s):
            await done
    finally:
        if read_fd is not None:
            loop.remove_reader(read_fd)
        if write_fd is not None:
            loop.remove_writer(write_fd)


def _splice(src: int, dst: int, size: int) -> int:
    """Bytes moved; -1 when src has nothing or dst takes nothing now."""
    try:
        return os.splice(src, dst, size, flags=FLAGS)
    except BlockingIOError:
        return -1


async def relay(src: int, dst: int, idle_s: float, count: Callable[[int], None]) -> None:
    """Move everything the socket src sends to the socket dst until src's end of file (both
    descriptors stay the caller's); `count` is told each part taken from src. TimeoutError
    when nothing moved for idle_s; OSError on a reset."""
    loop = asyncio.get_running_loop()
    src_fd, dst_fd = os.dup(src), os.dup(dst)
    pipe_r, pipe_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        with contextlib.suppress(OSError):
            fcntl.fcntl(pipe_w, F_SETPIPE_SZ, PIPE_BYTES)
        held, eof, last = 0, False, time.monotonic()
        while not (eof and held == 0):
            taken = _splice(src_fd, pipe_w, PIPE_BYTES - held) if not eof and held < PIPE_BYTES else -1
            eof = eof or taken == 0
            if taken > 0:
                held += taken
                count(taken)
            given = _splice(pipe_r, dst_fd, held) if held else -1
            held -= max(given, 0)
            if taken > 0 or given > 0:
                last = time.monotonic()
                continue
            if eof and held == 0:
                break
            try:
                await _ready(
                    loop, src_fd if not eof and held < PIPE_BYTES else None, dst_fd if held else None, idle_s
                )
            except TimeoutError:
                if time.monotonic() - last >= idle_s:
                    raise
    finally:
        for fd in (src_fd, dst_fd, pipe_r, pipe_w):
            os.close(fd)
