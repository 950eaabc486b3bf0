"""Wire protocol v1 codec: client frames in, typed messages out, server frames back.

Pure data: no I/O and no asyncio. The prose is `docs/protocol.md`;
this module only adds fields, never renames them.

The messages are typed models and are the single source of the published schemas
(`appliance.wire.openapi` generates the OpenAPI document and `docs/protocol.schema.json`
from them):

- client -> server: pydantic dataclasses (`ExecuteRequest`, `StdinMessage`, ...). The
  validation itself runs in pydantic-core; only the checks no schema can say (a path that
  climbs out, base64, the upload budget, GPU mode) are Python validators, and they run only
  when the frame carries those fields.
- server -> client: `TypedDict`s (`StreamFrame`, `DoneFrame`, ...). The builders return
  plain dicts and `encode` serializes them in pydantic-core. Tests check every builder
  against its TypedDict's schema.
"""

# No `from __future__ import annotations` here: on Python 3.11 a TypedDict only knows which
# keys are NotRequired when its annotations are real objects, not strings.
import base64
import binascii
import json
import re
import secrets
from dataclasses import dataclass
from typing import Annotated, Any, Literal, NotRequired, Protocol, get_args

import pydantic_core
from pydantic import (
    AfterValidator,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainValidator,
    StrictBool,
    StrictInt,
    StrictStr,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
)
from pydantic.dataclasses import dataclass as model
from pydantic_core import PydanticCustomError
from typing_extensions import TypedDict  # pydantic needs this one on Python < 3.12

from appliance.core.egress import parse_rule
from appliance.core.errors import RequestRejected

MAX_ID_CHARS = 128
MAX_PATH_CHARS = 1024
Status = Literal[
    "ok",
    "error",
    "timeout",
    "memory_limit",
    "output_limit",
    "cancelled",
    "gpu_memory_limit",
    "rejected",
    "busy",
    "internal",
]
STATUSES: tuple[str, ...] = get_args(Status)


class ProtocolError(RequestRejected):
    """A frame that cannot be accepted; `request_id` is echoed when it could be read."""

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


class LimitSettings(Protocol):
    """The settings a codec needs (structural, so this layer never imports settings)."""

    @property
    def max_message_bytes(self) -> int: ...
    @property
    def max_upload_bytes(self) -> int: ...
    @property
    def gpu(self) -> bool: ...
    @property
    def max_upload_files(self) -> int: ...


@dataclass(frozen=True)
class Limits:
    """What the codec needs to know to validate a request."""

    max_message_bytes: int
    max_upload_bytes: int
    gpu_enabled: bool = False
    max_upload_files: int = 1000

    @classmethod
    def from_settings(cls, settings: LimitSettings) -> "Limits":
        """The one place that turns settings into codec limits (every transport uses it)."""
        return cls(
            settings.max_message_bytes,
            settings.max_upload_bytes,
            gpu_enabled=settings.gpu,
            max_upload_files=settings.max_upload_files,
        )


def new_request_id() -> str:
    """A server-made request id, for requests that carry none."""
    return "r-" + secrets.token_hex(8)


# ---- client -> server messages -------------------------------------------------------------
# Python validators raise PydanticCustomError; `_rejection` turns every error into the
# protocol's own message, so a client reads the same words whichever check refused it.


def _is_id(value: object) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_ID_CHARS and value.isprintable()


def _request_id(value: object) -> str:
    if isinstance(value, str) and _is_id(value):
        return value
    raise PydanticCustomError("bad_id", "not a printable string of 1-{n} characters", {"n": MAX_ID_CHARS})


def _request_id_or_new(value: object) -> str:
    return new_request_id() if value is None else _request_id(value)


_ID_SCHEMA = {
    "type": "string",
    "minLength": 1,
    "maxLength": MAX_ID_CHARS,
    "description": "Printable characters; every reply to this request carries it.",
}
# A run's id as the client chose it (stdin, interrupt: required, since they address a run).
RequestId = Annotated[str, PlainValidator(_request_id), WithJsonSchema(_ID_SCHEMA)]
# An id the server makes when the client sends none (or null).
OptionalRequestId = Annotated[
    str,
    PlainValidator(_request_id_or_new),
    WithJsonSchema(
        {"anyOf": [_ID_SCHEMA, {"type": "null"}], "description": "Omitted or null: the server makes one."}
    ),
]


