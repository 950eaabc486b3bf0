"""The core's events as the wire's frames (appliance/api/frames.py): each event becomes exactly
the frame docs/protocol.md spells, key for key and in order, as JSON text too; a renamed,
dropped or unencoded field fails here. No server."""

from __future__ import annotations

import dataclasses
import json
import typing
from typing import Any

import pytest
from pydantic import TypeAdapter

from appliance.api.frames import frame_of, framed
from appliance.core import events
from appliance.core.egress import Flow
from appliance.core.events import (
    CellError,
    Display,
    Done,
    EgressAsked,
    EgressDenied,
    Event,
    FileOut,
    GpuShare,
    Output,
    Result,
    Started,
)
from appliance.wire import protocol

# (event, the frame of request "r1", its JSON text as a client reads it)
CASES: list[tuple[Event, dict[str, Any], str]] = [
    (
        Started("run-1", None, 3, 15000),
        {
            "type": "start",
            "id": "r1",
            "run": "run-1",
            "session": None,
            "queued_ms": 3,
            "gpu": None,
            "timeout_ms": 15000,
        },
        '{"type":"start","id":"r1","run":"run-1","session":null,"queued_ms":3,"gpu":null,"timeout_ms":15000}',
    ),
    (
        Started("run-2", "s-1", 0, 900, GpuShare(1, "GPU-1", 512)),
        {
            "type": "start",
            "id": "r1",
            "run": "run-2",
            "session": "s-1",
            "queued_ms": 0,
            "gpu": {"index": 1, "uuid": "GPU-1", "memory_mb": 512},
            "timeout_ms": 900,
        },
        '{"type":"start","id":"r1","run":"run-2","session":"s-1","queued_ms":0,'
        '"gpu":{"index":1,"uuid":"GPU-1","memory_mb":512},"timeout_ms":900}',
    ),
    (
        Output("stdout", "4\n"),
        {"type": "stream", "id": "r1", "name": "stdout", "text": "4\n"},
        '{"type":"stream","id":"r1","name":"stdout","text":"4\\n"}',
    ),
    (
        Output("stderr", '{"type":"done"}'),
        {"type": "stream", "id": "r1", "name": "stderr", "text": '{"type":"done"}'},
        '{"type":"stream","id":"r1","name":"stderr","text":"{\\"type\\":\\"done\\"}"}',
    ),
    (
        Display({"text/plain": "<Figure>", "image/png": "iVBORw0KGgo="}),
        {"type": "display", "id": "r1", "data": {"text/plain": "<Figure>", "image/png": "iVBORw0KGgo="}},
        '{"type":"display","id":"r1","data":{"text/plain":"<Figure>","image/png":"iVBORw0KGgo="}}',
    ),
    (
        Result({"text/plain": "42"}),
        {"type": "result", "id": "r1", "data": {"text/plain": "42"}},
        '{"type":"result","id":"r1","data":{"text/plain":"42"}}',
    ),
    (
        CellError("ZeroDivisionError", "division by zero", ["Traceback ...", "ZeroDivisionError"]),
        {
            "type": "error",
            "id": "r1",
            "ename": "ZeroDivisionError",
            "evalue": "division by zero",
            "traceback": ["Traceback ...", "ZeroDivisionError"],
        },
        '{"type":"error","id":"r1","ename":"ZeroDivisionError","evalue":"division by zero",'
        '"traceback":["Traceback ...","ZeroDivisionError"]}',
    ),
    (
        FileOut("plot.png", 5, b"alpha"),
        {"type": "file", "id": "r1", "path": "plot.png", "size": 5, "data": "YWxwaGE="},
        '{"type":"file","id":"r1","path":"plot.png","size":5,"data":"YWxwaGE="}',
    ),
    (
        FileOut("empty.txt", 0, b""),
        {"type": "file", "id": "r1", "path": "empty.txt", "size": 0, "data": ""},
        '{"type":"file","id":"r1","path":"empty.txt","size":0,"data":""}',
    ),
    (
        FileOut("big.bin", 10**9, None, "over SANDBOX_MAX_FILE_OUT_BYTES"),
        {
            "type": "file",
            "id": "r1",
            "path": "big.bin",
            "size": 10**9,
            "data": None,
            "message": "over SANDBOX_MAX_FILE_OUT_BYTES",
        },
        '{"type":"file","id":"r1","path":"big.bin","size":1000000000,"data":null,'
        '"message":"over SANDBOX_MAX_FILE_OUT_BYTES"}',
    ),
    (
        Done("ok", exit_code=0, duration_ms=3, cpu_ms=2, max_rss_mb=9.5),
        {
            "type": "done",
            "id": "r1",
            "status": "ok",
            "exit_code": 0,
            "duration_ms": 3,
            "cpu_ms": 2,
            "max_rss_mb": 9.5,
            "message": None,
        },
        '{"type":"done","id":"r1","status":"ok","exit_code":0,"duration_ms":3,"cpu_ms":2,'
        '"max_rss_mb":9.5,"message":null}',
    ),
    (
        # What applies is there, what does not is left out: files_skipped of 0 is "none".
        Done(
            "output_limit",
            exit_code=0,
            duration_ms=7,
            message="too much",
            session="s-1",
            import_ms=40,
            files_skipped=0,
        ),
        {
            "type": "done",
            "id": "r1",
            "status": "output_limit",
            "exit_code": 0,
            "duration_ms": 7,
            "cpu_ms": None,
            "max_rss_mb": None,
            "message": "too much",
            "session": "s-1",
            "import_ms": 40,
        },
        '{"type":"done","id":"r1","status":"output_limit","exit_code":0,"duration_ms":7,"cpu_ms":null,'
        '"max_rss_mb":null,"message":"too much","session":"s-1","import_ms":40}',
    ),
    (
        EgressDenied("other.example.com", 443, "other.example.com:443 is not in the allowlist"),
        {
            "type": "egress",
            "id": "r1",
            "host": "other.example.com",
            "port": 443,
            "decision": "denied",
            "why": "other.example.com:443 is not in the allowlist",
        },
        '{"type":"egress","id":"r1","host":"other.example.com","port":443,"decision":"denied",'
        '"why":"other.example.com:443 is not in the allowlist"}',
    ),
    (
        # Names mode: every flow, allowed or not; an empty ledger is said, flows past its
        # bound are counted.
        Done(
            "ok",
            duration_ms=1,
            egress=(
                Flow(
                    "api.example.com",
                    443,
                    "allowed",
                    rule="*.example.com:443",
                    address="203.0.113.7",
                    bytes_up=517,
                    bytes_down=4096,
                    duration_ms=12,
                ),
                Flow("other.example.com", 80, "denied", why="not listed"),
            ),
            egress_omitted=3,
        ),
        {
            "type": "done",
            "id": "r1",
            "status": "ok",
            "exit_code": None,
            "duration_ms": 1,
            "cpu_ms": None,
            "max_rss_mb": None,
            "message": None,
            "egress": [
                {
                    "host": "api.example.com",
                    "port": 443,
                    "decision": "allowed",
                    "bytes_up": 517,
                    "bytes_down": 4096,
                    "duration_ms": 12,
                    "rule": "*.example.com:443",
                    "address": "203.0.113.7",
                },
                {
                    "host": "other.example.com",
                    "port": 80,
                    "decision": "denied",
                    "bytes_up": 0,
                    "bytes_down": 0,
                    "duration_ms": 0,
                    "why": "not listed",
                },
            ],
            "egress_omitted": 3,
        },
        '{"type":"done","id":"r1","status":"ok","exit_code":null,"duration_ms":1,"cpu_ms":null,'
        '"max_rss_mb":null,"message":null,"egress":[{"host":"api.example.com","port":443,'
        '"decision":"allowed","bytes_up":517,"bytes_down":4096,"duration_ms":12,'
        '"rule":"*.example.com:443","address":"203.0.113.7"},{"host":"other.example.com","port":80,'
        '"decision":"denied","bytes_up":0,"bytes_down":0,"duration_ms":0,"why":"not listed"}],'
        '"egress_omitted":3}',
    ),
    (
        Done("ok", duration_ms=1, files_skipped=2),
        {
            "type": "done",
            "id": "r1",
            "status": "ok",
            "exit_code": None,
            "duration_ms": 1,
            "cpu_ms": None,
            "max_rss_mb": None,
            "message": None,
            "files_skipped": 2,
        },
        '{"type":"done","id":"r1","status":"ok","exit_code":null,"duration_ms":1,"cpu_ms":null,'
        '"max_rss_mb":null,"message":null,"files_skipped":2}',
    ),
    (
        EgressAsked("f-0123abcd", "api.example.com", 443, 30000),
        {
            "type": "egress_request",
            "id": "r1",
            "flow": "f-0123abcd",
            "host": "api.example.com",
            "port": 443,
            "timeout_ms": 30000,
        },
        '{"type":"egress_request","id":"r1","flow":"f-0123abcd","host":"api.example.com","port":443,'
        '"timeout_ms":30000}',
    ),
    (
        Done("busy", duration_ms=0, message="the run queue is full", retry_after_ms=1500),
        {
            "type": "done",
            "id": "r1",
            "status": "busy",
            "exit_code": None,
            "duration_ms": 0,
            "cpu_ms": None,
            "max_rss_mb": None,
            "message": "the run queue is full",
            "retry_after_ms": 1500,
        },
        '{"type":"done","id":"r1","status":"busy","exit_code":null,"duration_ms":0,"cpu_ms":null,'
        '"max_rss_mb":null,"message":"the run queue is full","retry_after_ms":1500}',
    ),
]
IDS = [f"{type(e).__name__}-{i}" for i, (e, _, _) in enumerate(CASES)]


