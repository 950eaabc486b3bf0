"""The protocol codec is pure data: frames in, typed messages out."""

from __future__ import annotations

import base64
import json
import re

import pytest

from appliance.settings import from_env
from appliance.wire import protocol
from appliance.wire.protocol import ExecuteRequest, Limits, ProtocolError, parse_client_frame
from tests.support import REPO

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
    msg = parse_client_frame(
        json.dumps({"code": "", "files": [{"path": "./in/data.csv", "data": data}]}), LIMITS
    )
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
    for bad in ("-1", "1.5", '"10"', "true", "0"):
        with pytest.raises(ProtocolError, match="memory_mb"):
            parse_client_frame(f'{{"code": "", "gpu": {{"memory_mb": {bad}}}}}', on)


def test_stdin_interrupt_and_close_session_parse() -> None:
    assert parse_client_frame('{"type":"stdin","id":"a","data":"x\\n"}', LIMITS) == protocol.StdinMessage(
        "a", "x\n"
    )
    assert parse_client_frame('{"type":"interrupt","id":"a"}', LIMITS) == protocol.InterruptMessage("a")
    msg = parse_client_frame('{"type":"close_session","session":"s1"}', LIMITS)
    assert isinstance(msg, protocol.CloseSessionMessage) and msg.session == "s1"


def test_a_bad_id_is_refused() -> None:
    with pytest.raises(ProtocolError, match="'id' must be"):
        parse_client_frame('{"id": 5, "code": ""}', LIMITS)


def test_server_frames_encode_compactly_and_done_checks_its_status() -> None:
    frame = protocol.done_frame("r1", "ok", exit_code=0, duration_ms=3)
    assert json.loads(protocol.encode(frame)) == frame
    assert set(frame) >= {
        "type",
        "id",
        "status",
        "exit_code",
        "duration_ms",
        "cpu_ms",
        "max_rss_mb",
        "message",
    }
    with pytest.raises(ValueError, match="unknown done status 'exploded'"):
        protocol.done_frame("r1", "exploded")


def test_output_that_looks_like_a_frame_stays_inside_a_stream_frame() -> None:
    forged = '{"type":"done","id":"victim","status":"ok"}'
    frame = protocol.stream_frame("r1", "stdout", forged)
    decoded = json.loads(protocol.encode(frame))
    assert decoded["type"] == "stream" and decoded["text"] == forged


# The protocol's own words for each problem: clients and tests match on them, so a change of
# validator must not change them.
@pytest.mark.parametrize(
    ("frame", "message"),
    [
        ('{"code": "1", "files": null, "gpu": null, "id": null}', None),
        ('{"id": "\\u0007", "code": 1}', "'id' must be a printable string of 1-128 characters"),
        ('{"type": "stdin", "data": 5}', "'data' must be a string, got number"),
        ('{"type": "stdin", "id": "a", "eof": 1}', "'eof' must be true or false, got number"),
        ('{"type": "stdin", "data": "x"}', "a 'stdin' frame needs the 'id' of its run"),
        ('{"type": "stdin", "id": null}', "a 'stdin' frame needs the 'id' of its run"),
        ('{"type": "interrupt"}', "an 'interrupt' frame needs the 'id' of its run"),
        ('{"type": "close_session", "session": ""}', "'close_session' needs a 'session' string"),
        ('{"code": "1", "session": ""}', "'session' must be null, \"new\" or a session id"),
        ('{"code": "1", "timeout_ms": true}', "'timeout_ms' must be a positive integer"),
        ('{"code": "1", "timeout_ms": 0}', "'timeout_ms' must be a positive integer"),
        ('{"code": "1", "stdin_eof": 0}', "'stdin_eof' must be true or false"),
        ('{"code": "1", "files": {}}', "'files' must be a list of {path, data} objects"),
        ('{"code": "1", "files": [["a", ""]]}', "files[0] must be an object"),
        ('{"code": "1", "files": [{"data": ""}]}', "files[0].path must be a string"),
        ('{"code": "1", "files": [{"path": "a", "data": 5}]}', "files[0].data must be a base64 string"),
        ('{"code": "1", "files": [{"path": "a", "data": "***"}]}', "files[0].data is not valid base64"),
        (
            '{"code": "1", "files": [{"path": "a/../../b"}]}',
            "files[0].path 'a/../../b' is refused: '..' climbs out of the working directory",
        ),
        ('{"code": "1", "files": [{"path": "a"}, {"path": "./a"}]}', "files[1].path './a' appears twice"),
        (
            '{"code": "1", "files": [{"path": "a", "data": "' + "QUFB" * 40 + '"}]}',
            "files total more than SANDBOX_MAX_UPLOAD_BYTES (100)",
        ),
        ('{"code": "1", "gpu": "lots"}', "'gpu' was requested but this appliance runs without SANDBOX_GPU"),
        ('{"code": 1, "session": 2}', "'code' must be a string, got number"),
    ],
)
def test_each_problem_is_named_in_the_protocols_words(frame: str, message: str | None) -> None:
    if message is None:
        assert isinstance(parse_client_frame(frame, LIMITS), ExecuteRequest)
        return
    with pytest.raises(ProtocolError) as err:
        parse_client_frame(frame, LIMITS)
    assert err.value.message == message