def _safe_path(path: str) -> str:
    reason = upload_path_problem(path)
    if reason:
        raise PydanticCustomError("path_refused", "{reason}", {"reason": reason})
    return "/".join(p for p in path.split("/") if p not in ("", "."))


def _upload_data(value: object) -> bytes:
    """Base64 text from the wire, decoded once here; raw bytes from code that builds a request."""
    if isinstance(value, bytes):
        return value
    if not isinstance(value, str):
        raise PydanticCustomError("data_type", "must be a base64 string")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise PydanticCustomError("base64", "is not valid base64") from None


_CONFIG = ConfigDict(frozen=True, extra="ignore")


@model(config=_CONFIG)
class UploadFile:
    """A file the client sends into the run's working directory."""

    path: Annotated[
        StrictStr,
        AfterValidator(_safe_path),
        Field(description="Relative to the working directory; absolute paths, '..' and links are refused."),
    ]
    data: Annotated[
        bytes,
        PlainValidator(_upload_data),
        WithJsonSchema({"type": "string", "contentEncoding": "base64", "default": ""}),
    ] = b""


@model(config=_CONFIG)
class GpuRequest:
    """The GPU share a run asks for (only with SANDBOX_GPU=1)."""

    memory_mb: Annotated[StrictInt, Field(ge=1, description="Device memory, in MiB.")]


MAX_EGRESS_RULES = 100  # a request's own allowlist; it only narrows the server's


@model(config=_CONFIG)
class EgressRequest:
    """What this run may reach by name, within the server's and its tenant's allowlists
    (names mode, SANDBOX_EGRESS_ALLOW_DOMAINS): it can only narrow them."""

    allow: Annotated[
        tuple[Annotated[StrictStr, Field(max_length=300)], ...] | None, Field(max_length=MAX_EGRESS_RULES)
    ] = Field(
        default=None,
        description='`host:port` rules like "api.example.com:443" or "*.pypi.org:443". Omitted: the '
        "run is not narrowed (with `ask`: every host is asked about).",
    )
    ask: StrictBool = Field(
        default=False,
        description="Live approval: a connection to a host this list leaves out (within the server's "
        "and the tenant's lists) waits for the client's `egress_decision` to an `egress_request` frame, "
        "instead of being refused. Only a WebSocket client can answer.",
    )

    @field_validator("allow", mode="after")
    @classmethod
    def _rules(cls, allow: tuple[str, ...] | None) -> tuple[str, ...] | None:
        for i, entry in enumerate(allow or ()):
            try:
                parse_rule(entry)
            except ValueError as exc:
                raise PydanticCustomError(
                    "egress_rule",
                    "egress.allow[{i}] {entry} {why}",
                    {"i": i, "entry": repr(entry), "why": str(exc)},
                ) from None
        return allow


def _files_or_empty(value: object) -> object:
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise PydanticCustomError("files_type", "must be a list of {path, data} objects")
    return value


