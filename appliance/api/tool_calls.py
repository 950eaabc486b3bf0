"""The server's side of its MCP tools (appliance.api.mcp_tools): the tools' definitions, a
model's run_python arguments checked, and a run's frames turned into the text, images and files
a model reads back, within a character budget.

The server imports nothing of the client distribution (appliance_client), whose tool adapters
(appliance_client.agents) carry the same definitions and rendering for model APIs and the stdio
bridge; tests/test_client_package.py checks that the two agree, definition by definition and
frame by frame, so a model reads the same result whichever way it reached the appliance.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

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

# run_python's input schema (JSON Schema, the draft 2020-12 subset that both OpenAI's and
# Anthropic's function calling accept, as the client's adapters give it to them).
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

# done.status -> the error's name, and what it means when the server's message says nothing
# (the client's ExecutionError names them the same).
STATUS_ERRORS: dict[str, tuple[str, str]] = {
    "error": ("NonZeroExit", "the code exited with a non-zero code"),
    "timeout": ("Timeout", "the run exceeded its time limit"),
    "memory_limit": ("MemoryLimit", "the run exceeded its memory limit"),
    "gpu_memory_limit": ("GpuMemoryLimit", "the run exceeded its GPU memory budget"),
    "output_limit": ("OutputLimit", "the run exceeded the output limit"),
    "cancelled": ("Cancelled", "the run was interrupted"),
    "rejected": ("Rejected", "the request was rejected; nothing ran"),
    "busy": ("Busy", "the appliance is busy; nothing ran"),
    "internal": ("InternalError", "the appliance failed"),
}
_STOPS = frozenset(("timeout", "cancelled"))


class ToolArgumentError(ValueError):
    """The model's arguments do not fit the tool's schema; the message is meant for the model."""


@dataclass(frozen=True)
class RunArguments:
    """run_python's arguments, checked."""

    code: str
    keep_state: bool = False
    session: str | None = None
    files: dict[str, bytes] = field(default_factory=dict)


def parse_arguments(arguments: str | Mapping[str, Any]) -> RunArguments:
    """Check a model's run_python arguments (a mapping, as MCP sends them, or a JSON string); an
    optional field may be null. ToolArgumentError names what is wrong."""
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
    keep_state = arguments.get("keep_state")
    if keep_state is None:
        keep_state = False
    if not isinstance(keep_state, bool):
        raise ToolArgumentError("'keep_state' must be true or false")
    session = arguments.get("session")
    if session is not None and not isinstance(session, str):
        raise ToolArgumentError("'session' must be a string")
    raw_files = arguments.get("files") or []
    if not isinstance(raw_files, list):
        raise ToolArgumentError("'files' must be a list of {path, content}")
    return RunArguments(code, keep_state, session, _files(raw_files))


def _files(raw_files: list[Any]) -> dict[str, bytes]:
    files: dict[str, bytes] = {}
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
    return files


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
    """What the model reads back from one call."""

    text: str
    images: list[Image]
    files: list[FileEntry]
    is_error: bool
    run: str | None = None


@dataclass(frozen=True)
class RunError:
    """Why a run did not end ok: the exception the code raised (`raised`), or its status."""

    name: str
    value: str
    traceback: list[str]
    raised: bool


@dataclass
class Outcome:
    """One run's frames, gathered as a tool result needs them."""

    status: str = "internal"
    stdout: str = ""
    stderr: str = ""
    results: list[tuple[dict[str, Any], bool]] = field(default_factory=list)  # (bundle, is the value)
    error: RunError | None = None
    files: list[FileEntry] = field(default_factory=list)
    exit_code: int | None = None
    duration_ms: int | None = None
    message: str | None = None
    session: str | None = None
    run: str | None = None
    retry_after_ms: int | None = None  # busy: when the server said to try again

    def add(self, frame: Mapping[str, Any]) -> None:
        """Take in one frame of the run."""
        kind = frame.get("type")
        if kind == "start":
            self.session = frame.get("session") or self.session
            self.run = frame.get("run")
        elif kind == "stream":
            if frame.get("name") == "stderr":
                self.stderr += frame.get("text", "")
            else:
                self.stdout += frame.get("text", "")
        elif kind in ("result", "display"):
            data = frame.get("data")
            self.results.append((dict(data) if isinstance(data, Mapping) else {}, kind == "result"))
        elif kind == "error":
            tb = frame.get("traceback")
            lines = [str(line) for line in tb] if isinstance(tb, list) else []
            self.error = RunError(str(frame.get("ename", "")), str(frame.get("evalue", "")), lines, True)
        elif kind == "file":
            self.files.append(_file_entry(frame))
        elif kind == "done":
            self._done(frame)

    def _done(self, frame: Mapping[str, Any]) -> None:
        self.status = str(frame.get("status") or "internal")
        self.exit_code = frame.get("exit_code")
        self.duration_ms = frame.get("duration_ms")
        self.message = frame.get("message")
        self.session = frame.get("session") or self.session
        self.retry_after_ms = _hint(frame)
        raised = self.error
        if self.status == "ok":
            self.error = None
        # KeyboardInterrupt under a timeout or an interrupt is the appliance's stop, not the
        # code's error: the status names it, with the traceback of where it stopped the code.
        elif raised is None or (self.status in _STOPS and raised.name == "KeyboardInterrupt"):
            name, meaning = STATUS_ERRORS.get(self.status, (self.status, f"the run ended {self.status}"))
            value = str(self.message) if self.message else meaning
            if self.status == "error" and not self.message and isinstance(self.exit_code, int):
                value = f"the code exited with code {self.exit_code}"
            self.error = RunError(name, value, raised.traceback if raised is not None else [], False)


