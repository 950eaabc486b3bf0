"""What the two transports (WebSocket in server.py, REST in rest.py) share: reading the
caller's token and origin, parsing frames within bounds, sending with a stall bound, and
noticing a connection that is gone.

A client that takes no frame for SANDBOX_CLIENT_STALL_MS is dropped: its connection is
aborted, so it holds none of the server's memory; its runs go on to their end within their
own limits, their frames kept for an `attach` (appliance.api.runlog).

No frame can stall the event loop for long (`FrameParser`): its size is checked before any
parsing, a big one is parsed in a child process (`ParseWorker`), one at a time for the whole
server, and its file entries are counted before they are validated.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import weakref
from collections.abc import AsyncIterator, Awaitable, Iterable, Iterator

from aiohttp import web

from appliance.api.runlog import RunStore
from appliance.core.errors import Busy, Cancelled
from appliance.core.service import RunService
from appliance.core.tasks import TaskScope
from appliance.settings import DEFAULT_PORTS, ORIGIN_RE
from appliance.wire import protocol
from appliance.wire.parse_worker import ParseWorker
from appliance.wire.protocol import ClientMessage, ProtocolError

GONE_POLL_S = 0.25
# Frames up to this size are parsed on the event loop (well under a millisecond); bigger
# ones in the parser's child process: a frame of hundreds of thousands of file entries holds
# the loop for seconds to parse and validate, and a fraction of that even when its entry
# count refuses it, which a thread would still hold the GIL for (parse_worker.py).
OFF_LOOP_BYTES = 64 * 1024


class FrameParser:
    """Client frames to typed messages, so that no frame holds the event loop for long.

    A frame that is refused costs its tenant one rate token (`RunService.charge_rejected`),
    and a tenant whose rate bucket is empty may send no big frame (`busy`, not parsed).
    """

    def __init__(self, service: RunService, worker: ParseWorker | None = None) -> None:
        self._service = service
        self._limits = protocol.Limits.from_settings(service.settings)
        self.worker = worker or ParseWorker()
        self._big = asyncio.Semaphore(1)  # big frames are parsed one at a time, server-wide

    async def parse(self, data: str | bytes, owner: str) -> ClientMessage:
        """The frame's message; ProtocolError (rejected) or Busy (over the rate) otherwise."""
        limits = self._limits
        # A refused frame costs its tenant a rate token (`_charged`); a run's small frame,
        # nearly every one, is judged here without a context manager's calls on its path.
        if len(data) <= OFF_LOOP_BYTES:
            try:
                return protocol.parse_client_frame(data, limits)  # its size checked there
            except ProtocolError:
                self._service.charge_rejected(owner)
                raise
        with self._charged(owner):
            protocol.check_size(data, limits)
            async with self._big_one(data, owner, "frame"):
                return await self.worker.parse(data, limits)

    async def screen(self, data: bytes, owner: str) -> None:
        """For a body another parser reads on the loop (the MCP SDK's): over OFF_LOOP_BYTES,
        ProtocolError (rejected) unless it holds at most `json_values_allowed` JSON values, or
        Busy (over the rate); counted in the parser's child, one at a time like big frames."""
        limits = self._limits
        if len(data) <= OFF_LOOP_BYTES:
            # The SDK's parser recurses: a small body nested thousands deep would end its
            # session with a 500. Judged here without parsing (bounded by OFF_LOOP_BYTES).
            if protocol.nested_deeper_than(data):
                with self._charged(owner):
                    raise ProtocolError(f"the body is nested deeper than {protocol.MAX_JSON_DEPTH} levels")
            return
        with self._charged(owner):
            protocol.check_size(data, limits)
            async with self._big_one(data, owner, "body"):
                await self.worker.screen(data, json_values_allowed(limits), limits)

    @contextlib.contextmanager
    def _charged(self, owner: str) -> Iterator[None]:
        # A refused frame or body costs its tenant one rate token.
        try:
            yield
        except ProtocolError:
            self._service.charge_rejected(owner)
            raise

    @contextlib.asynccontextmanager
    async def _big_one(self, data: str | bytes, owner: str, what: str) -> AsyncIterator[None]:
        # A tenant with no rate token left may send nothing big; big ones go one at a time.
        refusal = self._service.over_rate(owner)
        if refusal is not None:
            raise Busy(f"{refusal}; a {what} of {len(data)} bytes was not read")
        async with self._big:
            yield


