"""The appliance's tools as a Model Context Protocol server, built on the official `mcp` SDK's
low-level `Server`, served at `/mcp` over Streamable HTTP (appliance.api.mcp_http). The client
distribution's stdio bridge (`appliance-mcp`) serves the same tools from its own copy
(appliance_client.mcp_server), which the server does not import; tests/test_client_package.py
checks that the two agree.

Tools: `run_python` and `close_session`, defined in appliance.api.tool_calls, `list_models`:
the model catalogue (GET /v1/models, appliance.inside.tools.catalogue) as JSON text, the names
being what `load_llm` / `transcribe` take inside `run_python`, and `snapshot_session` /
`restore_snapshot` (docs/snapshots.md): keep the persistent interpreter's state, and start a
new one from it (the old one is closed).
A result comes back as text content (appliance.api.tool_calls.tool_result, within a budget), image
content for figures, and the files the run wrote under outputs/ as embedded resources.

Resources: the same files are listed by `resources/list` and read by `resources/read`
(`appliance://runs/<run>/outputs/<path>`), from what this MCP session's own calls received:
a session sees only its own runs' files (and over HTTP a session is bound to one caller), so
there is no way to name another tenant's. The server keeps the most recent files of a session
up to RESOURCE_FILES / RESOURCE_BYTES, and of all sessions together up to RESOURCE_BYTES_ALL
(oldest first, whichever session's); older ones are dropped from the list.

State: each MCP session (one `Mcp-Session-Id`) gets its own Dispatcher through the SDK's
per-session lifespan. Calls with `keep_state: true` run in
that MCP session's one appliance session, opened on first use and closed by `close_session`
or when the MCP session ends. Calls without it get a fresh jail each time.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import mimetypes
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import quote

import anyio
from mcp import types
from mcp.server.lowlevel import Server
from mcp.server.lowlevel.helper_types import ReadResourceContents
from mcp.shared.exceptions import McpError
from pydantic import AnyUrl

from appliance import __version__
from appliance.api import tool_calls
from appliance.api.tool_calls import ToolResult
from appliance.core.tasks import within

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
SERVER_INSTRUCTIONS = (
    "run_python runs Python in a fresh jail (keep_state: true keeps one session's variables); "
    "files a run writes under outputs/ come back in its result and stay listed as resources."
)
LIST_MODELS_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
SNAPSHOT_TOOL = "snapshot_session"
SNAPSHOT_DESCRIPTION = (
    "Keep the state of the persistent interpreter (run_python with keep_state=true, or the given "
    "session): its files and the variables, functions and classes that pickle. Returns the "
    "snapshot's id and what could not be kept (locks, sockets, threads, open files). The "
    "interpreter goes on; restore_snapshot starts from the snapshot again, as often as wanted."
)
SNAPSHOT_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "session": {"type": "string", "description": "Advanced: the appliance session to snapshot."}
    },
    "additionalProperties": False,
}
RESTORE_TOOL = "restore_snapshot"
RESTORE_DESCRIPTION = (
    "Start a new persistent interpreter from a snapshot (snapshot_session's id): run_python with "
    "keep_state=true then runs in it, and the one it replaces is closed. Each restore is a fork: "
    "the same starting state, diverging from there."
)
RESTORE_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"snapshot": {"type": "string", "description": "The snapshot's id."}},
    "required": ["snapshot"],
    "additionalProperties": False,
}


RESOURCE_FILES = 64  # the most output files one MCP session keeps readable ...
RESOURCE_BYTES = 16 * 1024 * 1024  # ... and their most bytes in all (oldest dropped first)
RESOURCE_BYTES_ALL = 64 * 1024 * 1024  # what all MCP sessions of one server keep together
RESOURCE_NOT_FOUND = -32002  # the MCP specification's code for an unknown resource


@dataclass(frozen=True)
class OutputResource:
    """One file a run of this session wrote, as sent in its tool result."""

    uri: str
    path: str
    run: str
    mime: str
    data: bytes


class ResourceBudget:
    """The bytes every session's ResourceStore holds together, on one server: past
    RESOURCE_BYTES_ALL the oldest file of any session is dropped, so many MCP sessions
    cannot add up to the server's memory."""

    def __init__(self, limit: int = RESOURCE_BYTES_ALL) -> None:
        self.limit = limit
        self.size = 0
        self._held: OrderedDict[tuple[int, str], tuple[ResourceStore, int]] = OrderedDict()

    def take(self, store: ResourceStore, uri: str, size: int) -> None:
        self._held[(id(store), uri)] = (store, size)
        self.size += size
        while self.size > self.limit and self._held:
            (_, old_uri), (owner, old_size) = self._held.popitem(last=False)
            self.size -= old_size
            owner.forget(old_uri)

    def give(self, store: ResourceStore, uri: str) -> None:
        entry = self._held.pop((id(store), uri), None)
        if entry is not None:
            self.size -= entry[1]


