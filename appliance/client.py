"""Python client for the appliance: async (`AsyncClient`) and sync (`Client`).

    async with AsyncClient("ws://127.0.0.1:9100/exec") as c:
        ex = await c.execute("print(2+2)\\n6*7", files={"data.csv": b"a,b\\n"})
        ex.stdout                   # "4\\n"
        ex.text                     # "42": the last result's text/plain
        ex.results[0].png           # bytes of an image/png result, or None
        ex.error and ex.error.name  # "ZeroDivisionError", with .value and .traceback
        ex.files[0].bytes           # a file the run wrote under outputs/

Several requests may run at once on one connection; frames are routed by `id`. `stream()`
yields the wire frames as they arrive (dicts, exactly as the server sent them);
`execute()` gathers them into an `Execution` of typed parts.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import builtins
import contextlib
import itertools
import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import AsyncGenerator, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypedDict, Unpack

import websockets
from websockets.asyncio.client import ClientConnection

from appliance.protocol import GpuRequest

Frame = dict[str, Any]


class ClientError(Exception):
    """The connection failed or the server broke the protocol."""


class CellOptions(TypedDict, total=False):
    """The optional fields of an execute request, as keyword arguments (see protocol.md)."""

    id: str | None
    timeout_ms: int | None
    files: Mapping[str, bytes | str] | None
    gpu: GpuRequest | Mapping[str, int] | None
    stdin_eof: bool


class RequestOptions(CellOptions, total=False):
    """CellOptions and the session to run in (a session object sets that itself)."""

    session: str | None


class Output(dict[str, Any]):
    """A result or display: its MIME bundle as sent (a dict), with typed views of it."""

    def _text(self, mime: str) -> str | None:
        value = self.get(mime)
        return value if isinstance(value, str) else None

    def _binary(self, mime: str) -> builtins.bytes | None:
        value = self.get(mime)
        return base64.b64decode(value) if isinstance(value, str) else None

    @property
    def text(self) -> str | None:
        """text/plain: what Jupyter would print."""
        return self._text("text/plain")

    @property
    def html(self) -> str | None:
        return self._text("text/html")

    @property
    def markdown(self) -> str | None:
        return self._text("text/markdown")

    @property
    def svg(self) -> str | None:
        return self._text("image/svg+xml")

    @property
    def png(self) -> builtins.bytes | None:
        """image/png, decoded."""
        return self._binary("image/png")

    @property
    def jpeg(self) -> builtins.bytes | None:
        """image/jpeg, decoded."""
        return self._binary("image/jpeg")

    @property
    def json(self) -> Any:
        """application/json, as the value it holds (None when absent)."""
        return self.get("application/json")


class _WireFields:
    """`obj["field"]` reads the wire frame: the typed classes used to be plain frames."""

    frame: Frame

    def __getitem__(self, key: str) -> Any:
        return self.frame[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.frame.get(key, default)


@dataclass(frozen=True)
class ExecutionError(_WireFields):
    """The exception the code raised (an `error` frame)."""

    name: str
    value: str
    traceback: list[str]
    frame: Frame = field(repr=False, compare=False)

    @classmethod
    def from_frame(cls, frame: Frame) -> ExecutionError:
        tb = frame.get("traceback")
        return cls(
            str(frame.get("ename", "")),
            str(frame.get("evalue", "")),
            [str(line) for line in tb] if isinstance(tb, list) else [],
            frame,
        )


@dataclass(frozen=True)
class OutputFile(_WireFields):
    """A file the run wrote under `outputs/`; `bytes` is None when it was too big to send."""

    path: str
    size: int
    bytes: builtins.bytes | None
    url: str | None
    message: str | None
    frame: Frame = field(repr=False, compare=False)

    @classmethod
    def from_frame(cls, frame: Frame) -> OutputFile:
        data = frame.get("data")
        try:
            blob = base64.b64decode(data, validate=True) if isinstance(data, str) else None
        except (binascii.Error, ValueError):
            raise ClientError(
                f"the server sent file {frame.get('path')!r} with data that is not base64"
            ) from None
        return cls(
            str(frame.get("path", "")),
            int(frame.get("size") or 0),
            blob,
            frame.get("url"),
            frame.get("message"),
            frame,
        )


@dataclass
class Execution:
    """Everything one request produced, gathered from its frames."""

    id: str
    status: str = "internal"
    stdout: str = ""
    stderr: str = ""
    results: list[Output] = field(default_factory=list)
    displays: list[Output] = field(default_factory=list)
    error: ExecutionError | None = None
    files: list[OutputFile] = field(default_factory=list)
    exit_code: int | None = None
    duration_ms: int | None = None
    message: str | None = None
    session: str | None = None
    run: str | None = None
    frames: list[Frame] = field(default_factory=list)

    @property
    def text(self) -> str | None:
        """The last result's text/plain, if any."""
        return self.results[-1].text if self.results else None

    def add(self, frame: Frame) -> None:
        """Take in one frame of this request."""
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
            self.results.append(Output(frame.get("data") or {}))
        elif kind == "display":
            self.displays.append(Output(frame.get("data") or {}))
        elif kind == "error":
            self.error = ExecutionError.from_frame(frame)
        elif kind == "file":
            self.files.append(OutputFile.from_frame(frame))
        elif kind == "done":
            self.status = frame.get("status", "internal")
            self.exit_code = frame.get("exit_code")
            self.duration_ms = frame.get("duration_ms")
            self.message = frame.get("message")
            self.session = frame.get("session") or self.session

    def file(self, path: str) -> OutputFile:
        """The output file at `path` (relative to outputs/); KeyError when there is none."""
        for item in self.files:
            if item.path == path:
                return item
        raise KeyError(path)

    def file_bytes(self, path: str) -> bytes:
        """The content of the output file at `path`; KeyError when it is absent or was not sent."""
        blob = self.file(path).bytes
        if blob is None:
            raise KeyError(path)
        return blob


