"""How a `busy` answer reads over HTTP, on every route that can give one (REST, MCP, E2B, and
any route added beside them): status 429, a `Retry-After` header in whole seconds (at least
1, as RFC 9110 spells it), and the `done` frame, whose `retry_after_ms` says the same to the
millisecond. The hint itself is the core's (appliance.core.backpressure)."""

from __future__ import annotations

import math
from typing import Any

from aiohttp import web

from appliance.core.errors import Busy
from appliance.core.service import RunService
from appliance.wire import protocol

STATUS = 429


def retry_after(ms: object) -> dict[str, str]:
    """The Retry-After header for a hint of `ms` milliseconds (none when there is no hint)."""
    if isinstance(ms, bool) or not isinstance(ms, int | float) or not math.isfinite(ms):
        return {}
    return {"Retry-After": str(max(1, math.ceil(ms / 1000)))}


def headers_of(done: dict[str, Any]) -> dict[str, str]:
    """The Retry-After header a `busy` done frame calls for (none for any other status)."""
    return retry_after(done.get("retry_after_ms")) if done.get("status") == "busy" else {}


def frame(service: RunService, exc: Busy, rid: str | None = None) -> protocol.Frame:
    """The `done` frame for a refusal the api layer itself made (nothing reached the core)."""
    return protocol.done_frame(
        rid or protocol.new_request_id(),
        exc.status,
        message=exc.message,
        retry_after_ms=service.retry_after_ms(exc),
    )


def response(done: dict[str, Any]) -> web.Response:
    """429 with Retry-After and the `busy` done frame as its JSON body."""
    return web.json_response(done, status=STATUS, headers=headers_of(done))
