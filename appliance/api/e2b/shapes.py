"""The JSON the E2B SDK reads, built from the appliance's records and frames; pure.

Field names and wire shapes are facts of E2B's protocol, as its SDK parses them: the control
API's sandbox objects (camelCase keys, RFC 3339 times), its error body `{code, message}`, and
the code interpreter's NDJSON lines (`stdout`, `stderr`, `result`, `error`,
`number_of_executions`, `end_of_execution`).
"""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import Callable, Mapping
from http import HTTPStatus
from typing import Any

from appliance.api.e2b.registry import Sandbox, SnapshotEntry

# envd's version as the SDK reads it: at least every version its features are gated on (the
# SDK refuses anything under 0.1.0 and turns features on by version).
ENVD_VERSION = "0.6.4"
CLIENT_ID = "appliance"
# Names a caller may create a sandbox from: E2B's default templates, both the appliance's
# Python jail. Unknown names are refused with this list.
TEMPLATES = ("base", "code-interpreter-v1")
LANGUAGES = ("python",)  # what a code context or a cell may ask for
MAX_TIMEOUT_S = 24 * 3600
DEFAULT_TIMEOUT_S = 300
# The metadata key that asks for a GPU memory budget (MiB) for each of a sandbox's contexts.
GPU_KEY = "gpu_memory_mb"
MAX_LABELS_BYTES = 64 * 1024  # metadata and env vars of one sandbox, as JSON, together

# MIME type -> the field of the SDK's Result that holds it.
MIME_FIELDS = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
}

# done.status -> the exception name a cell that ended so reports (the SDK's ExecutionError).
STATUS_ERRORS = {
    "timeout": "TimeoutError",
    "memory_limit": "MemoryError",
    "output_limit": "OutputLimitError",
    "gpu_memory_limit": "MemoryError",
    "cancelled": "KeyboardInterrupt",
    "busy": "BusyError",
    "rejected": "RejectedError",
    "internal": "SandboxError",
}


class BadRequest(ValueError):
    """A body or parameter the SDK would never send, or one this server refuses (HTTP 400)."""


def error(code: int, message: str) -> dict[str, Any]:
    """E2B's error body: the SDK raises its typed exception from the status and shows `message`."""
    return {"code": code, "message": message}


MAX_REASON_CHARS = 200


def reason(code: int, message: str) -> str:
    """The HTTP reason phrase of an error reply: the status's phrase and the message.

    The JavaScript SDK's code-interpreter calls show only `status statusText` of an error
    (not its body), so the message rides in the phrase too; printable ASCII only (the
    message may quote a caller's input), shortened."""
    try:
        phrase = HTTPStatus(code).phrase
    except ValueError:
        phrase = "Error"
    text = "".join(c if " " <= c <= "~" else "?" for c in message)
    if len(text) > MAX_REASON_CHARS:
        text = text[: MAX_REASON_CHARS - 3] + "..."
    return f"{phrase}: {text}" if text else phrase


def _rfc3339(epoch_s: float) -> str:
    return datetime.datetime.fromtimestamp(epoch_s, tz=datetime.UTC).isoformat().replace("+00:00", "Z")


def created(sandbox: Sandbox) -> dict[str, Any]:
    """The body of a created or connected sandbox: what the SDK needs to reach it."""
    return {
        "templateID": sandbox.template,
        "sandboxID": sandbox.id,
        "alias": sandbox.template,
        "clientID": CLIENT_ID,
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": sandbox.token,
        # The SDK sends this one on every code-interpreter call (the envd token only on some):
        # one secret serves both.
        "trafficAccessToken": sandbox.token,
        "domain": None,
    }


def detail(sandbox: Sandbox, cpus: float, memory_mb: int, disk_mb: int) -> dict[str, Any]:
    """One sandbox as listed or described (get_info)."""
    return {
        "templateID": sandbox.template,
        "alias": sandbox.template,
        "sandboxID": sandbox.id,
        "clientID": CLIENT_ID,
        "startedAt": _rfc3339(sandbox.started_at),
        "endAt": _rfc3339(sandbox.end_at),
        "envdVersion": ENVD_VERSION,
        "cpuCount": max(1, round(cpus)),
        "memoryMB": memory_mb,
        "diskSizeMB": disk_mb,
        "state": sandbox.state,
        "metadata": dict(sandbox.metadata),
    }