def request_frame(code: str, rid: str, **options: Unpack[RequestOptions]) -> Frame:
    """The execute frame for `code`, with every option checked for its type first."""
    unknown = set(options) - RequestOptions.__optional_keys__
    if unknown:
        raise TypeError(f"unexpected keyword argument(s): {', '.join(sorted(unknown))}")
    _expect("code", code, str)
    _expect("id", rid, str)
    frame: Frame = {"type": "execute", "id": rid, "code": code}
    session = options.get("session")
    if session is not None:
        frame["session"] = _expect("session", session, str)
    timeout_ms = options.get("timeout_ms")
    if timeout_ms is not None:
        if isinstance(timeout_ms, bool) or not isinstance(timeout_ms, int):
            raise TypeError(f"timeout_ms must be an int (milliseconds), got {type(timeout_ms).__name__}")
        frame["timeout_ms"] = timeout_ms
    files = options.get("files")
    if files:
        frame["files"] = _wire_files(files)
    gpu = options.get("gpu")
    if gpu is not None:
        frame["gpu"] = _wire_gpu(gpu)
    if _expect("stdin_eof", options.get("stdin_eof", False), bool):
        frame["stdin_eof"] = True
    return frame


def _expect(name: str, value: Any, kind: type) -> Any:
    if not isinstance(value, kind):
        raise TypeError(f"{name} must be {kind.__name__}, got {type(value).__name__}")
    return value


def _wire_files(files: object) -> list[dict[str, str]]:
    if not isinstance(files, Mapping):
        raise TypeError(
            f"files must be a mapping of path -> bytes or str, like {{'data.csv': b'...'}}; "
            f"got {type(files).__name__}"
        )
    out = []
    for path, data in files.items():
        if not isinstance(path, str):
            raise TypeError(f"files: a path must be a str, got {type(path).__name__}")
        if isinstance(data, str):
            data = data.encode()
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"files[{path!r}] must be bytes or str, got {type(data).__name__}")
        out.append({"path": path, "data": base64.b64encode(data).decode()})
    return out


def _wire_gpu(gpu: object) -> dict[str, Any]:
    if isinstance(gpu, GpuRequest):
        return {"memory_mb": gpu.memory_mb}
    if isinstance(gpu, Mapping):
        return dict(gpu)
    raise TypeError(
        f"gpu must be a GpuRequest or a mapping like {{'memory_mb': 2048}}, got {type(gpu).__name__}"
    )


