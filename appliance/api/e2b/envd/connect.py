"""Connect on aiohttp: a request for envd reaches its service through connectrpc's server.

connectrpc serves Connect as an ASGI application; `serve` hands it one aiohttp request (the
ASGI scope, the body as it arrives, the reply as it is sent) and nothing more, so all of
Connect's framing (unary and streams, codecs, compression, message size limits, the error
JSON and its HTTP statuses) is connectrpc's.

Who may call: the request names its sandbox in `E2b-Sandbox-Id` and carries that sandbox's
envd access token in `X-Access-Token` (the SDK sends both). `serve` looks the pair up first;
`SandboxGate`, a metadata interceptor, runs before connectrpc reads a byte of the body and
refuses a request whose pair did not match a live sandbox with Connect's `not_found` (an
unknown id, an ended sandbox and a wrong token read the same, so nothing tells a stranger
which ids exist; the SDK raises NotFoundException). A service's methods then ask
`sandbox_of()` for the sandbox the request reached.

A reply stream whose client stops reading is cut after SANDBOX_CLIENT_STALL_MS, and a call
whose client goes away is cancelled, so neither holds a watcher or a process stream open.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from aiohttp import web
from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext

from appliance.api.asgi import http_scope
from appliance.api.e2b.control import SANDBOXES_KEY
from appliance.api.e2b.engine import Sandboxes
from appliance.api.e2b.registry import Sandbox
from appliance.api.transport import send_within, until_gone
from appliance.core.errors import Cancelled

log = logging.getLogger("appliance.api.e2b.envd")

ENVD_PORT = "49983"
# The largest request message a service takes, after decompression (connectrpc's
# `read_max_bytes`): envd's requests are paths, commands and stdin chunks.
MAX_MESSAGE_BYTES = 1 << 20

ASGIMessage = dict[str, Any]


class ASGIApp(Protocol):
    async def __call__(
        self,
        scope: Any,
        receive: Callable[[], Awaitable[Any]],
        send: Callable[[Any], Awaitable[None]],
    ) -> None: ...


@dataclass(frozen=True)
class Reach:
    """What a request's headers reached: its sandbox, or why none."""

    sandboxes: Sandboxes
    sandbox: Sandbox | None
    code: Code = Code.NOT_FOUND
    message: str = ""


_REACHED: contextvars.ContextVar[Reach | None] = contextvars.ContextVar("e2b_envd_reached", default=None)


def reach(request: web.Request) -> Reach:
    """The sandbox a request for envd names, if its access token is that sandbox's."""
    sandboxes = request.app[SANDBOXES_KEY]
    sandbox_id = request.headers.get("E2b-Sandbox-Id", "")
    token = request.headers.get("X-Access-Token") or request.headers.get("E2B-Traffic-Access-Token")
    sandbox = sandboxes.reached(sandbox_id, token)
    if sandbox is None:
        # "was not found" is the phrase the SDK reads as a sandbox that is gone.
        return Reach(
            sandboxes,
            None,
            Code.NOT_FOUND,
            f"sandbox {sandbox_id[:64]!r} was not found (or not with this access token)",
        )
    port = request.headers.get("E2b-Sandbox-Port", ENVD_PORT)
    if port != ENVD_PORT:
        return Reach(
            sandboxes, None, Code.UNAVAILABLE, f"the sandbox is running but port {port[:8]!r} is not open"
        )
    return Reach(sandboxes, sandbox)


def reached() -> Reach:
    """The current request's `Reach` (set by `serve`)."""
    found = _REACHED.get()
    if found is None:
        raise ConnectError(Code.INTERNAL, "a call reached a service without the sandbox it names")
    return found


def sandbox_of(ctx: RequestContext[Any, Any] | None = None) -> Sandbox:
    """The live sandbox the current request reached; ConnectError otherwise."""
    found = reached()
    if found.sandbox is None:
        raise ConnectError(found.code, found.message)
    return found.sandbox


class SandboxGate:
    """Refuse a call whose headers reached no sandbox, before its body is read."""

    async def on_start(self, ctx: RequestContext[Any, Any]) -> None:
        sandbox_of(ctx)

    async def on_end(self, token: None, ctx: RequestContext[Any, Any], error: Exception | None, /) -> None:
        return None


def interceptors() -> Iterable[Any]:
    """What every envd service application is built with (auth first, so it runs before the body is read)."""
    return (SandboxGate(),)


class _Exchange:
    """One request's ASGI receive and send, over aiohttp."""

    def __init__(self, request: web.Request, stall_s: float) -> None:
        self.request = request
        self.stall_s = stall_s
        self.response: web.StreamResponse | None = None
        self._start: ASGIMessage | None = None
        self._body_done = False
        self.gone = False

    async def receive(self) -> ASGIMessage:
        if not self._body_done:
            chunk = await self.request.content.readany()
            if chunk:
                return {"type": "http.request", "body": chunk, "more_body": True}
            self._body_done = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await until_gone(self.request)  # asked again only to learn of a disconnect
        return {"type": "http.disconnect"}

    async def send(self, message: ASGIMessage) -> None:
        if self.gone:
            raise ConnectionResetError("the client went away")
        kind = message["type"]
        if kind == "http.response.start":
            self._start = message
            return
        if kind != "http.response.body":
            return  # trailers are gRPC's; Connect puts its end in the body
        body: bytes = message.get("body", b"")
        more: bool = message.get("more_body", False)
        if self.response is None:
            start = self._start or {"status": 500, "headers": []}
            response = web.StreamResponse(status=start["status"])
            for key, value in start["headers"]:
                response.headers.add(key.decode("latin-1"), value.decode("latin-1"))
            if not more:
                response.content_length = len(body)
            self.response = response
            await self._within(response.prepare(self.request))
        if body:
            await self._within(self.response.write(body))
        if not more:
            await self._within(self.response.write_eof())

    async def _within(self, sending: Awaitable[Any]) -> None:
        try:
            await send_within(self.request, sending, self.stall_s)
        except Cancelled:
            self.gone = True
            raise ConnectionResetError("the client stopped reading or went away") from None


async def serve(request: web.Request, app: ASGIApp, path: str) -> web.StreamResponse:
    """Run one Connect call (`path`: "/package.Service/Method") and return its reply."""
    found = reach(request)
    exchange = _Exchange(request, found.sandboxes.service.settings.client_stall_ms / 1000)
    token = _REACHED.set(found)
    try:
        call = asyncio.ensure_future(app(http_scope(request, path), exchange.receive, exchange.send))
        gone = asyncio.ensure_future(until_gone(request))
        try:
            await asyncio.wait([call, gone], return_when=asyncio.FIRST_COMPLETED)
            if not call.done():  # the client went away: a stream (a watch, a process) ends here
                exchange.gone = True
                call.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionError, ConnectError):
                await call
        finally:
            gone.cancel()
            if not call.done():
                call.cancel()
    except Exception:  # connectrpc re-raises what a method raised, once its error reply is sent
        log.exception("an envd call failed", extra={"path": path})
    finally:
        _REACHED.reset(token)
    if exchange.response is None:
        return web.json_response({"code": "internal", "message": "no reply"}, status=500)
    return exchange.response


def mount(app: web.Application, prefix: str, service: str, connect_app: ASGIApp) -> None:
    """Route POST {prefix}/{service}/{method} (`service`: "package.Service") to connect_app."""

    async def handle(request: web.Request) -> web.StreamResponse:
        return await serve(request, connect_app, f"/{service}/{request.match_info['method']}")

    app.router.add_post(f"{prefix}/{service}/{{method}}", handle)
