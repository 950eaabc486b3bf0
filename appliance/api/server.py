"""HTTP + WebSocket transport on one port. Moves frames; all decisions live elsewhere.

Routes: `GET /exec` (WebSocket), `/healthz`, `/readyz`, `/metrics`; `/v1` (rest.py) and
`/mcp` (mcp_http.py) share the bearer auth below, and so do SandboxFusion's routes (fusion/),
whose token may also come as an HTTP Basic password.
Every route refuses a browser `Origin` that SANDBOX_ALLOWED_ORIGINS does not list (403).
Half-close: when the client's Close frame arrives while runs are in flight, the
server keeps streaming them to their `done` and only then answers the Close (RFC
6455 §5.5.1 lets an endpoint finish sending before it replies with Close). A client that
goes without closing leaves its runs running to their end; `attach` finds them
(appliance.api.runlog).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from pathlib import Path
from typing import Any

from aiohttp import WSMsgType, web

from appliance.api import busy, cors, e2b, fusion, mcp_http, rest
from appliance.api.framebudget import Closing, FrameBudget, FrameMeter, Refusal
from appliance.api.runlog import NO_SUCH_RUN, Bounds, RunLog, RunStore
from appliance.api.transport import (
    PARSER_KEY,
    RUNS_KEY,
    TASKS_KEY,
    FrameParser,
    bearer_token,
    exposed_without_token,
    host_allowed,
    hosts_to_allow,
    is_gone,
    origin_allowed,
    send_within,
    until_gone,
)
from appliance.api.wsmeter import HeapTrimmer, MeteredWebSocket, check_aiohttp
from appliance.core.errors import Busy, Cancelled, RequestRejected
from appliance.core.service import Run, RunService
from appliance.core.tasks import TaskScope
from appliance.runtime.lifecycle import build_service
from appliance.settings import Settings
from appliance.wire import protocol
from appliance.wire.protocol import (
    AttachMessage,
    CloseSessionMessage,
    EgressDecisionMessage,
    ExecuteRequest,
    InterruptMessage,
    ProtocolError,
    StdinMessage,
)

log = logging.getLogger("appliance.api.server")

SERVICE_KEY = web.AppKey("service", RunService)
FRAME_BUDGET_KEY = web.AppKey("frame_budget", FrameBudget)
TRIMMER_KEY = web.AppKey("heap_trimmer", HeapTrimmer)
# Host names allowed besides literals and localhost; None: any (`transport.hosts_to_allow`).
HOSTS_KEY: web.AppKey[frozenset[str] | None] = web.AppKey("allowed_hosts")
# How long a run the shutdown interrupts has to end and send its `done`: the cell's interrupt
# grace (sandbox.cell.INTERRUPT_GRACE_S), its kill, and a client slower than usual to take it.
STOPPING_S = 3.0
OWNER = "appliance.owner"  # request key: who the caller is, set by the auth middleware


@web.middleware
async def auth_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """Before any route: a browser origin not allowed gets 403, a missing or wrong token 401
    (/metrics: see `RunService.may_read_metrics`)."""
    service = request.app[SERVICE_KEY]
    if not host_allowed(request.headers.get("Host"), request.app[HOSTS_KEY]):
        # DNS rebinding: a page on evil.example, resolved to this server, reads what needs no token.
        return web.json_response(
            {"error": "this request's Host is not this server's (SANDBOX_ALLOWED_HOSTS)"}, status=421
        )
    origins = request.headers.getall("Origin", [])
    if not origin_allowed(
        origins, service.settings.allowed_origins, request.headers.get("Host"), service.requires_token
    ):
        # A page on another origin may open a WebSocket or send a "simple" POST without any
        # CORS preflight; only the operator's own list of origins (and the server's own
        # pages, like /docs) may reach the API.
        return web.json_response(
            {"error": "this request's Origin is not in SANDBOX_ALLOWED_ORIGINS"}, status=403
        )
    if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
        # A CORS preflight carries no token; what it may lead to is decided above (its Origin).
        return cors.preflight(request, service.settings.allowed_origins)
    if request.path == "/metrics":
        if not service.may_read_metrics(bearer_token(request)):
            return _unauthorized()
    elif request.path == "/exec" or request.path.startswith(("/v1", "/mcp")):
        owner = service.identify(bearer_token(request))
        if owner is None:
            return _unauthorized()
        request[OWNER] = owner
    elif request.path in fusion.PATHS:
        # SandboxFusion's clients send no headers of their own: the token may come as the
        # password of HTTP Basic auth, from the client's URL.
        owner = service.identify(fusion.token(request))
        if owner is None:
            return _unauthorized()
        request[OWNER] = owner
    response: web.StreamResponse = await handler(request)
    return response


def _unauthorized() -> web.Response:
    return web.json_response(
        {"error": "missing or wrong bearer token"}, status=401, headers={"WWW-Authenticate": "Bearer"}
    )


class Connection:
    """One WebSocket client: what it follows and a serialised sender. Its runs are tasks of the
    server's run store (appliance.api.runlog): they outlive the connection, which follows them
    live (`RunLog.follow_live`) until it goes. Its attaches, the answers to refused frames and
    the watch for its client's going are tasks of its scope, which `exec_socket` holds open
    for as long as the socket lives."""

    def __init__(
        self,
        ws: web.WebSocketResponse,
        request: web.Request,
        service: RunService,
        scope: TaskScope,
    ) -> None:
        self.scope = scope
        self.ws = ws
        self.request = request
        self.service = service
        self.parser = request.app[PARSER_KEY]
        self.store = request.app[RUNS_KEY]
        self.owner: str = request[OWNER]
        # id -> what this connection receives frames under that id from: the run it started
        # (its task ends once the done went out) or an attach (its reader task).
        self.following: dict[str, asyncio.Task[None]] = {}
        self.runs: dict[str, Run] = {}  # id -> a running run this connection may feed stdin or interrupt
        self.started: dict[str, RunLog] = {}  # id -> a run this connection started, followed live
        self._send_lock = asyncio.Lock()
        self._stall_s = service.settings.client_stall_ms / 1000
        self.gone = False

    @property
    def tasks(self) -> list[asyncio.Task[None]]:
        return list(self.following.values())

    async def send(self, frame: protocol.Frame) -> None:
        await self.send_text(protocol.encode(frame))

    async def send_text(self, text: str) -> None:
        if self.gone:
            raise Cancelled("the client disconnected")
        async with self._send_lock:
            try:
                # At most 4 bytes a character in UTF-8, and 14 of frame header.
                await send_within(self.request, self.ws.send_str(text), self._stall_s, 4 * len(text) + 14)
            except Cancelled:
                self.gone = True
                raise

    async def handle_frame(self, data: str | bytes) -> None:  # noqa: C901, PLR0912 (one dispatch branch per client frame type)
        service = self.service
        try:
            message = await self.parser.parse(data, self.owner)
        except ProtocolError as exc:
            await self.reject(exc.request_id or protocol.new_request_id(), exc.message)
            return
        except Busy as exc:
            await self._send_quietly(busy.frame(service, exc))
            return
        if isinstance(message, ExecuteRequest):
            if message.id in self.following:
                await self.reject(message.id, f"id {message.id!r} is already in use by a running request")
                return
            if not self.scope.running or not self.store.scope.running:  # shutdown has begun
                await self.reject(message.id, "the server is shutting down")
                return
            log = self.store.start(service, message, self.owner, self.send_text)
            if log.handle is None or log.task is None:
                raise RuntimeError("RunStore.start returned a log without its run")
            self._follow(message.id, log.task, log.handle)
            self.started[message.id] = log
        elif isinstance(message, AttachMessage):
            await self.attach(message)
        elif isinstance(message, StdinMessage):
            found = self.runs.get(message.id)
            if found is None:
                await self.reject(message.id, f"no running request with id {message.id!r} to take stdin")
                return
            try:
                found.stdin(message.data, message.eof)
            except RequestRejected as exc:
                await self.reject(message.id, exc.message)
        elif isinstance(message, InterruptMessage):
            found = self.runs.get(message.id)
            if found is None:
                await self.reject(message.id, f"no running request with id {message.id!r} to interrupt")
                return
            found.interrupt()
        elif isinstance(message, EgressDecisionMessage):
            await self.decide_egress(message)
        elif isinstance(message, CloseSessionMessage):
            closed = await service.close_session(message.session, self.owner)
            if closed:
                await self._send_quietly(
                    protocol.done_frame(
                        message.id, "ok", message=f"session {message.session} closed", session=message.session
                    )
                )
            else:
                await self.reject(message.id, f"no such session {message.session!r}")

    async def decide_egress(self, message: EgressDecisionMessage) -> None:
        """The client's answer to an `egress_request` of a run this connection follows (it
        started it, or attached to it). A flow none of them waits on (unknown, another run's,
        already decided or timed out) is refused with a `done` `rejected` carrying the
        decision's own id, and changes nothing."""
        rid = message.id if message.id is not None and message.id not in self.following else None
        for run in set(self.runs.values()):
            if run.knows_flow(message.flow):
                try:
                    run.decide_egress(message.flow, message.allow, message.scope)
                except RequestRejected as exc:
                    self.service.charge_rejected(self.owner)
                    await self.reject(rid or protocol.new_request_id(), exc.message)
                return
        self.service.charge_rejected(self.owner)  # like any refused frame: a rate token
        await self.reject(
            rid or protocol.new_request_id(),
            f"no egress request {message.flow!r} of a run this connection follows waits for a decision",
        )

    async def attach(self, message: AttachMessage) -> None:
        """Follow a run of this tenant's again: its frames after `after`, then the live ones,
        to its done. Unknown, expired and another tenant's runs get the same answer."""
        log = self.store.find(message.run, self.owner)
        if log is None:
            self.service.charge_rejected(self.owner)  # like any refused frame: a rate token
            await self.reject(message.id or protocol.new_request_id(), NO_SUCH_RUN)
            return
        rid = message.id or log.rid
        if rid in self.following:
            await self.reject(rid, f"id {rid!r} is already in use by a running request")
            return
        if not self.scope.running:
            await self.reject(rid, "the server is shutting down")
            return
        reader = self.scope.spawn(self._replay(log, message.after, rid), name="attach")
        self._follow(rid, reader, log.handle if not log.done else None)

    async def _replay(self, log: RunLog, after: int, rid: str) -> None:
        with contextlib.suppress(Cancelled):
            async with contextlib.aclosing(log.follow(after, rid)) as frames:
                async for text in frames:
                    await self.send_text(text)

    def _follow(self, rid: str, task: asyncio.Task[None], run: Run | None) -> None:
        self.following[rid] = task
        if run is not None:
            self.runs[rid] = run
            run.watch((self, rid))  # this connection may answer the run's egress asks

        def forget(_task: asyncio.Task[None]) -> None:
            if self.following.get(rid) is task:
                del self.following[rid]
                gone = self.runs.pop(rid, None)
                if gone is not None:
                    gone.unwatch((self, rid))
                self.started.pop(rid, None)

        task.add_done_callback(forget)

    def refuse(self, refusal: Refusal) -> None:
        """Answer a frame the meter skipped at its header (framebudget.py), as if it was read."""
        if refusal.status == "rejected":  # like any refused frame, it costs its tenant a rate token
            self.service.charge_rejected(self.owner)
        if not self.scope.running:  # the connection is going: there is no one to answer
            return
        hint = self.service.retry_after_ms() if refusal.status == "busy" else None
        frame = protocol.done_frame(
            protocol.new_request_id(), refusal.status, message=refusal.message, retry_after_ms=hint
        )
        self.scope.spawn(self._send_quietly(frame), name="refusal")

    async def reject(self, rid: str, message: str) -> None:
        await self._send_quietly(protocol.done_frame(rid, "rejected", message=message))

    async def _send_quietly(self, frame: protocol.Frame) -> None:
        with contextlib.suppress(Cancelled):
            await self.send(frame)

    async def finish(self) -> None:
        """Client half-closed: let what it follows stream to its done, unless the connection
        itself goes away meanwhile."""
        self._unwatch_all()  # a client that sent its Close answers nothing more
        gone = self.scope.spawn(until_gone(self.request), name="client-watch")
        try:
            while self.tasks:
                await asyncio.wait([*self.tasks, gone], return_when=asyncio.FIRST_COMPLETED)
                if gone.done():
                    await self.abort()
                    return
        finally:
            gone.cancel()

    async def abort(self) -> None:
        """Client vanished: its runs go on without it (an attach finds them); its attaches end."""
        self.gone = True
        self._unwatch_all()  # its runs' pending egress asks are refused now, not at their timeout
        for log in self.started.values():
            log.detach(self.send_text)
        readers = [task for rid, task in self.following.items() if rid not in self.started]
        await self.scope.cancel(*readers)

    def _unwatch_all(self) -> None:
        for rid, run in self.runs.items():
            run.unwatch((self, rid))


