"""The private channel between the server and the in-jail driver: its messages, one place.

Standard library only: the driver imports this module inside the jail (it is staged into
the runtime as `appliance.inside.channel`). Two pipes carry it:

- control (server -> driver, the driver's fd 0 at start): one *op* a line. A `run` op's
  line is a header of byte counts (`run_op`), followed on the same pipe by the bytes it
  counts: the cell's code, then each uploaded file's path and contents, as they are (the
  codec decoded them once). Every other op is one JSON object.
- events (driver -> server, the fd named in the driver's argv): one *event* a line. The two
  every cell sends are not JSON (`encode_event`): `stream` is a header of its text's byte
  count, followed by the text, and `done` is a line of numbers; every other event is one
  JSON object. The server treats every event as untrusted input: `take_event` and
  `parse_event` return only events of a known kind whose fields have the promised types,
  or None.

The wire protocol the clients speak (appliance.wire.protocol) is a different thing: the server
builds every client frame itself from these events and stamps the request id on it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any, Literal, TypedDict, cast

# Written by the server into a GPU run's working directory: the run's budget, for the
# tools (appliance.tools) to shape their work to. It enforces nothing.
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


Op = RunOp | StdinOp | StdinEofOp | InterruptOp | CudaContextOp


# What the lines of numbers may hold: ASCII digits, at most 19 (a C long; int() of a few
# thousand digits would raise, and nothing the driver counts is longer).
_COUNT = re.compile(rb"[0-9]{1,19}")
_INT = re.compile(rb"-?[0-9]{1,19}")
_DECIMAL = re.compile(rb"[0-9]{1,19}(\.[0-9]{1,9})?")
RUN = b"run"  # the first word of a `run` header; no JSON op line starts so


def run_op(code: str, files: Sequence[tuple[str, bytes]], stdin_eof: bool) -> bytes:
    """A `run` op ready to write to the control pipe: the header line
    `run STDIN_EOF CODE_BYTES [PATH_BYTES SIZE]...` in ASCII digits, then the code, then each
    file's path and contents. Counted bytes, not JSON: neither side escapes or parses the
    code, and on an idle CPU the JSON round trip cost a run ~0.08 ms of its path."""
    # surrogatepass: the codec refuses a lone surrogate; were one here, it would arrive intact.
    body = [code.encode("utf-8", "surrogatepass")]
    counts = [int(stdin_eof), len(body[0])]
    for path, data in files:
        name = path.encode("utf-8", "surrogatepass")
        body += (name, data)
        counts += (len(name), len(data))
    return b" ".join([RUN, *(b"%d" % n for n in counts)]) + b"\n" + b"".join(body)


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


def stdin_op(data: str) -> bytes:
    op: StdinOp = {"op": "stdin", "data": data}
    return encode(op)


def stdin_eof_op() -> bytes:
    op: StdinEofOp = {"op": "stdin_eof"}
    return encode(op)


def interrupt_op() -> bytes:
    op: InterruptOp = {"op": "interrupt"}
    return encode(op)


def cuda_context_op(lib: str) -> bytes:
    op: CudaContextOp = {"op": "cuda_context", "lib": lib}
    return encode(op)


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
    return None


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
EventKind = Literal["ready", "stream", "result", "display", "error", "done", "cuda_context"]


def encode(message: Op | Event) -> bytes:
    """One message as one line (UTF-8 JSON, no newline inside)."""
    return (json.dumps(message, ensure_ascii=False, separators=(",", ":"), default=str) + "\n").encode(
        "utf-8", "replace"
    )


STREAM = b"stream"
DONE = b"done"
HEADER_BYTES = 64  # the longest a `stream` header may be, its newline included
_STREAM_NAMES = (b"stdout", b"stderr")


def encode_event(event: Event) -> bytes:
    """An event as the driver writes it. `stream` and `done`, which every cell sends: on an
    idle CPU their JSON cost the run ~0.06 ms to encode in the driver and as much to decode
    in the server, each on the run's path. Text goes as UTF-8 (a lone surrogate replaced,
    as the JSON line did); a `done` field of None is written `-`."""
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
    return encode(event)


def take_event(buf: bytes | bytearray) -> int | None:
    """How many bytes at the start of buf make its first event (a line; a `stream` header
    and the text it counts), or None while they have not all come. Any count is believed
    here: the caller bounds how much it buffers."""
    end = buf.find(b"\n")
    if end < 0:
        return None
    if buf.startswith(STREAM + b" ") and end < HEADER_BYTES:
        words = bytes(buf[:end]).split()
        if len(words) == 3 and _COUNT.fullmatch(words[2]):
            whole = end + 1 + int(words[2])
            return whole if len(buf) >= whole else None
    return end + 1  # a line (a malformed header, too: its text is then read as lines)


def parse_event(line: bytes) -> Event | None:  # noqa: C901, PLR0912 (one branch per event kind of the channel, each validated)
    """One event (what `take_event` measured) from the jail, validated; None for anything
    malformed or unknown."""
    if line.startswith(STREAM + b" "):
        return _parse_stream(line)
    if line.startswith(DONE + b" "):
        return _parse_done(line)
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    kind = obj.get("ev")
    if kind == "stream":
        if obj.get("name") in ("stdout", "stderr") and isinstance(obj.get("text"), str):
            return cast(StreamEvent, {"ev": "stream", "name": obj["name"], "text": obj["text"]})
        return None
    if kind in ("result", "display"):
        return (
            cast(DataEvent, {"ev": kind, "data": obj["data"]}) if isinstance(obj.get("data"), dict) else None
        )
    if kind == "error":
        tb = obj.get("traceback")
        return cast(
            ErrorEvent,
            {
                "ev": "error",
                "ename": str(obj.get("ename", "Error")),
                "evalue": str(obj.get("evalue", "")),
                "traceback": [str(line) for line in tb] if isinstance(tb, list) else [],
                "memory": obj.get("memory") is True,
            },
        )
    if kind == "done":
        if not _is_int(obj.get("exit_code")):
            return None
        return cast(
            DoneEvent,
            {
                "ev": "done",
                "exit_code": obj["exit_code"],
                "cpu_ms": obj["cpu_ms"] if _is_int(obj.get("cpu_ms")) else None,
                "max_rss_mb": float(obj["max_rss_mb"]) if _is_number(obj.get("max_rss_mb")) else None,
                "import_ms": obj["import_ms"] if _is_int(obj.get("import_ms")) else None,
            },
        )
    if kind == "ready":
        check, failed, ms = obj.get("check"), obj.get("preload_failed"), obj.get("preload_ms")
        return cast(
            ReadyEvent,
            {
                "ev": "ready",
                "check": check if isinstance(check, dict) else {},
                "preload_failed": {str(k): str(v) for k, v in failed.items()}
                if isinstance(failed, dict)
                else {},
                "preload_ms": ms if _is_int(ms) else 0,
            },
        )
    if kind == "cuda_context":
        event: CudaContextEvent = {"ev": "cuda_context", "ok": obj.get("ok") is True}
        if isinstance(obj.get("error"), str):
            event["error"] = obj["error"]
        return event
    return None


def _parse_stream(raw: bytes) -> StreamEvent | None:
    header, _, data = raw.partition(b"\n")
    words = header.split()
    if len(words) != 3 or words[1] not in _STREAM_NAMES or not _COUNT.fullmatch(words[2]):
        return None
    if int(words[2]) != len(data):
        return None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return {"ev": "stream", "name": "stdout" if words[1] == b"stdout" else "stderr", "text": text}


def _parse_done(line: bytes) -> DoneEvent | None:
    words = line.split()
    if len(words) != 5 or not line.endswith(b"\n"):
        return None
    exit_code, cpu_ms, rss, imports = words[1:]
    if _INT.fullmatch(exit_code) is None:
        return None
    return {
        "ev": "done",
        "exit_code": int(exit_code),
        "cpu_ms": int(cpu_ms) if _COUNT.fullmatch(cpu_ms) else None,
        "max_rss_mb": float(rss) if _DECIMAL.fullmatch(rss) else None,
        "import_ms": int(imports) if _COUNT.fullmatch(imports) else None,
    }


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