@model(config=_CONFIG, kw_only=True)
class ExecuteRequest:
    """Run code. Only `code` is required."""

    id: OptionalRequestId = Field(default_factory=new_request_id)
    code: StrictStr = Field(description="Python source to run.")
    session: Annotated[StrictStr, Field(min_length=1)] | None = Field(
        default=None, description='Omit for a one-shot run; "new" opens a session; a session id continues it.'
    )
    timeout_ms: Annotated[StrictInt, Field(ge=1)] | None = Field(
        default=None, description="Lowers SANDBOX_MAX_EXEC_MS for this run, never raises it."
    )
    files: Annotated[
        tuple[UploadFile, ...],
        BeforeValidator(_files_or_empty, json_schema_input_type=list[UploadFile] | None),
    ] = Field(default=(), description="Written into the working directory before the code starts.")
    gpu: GpuRequest | None = Field(default=None, description="Only valid with SANDBOX_GPU=1.")
    egress: EgressRequest | None = Field(
        default=None,
        description="Narrows the hosts this run may reach by name (SANDBOX_EGRESS_ALLOW_DOMAINS).",
    )
    stdin_eof: StrictBool = Field(default=False, description="The run's stdin is closed from the start.")
    memory_mb: Annotated[StrictInt, Field(ge=1)] | None = Field(
        default=None,
        description="Lowers SANDBOX_MEMORY_MB (the run's cgroup) for this run or the session it opens, never raises it.",
    )
    from_snapshot: Annotated[StrictStr, Field(min_length=1, max_length=128)] | None = Field(
        default=None,
        description='With "session": "new" (or POST /v1/sessions): the new session starts from this snapshot '
        "(its files and globals), with its GPU budget.",
    )
    type: Literal["execute"] = "execute"

    @field_validator("gpu", mode="before")
    @classmethod
    def _gpu_mode(cls, value: object, info: ValidationInfo) -> object:
        limits = info.context
        if value is not None and isinstance(limits, Limits) and not limits.gpu_enabled:
            raise PydanticCustomError(
                "gpu_off", "'gpu' was requested but this appliance runs without SANDBOX_GPU"
            )
        if value is not None and not isinstance(value, (dict, GpuRequest)):
            raise PydanticCustomError("gpu_type", "'gpu' must be an object like {\"memory_mb\": 2048}")
        return value

    @field_validator("files", mode="after")
    @classmethod
    def _upload_budget(cls, files: tuple[UploadFile, ...], info: ValidationInfo) -> tuple[UploadFile, ...]:
        limits = info.context
        seen: set[str] = set()
        total = 0
        for i, item in enumerate(files):
            total += len(item.data)
            if isinstance(limits, Limits) and total > limits.max_upload_bytes:
                raise PydanticCustomError(
                    "rejected",
                    "files total more than SANDBOX_MAX_UPLOAD_BYTES ({n})",
                    {"n": limits.max_upload_bytes},
                )
            if item.path in seen:
                raise PydanticCustomError("duplicate", "files[{i}] names a path already given", {"i": i})
            seen.add(item.path)
        return files


@model(config=_CONFIG)
class StdinMessage:
    """Feed a running request's stdin."""

    id: RequestId
    data: StrictStr = ""
    eof: StrictBool = Field(default=False, description="Close stdin after this data.")
    type: Literal["stdin"] = "stdin"


@model(config=_CONFIG)
class InterruptMessage:
    """Stop a running request (its done status is `cancelled`)."""

    id: RequestId
    type: Literal["interrupt"] = "interrupt"


@model(config=_CONFIG)
class CloseSessionMessage:
    """End a session and its jail."""

    session: Annotated[StrictStr, Field(min_length=1)]
    id: OptionalRequestId = Field(default_factory=new_request_id)
    type: Literal["close_session"] = "close_session"


def _request_id_or_none(value: object) -> str | None:
    return None if value is None else _request_id(value)


# An id a client may give; omitted or null, the reply uses another (`AttachMessage`).
MaybeRequestId = Annotated[
    str | None,
    PlainValidator(_request_id_or_none),
    WithJsonSchema({"anyOf": [_ID_SCHEMA, {"type": "null"}]}),
]
MAX_SEQ = 2**53 - 1  # the largest integer every JSON reader holds exactly


@model(config=_CONFIG)
class AttachMessage:
    """Follow a run again, from any connection of the same tenant: its kept frames whose
    `seq` is above `after`, then the live ones, ending with its `done`."""

    run: Annotated[
        StrictStr, Field(min_length=1, max_length=MAX_ID_CHARS, description="A start frame's `run`.")
    ]
    after: Annotated[StrictInt, Field(ge=-1, le=MAX_SEQ)] = Field(
        default=-1, description="The last seq the client has; -1 (the default): from the first frame."
    )
    id: MaybeRequestId = Field(
        default=None,
        description="The id the run's frames carry on this connection (and stdin/interrupt take); "
        "omitted: the run's own request id.",
    )
    type: Literal["attach"] = "attach"


