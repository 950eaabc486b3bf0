"""What a run tells its caller, as the core's own types: one frozen dataclass per event.

The run service and the sandbox build these and hand them to the caller's `Emit`; none of
them knows how a client reads them. The api layer turns each into the wire's frame
(`appliance/api/frames.py::frame_of`, adding the request's id); docs/protocol.md spells the
frames. An event carries only what the run decided: no request id, no frame type, no
encoding (a file's bytes are bytes here, base64 on the wire).

Every run's events come in this order: `Started` (once it has a jail), then its `Output`,
`Display`, `Result` and `CellError` as the cell makes them, then a `FileOut` per file it
left under outputs/, and always, exactly once, `Done` last (alone, for a run refused
before it started).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from appliance.core.egress import Flow


@dataclass(frozen=True, slots=True)
class GpuShare:
    """The GPU share a run was granted: a device, and the memory it may use there."""

    index: int
    uuid: str
    memory_mb: int


@dataclass(frozen=True, slots=True)
class Started:
    """The run got a jail: its run id, its session (None: one-shot), how long it waited for
    its slot and lease, the time limit it runs under, and its GPU share (None: no GPU)."""

    run: str
    session: str | None
    queued_ms: int
    timeout_ms: int
    gpu: GpuShare | None = None


@dataclass(frozen=True, slots=True)
class Output:
    """Text the code wrote to its stdout or stderr (`name`), as it wrote it; never empty."""

    name: str
    text: str


@dataclass(frozen=True, slots=True)
class Display:
    """A figure or rich object the code showed: a MIME bundle (type -> value)."""

    data: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Result:
    """The value of the cell's last expression, as a MIME bundle."""

    data: dict[str, Any]


@dataclass(frozen=True, slots=True)
class CellError:
    """The code raised: the exception's name, its value and the formatted traceback."""

    ename: str
    evalue: str
    traceback: list[str]


@dataclass(frozen=True, slots=True)
class FileOut:
    """A file the run wrote under outputs/; `data` is None (with `message` saying why) when
    it was not sent."""

    path: str
    size: int
    data: bytes | None
    message: str | None = None


@dataclass(frozen=True, slots=True)
class Done:
    """How the request ended (its status from `appliance.core.errors.status_of` when it
    failed), with what applies: the exit code, timings, the session it ran in or closed,
    the outputs/ files not returned, and for `busy` when to try again."""

    status: str
    exit_code: int | None = None
    duration_ms: int = 0
    cpu_ms: int | None = None
    max_rss_mb: float | None = None
    message: str | None = None
    session: str | None = None
    import_ms: int | None = None
    files_skipped: int | None = None
    retry_after_ms: int | None = None
    egress: tuple[Flow, ...] | None = None  # names mode: the run's flows through the egress proxy
    egress_omitted: int | None = None  # flows past the ledger's bound, counted only


@dataclass(frozen=True, slots=True)
class EgressDenied:
    """A connection the run asked the egress proxy for was refused (names mode), told as it
    happens so that the caller reads why instead of waiting for a timeout."""

    host: str
    port: int
    why: str


@dataclass(frozen=True, slots=True)
class EgressAsked:
    """A connection to a host the request's allowlist leaves out waits for the caller's
    answer (`"egress": {"ask": true}`): `flow` is what the answer names, `timeout_ms` how long
    the connection waits for it before it is refused."""

    flow: str
    host: str
    port: int
    timeout_ms: int


Event = Started | Output | Display | Result | CellError | FileOut | EgressDenied | EgressAsked | Done
CellEvent = Output | Display | Result | CellError  # what a cell's own output becomes
Emit = Callable[[Event], Awaitable[None]]  # the caller's: awaited per event, in order
