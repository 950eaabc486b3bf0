"""REST mirror of the WebSocket protocol, for clients that cannot speak WebSocket.

- `POST /v1/exec`: body = an execute frame; the reply streams the same frames as
  NDJSON (one JSON object a line), ending with `done`. A client that goes leaves its run
  running to its end.
- `GET /v1/runs/{run}/frames?after=N`: a run's frames after seq N, then the live ones, as
  NDJSON, ending with `done` (appliance.api.runlog); 404 "no such run" otherwise.
- `POST /v1/sessions`: opens a session (optionally running `code` in it); 201 with its id.
- `DELETE /v1/sessions/{id}`: ends it; 204, or 404 when there is no such session.
- `POST /v1/sessions/{id}/snapshot`: keeps the session's state; 201 with the snapshot
  (`{"snapshot", "bytes", "skipped", ...}`). `POST /v1/sessions` with `from_snapshot` opens a
  session restored from one (a fork, as often as asked).
- `GET` / `DELETE /v1/snapshots/{id}`: a snapshot of the caller's tenant (another tenant's id
  is answered exactly as an unknown one: 404).
- `GET /openapi.json` and `GET /docs`: the API description, generated from the protocol's
  models (appliance.wire.openapi); `/docs` is Swagger UI served from the installed
  swagger-ui-bundle package, and its page may load nothing from any other origin;
  `/docs/` redirects to it. Its "Try it out" calls are same-origin, which the `Origin`
  check lets through (appliance.api.transport.own_origin).
Bearer auth is applied by the server's middleware to every `/v1` route, and so is the
`Origin` check; a POST whose body is not `Content-Type: application/json` gets 415.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import swagger_ui_bundle
from aiohttp import web

from appliance.api import busy
from appliance.api.runlog import NO_SUCH_RUN
from appliance.api.transport import PARSER_KEY, RUNS_KEY, send_within, until_gone
from appliance.core.errors import ApplianceError, Busy, Cancelled, UnknownSession, UnknownSnapshot, status_of
from appliance.core.service import RunService, session_opener
from appliance.core.tasks import TaskScope
from appliance.wire import protocol
from appliance.wire.openapi import openapi_document
from appliance.wire.protocol import ExecuteRequest, ProtocolError

NDJSON = "application/x-ndjson"
JSON = "application/json"


def _rejected(message: str, rid: str | None = None, status: int = 400) -> web.Response:
    frame = protocol.done_frame(rid or protocol.new_request_id(), "rejected", message=message)
    return web.json_response(frame, status=status)


async def _parse(request: web.Request, owner: str, default: str | None = None) -> ExecuteRequest:
    raw = await request.read()
    if not raw.strip() and default is not None:
        raw = default.encode()
    message = await request.app[PARSER_KEY].parse(raw, owner)
    if not isinstance(message, ExecuteRequest):
        raise ProtocolError("this endpoint takes an execute request", getattr(message, "id", None))
    return message


async def _prepare(response: web.StreamResponse, request: web.Request) -> None:
    await response.prepare(request)


async def exec_ndjson(request: web.Request, service: RunService, owner: str) -> web.StreamResponse:
    try:
        req = await _parse(request, owner)
    except ProtocolError as exc:
        return _rejected(exc.message, exc.request_id)
    except Busy as exc:
        return busy.response(busy.frame(service, exc))
    store = request.app[RUNS_KEY]
    if not store.scope.running:
        return _rejected("the server is shutting down", req.id, status=503)
    response = _ndjson_response()
    stall_s = service.settings.client_stall_ms / 1000
    refused: list[protocol.Frame] = []

    async def emit(text: str) -> None:
        # The status line waits for the run's first frame: a request refused `busy` (nothing
        # ran) is answered 429 with Retry-After, not 200 and a stream that says so.
        if not response.prepared:
            first = json.loads(text)  # once, the first frame only
            if first.get("type") == "done" and first.get("status") == "busy":
                refused.append(first)
                return
            await send_within(request, _prepare(response, request), stall_s)
        await send_within(request, response.write((text + "\n").encode()), stall_s)

    # The run is a task of the run store: it goes on to its end if this client goes (an
    # attach, or GET /v1/runs/{run}/frames, finds it). The watch for the client is this
    # request's own.
    log = store.start(service, req, owner, emit)
    async with TaskScope("rest-run") as tasks:
        gone = tasks.spawn(until_gone(request), name="client-watch")
        waits = [gone] if log.task is None else [log.task, gone]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        log.detach(emit)
        await tasks.cancel(gone)
    if refused:
        return busy.response(refused[0])
    if not response.prepared:  # the client went before the run's first frame: nobody reads this
        return web.Response(status=499)
    with contextlib.suppress(ConnectionError, RuntimeError, Cancelled):
        await response.write_eof()
    return response


async def run_frames(request: web.Request, service: RunService, owner: str) -> web.StreamResponse:
    """`GET /v1/runs/{run}/frames?after=N`: the run's kept frames whose seq is above N (-1, the
    default: all), then the live ones, as NDJSON, ending with its done. An unknown, expired
    or other tenant's run: 404 with a `done` `rejected` "no such run", the same for all three."""
    raw = request.query.get("after", "-1")
    try:
        after = int(raw)
    except ValueError:
        after = -2
    if not -1 <= after <= protocol.MAX_SEQ:
        return _rejected(f"'after' must be an integer from -1 to {protocol.MAX_SEQ}")
    log = request.app[RUNS_KEY].find(request.match_info["run"], owner)
    if log is None:
        service.charge_rejected(owner)
        return _rejected(NO_SUCH_RUN, status=404)
    response = _ndjson_response()
    await response.prepare(request)
    stall_s = service.settings.client_stall_ms / 1000

    async def pump() -> None:
        async with contextlib.aclosing(log.follow(after)) as frames:
            async for text in frames:
                await send_within(request, response.write((text + "\n").encode()), stall_s)

    async with TaskScope("rest-follow") as tasks:
        reader = tasks.spawn(pump(), name="follow")
        gone = tasks.spawn(until_gone(request), name="client-watch")
        await asyncio.wait([reader, gone], return_when=asyncio.FIRST_COMPLETED)
        await tasks.cancel(reader, gone)
    with contextlib.suppress(ConnectionError, RuntimeError, Cancelled):
        await response.write_eof()
    return response