@model(config=_CONFIG)
class EgressDecisionMessage:
    """Answer an `egress_request`: the waiting connection goes on (`allow`) or is refused."""

    flow: Annotated[
        StrictStr,
        Field(min_length=1, max_length=MAX_ID_CHARS, description="The egress_request frame's `flow`."),
    ]
    allow: StrictBool
    scope: Literal["run", "session"] = Field(
        default="run",
        description='"run": the answer holds for this run\'s later connections to the same host and '
        'port; "session": for the session\'s later cells too.',
    )
    id: MaybeRequestId = Field(
        default=None,
        description="Names this decision: a refusal (`done` `rejected`) carries it; omitted: a server-made one.",
    )
    type: Literal["egress_decision"] = "egress_decision"


ClientMessage = (
    ExecuteRequest
    | StdinMessage
    | InterruptMessage
    | CloseSessionMessage
    | AttachMessage
    | EgressDecisionMessage
)
CLIENT_MESSAGES: dict[str, type[ClientMessage]] = {
    "execute": ExecuteRequest,
    "stdin": StdinMessage,
    "interrupt": InterruptMessage,
    "close_session": CloseSessionMessage,
    "attach": AttachMessage,
    "egress_decision": EgressDecisionMessage,
}
_ADAPTERS: dict[str, TypeAdapter[Any]] = {kind: TypeAdapter(cls) for kind, cls in CLIENT_MESSAGES.items()}
# When a frame has several problems, name the one the protocol checks first.
_FIELD_ORDER = {
    "execute": ("code", "session", "timeout_ms", "gpu", "stdin_eof", "memory_mb", "from_snapshot", "files"),
    "stdin": ("data", "eof", "id"),
    "interrupt": ("id",),
    "close_session": ("session",),
    "attach": ("run", "after", "id"),
    "egress_decision": ("flow", "allow", "scope", "id"),
}


def check_size(frame: str | bytes, limits: Limits) -> None:
    """ProtocolError if the frame is over SANDBOX_MAX_MESSAGE_BYTES: checked before any parsing."""
    # surrogatepass: a str frame may hold lone surrogates; they are refused later, not crashed on.
    size = len(frame.encode("utf-8", "surrogatepass") if isinstance(frame, str) else frame)
    if size > limits.max_message_bytes:
        raise ProtocolError(
            f"frame of {size} bytes exceeds SANDBOX_MAX_MESSAGE_BYTES ({limits.max_message_bytes})"
        )


def parse_client_frame(frame: str | bytes, limits: Limits) -> ClientMessage:
    """Turn one client frame into a typed message, or raise ProtocolError naming the problem."""
    check_size(frame, limits)
    # The stdlib decoder, not pydantic's: what counts as JSON on the wire stays exactly as it was.
    try:
        obj = json.loads(frame)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"frame is not valid JSON: {exc}") from None
    except RecursionError:  # "[[[[…" nested deeper than the decoder's stack
        raise ProtocolError("frame is nested too deeply") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"frame must be a JSON object, got {_json_type(obj)}")
    return parse_client_frame_object(obj, limits)


def parse_client_frame_object(obj: dict[str, Any], limits: Limits) -> ClientMessage:
    """parse_client_frame for a frame already decoded (MCP's tool calls build theirs in the
    server): the same checks, messages and limits, but the frame size, which the caller bounds."""
    kind = obj.get("type", "execute")
    files = obj.get("files")
    # Counted before any validation: per entry, validation costs far more than decoding did.
    if kind == "execute" and isinstance(files, list) and len(files) > limits.max_upload_files:
        raise ProtocolError(
            f"'files' has {len(files)} entries; SANDBOX_MAX_UPLOAD_FILES allows {limits.max_upload_files}",
            _optional_id(obj),
        )
    if kind == "execute":
        plain = _plain_execute(obj)
        if plain is not None:
            return plain
    adapter = _ADAPTERS.get(kind) if isinstance(kind, str) else None
    if adapter is None:
        request_id = _optional_id(obj)
        if not isinstance(kind, str):
            raise ProtocolError(f"'type' must be a string, got {_json_type(kind)}", request_id)
        raise ProtocolError(f"unknown type {kind!r}", request_id or new_request_id())
    try:
        message: ClientMessage = adapter.validate_python(obj, context=limits)
    except ValidationError as exc:
        raise _rejection(kind, exc, obj) from None
    return message


