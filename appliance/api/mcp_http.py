"""`/mcp`: the appliance's MCP tools (appliance.api.mcp_tools) over Streamable HTTP, on the aiohttp
server, behind the same bearer auth as `/exec` and `/v1` (the server's middleware).

How: the SDK's Streamable HTTP transport is ASGI (Starlette). Rather than re-implement it on
aiohttp, which would copy the part of the SDK that changes most between protocol revisions
(session ids, SSE framing, resumption, the protocol-version header), the SDK's own
`StreamableHTTPSessionManager` runs unchanged and a small bridge here turns each aiohttp request
into one ASGI `http` scope: the body (already bounded by the app's client_max_size) is its one
`http.request` message, `http.disconnect` comes when the TCP connection goes, and the ASGI
`send` messages become an aiohttp StreamResponse, written as they come (SSE streams flow).
The manager's task group runs in a task of its own, started and stopped with the app.

Identity: the caller the middleware identified becomes the ASGI `user`, so the SDK binds each
MCP session to it (another token gets 404 for that session id), and tool calls run as that
owner through the server's RunService directly, with its sessions bound to that owner too.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
from collections.abc import Callable
from typing import Any

from aiohttp import web
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.auth.provider import AccessToken
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager

from appliance.api import busy, mcp_tools, tool_calls
from appliance.api.asgi import http_scope
from appliance.api.frames import framed
from appliance.api.transport import PARSER_KEY, TASKS_KEY, until_gone
from appliance.core.errors import ApplianceError, Busy
from appliance.core.service import RunService
from appliance.wire import protocol
from appliance.wire.protocol import ExecuteRequest, ProtocolError

PATH = "/mcp"
OWNER_SCOPE_KEY = "appliance.owner"  # the ASGI scope key that carries the caller to the tools
MANAGER_KEY = web.AppKey("mcp_manager", StreamableHTTPSessionManager)
_TASK_KEY = web.AppKey("mcp_manager_task", asyncio.Task)
_STOP_KEY = web.AppKey("mcp_manager_stop", asyncio.Event)
_SERVICE_KEY = web.AppKey("mcp_service", RunService)
SESSIONS_PER_JAIL_SESSION = 8  # MCP sessions need no jail until they keep state; still bounded
_OPEN_KEY = web.AppKey("mcp_open_sessions", dict)


def mcp_session_caps(max_sessions: int, tenants: int) -> tuple[int, int]:
    """(server-wide, per-tenant) MCP sessions: each tenant gets an equal share of the server's,
    so that the shares together never exceed it and no tenant can lock another out."""
    total = max(1, max_sessions) * SESSIONS_PER_JAIL_SESSION
    return total, max(1, total // max(1, tenants))


class ServiceExecutor:
    """mcp_tools.Executor on the server's own RunService, as one owner: a tool call goes
    straight to the service, no loopback WebSocket and no client in between, with the same
    validation and limits as a request on /exec (protocol.parse_client_frame_object)."""

    def __init__(self, service: RunService, owner: str) -> None:
        self.service = service
        self.owner = owner

    async def execute(self, args: tool_calls.RunArguments, session: str | None) -> tool_calls.Outcome:
        """Run a call's code to the end and gather its frames."""
        rid = protocol.new_request_id()
        outcome = tool_calls.Outcome()
        frame: dict[str, Any] = {"type": "execute", "id": rid, "code": args.code}
        if session is not None:
            frame["session"] = session
        if args.files:
            frame["files"] = [
                {"path": path, "data": base64.b64encode(data).decode()} for path, data in args.files.items()
            ]
        try:
            message = protocol.parse_client_frame_object(
                frame, protocol.Limits.from_settings(self.service.settings)
            )
        except ProtocolError as exc:
            outcome.add(protocol.done_frame(rid, "rejected", message=exc.message))
            return outcome
        if not isinstance(message, ExecuteRequest):  # the frame above is an execute frame
            raise TypeError(f"not an execute request: {message.type}")

        async def gather(out: protocol.Frame) -> None:
            outcome.add(out)

        await self.service.execute(message, self.owner, framed(rid, gather))
        return outcome

    async def models(self) -> list[dict[str, Any]]:
        """The model catalogue, as GET /v1/models gives it."""
        found: list[dict[str, Any]] = (await self.service.models())["models"]
        return found

    async def close_session(self, session: str) -> bool:
        """End one of this owner's sessions; False when it has none of that id."""
        return await self.service.close_session(session, self.owner)

    async def snapshot(self, session: str) -> dict[str, Any]:
        """Keep one of this owner's sessions' state (POST /v1/sessions/{id}/snapshot's answer)."""
        try:
            info = await self.service.snapshot_session(session, self.owner)
        except ApplianceError as exc:
            raise RuntimeError(exc.message) from None
        return info.as_dict()

    async def restore(self, snapshot: str) -> tool_calls.Outcome:
        """Open a session of this owner's restored from a snapshot of its own."""
        rid = protocol.new_request_id()
        outcome = tool_calls.Outcome()
        frame = {"type": "execute", "id": rid, "code": "", "session": "new", "from_snapshot": snapshot}
        try:
            message = protocol.parse_client_frame_object(
                frame, protocol.Limits.from_settings(self.service.settings)
            )
        except ProtocolError as exc:
            outcome.add(protocol.done_frame(rid, "rejected", message=exc.message))
            return outcome
        if not isinstance(message, ExecuteRequest):
            raise TypeError(f"not an execute request: {message.type}")

        async def gather(out: protocol.Frame) -> None:
            outcome.add(out)

        await self.service.execute(message, self.owner, framed(rid, gather))
        return outcome


