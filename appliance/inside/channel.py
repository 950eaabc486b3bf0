"""The jail's end of the private channel between the server and the in-jail driver.

Standard library only: the driver imports this module inside the jail (it is staged into
the runtime as `appliance.inside.channel`). It decodes the ops the server sends and
encodes the events the driver sends back; the server's end, and the one description of the
wire between them, is `appliance.sandbox.channel` (the host side; nothing here imports it,
and tests/test_channel.py checks that the two ends agree).

The server is trusted on this side: an op's shape is checked, not its intent.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, Literal, TypedDict, cast

# Written by the server into a GPU run's working directory: the run's budget, for the
# tools (appliance.inside.tools) to shape their work to. It enforces nothing. The server's end
# states the same name (a test checks they agree).
GRANT_FILE = ".appliance-gpu.json"


# -- ops: server -> driver ---------------------------------------------------------------


class FileHeader(TypedDict):
    path_bytes: int  # its path, UTF-8
    size: int  # its contents


class RunOp(TypedDict):
    """A `run` header: the bytes that follow it are counted here, and read by the driver."""

    op: Literal["run"]
    code_bytes: int  # the cell's code, UTF-8
    stdin_eof: bool
    files: list[FileHeader]


class StdinOp(TypedDict):
    op: Literal["stdin"]
    data: str


class StdinEofOp(TypedDict):
    op: Literal["stdin_eof"]


class InterruptOp(TypedDict):
    op: Literal["interrupt"]


class CudaContextOp(TypedDict):
    op: Literal["cuda_context"]
    lib: str


class StateOp(TypedDict):
    """`snapshot` (write the session's state to SNAPSHOT_ARCHIVE in the cwd) or `restore`
    (read it from there): done on the main thread like a cell, reported by a `display` of
    SNAPSHOT_MIME, then `done`."""

    op: Literal["snapshot", "restore"]


Op = RunOp | StdinOp | StdinEofOp | InterruptOp | CudaContextOp | StateOp

# The archive a `snapshot` writes and a `restore` reads, in the cwd, and the MIME type of the
# report; the server's end states the same (a test checks they agree).
SNAPSHOT_ARCHIVE = ".appliance-snapshot.tar"
SNAPSHOT_MIME = "application/vnd.appliance.snapshot+json"


# What the lines of numbers may hold: ASCII digits, at most 19 (a C long; int() of a few
# thousand digits would raise, and nothing the driver counts is longer).
_COUNT = re.compile(rb"[0-9]{1,19}")
RUN = b"run"  # the first word of a `run` header; no JSON op line starts so


def parse_run(line: bytes) -> RunOp | None:
    """A `run` header line, checked (its counts whole and not negative), or None."""
    words = line.split()
    if len(words) < 3 or len(words) % 2 == 0 or words[0] != RUN:
        return None
    if not all(_COUNT.fullmatch(w) for w in words[1:]):  # ASCII digits only: no sign, no space
        return None
    counts = [int(w) for w in words[1:]]
    if counts[0] not in (0, 1):
        return None
    files: list[FileHeader] = [
        {"path_bytes": counts[i], "size": counts[i + 1]} for i in range(2, len(counts), 2)
    ]
    return {"op": "run", "code_bytes": counts[1], "stdin_eof": counts[0] == 1, "files": files}


def parse_op(line: bytes) -> Op | None:
    """The driver's reading of one control line (the server is trusted; shape is checked).
    A `run` op is its header only: the bytes it counts follow on the pipe."""
    if line.startswith(RUN):
        return parse_run(line)
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("op"), str):
        return None
    op = obj["op"]
    if op == "stdin" and isinstance(obj.get("data"), str):
        return cast(StdinOp, obj)
    if op in ("stdin_eof", "interrupt"):
        return cast(Op, {"op": op})
    if op == "cuda_context" and isinstance(obj.get("lib"), str):
        return cast(CudaContextOp, obj)
    if op in ("snapshot", "restore"):
        return cast(StateOp, {"op": op})
    return None


def read_run(op: RunOp, read_exactly: Callable[[int], bytes]) -> tuple[str, list[tuple[str, bytes]]]:
    """The code and the files a `run` header counts, read from the pipe as they follow it
    (`read_exactly(n)` returns n bytes, or raises EOFError)."""
    code = read_exactly(op["code_bytes"]).decode("utf-8", "surrogatepass")
    files = [
        (read_exactly(f["path_bytes"]).decode("utf-8", "surrogatepass"), read_exactly(f["size"]))
        for f in op["files"]
    ]
    return code, files


# -- events: driver -> server ------------------------------------------------------------


class ReadyEvent(TypedDict):
    ev: Literal["ready"]
    check: dict[str, Any]  # the driver's self-check (judged by appliance.sandbox.checks)
    preload_failed: dict[str, str]  # module -> why it failed to import
    preload_ms: int


class StreamEvent(TypedDict):
    ev: Literal["stream"]
    name: Literal["stdout", "stderr"]
    text: str


class DataEvent(TypedDict):
    """`result` (the cell's last expression) or `display`: a MIME bundle."""

    ev: Literal["result", "display"]
    data: dict[str, Any]


class ErrorEvent(TypedDict):
    ev: Literal["error"]
    ename: str
    evalue: str
    traceback: list[str]
    memory: bool  # the error was a MemoryError


class DoneEvent(TypedDict):
    ev: Literal["done"]
    exit_code: int
    cpu_ms: int | None
    max_rss_mb: float | None
    import_ms: int | None  # time the cell spent loading modules not yet imported


class CudaContextEvent(TypedDict, total=False):
    ev: Literal["cuda_context"]
    ok: bool
    error: str


Event = ReadyEvent | StreamEvent | DataEvent | ErrorEvent | DoneEvent | CudaContextEvent


def _json_line(message: Event) -> bytes:
    """One event as one line (UTF-8 JSON, no newline inside)."""
    return (json.dumps(message, ensure_ascii=False, separators=(",", ":"), default=str) + "\n").encode(
        "utf-8", "replace"
    )


STREAM = b"stream"
DONE = b"done"


def encode_event(event: Event) -> bytes:
    """An event as the driver writes it. `stream` and `done`, which every cell sends, go
    without JSON, so that neither end escapes or parses the run's output on its path. Text
    goes as UTF-8 (a lone surrogate replaced, as a JSON line does); a `done` field of None
    is written `-`."""
    if event["ev"] == "stream":
        data = event["text"].encode("utf-8", "replace")
        return b"%s %s %d\n%s" % (STREAM, event["name"].encode(), len(data), data)
    if event["ev"] == "done":
        cpu, rss, imports = event["cpu_ms"], event["max_rss_mb"], event["import_ms"]
        return b"%s %d %s %s %s\n" % (
            DONE,
            event["exit_code"],
            b"-" if cpu is None else b"%d" % cpu,
            b"-" if rss is None else b"%.1f" % rss,
            b"-" if imports is None else b"%d" % imports,
        )
    return _json_line(event)
