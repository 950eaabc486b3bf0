"""Python client for the appliance: async (`AsyncClient`) and sync (`Client`).

    async with AsyncClient("ws://127.0.0.1:9100/exec") as c:
        ex = await c.execute("print(2+2)")
        print(ex.stdout)            # "4\n"

Several requests may run at once on one connection; frames are routed by `id`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import websockets
from websockets.asyncio.client import ClientConnection

Frame = dict[str, Any]


class ClientError(Exception):
    """The connection failed or the server broke the protocol."""


@dataclass
class Execution:
    """Everything one request produced, gathered from its frames."""

    id: str
    status: str = "internal"
    stdout: str = ""
    stderr: str = ""
    results: list[dict[str, Any]] = field(default_factory=list)
    displays: list[dict[str, Any]] = field(default_factory=list)
    error: Frame | None = None
    files: list[Frame] = field(default_factory=list)
    exit_code: int | None = None
    duration_ms: int | None = None
    message: str | None = None
    session: str | None = None
    run: str | None = None
    frames: list[Frame] = field(default_factory=list)

    @property
    def text(self) -> str | None:
        """The last result's text/plain, if any."""
        return self.results[-1].get("text/plain") if self.results else None

    def add(self, frame: Frame) -> None:
        self.frames.append(frame)
        kind = frame.get("type")
        if kind == "start":
            self.session = frame.get("session") or self.session
            self.run = frame.get("run")
        elif kind == "stream":
            if frame.get("name") == "stderr":
                self.stderr += frame.get("text", "")
            else:
                self.stdout += frame.get("text", "")
        elif kind == "result":
            self.results.append(frame.get("data", {}))
        elif kind == "display":
            self.displays.append(frame.get("data", {}))
        elif kind == "error":
            self.error = frame
        elif kind == "file":
            self.files.append(frame)
        elif kind == "done":
            self.status = frame.get("status", "internal")
            self.exit_code = frame.get("exit_code")
            self.duration_ms = frame.get("duration_ms")
            self.message = frame.get("message")
            self.session = frame.get("session") or self.session

    def file_bytes(self, path: str) -> bytes:
        for item in self.files:
            if item.get("path") == path and item.get("data") is not None:
                return base64.b64decode(item["data"])
        raise KeyError(path)


def request_frame(code: str, rid: str, **fields: Any) -> Frame:
    frame: Frame = {"type": "execute", "id": rid, "code": code}
    files = fields.pop("files", None)
    if files:
        frame["files"] = [
            {"path": p, "data": base64.b64encode(d if isinstance(d, bytes) else d.encode()).decode()}
            for p, d in files.items()
        ]
    frame.update({k: v for k, v in fields.items() if v is not None})
    return frame


class AsyncClient:
    """One WebSocket connection; use as `async with`."""

    def __init__(self, url: str = "ws://127.0.0.1:9100/exec", token: str | None = None,
                 max_size: int | None = 64 * 1024 * 1024) -> None:
        self.url = url
        self.token = token
        self.max_size = max_size
        self._ws: ClientConnection | None = None
        self._queues: dict[str, asyncio.Queue[Frame | None]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._ids = itertools.count(1)
        self.unrouted: list[Frame] = []

    async def __aenter__(self) -> AsyncClient:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else None
        self._ws = await websockets.connect(self.url, additional_headers=headers, max_size=self.max_size)
        self._reader = asyncio.create_task(self._read())
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._ws is not None:
            await self._ws.close()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader

    async def _read(self) -> None:
        assert self._ws is not None
        try:
            async for raw in self._ws:
                frame = json.loads(raw)
                queue = self._queues.get(frame.get("id", ""))
                if queue is None:
                    self.unrouted.append(frame)
                else:
                    queue.put_nowait(frame)
        except websockets.ConnectionClosed:
            pass
        finally:
            for queue in self._queues.values():
                queue.put_nowait(None)

    async def send(self, frame: Frame) -> None:
        """Send a raw frame (stdin, interrupt, close_session, or anything)."""
        assert self._ws is not None, "use `async with`"
        await self._ws.send(json.dumps(frame))

    def new_id(self) -> str:
        return f"c{next(self._ids)}"

    async def stream(self, code: str, *, id: str | None = None, **fields: Any) -> AsyncIterator[Frame]:
        """Send an execute request and yield its frames up to and including `done`."""
        rid = id or self.new_id()
        queue: asyncio.Queue[Frame | None] = asyncio.Queue()
        self._queues[rid] = queue
        try:
            await self.send(request_frame(code, rid, **fields))
            while True:
                frame = await queue.get()
                if frame is None:
                    raise ClientError(f"connection closed before request {rid} was done")
                yield frame
                if frame.get("type") == "done":
                    return
        finally:
            self._queues.pop(rid, None)

    async def execute(self, code: str, **fields: Any) -> Execution:
        """Run code to the end and gather its output."""
        rid = fields.pop("id", None) or self.new_id()
        result = Execution(id=rid)
        async for frame in self.stream(code, id=rid, **fields):
            result.add(frame)
        return result

    async def stdin(self, rid: str, data: str, eof: bool = False) -> None:
        await self.send({"type": "stdin", "id": rid, "data": data, "eof": eof})

    async def interrupt(self, rid: str) -> None:
        await self.send({"type": "interrupt", "id": rid})

    async def close_session(self, session: str) -> Frame:
        rid = self.new_id()
        queue: asyncio.Queue[Frame | None] = asyncio.Queue()
        self._queues[rid] = queue
        try:
            await self.send({"type": "close_session", "session": session, "id": rid})
            frame = await queue.get()
            if frame is None:
                raise ClientError("connection closed")
            return frame
        finally:
            self._queues.pop(rid, None)

    def session(self) -> AsyncSession:
        return AsyncSession(self)


class AsyncSession:
    """A stateful session: every `execute` runs in the same interpreter."""

    def __init__(self, client: AsyncClient) -> None:
        self.client = client
        self.id: str | None = None

    async def execute(self, code: str, **fields: Any) -> Execution:
        result = await self.client.execute(code, session=self.id or "new", **fields)
        if self.id is None and result.session:
            self.id = result.session
        return result

    async def close(self) -> None:
        if self.id is not None:
            await self.client.close_session(self.id)
            self.id = None

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class Client:
    """Synchronous client over a private event loop thread."""

    def __init__(self, url: str = "ws://127.0.0.1:9100/exec", token: str | None = None) -> None:
        self._runner = asyncio.Runner()
        self._async = AsyncClient(url, token)
        self._runner.run(self._async.__aenter__())

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._runner.run(self._async.close())
        self._runner.close()

    def execute(self, code: str, **fields: Any) -> Execution:
        return self._runner.run(self._async.execute(code, **fields))

    def stream(self, code: str, **fields: Any) -> Iterator[Frame]:
        agen = self._async.stream(code, **fields)

        async def step() -> Frame | None:
            try:
                return await agen.__anext__()
            except StopAsyncIteration:
                return None

        while (frame := self._runner.run(step())) is not None:
            yield frame

    def close_session(self, session: str) -> Frame:
        return self._runner.run(self._async.close_session(session))

    def session(self) -> Session:
        return Session(self)


class Session:
    """Synchronous stateful session."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.id: str | None = None

    def execute(self, code: str, **fields: Any) -> Execution:
        result = self.client.execute(code, session=self.id or "new", **fields)
        if self.id is None and result.session:
            self.id = result.session
        return result

    def close(self) -> None:
        if self.id is not None:
            self.client.close_session(self.id)
            self.id = None

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
