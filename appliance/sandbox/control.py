"""The server's end of a jail's control pipe: channel bytes queued and written as it takes them.

Never blocks the event loop: what the pipe does not take at once waits in a buffer and goes
out when the pipe is writable again. A caller that may be fed without bound (stdin from a
client) passes a limit, and gets PipeFull rather than a buffer that grows.
"""

from __future__ import annotations

import asyncio
import contextlib
import os

from appliance.core.domain import PipeFull


class ControlPipe:
    """Owns the write end of one control pipe (non-blocking once handed over)."""

    def __init__(self, fd: int, loop: asyncio.AbstractEventLoop) -> None:
        self._fd = fd
        self._loop = loop
        self._buf = bytearray()
        self._writer_added = False
        self._flushed: list[asyncio.Future[None]] = []
        self.closed = False
        os.set_blocking(fd, False)

    def write(self, data: bytes, limit: int | None = None) -> None:
        """Queue bytes for the driver without blocking; they go out as the pipe takes them.

        With `limit`, raises PipeFull rather than hold more than that many unsent bytes.
        Raises BrokenPipeError once the pipe is closed (or the driver is gone).
        """
        if self.closed:
            raise BrokenPipeError("jail control channel is closed")
        if limit is not None and len(self._buf) + len(data) > limit:
            raise PipeFull(f"more than {limit} bytes are already waiting for the jail")
        was_empty = not self._buf
        self._buf += data
        if was_empty:
            self._flush()

    def pending(self) -> int:
        """Bytes written but not yet taken by the pipe."""
        return len(self._buf)

    async def flushed(self) -> None:
        """Wait until the pipe has taken everything written so far (or was closed)."""
        if not self._buf:
            return
        done: asyncio.Future[None] = self._loop.create_future()
        self._flushed.append(done)
        await done

    def close(self) -> None:
        """Close the pipe; what was not sent is dropped and every waiter released."""
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(Exception):
            self._loop.remove_writer(self._fd)
        with contextlib.suppress(OSError):
            os.close(self._fd)
        self._writer_added = False
        self._buf.clear()
        self._release()

    def _flush(self) -> None:
        while self._buf:
            try:
                written = os.write(self._fd, self._buf)
            except BlockingIOError:
                self._loop.add_writer(self._fd, self._flush)
                self._writer_added = True
                return
            except OSError:  # the driver is gone (EPIPE) or the fd was closed
                self.close()
                return
            del self._buf[:written]
        if self._writer_added:  # asked for only when the pipe was full (not on a run's path)
            self._writer_added = False
            with contextlib.suppress(Exception):
                self._loop.remove_writer(self._fd)
        self._release()

    def _release(self) -> None:
        waiters, self._flushed = self._flushed, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
