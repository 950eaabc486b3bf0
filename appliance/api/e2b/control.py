"""E2B's control API: create, list, describe, kill, time out, connect to, pause and snapshot
sandboxes.

Every call names its caller with `X-API-Key`, a token the native API would take as a bearer
token (SANDBOX_AUTH_TOKEN, or a tenant's from SANDBOX_AUTH_TOKENS_FILE): a missing or wrong
key is 401, which the SDK raises as AuthenticationException. A sandbox is found only by its
owner: another tenant's reads as 404, exactly like one that never existed.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from appliance.api import busy
from appliance.api.e2b import shapes
from appliance.api.e2b.engine import Refused, Sandboxes, as_refused
from appliance.api.e2b.registry import Sandbox
from appliance.api.e2b.shapes import BadRequest
from appliance.api.transport import PARSER_KEY
from appliance.core.errors import ApplianceError

SANDBOXES_KEY = web.AppKey("e2b_sandboxes", Sandboxes)


def reply(status: int, message: str, retry_after_ms: int | None = None) -> web.Response:
    # A `busy` refusal is 429 with Retry-After, as on every route (appliance.api.busy).
    return web.json_response(
        shapes.error(status, message),
        status=status,
        reason=shapes.reason(status, message),
        headers=busy.retry_after(retry_after_ms),
    )


def owner_of(request: web.Request) -> str | None:
    service = request.app[SANDBOXES_KEY].service
    return service.identify(request.headers.get("X-API-Key"))


async def read_json(request: web.Request, owner: str) -> object:
    """The body as JSON, screened like a native frame first (size, nesting; a big one counted
    in the parser's child), so no body holds the event loop or the stack."""
    raw = await request.read()
    if not raw.strip():
        return {}
    await request.app[PARSER_KEY].screen(raw, owner)
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        raise BadRequest("the body is not JSON") from None


async def read_object(request: web.Request, owner: str) -> dict[str, Any]:
    """`read_json`, and the body must be a JSON object (an empty body is one)."""
    body = await read_json(request, owner)
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


def _not_found(sandbox_id: str) -> web.Response:
    return reply(404, f"sandbox {sandbox_id[:64]!r} not found")


def handler(fn: Any) -> Any:
    """Authenticate, then map every refusal to E2B's error body, in one place."""

    async def wrapped(request: web.Request) -> web.StreamResponse:
        owner = owner_of(request)
        if owner is None:
            return reply(401, "missing or wrong X-API-Key")
        try:
            response: web.StreamResponse = await fn(request, request.app[SANDBOXES_KEY], owner)
        except BadRequest as exc:
            return reply(400, str(exc))
        except Refused as exc:
            return reply(exc.status, exc.message, exc.retry_after_ms)
        except ApplianceError as exc:
            refused = as_refused(exc)
            return reply(refused.status, refused.message, refused.retry_after_ms)
        return response

    return wrapped


def one_sandbox(fn: Callable[[web.Request, Sandboxes, Sandbox], Awaitable[web.StreamResponse]]) -> Any:
    """A route on one sandbox ({sandbox_id}): the caller's own, else 404 before anything is read
    (another tenant's reads as one that does not exist)."""

    async def on_one(request: web.Request, sandboxes: Sandboxes, owner: str) -> web.StreamResponse:
        sandbox_id = request.match_info["sandbox_id"]
        sandbox = sandboxes.owned(sandbox_id, owner)
        if sandbox is None:
            return _not_found(sandbox_id)
        return await fn(request, sandboxes, sandbox)

    return on_one


def _detail(sandboxes: Sandboxes, sandbox: Sandbox) -> dict[str, Any]:
    s = sandboxes.service.settings
    return shapes.detail(sandbox, s.cpus, s.memory_mb, s.max_disk_mb)


async def create(request: web.Request, sandboxes: Sandboxes, owner: str) -> web.StreamResponse:
    """Create a sandbox from a template, or from a snapshot of the caller's (by id or name; another
    tenant's reads as an unknown template)."""

    body = await read_json(request, owner)
    asked = body.get("templateID") if isinstance(body, dict) else None
    entry = None
    if isinstance(asked, str) and asked not in shapes.TEMPLATES:
        entry = await sandboxes.find_snapshot(owner, asked[: shapes.MAX_TEMPLATE_REF])
    template, timeout_s, metadata, envs = shapes.new_sandbox(
        body, lambda ref: entry is not None and ref == asked
    )
    sandbox = await sandboxes.create(
        owner,
        template,
        timeout_s,
        metadata,
        envs,
        shapes.gpu_ask(metadata),
        from_snapshot=entry.id if entry is not None else None,
    )
    return web.json_response(shapes.created(sandbox), status=201)


async def listing(request: web.Request, sandboxes: Sandboxes, owner: str) -> web.StreamResponse:
    q = request.query
    page, token = shapes.listing(
        sandboxes.of_owner(owner),
        shapes.metadata_filter(q.get("metadata")),
        q.get("state"),
        shapes.page_limit(q.get("limit")),
        q.get("nextToken"),
        q.get("template"),
        q.get("order"),
    )
    headers = {"x-next-token": token} if token else {}
    return web.json_response([_detail(sandboxes, s) for s in page], headers=headers)


async def info(request: web.Request, sandboxes: Sandboxes, sandbox: Sandbox) -> web.StreamResponse:
    return web.json_response({**_detail(sandboxes, sandbox), "envdAccessToken": sandbox.token})


async def kill(request: web.Request, sandboxes: Sandboxes, sandbox: Sandbox) -> web.StreamResponse:
    await sandboxes.kill(sandbox)
    return web.Response(status=204)


async def set_timeout(request: web.Request, sandboxes: Sandboxes, sandbox: Sandbox) -> web.StreamResponse:
    body = await read_object(request, sandbox.owner)
    sandboxes.set_timeout(sandbox, shapes.timeout_s(body.get("timeout"), default=None))
    return web.Response(status=204)


async def connect(request: web.Request, sandboxes: Sandboxes, sandbox: Sandbox) -> web.StreamResponse:
    """Connect to a sandbox, resuming it if paused (201; a running one: 200); a timeout given
    sets its new end."""
    body = await read_object(request, sandbox.owner)
    timeout = shapes.timeout_s(body.get("timeout")) if body.get("timeout") is not None else None
    resumed = await sandboxes.resume(sandbox)
    if timeout is not None:
        sandboxes.set_timeout(sandbox, timeout)
    return web.json_response(shapes.created(sandbox), status=201 if resumed else 200)


async def resume(request: web.Request, sandboxes: Sandboxes, sandbox: Sandbox) -> web.StreamResponse:
    """The older resume call: a running sandbox is a conflict (409), as on E2B."""
    body = await read_object(request, sandbox.owner)
    timeout = shapes.timeout_s(body.get("timeout"))
    if not await sandboxes.resume(sandbox):
        return reply(409, f"sandbox {sandbox.id} is running, not paused")
    sandboxes.set_timeout(sandbox, timeout)
    return web.json_response(shapes.created(sandbox), status=201)


async def pause(request: web.Request, sandboxes: Sandboxes, sandbox: Sandbox) -> web.StreamResponse:
    """Pause: the default context kept as a snapshot, the jails ended; 409 if paused already."""
    await read_json(request, sandbox.owner)  # screened like every body; its options change nothing here
    if not await sandboxes.pause(sandbox):
        return reply(409, f"sandbox {sandbox.id} is paused already")
    return web.Response(status=204)


async def create_snapshot(request: web.Request, sandboxes: Sandboxes, sandbox: Sandbox) -> web.StreamResponse:
    """Snapshot a sandbox's default context (a template new sandboxes start from); it runs on."""
    body = await read_object(request, sandbox.owner)
    # `memory: false` (filesystem only) asks for less than a snapshot keeps here: taken in full.
    entry = await sandboxes.snapshot(sandbox, shapes.snapshot_name(body.get("name")))
    return web.json_response(shapes.snapshot_info(entry), status=201)


def _store_off() -> web.Response:
    return reply(501, "snapshots is not supported by this server: it needs SANDBOX_SNAPSHOT_DIR set")


async def list_snapshots(request: web.Request, sandboxes: Sandboxes, owner: str) -> web.StreamResponse:
    if not sandboxes.service.snapshots.enabled:
        return _store_off()
    q = request.query
    page, token = shapes.snapshot_listing(
        await sandboxes.snapshots_of(owner),
        q.get("sandboxID"),
        q.get("name"),
        shapes.page_limit(q.get("limit")),
        q.get("nextToken"),
    )
    headers = {"x-next-token": token} if token else {}
    return web.json_response([shapes.snapshot_info(e) for e in page], headers=headers)


async def delete_template(request: web.Request, sandboxes: Sandboxes, owner: str) -> web.StreamResponse:
    """Delete a snapshot (the SDK's delete_snapshot deletes it as a template): 204, or 404 for
    an id this tenant has no snapshot of; the server's own templates are not the caller's."""
    ref = request.match_info["template_id"]
    if ref in shapes.TEMPLATES:
        return reply(403, f"template {ref!r} is the server's own; only snapshots can be deleted")
    if not sandboxes.service.snapshots.enabled:
        return _store_off()
    if not await sandboxes.delete_snapshot(owner, ref):
        return reply(404, f"snapshot {ref[:64]!r} not found")
    return web.Response(status=204)


def not_supported(feature: str) -> Any:
    """Features of E2B's cloud with no counterpart here yet: the SDK's error, naming the feature."""

    async def answer(request: web.Request, sandboxes: Sandboxes, owner: str) -> web.StreamResponse:
        sandbox_id = request.match_info.get("sandbox_id")
        if sandbox_id is not None and sandboxes.owned(sandbox_id, owner) is None:
            return _not_found(sandbox_id)
        return reply(501, f"{feature} is not supported by this server (the appliance); see docs/e2b.md")

    return answer


def add_routes(app: web.Application, prefix: str) -> None:
    r = app.router
    for base in (f"{prefix}/sandboxes", f"{prefix}/v2/sandboxes"):
        r.add_post(base, handler(create))
        r.add_get(base, handler(listing))
        r.add_post(f"{base}/{{sandbox_id}}/connect", handler(one_sandbox(connect)))
    r.add_get(f"{prefix}/sandboxes/metrics", handler(not_supported("metrics")))  # before {sandbox_id}
    one = f"{prefix}/sandboxes/{{sandbox_id}}"
    r.add_get(one, handler(one_sandbox(info)))
    r.add_delete(one, handler(one_sandbox(kill)))
    r.add_post(f"{one}/timeout", handler(one_sandbox(set_timeout)))
    r.add_post(f"{one}/pause", handler(one_sandbox(pause)))
    r.add_post(f"{one}/resume", handler(one_sandbox(resume)))
    r.add_post(f"{one}/snapshots", handler(one_sandbox(create_snapshot)))
    r.add_post(f"{one}/fork", handler(not_supported("fork")))
    r.add_post(f"{one}/refreshes", handler(not_supported("refreshes")))
    r.add_get(f"{one}/metrics", handler(not_supported("metrics")))
    r.add_get(f"{one}/logs", handler(not_supported("logs")))
    r.add_put(f"{one}/network", handler(not_supported("network updates")))
    r.add_get(f"{prefix}/snapshots", handler(list_snapshots))
    r.add_delete(f"{prefix}/templates/{{template_id}}", handler(delete_template))
