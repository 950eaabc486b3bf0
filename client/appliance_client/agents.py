"""The appliance as a tool for model APIs: one tool definition, rendered for OpenAI Chat
Completions, the OpenAI Responses API and Anthropic, and `tool_result()`, which turns a client
`Execution` into what the model reads back.

    from appliance_client import agents
    tools = agents.Dispatcher(client)          # client: an appliance_client.client.AsyncClient
    # Chat Completions: chat.completions.create(..., tools=agents.openai_tools())
    messages.append(assistant_message)         # the assistant turn first, then its results
    messages += await tools.openai_turn(assistant_message.tool_calls)
    # Responses: responses.create(..., tools=agents.responses_tools())
    inputs += response.output
    inputs += await tools.responses_turn(response.output)
    # Anthropic: messages.create(..., tools=agents.anthropic_tools())
    messages += [{"role": "assistant", "content": reply.content}, await tools.anthropic_turn(reply.content)]

A turn renders every call of one assistant message together, as each API requires: Chat
Completions gets all `tool` messages right after the assistant message, then one `user` message
with the figures (tool messages take text only); Responses gets `function_call_output` items
that carry their images; Anthropic gets one `user` message of `tool_result` blocks.

The schema has one source (`RUN_PYTHON_PARAMETERS`; `strict_schema()` derives the form that
OpenAI's strict mode takes); the MCP servers (the stdio bridge's, and the appliance's own /mcp)
serve the same one. The text
a model reads is bounded by `max_chars` whatever the run printed: each section that had to be
cut carries a visible marker saying how much was cut, so a model never mistakes a cut output
for the whole of it. Figures become base64 image blocks (models that see images get the plot,
not its repr); files are listed by name and size. Rendering is pure; only the Dispatcher runs
code (through its client).
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, Unpack

from appliance_client.client import Client, ClientError, Execution, Frame, RequestOptions, SessionLost

TOOL_NAME = "run_python"
CLOSE_SESSION_TOOL = "close_session"
TOOL_DESCRIPTION = (
    "Run Python 3 code in a fresh, isolated sandbox (no network, no secrets) and return what it "
    "printed, the value of its last expression, any exception, matplotlib figures as images, and "
    "the files it wrote under outputs/. numpy, pandas and matplotlib are installed. Notebook lines "
    "work: `!cmd` runs a shell command, `%pip install pkg` installs a package the operator "
    "provides. With keep_state=true the code runs in a persistent interpreter where variables, "
    "imports and files survive between calls."
)
CLOSE_SESSION_DESCRIPTION = "End the persistent interpreter that run_python with keep_state=true uses."

# The one source of the tool's input schema (JSON Schema, draft 2020-12 subset that both
# OpenAI's and Anthropic's function calling accept).
RUN_PYTHON_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "code": {"type": "string", "description": "Python source to run, as a notebook cell."},
        "keep_state": {
            "type": "boolean",
            "description": "Run in the persistent interpreter of this conversation (opened on first use).",
            "default": False,
        },
        "session": {
            "type": "string",
            "description": "Advanced: the id of an appliance session to run in (overrides keep_state).",
        },
        "files": {
            "type": "array",
            "description": "Files written into the working directory before the code runs.",
            "items": {
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": "Relative path, e.g. data.csv"},
                    "content": {"type": "string"},
                    "encoding": {"type": "string", "enum": ["utf-8", "base64"], "default": "utf-8"},
                },
                "required": ["path", "content"],
            },
        },
    },
    "required": ["code"],
}
CLOSE_SESSION_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}

DEFAULT_MAX_CHARS = 8000
MAX_FRAMES = 3  # traceback frames a model gets: the last ones, where its own code failed
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_IMAGE_MIMES = ("image/png", "image/jpeg")


def strict_schema(schema: Mapping[str, Any]) -> dict[str, Any]:
    """`schema` in the form OpenAI's strict mode takes: every object closed
    (`additionalProperties: false`) with every property required, the optional ones nullable
    (null means "not given": parse_arguments reads it so), and no `default`s."""
    return _strict(schema, optional=False)


def _strict(node: Mapping[str, Any], optional: bool) -> dict[str, Any]:
    out = {k: v for k, v in node.items() if k != "default"}
    if optional:
        kind = out.get("type")
        if isinstance(kind, str):
            out["type"] = [kind, "null"]
        if isinstance(out.get("enum"), list):
            out["enum"] = [*out["enum"], None]
    properties = out.get("properties")
    if isinstance(properties, Mapping):
        required = set(out.get("required", ()))
        out["properties"] = {name: _strict(sub, name not in required) for name, sub in properties.items()}
        out["required"] = list(properties)
        out["additionalProperties"] = False
    items = out.get("items")
    if isinstance(items, Mapping):
        out["items"] = _strict(items, optional=False)
    return out


_TOOLS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    (TOOL_NAME, TOOL_DESCRIPTION, RUN_PYTHON_PARAMETERS),
    (CLOSE_SESSION_TOOL, CLOSE_SESSION_DESCRIPTION, CLOSE_SESSION_PARAMETERS),
)


def _chat_tool(name: str, description: str, parameters: dict[str, Any], strict: bool) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name, "description": description, "parameters": parameters}
    if strict:
        function.update(parameters=strict_schema(parameters), strict=True)
    return {"type": "function", "function": function}


def openai_tool(strict: bool = False) -> dict[str, Any]:
    """run_python as an OpenAI Chat Completions `tools=[...]` entry (`strict`: OpenAI's strict
    mode, with the schema strict_schema() gives; off by default, as other servers that speak
    this format, llama.cpp's for one, may not take it)."""
    return _chat_tool(TOOL_NAME, TOOL_DESCRIPTION, RUN_PYTHON_PARAMETERS, strict)


def anthropic_tool() -> dict[str, Any]:
    """run_python as an Anthropic Messages API `tools=[...]` entry."""
    return {"name": TOOL_NAME, "description": TOOL_DESCRIPTION, "input_schema": RUN_PYTHON_PARAMETERS}


def responses_tool() -> dict[str, Any]:
    """run_python as an OpenAI Responses API `tools=[...]` entry: strict, with the strict schema."""
    return _responses_tool(TOOL_NAME, TOOL_DESCRIPTION, RUN_PYTHON_PARAMETERS)


def _responses_tool(name: str, description: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "function",
        "name": name,
        "description": description,
        "parameters": strict_schema(parameters),
        "strict": True,
    }


def openai_tools(strict: bool = False) -> list[dict[str, Any]]:
    """run_python and close_session, Chat Completions format (answer them with
    Dispatcher.openai_turn, which handles both)."""
    return [_chat_tool(name, text, params, strict) for name, text, params in _TOOLS]


def responses_tools() -> list[dict[str, Any]]:
    """run_python and close_session, Responses API format (strict)."""
    return [_responses_tool(name, text, params) for name, text, params in _TOOLS]


def anthropic_tools() -> list[dict[str, Any]]:
    """run_python and close_session, Anthropic format."""
    return [{"name": name, "description": text, "input_schema": params} for name, text, params in _TOOLS]


class ToolArgumentError(ValueError):
    """The model's arguments do not fit the tool's schema; the message is meant for the model."""


@dataclass(frozen=True)
class RunArguments:
    """run_python's arguments, checked: what a host passes on to the client."""

    code: str
    keep_state: bool = False
    session: str | None = None
    files: dict[str, bytes] = field(default_factory=dict)


def parse_arguments(arguments: str | Mapping[str, Any]) -> RunArguments:  # noqa: C901, PLR0912 (one check per tool argument, each with its own message)
    """Check a model's run_python arguments (a JSON string, as OpenAI sends them, or a mapping,
    as Anthropic and MCP do); an optional field may be null (strict mode sends them so).
    ToolArgumentError names what is wrong. For close_session, or a call whose tool you do not
    know yet, use Dispatcher.call (or a turn), which answers every tool."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise ToolArgumentError(f"arguments are not valid JSON: {exc.msg}") from None
    if not isinstance(arguments, Mapping):
        raise ToolArgumentError("arguments must be a JSON object")
    unknown = set(arguments) - set(RUN_PYTHON_PARAMETERS["properties"])
    if unknown:
        raise ToolArgumentError(f"unknown argument(s): {', '.join(sorted(unknown))}")
    code = arguments.get("code")
    if not isinstance(code, str):
        raise ToolArgumentError("'code' is required and must be a string")
    # null means "not given": OpenAI's strict mode sends every optional field, as null when unset.
    keep_state = arguments.get("keep_state")
    if keep_state is None:
        keep_state = False
    if not isinstance(keep_state, bool):
        raise ToolArgumentError("'keep_state' must be true or false")
    session = arguments.get("session")
    if session is not None and not isinstance(session, str):
        raise ToolArgumentError("'session' must be a string")
    files: dict[str, bytes] = {}
    raw_files = arguments.get("files") or []
    if not isinstance(raw_files, list):
        raise ToolArgumentError("'files' must be a list of {path, content}")
    for item in raw_files:
        if (
            not isinstance(item, Mapping)
            or not isinstance(item.get("path"), str)
            or not isinstance(item.get("content"), str)
        ):
            raise ToolArgumentError("each file must be an object with string 'path' and 'content'")
        encoding = item.get("encoding") or "utf-8"
        if encoding == "base64":
            try:
                files[item["path"]] = base64.b64decode(item["content"], validate=True)
            except (binascii.Error, ValueError):
                raise ToolArgumentError(f"file {item['path']!r}: content is not base64") from None
        elif encoding == "utf-8":
            files[item["path"]] = item["content"].encode()
        else:
            raise ToolArgumentError(f"file {item['path']!r}: encoding must be 'utf-8' or 'base64'")
    return RunArguments(code, keep_state, session, files)


@dataclass(frozen=True)
class Image:
    """A figure or image result, base64 as on the wire."""

    mime: str
    data: str

    def data_url(self) -> str:
        """The image as a `data:` URL, as OpenAI's image inputs take it."""
        return f"data:{self.mime};base64,{self.data}"


@dataclass(frozen=True)
class FileEntry:
    """A file the run wrote under outputs/; `data` is None when it was too big to send."""

    path: str
    size: int
    data: bytes | None


@dataclass(frozen=True)
class ToolResult:
    """What the model reads back from one run, neutral; `openai()`/`anthropic()` render it."""

    text: str
    images: list[Image]
    files: list[FileEntry]
    is_error: bool
    run: str | None = None

    def openai_tool_message(self, tool_call_id: str) -> dict[str, Any]:
        """The Chat Completions `tool` message: the text (tool messages take text only; the
        images go in the user message openai_messages() puts after all of a turn's tool messages)."""
        return {"role": "tool", "tool_call_id": tool_call_id, "content": self.text}

    def openai(self, tool_call_id: str) -> list[dict[str, Any]]:
        """This one result as Chat Completions messages: `openai_messages([(tool_call_id, self)])`.

        Only right when the assistant message made this one call: with parallel calls, a user
        message between two tool messages is refused by the API. Render a whole turn with
        openai_messages() or Dispatcher.openai_turn()."""
        warnings.warn(
            "ToolResult.openai() renders one call alone; with parallel tool calls its user message "
            "lands between tool messages, which the API refuses: use agents.openai_messages() or "
            "Dispatcher.openai_turn()",
            DeprecationWarning,
            stacklevel=2,
        )
        return openai_messages([(tool_call_id, self)])

    def responses(self, call_id: str) -> dict[str, Any]:
        """A Responses API `function_call_output` input item; the images travel in it, as
        `input_image` parts with a data URL (that format takes images directly)."""
        output: str | list[dict[str, Any]] = self.text
        if self.images:
            output = [{"type": "input_text", "text": self.text}]
            output += [{"type": "input_image", "image_url": img.data_url()} for img in self.images]
        return {"type": "function_call_output", "call_id": call_id, "output": output}

    def anthropic(self, tool_use_id: str) -> dict[str, Any]:
        """An Anthropic `tool_result` content block (text and base64 image blocks); a turn's
        blocks go together in one user message (anthropic_message())."""
        content: list[dict[str, Any]] = [{"type": "text", "text": self.text}]
        content += [
            {"type": "image", "source": {"type": "base64", "media_type": img.mime, "data": img.data}}
            for img in self.images
        ]
        return {
            "type": "tool_result",
            "tool_use_id": tool_use_id,
            "content": content,
            "is_error": self.is_error,
        }


Answered = Sequence[tuple[str, ToolResult]]
"""One assistant turn's answered calls: (the call's id, its result), in the order of the calls."""


def openai_messages(answered: Answered) -> list[dict[str, Any]]:
    """Chat Completions messages for one assistant turn, to append after that assistant message:
    every `tool` message first, in the calls' order (the API requires them contiguous), then,
    when any run made figures, one `user` message carrying them, each labelled with its call."""
    messages = [result.openai_tool_message(call_id) for call_id, result in answered]
    parts: list[dict[str, Any]] = []
    for call_id, result in answered:
        if result.images:
            parts.append({"type": "text", "text": f"Images from the {TOOL_NAME} call {call_id}:"})
            parts += [{"type": "image_url", "image_url": {"url": img.data_url()}} for img in result.images]
    if parts:
        messages.append({"role": "user", "content": parts})
    return messages


def responses_items(answered: Answered) -> list[dict[str, Any]]:
    """Responses API input items for one turn: a `function_call_output` per call, images inside."""
    return [result.responses(call_id) for call_id, result in answered]


def anthropic_message(answered: Answered) -> dict[str, Any]:
    """The Anthropic `user` message answering one assistant turn: every `tool_result` block."""
    return {"role": "user", "content": [result.anthropic(call_id) for call_id, result in answered]}


def tool_result(execution: Execution, max_chars: int = DEFAULT_MAX_CHARS, images: bool = True) -> ToolResult:  # noqa: C901 (one branch per part of an Execution the model reads back)
    """Turn an Execution into what the model reads back.

    The text holds the status, stdout, stderr, the last result's text, the error with its last
    MAX_FRAMES frames, and the files with their sizes, in at most `max_chars` characters: the
    short, decisive parts (status, error, files) first, the streams sharing what is left, each
    cut in the middle with a `[… N characters cut …]` marker. With `images`, image/png and
    image/jpeg results and displays come back as images (and are only named in the text)."""
    if max_chars < 200:
        raise ValueError("max_chars must be at least 200: the status and markers need room")
    found_images: list[Image] = []
    display_notes: list[str] = []
    # The cell's values first, then the figures and displays, as the text has always listed them.
    ordered = [r for r in execution.results if r.is_main_result] + execution.displays
    for bundle in ordered:
        kind = "result" if bundle.is_main_result else "display"
        mime = next((m for m in _IMAGE_MIMES if isinstance(bundle.get(m), str)), None)
        if mime is not None and images:
            found_images.append(Image(mime, bundle[mime]))
            display_notes.append(f"[{kind}: {mime} image #{len(found_images)} attached]")
        elif kind == "display":
            display_notes.append(bundle.text or f"[display: {', '.join(sorted(bundle))}]")
    files = [FileEntry(f.path, f.size, f.bytes) for f in execution.files]

    fixed: list[tuple[str, str]] = [("status", _status_line(execution))]
    if execution.error is not None and (execution.error.raised or execution.error.traceback):
        # A status without a traceback (a limit, busy, …) is told by the status line alone.
        fixed.append(
            ("error", _error_text(execution.error.name, execution.error.value, execution.error.traceback))
        )
    if files:
        fixed.append(
            (
                "files",
                "\n".join(
                    f"outputs/{f.path} ({f.size} bytes)"
                    + ("" if f.data is not None else " [not sent: too big]")
                    for f in files
                ),
            )
        )
    flexible: list[tuple[str, str]] = []
    if execution.stdout:
        flexible.append(("stdout", execution.stdout))
    if execution.stderr:
        flexible.append(("stderr", execution.stderr))
    text_result = next(
        (
            r.text
            for r in reversed(execution.results)
            if r.is_main_result and r.text is not None and not any(m in r for m in _IMAGE_MIMES if images)
        ),
        None,
    )
    if text_result is not None:
        flexible.append(("result", text_result))
    if display_notes:
        flexible.append(("displays", "\n".join(display_notes)))
    return ToolResult(
        _layout(fixed, flexible, max_chars),
        found_images,
        files,
        is_error=execution.status != "ok",
        run=execution.run,
    )


def _status_line(ex: Execution) -> str:
    line = f"status: {ex.status}"
    if ex.exit_code is not None:
        line += f", exit code {ex.exit_code}"
    if ex.duration_ms is not None:
        line += f", {ex.duration_ms} ms"
    if ex.session:
        line += f", session {ex.session}"
    if ex.retry_after_ms is not None:
        line += f", retry after {ex.retry_after_ms} ms"
    if ex.message:
        line += f"\n{ex.message}"
    return line


def _error_text(name: str, value: str, traceback: list[str], max_frames: int = MAX_FRAMES) -> str:
    """The exception line and the last `max_frames` frames of its traceback, without colour codes."""
    lines = _ANSI.sub("", "\n".join(traceback)).splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("  File ")]
    if len(starts) > max_frames:
        head = next(
            (line for line in lines[: starts[0]] if line.strip()), "Traceback (most recent call last):"
        )
        cut = len(starts) - max_frames
        lines = [
            head,
            f"  [… {cut} earlier frame{'s' if cut != 1 else ''} cut …]",
            *lines[starts[-max_frames] :],
        ]
    summary = f"{name}: {value}" if value else name
    if not lines or lines[-1].strip() != summary.strip():
        lines.append(summary)
    return "\n".join(lines)