# What an execute request without uploads, GPU, egress or snapshot carries: fields whose every
# check is a type and a bound, made here without pydantic (`_plain_execute`).
_PLAIN_EXECUTE = frozenset(("type", "id", "code", "session", "timeout_ms", "stdin_eof", "memory_mb"))


def _positive_int_or_none(value: object) -> bool:
    return value is None or (type(value) is int and value >= 1)


def _plain_execute(obj: dict[str, Any]) -> ExecuteRequest | None:
    """The ExecuteRequest validation makes of obj when obj holds only plain fields, all valid
    (what nearly every run sends); None for anything else, which the full validation then
    accepts or names the problem of. Each check is the one the field's type makes (StrictStr,
    StrictInt >= 1, StrictBool, the id's rule); tests/test_protocol_plain.py holds the two
    paths to the same answer. Why: a warm run's frame meets a cold CPU, where the validator's
    first use costs far more than these checks (benchmarks/results/house-ab.md)."""
    if not obj.keys() <= _PLAIN_EXECUTE:
        return None
    rid = obj.get("id")
    code = obj.get("code")
    session = obj.get("session")
    stdin_eof = obj.get("stdin_eof", False)
    if (
        type(code) is not str
        or (rid is not None and not _is_id(rid))
        # min_length=1; and a lone surrogate, which validation refuses, cannot be in ASCII.
        or (session is not None and (type(session) is not str or not session or not session.isascii()))
        or not _positive_int_or_none(obj.get("timeout_ms"))
        or not _positive_int_or_none(obj.get("memory_mb"))
        or type(stdin_eof) is not bool
    ):
        return None
    message = object.__new__(ExecuteRequest)
    # Filled as validation fills a frozen dataclass: every field, in declaration order.
    message.__dict__.update(
        id=new_request_id() if rid is None else rid,
        code=code,
        session=session,
        timeout_ms=obj.get("timeout_ms"),
        files=(),
        gpu=None,
        egress=None,
        stdin_eof=stdin_eof,
        memory_mb=obj.get("memory_mb"),
        from_snapshot=None,
        type="execute",
    )
    return message


def _rejection(kind: str, exc: ValidationError, obj: dict[str, Any]) -> ProtocolError:
    """The protocol's message for the first problem (in the order the protocol names them)."""
    request_id = _optional_id(obj)  # a bad id is named first, and cannot be echoed
    rid = request_id or new_request_id()
    order = _FIELD_ORDER[kind]
    errors = exc.errors(include_url=False)
    first = min(
        errors, key=lambda e: order.index(e["loc"][0]) if e["loc"] and e["loc"][0] in order else len(order)
    )
    return ProtocolError(_message(kind, first, obj), rid)