CONNECTIONS_KEY: web.AppKey[set[Connection]] = web.AppKey("connections")


class FrameEvents:
    """What one connection's frame meter reports: refusals go to its Connection (once there is
    one), closings and releases to the metrics and the heap trimmer."""

    def __init__(self, service: RunService, trimmer: HeapTrimmer) -> None:
        self._service = service
        self._trimmer = trimmer
        self.conn: Connection | None = None
        self.early: list[Refusal] = []  # refused before the Connection existed

    def refused(self, refusal: Refusal) -> None:
        reason = "too_big" if refusal.status == "rejected" else "budget"
        self._service.metrics.frames_refused.labels(reason=reason).inc()
        if self.conn is None:
            self.early.append(refusal)
        else:
            self.conn.refuse(refusal)

    def closed(self, closing: Closing) -> None:
        reason = {1009: "too_big", 1008: "deadline"}.get(closing.code, "budget")
        self._service.metrics.frames_refused.labels(reason=reason).inc()

    def gone(self, freed: int) -> None:
        self._trimmer.freed(freed)


async def _receive(conn: Connection, ws: MeteredWebSocket, meter: FrameMeter) -> bool:
    """Hand the client's frames to its connection until it closes; True if it half-closed."""
    while True:
        msg = await ws.receive()
        if msg.type in (WSMsgType.TEXT, WSMsgType.BINARY):
            try:
                await conn.handle_frame(msg.data)
            finally:
                meter.handled()
        elif msg.type == WSMsgType.CLOSE:
            return True
        elif msg.type == WSMsgType.ERROR and isinstance(ws.exception(), Exception):
            exc = ws.exception()
            if "too big" in str(exc).lower() or "size" in str(exc).lower():
                log.info("client frame too big; closing", extra={"error": str(exc)})
            return False
        else:
            return False