def cut(text: str, budget: int) -> str:
    """`text` in at most `budget` characters: its head and tail with a marker between saying how
    many characters were cut (the tail gets more: the end of an output is usually what matters)."""
    if len(text) <= budget:
        return text
    marker_len = len(f"\n[… {len(text)} characters cut …]\n")
    room = budget - marker_len
    if room <= 0:
        return f"[… {len(text)} characters cut …]"[:budget]
    head = room * 2 // 5
    tail = room - head
    dropped = len(text) - head - tail
    return f"{text[:head]}\n[… {dropped} characters cut …]\n{text[len(text) - tail :] if tail else ''}"


def _section(name: str, body: str) -> str:
    return f"--- {name} ---\n{body}"


def _layout(fixed: list[tuple[str, str]], flexible: list[tuple[str, str]], max_chars: int) -> str:
    """Join the sections within max_chars: fixed ones first (each cut to half the budget at
    most), then the flexible ones share the rest fairly (small ones whole, large ones cut)."""
    sep = "\n"
    parts: list[str] = []
    used = 0
    for name, body in fixed:
        header = 0 if name == "status" else len(f"--- {name} ---\n")
        budget = max(0, min(len(body), max_chars // 2 - header))
        piece = cut(body, budget) if name == "status" else _section(name, cut(body, budget))
        parts.append(piece)
        used += len(piece) + len(sep)
    remaining = max(0, max_chars - used)
    overhead = [len(f"--- {name} ---\n") + len(sep) for name, _ in flexible]
    sizes = [len(body) for _, body in flexible]
    budgets = _fair_share([s for s in sizes], remaining - sum(overhead))
    for (name, body), budget in zip(flexible, budgets, strict=True):
        if budget <= 0:
            parts.append(f"--- {name} ---\n[… {len(body)} characters cut …]"[: max(0, remaining)])
        else:
            parts.append(_section(name, cut(body, budget)))
        remaining -= len(parts[-1]) + len(sep)
    text = sep.join(p for p in parts if p)
    return text[:max_chars]


def _fair_share(sizes: list[int], total: int) -> list[int]:
    """Water-filling: sections smaller than an equal share keep their size; the rest split what is left."""
    budgets = [0] * len(sizes)
    left = max(0, total)
    pending = sorted(range(len(sizes)), key=lambda i: sizes[i])
    while pending:
        share = left // len(pending)
        i = pending[0]
        if sizes[i] <= share:
            budgets[i] = sizes[i]
            left -= sizes[i]
            pending.pop(0)
        else:
            for j in pending:
                budgets[j] = share
            break
    return budgets


class Executor(Protocol):
    """What runs the code: an appliance_client.client.AsyncClient (or the stdio bridge's
    reconnecting wrapper of one, appliance_client.mcp_bridge.BridgeExecutor)."""

    async def execute(self, code: str, **options: Unpack[RequestOptions]) -> Execution: ...

    async def close_session(self, session: str) -> Frame: ...

    async def models(self) -> list[dict[str, Any]]: ...

    async def snapshot(self, session: str) -> dict[str, Any]:
        """Keep a session's state (AsyncClient.snapshot)."""


class Dispatcher:
    """Runs the tools' calls on an Executor for one conversation: keep_state calls share one
    appliance session, opened on first use and ended by close_session (or `close()`)."""

    def __init__(
        self,
        client: Executor,
        max_chars: int = DEFAULT_MAX_CHARS,
        images: bool = True,
        timeout_ms: int | None = None,
    ) -> None:
        self.client = client
        self.max_chars = max_chars
        self.images = images
        self.timeout_ms = timeout_ms
        self.session: str | None = None

    async def execute(self, args: RunArguments) -> Execution:
        """Run checked run_python arguments; a keep_state run remembers its session."""
        session = args.session or ((self.session or "new") if args.keep_state else None)
        ex = await self.client.execute(
            args.code, session=session, files=args.files or None, timeout_ms=self.timeout_ms
        )
        if args.keep_state and not args.session and ex.session:
            self.session = ex.session
        return ex

    async def call(self, name: str, arguments: str | Mapping[str, Any]) -> ToolResult:
        """One tool call by name, answered as a ToolResult (bad arguments too: the model reads why)."""
        if name == CLOSE_SESSION_TOOL:
            closed = await self.close()
            return ToolResult("session closed" if closed else "there was no open session", [], [], False)
        if name != TOOL_NAME:
            return ToolResult(
                f"unknown tool {name!r}; the tools are {TOOL_NAME} and {CLOSE_SESSION_TOOL}", [], [], True
            )
        try:
            args = parse_arguments(arguments)
        except ToolArgumentError as exc:
            return ToolResult(f"bad arguments: {exc}", [], [], True)
        try:
            execution = await self.execute(args)
        except SessionLost as exc:
            if exc.session == self.session:
                self.session = None  # the next keep_state call opens a new one
            return ToolResult(
                f"status: not run\n{exc} Call {TOOL_NAME} with keep_state=true again to start a "
                "fresh interpreter, and redo the setup it needs.",
                [],
                [],
                True,
            )
        except ClientError as exc:  # the appliance is out of reach, or the connection dropped mid-run
            return ToolResult(f"status: not run or outcome unknown\n{exc}", [], [], True)
        return tool_result(execution, self.max_chars, self.images)

    async def openai_turn(self, tool_calls: Iterable[Any] | None) -> list[dict[str, Any]]:
        """Run every tool call of one Chat Completions assistant message (the SDK's objects or
        their dicts) and return the messages to append after that assistant message:
        openai_messages(), so parallel calls stay valid."""
        answered: list[tuple[str, ToolResult]] = []
        for call in tool_calls or ():
            function = _field(call, "function")
            name, arguments = _field(function, "name"), _field(function, "arguments")
            answered.append((str(_field(call, "id")), await self.call(str(name), arguments or "{}")))
        return openai_messages(answered)

    async def responses_turn(self, output: Iterable[Any]) -> list[dict[str, Any]]:
        """Run every `function_call` item of a Responses API output (other items are skipped)
        and return the `function_call_output` items to add to the next request's input."""
        answered: list[tuple[str, ToolResult]] = []
        for item in output:
            if _field(item, "type") == "function_call":
                result = await self.call(str(_field(item, "name")), _field(item, "arguments") or "{}")
                answered.append((str(_field(item, "call_id")), result))
        return responses_items(answered)

    async def anthropic_turn(self, content: Iterable[Any]) -> dict[str, Any]:
        """Run every `tool_use` block of an Anthropic assistant message's content and return the
        one user message of `tool_result` blocks that must follow it."""
        answered: list[tuple[str, ToolResult]] = []
        for block in content:
            if _field(block, "type") == "tool_use":
                result = await self.call(str(_field(block, "name")), _field(block, "input") or {})
                answered.append((str(_field(block, "id")), result))
        return anthropic_message(answered)

    async def close(self) -> bool:
        """End this conversation's session, if one is open."""
        if self.session is None:
            return False
        session, self.session = self.session, None
        done = await self.client.close_session(session)
        return done.get("status") == "ok"

    async def __aenter__(self) -> Dispatcher:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _field(obj: Any, name: str) -> Any:
    """`obj[name]` of a dict, `obj.name` of an SDK object (the turns take either)."""
    if isinstance(obj, Mapping):
        return obj.get(name)
    return getattr(obj, name, None)


class SyncDispatcher:
    """Dispatcher for the synchronous appliance_client.client.Client: the same calls and turns,
    run on the client's private loop."""

    def __init__(
        self,
        client: Client,
        max_chars: int = DEFAULT_MAX_CHARS,
        images: bool = True,
        timeout_ms: int | None = None,
    ) -> None:
        self.client = client
        self.dispatcher = Dispatcher(client.async_client, max_chars, images, timeout_ms)

    @property
    def session(self) -> str | None:
        """The appliance session keep_state calls share, once one is open."""
        return self.dispatcher.session

    def call(self, name: str, arguments: str | Mapping[str, Any]) -> ToolResult:
        """Dispatcher.call."""
        return self.client.run_async(self.dispatcher.call(name, arguments))

    def openai_turn(self, tool_calls: Iterable[Any] | None) -> list[dict[str, Any]]:
        """Dispatcher.openai_turn."""
        return self.client.run_async(self.dispatcher.openai_turn(tool_calls))

    def responses_turn(self, output: Iterable[Any]) -> list[dict[str, Any]]:
        """Dispatcher.responses_turn."""
        return self.client.run_async(self.dispatcher.responses_turn(output))

    def anthropic_turn(self, content: Iterable[Any]) -> dict[str, Any]:
        """Dispatcher.anthropic_turn."""
        return self.client.run_async(self.dispatcher.anthropic_turn(content))

    def close(self) -> bool:
        """Dispatcher.close."""
        return self.client.run_async(self.dispatcher.close())

    def __enter__(self) -> SyncDispatcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