def _message(kind: str, err: Any, obj: dict[str, Any]) -> str:  # noqa: C901, PLR0912 (one message per pydantic error type a client can cause)
    loc: tuple[int | str, ...] = err["loc"]
    field = loc[0] if loc else ""
    custom = err["type"] in ("gpu_off", "gpu_type", "rejected")
    if custom:
        return str(err["msg"])
    if kind == "execute":
        if field == "code":
            if err["type"] == "missing":
                return "missing required field 'code'"
            return f"'code' must be a string, got {_json_type(obj['code'])}"
        if field == "session":
            return "'session' must be null, \"new\" or a session id"
        if field == "timeout_ms":
            return "'timeout_ms' must be a positive integer"
        if field == "gpu":
            if len(loc) > 1:
                return "'gpu.memory_mb' must be a positive integer"
            return "'gpu' must be an object like {\"memory_mb\": 2048}"
        if field == "stdin_eof":
            return "'stdin_eof' must be true or false"
        if field == "memory_mb":
            return "'memory_mb' must be a positive integer (MiB)"
        if field == "from_snapshot":
            return "'from_snapshot' must be a snapshot id (a string)"
        if field == "files":
            return _file_message(loc, err, obj)
    if kind == "stdin":
        if field == "data":
            return f"'data' must be a string, got {_json_type(obj['data'])}"
        if field == "eof":
            return f"'eof' must be true or false, got {_json_type(obj['eof'])}"
        return "a 'stdin' frame needs the 'id' of its run"
    if kind == "interrupt":
        return "an 'interrupt' frame needs the 'id' of its run"
    if kind == "close_session":
        return "'close_session' needs a 'session' string"
    if kind == "attach":
        if field == "after":
            return f"'after' must be an integer from -1 to {MAX_SEQ}"
        return f"'attach' needs a 'run' string of 1-{MAX_ID_CHARS} characters (a start frame's run)"
    if kind == "egress_decision":
        if field == "allow":
            return "'egress_decision' needs 'allow': true or false"
        if field == "scope":
            return '\'scope\' must be "run" or "session"'
        if field == "id":
            return f"'id' must be a printable string of 1-{MAX_ID_CHARS} characters"
        return f"'egress_decision' needs a 'flow' string of 1-{MAX_ID_CHARS} characters (an egress_request's flow)"
    return f"{'.'.join(map(str, loc)) or 'frame'}: {err['msg']}"  # not reached by any known frame


def _file_message(loc: tuple[int | str, ...], err: Any, obj: dict[str, Any]) -> str:
    if err["type"] == "duplicate":  # named as the client wrote it, not as normalised
        i = err["ctx"]["i"]
        return f"files[{i}].path {obj['files'][i]['path']!r} appears twice"
    if len(loc) == 1:
        return "'files' must be a list of {path, data} objects"
    at = f"files[{loc[1]}]"
    if len(loc) == 2:
        return f"{at} must be an object"
    if loc[2] == "path":
        if err["type"] == "path_refused":
            return f"{at}.path {err['input']!r} is refused: {err['ctx']['reason']}"
        return f"{at}.path must be a string"
    if err["type"] == "base64":
        return f"{at}.data is not valid base64"
    return f"{at}.data must be a base64 string"


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
    if not _is_id(rid):
        raise ProtocolError(f"'id' must be a printable string of 1-{MAX_ID_CHARS} characters")
    return str(rid)


def _json_type(value: Any) -> str:
    return {
        dict: "object",
        list: "array",
        str: "string",
        int: "number",
        float: "number",
        bool: "boolean",
        type(None): "null",
    }.get(type(value), type(value).__name__)


# ---- server -> client frames ---------------------------------------------------------------
# Frames are plain dicts, made only in the api layer: from the core's events
# (appliance.api.frames, through these builders) and for what it refuses itself. These
# TypedDicts say their shape, for the schemas, the client and the tests.

MimeBundle = Annotated[
    dict[str, Any],
    Field(
        description="MIME type -> value, as Jupyter shows it: text/plain, text/html, image/png (base64), ..."
    ),
]


Seq = Annotated[
    int,
    Field(
        ge=0,
        description="The frame's place among its run's frames: 0, 1, 2, ... (`attach` resumes after one). "
        "A `done` that answers a frame refused before any run (it did not parse, an attach to no "
        "such run) has none.",
    ),
]


class GpuGrant(TypedDict):
    """The GPU share a run was granted."""

    index: int
    uuid: str
    memory_mb: int


class StartFrame(TypedDict):
    """The run got a jail."""

    type: Literal["start"]
    id: str
    run: str
    session: str | None
    queued_ms: int
    gpu: GpuGrant | None
    timeout_ms: int
    seq: NotRequired[Seq]


class StreamFrame(TypedDict):
    """Output, as the code writes it (every byte it prints travels inside `text`)."""

    type: Literal["stream"]
    id: str
    name: Literal["stdout", "stderr"]
    text: str
    seq: NotRequired[Seq]


