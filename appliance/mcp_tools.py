"""The appliance's tools as a Model Context Protocol server, built on the official `mcp` SDK's
low-level `Server`; transports are elsewhere (stdio here for `appliance mcp`, Streamable HTTP
at `/mcp` in appliance.mcp_http).

Tools: `run_python` and `close_session`, with the schema of appliance.agents (one source), and
`list_models`: the model catalogue (GET /v1/models, appliance.tools.catalogue) as JSON text,
the names being what `load_llm` / `transcribe` take inside `run_python`.
A result comes back as text content (appliance.agents.tool_result, within a budget), image
content for figures, and the files the run wrote under outputs/ as embedded resources.

State: each MCP session (a stdio process, or one `Mcp-Session-Id` over HTTP) gets its own
agents.Dispatcher through the SDK's per-session lifespan. Calls with `keep_state: true` run in
that MCP session's one appliance session, opened on first use and closed by `close_session`
or when the MCP session ends. Calls without it get a fresh jail each time.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
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
LIST_MODELS_TOOL = "list_models"
LIST_MODELS_DESCRIPTION = (
    "List the models the appliance holds (its SANDBOX_MODELS_DIR): name, kind (llm: GGUF for "
    "llama.cpp; whisper: whisper.cpp), size, architecture, quantisation, parameters and the GPU "
    "memory a full offload needs. Load one inside run_python with "
    "`from appliance.tools import load_llm; llm = load_llm(NAME)` or `transcribe(audio, model=NAME)`."
)
LIST_MODELS_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


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
        types.Tool(
            name=agents.TOOL_NAME,
            description=agents.TOOL_DESCRIPTION,
            inputSchema=agents.RUN_PYTHON_PARAMETERS,
        ),
        types.Tool(
            name=agents.CLOSE_SESSION_TOOL,
            description=agents.CLOSE_SESSION_DESCRIPTION,
            inputSchema=agents.CLOSE_SESSION_PARAMETERS,
        ),
        types.Tool(
            name=LIST_MODELS_TOOL, description=LIST_MODELS_DESCRIPTION, inputSchema=LIST_MODELS_PARAMETERS
        ),
    ]


async def list_models(executor: agents.Executor) -> types.CallToolResult:
    """The catalogue as one text block of JSON (an error result, saying why, if it cannot be read)."""
    try:
        models = await executor.models()
    except Exception as exc:  # noqa: BLE001 (Executor is a protocol: whatever its transport raises, the model reads why)
        return types.CallToolResult(
            content=[types.TextContent(type="text", text=f"the model catalogue could not be read: {exc}")],
            isError=True,
        )
    if not models:
        text = "no models: the appliance's models directory (SANDBOX_MODELS_DIR) is not set or holds none"
    else:
        text = json.dumps({"models": models}, indent=1)
    return types.CallToolResult(content=[types.TextContent(type="text", text=text)], isError=False)


def to_mcp(result: agents.ToolResult) -> types.CallToolResult:
    """An agents.ToolResult as MCP content: text, images, and each sent file as a resource."""
    content: list[types.ContentBlock] = [types.TextContent(type="text", text=result.text)]
    content += [types.ImageContent(type="image", data=img.data, mimeType=img.mime) for img in result.images]
    for item in result.files:
        if item.data is None:
            continue  # too big to send: the text lists it with its size
        mime = mimetypes.guess_type(item.path)[0] or "application/octet-stream"
        uri = f"appliance://runs/{result.run or 'unknown'}/outputs/{item.path}"
        content.append(
            types.EmbeddedResource(
                type="resource",
                resource=types.BlobResourceContents(
                    uri=AnyUrl(uri), mimeType=mime, blob=base64.b64encode(item.data).decode()
                ),
            )
        )
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
        if name == LIST_MODELS_TOOL:
            return await list_models(state.dispatcher.client)
        return to_mcp(await state.dispatcher.call(name, arguments))

    return server


async def serve_stdio(url: str, token: str | None, max_chars: int = agents.DEFAULT_MAX_CHARS) -> None:
    """Serve MCP over stdin/stdout for a local client, running code on the appliance at `url`."""
    from mcp.server.stdio import stdio_server

    async with AsyncClient(url, token) as client:
        server = build_server(lambda _ctx: client, max_chars)
        async with stdio_server() as (read, write):
            await server.run(read, write, server.create_initialization_options())