async def exec_socket(request: web.Request) -> web.StreamResponse:
    service = request.app[SERVICE_KEY]
    settings = service.settings
    # Every frame is judged at its header (framebudget.py): a message over the limit is never
    # buffered (a single frame is skipped and answered `rejected`; far over, or fragmented,
    # the connection closes with 1009), kept ones count against the frame budgets, and a
    # message must be finished within SANDBOX_FRAME_DEADLINE_MS.
    # No permessage-deflate: a compressor made for every message costs a small frame far more
    # server CPU than the rest of its handling, and the appliance sits next to the API it
    # serves, where bandwidth is cheap and latency is not.
    events = FrameEvents(service, request.app[TRIMMER_KEY])
    meter = FrameMeter(
        request.app[FRAME_BUDGET_KEY],
        request[OWNER],
        settings.max_message_bytes,
        asyncio.get_running_loop().time,
    )
    ws = MeteredWebSocket(
        meter,
        settings.frame_deadline_ms / 1000,
        events,
        autoclose=False,
        compress=False,
        max_msg_size=settings.max_message_bytes + 1,  # aiohttp's own check: the meter's, as a backstop
    )
    try:
        await ws.prepare(request)
    except BaseException:
        if ws.metered is not None:
            ws.metered.release()
        raise
    conns = request.app[CONNECTIONS_KEY]
    conn: Connection | None = None
    try:
        async with TaskScope("connection") as scope:  # nothing this connection started outlives it
            conn = events.conn = Connection(ws, request, service, scope)
            for refusal in events.early:
                conn.refuse(refusal)
            conns.add(conn)
            if await _receive(conn, ws, meter) and not is_gone(request) and scope.running:
                await conn.finish()  # the client half-closed: its runs stream to their end
            else:
                await conn.abort()
    finally:
        if ws.metered is not None:
            ws.metered.release()
        conns.discard(conn)
        if not ws.closed:
            with contextlib.suppress(Exception):
                await ws.close()
    return ws


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    ready, body = request.app[SERVICE_KEY].readiness()
    return web.json_response(body, status=200 if ready else 503)


