"""What the two transports (WebSocket in server.py, REST in rest.py) share: reading the
caller's token, sending with a stall bound, and noticing a connection that is gone.

A client that takes no frame for SANDBOX_CLIENT_STALL_MS is dropped: its connection is
aborted and its runs are cancelled, so it can hold neither a slot nor the server's memory.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

from aiohttp import web

from appliance.errors import Cancelled

GONE_POLL_S = 0.25


def bearer_token(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


async def send_within(request: web.Request, sending: Awaitable[None], stall_s: float) -> None:
    """Await one send; Cancelled (and the connection aborted) if the client does not take it
    within stall_s, or if the connection broke."""
    try:
        async with asyncio.timeout(stall_s):
            await sending
    except TimeoutError:
        abort(request)
        raise Cancelled(f"the client took no output for {stall_s:g} s (SANDBOX_CLIENT_STALL_MS); "
                        "it was disconnected") from None
    except (ConnectionError, RuntimeError) as exc:
        raise Cancelled("the client disconnected") from exc


def abort(request: web.Request) -> None:
    """Drop the connection now, without a closing handshake."""
    transport = request.transport
    if transport is not None:
        transport.abort()


def is_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


async def until_gone(request: web.Request) -> None:
    """Return once the client's TCP connection is closed (checked every GONE_POLL_S)."""
    while not is_gone(request):
        await asyncio.sleep(GONE_POLL_S)