def _ndjson_response() -> web.StreamResponse:
    return web.StreamResponse(headers={"Content-Type": NDJSON, "Cache-Control": "no-store"})


async def open_session(request: web.Request, service: RunService, owner: str) -> web.Response:
    try:
        req = await _parse(request, owner, default='{"code": ""}')
    except ProtocolError as exc:
        return _rejected(exc.message, exc.request_id)
    except Busy as exc:
        return busy.response(busy.frame(service, exc))
    if req.session is not None:
        return _rejected("POST /v1/sessions opens a new session; leave 'session' out", req.id)
    store = request.app[RUNS_KEY]
    if not store.scope.running:
        return _rejected("the server is shutting down", req.id, status=503)
    frames: list[protocol.Frame] = []

    async def collect(text: str) -> None:
        frames.append(json.loads(text))

    # A run of the store like any other: numbered, kept for attach, and not cut off if this
    # client goes (the session it opens stays open, its idle timeout as usual).
    log = store.start(service, session_opener(req), owner, collect)
    if log.task is not None:
        await asyncio.shield(log.task)
    if not frames or frames[-1].get("type") != "done":
        return _rejected("the server is shutting down", req.id, status=503)
    done = frames[-1]
    session = done.get("session")
    if done.get("status") in ("rejected", "busy", "internal") or not session:
        code = {"rejected": 400, "busy": busy.STATUS}.get(str(done.get("status")), 500)
        return web.json_response(done, status=code, headers=busy.headers_of(done))
    return web.json_response({"session": session, "frames": frames}, status=201)


async def close_session(request: web.Request, service: RunService, owner: str) -> web.Response:
    session_id = request.match_info["session_id"]
    if await service.close_session(session_id, owner):
        return web.Response(status=204)
    return web.json_response({"error": f"no such session {session_id!r}"}, status=404)


def _refused(exc: ApplianceError, service: RunService) -> web.Response:
    """A snapshot route's refusal: its HTTP status from the error's kind (one place); a
    `busy` one is 429 with Retry-After, as on every route."""
    status, message = status_of(exc)
    headers: dict[str, str] = {}
    if isinstance(exc, (UnknownSession, UnknownSnapshot)):
        code = 404
    else:
        code = {"rejected": 400, "busy": busy.STATUS, "internal": 500}.get(status, 422)
    if isinstance(exc, Busy):
        headers = busy.retry_after(service.retry_after_ms(exc))
    return web.json_response({"error": message, "status": status}, status=code, headers=headers)


async def snapshot_session(request: web.Request, service: RunService, owner: str) -> web.Response:
    try:
        info = await service.snapshot_session(request.match_info["session_id"], owner)
    except ApplianceError as exc:
        return _refused(exc, service)
    return web.json_response(info.as_dict(), status=201)


async def get_snapshot(request: web.Request, service: RunService, owner: str) -> web.Response:
    try:
        info = await service.find_snapshot(request.match_info["snapshot_id"], owner)
    except ApplianceError as exc:
        return _refused(exc, service)
    return web.json_response(info.as_dict())