def _executor_for(service: RunService) -> mcp_tools.ExecutorFor:
    def executor_for(ctx: Any) -> ServiceExecutor:
        owner = ctx.request.scope.get(OWNER_SCOPE_KEY) if ctx.request is not None else None
        if not isinstance(owner, str):  # only the bridge below makes requests: fail closed anyway
            raise PermissionError("an MCP call without an authenticated caller")
        return ServiceExecutor(service, owner)

    return executor_for


def _scope(request: web.Request, owner: str) -> dict[str, Any]:
    # The SDK compares this identity on every request of a session; the token itself is never
    # copied into it.
    user = AuthenticatedUser(AccessToken(token="", client_id=owner, scopes=[]))
    return http_scope(request, user=user, **{OWNER_SCOPE_KEY: owner})


def _jsonrpc_error(
    code: int, message: str, status: int, headers: dict[str, str] | None = None
) -> web.Response:
    # The shape the SDK itself answers a bad body with (a JSON-RPC error without an id).
    return web.json_response(
        {"jsonrpc": "2.0", "id": None, "error": {"code": code, "message": message}},
        status=status,
        headers=headers,
    )


async def handle(request: web.Request, owner: str) -> web.StreamResponse:  # noqa: C901 (the ASGI bridge's receive/send closures share this request's state)
    """One HTTP request of the MCP Streamable HTTP transport, through the SDK's manager."""
    manager = request.app[MANAGER_KEY]
    service: RunService = request.app[_SERVICE_KEY]
    body = await request.read()
    try:  # a body costly to parse is refused before the SDK parses it on the loop
        await request.app[PARSER_KEY].screen(body, owner)
    except ProtocolError as exc:
        return _jsonrpc_error(-32600, exc.message, 400)
    except Busy as exc:
        hint = busy.retry_after(service.retry_after_ms(exc))
        return _jsonrpc_error(-32000, exc.message, busy.STATUS, hint)
    opened = _opened_by(request, manager, owner)
    opening = request.method == "POST" and "mcp-session-id" not in request.headers
    if opening:
        _total, per_tenant = mcp_session_caps(
            service.settings.max_sessions, len(service.tenants) if service.tenants is not None else 1
        )
        if len(opened) >= per_tenant:
            return _jsonrpc_error(
                -32000,
                f"this tenant has {len(opened)} MCP sessions open, its share of the server's "
                f"({per_tenant}); end one (DELETE /mcp) or let one go idle",
                429,
            )
    scope = _scope(request, owner)
    response: web.StreamResponse | None = None
    delivered = False
    # A GET stream ends after SANDBOX_SESSION_IDLE_S (the client may open another): a stream
    # held open would otherwise keep its session from ever going idle.
    stream_s = float(service.settings.session_idle_s) if request.method == "GET" else None

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(stream_s):
                await until_gone(request)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal response
        if message["type"] == "http.response.start":
            response = web.StreamResponse(status=message["status"])
            for name, value in message.get("headers", []):
                key, val = name.decode("latin-1"), value.decode("latin-1")
                if key.lower() == "content-length":
                    continue  # aiohttp frames the body itself
                if opening and key.lower() == "mcp-session-id":
                    opened.add(val)
                response.headers.add(key, val)
            await response.prepare(request)
        elif message["type"] == "http.response.body" and response is not None:
            chunk = message.get("body", b"")
            with contextlib.suppress(ConnectionError, RuntimeError):
                if chunk:
                    await response.write(chunk)
                if not message.get("more_body", False):
                    await response.write_eof()

    await manager.handle_request(scope, receive, send)  # type: ignore[arg-type]
    if response is None:
        return web.json_response({"error": "the MCP transport sent no response"}, status=500)
    return response


def _opened_by(request: web.Request, manager: StreamableHTTPSessionManager, owner: str) -> set[str]:
    """The MCP sessions owner opened that the SDK still has (ended ones are forgotten here)."""
    every: dict[str, set[str]] = request.app[_OPEN_KEY]
    live = manager._server_instances  # the SDK's own table: a session is open while it is there
    mine = {sid for sid in every.get(owner, set()) if sid in live}
    every[owner] = mine
    return mine


def add_routes(
    app: web.Application, service_key: web.AppKey[Any], owner_for: Callable[[web.Request], str]
) -> None:
    """Mount /mcp (GET, POST, DELETE) and run the SDK's session manager with the app."""

    async def start(app: web.Application) -> None:
        service: RunService = app[service_key]
        settings = service.settings
        total, _per_tenant = mcp_session_caps(settings.max_sessions, 1)
        manager = StreamableHTTPSessionManager(
            app=mcp_tools.build_server(_executor_for(service)),
            session_idle_timeout=float(settings.session_idle_s),
            max_request_body_size=settings.max_message_bytes,
            max_sessions=total,
        )
        app[_SERVICE_KEY] = service
        app[_OPEN_KEY] = {}
        started = asyncio.Event()
        stop = asyncio.Event()

        async def run_manager() -> None:
            async with manager.run():
                started.set()
                await stop.wait()

        app[MANAGER_KEY] = manager
        app[_STOP_KEY] = stop
        app[_TASK_KEY] = app[TASKS_KEY].spawn(run_manager(), name="mcp-manager")
        await started.wait()

    async def stop(app: web.Application) -> None:
        app[_STOP_KEY].set()
        with contextlib.suppress(Exception):
            await app[_TASK_KEY]

    async def route(request: web.Request) -> web.StreamResponse:
        return await handle(request, owner_for(request))

    app.on_startup.append(start)
    app.on_cleanup.insert(0, stop)
    for method in ("GET", "POST", "DELETE"):
        app.router.add_route(method, PATH, route)