async def metrics(request: web.Request) -> web.Response:
    request.app[RUNS_KEY].report()
    service = request.app[SERVICE_KEY]
    service.metrics.frame_buffer.set(request.app[FRAME_BUDGET_KEY].held)
    text = service.metrics_text()
    return web.Response(body=text, content_type="text/plain", charset="utf-8")


def run_log_bounds(service: RunService) -> Bounds:
    """What the run store may hold: SANDBOX_REATTACH_* for each tenant (one without a tokens file)."""
    s = service.settings
    return Bounds(
        keep_s=s.reattach_s,
        run_bytes=s.max_output_bytes,
        tenant_runs=s.reattach_runs,
        tenant_bytes=s.reattach_bytes,
        tenants=max(1, len(service.tenants)) if service.tenants is not None else 1,
    )


def make_app(service: RunService) -> web.Application:
    # E2B's port proxy first: a request for a server inside a sandbox is that sandbox's to
    # authenticate (its access token), whatever its Host (appliance.api.e2b.proxy).
    app = web.Application(
        middlewares=[e2b.proxy_middleware, auth_middleware],
        client_max_size=service.settings.max_message_bytes,
    )
    app[SERVICE_KEY] = service
    app[HOSTS_KEY] = frozenset(service.settings.allowed_hosts) or None  # serve() judges the bound addresses
    parser = app[PARSER_KEY] = FrameParser(service)
    check_aiohttp()  # frames are metered in front of aiohttp's reader, or not served at all
    total, per_tenant = service.settings.frame_budget()
    # Its gauge is set at each scrape (`metrics`), not at every frame a client sends.
    app[FRAME_BUDGET_KEY] = FrameBudget(total, per_tenant)
    trimmer = app[TRIMMER_KEY] = HeapTrimmer()
    app[CONNECTIONS_KEY] = set()
    tasks = app[TASKS_KEY] = TaskScope("server")
    store = app[RUNS_KEY] = RunStore(run_log_bounds(service), service.metrics)

    async def start_parser(app: web.Application) -> None:
        await tasks.open()
        await store.open()
        # In the background: the child's imports must not delay the server's start.
        tasks.spawn(parser.worker.start(), name="parser-start")

    async def stop_parser(app: web.Application) -> None:
        await store.close()  # closed by the shutdown already, unless the app was run without `serve`
        await tasks.wait()  # a start still spawning the child ends first: then close stops it
        await parser.worker.close()
        await trimmer.close()
        await tasks.close()

    async def cors_headers(request: web.Request, response: web.StreamResponse) -> None:
        cors.add_headers(request, response, service.settings.allowed_origins)

    app.on_startup.append(start_parser)
    app.on_cleanup.append(stop_parser)
    app.on_response_prepare.append(cors_headers)
    app.router.add_get("/exec", exec_socket)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    rest.add_routes(app, SERVICE_KEY, lambda request: str(request[OWNER]))
    mcp_http.add_routes(app, SERVICE_KEY, lambda request: str(request[OWNER]))
    e2b.add_routes(app, SERVICE_KEY)  # authenticates its own callers: E2B's headers, not bearer
    fusion.add_routes(app, SERVICE_KEY, lambda request: str(request[OWNER]))
    return app