class ResourceStore:
    """The output files one MCP session received, newest last, within its own bounds
    (RESOURCE_FILES, RESOURCE_BYTES) and the server's (ResourceBudget)."""

    def __init__(self, budget: ResourceBudget | None = None) -> None:
        self.items: OrderedDict[str, OutputResource] = OrderedDict()
        self.size = 0
        self.budget = budget if budget is not None else ResourceBudget()

    def add(self, item: OutputResource) -> None:
        self.drop(item.uri)
        if len(item.data) > min(RESOURCE_BYTES, self.budget.limit):
            return
        self.items[item.uri] = item
        self.size += len(item.data)
        self.budget.take(self, item.uri, len(item.data))
        while len(self.items) > RESOURCE_FILES or self.size > RESOURCE_BYTES:
            self.drop(next(iter(self.items)))

    def forget(self, uri: str) -> None:
        """Drop a file the budget already let go of."""
        item = self.items.pop(uri, None)
        if item is not None:
            self.size -= len(item.data)

    def drop(self, uri: str) -> None:
        self.forget(uri)
        self.budget.give(self, uri)

    def clear(self) -> None:
        """The MCP session ended: its files leave the server's budget."""
        for uri in list(self.items):
            self.drop(uri)

    def listed(self) -> list[types.Resource]:
        return [
            types.Resource(
                uri=AnyUrl(item.uri),
                name=item.path,
                title=f"outputs/{item.path} of run {item.run}",
                mimeType=item.mime,
                size=len(item.data),
            )
            for item in self.items.values()
        ]

    def read(self, uri: str) -> OutputResource:
        found = self.items.get(uri)
        if found is None:
            raise McpError(
                types.ErrorData(
                    code=RESOURCE_NOT_FOUND,
                    message=f"no resource {uri} in this MCP session: only files written by this "
                    f"session's own runs are readable, the latest ones it still keeps",
                )
            )
        return found


class Executor(Protocol):
    """What runs a tool call's code for one caller (appliance.api.mcp_http: the RunService)."""

    async def execute(self, args: tool_calls.RunArguments, session: str | None) -> tool_calls.Outcome: ...

    async def close_session(self, session: str) -> bool: ...

    async def models(self) -> list[dict[str, Any]]: ...

    async def snapshot(self, session: str) -> dict[str, Any]:
        """Keep a session's state: the snapshot's description (its id, size, what was skipped)."""

    async def restore(self, snapshot: str) -> tool_calls.Outcome:
        """Open a session restored from a snapshot (its id is the outcome's `session`)."""


class Dispatcher:
    """Runs one MCP session's tool calls on an Executor: keep_state calls share one appliance
    session, opened on first use and ended by close_session (or `close()`)."""

    def __init__(self, executor: Executor, max_chars: int = tool_calls.DEFAULT_MAX_CHARS) -> None:
        self.executor = executor
        self.max_chars = max_chars
        self.session: str | None = None

    async def call(self, name: str, arguments: str | Mapping[str, Any]) -> ToolResult:
        """One tool call by name, answered as a ToolResult (bad arguments too: the model reads why)."""
        if name == tool_calls.CLOSE_SESSION_TOOL:
            closed = await self.close()
            return ToolResult("session closed" if closed else "there was no open session", [], [], False)
        if name != tool_calls.TOOL_NAME:
            return ToolResult(
                f"unknown tool {name!r}; the tools are {tool_calls.TOOL_NAME} and "
                f"{tool_calls.CLOSE_SESSION_TOOL}",
                [],
                [],
                True,
            )
        try:
            args = tool_calls.parse_arguments(arguments)
        except tool_calls.ToolArgumentError as exc:
            return ToolResult(f"bad arguments: {exc}", [], [], True)
        session = args.session or ((self.session or "new") if args.keep_state else None)
        outcome = await self.executor.execute(args, session)
        if args.keep_state and not args.session and outcome.session:
            self.session = outcome.session
        return tool_calls.tool_result(outcome, self.max_chars)

    async def close(self) -> bool:
        """End this MCP session's appliance session, if one is open."""
        if self.session is None:
            return False
        session, self.session = self.session, None
        return await self.executor.close_session(session)


