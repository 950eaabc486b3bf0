"""The host's end of the private channel between the server and the in-jail driver.

Sans-I/O: op encoders return bytes for the caller to write, and `EventDecoder` is fed the
bytes the caller read and hands back validated events; nothing here reads, writes or waits.
The jail's end is `appliance.inside.channel` (it decodes ops and encodes events); the two
modules share no code, and tests/test_channel.py checks that they agree.

The wire (this docstring is its one description):

- control (server -> driver, the driver's fd 0 at start): one *op* a line.
  - `run`: a header line `run STDIN_EOF CODE_BYTES [PATH_BYTES SIZE]...` (ASCII digits, no
    sign; STDIN_EOF is 0 or 1), followed on the same pipe by exactly the bytes it counts:
    the cell's code (UTF-8), then each uploaded file's path (UTF-8) and contents, as they
    are. Counted bytes, not JSON: neither side escapes or parses the code.
  - every other op is one JSON object on one line: `{"op":"stdin","data":STR}`,
    `{"op":"stdin_eof"}`, `{"op":"interrupt"}`, `{"op":"cuda_context","lib":STR}`,
    `{"op":"snapshot"}`, `{"op":"restore"}` (a session's state to or from SNAPSHOT_ARCHIVE in
    the jail's cwd, done like a cell: a `display` of SNAPSHOT_MIME reports it, then `done`).
- events (driver -> server, the fd named in the driver's argv): one *event* a line.
  - `stream`: a header line `stream NAME BYTES` (NAME stdout or stderr), then exactly BYTES
    of UTF-8 text, which may hold newlines.
  - `done`: a line `done EXIT_CODE CPU_MS MAX_RSS_MB IMPORT_MS`, a field that is unknown
    written `-`.
  - every other event (`ready`, `result`, `display`, `error`, `cuda_context`, and `stream`
    or `done` as JSON too) is one JSON object on one line, its kind under `ev`.

The server trusts nothing that comes back: an event of an unknown kind, with a field of the
wrong type, a count that is not the text's, bytes that are not UTF-8 or a number too long
to be one is dropped (`EventDecoder.rejected` counts them), and input that grows past the
decoder's bound without making an event is cut off (`Oversized`).

The wire protocol the clients speak is a different thing: the server builds every client
frame itself from these events.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypedDict

# Written by the server into a GPU run's working directory: the run's budget, for the
# tools inside the jail to shape their work to. It enforces nothing. The jail's end states
# the same name (a test checks they agree).
GRANT_FILE = ".appliance-gpu.json"

# The archive the driver's `snapshot` op writes and `restore` reads, in the jail's cwd, and the
# MIME type of the `display` that reports either (appliance.inside.snapshot writes them).
SNAPSHOT_ARCHIVE = ".appliance-snapshot.tar"
SNAPSHOT_MIME = "application/vnd.appliance.snapshot+json"

HEADER_BYTES = 64  # the longest a `stream` header may be, its newline included

RUN = b"run"
STREAM = b"stream"
DONE = b"done"
_STREAM_NAMES = (b"stdout", b"stderr")
# What the lines of numbers may hold: ASCII digits, at most 19 (a C long; int() of a few
# thousand digits would raise, and nothing the driver counts is longer).
_COUNT = re.compile(rb"[0-9]{1,19}")
_INT = re.compile(rb"-?[0-9]{1,19}")
_DECIMAL = re.compile(rb"[0-9]{1,19}(\.[0-9]{1,9})?")


# -- ops: encoded here -------------------------------------------------------------------


def run_op(code: str, files: Sequence[tuple[str, bytes]], stdin_eof: bool) -> bytes:
    """A `run` op ready to write to the control pipe: its header line, then the bytes it
    counts."""
    # surrogatepass: the wire codec refuses a lone surrogate; were one here, it would arrive intact.
    body = [code.encode("utf-8", "surrogatepass")]
    counts = [int(stdin_eof), len(body[0])]
    for path, data in files:
        name = path.encode("utf-8", "surrogatepass")
        body += (name, data)
        counts += (len(name), len(data))
    return b" ".join([RUN, *(b"%d" % n for n in counts)]) + b"\n" + b"".join(body)


def stdin_op(data: str) -> bytes:
    return _json_line({"op": "stdin", "data": data})


def stdin_eof_op() -> bytes:
    return _json_line({"op": "stdin_eof"})


def interrupt_op() -> bytes:
    return _json_line({"op": "interrupt"})


def cuda_context_op(lib: str) -> bytes:
    return _json_line({"op": "cuda_context", "lib": lib})


def snapshot_op() -> bytes:
    return _json_line({"op": "snapshot"})


def restore_op() -> bytes:
    return _json_line({"op": "restore"})


def _json_line(op: dict[str, str]) -> bytes:
    # A lone surrogate (which the wire codec refuses) would be replaced, never raise here.
    return (json.dumps(op, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8", "replace")


# -- events: decoded here ----------------------------------------------------------------


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


@dataclass(frozen=True)
class Received:
    """One validated event and the bytes it took on the wire."""

    event: Event
    nbytes: int


@dataclass(frozen=True)
class Oversized:
    """An event longer than the bound, or more than the bound held without making one:
    what was held is dropped."""

    limit: int


class EventDecoder:
    """The driver's event pipe, decoded: `feed` it what was read, then take `next()` until
    it returns None. No I/O: the caller reads (and may act between two events: the process
    plumbing drains the code's stdout first, to keep program order)."""

    def __init__(self, max_event_bytes: int) -> None:
        self._buf = bytearray()
        self._max = max_event_bytes
        self.rejected = 0  # complete messages that were not a valid event

    def feed(self, data: bytes) -> None:
        self._buf += data

    def pending(self) -> int:
        """Bytes held that do not yet make an event."""
        return len(self._buf)

    def next(self) -> Received | Oversized | None:
        """The next event, `Oversized` once the bound is passed, or None until more comes."""
        limit = self._max + HEADER_BYTES  # an event's text may be as long as the bound
        while (size := take_event(self._buf)) is not None:
            raw = bytes(self._buf[:size])
            del self._buf[:size]
            if size > limit:  # whole, but only because it came in one large read
                return Oversized(self._max)
            event = parse_event(raw)
            if event is not None:
                return Received(event, size)
            self.rejected += 1
        if len(self._buf) > limit:
            self._buf.clear()
            return Oversized(self._max)
        return None


def take_event(buf: bytes | bytearray) -> int | None:
    """How many bytes at the start of buf make its first event (a line; a `stream` header
    and the text it counts), or None while they have not all come. Any count is believed
    here: the decoder bounds how much it holds."""
    end = buf.find(b"\n")
    if end < 0:
        return None
    if buf.startswith(STREAM + b" ") and end < HEADER_BYTES:
        words = bytes(buf[:end]).split()
        if len(words) == 3 and _COUNT.fullmatch(words[2]):
            whole = end + 1 + int(words[2])
            return whole if len(buf) >= whole else None
    return end + 1  # a line (a malformed header, too: its text is then read as lines)


def parse_event(raw: bytes) -> Event | None:
    """One event (what `take_event` measured) from the jail, validated; None for anything
    malformed or unknown."""
    if raw.startswith(STREAM + b" "):
        return _parse_stream(raw)
    if raw.startswith(DONE + b" "):
        return _parse_done(raw)
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    return _parse_json_event(obj)


def _parse_json_event(obj: dict[str, Any]) -> Event | None:
    kind = obj.get("ev")
    if kind == "stream":
        name, text = obj.get("name"), obj.get("text")
        if name in ("stdout", "stderr") and isinstance(text, str):
            return {"ev": "stream", "name": "stdout" if name == "stdout" else "stderr", "text": text}
        return None
    if kind in ("result", "display"):
        data = obj.get("data")
        if not isinstance(data, dict):
            return None
        return {"ev": "result", "data": data} if kind == "result" else {"ev": "display", "data": data}
    if kind == "error":
        tb = obj.get("traceback")
        return {
            "ev": "error",
            "ename": str(obj.get("ename", "Error")),
            "evalue": str(obj.get("evalue", "")),
            "traceback": [str(line) for line in tb] if isinstance(tb, list) else [],
            "memory": obj.get("memory") is True,
        }
    if kind == "done":
        return _json_done(obj)
    if kind == "ready":
        check, failed, ms = obj.get("check"), obj.get("preload_failed"), obj.get("preload_ms")
        ready: ReadyEvent = {
            "ev": "ready",
            "check": check if isinstance(check, dict) else {},
            "preload_failed": {str(k): str(v) for k, v in failed.items()} if isinstance(failed, dict) else {},
            "preload_ms": ms if isinstance(ms, int) and _is_int(ms) else 0,
        }
        return ready
    if kind == "cuda_context":
        event: CudaContextEvent = {"ev": "cuda_context", "ok": obj.get("ok") is True}
        if isinstance(obj.get("error"), str):
            event["error"] = obj["error"]
        return event
    return None


def _json_done(obj: dict[str, Any]) -> DoneEvent | None:
    exit_code, cpu, rss, imports = (
        obj.get("exit_code"),
        obj.get("cpu_ms"),
        obj.get("max_rss_mb"),
        obj.get("import_ms"),
    )
    if not isinstance(exit_code, int) or isinstance(exit_code, bool):
        return None
    return {
        "ev": "done",
        "exit_code": exit_code,
        "cpu_ms": cpu if isinstance(cpu, int) and _is_int(cpu) else None,
        "max_rss_mb": float(rss) if isinstance(rss, (int, float)) and _is_number(rss) else None,
        "import_ms": imports if isinstance(imports, int) and _is_int(imports) else None,
    }


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


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
