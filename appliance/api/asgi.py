"""An aiohttp request as an ASGI HTTP scope, for the ASGI applications the server mounts
(the MCP SDK's Streamable HTTP transport, connectrpc's envd services)."""

from __future__ import annotations

from typing import Any

from aiohttp import web


def http_scope(request: web.Request, path: str | None = None, **extra: Any) -> dict[str, Any]:
    """The request's scope; `path` replaces the request's own (a mount point already routed);
    `extra` keys are added (an authenticated identity, say)."""
    peer = request.transport.get_extra_info("peername") if request.transport is not None else None
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": f"{request.version.major}.{request.version.minor}",
        "method": request.method,
        "scheme": request.scheme,
        "path": request.path if path is None else path,
        "raw_path": (request.raw_path.split("?", 1)[0] if path is None else path).encode(),
        "root_path": "",
        "query_string": request.query_string.encode(),
        "headers": [(k.lower(), v) for k, v in request.raw_headers],
        "client": (peer[0], peer[1]) if isinstance(peer, tuple) and len(peer) >= 2 else None,
        "server": None,
        "extensions": {},
        **extra,
    }