@dataclass
class McpSessionState:
    """What one MCP session holds: its dispatcher, made on its first tool call, and the
    output files its runs sent."""

    dispatcher: Dispatcher | None = None
    resources: ResourceStore = field(default_factory=ResourceStore)


# Names the Executor a tool call runs on, from the SDK's request context (the HTTP transport
# reads the caller's identity from it).
ExecutorFor = Callable[[Any], Executor]


def tools() -> list[types.Tool]:
    """The MCP tool list, from appliance.api.tool_calls' definitions."""
    return [
        types.Tool(
            name=tool_calls.TOOL_NAME,
            description=tool_calls.TOOL_DESCRIPTION,
            inputSchema=tool_calls.RUN_PYTHON_PARAMETERS,
        ),
        types.Tool(
            name=tool_calls.CLOSE_SESSION_TOOL,
            description=tool_calls.CLOSE_SESSION_DESCRIPTION,
            inputSchema=tool_calls.CLOSE_SESSION_PARAMETERS,
        ),
        types.Tool(
            name=LIST_MODELS_TOOL, description=LIST_MODELS_DESCRIPTION, inputSchema=LIST_MODELS_PARAMETERS
        ),
        types.Tool(name=SNAPSHOT_TOOL, description=SNAPSHOT_DESCRIPTION, inputSchema=SNAPSHOT_PARAMETERS),
        types.Tool(name=RESTORE_TOOL, description=RESTORE_DESCRIPTION, inputSchema=RESTORE_PARAMETERS),
    ]


async def list_models(executor: Executor) -> types.CallToolResult:
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


def _said(text: str, error: bool = False) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(type="text", text=text)], isError=error)


async def snapshot_session(dispatcher: Dispatcher, arguments: Mapping[str, Any]) -> types.CallToolResult:
    """snapshot_session: the given session's, or this MCP session's persistent interpreter's."""
    session = arguments.get("session")
    if session is not None and not isinstance(session, str):
        return _said("bad arguments: 'session' must be a string", True)
    session = session or dispatcher.session
    if session is None:
        return _said("there is no open session to snapshot: run run_python with keep_state=true first", True)
    try:
        info = await dispatcher.executor.snapshot(session)
    except Exception as exc:  # noqa: BLE001 (Executor is a protocol: whatever its transport raises, the model reads why)
        return _said(f"the snapshot could not be taken: {exc}", True)
    return _said(json.dumps(info, indent=1))


async def restore_snapshot(dispatcher: Dispatcher, arguments: Mapping[str, Any]) -> types.CallToolResult:
    """restore_snapshot: a new session from the snapshot becomes the persistent interpreter."""
    snapshot = arguments.get("snapshot")
    if not isinstance(snapshot, str) or not snapshot:
        return _said("bad arguments: 'snapshot' is required and must be a snapshot id", True)
    outcome = await dispatcher.executor.restore(snapshot)
    if outcome.status != "ok" or not outcome.session:
        return _said(tool_calls.tool_result(outcome, dispatcher.max_chars).text, True)
    old, dispatcher.session = dispatcher.session, outcome.session
    if old is not None:
        with contextlib.suppress(Exception):
            await dispatcher.executor.close_session(old)
    return _said(
        f"restored snapshot {snapshot} into session {outcome.session}; "
        "run_python with keep_state=true runs in it"
    )


async def _list_models(dispatcher: Dispatcher, arguments: Mapping[str, Any]) -> types.CallToolResult:
    return await list_models(dispatcher.executor)