@pytest.mark.parametrize(("event", "frame", "text"), CASES, ids=IDS)
def test_each_event_becomes_exactly_its_frame(event: Event, frame: dict[str, Any], text: str) -> None:
    got = frame_of("r1", event)
    assert got == frame
    assert list(got) == list(frame), "the keys come in the protocol's order"
    assert protocol.encode(got) == text


@pytest.mark.parametrize(("event", "frame", "text"), CASES, ids=IDS)
def test_each_frame_fits_its_typed_shape_and_schema(event: Event, frame: dict[str, Any], text: str) -> None:
    shape = protocol.SERVER_FRAMES[frame["type"]]
    hints = typing.get_type_hints(shape, include_extras=True)
    required = {k for k in hints if k in shape.__required_keys__}
    got = frame_of("r1", event)
    assert required <= set(got) <= set(hints), "a field renamed, dropped or added outside the protocol"
    TypeAdapter(shape).validate_python(got, strict=True)


def test_every_event_type_has_its_frame_and_every_field_reaches_it() -> None:
    """An event type (or a field) added to the core without its spelling here fails."""
    kinds = set(typing.get_args(events.Event))
    assert kinds == {type(e) for e, _, _ in CASES}
    for kind in kinds:
        fields = {f.name for f in dataclasses.fields(kind)}
        covered: set[str] = set()
        for event, frame, _ in CASES:
            if type(event) is not kind:
                continue
            for name in fields:
                # A field reaches the frame under its own name (file data as base64).
                if name in frame:
                    covered.add(name)
        assert covered == fields, f"{kind.__name__}: {sorted(fields - covered)} never reach a frame"


def test_an_unknown_status_or_object_is_refused_not_spelt() -> None:
    with pytest.raises(ValueError, match="unknown done status"):
        frame_of("r1", Done("exploded"))
    with pytest.raises(TypeError, match="not an event"):
        frame_of("r1", {"type": "stream"})  # type: ignore[arg-type]


async def test_framed_stamps_its_request_id_on_every_event_in_order() -> None:
    sent: list[protocol.Frame] = []

    async def send(frame: protocol.Frame) -> None:
        sent.append(frame)

    emit = framed("abc", send)
    for event, _, _ in CASES:
        await emit(event)
    assert [f["id"] for f in sent] == ["abc"] * len(CASES)
    assert [f["type"] for f in sent] == [frame["type"] for _, frame, _ in CASES]
    assert json.loads(protocol.encode(sent[-1]))["retry_after_ms"] == 1500