def json_values_allowed(limits: protocol.Limits) -> int:
    """The most JSON values a request body may hold: a few per upload entry and a margin for
    the envelope and options. Parsing that many on the loop takes milliseconds; a body of
    hundreds of thousands of values holds it for over a second in the MCP SDK's parser."""
    return 8 * limits.max_upload_files + 4096


PARSER_KEY = web.AppKey("parser", FrameParser)
# Every run's frames, kept for attach, and the scope its runs are tasks of (`runlog.RunStore`):
# a run outlives the connection or REST request that started it.
RUNS_KEY = web.AppKey("runs", RunStore)
# The server's own tasks (the parser child's start, MCP's session manager): opened at the app's
# startup, closed at its cleanup (`server.make_app`).
TASKS_KEY = web.AppKey("tasks", TaskScope)


def origin_allowed(
    origins: Iterable[str], allowed: tuple[str, ...], host: str | None = None, tokens: bool = False
) -> bool:
    """Whether every `Origin` a request carries is one of SANDBOX_ALLOWED_ORIGINS (exact
    match) or the server's own origin (`own_origin`: the page came from this server, like
    /docs). No Origin at all (curl, websocat, SDK clients) is not a browser's cross-site
    request and passes; `Origin: null` is a browser's and does not."""
    return all(origin in allowed or own_origin(origin, host, tokens) for origin in origins)


def _host_port(hostport: str, scheme: str) -> tuple[str, int] | None:
    """`host[:port]` as (lower-case host, port), the port defaulting to the scheme's."""
    hostport = hostport.strip().lower()
    host, port = hostport, ""
    if hostport.startswith("["):  # [v6]:port
        end = hostport.find("]")
        if end < 0:
            return None
        host, rest = hostport[: end + 1], hostport[end + 1 :]
        if rest and not rest.startswith(":"):
            return None
        port = rest[1:]
    elif ":" in hostport:
        host, _, port = hostport.rpartition(":")
    if not host or (port and not port.isdigit()):
        return None
    return host, int(port) if port else DEFAULT_PORTS[scheme]


