"""Python client for the appliance: async (`AsyncClient`) and sync (`Client`).

    async with AsyncClient("ws://127.0.0.1:9100") as c:   # ws, wss, http or https; /exec optional
        ex = await c.execute("print(2+2)\\n6*7", files={"data.csv": b"a,b\\n"})
        ex.stdout                   # "4\\n"
        ex.text                     # "42": the main result's text/plain
        ex.results[0].png           # bytes of an image/png result or figure, or None
        if ex.error:                # any status but ok: the code raised, a timeout, a limit, busy…
            ex.error.name           # "ZeroDivisionError", "Timeout", "MemoryLimit", …
        ex.files[0].bytes           # a file the run wrote under outputs/

Several requests may run at once on one connection; frames are routed by `id`. `stream()`
yields typed events (`StdoutEvent`, `ResultEvent`, `DoneEvent`, …), each still the wire frame
as a dict; `execute()` gathers them into an `Execution`, calling `on_stdout`, `on_stderr`,
`on_result` and `on_error` as they arrive.

Failures to reach the appliance are typed: `AuthenticationError` (the token was refused),
`ConnectionFailed` (nothing answered, or not the appliance), `ConnectionLost` (the connection
dropped while a request ran: its result is unknown). After a drop the next request reconnects
(with backoff, for up to `reconnect_s`); a session the appliance still has goes on, one it
no longer has (it restarted) raises `SessionLost`.

Live egress approval (names mode): `execute(code, egress_ask=decide)` sends
`"egress": {"ask": true}`; each `egress_request` the run sends (a host its `egress_allow`
leaves out) is handed to `decide(request)` (an `EgressRequestEvent`: `.host`, `.port`,
`.flow`), which returns True/False, or `EgressAnswer(allow, scope="session")` to keep the
answer for the session's later cells; the client sends the `egress_decision`. A plain function
runs in a worker thread (it may take its time: ask a person), a coroutine function on the
loop; one that raises refuses the host, and its exception ends the stream.

A run goes on when its connection drops, and the appliance keeps its frames for a while
(SANDBOX_REATTACH_S): `attach(run)` follows it again from the last frame this client had
(`ConnectionLost.run` names it; every frame carries its `seq`, and the client remembers the
last one it saw of each run).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import builtins
import contextlib
import dataclasses
import inspect
import itertools
import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn, TypedDict, TypeVar, Unpack

import websockets
from websockets.asyncio.client import ClientConnection
from websockets.protocol import State

from appliance_client import retry
from appliance_client.protocol import GpuRequest
from appliance_client.retry import hint_of_done

Frame = dict[str, Any]
T = TypeVar("T")
DEFAULT_URL = "ws://127.0.0.1:9100/exec"
RECONNECT_S = 30.0  # how long a request waits for a lost appliance to come back
_BACKOFF_FIRST_S, _BACKOFF_MAX_S = 0.1, 2.0
# Close codes a server sends only once it has answered every request it took: a request with
# no reply yet was never run, so it is safe to send again on the next connection.
_CLEAN_CLOSES = frozenset((1001, 1012))
REMEMBERED_RUNS = 1024  # runs whose last seq a client remembers (the most recent ones)


class ClientError(Exception):
    """The connection failed or the server broke the protocol (the base of this module's errors)."""


class InvalidURL(ClientError, ValueError):
    """The URL is not one an appliance can be reached at."""


class AuthenticationError(ClientError):
    """The appliance refused the token (HTTP 401 or 403 on the upgrade); retrying will not help."""


class ConnectionFailed(ClientError, ConnectionError):
    """The appliance could not be reached, or what answered is not the appliance's /exec."""


class ConnectionLost(ClientError, ConnectionError):
    """The connection dropped while a request ran: its outcome is unknown. The next request
    reconnects. `run`: the run it had started (None if it had not), which `attach(run)`
    follows again from `seq`, the last frame of it this client had."""

    def __init__(self, message: str, run: str | None = None, seq: int | None = None) -> None:
        super().__init__(message)
        self.run = run
        self.seq = seq


class SessionLost(ClientError):
    """The connection dropped and the appliance no longer has the session (it restarted, or the
    session ended meanwhile): its variables and files are gone."""

    def __init__(self, session: str, reason: str) -> None:
        super().__init__(
            f"session {session} was lost: the connection to the appliance dropped and the "
            f"appliance no longer has it ({reason}). Its variables, imports and files are gone; "
            "start a new session."
        )
        self.session = session


def normalise_url(url: str) -> str:
    """The /exec WebSocket URL of an appliance given as ws://, wss://, http:// or https://,
    with or without /exec (http becomes ws, https wss; a path prefix, as behind a proxy, stays)."""
    if not isinstance(url, str):
        raise TypeError(f"url must be str, got {type(url).__name__}")
    parts = urllib.parse.urlsplit(url.strip())
    scheme = {"ws": "ws", "wss": "wss", "http": "ws", "https": "wss"}.get(parts.scheme.lower())
    if scheme is None or not parts.hostname:
        raise InvalidURL(
            f"not an appliance URL: {url!r}; give ws://HOST:PORT (or wss://, http://, https://), "
            "with or without /exec"
        )
    path = parts.path.rstrip("/")
    if not path.endswith("/exec"):
        path += "/exec"
    return urllib.parse.urlunsplit((scheme, parts.netloc, path, parts.query, ""))


def http_base(url: str) -> str:
    """The http(s) base of the appliance whose /exec is at `url` (any form normalise_url takes)."""
    parts = urllib.parse.urlsplit(normalise_url(url))
    scheme = "https" if parts.scheme == "wss" else "http"
    return urllib.parse.urlunsplit((scheme, parts.netloc, parts.path[: -len("/exec")], "", ""))


class CellOptions(TypedDict, total=False):
    """The optional fields of an execute request, as keyword arguments (see docs/protocol.md)."""

    id: str | None
    timeout_ms: int | None
    files: Mapping[str, bytes | str] | None
    gpu: GpuRequest | Mapping[str, int] | None
    stdin_eof: bool
    # Narrows the hosts the run may reach by name ("api.example.com:443"), within the server's
    # SANDBOX_EGRESS_ALLOW_DOMAINS: the execute frame's `egress.allow`.
    egress_allow: Sequence[str] | None
    # Live approval: a host egress_allow leaves out (every host, without it) waits for this
    # callback's answer (the execute frame's `egress.ask`; see the module's docstring).
    egress_ask: EgressAsker | None


class RequestOptions(CellOptions, total=False):
    """CellOptions and the session to run in (a session object sets that itself); with
    `"session": "new"`, `from_snapshot` starts the new session from a snapshot (a fork)."""

    session: str | None
    from_snapshot: str | None


class Callbacks(TypedDict, total=False):
    """Called as the run's output arrives (a coroutine function is awaited): `on_stdout` and
    `on_stderr` with each chunk of text, `on_result` with each result or figure (an Output),
    `on_error` with the typed error (the code's exception, or a timeout, a limit, …)."""

    on_stdout: Callable[[str], object] | None
    on_stderr: Callable[[str], object] | None
    on_result: Callable[[Output], object] | None
    on_error: Callable[[ExecutionError], object] | None


class ExecuteOptions(RequestOptions, Callbacks, total=False):
    """execute()'s keyword arguments: the request's options and the callbacks."""


class CellExecuteOptions(CellOptions, Callbacks, total=False):
    """A session's execute() keyword arguments."""


class Output(dict[str, Any]):
    """A result or figure: its MIME bundle as sent (a dict), with typed views of it.
    `is_main_result` tells the cell's value (a `result` frame) from a display (a figure,
    `display(obj)`)."""

    def __init__(self, data: Mapping[str, Any] | None = None, is_main_result: bool = False) -> None:
        super().__init__(data or {})
        self.is_main_result = is_main_result

    def _text(self, mime: str) -> str | None:
        value = self.get(mime)
        return value if isinstance(value, str) else None

    def _binary(self, mime: str) -> builtins.bytes | None:
        value = self.get(mime)
        return base64.b64decode(value) if isinstance(value, str) else None

    def formats(self) -> list[str]:
        """The MIME types this output has."""
        return list(self)

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
    def latex(self) -> str | None:
        return self._text("text/latex")

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


Result = Output  # the name other sandboxes' clients use for it


class _WireFields:
    """`obj["field"]` reads the wire frame: the typed classes used to be plain frames."""

    frame: Frame

    def __getitem__(self, key: str) -> Any:
        return self.frame[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.frame.get(key, default)


# done.status -> the error's name, and what it means when the server's message says nothing.
STATUS_ERRORS: dict[str, tuple[str, str]] = {
    "error": ("NonZeroExit", "the code exited with a non-zero code"),
    "timeout": ("Timeout", "the run exceeded its time limit"),
    "memory_limit": ("MemoryLimit", "the run exceeded its memory limit"),
    "gpu_memory_limit": ("GpuMemoryLimit", "the run exceeded its GPU memory budget"),
    "output_limit": ("OutputLimit", "the run exceeded the output limit"),
    "cancelled": ("Cancelled", "the run was interrupted"),
    "rejected": ("Rejected", "the request was rejected; nothing ran"),
    "busy": ("Busy", "the appliance is busy; nothing ran"),
    "internal": ("InternalError", "the appliance failed"),
}


@dataclass(frozen=True)
class ExecutionError(_WireFields):
    """Why a run did not end ok, for every status but ok (`status` is done's status).

    When the code raised (an `error` frame), it is that exception: `name` "ZeroDivisionError"
    or, under a memory limit, "MemoryError". Otherwise it stands for the status: `name`
    "Timeout", "MemoryLimit", "OutputLimit", "Busy", "Rejected", …, `value` the server's message,
    `traceback` where the code was when it was stopped, if it said. `raised` tells the two apart."""

    name: str
    value: str
    traceback: list[str]
    frame: Frame = field(repr=False, compare=False)
    status: str = "error"

    @classmethod
    def from_frame(cls, frame: Frame) -> ExecutionError:
        tb = frame.get("traceback")
        return cls(
            str(frame.get("ename", "")),
            str(frame.get("evalue", "")),
            [str(line) for line in tb] if isinstance(tb, list) else [],
            frame,
        )

    @classmethod
    def from_done(cls, done: Frame, raised: ExecutionError | None) -> ExecutionError:
        """The error a non-ok `done` stands for; `raised` is the code's own, if it sent one."""
        status = str(done.get("status") or "internal")
        # KeyboardInterrupt under a timeout or an interrupt is the appliance's stop, not the code's
        # error: the status names it, with the traceback of where it stopped the code.
        if raised is not None and not (status in _STOPS and raised.name == "KeyboardInterrupt"):
            return dataclasses.replace(raised, status=status)
        name, meaning = STATUS_ERRORS.get(status, (status, f"the run ended {status}"))
        message = done.get("message")
        value = str(message) if message else meaning
        if status == "error" and not message and isinstance(done.get("exit_code"), int):
            value = f"the code exited with code {done['exit_code']}"
        return cls(name, value, raised.traceback if raised is not None else [], done, status)

    @property
    def raised(self) -> bool:
        """True when the code raised it (an `error` frame), False for a status the run ended with."""
        return self.frame.get("type") == "error"

    def __getitem__(self, key: str) -> Any:
        # A status's error reads like an error frame too (ename/evalue/traceback).
        if not self.raised and key in _ERROR_FIELDS:
            return getattr(self, _ERROR_FIELDS[key])
        return self.frame[key]

    def get(self, key: str, default: Any = None) -> Any:
        if not self.raised and key in _ERROR_FIELDS:
            return getattr(self, _ERROR_FIELDS[key])
        return self.frame.get(key, default)


_STOPS = frozenset(("timeout", "cancelled"))
_ERROR_FIELDS = {"ename": "name", "evalue": "value", "traceback": "traceback"}


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


class Event(dict[str, Any]):
    """One frame from the server, exactly as sent (a dict: `event["type"]` still works), with
    typed views; stream() yields the subclass for its type (an unknown type stays an Event)."""

    @property
    def type(self) -> str:
        return str(self.get("type", ""))

    @property
    def id(self) -> str:
        return str(self.get("id", ""))

    @property
    def seq(self) -> int | None:
        """The frame's place among its run's frames (0, 1, 2, ...); None on a frame of no run."""
        seq = self.get("seq")
        return seq if isinstance(seq, int) else None


class EgressRequestEvent(Event):
    """A connection of the run to `host:port` waits for the client's answer (`egress.ask`)."""

    @property
    def flow(self) -> str:
        return str(self.get("flow", ""))

    @property
    def host(self) -> str:
        return str(self.get("host", ""))

    @property
    def port(self) -> int:
        port = self.get("port")
        return port if isinstance(port, int) else 0

    @property
    def timeout_ms(self) -> int | None:
        """How long the connection waits for the answer before it is refused."""
        value = self.get("timeout_ms")
        return value if isinstance(value, int) else None


@dataclass(frozen=True)
class EgressAnswer:
    """An egress_ask callback's answer: `scope` "run" keeps it for this run's later connections
    to the same host and port, "session" for the session's later cells that ask too."""

    allow: bool
    scope: str = "run"


# Called with each egress_request; returns True/False or an EgressAnswer (or an awaitable of one).
EgressAsker = Callable[[EgressRequestEvent], object]


class StartEvent(Event):
    """The run got a jail."""

    @property
    def run(self) -> str | None:
        return self.get("run")

    @property
    def session(self) -> str | None:
        return self.get("session")


class StdoutEvent(Event):
    """Text the code wrote to stdout."""

    @property
    def text(self) -> str:
        return str(self.get("text", ""))


class StderrEvent(StdoutEvent):
    """Text the code wrote to stderr."""


class ResultEvent(Event):
    """The cell's value (`result`; `.result.is_main_result`) or a figure or display (`display`)."""

    @property
    def result(self) -> Output:
        data = self.get("data")
        return Output(data if isinstance(data, Mapping) else {}, is_main_result=self.type == "result")


class ErrorEvent(Event):
    """The exception the code raised."""

    @property
    def error(self) -> ExecutionError:
        return ExecutionError.from_frame(self)


class FileEvent(Event):
    """A file the run wrote under outputs/."""

    @property
    def file(self) -> OutputFile:
        return OutputFile.from_frame(self)


class DoneEvent(Event):
    """The last frame of a request."""

    @property
    def status(self) -> str:
        return str(self.get("status") or "internal")

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def exit_code(self) -> int | None:
        return self.get("exit_code")

    @property
    def message(self) -> str | None:
        return self.get("message")


_EVENTS: dict[str, type[Event]] = {
    "start": StartEvent,
    "result": ResultEvent,
    "display": ResultEvent,
    "error": ErrorEvent,
    "file": FileEvent,
    "egress_request": EgressRequestEvent,
    "done": DoneEvent,
}


def event(frame: Mapping[str, Any]) -> Event:
    """The typed event for a wire frame."""
    kind = frame.get("type")
    if kind == "stream":
        return (StderrEvent if frame.get("name") == "stderr" else StdoutEvent)(frame)
    return _EVENTS.get(str(kind), Event)(frame)


@dataclass
class Execution:
    """Everything one request produced, gathered from its frames."""

    id: str
    status: str = "internal"
    stdout: str = ""
    stderr: str = ""
    results: list[Output] = field(default_factory=list)
    error: ExecutionError | None = None
    files: list[OutputFile] = field(default_factory=list)
    exit_code: int | None = None
    duration_ms: int | None = None
    message: str | None = None
    session: str | None = None
    run: str | None = None
    frames: list[Frame] = field(default_factory=list)
    retry_after_ms: int | None = None  # busy: when the appliance said to try again

    @property
    def ok(self) -> bool:
        """The run ended `ok` (then `error` is None)."""
        return self.status == "ok"

    @property
    def text(self) -> str | None:
        """The main result's (the cell's value's) text/plain, if any."""
        main = [r for r in self.results if r.is_main_result]
        return main[-1].text if main else None

    @property
    def displays(self) -> list[Output]:
        """The figures and displays alone (`results` holds them too, with the cell's value)."""
        return [r for r in self.results if not r.is_main_result]

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
        elif kind in ("result", "display"):
            data = frame.get("data")
            self.results.append(Output(data if isinstance(data, Mapping) else {}, kind == "result"))
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
            hint = frame.get("retry_after_ms")
            self.retry_after_ms = hint if isinstance(hint, int) and not isinstance(hint, bool) else None
            # Every status but ok has a typed error, so `if ex.error:` misses none of them.
            self.error = None if self.status == "ok" else ExecutionError.from_done(frame, self.error)

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
    from_snapshot = options.get("from_snapshot")
    if from_snapshot is not None:
        frame["from_snapshot"] = _expect("from_snapshot", from_snapshot, str)
    egress = _wire_egress(options.get("egress_allow"), options.get("egress_ask"))
    if egress:
        frame["egress"] = egress
    return frame


def _wire_egress(allow: object, asker: object) -> Frame:
    egress: Frame = {}
    if allow is not None:
        egress["allow"] = _wire_rules(allow)
    if asker is not None:
        if not callable(asker):
            raise TypeError("egress_ask must be a callable that decides an EgressRequestEvent")
        egress["ask"] = True
    return egress


async def _decision(asker: EgressAsker, request: EgressRequestEvent) -> Frame:
    """The egress_decision frame for one egress_request, as `asker` decides it."""
    if inspect.iscoroutinefunction(asker):
        answer = await asker(request)
    else:
        answer = await asyncio.to_thread(asker, request)  # it may wait for a person
        if inspect.isawaitable(answer):
            answer = await answer
    if isinstance(answer, EgressAnswer):
        allow, scope = answer.allow, answer.scope
    elif isinstance(answer, bool):
        allow, scope = answer, "run"
    else:
        raise TypeError(
            f"an egress_ask callback returns a bool or an EgressAnswer, not {type(answer).__name__}"
        )
    if scope not in ("run", "session"):
        raise ValueError(f'EgressAnswer.scope must be "run" or "session", not {scope!r}')
    return {"type": "egress_decision", "flow": request.flow, "allow": allow, "scope": scope}


async def _answer(ws: ClientConnection, asker: EgressAsker | None, frame: Frame) -> None:
    """Answer one egress_request of a run this client follows (refused when the asker raises)."""
    if asker is None or frame.get("type") != "egress_request" or not isinstance(frame, EgressRequestEvent):
        return
    try:
        decision = await _decision(asker, frame)
    except BaseException:
        with contextlib.suppress(websockets.ConnectionClosed):
            await ws.send(json.dumps({"type": "egress_decision", "flow": frame.flow, "allow": False}))
        raise
    with contextlib.suppress(websockets.ConnectionClosed):  # the stream sees the drop itself
        await ws.send(json.dumps(decision))


def _wire_rules(allow: object) -> list[str]:
    if (
        isinstance(allow, str)
        or not isinstance(allow, Sequence)
        or not all(isinstance(r, str) for r in allow)
    ):
        raise TypeError('egress_allow must be a list of "host:port" strings')
    return list(allow)


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
        return gpu.to_wire()
    if isinstance(gpu, Mapping):
        return dict(gpu)
    raise TypeError(
        f"gpu must be a GpuRequest or a mapping like {{'memory_mb': 2048}}, got {type(gpu).__name__}"
    )


class AsyncClient:
    """One WebSocket connection to the appliance, made again when it drops; use as `async with`.

    `url`: ws://, wss://, http:// or https://, with or without /exec. `reconnect_s`: how long a
    request waits for a lost appliance to come back (0: fail at once). `lazy`: connect on the
    first request rather than on entering (a process that may start before the appliance).
    `retry_busy_s`, `retry_busy_attempts`: a request the appliance refused `busy` (nothing ran)
    is sent again, with jittered exponential backoff that honours the server's
    `retry_after_ms`, for up to that many seconds from its first send and that many sends in
    all (appliance_client.retry); then its `busy` is the answer. 0 seconds or 1 attempt: no
    retry. A request with any other answer, or none (the connection dropped mid-run), is
    never sent again by it. stdin sent before a request's `start` is not sent again with it:
    feed stdin after `start`, or pass `retry_busy_s=0`."""

    def __init__(  # noqa: PLR0913 (keyword settings of a public client, each with a default)
        self,
        url: str = DEFAULT_URL,
        token: str | None = None,
        max_size: int | None = 64 * 1024 * 1024,
        reconnect_s: float = RECONNECT_S,
        open_timeout_s: float = 10.0,
        lazy: bool = False,
        retry_busy_s: float = retry.DEADLINE_S,
        retry_busy_attempts: int = retry.ATTEMPTS,
    ) -> None:
        self.url = normalise_url(url)
        self.busy_retry = retry.BusyRetry(retry_busy_s, retry_busy_attempts)
        self.busy_retries = 0  # requests sent again after a `busy`, so far
        self.token = token
        self.max_size = max_size
        self.reconnect_s = reconnect_s
        self.open_timeout_s = open_timeout_s
        self.lazy = lazy
        self.connections = 0  # connections made so far; a session opened on an earlier one may be gone
        self.unrouted: list[Frame] = []
        self._ws: ClientConnection | None = None
        # request id -> (the connection it was sent on, where the reader puts its frames; None
        # when that connection closed)
        self._queues: dict[str, tuple[int, asyncio.Queue[Frame | None]]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._ids = itertools.count(1)
        self._opened = False
        self._closing = False
        self._lock = asyncio.Lock()
        self._session_seen: dict[str, int] = {}  # session id -> the connection it was last used on
        # run id -> the last seq of it this client had (attach resumes after it), newest last
        self._last_seq: OrderedDict[str, int] = OrderedDict()

    async def __aenter__(self) -> AsyncClient:
        self._opened, self._closing = True, False
        if not self.lazy:
            await self._connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def connected(self) -> bool:
        """The connection is open now (as far as this end knows)."""
        return _usable(self._ws)

    async def close(self) -> None:
        """Close the connection; requests still in flight end with ConnectionLost."""
        self._closing = True
        if self._ws is not None:
            await self._ws.close()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader

    async def _connect(self) -> None:
        """One attempt; the errors are typed."""
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else None
        try:
            ws = await websockets.connect(
                self.url, additional_headers=headers, max_size=self.max_size, open_timeout=self.open_timeout_s
            )
        except websockets.InvalidStatus as exc:
            status = exc.response.status_code
            said = exc.response.body.decode(errors="replace")[:300] if exc.response.body else ""
            if status in (401, 403):
                raise AuthenticationError(
                    f"the appliance at {self.url} refused the connection (HTTP {status}): {said or 'no reason given'}; "
                    "check the token (SANDBOX_AUTH_TOKEN)"
                ) from None
            raise ConnectionFailed(
                f"{self.url} answered HTTP {status} instead of accepting a WebSocket: is this the "
                f"appliance? {said}".rstrip()
            ) from None
        except (OSError, TimeoutError, websockets.InvalidHandshake, websockets.InvalidURI) as exc:
            raise ConnectionFailed(
                f"could not reach the appliance at {self.url}: {exc or type(exc).__name__}"
            ) from None
        self._ws = ws
        self.connections += 1
        self._reader = asyncio.create_task(self._read(ws, self.connections))

    async def _ensure_connected(self) -> ClientConnection:
        """The open connection, made again (with backoff, up to reconnect_s) if it dropped."""
        if not self._opened:
            raise RuntimeError("the client is not connected: use `async with`")
        async with self._lock:
            if _usable(self._ws):
                assert self._ws is not None  # noqa: S101 (_usable checked it)
                return self._ws
            if self._closing:
                raise ClientError("the client is closed")
            deadline = asyncio.get_running_loop().time() + self.reconnect_s
            delay = _BACKOFF_FIRST_S
            while True:
                try:
                    await self._connect()
                except ConnectionFailed:
                    left = deadline - asyncio.get_running_loop().time()
                    if left <= 0:
                        raise
                    await asyncio.sleep(min(delay, left))
                    delay = min(delay * 2, _BACKOFF_MAX_S)
                    continue
                assert self._ws is not None  # noqa: S101 (set by _connect)
                return self._ws

    def _queue(self, rid: str, connection: int) -> asyncio.Queue[Frame | None]:
        queue: asyncio.Queue[Frame | None] = asyncio.Queue()
        self._queues[rid] = (connection, queue)
        return queue

    async def _read(self, ws: ClientConnection, connection: int) -> None:
        try:
            async for raw in ws:
                try:
                    frame = json.loads(raw)
                except (json.JSONDecodeError, TypeError):
                    self.unrouted.append({"type": "invalid", "raw": str(raw)[:1000]})
                    continue
                routed = self._queues.get(frame.get("id", "")) if isinstance(frame, dict) else None
                if routed is None:
                    self.unrouted.append(frame)
                else:
                    routed[1].put_nowait(event(frame))
        except websockets.ConnectionClosed:
            pass
        finally:
            for sent_on, queue in self._queues.values():
                if sent_on == connection:
                    queue.put_nowait(None)

    def _lost(self, ws: ClientConnection | None, rid: str, run: str | None = None) -> ConnectionLost:
        code = ws.close_code if ws is not None else None
        reason = ws.close_reason if ws is not None else ""
        said = f" (close code {code}{': ' + reason if reason else ''})" if code is not None else ""
        resume = f" Its run goes on: attach({run!r}) follows it again." if run is not None else ""
        return ConnectionLost(
            f"the connection to the appliance at {self.url} closed before request {rid} was done{said}; "
            f"its outcome is unknown. The next request reconnects.{resume}",
            run,
            self._last_seq.get(run) if run is not None else None,
        )

    def last_seq(self, run: str) -> int | None:
        """The seq of the last frame of `run` this client had (None: none, or forgotten)."""
        return self._last_seq.get(run)

    def _saw(self, run: str | None, frame: Frame) -> str | None:
        """Note a frame of a run (its `start` names the run): the seq an attach resumes after."""
        if frame.get("type") == "start" and isinstance(frame.get("run"), str):
            run = str(frame["run"])
        seq = frame.get("seq")
        if run is not None and isinstance(seq, int):
            self._last_seq[run] = seq
            self._last_seq.move_to_end(run)
            while len(self._last_seq) > REMEMBERED_RUNS:
                self._last_seq.popitem(last=False)
        return run

    async def send(self, frame: Frame) -> None:
        """Send a raw frame (stdin, interrupt, close_session, or anything), reconnecting first
        if the connection dropped."""
        ws = await self._ensure_connected()
        try:
            await ws.send(json.dumps(frame))
        except websockets.ConnectionClosed:
            raise self._lost(ws, str(frame.get("id", ""))) from None

    def new_id(self) -> str:
        """A fresh request id, unique on this client."""
        return f"c{next(self._ids)}"

    async def stream(self, code: str, **options: Unpack[RequestOptions]) -> AsyncGenerator[Event, None]:
        """Send an execute request and yield its events up to and including `done`."""
        rid = options.pop("id", None) or self.new_id()
        frame = request_frame(code, rid, **options)  # a bad argument fails here, before anything is sent
        session = options.get("session")
        asker = options.get("egress_ask")
        replied = False
        loop = asyncio.get_running_loop()
        first_sent = loop.time()
        resent = busy_sends = 0
        run: str | None = None
        try:
            while True:
                ws = await self._ensure_connected()
                connection = self.connections
                queue = self._queue(rid, connection)
                try:
                    await ws.send(json.dumps(frame))
                    sent = True
                except websockets.ConnectionClosed:
                    sent = False  # it never left: safe to send again
                refused: Frame | None = None
                while sent:
                    reply = await queue.get()
                    if reply is None:
                        break
                    if not replied and _is_busy(reply):
                        refused = reply  # nothing ran: held back while it may be sent again
                        break
                    replied = True
                    run = self._saw(run, reply)
                    self._note_session(reply, session, connection)
                    await _answer(ws, asker, reply)
                    yield reply  # type: ignore[misc]  # the reader queues Events
                    if reply.get("type") == "done":
                        return
                if refused is not None:
                    busy_sends += 1
                    wait = self.busy_retry.delay(busy_sends, loop.time() - first_sent, hint_of_done(refused))
                    if wait is None:
                        yield refused  # type: ignore[misc]  # the reader queues Events
                        return
                    self.busy_retries += 1
                    await asyncio.sleep(wait)
                    continue
                # The connection dropped. A clean close with no reply to this request means the
                # server never took it (it answers all it took before closing): send it again, once.
                if replied or resent or (sent and ws.close_code not in _CLEAN_CLOSES):
                    raise self._lost(ws, rid, run)
                resent += 1
        finally:
            self._queues.pop(rid, None)

    async def attach(
        self, run: str, after: int | None = None, egress_ask: EgressAsker | None = None
    ) -> AsyncGenerator[Event, None]:
        """Follow run `run` again (a start frame's `run`, or `ConnectionLost.run`), from any
        connection with the same token: its frames after seq `after` (None: after the last one
        this client had, else from the first), then the live ones, up to and including `done`.
        The frames carry this attach's own id (stdin() and interrupt() take it: `Event.id`).
        A run the appliance does not have (unknown, expired, or another tenant's) yields one
        `done` `rejected` "no such run". `egress_ask` answers the run's egress_requests from
        here on, as execute's does (those already answered or refused are turned down by the
        appliance, and change nothing)."""
        if after is None:
            after = self._last_seq.get(run, -1)
        rid = self.new_id()
        ws = await self._ensure_connected()
        queue = self._queue(rid, self.connections)
        try:
            try:
                await ws.send(json.dumps({"type": "attach", "id": rid, "run": run, "after": after}))
            except websockets.ConnectionClosed:
                raise self._lost(ws, rid, run) from None
            while True:
                reply = await queue.get()
                if reply is None:
                    raise self._lost(ws, rid, run)
                if reply.get("type") != "done" or reply.get("status") != "rejected":
                    self._saw(run, reply)
                await _answer(ws, egress_ask, reply)
                yield reply  # type: ignore[misc]  # the reader queues Events
                if reply.get("type") == "done":
                    return
        finally:
            self._queues.pop(rid, None)

    def _note_session(self, reply: Frame, session: str | None, connection: int) -> None:
        """Remember the connection a session was last used on; a session sent on a later one
        and unknown to the server was lost with the connection."""
        opened = reply.get("session")
        if isinstance(opened, str) and opened:
            self._session_seen[opened] = connection
        if (
            reply.get("type") == "done"
            and reply.get("status") == "rejected"
            and session not in (None, "new")
            and self._session_seen.get(str(session), connection) < connection
            and _no_such_session(str(reply.get("message") or ""))
        ):
            self._session_seen.pop(str(session), None)
            raise SessionLost(str(session), str(reply.get("message")))

    async def execute(self, code: str, **options: Unpack[ExecuteOptions]) -> Execution:
        """Run code to the end and gather its output, calling the callbacks as it arrives.
        Raises ConnectionLost if the connection drops mid-run, SessionLost if the session did
        not survive a reconnect."""
        on_stdout, on_stderr = options.pop("on_stdout", None), options.pop("on_stderr", None)
        on_result, on_error = options.pop("on_result", None), options.pop("on_error", None)
        callbacks = (on_stdout, on_stderr, on_result, on_error) != (None, None, None, None)
        rid = options["id"] = options.get("id") or self.new_id()
        result = Execution(id=rid)
        reported: ExecutionError | None = None
        events = self.stream(code, **options)  # type: ignore[misc]  # the callbacks were popped
        async with contextlib.aclosing(events):
            try:
                async for frame in events:
                    result.add(frame)
                    kind = frame.get("type")
                    if kind == "stream":
                        name = frame.get("name")
                        await _call(on_stderr if name == "stderr" else on_stdout, frame.get("text", ""))
                    elif kind in ("result", "display"):
                        await _call(on_result, result.results[-1])
                    # Once per error: done may restate the code's error with its status.
                    elif result.error is not None and (
                        reported is None or result.error.frame is not reported.frame
                    ):
                        reported = result.error
                        await _call(on_error, reported)
            except Exception:
                # A callback raised: stop the run rather than leave it running unread.
                running = bool(result.frames) and result.frames[-1].get("type") != "done"
                if callbacks and running and self.connected:
                    with contextlib.suppress(ClientError, websockets.ConnectionClosed):
                        await self.interrupt(rid)
                raise
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
        ws = await self._ensure_connected()
        queue = self._queue(rid, self.connections)
        try:
            await self.send({"type": "close_session", "session": session, "id": rid})
            frame = await queue.get()
            if frame is None:
                raise self._lost(ws, rid)
            self._session_seen.pop(session, None)
            return frame
        finally:
            self._queues.pop(rid, None)

    def session(self, from_snapshot: str | None = None) -> AsyncSession:
        """A stateful session on this connection, opened by its first `execute`; with
        `from_snapshot`, restored from that snapshot (each such session is a fork of it)."""
        return AsyncSession(self, from_snapshot)

    async def models(self) -> list[dict[str, Any]]:
        """The appliance's model catalogue (GET /v1/models on the same host and token)."""
        return await asyncio.to_thread(_get_models, self.url, self.token)

    async def snapshot(self, session: str) -> dict[str, Any]:
        """Keep session `session`'s state as a snapshot: `{"snapshot": id, "bytes": n,
        "skipped": ["name: why", ...], ...}` (POST /v1/sessions/{id}/snapshot)."""
        return await asyncio.to_thread(
            _http_json,
            self.url,
            self.token,
            "POST",
            f"/v1/sessions/{_path(session)}/snapshot",
            201,
            self.busy_retry,
        )

    async def snapshot_info(self, snapshot: str) -> dict[str, Any]:
        """A snapshot of this token's tenant (GET /v1/snapshots/{id})."""
        return await asyncio.to_thread(
            _http_json, self.url, self.token, "GET", f"/v1/snapshots/{_path(snapshot)}", 200, self.busy_retry
        )

    async def delete_snapshot(self, snapshot: str) -> None:
        """Delete a snapshot of this token's tenant (DELETE /v1/snapshots/{id})."""
        await asyncio.to_thread(
            _http_json,
            self.url,
            self.token,
            "DELETE",
            f"/v1/snapshots/{_path(snapshot)}",
            204,
            self.busy_retry,
        )


def _is_busy(reply: Frame) -> bool:
    return reply.get("type") == "done" and reply.get("status") == "busy"


def _usable(ws: ClientConnection | None) -> bool:
    # A transport already closing (aborted, or its peer gone) is not used for a new request,
    # even before the close reaches the connection's state.
    return ws is not None and ws.state is State.OPEN and not ws.transport.is_closing()


def _no_such_session(message: str) -> bool:
    # The server's words for a session it does not have (appliance.core.sessions.SessionRegistry.get).
    return message.startswith("no such session") or (
        message.startswith("session ") and " has ended" in message
    )


async def _call(callback: Callable[[Any], object] | None, value: Any) -> None:
    if callback is not None:
        outcome = callback(value)
        if inspect.isawaitable(outcome):
            await outcome


def _in_session(
    options: CellExecuteOptions, session: str | None, from_snapshot: str | None = None
) -> ExecuteOptions:
    if {"session", "from_snapshot"} & set(options):
        raise TypeError("a session's execute() sets 'session' and 'from_snapshot' itself")
    # Only the request that opens the session starts it from the snapshot.
    return ExecuteOptions(
        **options, session=session or "new", from_snapshot=from_snapshot if session is None else None
    )


def _opened(session: str | None) -> str:
    if session is None:
        raise ClientError("the session is not open yet: run a cell in it first")
    return session


class AsyncSession:
    """A stateful session: every `execute` runs in the same interpreter. With `from_snapshot`
    its first `execute` opens it restored from that snapshot."""

    def __init__(self, client: AsyncClient, from_snapshot: str | None = None) -> None:
        self.client = client
        self.id: str | None = None
        self.from_snapshot = from_snapshot

    async def snapshot(self) -> dict[str, Any]:
        """Keep this session's state (AsyncClient.snapshot); the session goes on."""
        return await self.client.snapshot(_opened(self.id))

    async def execute(self, code: str, **options: Unpack[CellExecuteOptions]) -> Execution:
        """Run a cell in this session (the first one opens it). SessionLost if the appliance
        lost it across a reconnect (the next execute opens a new one)."""
        try:
            result = await self.client.execute(code, **_in_session(options, self.id, self.from_snapshot))
        except SessionLost:
            self.id = None
            raise
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
    """Synchronous client. Its connection lives on a private event loop in a thread of its own,
    so it works where a loop already runs in the caller's thread (Jupyter, an async web app);
    each call blocks the calling thread until its result is in. Callbacks (on_stdout, …) run on
    that private thread."""

    def __init__(self, url: str = DEFAULT_URL, token: str | None = None, **options: Any) -> None:
        self._async = AsyncClient(url, token, **options)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="appliance-client", daemon=True)
        self._thread.start()
        try:
            self.run_async(self._async.__aenter__())
        except BaseException:
            self._stop_loop()
            raise

    @property
    def async_client(self) -> AsyncClient:
        """The AsyncClient underneath, whose coroutines run_async() runs."""
        return self._async

    @property
    def url(self) -> str:
        """The WebSocket URL, normalised."""
        return self._async.url

    def run_async(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine of the AsyncClient underneath on the private loop and wait for it."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("a sync Client cannot be called from its own callbacks")
        if self._loop.is_closed():
            coro.close()
            raise ClientError("the client is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # Ctrl-C in the caller's thread stops the waiting coroutine too
            raise

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection and the private loop."""
        if self._loop.is_closed():
            return
        with contextlib.suppress(Exception):
            self.run_async(self._async.close())
        self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def execute(self, code: str, **options: Unpack[ExecuteOptions]) -> Execution:
        """Run code to the end and gather its output (AsyncClient.execute)."""
        return self.run_async(self._async.execute(code, **options))

    def stream(self, code: str, **options: Unpack[RequestOptions]) -> Iterator[Event]:
        """Send an execute request and yield its events up to and including `done`."""
        return self._iterate(self._async.stream(code, **options))

    def attach(
        self, run: str, after: int | None = None, egress_ask: EgressAsker | None = None
    ) -> Iterator[Event]:
        """Follow run `run` again, up to and including `done` (AsyncClient.attach)."""
        return self._iterate(self._async.attach(run, after, egress_ask))

    def _iterate(self, agen: AsyncGenerator[Event, None]) -> Iterator[Event]:
        """An async generator's events, each awaited on this client's loop; closed there when
        the caller stops early."""
        try:
            while True:
                try:
                    event = self.run_async(agen.__anext__())
                except StopAsyncIteration:
                    return
                yield event
        finally:
            if not self._loop.is_closed():
                with contextlib.suppress(Exception):
                    self.run_async(agen.aclose())

    def last_seq(self, run: str) -> int | None:
        """The seq of the last frame of `run` this client had (AsyncClient.last_seq)."""
        return self._async.last_seq(run)

    def stdin(self, rid: str, data: str, eof: bool = False) -> None:
        """Feed the stdin of running request `rid`."""
        self.run_async(self._async.stdin(rid, data, eof))

    def interrupt(self, rid: str) -> None:
        """Stop running request `rid` (its done status is `cancelled`)."""
        self.run_async(self._async.interrupt(rid))

    def close_session(self, session: str) -> Frame:
        """End a session and its jail; returns the server's `done` frame."""
        return self.run_async(self._async.close_session(session))

    def session(self, from_snapshot: str | None = None) -> Session:
        """A stateful session on this connection, opened by its first `execute`; with
        `from_snapshot`, restored from that snapshot (each such session is a fork of it)."""
        return Session(self, from_snapshot)

    def models(self) -> list[dict[str, Any]]:
        """The appliance's model catalogue (GET /v1/models on the same host and token)."""
        return _get_models(self._async.url, self._async.token)

    def snapshot(self, session: str) -> dict[str, Any]:
        """AsyncClient.snapshot."""
        return self.run_async(self._async.snapshot(session))

    def snapshot_info(self, snapshot: str) -> dict[str, Any]:
        """AsyncClient.snapshot_info."""
        return self.run_async(self._async.snapshot_info(snapshot))

    def delete_snapshot(self, snapshot: str) -> None:
        """AsyncClient.delete_snapshot."""
        self.run_async(self._async.delete_snapshot(snapshot))


class Session:
    """Synchronous stateful session."""

    def __init__(self, client: Client, from_snapshot: str | None = None) -> None:
        self.client = client
        self.id: str | None = None
        self.from_snapshot = from_snapshot

    def snapshot(self) -> dict[str, Any]:
        """Keep this session's state (AsyncClient.snapshot); the session goes on."""
        return self.client.snapshot(_opened(self.id))

    def execute(self, code: str, **options: Unpack[CellExecuteOptions]) -> Execution:
        """Run a cell in this session (the first one opens it); SessionLost as AsyncSession's."""
        try:
            result = self.client.execute(code, **_in_session(options, self.id, self.from_snapshot))
        except SessionLost:
            self.id = None
            raise
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


def _get_models(url: str, token: str | None) -> list[dict[str, Any]]:
    """GET /v1/models of the appliance whose WebSocket is at `url`."""
    # S310: the scheme is http(s), by http_base's construction.
    req = urllib.request.Request(http_base(url) + "/v1/models")  # noqa: S310
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:  # noqa: S310 (the scheme is http(s) by construction)
            body = json.load(resp)
    except urllib.error.HTTPError as exc:
        said = exc.read().decode(errors="replace")[:300]
        if exc.code in (401, 403):
            raise AuthenticationError(f"GET /v1/models answered {exc.code}: {said}") from None
        raise ClientError(f"GET /v1/models answered {exc.code}: {said}") from None
    except OSError as exc:
        raise ConnectionFailed(f"GET /v1/models failed: {exc}") from None
    models: list[dict[str, Any]] = body["models"]
    return models


def _path(part: str) -> str:
    return urllib.parse.quote(_expect("id", part, str), safe="")


def _http_json(  # noqa: PLR0913 (a REST call's parts and its retry policy)
    url: str, token: str | None, method: str, path: str, expect: int, busy: retry.BusyRetry | None = None
) -> dict[str, Any]:
    """One REST call to the appliance whose WebSocket is at `url`: its JSON body (empty for
    204); ClientError with the server's words for any other status. A 429 (busy: nothing was
    done) is sent again under `busy`'s policy, after at least its Retry-After."""
    data = b"{}" if method == "POST" else None
    # S310: the scheme is http(s), by http_base's construction.
    req = urllib.request.Request(http_base(url) + path, data=data, method=method)  # noqa: S310
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    first, sends = time.monotonic(), 0
    while True:
        sends += 1
        try:
            with urllib.request.urlopen(req, timeout=300) as resp:  # noqa: S310 (the scheme is http(s) by construction)
                status, raw = resp.status, resp.read()
            break
        except urllib.error.HTTPError as exc:
            wait = None
            if exc.code == 429 and busy is not None:
                hint = retry.hint_of_header(exc.headers.get("Retry-After"))
                wait = busy.delay(sends, time.monotonic() - first, hint)
            if wait is None:
                _http_refused(method, path, exc)
            exc.close()
            time.sleep(wait or 0)  # on a worker thread (asyncio.to_thread)
        except OSError as exc:
            raise ConnectionFailed(f"{method} {path} failed: {exc}") from None
    if status != expect:
        raise ClientError(f"{method} {path} answered {status}")
    body: dict[str, Any] = json.loads(raw) if raw else {}
    return body


def _http_refused(method: str, path: str, exc: urllib.error.HTTPError) -> NoReturn:
    said = exc.read().decode(errors="replace")[:500]
    with contextlib.suppress(ValueError, AttributeError):
        said = str(json.loads(said).get("error") or said)
    if exc.code in (401, 403):
        raise AuthenticationError(f"{method} {path} answered {exc.code}: {said}") from None
    raise ClientError(f"{method} {path} answered {exc.code}: {said}") from None