async def serve(settings: Settings, host: str, port: int, ready_file: str | None = None) -> None:
    """Run until SIGTERM/SIGINT, then shut down in order: stop accepting, let runs finish
    within the grace period, cancel the rest, drain the pool."""
    service = build_service(settings)
    service.check_host()
    app = make_app(service)
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    await site.start()
    bound = _bound_port(runner) or port
    addresses = [str(addr[0]) for addr in runner.addresses if isinstance(addr, tuple) and addr]
    app[HOSTS_KEY] = hosts_to_allow(settings.allowed_hosts, addresses)
    _warn_if_exposed(service, runner)
    try:
        await service.start(canary_port=bound)
    except BaseException:  # a refusal found while starting (e.g. MPS required, not proven)
        await service.close()
        await runner.cleanup()
        raise
    log.info("listening", extra={"host": host, "port": bound})
    if ready_file:
        await asyncio.to_thread(Path(ready_file).write_text, str(bound))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down", extra={"grace_s": settings.shutdown_grace_s})
    await site.stop()  # 1. stop accepting
    await _close_connections(app[CONNECTIONS_KEY], app[RUNS_KEY], settings)  # 2. and 3.
    await service.close()  # 4. the sessions, then the lifecycle's scope: pools, watchdogs, canary
    await runner.cleanup()  # 5. the server's own scope
    log.info("stopped")


