"""Big client frames are parsed in a child process, so that their cost never holds the server.

`json.loads` holds the GIL for the whole of its work, and so does the collection of what it
built: a worker thread does not take that cost off the event loop, and a few frames of
hundreds of thousands of file entries parsed in one kept /healthz from answering for most of
a second; parsed in this child, a small fraction of that. The server only copies the frame
into a pipe and unpickles the typed message, which the codec's limits keep small (a refused
frame comes back as its error alone).

The same child screens bodies that another parser will read on the loop (`screen`): the MCP
SDK's pydantic parse of a body of hundreds of thousands of small values holds the loop for
over a second, so /mcp bodies over 64 KiB are first counted here and refused when they hold
more JSON values than any request needs.

One child (`python -m appliance.wire.parse_worker`), started with the server and restarted after it
dies; a frame whose parse killed it is refused, and the next frame gets a new child. The child
exits when its stdin closes, so it never outlives the server. Its channel is a length-prefixed
pickle each way; both ends are this module (the frame itself is only ever read by json.loads).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import pickle
import struct
import sys
from typing import BinaryIO

from appliance.wire import protocol
from appliance.wire.protocol import ClientMessage, Limits, ProtocolError

log = logging.getLogger(__name__)

MODULE = "appliance.wire.parse_worker"  # how tests (and `ps`) tell the parser from a jail
_HEADER = struct.Struct("!Q")
_Reply = tuple[ClientMessage | None, None] | tuple[None, tuple[str, str | None]]


def count_values(data: str | bytes, most: int) -> str | None:
    """None when data is JSON of at most `most` values (objects, arrays, keys and scalars
    each count one); otherwise what is wrong with it, in words for the caller."""
    try:
        root = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        return f"the body is not valid JSON: {exc}"
    except RecursionError:
        return "the body is nested too deeply"
    if protocol.nested_deeper_than(data):
        return f"the body is nested deeper than {protocol.MAX_JSON_DEPTH} levels"
    seen, stack = 0, [root]
    while stack:
        value = stack.pop()
        seen += 1
        if isinstance(value, dict):
            seen += len(value)
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
        if seen > most:
            return f"the body holds more than {most} JSON values"
    return None


class ParseWorker:
    """A child process that turns big frames into typed messages (`protocol.parse_client_frame`)."""

    def __init__(self) -> None:
        self._proc: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()  # one exchange at a time: replies are matched by order
        self._closed = False

    @property
    def pid(self) -> int | None:
        """The child's process ID while it runs."""
        return self._proc.pid if self._proc is not None and self._proc.returncode is None else None

    async def _child(self) -> asyncio.subprocess.Process:
        if self._closed:
            raise ProtocolError("the server is shutting down")
        if self._proc is None or self._proc.returncode is not None:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", MODULE, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
            )
        return self._proc

    async def start(self) -> None:
        """Start the child now (its imports take a moment), so the first big frame does not wait."""
        try:
            async with self._lock:
                await self._child()
        except (OSError, ProtocolError) as exc:  # the first big frame tries again
            log.error("the frame parser process did not start", extra={"error": str(exc)})

    async def parse(self, data: str | bytes, limits: Limits) -> ClientMessage:
        """The frame's message, or ProtocolError; the child's death refuses this frame only.

        Shielded: a caller that goes away mid-parse must not leave a reply in the pipe for the
        next frame to read as its own."""
        message = await asyncio.shield(self._exchange(("frame", data, limits), limits))
        if message is None:
            raise RuntimeError("the parser child replied to a frame without its message")
        return message

    async def screen(self, data: str | bytes, most: int, limits: Limits) -> None:
        """ProtocolError unless data is JSON of at most `most` values (`count_values`)."""
        await asyncio.shield(self._exchange(("screen", data, most), limits))

    async def _exchange(self, request: tuple[object, ...], limits: Limits) -> ClientMessage | None:
        async with self._lock:
            proc = await self._child()
            if proc.stdin is None or proc.stdout is None:
                raise RuntimeError("the parser child has no pipes")
            try:
                body = pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)
                proc.stdin.write(_HEADER.pack(len(body)) + body)
                await proc.stdin.drain()
                (size,) = _HEADER.unpack(await proc.stdout.readexactly(_HEADER.size))
                if size > 2 * limits.max_message_bytes + (1 << 20):
                    raise ValueError(f"a reply of {size} bytes")
                reply: _Reply = pickle.loads(await proc.stdout.readexactly(size))  # noqa: S301 (our own child)
            except (OSError, EOFError, ValueError, asyncio.IncompleteReadError) as exc:
                # Killed while parsing this frame (e.g. by the OOM killer), or out of step:
                # nothing of it is trusted, and the next frame gets a new child.
                await self._stop(proc)
                log.error("the frame parser process failed; starting a new one", extra={"error": str(exc)})
                raise ProtocolError("the frame could not be parsed: the parser process failed") from None
        message, error = reply
        if error is not None:
            raise ProtocolError(*error)
        return message

    async def _stop(self, proc: asyncio.subprocess.Process) -> None:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        await proc.wait()
        if self._proc is proc:
            self._proc = None

    async def close(self) -> None:
        """Stop the child; no frame is parsed after this."""
        self._closed = True
        if self._proc is not None:
            await self._stop(self._proc)


def answer(op: str, data: str | bytes, arg: Limits | int) -> _Reply:
    """The child's reply to one request: ("frame", data, limits) or ("screen", data, most)."""
    if op == "frame" and isinstance(arg, Limits):
        try:
            return (protocol.parse_client_frame(data, arg), None)
        except ProtocolError as exc:
            return (None, (exc.message, exc.request_id))
    if op == "screen" and isinstance(arg, int):
        problem = count_values(data, arg)
        return (None, None) if problem is None else (None, (problem, None))
    raise ValueError(f"unknown request {op!r}")


def serve(inp: BinaryIO, out: BinaryIO) -> None:
    """The child's loop: one request in, one reply out, until stdin closes."""
    while header := inp.read(_HEADER.size):
        if len(header) < _HEADER.size:
            return
        (size,) = _HEADER.unpack(header)
        op, data, arg = pickle.loads(inp.read(size))  # noqa: S301 (from the server that started us)
        body = pickle.dumps(answer(op, data, arg), protocol=pickle.HIGHEST_PROTOCOL)
        out.write(_HEADER.pack(len(body)) + body)
        out.flush()
        del data, body  # the request's objects go before the next one arrives


if __name__ == "__main__":
    serve(sys.stdin.buffer, sys.stdout.buffer)
