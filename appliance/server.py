"""HTTP + WebSocket transport on one port. Moves frames; all decisions live elsewhere.

Routes: `GET /exec` (WebSocket), `/healthz`, `/readyz`, `/metrics`.
Half-close: when the client's Close frame arrives while runs are in flight, the
server keeps streaming them to their `done` and only then answers the Close (RFC
6455 §5.5.1 lets an endpoint finish sending before it replies with Close).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import signal
from typing import Any

from aiohttp import WSMsgType, web

from appliance import protocol, rest
from appliance.errors import Cancelled
from appliance.protocol import (
    CloseSessionMessage,
    ExecuteRequest,
    InterruptMessage,
    ProtocolError,
    StdinMessage,
)
from appliance.runner import ActiveRun
from appliance.service import Appliance
from appliance.sessions import owner_of
from appliance.settings import Settings
from appliance.tenants import Tenants

log = logging.getLogger("appliance.server")

APPLIANCE_KEY = web.AppKey("appliance", Appliance)


def bearer_token(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def authorized(settings: Settings, request: web.Request, tenants: Tenants | None = None) -> bool:
    """Constant-time check of the bearer token; everything passes when no token is set.

    With a tokens file the token must belong to a tenant (compared against every one).
    """
    if tenants is not None:
        return tenants.identify(bearer_token(request)) is not None
    if settings.auth_token is None:
        return True
    token = bearer_token(request) or ""
    return hmac.compare_digest(token.encode(), settings.auth_token.encode())


@web.middleware
async def auth_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    appliance = request.app[APPLIANCE_KEY]
    protected = request.path == "/exec" or request.path.startswith("/v1")
    if protected and not authorized(appliance.settings, request, appliance.tenants):
        return web.json_response({"error": "missing or wrong bearer token"}, status=401,
                                 headers={"WWW-Authenticate": "Bearer"})
    response: web.StreamResponse = await handler(request)
    return response


class Connection:
    """One WebSocket client: its in-flight requests and a serialised sender."""

    def __init__(self, ws: web.WebSocketResponse, appliance: Appliance, owner: str) -> None:
        self.ws = ws
        self.appliance = appliance
        self.owner = owner
        self.runs: dict[str, ActiveRun] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self._send_lock = asyncio.Lock()
        self.gone = False

    async def send(self, frame: protocol.Frame) -> None:
        if self.gone:
            raise Cancelled("the client disconnected")
        text = protocol.encode(frame)
        async with self._send_lock:
            try:
                await self.ws.send_str(text)
            except (ConnectionError, RuntimeError) as exc:
                self.gone = True
                raise Cancelled("the client disconnected") from exc

    async def handle_frame(self, data: str | bytes) -> None:
        appliance = self.appliance
        limits = protocol.Limits(
            max_message_bytes=appliance.settings.max_message_bytes,
            max_upload_bytes=appliance.settings.max_upload_bytes,
            gpu_enabled=appliance.settings.gpu,
        )
        try:
            message = protocol.parse_client_frame(data, limits)
        except ProtocolError as exc:
            await self.reject(exc.request_id or protocol.new_request_id(), exc.message)
            return
        if isinstance(message, ExecuteRequest):
            if message.id in self.runs:
                await self.reject(message.id, f"id {message.id!r} is already in use by a running request")
                return
            active = ActiveRun(message.id)
            self.runs[message.id] = active
            task = asyncio.create_task(self._execute(message, active))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        elif isinstance(message, StdinMessage):
            run = self.runs.get(message.id)
            if run is None:
                await self.reject(message.id, f"no running request with id {message.id!r} to take stdin")
                return
            await run.stdin(message.data, message.eof)
        elif isinstance(message, InterruptMessage):
            run = self.runs.get(message.id)
            if run is None:
                await self.reject(message.id, f"no running request with id {message.id!r} to interrupt")
                return
            run.interrupt()
        elif isinstance(message, CloseSessionMessage):
            closed = await appliance.close_session(message.session, self.owner)
            if closed:
                await self._send_quietly(protocol.done_frame(
                    message.id, "ok", message=f"session {message.session} closed", session=message.session))
            else:
                await self.reject(message.id, f"no such session {message.session!r}")

    async def _execute(self, req: ExecuteRequest, active: ActiveRun) -> None:
        try:
            await self.appliance.execute(req, self.owner, self.send, active)
        finally:
            self.runs.pop(req.id, None)

    async def reject(self, rid: str, message: str) -> None:
        await self._send_quietly(protocol.done_frame(rid, "rejected", message=message))

    async def _send_quietly(self, frame: protocol.Frame) -> None:
        with contextlib.suppress(Cancelled):
            await self.send(frame)

    async def finish(self) -> None:
        """Client half-closed: let in-flight requests stream to their end."""
        while self.tasks:
            await asyncio.gather(*list(self.tasks), return_exceptions=True)

    async def abort(self) -> None:
        """Client vanished: cancel in-flight requests (their jails are killed)."""
        self.gone = True
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*list(self.tasks), return_exceptions=True)


async def exec_socket(request: web.Request) -> web.StreamResponse:
    appliance = request.app[APPLIANCE_KEY]
    settings = appliance.settings
    # Frames a little over the limit still get a `rejected` answer; far over, the
    # transport closes with 1009 (message too big) rather than buffer them.
    ws = web.WebSocketResponse(autoclose=False, max_msg_size=settings.max_message_bytes * 2 + 4096)
    await ws.prepare(request)
    conn = Connection(ws, appliance, owner_of(bearer_token(request)))
    request.app["connections"].add(conn)
    half_closed = False
    try:
        while True:
            msg = await ws.receive()
            if msg.type in (WSMsgType.TEXT, WSMsgType.BINARY):
                await conn.handle_frame(msg.data)
            elif msg.type == WSMsgType.CLOSE:
                half_closed = True
                break
            elif msg.type == WSMsgType.ERROR and isinstance(ws.exception(), Exception):
                exc = ws.exception()
                if "too big" in str(exc).lower() or "size" in str(exc).lower():
                    log.info("client frame too big; closing", extra={"error": str(exc)})
                break
            else:
                break
        if half_closed:
            await conn.finish()
        else:
            await conn.abort()
    except asyncio.CancelledError:
        await conn.abort()
        raise
    finally:
        request.app["connections"].discard(conn)
        if not ws.closed:
            with contextlib.suppress(Exception):
                await ws.close()
    return ws


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    appliance = request.app[APPLIANCE_KEY]
    problems = appliance.ready_problems
    pool = appliance.pool
    body: dict[str, Any] = {
        "status": "ready" if not problems else "not ready",
        "problems": problems,
        "pool_ready": len(pool.ready) if pool else 0,
        "memory_cap": "RLIMIT_AS",
        "firejail": appliance.host.firejail_version if appliance.host else None,
    }
    if appliance.gpu is not None:  # GPU mode: each enforcement layer, available or not
        body["gpu"] = appliance.gpu.layers()
        gpu_problems = appliance.gpu.problems()
        if gpu_problems:
            problems = [*problems, *gpu_problems]
            body["status"], body["problems"] = "not ready", problems
    return web.json_response(body, status=200 if not problems else 503)


async def metrics(request: web.Request) -> web.Response:
    appliance = request.app[APPLIANCE_KEY]
    appliance._update_pool_gauges()
    return web.Response(body=appliance.metrics.render(), content_type="text/plain", charset="utf-8")


def make_app(appliance: Appliance) -> web.Application:
    app = web.Application(middlewares=[auth_middleware], client_max_size=appliance.settings.max_message_bytes)
    app[APPLIANCE_KEY] = appliance
    app["connections"] = set()
    app.router.add_get("/exec", exec_socket)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    rest.add_routes(app, APPLIANCE_KEY, lambda request: owner_of(bearer_token(request)))
    return app


async def serve(settings: Settings, host: str, port: int, ready_file: str | None = None) -> None:
    """Run until SIGTERM/SIGINT, then shut down in order: stop accepting, let runs finish
    within the grace period, cancel the rest, drain the pool."""
    appliance = Appliance(settings)
    appliance.check_host()
    app = make_app(appliance)
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    await site.start()
    bound = _bound_port(runner) or port
    try:
        await appliance.start(canary_port=bound)
    except BaseException:  # a refusal found while starting (e.g. MPS required, not proven)
        await appliance.close()
        await runner.cleanup()
        raise
    log.info("listening", extra={"host": host, "port": bound})
    if ready_file:
        with open(ready_file, "w") as fh:
            fh.write(str(bound))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down", extra={"grace_s": settings.shutdown_grace_s})
    await site.stop()  # 1. stop accepting
    connections: set[Connection] = app["connections"]
    pending = [t for c in connections for t in c.tasks]
    if pending:  # 2. let running work finish within the grace period
        await asyncio.wait(pending, timeout=settings.shutdown_grace_s)
    for conn in list(connections):  # 3. cancel the rest: each gets `done` cancelled, then goes
        for run in list(conn.runs.values()):
            run.interrupt("the server is shutting down")
    pending = [t for c in connections for t in c.tasks]
    if pending:
        await asyncio.wait(pending, timeout=3.0)
    for conn in list(connections):
        await conn.abort()
        with contextlib.suppress(Exception):
            await conn.ws.close(code=1001, message=b"server shutting down")
    await appliance.close()  # 4. drain the pool and sessions
    await runner.cleanup()
    log.info("stopped")


def _bound_port(runner: web.AppRunner) -> int | None:
    for addr in runner.addresses:
        if isinstance(addr, tuple) and len(addr) >= 2:
            return int(addr[1])
    return None
