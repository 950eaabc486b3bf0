"""The E2B dialect's pure parts: what the SDK's wire reads, listing and pagination, validation."""

from __future__ import annotations

import urllib.parse

import pytest
from e2b_code_interpreter.models import Execution, parse_output

from appliance.api.e2b import shapes
from appliance.api.e2b.registry import Registry, Sandbox
from appliance.api.e2b.shapes import BadRequest


def box(sid: str, started: float, owner: str = "o", **metadata: str) -> Sandbox:
    return Sandbox(sid, owner, "base", "t-" + sid, started, started + 60, metadata, {})


def test_lines_parse_in_the_sdks_own_parser() -> None:
    execution = Execution()
    lines = [
        shapes.count_line(3),
        shapes.stream_line("stdout", "out\n"),
        shapes.stream_line("stderr", "err\n"),
        shapes.result_line(
            {"text/plain": "1", "image/png": "iVBO", "application/x-custom": {"a": 1}}, main=True
        ),
        shapes.error_line("ValueError", "bad", ["line 1", "line 2"]),
        shapes.END_LINE,
    ]
    for line in lines:
        parse_output(execution, shapes.line_bytes(line).decode())
    assert execution.execution_count == 3
    assert execution.logs.stdout == ["out\n"] and execution.logs.stderr == ["err\n"]
    result = execution.results[0]
    assert (result.text, result.png, result.is_main_result) == ("1", "iVBO", True)
    assert result.extra == {"application/x-custom": {"a": 1}}
    assert execution.error is not None and execution.error.traceback == "line 1\nline 2"


def test_every_mime_type_the_sdk_models_has_its_field() -> None:
    bundle = {mime: f"v-{field}" for mime, field in shapes.MIME_FIELDS.items()}
    execution = Execution()
    parse_output(execution, shapes.line_bytes(shapes.result_line(bundle, main=False)).decode())
    result = execution.results[0]
    for field in shapes.MIME_FIELDS.values():
        assert getattr(result, field) == f"v-{field}"


def test_listing_pages_filter_and_order() -> None:
    boxes = [box(f"s{i}", float(i), tag="a" if i % 2 else "b") for i in range(7)]
    seen, token = [], None
    while True:
        page, token = shapes.listing(boxes, {}, None, 3, token)
        seen += [s.id for s in page]
        if token is None:
            break
    assert seen == [f"s{i}" for i in range(7)]
    page, _ = shapes.listing(boxes, {"tag": "a"}, None, 100, None)
    assert [s.id for s in page] == ["s1", "s3", "s5"]
    page, token = shapes.listing(boxes, {}, None, 2, None, order="desc")
    assert [s.id for s in page] == ["s6", "s5"]
    page, _ = shapes.listing(boxes, {}, None, 2, token, order="desc")
    assert [s.id for s in page] == ["s4", "s3"]
    assert shapes.listing(boxes, {}, "paused", 10, None) == ([], None)
    boxes[2].paused = "a-snapshot"
    assert [s.id for s in shapes.listing(boxes, {}, "paused", 10, None)[0]] == ["s2"]
    assert "s2" not in [s.id for s in shapes.listing(boxes, {}, "running", 10, None)[0]]
    assert "s2" in [s.id for s in shapes.listing(boxes, {}, None, 10, None)[0]]
    with pytest.raises(BadRequest):
        shapes.listing(boxes, {}, None, 2, "garbage/x")


def test_metadata_filter_reads_what_the_sdk_sends() -> None:
    # The SDK quotes each key and value, then form-encodes the pairs.
    sent = urllib.parse.urlencode({urllib.parse.quote("a b"): urllib.parse.quote("c&d=e")})
    assert shapes.metadata_filter(sent) == {"a b": "c&d=e"}
    assert shapes.metadata_filter(None) == {}


def test_create_requests_are_checked() -> None:
    assert shapes.new_sandbox({"templateID": "base"}) == ("base", shapes.DEFAULT_TIMEOUT_S, {}, {})
    with pytest.raises(BadRequest, match="code-interpreter-v1"):
        shapes.new_sandbox({"templateID": "ubuntu"})
    for bad in (
        {"templateID": "base", "timeout": 0},
        {"templateID": "base", "timeout": True},
        {"templateID": "base", "timeout": shapes.MAX_TIMEOUT_S + 1},
        {"templateID": "base", "envVars": {"": "x"}},
        {"templateID": "base", "envVars": {"A": "nul\0"}},
        {"templateID": "base", "metadata": {"k": "v" * shapes.MAX_LABELS_BYTES}},
        {"templateID": "base", "metadata": ["k"]},
    ):
        with pytest.raises(BadRequest):
            shapes.new_sandbox(bad)


def test_languages_other_than_python_name_python() -> None:
    assert shapes.language(None) == "python"
    with pytest.raises(BadRequest, match="supported: python"):
        shapes.language("r")


def test_registry_finds_a_sandbox_only_by_owner_or_by_token() -> None:
    reg = Registry()
    mine = box("s1", 1.0, owner="alice")
    reg.add(mine)
    assert reg.owned("s1", "alice") is mine
    assert reg.owned("s1", "bob") is None
    assert reg.reached("s1", mine.token) is mine
    assert reg.reached("s1", "t-other") is None
    assert reg.reached("s1", None) is None
    assert reg.expired(60.9) == [] and reg.expired(61.0) == [mine]
    assert reg.of_owner("bob") == []


def test_an_error_reason_phrase_carries_the_message_safely() -> None:
    # The JavaScript SDK shows only the status line of a code-interpreter error.
    assert shapes.reason(400, "language 'r' is not supported") == "Bad Request: language 'r' is not supported"
    assert shapes.reason(599, "") == "Error"
    phrase = shapes.reason(404, "id '\r\nSet-Cookie: x\u00e9" + "y" * 500)
    assert phrase.isascii() and phrase.isprintable() and "\r" not in phrase and "\n" not in phrase
    assert len(phrase) <= len("Not Found: ") + shapes.MAX_REASON_CHARS


def test_gpu_budget_is_read_from_metadata() -> None:
    assert shapes.gpu_ask({}) == 0
    assert shapes.gpu_ask({"gpu_memory_mb": "2048", "other": "x"}) == 2048
    for bad in ("0", "-1", "1.5", "lots", "", "٣", "9" * 13):
        with pytest.raises(BadRequest, match="whole number of MiB"):
            shapes.gpu_ask({"gpu_memory_mb": bad})