class DisplayFrame(TypedDict):
    """A figure or rich object was shown."""

    type: Literal["display"]
    id: str
    data: MimeBundle
    seq: NotRequired[Seq]


class ResultFrame(TypedDict):
    """The value of the cell's last expression."""

    type: Literal["result"]
    id: str
    data: MimeBundle
    seq: NotRequired[Seq]


class ErrorFrame(TypedDict):
    """The code raised."""

    type: Literal["error"]
    id: str
    ename: str
    evalue: str
    traceback: list[str]
    seq: NotRequired[Seq]


class FileFrame(TypedDict):
    """A file the run wrote under `outputs/`; `data` is null (with a `message`) when it was too big."""

    type: Literal["file"]
    id: str
    path: str
    size: int
    data: Annotated[str | None, Field(json_schema_extra={"contentEncoding": "base64"})]
    message: NotRequired[str]
    seq: NotRequired[Seq]


class EgressFlow(TypedDict):
    """One connection a run asked the egress proxy for (names mode), in `done.egress`."""

    host: str
    port: int
    decision: Literal["allowed", "denied", "failed"]
    rule: NotRequired[str]  # the server's rule that allowed it ("address rules" for an IP literal)
    why: NotRequired[str]  # why it was denied, or could not be reached
    address: NotRequired[str]  # the checked address it went to
    asked: NotRequired[str]  # the egress_request's flow id, when the client was asked
    bytes_up: int
    bytes_down: int
    duration_ms: int
    injected: NotRequired[list[str]]  # the secret headers the proxy set (names, never values)


class DoneFrame(TypedDict):
    """Always last for a request, exactly once."""

    type: Literal["done"]
    id: str
    status: Status
    exit_code: int | None
    duration_ms: int
    cpu_ms: int | None
    max_rss_mb: float | None
    message: str | None
    session: NotRequired[str]
    import_ms: NotRequired[int]  # time the cell spent loading modules its jail had not imported
    files_skipped: NotRequired[int]  # outputs/ files not returned: past SANDBOX_MAX_OUTPUTS_BYTES
    retry_after_ms: NotRequired[int]  # with status busy: when to try again (the server's estimate)
    seq: NotRequired[Seq]
    egress: NotRequired[list[EgressFlow]]  # names mode: the run's flows through the egress proxy
    egress_omitted: NotRequired[int]  # flows past the ledger's bound, counted only


class EgressFrame(TypedDict):
    """A connection the run asked the egress proxy for was refused, as it happens."""

    type: Literal["egress"]
    id: str
    host: str
    port: int
    decision: Literal["denied"]
    why: str
    seq: NotRequired[Seq]


class EgressRequestFrame(TypedDict):
    """A connection to a host the request's allowlist leaves out waits for the client's
    `egress_decision` (`"egress": {"ask": true}`); unanswered within `timeout_ms`, it is refused."""

    type: Literal["egress_request"]
    id: str
    flow: str  # what the egress_decision names
    host: str
    port: int
    timeout_ms: int  # SANDBOX_EGRESS_ASK_MS
    seq: NotRequired[Seq]


ServerFrame = (
    StartFrame
    | StreamFrame
    | DisplayFrame
    | ResultFrame
    | ErrorFrame
    | FileFrame
    | EgressFrame
    | EgressRequestFrame
    | DoneFrame
)
SERVER_FRAMES: dict[str, type[Any]] = {
    "start": StartFrame,
    "stream": StreamFrame,
    "display": DisplayFrame,
    "result": ResultFrame,
    "error": ErrorFrame,
    "file": FileFrame,
    "egress": EgressFrame,
    "egress_request": EgressRequestFrame,
    "done": DoneFrame,
}


class SessionOpened(TypedDict):
    """REST: `POST /v1/sessions` succeeded."""

    session: str
    frames: list[ServerFrame]


class HttpError(TypedDict):
    """REST: a refusal that is not about a request (auth, an unknown session or snapshot)."""

    error: str
    status: NotRequired[str]  # a done status naming the kind of refusal (`rejected`, `busy`, ...)