def _literal_or_localhost(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def host_allowed(host: str | None, allowed: frozenset[str] | None) -> bool:
    """Whether a request's `Host` header names this server: any, when `allowed` is None (no
    check); else an IP literal, `localhost` or a name in `allowed` (SANDBOX_ALLOWED_HOSTS).
    A DNS-rebinding page's requests carry its own domain in Host, never a literal. No Host
    at all (HTTP/1.0 tools) is no browser's and passes."""
    if allowed is None or host is None:
        return True
    parsed = _host_port(host, "http")
    if parsed is None:
        return False
    name = parsed[0].rstrip(".")
    return _literal_or_localhost(name) or name in allowed


def hosts_to_allow(configured: tuple[str, ...], bound: Iterable[str]) -> frozenset[str] | None:
    """The names Host may carry besides literals and localhost: SANDBOX_ALLOWED_HOSTS when
    set; none when every bound address is loopback; else None, no check (a server on a
    network address is reached by names the operator did not list: containers' health
    checks and Kubernetes probes send the pod's address, clients a Service's name)."""
    if configured:
        return frozenset(configured)
    return frozenset() if not exposed_without_token(bound) else None


def own_origin(origin: str, host: str | None, tokens: bool) -> bool:
    """Whether `origin` is the origin this request was sent to: its host and port are the
    request's `Host` header (the scheme may differ: TLS may end at a proxy in front).

    A DNS-rebinding page controls the name in both headers (evil.example resolving to this
    server), so without tokens only a Host that no DNS answer can forge passes: an IP
    literal or `localhost`. With tokens such a page still lacks the bearer token a browser
    never adds by itself, so any matching Host passes."""
    match = ORIGIN_RE.match(origin)
    if match is None or host is None:
        return False
    scheme, name, port = match.groups()
    mine = (name, int(port) if port else DEFAULT_PORTS[scheme])
    if _host_port(host, scheme) != mine:
        return False
    return tokens or _literal_or_localhost(name)


def exposed_without_token(hosts: Iterable[str]) -> list[str]:
    """The bound addresses that are not loopback (a server without a token must not be there)."""
    found = []
    for host in hosts:
        try:
            loopback = ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
        except ValueError:
            loopback = host == "localhost"
        if not loopback:
            found.append(host)
    return found


def bearer_token(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


async def send_within(
    request: web.Request, sending: Awaitable[object], stall_s: float, size: int | None = None
) -> None:
    """Await one send; Cancelled (and the connection aborted) if the client does not take it
    within stall_s, or if the connection broke. `size`: the bytes it writes, where known. A
    send waits for its client only once the transport's buffer passes its high-water mark
    (the writer then waits for it to drain): a send of fewer bytes than that to an empty
    buffer cannot wait, and needs no timer (a run's frames, nearly always)."""
    try:
        if size is not None and _cannot_wait(request, size):
            await sending
            return
        async with asyncio.timeout(stall_s):
            await sending
    except TimeoutError:
        abort(request)
        raise Cancelled(
            f"the client took no output for {stall_s:g} s (SANDBOX_CLIENT_STALL_MS); it was disconnected"
        ) from None
    except (ConnectionError, RuntimeError) as exc:
        raise Cancelled("the client disconnected") from exc


def _cannot_wait(request: web.Request, size: int) -> bool:
    # An empty buffer means the protocol is not paused (asyncio resumes it as the buffer
    # drains to its low-water mark), and what this write leaves buffered stays under the
    # high-water mark, so it does not pause it either: the writer has nothing to wait for.
    transport = request.transport
    if transport is None or transport.get_write_buffer_size():
        return False
    return size < transport.get_write_buffer_limits()[1]


def abort(request: web.Request) -> None:
    """Drop the connection now, without a closing handshake."""
    transport = request.transport
    if transport is not None:
        transport.abort()


def is_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


class _GoneWatch:
    """The connections that handlers wait on (`until_gone`), checked together every GONE_POLL_S
    by one timer of the event loop. aiohttp tells a handler nothing when its client's connection
    closes, so it is polled; with many requests waiting at once (a trainer's 64 clients, each
    queued for seconds), a timer and a task's wake-up per request per poll cost the server's
    CPU on every run."""

    def __init__(self) -> None:
        self._waiting: dict[asyncio.Future[None], web.Request] = {}
        self._timer: asyncio.TimerHandle | None = None

    def add(self, request: web.Request) -> asyncio.Future[None]:
        """A future set once the request's connection is closed; `discard` it when done."""
        loop = asyncio.get_running_loop()
        gone: asyncio.Future[None] = loop.create_future()
        self._waiting[gone] = request
        if self._timer is None:
            self._timer = loop.call_later(GONE_POLL_S, self._tick)
        return gone

    def discard(self, gone: asyncio.Future[None]) -> None:
        self._waiting.pop(gone, None)

    def _tick(self) -> None:
        self._timer = None
        for gone, request in list(self._waiting.items()):
            if gone.done() or is_gone(request):
                del self._waiting[gone]
                if not gone.done():
                    gone.set_result(None)
        if self._waiting:
            self._timer = asyncio.get_running_loop().call_later(GONE_POLL_S, self._tick)


# One watch per event loop (a test may run several, one after another); it holds no loop.
_WATCHES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _GoneWatch] = weakref.WeakKeyDictionary()


async def until_gone(request: web.Request) -> None:
    """Return once the client's TCP connection is closed (checked every GONE_POLL_S)."""
    if is_gone(request):
        return
    loop = asyncio.get_running_loop()
    watch = _WATCHES.get(loop)
    if watch is None:
        watch = _WATCHES[loop] = _GoneWatch()
    gone = watch.add(request)
    try:
        await gone
    finally:
        watch.discard(gone)