def _str_map(value: object, what: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise BadRequest(f"'{what}' must be an object of strings")
    return dict(value)


def env_vars(value: object, what: str = "envVars") -> dict[str, str]:
    """Env vars as the SDK sends them, refused where the jail's environment could not take them."""
    envs = _str_map(value, what)
    for key, val in envs.items():
        if not key or "=" in key or "\0" in key or "\0" in val:
            raise BadRequest(f"'{what}' has a name or value no environment can hold: {key[:64]!r}")
    return envs


def timeout_s(value: object, default: int | None = DEFAULT_TIMEOUT_S) -> int:
    """A sandbox timeout in seconds, within 1 .. MAX_TIMEOUT_S."""
    if value is None and default is not None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_TIMEOUT_S:
        raise BadRequest(f"'timeout' must be a whole number of seconds from 1 to {MAX_TIMEOUT_S}")
    return value


def new_sandbox(
    body: object, is_snapshot: Callable[[str], bool] = lambda _: False
) -> tuple[str, int, dict[str, str], dict[str, str]]:
    """(template, timeout_s, metadata, env vars) of a create request; the template is one of
    the server's or a snapshot of the caller's (`is_snapshot`), else refused, listing them."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    template = body.get("templateID")
    if not isinstance(template, str) or not template:
        raise BadRequest("'templateID' must name a template")
    if template not in TEMPLATES and not is_snapshot(template):
        raise BadRequest(
            f"template {template[:100]!r} is not on this server; its templates: {', '.join(TEMPLATES)}"
        )
    metadata = _str_map(body.get("metadata"), "metadata")
    envs = env_vars(body.get("envVars"))
    if len(json.dumps([metadata, envs])) > MAX_LABELS_BYTES:
        raise BadRequest(f"metadata and envVars together may take at most {MAX_LABELS_BYTES} bytes")
    return template, timeout_s(body.get("timeout")), metadata, envs


def gpu_ask(metadata: Mapping[str, str]) -> int:
    """The GPU budget a sandbox's metadata asks for (0: none), a whole number of MiB."""
    raw = metadata.get(GPU_KEY)
    if raw is None:
        return 0
    if len(raw) > 12 or not raw.isascii() or not raw.isdigit() or int(raw) <= 0:
        raise BadRequest(f"metadata {GPU_KEY!r} must be a whole number of MiB, from 1")
    return int(raw)


def language(value: object) -> str:
    """The language a cell or context asks for (None: Python); others are refused, naming what is."""
    if value is None or value in ("python", "python3"):
        return "python"
    shown = value[:40] if isinstance(value, str) else type(value).__name__
    raise BadRequest(f"language {shown!r} is not supported here; supported: {', '.join(LANGUAGES)}")


def metadata_filter(raw: str | None) -> dict[str, str]:
    """The list endpoint's `metadata` query: key=value pairs, form-encoded, each part quoted."""
    from urllib.parse import parse_qsl, unquote

    if not raw:
        return {}
    try:
        pairs = parse_qsl(raw, keep_blank_values=True, strict_parsing=True, max_num_fields=100)
    except ValueError as exc:
        raise BadRequest(f"'metadata' must be key=value pairs joined by '&' ({exc})") from None
    return {unquote(k): unquote(v) for k, v in pairs}


def page_limit(raw: str | None, most: int = 100) -> int:
    if raw is None:
        return most
    if not raw.isdigit() or not 0 < int(raw) <= most:
        raise BadRequest(f"'limit' must be a whole number from 1 to {most}")
    return int(raw)


def listing(  # noqa: PLR0913 (the list endpoint's query, one argument per parameter)
    sandboxes: list[Sandbox],
    wanted: Mapping[str, str],
    states: str | None,
    limit: int,
    after: str | None,
    template: str | None = None,
    order: str | None = None,
) -> tuple[list[Sandbox], str | None]:
    """One page of the sandboxes that match, oldest first (`order=desc`: newest first), and the
    token of the next page (None: this is the last).

    The token is the last listed sandbox's (start time, id): a page never repeats or skips a
    sandbox that lives on, whatever starts or ends between pages."""
    wanted_states = set(states.split(",")) if states is not None else {"running", "paused"}
    if order not in (None, "asc", "desc"):
        raise BadRequest("'order' must be asc or desc")
    newest_first = order == "desc"
    matching = sorted(
        (
            s
            for s in sandboxes
            if all(s.metadata.get(k) == v for k, v in wanted.items())
            and template in (None, s.template)
            and s.state in wanted_states
        ),
        key=lambda s: (s.started_at, s.id),
        reverse=newest_first,
    )
    if after:
        key = _cursor(after)
        matching = [
            s
            for s in matching
            if ((s.started_at, s.id) < key if newest_first else (s.started_at, s.id) > key)
        ]
    page = matching[:limit]
    more = len(matching) > limit
    return page, (f"{page[-1].started_at!r}/{page[-1].id}" if more else None)


def _cursor(token: str) -> tuple[float, str]:
    started, _, sid = token.partition("/")
    try:
        return float(started), sid
    except ValueError:
        raise BadRequest("'nextToken' is not one this server gave") from None


# -- the code interpreter's NDJSON lines ---------------------------------------------------------
def now_ns() -> int:
    return time.time_ns()


def stream_line(name: str, text: str) -> dict[str, Any]:
    return {"type": "stderr" if name == "stderr" else "stdout", "text": text, "timestamp": now_ns()}


def result_line(bundle: Mapping[str, Any], main: bool) -> dict[str, Any]:
    """A MIME bundle as the SDK's Result: the types it models by name, the rest under `extra`."""
    line: dict[str, Any] = {"type": "result", "is_main_result": main}
    extra: dict[str, Any] = {}
    for mime, value in bundle.items():
        field = MIME_FIELDS.get(mime)
        if field is not None:
            line[field] = value
        else:
            extra[mime] = value
    if extra:
        line["extra"] = extra
    return line


def error_line(name: str, value: str, traceback: list[str] | str) -> dict[str, Any]:
    text = traceback if isinstance(traceback, str) else "\n".join(traceback)
    return {"type": "error", "name": name, "value": value, "traceback": text}


def count_line(n: int) -> dict[str, Any]:
    return {"type": "number_of_executions", "execution_count": n}


END_LINE: dict[str, Any] = {"type": "end_of_execution"}


def context(context_id: str, cwd: str) -> dict[str, Any]:
    return {"id": context_id, "language": "python", "cwd": cwd}


def line_bytes(line: Mapping[str, Any]) -> bytes:
    return (json.dumps(line, separators=(",", ":")) + "\n").encode()


# -- snapshots (E2B's: templates made of a sandbox) ---------------------------------------------
MAX_SNAPSHOT_NAME = 128
MAX_TEMPLATE_REF = 256  # a template asked for is looked up as a snapshot within this length


def snapshot_name(value: object) -> str:
    """A snapshot's optional name ("" for none): printable ASCII without spaces, never one of the
    server's templates (a name is what `Sandbox.create` may start from, as its id is)."""
    if value is None:
        return ""
    if (
        not isinstance(value, str)
        or not 0 < len(value) <= MAX_SNAPSHOT_NAME
        or not value.isascii()
        or not value.isprintable()
        or " " in value
    ):
        raise BadRequest(f"'name' must be 1 to {MAX_SNAPSHOT_NAME} printable ASCII characters without spaces")
    if value in TEMPLATES:
        raise BadRequest(f"'name' may not be one of the server's templates ({', '.join(TEMPLATES)})")
    return value


def snapshot_info(entry: SnapshotEntry) -> dict[str, Any]:
    """E2B's SnapshotInfo: the id `Sandbox.create` takes, and the name given (if any)."""
    return {"snapshotID": entry.id, "names": [entry.name] if entry.name else []}


def snapshot_listing(
    entries: list[SnapshotEntry], sandbox_id: str | None, name: str | None, limit: int, after: str | None
) -> tuple[list[SnapshotEntry], str | None]:
    """One page of a tenant's snapshots, oldest first, filtered by source sandbox and by name
    or id; the next page's token is the last listed one's (time taken, id), as for sandboxes."""
    matching = sorted(
        (e for e in entries if sandbox_id in (None, e.sandbox_id) and name in (None, e.id, e.name or None)),
        key=lambda e: (e.created, e.id),
    )
    if after:
        key = _cursor(after)
        matching = [e for e in matching if (e.created, e.id) > key]
    page = matching[:limit]
    more = len(matching) > limit
    return page, (f"{page[-1].created!r}/{page[-1].id}" if more else None)
