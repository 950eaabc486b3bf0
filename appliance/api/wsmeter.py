"""aiohttp glue for framebudget.py: every byte a WebSocket client sends after the upgrade goes
through its connection's `FrameMeter` before aiohttp's reader sees it.

aiohttp's reader keeps any frame up to its max_msg_size, however long the client takes to
finish it, and offers no hook to judge a frame at its header; so the meter sits in front of
it (`MeteredWebSocket` puts a `MeteredReader` where the connection feeds its parser). This
leans on two attributes of aiohttp's request handler; `check_aiohttp` refuses to start the
server on an aiohttp without them rather than serve unmetered.

Memory the frames held is given back to the system once a connection that held a lot goes:
CPython frees it, but glibc keeps freed heap pages mapped (its mmap threshold grows after a
big free), so `malloc_trim` runs, in a thread, at most once a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import logging
from collections.abc import Callable
from typing import Any, Protocol

from aiohttp import web, web_protocol
from aiohttp.web_request import BaseRequest

from appliance.api.framebudget import CLOSE_POLICY, Closing, FrameMeter, Refusal

log = logging.getLogger(__name__)

TRIM_AFTER_BYTES = 1 << 20  # a connection that held this much gives its memory back as it goes
TRIM_EVERY_S = 1.0
_HANDLER_ATTRIBUTES = ("_payload_parser", "_message_tail")


def check_aiohttp() -> None:
    """RuntimeError unless aiohttp's request handler has what `MeteredWebSocket` replaces."""
    missing = [a for a in _HANDLER_ATTRIBUTES if not hasattr(web_protocol.RequestHandler, a)]
    if missing or not hasattr(web.WebSocketResponse, "_post_start"):
        raise RuntimeError(
            f"this aiohttp has no RequestHandler.{', '.join(missing) or 'WebSocketResponse._post_start'}: "
            "WebSocket frames could not be metered (appliance/api/wsmeter.py); install a supported aiohttp"
        )


class MeterEvents(Protocol):
    """What a connection's meter tells the rest of the server."""

    def refused(self, refusal: Refusal) -> None:
        """A frame was skipped whole: answer it."""

    def closed(self, closing: Closing) -> None:
        """The meter closed the connection."""

    def gone(self, freed: int) -> None:
        """The connection went, and its reservations (freed bytes) with it."""


class MeteredReader:
    """Stands where aiohttp's connection feeds its WebSocket reader: meters, then hands on."""

    def __init__(
        self,
        inner: Any,
        meter: FrameMeter,
        transport: asyncio.Transport,
        deadline_s: float,
        events: MeterEvents,
    ) -> None:
        self.inner = inner
        self.meter = meter
        self._transport = transport
        self._deadline_s = deadline_s
        self._events = events
        self._timer: asyncio.TimerHandle | None = None
        self._timer_for: float | None = None

    def feed_data(self, data: bytes) -> tuple[bool, bytes]:
        if self._timer is None and self.meter.take_whole(data):
            handed: tuple[bool, bytes] = self.inner.feed_data(data)  # one whole frame, kept
            return handed
        fed = self.meter.feed(data)
        if fed.closing is not None:
            self._close(fed.closing)
            return True, b""
        for piece in fed.pieces:
            eof, tail = self.inner.feed_data(piece)
            if eof:
                return eof, tail
        for refusal in fed.refusals:
            self._events.refused(refusal)
        self._arm()
        return False, b""

    def feed_eof(self) -> None:
        self.inner.feed_eof()
        self.release()

    def release(self) -> None:
        """The connection is gone: its reservations go, and the deadline with them."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self.meter.closed:
            self._events.gone(self.meter.close())

    def _arm(self) -> None:
        started = self.meter.started
        if started == self._timer_for:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_for = started
        # Timers, not tasks: the reader keeps the one handle and cancels it at release.
        if started is not None:  # the meter's clock is the loop's
            self._timer = asyncio.get_running_loop().call_at(started + self._deadline_s, self._expired)

    def _expired(self) -> None:
        self._timer = None
        if self.meter.started is None or self.meter.closed:
            return
        if self.meter.taken:  # the server has not taken its previous message: not the client's fault
            self._timer = asyncio.get_running_loop().call_later(self._deadline_s, self._expired)
            return
        ms = int(self._deadline_s * 1000)
        self._close(
            Closing(CLOSE_POLICY, f"a message was not finished within SANDBOX_FRAME_DEADLINE_MS ({ms})")
        )

    def _close(self, closing: Closing) -> None:
        log.info(
            "WebSocket closed by the frame meter", extra={"code": closing.code, "reason": closing.reason}
        )
        reason = closing.reason.encode()[:123]
        # A server frame is never masked; one write, between whole frames of the server's own.
        self._transport.write(bytes((0x88, 2 + len(reason))) + closing.code.to_bytes(2, "big") + reason)
        self._transport.close()
        self._events.closed(closing)
        self.release()


class MeteredWebSocket(web.WebSocketResponse):
    """A WebSocketResponse whose incoming bytes pass a `FrameMeter` first."""

    def __init__(self, meter: FrameMeter, deadline_s: float, events: MeterEvents, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.meter = meter
        self._deadline_s = deadline_s
        self._events = events
        self.metered: MeteredReader | None = None

    def _post_start(self, request: BaseRequest, protocol: str | None, writer: Any) -> None:
        handler: Any = request.protocol
        transport = request.transport
        if transport is None:
            raise ConnectionResetError("Connection lost")
        # The bytes that came with the upgrade request go through the meter too, not straight
        # to the reader as aiohttp's set_parser would feed them.
        tail, handler._message_tail = handler._message_tail, b""
        super()._post_start(request, protocol, writer)
        self.metered = MeteredReader(
            handler._payload_parser, self.meter, transport, self._deadline_s, self._events
        )
        handler._payload_parser = self.metered
        if tail:
            eof, _ = self.metered.feed_data(tail)
            if eof:
                handler.close()


class HeapTrimmer:
    """Runs glibc's malloc_trim in a thread after big frees, at most once every TRIM_EVERY_S."""

    def __init__(self) -> None:
        name = ctypes.util.find_library("c")
        libc = ctypes.CDLL(name) if name else None
        self._trim: Callable[[int], int] | None = getattr(libc, "malloc_trim", None)  # not glibc: none
        self._pending: asyncio.TimerHandle | None = None
        self._running: asyncio.Future[Any] | None = None

    def freed(self, size: int) -> None:
        """size bytes of frames were let go; trim soon if that was a lot."""
        if size < TRIM_AFTER_BYTES or self._trim is None or self._pending is not None:
            return
        # A timer, then a thread: the trimmer keeps both handles, and `close` ends them.
        self._pending = asyncio.get_running_loop().call_later(TRIM_EVERY_S, self._run)

    def _run(self) -> None:
        self._pending = None
        if self._trim is not None and (self._running is None or self._running.done()):
            self._running = asyncio.get_running_loop().run_in_executor(None, self._trim, 0)

    async def close(self) -> None:
        """Cancel a trim not begun; wait for one running in its thread (the trimmer owns both)."""
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None
        if self._running is not None:
            with contextlib.suppress(Exception):
                await self._running
