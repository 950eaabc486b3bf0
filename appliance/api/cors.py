"""CORS for the browser origins the operator lists in SANDBOX_ALLOWED_ORIGINS, so that a
browser-based client on such an origin (an MCP inspector, a web app) can send the JSON POSTs,
the Authorization header and the `Mcp-Session-Id` header that need a preflight, and read the
answers. Any other origin gets no CORS header at all: the server's middleware has already
answered it 403. The server's own pages (/docs) are same-origin and need none of this.

Credentials (cookies) are never allowed: the API's only credential is the bearer token,
which the page itself must add.
"""

from __future__ import annotations

from aiohttp import web

ALLOW_METHODS = "GET, POST, DELETE"
# What the API reads: the token, JSON bodies, and the MCP Streamable HTTP transport's headers.
ALLOW_HEADERS = "Authorization, Content-Type, Mcp-Session-Id, Mcp-Protocol-Version, Last-Event-ID"
EXPOSE_HEADERS = "Mcp-Session-Id, Mcp-Protocol-Version, WWW-Authenticate"
MAX_AGE_S = 600


def listed_origin(request: web.Request, allowed: tuple[str, ...]) -> str | None:
    """The request's one Origin, when it is one of the listed origins."""
    origins = request.headers.getall("Origin", [])
    return origins[0] if len(origins) == 1 and origins[0] in allowed else None


def preflight(request: web.Request, allowed: tuple[str, ...]) -> web.Response:
    """Answer a CORS preflight: 204 with the grants for a listed origin, 403 for any other."""
    origin = listed_origin(request, allowed)
    if origin is None:
        return web.json_response(
            {"error": "CORS is granted only to the origins in SANDBOX_ALLOWED_ORIGINS"}, status=403
        )
    return web.Response(
        status=204,
        headers={
            "Access-Control-Allow-Origin": origin,
            "Access-Control-Allow-Methods": ALLOW_METHODS,
            "Access-Control-Allow-Headers": ALLOW_HEADERS,
            "Access-Control-Max-Age": str(MAX_AGE_S),
            "Vary": "Origin",
        },
    )


def add_headers(request: web.Request, response: web.StreamResponse, allowed: tuple[str, ...]) -> None:
    """Before a response's headers go out (also a streamed one): let a listed origin read it."""
    origin = listed_origin(request, allowed)
    if origin is None:
        return
    response.headers["Access-Control-Allow-Origin"] = origin
    response.headers["Access-Control-Expose-Headers"] = EXPOSE_HEADERS
    response.headers.add("Vary", "Origin")
