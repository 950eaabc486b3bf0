"""`appliance-mcp` (or `appliance mcp`): the MCP tools (appliance_client.mcp_server) over stdio for a local client (a
desktop app, an IDE), running code on an appliance over its WebSocket.

The bridge outlives the appliance: a desktop app starts it once and keeps it. So
- it starts and answers `initialize` and `tools/list` whether or not the appliance is up;
  only a refused token (HTTP 401/403 at launch) ends it, since no retry can fix that;
- every call reaches the appliance through one lazily connected AsyncClient that reconnects
  with backoff (up to `reconnect_s` per call) after the connection drops, e.g. when the
  appliance restarts;
- a call made while the appliance stays unreachable is a tool error saying so ("appliance
  unreachable at URL, retrying"), and the next call tries again;
- a keep_state session the appliance still has after a reconnect goes on; one it lost (it
  restarted) is reported plainly in the tool result, and the next keep_state call opens a new
  one (appliance_client.agents.Dispatcher, on the client's SessionLost).
"""

from __future__ import annotations

import logging
from typing import Any, Unpack

from appliance_client import agents
from appliance_client.client import (
    AsyncClient,
    AuthenticationError,
    ConnectionFailed,
    Execution,
    Frame,
    RequestOptions,
)
from appliance_client.mcp_server import build_server

log = logging.getLogger("appliance.mcp")

RECONNECT_S = 10.0  # how long one call waits for an unreachable appliance before saying so


class BridgeExecutor:
    """agents.Executor on a reconnecting AsyncClient; an unreachable appliance is named as
    such (the call did not run), in the words a model and its user can act on."""

    def __init__(self, client: AsyncClient) -> None:
        self.client = client

    def _unreachable(self, exc: ConnectionFailed) -> ConnectionFailed:
        return ConnectionFailed(
            f"appliance unreachable at {self.client.url}, retrying: this call did not run; "
            f"call again once it is back ({exc})"
        )

    async def execute(self, code: str, **options: Unpack[RequestOptions]) -> Execution:
        try:
            return await self.client.execute(code, **options)
        except ConnectionFailed as exc:
            raise self._unreachable(exc) from None

    async def close_session(self, session: str) -> Frame:
        try:
            return await self.client.close_session(session)
        except ConnectionFailed as exc:
            raise self._unreachable(exc) from None

    async def models(self) -> list[dict[str, Any]]:
        try:
            return await self.client.models()
        except ConnectionFailed as exc:
            raise self._unreachable(exc) from None

    async def snapshot(self, session: str) -> dict[str, Any]:
        try:
            return await self.client.snapshot(session)
        except ConnectionFailed as exc:
            raise self._unreachable(exc) from None


async def probe(url: str, token: str | None) -> None:
    """One connection attempt at launch: AuthenticationError (a refused token) is raised; an
    appliance not up yet is only logged, as the bridge serves anyway."""
    try:
        async with AsyncClient(url, token, reconnect_s=0):
            pass
    except ConnectionFailed as exc:
        log.warning("appliance unreachable at %s, retrying on each call: %s", url, exc)


async def serve_stdio(
    url: str,
    token: str | None,
    max_chars: int = agents.DEFAULT_MAX_CHARS,
    reconnect_s: float = RECONNECT_S,
) -> None:
    """Serve MCP over stdin/stdout for a local client, running code on the appliance at `url`.
    AuthenticationError when the appliance refuses the token at launch."""
    from mcp.server.stdio import stdio_server

    await probe(url, token)
    async with AsyncClient(url, token, reconnect_s=reconnect_s, lazy=True) as client:
        executor = BridgeExecutor(client)
        server = build_server(lambda _ctx: executor, max_chars)
        async with stdio_server() as (read, write):
            await server.run(read, write, server.create_initialization_options())


__all__ = ["RECONNECT_S", "AuthenticationError", "BridgeExecutor", "serve_stdio"]
