"""The appliance as a tool for model APIs: one tool definition, rendered for OpenAI and
Anthropic, and `tool_result()`, which turns a client `Execution` into what the model reads
back.

    from appliance import agents
    tools = agents.openai_tools()              # chat.completions.create(..., tools=tools)
    runner = agents.Dispatcher(client)         # client: an appliance.client.AsyncClient
    result = await runner.call(call.function.name, call.function.arguments)
    messages += result.openai(call.id)         # or result.anthropic(block.id) for Claude

The schema has one source (`RUN_PYTHON_PARAMETERS`); the MCP server (appliance.mcp_tools)
serves the same one. The text a model reads is bounded by `max_chars` whatever the run
printed: each section that had to be cut carries a visible marker saying how much was cut,
so a model never mistakes a cut output for the whole of it. Figures become base64 image
blocks (models that see images get the plot, not its repr); files are listed by name and size.
Pure functions over data: nothing here does I/O.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, Unpack

from appliance.client import ClientError, Execution, Frame, RequestOptions, SessionLost

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


def openai_tool() -> dict[str, Any]:
    """run_python as an OpenAI `tools=[...]` entry (Chat Completions function tool)."""
    return {
        "type": "function",
        "function": {"name": TOOL_NAME, "description": TOOL_DESCRIPTION, "parameters": RUN_PYTHON_PARAMETERS},
    }


def anthropic_tool() -> dict[str, Any]:
    """run_python as an Anthropic Messages API `tools=[...]` entry."""
    return {"name": TOOL_NAME, "description": TOOL_DESCRIPTION, "input_schema": RUN_PYTHON_PARAMETERS}


def openai_tools() -> list[dict[str, Any]]:
    """run_python and close_session, OpenAI format."""
    return [
        openai_tool(),
        {
            "type": "function",
            "function": {
                "name": CLOSE_SESSION_TOOL,
                "description": CLOSE_SESSION_DESCRIPTION,
                "parameters": CLOSE_SESSION_PARAMETERS,
            },
        },
    ]


def anthropic_tools() -> list[dict[str, Any]]:
    """run_python and close_session, Anthropic format."""
    return [
        anthropic_tool(),
        {
            "name": CLOSE_SESSION_TOOL,
            "description": CLOSE_SESSION_DESCRIPTION,
            "input_schema": CLOSE_SESSION_PARAMETERS,
        },
    ]


class ToolArgumentError(ValueError):
    """The model's arguments do not fit the tool's schema; the message is meant for the model."""


@dataclass(frozen=True)
class RunArguments:
    """run_python's arguments, checked: what a host passes on to the client."""

    code: str
    keep_state: bool = False
    session: str | None = None
    files: dict[str, bytes] = field(default_factory=dict)


def parse_arguments(arguments: str | Mapping[str, Any]) -> RunArguments:
    """Check a model's run_python arguments (a JSON string, as OpenAI sends them, or a mapping,
    as Anthropic and MCP do). ToolArgumentError names what is wrong."""
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
    keep_state = arguments.get("keep_state", False)
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
        encoding = item.get("encoding", "utf-8")
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

    def openai(self, tool_call_id: str) -> list[dict[str, Any]]:
        """Chat Completions messages to append: the `tool` message with the text, then, when
        there are images, a `user` message carrying them (tool messages take text only)."""
        messages: list[dict[str, Any]] = [
            {"role": "tool", "tool_call_id": tool_call_id, "content": self.text}
        ]
        if self.images:
            parts: list[dict[str, Any]] = [
                {"type": "text", "text": f"Images from the {TOOL_NAME} call above:"}
            ]
            parts += [
                {"type": "image_url", "image_url": {"url": f"data:{img.mime};base64,{img.data}"}}
                for img in self.images
            ]
            messages.append({"role": "user", "content": parts})
        return messages

    def anthropic(self, tool_use_id: str) -> dict[str, Any]:
        """An Anthropic `tool_result` content block (text and base64 image blocks)."""
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


def tool_result(execution: Execution, max_chars: int = DEFAULT_MAX_CHARS, images: bool = True) -> ToolResult:
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
    """What runs the code: an appliance.client.AsyncClient, or the server's own service
    (appliance.mcp_http) for the /mcp endpoint."""

    async def execute(self, code: str, **options: Unpack[RequestOptions]) -> Execution: ...

    async def close_session(self, session: str) -> Frame: ...

    async def models(self) -> list[dict[str, Any]]: ...


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

    async def close(self) -> bool:
        """End this conversation's session, if one is open."""
        if self.session is None:
            return False
        session, self.session = self.session, None
        done = await self.client.close_session(session)
        return done.get("status") == "ok"