async def _close_connections(connections: set[Connection], store: RunStore, settings: Settings) -> None:
    """Shutdown's steps 2 and 3, against one deadline, SANDBOX_SHUTDOWN_GRACE_MS + STOPPING_S
    from now: runs (whoever follows them, if anyone) finish within the grace period; those
    still going are interrupted and have STOPPING_S to send their `done` (cancelled); then
    each connection's scope is closed (its attaches) and its socket closed with 1001, and
    the runs' scope is closed (what is left is cancelled and awaited)."""
    loop = asyncio.get_running_loop()
    interrupt_at = loop.time() + settings.shutdown_grace_s
    deadline = interrupt_at + STOPPING_S
    conns = list(connections)
    runs = [log.task for log in store.running if log.task is not None]
    if runs:
        await asyncio.wait(runs, timeout=max(0.0, interrupt_at - loop.time()))
    for log in store.running:
        if log.handle is not None:
            log.handle.interrupt("the server is shutting down")
    runs = [log.task for log in store.running if log.task is not None]
    if runs:
        await asyncio.wait(runs, timeout=max(0.0, deadline - loop.time()))
    for conn in conns:
        conn.gone = True
        await conn.scope.close()
        with contextlib.suppress(Exception):
            await conn.ws.close(code=1001, message=b"server shutting down")
    await store.close()


def _warn_if_exposed(service: RunService, runner: web.AppRunner) -> None:
    """No token and a non-loopback address: anyone who can reach it runs code. Allowed (a
    private network may be the operator's choice), but said loudly, in the log and /readyz."""
    s = service.settings
    if s.auth_token is not None or s.auth_tokens_file is not None:
        return
    hosts = [str(addr[0]) for addr in runner.addresses if isinstance(addr, tuple) and addr]
    exposed = exposed_without_token(hosts)
    if exposed:
        warning = (
            f"no SANDBOX_AUTH_TOKEN or SANDBOX_AUTH_TOKENS_FILE, yet listening on "
            f"{', '.join(sorted(set(exposed)))}: anyone who can reach this port can run code"
        )
        service.warnings.append(warning)
        log.warning(
            f"UNAUTHENTICATED AND EXPOSED: {warning}",
            extra={"addresses": exposed, "fix": "set SANDBOX_AUTH_TOKEN, or --host 127.0.0.1"},
        )


def _bound_port(runner: web.AppRunner) -> int | None:
    for addr in runner.addresses:
        if isinstance(addr, tuple) and len(addr) >= 2:
            return int(addr[1])
    return None