def _file_entry(frame: Mapping[str, Any]) -> FileEntry:
    data = frame.get("data")
    try:
        blob = base64.b64decode(data, validate=True) if isinstance(data, str) else None
    except (binascii.Error, ValueError):
        blob = None  # the server's own frames carry valid base64; a bad one is "not sent"
    return FileEntry(str(frame.get("path", "")), int(frame.get("size") or 0), blob)


def tool_result(outcome: Outcome, max_chars: int = DEFAULT_MAX_CHARS, images: bool = True) -> ToolResult:
    """Turn a run's Outcome into what the model reads back.

    The text holds the status, stdout, stderr, the last result's text, the error with its last
    MAX_FRAMES frames, and the files with their sizes, in at most `max_chars` characters: the
    short, decisive parts (status, error, files) first, the streams sharing what is left, each
    cut in the middle with a `[… N characters cut …]` marker. With `images`, image/png and
    image/jpeg results and displays come back as images (and are only named in the text)."""
    if max_chars < 200:
        raise ValueError("max_chars must be at least 200: the status and markers need room")
    found_images, display_notes = _images(outcome, images)
    fixed: list[tuple[str, str]] = [("status", _status_line(outcome))]
    error = outcome.error
    if error is not None and (error.raised or error.traceback):
        fixed.append(("error", _error_text(error.name, error.value, error.traceback)))
    if outcome.files:
        fixed.append(
            (
                "files",
                "\n".join(
                    f"outputs/{f.path} ({f.size} bytes)"
                    + ("" if f.data is not None else " [not sent: too big]")
                    for f in outcome.files
                ),
            )
        )
    flexible: list[tuple[str, str]] = []
    if outcome.stdout:
        flexible.append(("stdout", outcome.stdout))
    if outcome.stderr:
        flexible.append(("stderr", outcome.stderr))
    text_result = next(
        (
            _plain(bundle)
            for bundle, is_value in reversed(outcome.results)
            if is_value
            and _plain(bundle) is not None
            and not any(m in bundle for m in _IMAGE_MIMES if images)
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
        list(outcome.files),
        is_error=outcome.status != "ok",
        run=outcome.run,
    )


def _images(outcome: Outcome, images: bool) -> tuple[list[Image], list[str]]:
    """The images a model gets (with `images`) and the notes the text has for them and for the
    displays, the cell's values first, then the figures and displays."""
    found: list[Image] = []
    notes: list[str] = []
    ordered = [r for r in outcome.results if r[1]] + [r for r in outcome.results if not r[1]]
    for bundle, is_value in ordered:
        kind = "result" if is_value else "display"
        mime = next((m for m in _IMAGE_MIMES if isinstance(bundle.get(m), str)), None)
        if mime is not None and images:
            found.append(Image(mime, bundle[mime]))
            notes.append(f"[{kind}: {mime} image #{len(found)} attached]")
        elif kind == "display":
            notes.append(_plain(bundle) or f"[display: {', '.join(sorted(bundle))}]")
    return found, notes


def _plain(bundle: Mapping[str, Any]) -> str | None:
    value = bundle.get("text/plain")
    return value if isinstance(value, str) else None


def _status_line(outcome: Outcome) -> str:
    line = f"status: {outcome.status}"
    if outcome.exit_code is not None:
        line += f", exit code {outcome.exit_code}"
    if outcome.duration_ms is not None:
        line += f", {outcome.duration_ms} ms"
    if outcome.session:
        line += f", session {outcome.session}"
    if outcome.retry_after_ms is not None:
        line += f", retry after {outcome.retry_after_ms} ms"
    if outcome.message:
        line += f"\n{outcome.message}"
    return line


def _hint(done: Mapping[str, Any]) -> int | None:
    hint = done.get("retry_after_ms")
    return hint if isinstance(hint, int) and not isinstance(hint, bool) and hint >= 0 else None


def _error_text(name: str, value: str, traceback: list[str], max_frames: int = MAX_FRAMES) -> str:
    """The exception line and the last `max_frames` frames of its traceback, without colour codes."""
    lines = _ANSI.sub("", "\n".join(traceback)).splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("  File ")]
    if len(starts) > max_frames:
        head = next(
            (line for line in lines[: starts[0]] if line.strip()), "Traceback (most recent call last):"
        )
        cut_frames = len(starts) - max_frames
        lines = [
            head,
            f"  [… {cut_frames} earlier frame{'s' if cut_frames != 1 else ''} cut …]",
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
    budgets = _fair_share(sizes, remaining - sum(overhead))
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
