"""Sandbox traffic: E2B's code interpreter (port 49999) and envd's health check (port 49983).

The SDK sends it all to E2B_SANDBOX_URL, naming the sandbox in `E2b-Sandbox-Id` and the port
in `E2b-Sandbox-Port`, with the sandbox's access token in `X-Access-Token` or
`E2B-Traffic-Access-Token`. A sandbox is reached only with its own token: an unknown id and a
wrong token get the same 404, so nothing tells a stranger which ids exist.

`POST /execute` streams NDJSON lines as the SDK parses them. The reply is prepared only once
the run has started, so a cell refused before it runs (busy, over a quota) gets an HTTP error
the SDK raises. A client that stops reading (or goes away) costs the cell: it is interrupted
once a write waits SANDBOX_CLIENT_STALL_MS; its context lives on if the interpreter recovers.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from aiohttp import web

from appliance.api.e2b import engine, shapes
from appliance.api.e2b.control import SANDBOXES_KEY, read_object, reply
from appliance.api.e2b.engine import Refused, Sandboxes, as_refused
from appliance.api.e2b.registry import Context, Sandbox
from appliance.api.e2b.shapes import BadRequest
from appliance.api.transport import send_within, until_gone
from appliance.core.errors import ApplianceError, Cancelled
from appliance.core.events import CellError, Display, Done, Event, Output, Result, Started
from appliance.core.tasks import TaskScope, wait_ended

INTERPRETER_PORT = "49999"
ENVD_PORT = "49983"
NDJSON = "application/x-ndjson"
# How long a cell interrupted for a vanished client may take to end before it is cancelled
# (which ends its context's session).
INTERRUPT_GRACE_S = 5.0


def _reached(request: web.Request, port: str) -> Sandbox | web.Response:
    sandbox_id = request.headers.get("E2b-Sandbox-Id", "")
    token = request.headers.get("X-Access-Token") or request.headers.get("E2B-Traffic-Access-Token")
    sandbox = request.app[SANDBOXES_KEY].reached(sandbox_id, token)
    if sandbox is None:
        # envd's health check reads 502 as "not running" (the SDK's is_running); the rest 404.
        return reply(
            502 if port == ENVD_PORT else 404,
            f"sandbox {sandbox_id[:64]!r} not found (or not with this access token)",
        )
    asked = request.headers.get("E2b-Sandbox-Port", "")
    if asked != port:
        return reply(
            502,
            f"port {asked[:8]!r} of a sandbox is not served here: only {INTERPRETER_PORT} and /health on {ENVD_PORT}",
        )
    return sandbox


def handler(port: str) -> Any:
    def wrap(fn: Any) -> Any:
        async def wrapped(request: web.Request) -> web.StreamResponse:
            found = _reached(request, port)
            if isinstance(found, web.Response):
                return found
            try:
                response: web.StreamResponse = await fn(request, request.app[SANDBOXES_KEY], found)
            except BadRequest as exc:
                return reply(400, str(exc))
            except Refused as exc:
                return reply(exc.status, exc.message, exc.retry_after_ms)
            except ApplianceError as exc:
                refused = as_refused(exc)
                return reply(refused.status, refused.message, refused.retry_after_ms)
            return response

        return wrapped

    return wrap


def _context(sandbox: Sandbox, context_id: object) -> Context:
    ctx = sandbox.contexts.get(context_id if isinstance(context_id, str) else sandbox.default)
    if ctx is None:
        raise Refused(404, f"context {str(context_id)[:64]!r} not found")
    return ctx


class Stream:
    """One /execute reply: the run's events in, E2B's NDJSON lines out."""

    def __init__(self, request: web.Request, ctx: Context, stall_s: float) -> None:
        self.request = request
        self.ctx = ctx
        self.stall_s = stall_s
        self.response: web.StreamResponse | None = None
        self.refused: Done | None = None  # the `Done` of a cell refused before it ran
        self.gone = False
        self.run: Any = None

    async def _write(self, line: dict[str, Any]) -> None:
        if self.gone or self.response is None:
            return
        try:
            await send_within(self.request, self.response.write(shapes.line_bytes(line)), self.stall_s)
        except Cancelled:
            self._give_up()

    def _give_up(self) -> None:
        # Stop the cell, not the interpreter: the context keeps its state for the next call.
        self.gone = True
        if self.run is not None:
            self.run.interrupt("the client stopped reading the reply")

    async def emit(self, event: Event) -> None:
        if self.response is None:
            if isinstance(event, Done):
                self.refused = event
                return
            self.response = web.StreamResponse(headers={"Content-Type": NDJSON, "Cache-Control": "no-store"})
            try:
                await self.response.prepare(self.request)
            except (ConnectionError, RuntimeError):
                self._give_up()
        if isinstance(event, Started):
            self.ctx.executions += 1
            await self._write(shapes.count_line(self.ctx.executions))
        elif isinstance(event, Output):
            await self._write(shapes.stream_line(event.name, event.text))
        elif isinstance(event, (Display, Result)):
            await self._write(shapes.result_line(event.data, main=isinstance(event, Result)))
        elif isinstance(event, CellError):
            await self._write(shapes.error_line(event.ename, event.evalue, event.traceback))
        elif isinstance(event, Done):
            if event.status not in ("ok", "error"):
                name = shapes.STATUS_ERRORS.get(event.status, "SandboxError")
                await self._write(shapes.error_line(name, event.message or event.status, ""))
            await self._write(shapes.END_LINE)


async def execute(request: web.Request, sandboxes: Sandboxes, sandbox: Sandbox) -> web.StreamResponse:
    body = await read_object(request, sandbox.owner)
    code = body.get("code")
    if not isinstance(code, str):
        raise BadRequest("'code' must be a string")
    if body.get("context_id") is not None and body.get("language") is not None:
        raise BadRequest("give 'context_id' or 'language', not both")
    shapes.language(body.get("language"))
    envs = shapes.env_vars(body.get("env_vars"), "env_vars")
    ctx = _context(sandbox, body.get("context_id"))
    stream = Stream(request, ctx, sandboxes.service.settings.client_stall_ms / 1000)
    # One call at a time per context, as a kernel takes them: a second waits rather than being
    # refused, and a call's env vars are never set or put back in the middle of another's cell.
    async with ctx.lock:
        if envs:
            await sandboxes.quiet_cell(sandbox, ctx, engine.set_envs_code(envs))
        try:
            # The request's scope owns its run and the watch for its client: neither outlives it.
            async with TaskScope("e2b-run") as tasks:
                run = stream.run = sandboxes.submit(sandbox, ctx, code, stream.emit, tasks)
                if run.task is None:
                    raise RuntimeError("RunService.submit returned a run without its task")
                await _until_done(request, stream, run.task, tasks)
        finally:
            if envs:
                with contextlib.suppress(Refused, ApplianceError):
                    await sandboxes.quiet_cell(sandbox, ctx, engine.RESTORE_ENVS_CODE)
    if stream.response is None:
        refused = engine.refusal(stream.refused or Done("internal", message="no reply"))
        return reply(refused.status, refused.message, refused.retry_after_ms)
    with contextlib.suppress(ConnectionError, RuntimeError):
        await stream.response.write_eof()
    return stream.response


async def _until_done(
    request: web.Request, stream: Stream, task: asyncio.Task[None], tasks: TaskScope
) -> None:
    """Await the cell; if the client goes away meanwhile, interrupt it (its context lives on if the interpreter recovers),
    and cancel it only if it does not end within INTERRUPT_GRACE_S."""
    gone = tasks.spawn(until_gone(request), name="client-watch")
    try:
        await asyncio.wait([task, gone], return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            stream.gone = True
            stream.run.interrupt("the client went away")
            await asyncio.wait([task], timeout=INTERRUPT_GRACE_S)
            if not task.done():
                task.cancel()
        await wait_ended(task)
    finally:
        gone.cancel()


async def create_context(request: web.Request, sandboxes: Sandboxes, sandbox: Sandbox) -> web.StreamResponse:
    body = await read_object(request, sandbox.owner)
    shapes.language(body.get("language"))
    cwd = body.get("cwd")
    if cwd is not None and cwd not in ("/home/user", engine.WORKDIR):
        raise BadRequest(
            f"a context's cwd is the sandbox's working directory, {engine.WORKDIR} (asked: {str(cwd)[:100]!r})"
        )
    ctx = await sandboxes.new_context(sandbox)
    return web.json_response(shapes.context(ctx.id, ctx.cwd))


async def list_contexts(request: web.Request, sandboxes: Sandboxes, sandbox: Sandbox) -> web.StreamResponse:
    return web.json_response([shapes.context(c.id, c.cwd) for c in sandbox.contexts.values()])


async def remove_context(request: web.Request, sandboxes: Sandboxes, sandbox: Sandbox) -> web.StreamResponse:
    ctx = _context(sandbox, request.match_info["context_id"])
    if ctx.id == sandbox.default:
        raise BadRequest("the default context lives as long as its sandbox; kill the sandbox to end it")
    await sandboxes.remove_context(sandbox, ctx)
    return web.Response(status=204)


async def restart_context(request: web.Request, sandboxes: Sandboxes, sandbox: Sandbox) -> web.StreamResponse:
    ctx = _context(sandbox, request.match_info["context_id"])
    await sandboxes.restart_context(sandbox, ctx)
    return web.Response(status=204)


async def health(request: web.Request, sandboxes: Sandboxes, sandbox: Sandbox) -> web.StreamResponse:
    return web.Response(status=204)


def add_routes(app: web.Application, prefix: str) -> None:
    r = app.router
    jupyter = handler(INTERPRETER_PORT)
    r.add_post(f"{prefix}/execute", jupyter(execute))
    r.add_post(f"{prefix}/contexts", jupyter(create_context))
    r.add_get(f"{prefix}/contexts", jupyter(list_contexts))
    r.add_delete(f"{prefix}/contexts/{{context_id}}", jupyter(remove_context))
    r.add_post(f"{prefix}/contexts/{{context_id}}/restart", jupyter(restart_context))
    r.add_get(f"{prefix}/health", handler(ENVD_PORT)(health))
