"""SandboxFusion's routes on the appliance's port, authenticated as every API route.

`POST /run_code`, `POST /run_jupyter` (SandboxFusion's paths, at the root, so a client's
base URL is the appliance's), `POST /run_tests` (the appliance's own: N cases of one
program) and `GET /v1/languages` (what /run_code serves here; SandboxFusion has no such
listing). The caller's token is the bearer token, or the password of HTTP Basic auth: a
client that sends no headers of its own (verl's) carries it in its URL,
`http://x:TOKEN@host:9100/run_code`.

Bad input is refused before anything runs with HTTP 400 (a busy server: 429 with
Retry-After, as every route answers `busy`: appliance.api.busy) and
SandboxFusion's body, status `SandboxError`, its message naming the problem; a jail that
failed answers 200 with `SandboxError`, as SandboxFusion does.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
from collections.abc import Callable, Coroutine
from typing import Any

from aiohttp import web

from appliance.api import busy
from appliance.api.fusion import languages, shapes
from appliance.api.fusion.engine import Refused, Runner
from appliance.api.fusion.shapes import BadRequest
from appliance.api.transport import PARSER_KEY, bearer_token, until_gone
from appliance.core.errors import ApplianceError, Busy, status_of
from appliance.core.service import RunService
from appliance.core.tasks import TaskScope

JSON = "application/json"
PATHS = frozenset(("/run_code", "/run_jupyter", "/run_tests"))
TOOLS_KEY: web.AppKey[dict[str, tuple[str, ...]]] = web.AppKey("fusion_tools")


def token(request: web.Request) -> str | None:
    """The caller's token: a bearer token, or the password of HTTP Basic auth."""
    found = bearer_token(request)
    if found is not None:
        return found
    scheme, _, value = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        _, _, password = base64.b64decode(value.strip(), validate=True).decode().partition(":")
    except (binascii.Error, ValueError):
        return None
    return password or None


def _refused(status: int, message: str, retry_after_ms: int | None = None) -> web.Response:
    # A `busy` refusal is 429 with Retry-After, as on every route (appliance.api.busy).
    return web.json_response(shapes.refusal(message), status=status, headers=busy.retry_after(retry_after_ms))


async def _body(request: web.Request, service: RunService, owner: str) -> object:
    """The body as JSON, screened like a native frame first (size, nesting), so no body holds
    the event loop or the stack."""
    if request.content_type != JSON:
        # A browser sends text/plain, form and multipart bodies across origins with no CORS
        # preflight (as rest.py refuses them).
        raise Refused(415, f"the body must be sent as Content-Type: {JSON}")
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        limit = service.settings.max_message_bytes
        raise Refused(413, f"the body is over SANDBOX_MAX_MESSAGE_BYTES ({limit} bytes)") from None
    await request.app[PARSER_KEY].screen(raw, owner)
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        raise BadRequest("the body is not JSON") from None


Handler = Callable[[Runner, object], Coroutine[Any, Any, dict[str, Any]]]


def _route(service_key: web.AppKey[Any], owner_for: Callable[[web.Request], str], work: Handler) -> Any:
    async def handle(request: web.Request) -> web.StreamResponse:
        service: RunService = request.app[service_key]
        owner = owner_for(request)
        runner = Runner(service, request.app[PARSER_KEY], owner, request.app[TOOLS_KEY])
        try:
            body = await _body(request, service, owner)
            answer = await _unless_gone(request, work(runner, body))
        except BadRequest as exc:
            return _refused(400, str(exc))
        except Refused as exc:
            return _refused(exc.status, exc.message, exc.retry_after_ms)
        except Busy as exc:
            return _refused(busy.STATUS, exc.message, service.retry_after_ms(exc))
        except ApplianceError as exc:
            status, message = status_of(exc)
            return _refused(400 if status == "rejected" else 500, message)
        if answer is None:  # the client went away: nobody to answer
            return web.Response(status=499)
        return web.json_response(answer)

    return handle


async def _unless_gone(
    request: web.Request, work: Coroutine[Any, Any, dict[str, Any]]
) -> dict[str, Any] | None:
    """The work's answer; None, the work cancelled (its runs and sessions ended), if the
    client went away first. The work's own error is raised here, for the handler to map."""
    answer: list[dict[str, Any]] = []
    failed: list[Exception] = []

    async def attempt() -> None:
        try:
            answer.append(await work)
        except Exception as exc:  # noqa: BLE001  (the scope would only log it: the handler maps it)
            failed.append(exc)

    async with TaskScope("fusion-request") as tasks:
        task = tasks.spawn(attempt(), name="fusion-work")
        gone = tasks.spawn(until_gone(request), name="client-watch")
        await asyncio.wait([task, gone], return_when=asyncio.FIRST_COMPLETED)
        await tasks.cancel(gone)
        await tasks.cancel(task)  # a no-op once it has ended; else the client went first
    if failed:
        raise failed[0]
    return answer[0] if answer else None


async def _code(runner: Runner, body: object) -> dict[str, Any]:
    compiled, ran, files, note = await runner.run_code(shapes.code_ask(body))
    return shapes.code_response(compiled, ran, files, note)


async def _jupyter(runner: Runner, body: object) -> dict[str, Any]:
    return await runner.run_jupyter(shapes.jupyter_ask(body))


async def _tests(runner: Runner, body: object) -> dict[str, Any]:
    return await runner.run_tests(shapes.tests_ask(body))


async def _languages(request: web.Request) -> web.Response:
    tools = request.app[TOOLS_KEY]
    return web.json_response(
        {
            "languages": sorted(tools),
            "compiled": sorted(
                n for n in tools if (lang := languages.by_name().get(n)) is not None and lang.compile
            ),
        }
    )


def add_routes(
    app: web.Application, service_key: web.AppKey[Any], owner_for: Callable[[web.Request], str]
) -> None:
    """Register the routes; the middleware has authenticated the caller (`owner_for`)."""
    app[TOOLS_KEY] = languages.available()
    app.router.add_post("/run_code", _route(service_key, owner_for, _code))
    app.router.add_post("/run_jupyter", _route(service_key, owner_for, _jupyter))
    app.router.add_post("/run_tests", _route(service_key, owner_for, _tests))
    app.router.add_get("/v1/languages", _languages)
