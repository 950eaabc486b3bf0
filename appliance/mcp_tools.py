"""The appliance's tools as a Model Context Protocol server, built on the official `mcp` SDK's
low-level `Server`; transports are elsewhere (stdio here for `appliance mcp`, Streamable HTTP
at `/mcp` in appliance.mcp_http).

Tools: `run_python` and `close_session`, with the schema of appliance.agents (one source).
A result comes back as text content (appliance.agents.tool_result, within a budget), image
content for figures, and the files the run wrote under outputs/ as embedded resources.

State: each MCP session (a stdio process, or one `Mcp-Session-Id` over HTTP) gets its own
agents.Dispatcher through the SDK's per-session lifespan. Calls with `keep_state: true` run in
that MCP session's one appliance session, opened on first use and closed by `close_session`
or when the MCP session ends. Calls without it get a fresh jail each time.

No model catalogue exists in the appliance yet, so there is no `list_models` tool.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import mimetypes
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import anyio
from mcp import types
from mcp.server.lowlevel import Server
from pydantic import AnyUrl

from appliance import agents
from appliance.client import AsyncClient

log = logging.getLogger("appliance.mcp")

SERVER_NAME = "appliance"
CLOSE_TIMEOUT_S = 10.0  # closing an appliance session when its MCP session ends


@dataclass
class McpSessionState:
    """What one MCP session holds: its dispatcher, made on its first tool call."""

    dispatcher: agents.Dispatcher | None = None


# Names the Executor a tool call runs on, from the SDK's request context (the HTTP transport
# reads the caller's identity from it; stdio has one client for the whole process).
ExecutorFor = Callable[[Any], agents.Executor]


def tools() -> list[types.Tool]:
    """The MCP tool list, from appliance.agents' definitions."""
    return [
        types.Tool(name=agents.TOOL_NAME, description=agents.TOOL_DESCRIPTION,
                   inputSchema=agents.RUN_PYTHON_PARAMETERS),
        types.Tool(name=agents.CLOSE_SESSION_TOOL, description=agents.CLOSE_SESSION_DESCRIPTION,
                   inputSchema=agents.CLOSE_SESSION_PARAMETERS),
    ]


def to_mcp(result: agents.ToolResult) -> types.CallToolResult:
    """An agents.ToolResult as MCP content: text, images, and each sent file as a resource."""
    content: list[types.ContentBlock] = [types.TextContent(type="text", text=result.text)]
    content += [types.ImageContent(type="image", data=img.data, mimeType=img.mime) for img in result.images]
    for item in result.files:
        if item.data is None:
            continue  # too big to send: the text lists it with its size
        mime = mimetypes.guess_type(item.path)[0] or "application/octet-stream"
        uri = f"appliance://runs/{result.run or 'unknown'}/outputs/{item.path}"
        content.append(types.EmbeddedResource(type="resource", resource=types.BlobResourceContents(
            uri=AnyUrl(uri), mimeType=mime, blob=base64.b64encode(item.data).decode())))
    return types.CallToolResult(content=content, isError=result.is_error)


def build_server(executor_for: ExecutorFor, max_chars: int = agents.DEFAULT_MAX_CHARS) -> Server[Any, Any]:
    """The MCP server; `executor_for(request_context)` gives the Executor of a session's calls."""

    @contextlib.asynccontextmanager
    async def lifespan(_: Server[Any, Any]) -> AsyncIterator[McpSessionState]:
        state = McpSessionState()
        try:
            yield state
        finally:
            if state.dispatcher is not None and state.dispatcher.session is not None:
                # The MCP session is over: end its appliance session now rather than at the
                # idle timeout. Shielded: this also runs while the transport is cancelled.
                with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                    async with asyncio.timeout(CLOSE_TIMEOUT_S):
                        await state.dispatcher.close()

    server: Server[Any, Any] = Server(SERVER_NAME, lifespan=lifespan)

    @server.list_tools()  # type: ignore[no-untyped-call, untyped-decorator]
    async def list_tools() -> list[types.Tool]:
        return tools()

    @server.call_tool(validate_input=False)  # type: ignore[untyped-decorator]
    async def call_tool(name: str, arguments: dict[str, Any]) -> types.CallToolResult:
        # Arguments are checked by agents.parse_arguments, whose messages name the problem for
        # the model, rather than by the SDK's generic schema validation.
        ctx = server.request_context
        state: McpSessionState = ctx.lifespan_context
        if state.dispatcher is None:
            state.dispatcher = agents.Dispatcher(executor_for(ctx), max_chars=max_chars)
        return to_mcp(await state.dispatcher.call(name, arguments))

    return server


async def serve_stdio(url: str, token: str | None, max_chars: int = agents.DEFAULT_MAX_CHARS) -> None:
    """Serve MCP over stdin/stdout for a local client, running code on the appliance at `url`."""
    from mcp.server.stdio import stdio_server

    async with AsyncClient(url, token) as client:
        server = build_server(lambda _ctx: client, max_chars)
        async with stdio_server() as (read, write):
            await server.run(read, write, server.create_initialization_options())
