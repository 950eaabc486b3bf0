"""Wire protocol v1 codec: client frames in, typed messages out, server frames back.

Pure data: no I/O and no asyncio. The contract is `shared/design/protocol.md`;
this module only adds fields, never renames them.
"""

from __future__ import annotations

import base64
import binascii
import json
import secrets
from dataclasses import dataclass
from typing import Any

from appliance.errors import RequestRejected

MAX_ID_CHARS = 128
MAX_PATH_CHARS = 1024
STATUSES = (
    "ok", "error", "timeout", "memory_limit", "output_limit", "cancelled",
    "gpu_memory_limit", "rejected", "busy", "internal",
)


class ProtocolError(RequestRejected):
    """A frame that cannot be accepted; `request_id` is echoed when it could be read."""

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


@dataclass(frozen=True)
class UploadFile:
    """A file the client sends into the run's working directory."""

    path: str
    data: bytes


@dataclass(frozen=True)
class GpuRequest:
    memory_mb: int


@dataclass(frozen=True)
class ExecuteRequest:
    id: str
    code: str
    session: str | None = None
    timeout_ms: int | None = None
    files: tuple[UploadFile, ...] = ()
    gpu: GpuRequest | None = None
    stdin_eof: bool = False


@dataclass(frozen=True)
class StdinMessage:
    id: str
    data: str
    eof: bool = False


@dataclass(frozen=True)
class InterruptMessage:
    id: str


@dataclass(frozen=True)
class CloseSessionMessage:
    session: str
    id: str


ClientMessage = ExecuteRequest | StdinMessage | InterruptMessage | CloseSessionMessage


@dataclass(frozen=True)
class Limits:
    """What the codec needs to know to validate a request."""

    max_message_bytes: int
    max_upload_bytes: int
    gpu_enabled: bool = False


def new_request_id() -> str:
    """A server-made request id, for requests that carry none."""
    return "r-" + secrets.token_hex(8)


def parse_client_frame(frame: str | bytes, limits: Limits) -> ClientMessage:
    """Turn one client frame into a typed message, or raise ProtocolError naming the problem."""
    # surrogatepass: a str frame may hold lone surrogates; they are refused below, not crashed on.
    size = len(frame.encode("utf-8", "surrogatepass") if isinstance(frame, str) else frame)
    if size > limits.max_message_bytes:
        raise ProtocolError(
            f"frame of {size} bytes exceeds SANDBOX_MAX_MESSAGE_BYTES ({limits.max_message_bytes})"
        )
    try:
        obj = json.loads(frame)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"frame is not valid JSON: {exc}") from None
    except RecursionError:  # "[[[[…" nested deeper than the decoder's stack
        raise ProtocolError("frame is nested too deeply") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"frame must be a JSON object, got {_json_type(obj)}")
    request_id = _optional_id(obj)
    kind = obj.get("type", "execute")
    if not isinstance(kind, str):
        raise ProtocolError(f"'type' must be a string, got {_json_type(kind)}", request_id)
    rid = request_id or new_request_id()
    if kind == "execute":
        return _execute(obj, rid, limits)
    if kind == "stdin":
        data = obj.get("data", "")
        if not isinstance(data, str):
            raise ProtocolError(f"'data' must be a string, got {_json_type(data)}", rid)
        eof = obj.get("eof", False)
        if not isinstance(eof, bool):
            raise ProtocolError(f"'eof' must be true or false, got {_json_type(eof)}", rid)
        if request_id is None:
            raise ProtocolError("a 'stdin' frame needs the 'id' of its run", rid)
        return StdinMessage(id=request_id, data=data, eof=eof)
    if kind == "interrupt":
        if request_id is None:
            raise ProtocolError("an 'interrupt' frame needs the 'id' of its run", rid)
        return InterruptMessage(id=request_id)
    if kind == "close_session":
        session = obj.get("session")
        if not isinstance(session, str) or not session:
            raise ProtocolError("'close_session' needs a 'session' string", rid)
        return CloseSessionMessage(session=session, id=rid)
    raise ProtocolError(f"unknown type {kind!r}", rid)


def _execute(obj: dict[str, Any], rid: str, limits: Limits) -> ExecuteRequest:
    if "code" not in obj:
        raise ProtocolError("missing required field 'code'", rid)
    code = obj["code"]
    if not isinstance(code, str):
        raise ProtocolError(f"'code' must be a string, got {_json_type(code)}", rid)
    session = obj.get("session")
    if session is not None and (not isinstance(session, str) or not session):
        raise ProtocolError("'session' must be null, \"new\" or a session id", rid)
    timeout_ms = obj.get("timeout_ms")
    if timeout_ms is not None and (
        isinstance(timeout_ms, bool) or not isinstance(timeout_ms, int) or timeout_ms <= 0
    ):
        raise ProtocolError("'timeout_ms' must be a positive integer", rid)
    gpu_raw = obj.get("gpu")
    gpu = None
    if gpu_raw is not None:
        if not limits.gpu_enabled:
            raise ProtocolError("'gpu' was requested but this appliance runs without SANDBOX_GPU", rid)
        gpu = _gpu(gpu_raw, rid)
    stdin_eof = obj.get("stdin_eof", False)
    if not isinstance(stdin_eof, bool):
        raise ProtocolError("'stdin_eof' must be true or false", rid)
    return ExecuteRequest(
        id=rid, code=code, session=session, timeout_ms=timeout_ms,
        files=_files(obj.get("files"), rid, limits), gpu=gpu, stdin_eof=stdin_eof,
    )


