"""Servers inside sandboxes: HTTP and WebSocket requests proxied to a port inside the jail.

A request reaches port P of sandbox S in one of two ways:
- by its headers, sent to E2B_SANDBOX_URL (`/e2b/...`) as the SDK sends sandbox traffic:
  `E2b-Sandbox-Id: S`, `E2b-Sandbox-Port: P` (P neither 49999 nor 49983); the `/e2b`
  prefix is taken off the path;
- by its Host, as the SDK's `get_host(P)` names it: `P-S.<domain>` (a wildcard DNS name
  for the appliance, docs/e2b.md); the path is passed as is.
Either way it carries the sandbox's access token (`E2B-Traffic-Access-Token`, the SDK's
`traffic_access_token`, or `X-Access-Token`): a sandbox is reached only with its own token,
so only by its tenant; an unknown sandbox and a wrong token read the same (404).

The connection is made from a socket created inside the jail's network namespace
(appliance.sandbox.jailnet) to 127.0.0.1:P there: the jail's own loopback, nothing of the
host's and no other jail's. Each sandbox holds at most MAX_CONNECTIONS proxied requests at
once; bodies stream both ways, and a client that stops reading is cut after
SANDBOX_CLIENT_STALL_MS. The sandbox's own headers (ids, tokens) are not passed on.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp import web

from appliance.api.e2b.control import SANDBOXES_KEY, reply
from appliance.api.e2b.engine import Sandboxes
from appliance.api.e2b.registry import Sandbox
from appliance.api.transport import send_within
from appliance.core.errors import Cancelled
from appliance.core.tasks import TaskScope, within
from appliance.sandbox import jailnet

PREFIX = "/e2b"
OWN_PORTS = frozenset({"49999", "49983"})  # the code interpreter and envd: served, not proxied
MAX_CONNECTIONS = 64  # proxied requests (WebSockets included) a sandbox holds at once
CONNECT_S = 5.0
CHUNK = 65536
HOST_NAME = re.compile(r"^(\d{1,5})-([0-9a-f]{1,64})\.")
# Headers of the hop or of E2B's routing: never passed on to the sandbox's server.
DROPPED = frozenset(
    h.lower()
    for h in (
        "Host",
        "Connection",
        "Keep-Alive",
        "Proxy-Authenticate",
        "Proxy-Authorization",
        "TE",
        "Trailer",
        "Transfer-Encoding",
        "Upgrade",
        "Content-Length",
        "E2b-Sandbox-Id",
        "E2b-Sandbox-Port",
        "X-Access-Token",
        "E2B-Traffic-Access-Token",
        "Sec-WebSocket-Key",
        "Sec-WebSocket-Version",
        "Sec-WebSocket-Extensions",
        "Sec-WebSocket-Accept",
    )
)


def addressed(request: web.Request) -> tuple[str, int, str] | None:
    """(sandbox id, port, path) when the request is for a port a sandbox's own server holds;
    None when it is not a proxied request at all. A port out of range is still one (refused)."""
    match = HOST_NAME.match(request.headers.get("Host", ""))
    if match is not None:
        return match.group(2), int(match.group(1)), request.rel_url.raw_path_qs
    port = request.headers.get("E2b-Sandbox-Port")
    if port is None or port in OWN_PORTS or not request.path.startswith(PREFIX + "/"):
        return None
    path = request.rel_url.raw_path_qs[len(PREFIX) :]
    return request.headers.get("E2b-Sandbox-Id", ""), int(port) if port.isdigit() else -1, path


@web.middleware
async def proxy_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """Send a request addressed to a sandbox's own server there (`addressed`), before any other
    route or check sees it; everything else goes on as usual."""
    target = addressed(request)
    if target is None:
        response: web.StreamResponse = await handler(request)
        return response
    return await handle(request, *target)


async def handle(request: web.Request, sandbox_id: str, port: int, path: str) -> web.StreamResponse:
    """Proxy one request (or WebSocket) to `port` inside the sandbox's jail."""
    sandboxes = request.app[SANDBOXES_KEY]
    token = request.headers.get("E2B-Traffic-Access-Token") or request.headers.get("X-Access-Token")
    sandbox = sandboxes.reached(sandbox_id, token)
    if sandbox is None:
        return reply(404, f"sandbox {sandbox_id[:64]!r} not found (or not with this access token)")
    if not 1 <= port <= 65535:
        return reply(400, "E2b-Sandbox-Port must name a port, 1 to 65535")
    held = sandboxes.proxied.get(sandbox.id, 0)
    if held >= MAX_CONNECTIONS:
        return reply(429, f"this sandbox holds {MAX_CONNECTIONS} proxied connections already", 1000)
    sandboxes.proxied[sandbox.id] = held + 1
    try:
        return await _proxy(request, sandboxes, sandbox, port, path)
    finally:
        left = sandboxes.proxied.get(sandbox.id, 1) - 1
        if left > 0:
            sandboxes.proxied[sandbox.id] = left
        else:
            sandboxes.proxied.pop(sandbox.id, None)