class AsyncClient:
    """One WebSocket connection; use as `async with`."""

    def __init__(
        self,
        url: str = "ws://127.0.0.1:9100/exec",
        token: str | None = None,
        max_size: int | None = 64 * 1024 * 1024,
    ) -> None:
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
        """Close the connection; requests still in flight end with ClientError."""
        if self._ws is not None:
            await self._ws.close()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader

    async def _read(self) -> None:
        if self._ws is None:
            raise RuntimeError("the client is not connected: use `async with`")
        try:
            async for raw in self._ws:
                frame = json.loads(raw)
                queue = self._queues.get(frame.get("id", "")) if isinstance(frame, dict) else None
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
        if self._ws is None:
            raise RuntimeError("the client is not connected: use `async with`")
        await self._ws.send(json.dumps(frame))

    def new_id(self) -> str:
        """A fresh request id, unique on this connection."""
        return f"c{next(self._ids)}"

    async def stream(self, code: str, **options: Unpack[RequestOptions]) -> AsyncGenerator[Frame, None]:
        """Send an execute request and yield its frames up to and including `done`."""
        rid = options.pop("id", None) or self.new_id()
        frame = request_frame(code, rid, **options)  # a bad argument fails here, before anything is sent
        queue: asyncio.Queue[Frame | None] = asyncio.Queue()
        self._queues[rid] = queue
        try:
            await self.send(frame)
            while True:
                reply = await queue.get()
                if reply is None:
                    raise ClientError(f"connection closed before request {rid} was done")
                yield reply
                if reply.get("type") == "done":
                    return
        finally:
            self._queues.pop(rid, None)

    async def execute(self, code: str, **options: Unpack[RequestOptions]) -> Execution:
        """Run code to the end and gather its output."""
        rid = options["id"] = options.get("id") or self.new_id()
        result = Execution(id=rid)
        async for frame in self.stream(code, **options):
            result.add(frame)
        return result

    async def stdin(self, rid: str, data: str, eof: bool = False) -> None:
        """Feed the stdin of running request `rid`."""
        await self.send({"type": "stdin", "id": rid, "data": data, "eof": eof})

    async def interrupt(self, rid: str) -> None:
        """Stop running request `rid` (its done status is `cancelled`)."""
        await self.send({"type": "interrupt", "id": rid})

    async def close_session(self, session: str) -> Frame:
        """End a session and its jail; returns the server's `done` frame."""
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
        """A stateful session on this connection, opened by its first `execute`."""
        return AsyncSession(self)

    async def models(self) -> list[dict[str, Any]]:
        """The appliance's model catalogue (GET /v1/models on the same host and token)."""
        return await asyncio.to_thread(_get_models, self.url, self.token)


def _in_session(options: CellOptions, session: str | None) -> RequestOptions:
    if "session" in options:
        raise TypeError("a session's execute() sets 'session' itself")
    return RequestOptions(**options, session=session or "new")


class AsyncSession:
    """A stateful session: every `execute` runs in the same interpreter."""

    def __init__(self, client: AsyncClient) -> None:
        self.client = client
        self.id: str | None = None

    async def execute(self, code: str, **options: Unpack[CellOptions]) -> Execution:
        """Run a cell in this session (the first one opens it)."""
        result = await self.client.execute(code, **_in_session(options, self.id))
        if self.id is None and result.session:
            self.id = result.session
        return result

    async def close(self) -> None:
        """End the session and its jail."""
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
        """Close the connection and the private loop."""
        with contextlib.suppress(Exception):
            self._runner.run(self._async.close())
        self._runner.close()

    def execute(self, code: str, **options: Unpack[RequestOptions]) -> Execution:
        """Run code to the end and gather its output."""
        return self._runner.run(self._async.execute(code, **options))

    def stream(self, code: str, **options: Unpack[RequestOptions]) -> Iterator[Frame]:
        """Send an execute request and yield its frames up to and including `done`."""
        agen = self._async.stream(code, **options)

        async def step() -> Frame | None:
            try:
                return await agen.__anext__()
            except StopAsyncIteration:
                return None

        while (frame := self._runner.run(step())) is not None:
            yield frame

    def close_session(self, session: str) -> Frame:
        """End a session and its jail; returns the server's `done` frame."""
        return self._runner.run(self._async.close_session(session))

    def session(self) -> Session:
        """A stateful session on this connection, opened by its first `execute`."""
        return Session(self)

    def models(self) -> list[dict[str, Any]]:
        """The appliance's model catalogue (GET /v1/models on the same host and token)."""
        return _get_models(self._async.url, self._async.token)


class Session:
    """Synchronous stateful session."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.id: str | None = None

    def execute(self, code: str, **options: Unpack[CellOptions]) -> Execution:
        """Run a cell in this session (the first one opens it)."""
        result = self.client.execute(code, **_in_session(options, self.id))
        if self.id is None and result.session:
            self.id = result.session
        return result

    def close(self) -> None:
        """End the session and its jail."""
        if self.id is not None:
            self.client.close_session(self.id)
            self.id = None

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _get_models(ws_url: str, token: str | None) -> list[dict[str, Any]]:
    """GET /v1/models of the appliance whose WebSocket is ws_url (ws -> http, wss -> https)."""
    parts = urllib.parse.urlsplit(ws_url)
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme)
    if scheme is None:
        raise ClientError(f"not a ws:// or wss:// URL: {ws_url!r}")
    # S310: the scheme is http(s), chosen above.
    req = urllib.request.Request(urllib.parse.urlunsplit((scheme, parts.netloc, "/v1/models", "", "")))  # noqa: S310
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:  # noqa: S310 (the scheme is http(s) by construction)
            body = json.load(resp)
    except urllib.error.HTTPError as exc:
        raise ClientError(
            f"GET /v1/models answered {exc.code}: {exc.read().decode(errors='replace')[:300]}"
        ) from None
    except OSError as exc:
        raise ClientError(f"GET /v1/models failed: {exc}") from None
    models: list[dict[str, Any]] = body["models"]
    return models