async def delete_snapshot(request: web.Request, service: RunService, owner: str) -> web.Response:
    try:
        deleted = await service.delete_snapshot(request.match_info["snapshot_id"], owner)
    except ApplianceError as exc:
        return _refused(exc, service)
    if deleted:
        return web.Response(status=204)
    return _refused(UnknownSnapshot(f"no such snapshot {request.match_info['snapshot_id'][:64]!r}"), service)


async def list_models(request: web.Request, service: RunService, owner: str) -> web.Response:
    """The model catalogue: what SANDBOX_MODELS_DIR holds (auth as every /v1 route)."""
    return web.json_response(await service.models())


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(openapi_document())


# The /docs page: Swagger UI from the installed package. Relative URLs (so it works behind a
# path prefix), no inline script, and a CSP that lets the browser load nothing from any other
# origin, whatever the bundle would try (Swagger UI's default validator badge is one such URL).
_SWAGGER_UI = Path(str(swagger_ui_bundle.swagger_ui_path))
_DOCS_ASSETS = {
    "swagger-ui.css": "text/css",
    "swagger-ui-bundle.js": "application/javascript",
    "favicon-32x32.png": "image/png",
}
_DOCS_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
        "img-src 'self' data:; font-src 'self' data:; connect-src 'self'; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
_DOCS_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>Appliance API</title>
<link rel="stylesheet" href="docs/swagger-ui.css">
<link rel="icon" type="image/png" href="docs/favicon-32x32.png">
</head>
<body>
<div id="swagger-ui"></div>
<script src="docs/swagger-ui-bundle.js"></script>
<script src="docs/init.js"></script>
</body>
</html>
"""
_DOCS_INIT = """window.onload = function () {
  window.ui = SwaggerUIBundle({
    url: "openapi.json",
    dom_id: "#swagger-ui",
    validatorUrl: null,
    deepLinking: true,
    presets: [SwaggerUIBundle.presets.apis],
    layout: "BaseLayout"
  });
};
"""


async def docs(request: web.Request) -> web.Response:
    """The OpenAPI document rendered by Swagger UI."""
    return web.Response(text=_DOCS_PAGE, content_type="text/html", headers=_DOCS_HEADERS)


async def docs_slash(request: web.Request) -> web.Response:
    """`/docs/` is /docs: its page's relative URLs (docs/...) resolve only from /docs. The
    Location is relative, so it stays right behind a path prefix."""
    raise web.HTTPPermanentRedirect("../docs")


async def docs_asset(request: web.Request) -> web.StreamResponse:
    name = request.match_info["name"]
    if name == "init.js":
        return web.Response(text=_DOCS_INIT, content_type="application/javascript", headers=_DOCS_HEADERS)
    content_type = _DOCS_ASSETS.get(name)  # a fixed list: no path from the request reaches the disk
    if content_type is None:
        raise web.HTTPNotFound()
    return web.FileResponse(_SWAGGER_UI / name, headers={**_DOCS_HEADERS, "Content-Type": content_type})


def add_routes(
    app: web.Application, service_key: web.AppKey[Any], owner_for: Callable[[web.Request], str]
) -> None:
    """Register the REST routes; `owner_for` names the caller (sessions are bound to it).
    Frames are parsed by the app's FrameParser (`PARSER_KEY`)."""

    def bind(handler: Any) -> Any:
        async def wrapped(request: web.Request) -> web.StreamResponse:
            if request.method == "POST" and request.content_type != JSON:
                # A browser sends text/plain, form and multipart bodies across origins with no
                # CORS preflight; application/json it may only send after one, which only the
                # origins in SANDBOX_ALLOWED_ORIGINS are granted (appliance.api.cors).
                return _rejected(f"a POST body must be sent as Content-Type: {JSON}", status=415)
            response: web.StreamResponse = await handler(
                request, request.app[service_key], owner_for(request)
            )
            return response

        return wrapped

    app.router.add_post("/v1/exec", bind(exec_ndjson))
    app.router.add_post("/v1/sessions", bind(open_session))
    app.router.add_delete("/v1/sessions/{session_id}", bind(close_session))
    app.router.add_post("/v1/sessions/{session_id}/snapshot", bind(snapshot_session))
    app.router.add_get("/v1/snapshots/{snapshot_id}", bind(get_snapshot))
    app.router.add_delete("/v1/snapshots/{snapshot_id}", bind(delete_snapshot))
    app.router.add_get("/v1/models", bind(list_models))
    app.router.add_get("/v1/runs/{run}/frames", bind(run_frames))
    app.router.add_get("/openapi.json", openapi)
    app.router.add_get("/docs", docs)
    app.router.add_get("/docs/", docs_slash)
    app.router.add_get("/docs/{name}", docs_asset)
