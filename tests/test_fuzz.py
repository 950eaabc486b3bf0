"""Fuzzing: the protocol codec never raises anything but ProtocolError, and a real server fed
random frames over a real connection answers `rejected` and stays up."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest
import websockets
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from appliance.wire import protocol
from appliance.wire.protocol import ProtocolError
from tests.support import Server, scaled, start_server

LIMITS = protocol.Limits(max_message_bytes=65536, max_upload_bytes=4096)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
FIELDS = ("type", "id", "code", "session", "timeout_ms", "files", "gpu", "stdin_eof", "data", "eof", "path")
TYPES = ("execute", "stdin", "interrupt", "close_session", "", "EXECUTE", "done")
frames_like = st.fixed_dictionaries(
    {},
    optional={
        "type": st.sampled_from(TYPES) | json_values,
        "id": st.text(max_size=200) | json_values,
        "code": st.text() | json_values,
        "session": st.sampled_from(["new", ""]) | st.text(max_size=40) | json_values,
        "timeout_ms": st.integers() | json_values,
        "files": st.lists(
            st.fixed_dictionaries(
                {},
                optional={
                    "path": st.text(max_size=40)
                    | st.sampled_from(["../x", "/etc/p", "a/../../b", "a//b/./c", "."])
                    | json_values,
                    "data": st.text(max_size=40) | st.sampled_from(["aGk=", "!!", ""]) | json_values,
                },
            ),
            max_size=3,
        )
        | json_values,
        "gpu": st.fixed_dictionaries({}, optional={"memory_mb": json_values}) | json_values,
        "stdin_eof": json_values,
        "data": json_values,
        "eof": json_values,
    },
)


def parse(frame: str | bytes) -> None:
    try:
        message = protocol.parse_client_frame(frame, LIMITS)
    except ProtocolError as exc:  # either outcome is valid: a refusal must carry its reason
        assert exc.message and isinstance(exc.message, str)  # noqa: PT017
        return
    assert isinstance(
        message,
        (
            protocol.ExecuteRequest,
            protocol.StdinMessage,
            protocol.InterruptMessage,
            protocol.CloseSessionMessage,
        ),
    )


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frames_like)
def test_the_codec_only_ever_raises_protocol_error_on_structured_frames(obj: dict[str, Any]) -> None:
    parse(json.dumps(obj))


plain_frames = st.fixed_dictionaries(
    {"code": st.text()},
    optional={
        "type": st.just("execute"),
        "id": st.none() | st.text(min_size=1, max_size=protocol.MAX_ID_CHARS).filter(str.isprintable),
        "session": st.none() | st.text(min_size=1, max_size=40),
        "timeout_ms": st.none() | st.integers(min_value=1),
        "stdin_eof": st.booleans(),
    },
)


@settings(max_examples=500, deadline=None)
@given(plain_frames)
def test_a_valid_request_with_no_files_and_no_gpu_parses_to_what_it_says(obj: dict[str, Any]) -> None:
    parsed = protocol.parse_client_frame(json.dumps(obj), LIMITS)
    assert isinstance(parsed, protocol.ExecuteRequest)
    assert (parsed.code, parsed.session, parsed.timeout_ms, parsed.stdin_eof) == (
        obj["code"],
        obj.get("session"),
        obj.get("timeout_ms"),
        obj.get("stdin_eof", False),
    )
    assert parsed.id == obj["id"] if obj.get("id") is not None else parsed.id.startswith("r-")
    assert (parsed.files, parsed.gpu) == ((), None)


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        ({"code": "x", "timeout_ms": True}, "'timeout_ms' must be a positive integer"),
        ({"code": "x", "stdin_eof": 1}, "'stdin_eof' must be true or false"),
        ({"code": 7}, "'code' must be a string, got number"),
        ({"code": "x", "session": ""}, "'session' must be null, \"new\" or a session id"),
    ],
)
def test_a_refused_execute_field_is_named(obj: dict[str, Any], message: str) -> None:
    with pytest.raises(ProtocolError) as caught:
        protocol.parse_client_frame(json.dumps(obj), LIMITS)
    assert caught.value.message == message


@settings(max_examples=1500, deadline=None)
@given(st.binary(max_size=2048) | st.text(max_size=2048))
def test_the_codec_only_ever_raises_protocol_error_on_arbitrary_bytes_and_text(frame: str | bytes) -> None:
    parse(frame)


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=1, max_value=200_000), st.sampled_from(["[", '{"a":', '[{"x":']))
def test_the_codec_survives_deep_nesting(depth: int, opener: str) -> None:
    parse(opener * depth)


@settings(max_examples=500, deadline=None)
@given(st.text(max_size=300))
def test_upload_path_checks_never_crash_and_refuse_climbing(path: str) -> None:
    reason = protocol.upload_path_problem(path)
    if reason is None:
        parts = [p for p in path.split("/") if p not in ("", ".")]
        assert parts and ".." not in parts and not path.startswith("/") and "\x00" not in path


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(
        tmp_path_factory.mktemp("fuzz-server"),
        SANDBOX_POOL_SIZE="0",
        SANDBOX_MAX_MESSAGE_BYTES="65536",
        SANDBOX_MAX_UPLOAD_BYTES="4096",
    )
    yield srv
    srv.stop()


def test_a_real_server_fed_random_frames_answers_rejected_and_stays_up(fuzz_server: Server) -> None:
    """500 random non-runnable frames on one connection: each gets exactly one `rejected` done."""
    examples: list[str | bytes] = []

    @settings(max_examples=500, deadline=None, database=None)
    @given(frames_like | st.binary(max_size=512) | st.text(max_size=512))
    def gather(value: Any) -> None:
        if isinstance(value, dict):
            # Never a runnable request: we are fuzzing the front door, not running code.
            value = dict(value, type=value.get("type") if value.get("type") not in ("execute", None) else 7)
            examples.append(json.dumps(value))
        else:
            examples.append(value)

    gather()

    async def feed() -> list[dict[str, Any]]:
        replies: list[dict[str, Any]] = []
        async with websockets.connect(fuzz_server.url, max_size=None) as ws:
            for frame in examples:
                await ws.send(frame)
            while sum(r.get("type") == "done" for r in replies) < len(examples):
                replies.append(json.loads(await asyncio.wait_for(ws.recv(), scaled(30))))
            await ws.send(json.dumps({"id": "after", "code": "print('alive')"}))
            while not (replies[-1].get("id") == "after" and replies[-1].get("type") == "done"):
                replies.append(json.loads(await asyncio.wait_for(ws.recv(), scaled(60))))
        return replies

    replies = asyncio.run(feed())
    dones = [r for r in replies if r["type"] == "done" and r["id"] != "after"]
    assert len(dones) == len(examples)
    assert {d["status"] for d in dones} == {"rejected"}, {d["status"] for d in dones}
    assert replies[-1]["status"] == "ok"
    assert fuzz_server.proc.poll() is None and fuzz_server.get("/healthz")[0] == 200