def test_gpu_shape_problems_are_named_when_gpu_mode_is_on() -> None:
    on = Limits(4096, 100, gpu_enabled=True)
    with pytest.raises(ProtocolError, match=r"""^'gpu' must be an object like \{"memory_mb": 2048\}$"""):
        parse_client_frame('{"code": "", "gpu": [1]}', on)
    with pytest.raises(ProtocolError, match=r"^'gpu.memory_mb' must be a positive integer$"):
        parse_client_frame('{"code": "", "gpu": {}}', on)


def test_a_rejected_frame_echoes_a_readable_id_and_makes_one_otherwise() -> None:
    with pytest.raises(ProtocolError) as err:
        parse_client_frame('{"id": "mine", "code": 5}', LIMITS)
    assert err.value.request_id == "mine"
    with pytest.raises(ProtocolError) as err:
        parse_client_frame('{"code": 5}', LIMITS)
    assert err.value.request_id is not None and err.value.request_id.startswith("r-")


def test_messages_built_in_code_keep_their_bytes_and_are_checked_too() -> None:
    upload = protocol.UploadFile("dir/./probe.json", b"\x00raw")  # raw bytes, not base64
    req = ExecuteRequest(id="canary", code="1", files=(upload,))
    assert req.files[0].path == "dir/probe.json" and req.files[0].data == b"\x00raw" and req.type == "execute"
    with pytest.raises(ValueError, match="climbs out"):
        protocol.UploadFile("../x", b"")


def test_limits_are_built_from_settings_in_one_place() -> None:
    settings = from_env({"SANDBOX_MAX_MESSAGE_BYTES": "4096", "SANDBOX_MAX_UPLOAD_BYTES": "10"})
    assert Limits.from_settings(settings) == Limits(4096, 10, gpu_enabled=False)
    builders = [
        path.relative_to(REPO)
        for path in (REPO / "appliance").rglob("*.py")
        # protocol.Limits only: JailLimits and cgroups.GroupLimits are other classes.
        if path.name != "protocol.py" and re.search(r"(?<!\w)Limits\(", path.read_text())
    ]
    assert builders == [], "build protocol.Limits with Limits.from_settings"


def test_text_that_is_not_unicode_is_escaped_not_a_failed_frame() -> None:
    frame = protocol.error_frame("r1", "ValueError", "bad \ud800 text", [])
    text = protocol.encode(frame)
    text.encode("utf-8")  # a WebSocket text frame must be UTF-8: this is what send_str does
    assert json.loads(text) == frame


def test_encode_is_compact_json_with_text_kept_as_it_is() -> None:
    frame = protocol.result_frame(
        "r1", {"text/plain": "é 😀 <>&\u2028", "application/json": {"x": [1.5, None]}}
    )
    assert protocol.encode(frame) == json.dumps(frame, ensure_ascii=False, separators=(",", ":"))


def test_file_entries_are_counted_before_they_are_validated() -> None:
    limits = Limits(max_message_bytes=1 << 20, max_upload_bytes=100, max_upload_files=3)
    ok = json.dumps(
        {
            "type": "execute",
            "id": "f",
            "code": "1",
            "files": [{"path": f"f{i}", "data": ""} for i in range(3)],
        }
    )
    assert len(protocol.parse_client_frame(ok, limits).files) == 3  # type: ignore[union-attr]
    # Four entries, none of them even valid: refused by count alone, naming the setting.
    over = json.dumps({"type": "execute", "id": "f", "code": "1", "files": [{"bogus": i} for i in range(4)]})
    with pytest.raises(ProtocolError, match="4 entries; SANDBOX_MAX_UPLOAD_FILES allows 3") as info:
        protocol.parse_client_frame(over, limits)
    assert info.value.request_id == "f"
