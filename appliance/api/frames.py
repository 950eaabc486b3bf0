"""The core's events as the wire's frames: the one place a run's events become frames.

The run service and the sandbox say what happened as `appliance.core.events` (no request
id, no frame type, file bytes as bytes). Whatever hands the service an emit and speaks the
wire turns each event into its frame here: the run log of WebSocket and REST runs
(`appliance.api.runlog.RunLog.emit`, which then numbers and keeps it) calls `frame_of`, MCP's
tool calls wrap their gatherer with `framed`. `frame_of` stamps the request's id and spells
the event with the wire module's builders (`appliance.wire.protocol.start_frame` & co.,
beside the frames' TypedDicts and schema), one plain function per event type: no validation
model on the hot path. What the api answers on its own (a refused frame's `done`) it builds
with the same builders.
"""

from __future__ import annotations

import base64
from collections.abc import Awaitable, Callable

from appliance.core.events import (
    CellError,
    Display,
    Done,
    EgressAsked,
    EgressDenied,
    Emit,
    Event,
    FileOut,
    Output,
    Result,
    Started,
)
from appliance.wire import protocol
from appliance.wire.protocol import Frame

SendFrame = Callable[[Frame], Awaitable[None]]


def _start(rid: str, e: Started) -> Frame:
    gpu = e.gpu
    grant = None if gpu is None else {"index": gpu.index, "uuid": gpu.uuid, "memory_mb": gpu.memory_mb}
    return protocol.start_frame(rid, e.run, e.session, e.queued_ms, e.timeout_ms, grant)


def _stream(rid: str, e: Output) -> Frame:
    return protocol.stream_frame(rid, e.name, e.text)


def _display(rid: str, e: Display) -> Frame:
    return protocol.display_frame(rid, e.data)


def _result(rid: str, e: Result) -> Frame:
    return protocol.result_frame(rid, e.data)


def _error(rid: str, e: CellError) -> Frame:
    return protocol.error_frame(rid, e.ename, e.evalue, e.traceback)


def _file(rid: str, e: FileOut) -> Frame:
    data = base64.b64encode(e.data).decode() if e.data is not None else None
    return protocol.file_frame(rid, e.path, e.size, data, e.message)


def _done(rid: str, e: Done) -> Frame:
    return protocol.done_frame(
        rid,
        e.status,
        exit_code=e.exit_code,
        duration_ms=e.duration_ms,
        cpu_ms=e.cpu_ms,
        max_rss_mb=e.max_rss_mb,
        message=e.message,
        session=e.session,
        import_ms=e.import_ms,
        files_skipped=e.files_skipped,
        retry_after_ms=e.retry_after_ms,
        egress=[f.as_dict() for f in e.egress] if e.egress is not None else None,
        egress_omitted=e.egress_omitted,
    )


def _egress(rid: str, e: EgressDenied) -> Frame:
    return protocol.egress_frame(rid, e.host, e.port, e.why)


def _egress_request(rid: str, e: EgressAsked) -> Frame:
    return protocol.egress_request_frame(rid, e.flow, e.host, e.port, e.timeout_ms)


def frame_of(rid: str, event: Event) -> Frame:
    """The frame a client reads for `event` of request `rid` (docs/protocol.md). Tried in the
    order they are most often sent: a cell's output first."""
    if isinstance(event, Output):
        return _stream(rid, event)
    if isinstance(event, Display):
        return _display(rid, event)
    if isinstance(event, Result):
        return _result(rid, event)
    if isinstance(event, CellError):
        return _error(rid, event)
    if isinstance(event, Started):
        return _start(rid, event)
    if isinstance(event, Done):
        return _done(rid, event)
    if isinstance(event, FileOut):
        return _file(rid, event)
    if isinstance(event, EgressDenied):
        return _egress(rid, event)
    if isinstance(event, EgressAsked):
        return _egress_request(rid, event)
    raise TypeError(f"not an event of appliance.core.events: {type(event).__name__}")


def framed(rid: str, send: SendFrame) -> Emit:
    """An emit for request `rid` that hands each event to `send` as its frame."""

    async def emit(event: Event) -> None:
        await send(frame_of(rid, event))

    return emit