def _session(sandboxes: Sandboxes, sandbox: Sandbox) -> aiohttp.ClientSession | None:
    """A client session whose one connection is a socket made inside the sandbox's jail."""
    jail = sandboxes.jail_of(sandbox)
    pidfd = jail.process.init_pidfd() if jail is not None else None
    if pidfd is None:
        return None
    try:
        sock = jailnet.socket_in(pidfd)
    except jailnet.Unreachable:
        return None

    def socket_factory(_: Any) -> Any:
        return sock  # made once, used once: the connector makes one connection (force_close)

    connector = aiohttp.TCPConnector(socket_factory=socket_factory, force_close=True, limit=1)
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_S),
        auto_decompress=False,
        skip_auto_headers=("User-Agent", "Accept-Encoding", "Accept"),
    )


def _forwarded(request: web.Request, port: int) -> dict[str, str]:
    headers = {k: v for k, v in request.headers.items() if k.lower() not in DROPPED}
    headers["Host"] = f"localhost:{port}"
    return headers


async def _proxy(
    request: web.Request, sandboxes: Sandboxes, sandbox: Sandbox, port: int, path: str
) -> web.StreamResponse:
    session = _session(sandboxes, sandbox)
    if session is None:
        return reply(502, "the sandbox's network cannot be reached (it has ended)")
    url = f"http://{jailnet.LOOPBACK}:{port}{path if path.startswith('/') else '/' + path}"
    stall_s = sandboxes.service.settings.client_stall_ms / 1000
    async with session:
        if request.headers.get("Upgrade", "").lower() == "websocket":
            return await _websocket(request, session, url, port, stall_s)
        try:
            upstream = await session.request(
                request.method,
                url,
                headers=_forwarded(request, port),
                data=_body(request) if request.body_exists else None,
                allow_redirects=False,
            )
        except (aiohttp.ClientError, OSError):
            return reply(502, f"the sandbox is running but port {port} is not open")
        async with upstream:
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for key, value in upstream.headers.items():
                if key.lower() not in DROPPED:
                    response.headers.add(key, value)
            if upstream.headers.get("Content-Length") is not None:
                response.content_length = int(upstream.headers["Content-Length"])
            try:
                await send_within(request, response.prepare(request), stall_s)
                async for chunk in upstream.content.iter_chunked(CHUNK):
                    await send_within(request, response.write(chunk), stall_s)
                await send_within(request, response.write_eof(), stall_s)
            except (Cancelled, aiohttp.ClientError, OSError):
                with contextlib.suppress(Exception):
                    if request.transport is not None:
                        request.transport.close()
            return response


async def _body(request: web.Request) -> AsyncIterator[bytes]:
    async for chunk in request.content.iter_chunked(CHUNK):
        yield chunk


async def _websocket(
    request: web.Request, session: aiohttp.ClientSession, url: str, port: int, stall_s: float
) -> web.StreamResponse:
    """A WebSocket relayed message by message; either side closing closes the other. A side
    that does not take a message within the stall limit ends the relay."""
    max_message = int(request.app[SANDBOXES_KEY].service.settings.max_message_bytes)
    offered = request.headers.get("Sec-WebSocket-Protocol", "")
    try:
        upstream = await session.ws_connect(
            url,
            headers=_forwarded(request, port),
            protocols=tuple(p.strip() for p in offered.split(",") if p.strip()),
            max_msg_size=max_message,
        )
    except (aiohttp.ClientError, OSError):
        return reply(502, f"the sandbox is running but port {port} is not open")
    client = web.WebSocketResponse(
        protocols=(upstream.protocol,) if upstream.protocol else (), max_msg_size=max_message
    )
    ended = asyncio.Event()

    async def pump(src: Any, dst: Any) -> None:
        try:
            async for msg in src:
                if msg.type == aiohttp.WSMsgType.TEXT:
                    await within(dst.send_str(msg.data), stall_s)
                elif msg.type == aiohttp.WSMsgType.BINARY:
                    await within(dst.send_bytes(msg.data), stall_s)
                else:
                    break
        except (TimeoutError, aiohttp.ClientError, ConnectionError, RuntimeError):
            pass
        finally:
            ended.set()

    async with upstream:
        await client.prepare(request)
        async with TaskScope("e2b-ws-relay") as scope:
            scope.spawn(pump(client, upstream), name="ws-up")
            scope.spawn(pump(upstream, client), name="ws-down")
            await ended.wait()
    with contextlib.suppress(Exception):
        await client.close()
    return client
