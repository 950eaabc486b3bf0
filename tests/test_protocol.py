"""The protocol codec is pure data: frames in, typed messages out."""

from __future__ import annotations

import base64
import json

import pytest

from appliance import protocol
from appliance.protocol import ExecuteRequest, Limits, ProtocolError, parse_client_frame

LIMITS = Limits(max_message_bytes=4096, max_upload_bytes=100)


def test_only_code_is_required_and_type_defaults_to_execute() -> None:
    msg = parse_client_frame('{"code": "print(1)"}', LIMITS)
    assert isinstance(msg, ExecuteRequest)
    assert msg.code == "print(1)" and msg.session is None and msg.timeout_ms is None
    assert msg.id.startswith("r-") and len(msg.id) == 18


def test_a_client_id_is_kept() -> None:
    msg = parse_client_frame('{"type": "execute", "id": "r1", "code": ""}', LIMITS)
    assert msg.id == "r1"


def test_files_are_decoded_and_paths_normalised() -> None:
    data = base64.b64encode(b"a,b\n").decode()
    msg = parse_client_frame(json.dumps({"code": "", "files": [{"path": "./in/data.csv", "data": data}]}), LIMITS)
    assert isinstance(msg, ExecuteRequest)
    assert msg.files[0].path == "in/data.csv" and msg.files[0].data == b"a,b\n"


@pytest.mark.parametrize("path", ["/abs", "../up", "a/../../b", "", "a\x00b", "x" * 300])
def test_unsafe_upload_paths_are_refused(path: str) -> None:
    assert protocol.upload_path_problem(path) is not None


def test_a_frame_over_the_size_limit_is_refused_before_parsing() -> None:
    with pytest.raises(ProtocolError, match="exceeds SANDBOX_MAX_MESSAGE_BYTES"):
        parse_client_frame("x" * 5000, LIMITS)


def test_gpu_is_refused_when_gpu_mode_is_off_and_validated_when_on() -> None:
    with pytest.raises(ProtocolError, match="SANDBOX_GPU"):
        parse_client_frame('{"code": "", "gpu": {"memory_mb": 10}}', LIMITS)
    on = Limits(4096, 100, gpu_enabled=True)
    msg = parse_client_frame('{"code": "", "gpu": {"memory_mb": 10}}', on)
    assert isinstance(msg, ExecuteRequest) and msg.gpu is not None and msg.gpu.memory_mb == 10
    for bad in ('-1', '1.5', '"10"', 'true', '0'):
        with pytest.raises(ProtocolError, match="memory_mb"):
            parse_client_frame(f'{{"code": "", "gpu": {{"memory_mb": {bad}}}}}', on)


def test_stdin_interrupt_and_close_session_parse() -> None:
    assert parse_client_frame('{"type":"stdin","id":"a","data":"x\\n"}', LIMITS) == protocol.StdinMessage("a", "x\n")
    assert parse_client_frame('{"type":"interrupt","id":"a"}', LIMITS) == protocol.InterruptMessage("a")
    msg = parse_client_frame('{"type":"close_session","session":"s1"}', LIMITS)
    assert isinstance(msg, protocol.CloseSessionMessage) and msg.session == "s1"


def test_a_bad_id_is_refused() -> None:
    with pytest.raises(ProtocolError, match="'id' must be"):
        parse_client_frame('{"id": 5, "code": ""}', LIMITS)


def test_server_frames_encode_compactly_and_done_checks_its_status() -> None:
    frame = protocol.done_frame("r1", "ok", exit_code=0, duration_ms=3)
    assert json.loads(protocol.encode(frame)) == frame
    assert set(frame) >= {"type", "id", "status", "exit_code", "duration_ms", "cpu_ms", "max_rss_mb", "message"}
    with pytest.raises(AssertionError):
        protocol.done_frame("r1", "exploded")


def test_output_that_looks_like_a_frame_stays_inside_a_stream_frame() -> None:
    forged = '{"type":"done","id":"victim","status":"ok"}'
    frame = protocol.stream_frame("r1", "stdout", forged)
    decoded = json.loads(protocol.encode(frame))
    assert decoded["type"] == "stream" and decoded["text"] == forged