# The tools the MCP server answers itself (run_python and close_session are the dispatcher's).
SESSION_TOOLS: dict[str, Callable[[Dispatcher, Mapping[str, Any]], Awaitable[types.CallToolResult]]] = {
    LIST_MODELS_TOOL: _list_models,
    SNAPSHOT_TOOL: snapshot_session,
    RESTORE_TOOL: restore_snapshot,
}


def output_resources(result: ToolResult) -> list[OutputResource]:
    """The files a result carries (not those too big to send: its text lists them)."""
    run = result.run or "unknown"
    return [
        OutputResource(
            # As the SDK's AnyUrl writes it, so that a client's resources/read finds it.
            uri=str(AnyUrl(f"appliance://runs/{quote(run, safe='')}/outputs/{quote(item.path)}")),
            path=item.path,
            run=run,
            mime=mimetypes.guess_type(item.path)[0] or "application/octet-stream",
            data=item.data,
        )
        for item in result.files
        if item.data is not None
    ]


def to_mcp(result: ToolResult) -> types.CallToolResult:
    """A ToolResult as MCP content: text, images, and each sent file as a resource."""
    content: list[types.ContentBlock] = [types.TextContent(type="text", text=result.text)]
    content += [types.ImageContent(type="image", data=img.data, mimeType=img.mime) for img in result.images]
    for item in output_resources(result):
        content.append(
            types.EmbeddedResource(
                type="resource",
                resource=types.BlobResourceContents(
                    uri=AnyUrl(item.uri), mimeType=item.mime, blob=base64.b64encode(item.data).decode()
                ),
            )
        )
    return types.CallToolResult(content=content, isError=result.is_error)


def build_server(
    executor_for: ExecutorFor, max_chars: int = tool_calls.DEFAULT_MAX_CHARS
) -> Server[Any, Any]:
    """The MCP server; `executor_for(request_context)` gives the Executor of a session's calls."""

    budget = ResourceBudget()  # shared by every MCP session of this server

    @contextlib.asynccontextmanager
    async def lifespan(_: Server[Any, Any]) -> AsyncIterator[McpSessionState]:
        state = McpSessionState(resources=ResourceStore(budget))
        try:
            yield state
        finally:
            state.resources.clear()
            if state.dispatcher is not None and state.dispatcher.session is not None:
                # The MCP session is over: end its appliance session now rather than at the
                # idle timeout. Shielded: this also runs while the transport is cancelled.
                with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                    await within(state.dispatcher.close(), CLOSE_TIMEOUT_S)

    server: Server[Any, Any] = Server(
        SERVER_NAME,
        version=__version__,
        instructions=SERVER_INSTRUCTIONS,
        lifespan=lifespan,
    )

    @server.list_tools()  # type: ignore[no-untyped-call, untyped-decorator]
    async def list_tools() -> list[types.Tool]:
        return tools()

    @server.call_tool(validate_input=False)  # type: ignore[untyped-decorator]
    async def call_tool(name: str, arguments: dict[str, Any]) -> types.CallToolResult:
        # Arguments are checked by tool_calls.parse_arguments, whose messages name the problem for
        # the model, rather than by the SDK's generic schema validation.
        ctx = server.request_context
        state: McpSessionState = ctx.lifespan_context
        if state.dispatcher is None:
            state.dispatcher = Dispatcher(executor_for(ctx), max_chars=max_chars)
        session_tool = SESSION_TOOLS.get(name)
        if session_tool is not None:
            return await session_tool(state.dispatcher, arguments or {})
        result = await state.dispatcher.call(name, arguments)
        for item in output_resources(result):
            state.resources.add(item)
        return to_mcp(result)

    @server.list_resources()  # type: ignore[no-untyped-call, untyped-decorator]
    async def list_resources() -> list[types.Resource]:
        state: McpSessionState = server.request_context.lifespan_context
        return state.resources.listed()

    @server.read_resource()  # type: ignore[no-untyped-call, untyped-decorator]
    async def read_resource(uri: AnyUrl) -> list[ReadResourceContents]:
        state: McpSessionState = server.request_context.lifespan_context
        item = state.resources.read(str(uri))
        return [ReadResourceContents(content=item.data, mime_type=item.mime)]

    return server