def _gpu(raw: Any, rid: str) -> GpuRequest:
    if not isinstance(raw, dict):
        raise ProtocolError("'gpu' must be an object like {\"memory_mb\": 2048}", rid)
    mb = raw.get("memory_mb")
    if isinstance(mb, bool) or not isinstance(mb, int) or mb <= 0:
        raise ProtocolError("'gpu.memory_mb' must be a positive integer", rid)
    return GpuRequest(memory_mb=mb)


def _files(raw: Any, rid: str, limits: Limits) -> tuple[UploadFile, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise ProtocolError("'files' must be a list of {path, data} objects", rid)
    out: list[UploadFile] = []
    total = 0
    seen: set[str] = set()
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise ProtocolError(f"files[{i}] must be an object", rid)
        path = item.get("path")
        if not isinstance(path, str):
            raise ProtocolError(f"files[{i}].path must be a string", rid)
        reason = upload_path_problem(path)
        if reason:
            raise ProtocolError(f"files[{i}].path {path!r} is refused: {reason}", rid)
        data = item.get("data", "")
        if not isinstance(data, str):
            raise ProtocolError(f"files[{i}].data must be a base64 string", rid)
        try:
            blob = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise ProtocolError(f"files[{i}].data is not valid base64", rid) from None
        total += len(blob)
        if total > limits.max_upload_bytes:
            raise ProtocolError(
                f"files total more than SANDBOX_MAX_UPLOAD_BYTES ({limits.max_upload_bytes})", rid
            )
        norm = "/".join(p for p in path.split("/") if p not in ("", "."))
        if norm in seen:
            raise ProtocolError(f"files[{i}].path {path!r} appears twice", rid)
        seen.add(norm)
        out.append(UploadFile(path=norm, data=blob))
    return tuple(out)


def upload_path_problem(path: str) -> str | None:
    """Why a client-supplied relative path is unsafe, or None if it is fine."""
    if not path or len(path) > MAX_PATH_CHARS:
        return "empty or too long"
    if "\x00" in path:
        return "contains a NUL byte"
    if any("\ud800" <= c <= "\udfff" for c in path):
        return "is not valid UTF-8 (lone surrogate)"
    if path.startswith("/"):
        return "absolute paths are not allowed"
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if not parts:
        return "names no file"
    if any(p == ".." for p in parts):
        return "'..' climbs out of the working directory"
    if any(len(p.encode()) > 255 for p in parts):
        return "a path component is longer than 255 bytes"
    return None


def _optional_id(obj: dict[str, Any]) -> str | None:
    rid = obj.get("id")
    if rid is None:
        return None
    if not isinstance(rid, str) or not rid or len(rid) > MAX_ID_CHARS or not rid.isprintable():
        raise ProtocolError(f"'id' must be a printable string of 1-{MAX_ID_CHARS} characters")
    return rid


def _json_type(value: Any) -> str:
    return {
        dict: "object", list: "array", str: "string", int: "number", float: "number",
        bool: "boolean", type(None): "null",
    }.get(type(value), type(value).__name__)


# ---- server -> client frames -------------------------------------------------------------

Frame = dict[str, Any]


def encode(frame: Frame) -> str:
    """Serialize a server frame to the text of one WebSocket message."""
    return json.dumps(frame, ensure_ascii=False, separators=(",", ":"))


def start_frame(
    rid: str, run: str, session: str | None, queued_ms: int, timeout_ms: int,
    gpu: dict[str, Any] | None = None,
) -> Frame:
    return {"type": "start", "id": rid, "run": run, "session": session,
            "queued_ms": queued_ms, "gpu": gpu, "timeout_ms": timeout_ms}


def stream_frame(rid: str, name: str, text: str) -> Frame:
    return {"type": "stream", "id": rid, "name": name, "text": text}


def display_frame(rid: str, data: dict[str, Any]) -> Frame:
    return {"type": "display", "id": rid, "data": data}


def result_frame(rid: str, data: dict[str, Any]) -> Frame:
    return {"type": "result", "id": rid, "data": data}


def error_frame(rid: str, ename: str, evalue: str, traceback: list[str]) -> Frame:
    return {"type": "error", "id": rid, "ename": ename, "evalue": evalue, "traceback": traceback}


def file_frame(rid: str, path: str, size: int, data: str | None, message: str | None = None) -> Frame:
    frame: Frame = {"type": "file", "id": rid, "path": path, "size": size, "data": data}
    if message:
        frame["message"] = message
    return frame


def done_frame(
    rid: str, status: str, *, exit_code: int | None = None, duration_ms: int = 0,
    cpu_ms: int | None = None, max_rss_mb: float | None = None, message: str | None = None,
    session: str | None = None,
) -> Frame:
    assert status in STATUSES, status
    frame: Frame = {
        "type": "done", "id": rid, "status": status, "exit_code": exit_code,
        "duration_ms": duration_ms, "cpu_ms": cpu_ms, "max_rss_mb": max_rss_mb,
        "message": message,
    }
    if session is not None:
        frame["session"] = session
    return frame