class Snapshot(TypedDict):
    """REST: a kept snapshot (`POST /v1/sessions/{id}/snapshot`, `GET /v1/snapshots/{id}`)."""

    snapshot: str  # its id
    bytes: int  # its size as kept
    skipped: list[str]  # "name: why" for each global that did not pickle, each file not kept
    created: float  # Unix time
    gpu_memory_mb: int  # the session's GPU budget (0: none); a restore asks for it again
    profile: str  # the session's preload profile


Frame = dict[str, Any]


def encode(frame: Frame) -> str:
    """Serialize a server frame to the text of one WebSocket message."""
    try:
        return pydantic_core.to_json(frame).decode()
    except pydantic_core.PydanticSerializationError:
        # Text that is not valid Unicode (a lone surrogate): the driver already replaces them,
        # but encoding must never fail a frame, so escape them as JSON \u escapes instead.
        return json.dumps(frame, ensure_ascii=True, separators=(",", ":"))


def start_frame(  # noqa: PLR0913 (one argument per field of the frame)
    rid: str,
    run: str,
    session: str | None,
    queued_ms: int,
    timeout_ms: int,
    gpu: dict[str, Any] | None = None,
) -> Frame:
    return {
        "type": "start",
        "id": rid,
        "run": run,
        "session": session,
        "queued_ms": queued_ms,
        "gpu": gpu,
        "timeout_ms": timeout_ms,
    }


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


def done_frame(  # noqa: PLR0913 (one argument per field of the frame)
    rid: str,
    status: str,
    *,
    exit_code: int | None = None,
    duration_ms: int = 0,
    cpu_ms: int | None = None,
    max_rss_mb: float | None = None,
    message: str | None = None,
    session: str | None = None,
    import_ms: int | None = None,
    files_skipped: int | None = None,
    retry_after_ms: int | None = None,
    egress: list[dict[str, Any]] | None = None,
    egress_omitted: int | None = None,
) -> Frame:
    if status not in STATUSES:
        raise ValueError(f"unknown done status {status!r}")
    frame: Frame = {
        "type": "done",
        "id": rid,
        "status": status,
        "exit_code": exit_code,
        "duration_ms": duration_ms,
        "cpu_ms": cpu_ms,
        "max_rss_mb": max_rss_mb,
        "message": message,
    }
    if session is not None:
        frame["session"] = session
    if import_ms is not None:
        frame["import_ms"] = import_ms
    if files_skipped:
        frame["files_skipped"] = files_skipped
    if retry_after_ms is not None:
        frame["retry_after_ms"] = retry_after_ms
    if egress is not None:
        frame["egress"] = egress
    if egress_omitted:
        frame["egress_omitted"] = egress_omitted
    return frame


def egress_frame(rid: str, host: str, port: int, why: str) -> Frame:
    return {"type": "egress", "id": rid, "host": host, "port": port, "decision": "denied", "why": why}


def egress_request_frame(rid: str, flow: str, host: str, port: int, timeout_ms: int) -> Frame:
    return {
        "type": "egress_request",
        "id": rid,
        "flow": flow,
        "host": host,
        "port": port,
        "timeout_ms": timeout_ms,
    }


MAX_JSON_DEPTH = 64  # arrays and objects inside each other; no request of this API needs more
_JSON_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"')
_JSON_BRACKETS = re.compile(rb"[\[\]{}]")


def nested_deeper_than(data: str | bytes, most: int = MAX_JSON_DEPTH) -> bool:
    """Whether JSON text opens more than `most` arrays/objects inside each other, judged
    without parsing (no recursion, no objects): brackets in strings do not count."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    if raw.count(b"[") + raw.count(b"{") <= most:
        return False
    depth = 0
    for match in _JSON_BRACKETS.finditer(_JSON_STRINGS.sub(b"", raw)):
        if match[0] in (b"[", b"{"):
            depth += 1
            if depth > most:
                return True
        else:
            depth -= 1
    return False
