"""The published schemas are generated from the protocol's models and agree with the codec."""

from __future__ import annotations

import base64
import functools
import json
import re
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from appliance.wire import openapi, protocol
from tests.support import REPO
from tests.test_fuzz import frames_like

SCHEMA_FILE = REPO / "docs" / "protocol.schema.json"
LIMITS = protocol.Limits(max_message_bytes=65536, max_upload_bytes=4096, gpu_enabled=True)
# What the codec refuses that no JSON Schema can say (paths, base64, budgets, GPU mode).
BEYOND_THE_SCHEMA = (
    "is refused",
    "not valid base64",
    "SANDBOX_MAX_UPLOAD_BYTES",
    "appears twice",
    "'id' must be a printable string",
)


@functools.cache
def validator(definition: str) -> jsonschema.protocols.Validator:
    schema = dict(openapi.frames_schema(), **{"$ref": f"#/$defs/{definition}"})
    del schema["oneOf"]
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def test_the_committed_frame_schema_is_the_generated_one() -> None:
    assert SCHEMA_FILE.read_text() == openapi.render_frames_schema(), (
        "docs/protocol.schema.json is stale: python -m appliance.wire.openapi > docs/protocol.schema.json"
    )


def test_the_frame_schema_is_valid_json_schema_2020_12() -> None:
    schema = json.loads(SCHEMA_FILE.read_text())
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    jsonschema.Draft202012Validator.check_schema(schema)
    client = {ref["$ref"].rsplit("/", 1)[1] for ref in schema["$defs"]["ClientFrame"]["oneOf"]}
    server = {ref["$ref"].rsplit("/", 1)[1] for ref in schema["$defs"]["ServerFrame"]["oneOf"]}
    assert client == {
        "ExecuteRequest",
        "StdinMessage",
        "InterruptMessage",
        "CloseSessionMessage",
        "AttachMessage",
        "EgressDecisionMessage",
    }
    assert server == {
        "".join(p.capitalize() for p in kind.split("_")) + "Frame" for kind in protocol.SERVER_FRAMES
    }


BUILT = [
    protocol.start_frame("r1", "run-1", None, 3, 15000),
    protocol.start_frame("r1", "run-1", "s1", 0, 15000, {"index": 0, "uuid": "GPU-0", "memory_mb": 512}),
    protocol.stream_frame("r1", "stdout", "4\n"),
    protocol.display_frame("r1", {"text/plain": "<Figure>", "image/png": "iVBORw0KGgo="}),
    protocol.result_frame("r1", {"text/plain": "42"}),
    protocol.error_frame("r1", "ZeroDivisionError", "division by zero", ["Traceback ..."]),
    protocol.file_frame("r1", "plot.png", 3, "AAAA"),
    protocol.file_frame("r1", "big.bin", 10**9, None, "over SANDBOX_MAX_FILE_OUT_BYTES"),
    protocol.done_frame("r1", "ok", exit_code=0, duration_ms=3, cpu_ms=2, max_rss_mb=9.5),
    protocol.done_frame("r1", "rejected", message="bad", session="s1"),
    protocol.egress_request_frame("r1", "f-0123", "api.example.com", 443, 30000),
]


@pytest.mark.parametrize("frame", BUILT, ids=lambda f: f"{f['type']}-{len(f)}")
def test_every_frame_builder_makes_what_the_schema_and_its_typed_dict_say(frame: dict[str, Any]) -> None:
    validator("ServerFrame").validate(frame)
    typed = protocol.SERVER_FRAMES[frame["type"]]
    assert typed.__required_keys__ <= set(frame) <= typed.__required_keys__ | typed.__optional_keys__


def test_the_schema_refuses_what_a_client_could_not_rely_on() -> None:
    server = validator("ServerFrame")
    assert not server.is_valid({"type": "done", "id": "r1", "status": "exploded"})
    assert not server.is_valid({"type": "stream", "id": "r1", "name": "stdlog", "text": ""})
    client = validator("ClientFrame")
    assert client.is_valid({"code": "print(1)"}) and client.is_valid({"type": "interrupt", "id": "r1"})
    assert not client.is_valid({"id": "r1"}) and not client.is_valid({"type": "stdin", "data": "x"})


ids = st.text(st.characters(codec="utf-8"), min_size=1, max_size=130)
well_formed = st.one_of(
    st.fixed_dictionaries(
        {"code": st.text()},
        optional={
            "type": st.just("execute"),
            "id": ids | st.none(),
            "session": st.none() | st.just("new") | st.text(),
            "timeout_ms": st.none() | st.integers(min_value=-2, max_value=10**12),
            "stdin_eof": st.booleans(),
            "gpu": st.none()
            | st.fixed_dictionaries({"memory_mb": st.integers(min_value=0, max_value=10**6)}),
            "files": st.none()
            | st.lists(
                st.fixed_dictionaries(
                    {"path": st.sampled_from(["a.txt", "d/b.bin", "./c", "../x", "/abs", "a//b"])},
                    optional={"data": st.binary(max_size=64).map(lambda b: base64.b64encode(b).decode())},
                ),
                max_size=3,
            ),
        },
    ),
    st.fixed_dictionaries(
        {"type": st.just("stdin"), "id": ids}, optional={"data": st.text(), "eof": st.booleans()}
    ),
    st.fixed_dictionaries({"type": st.just("interrupt"), "id": ids}),
    st.fixed_dictionaries({"type": st.just("close_session"), "session": st.text()}, optional={"id": ids}),
)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frames_like | well_formed)
def test_the_schema_and_the_codec_agree_on_every_frame(obj: dict[str, Any]) -> None:
    """Every frame the codec takes is valid by the schema; every frame valid by the schema is taken,
    unless for a reason no schema can say."""
    schema_ok = validator("ClientFrame").is_valid(obj)
    try:
        protocol.parse_client_frame(json.dumps(obj), LIMITS)
    except protocol.ProtocolError as exc:  # either outcome is valid: it must agree with the schema
        assert not schema_ok or any(reason in exc.message for reason in BEYOND_THE_SCHEMA), exc.message  # noqa: PT017
    else:
        assert schema_ok, "the codec took a frame its own schema calls invalid"


def _walk(node: Any) -> Any:
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from _walk(value)


def test_the_openapi_document_speaks_openapi_3_0_and_every_ref_resolves() -> None:
    doc = openapi.openapi_document()
    assert doc["openapi"] == "3.0.3"
    schemas = doc["components"]["schemas"]
    assert {"ExecuteRequest", "ClientFrame", "ServerFrame", "DoneFrame", "SessionOpened"} <= set(schemas)
    for node in _walk(doc):
        # JSON Schema 2020-12 words that OpenAPI 3.0 (and so the packaged Swagger UI) does not know.
        assert not {"$defs", "const", "prefixItems", "contentEncoding", "$schema"} & set(node), node
        assert node.get("type") != "null", node
        if "$ref" in node:
            assert set(node) == {"$ref"}, f"3.0 ignores siblings of a $ref: {node}"
            assert node["$ref"].removeprefix("#/components/schemas/") in schemas, node["$ref"]
    files = schemas["UploadFile"]["properties"]["data"]
    assert (
        files["format"] == "byte" and schemas["ExecuteRequest"]["properties"]["session"]["nullable"] is True
    )


def test_the_openapi_schemas_are_the_frame_schemas_in_openapis_words() -> None:
    frames = openapi.frames_schema()["$defs"]
    schemas = openapi.openapi_document()["components"]["schemas"]
    assert set(frames) <= set(schemas)
    for name, schema in frames.items():
        assert set(schema.get("properties", {})) == set(schemas[name].get("properties", {})), name
        assert schema.get("required") == schemas[name].get("required"), name


def test_well_formed_frames_are_mostly_taken() -> None:
    """The agreement test above must see frames the codec takes, not only refusals."""
    taken = 0

    @settings(max_examples=200, deadline=None, database=None)
    @given(well_formed)
    def count(obj: dict[str, Any]) -> None:
        nonlocal taken
        try:
            protocol.parse_client_frame(json.dumps(obj), LIMITS)
            taken += 1
        except protocol.ProtocolError:
            pass

    count()
    assert taken >= 50, taken


def test_the_protocol_document_names_every_frame_field_and_status() -> None:
    """docs/protocol.md is the prose of the protocol: a frame type, field or status the code
    serves and the page does not name fails here (the page grows with the schema)."""
    doc = (REPO / "docs" / "protocol.md").read_text()
    named = set(re.findall(r"`([a-z_]+)", doc)) | set(re.findall(r'"([a-z_]+)"', doc))
    named |= set(re.findall(r"`[a-z_]+\.([a-z_]+)", doc))  # `done.session`, `start.gpu.uuid`
    named |= set(re.findall(r"`[a-z_]+\.[a-z_]+\.([a-z_]+)", doc))
    missing = []
    for name, definition in openapi.frames_schema()["$defs"].items():
        for field, spec in definition.get("properties", {}).items():
            if field not in named:
                missing.append(f"{name}.{field}")
            if field == "type" and "const" in spec and spec["const"] not in named:
                missing.append(f"frame type {spec['const']}")
    missing += [f"status {status}" for status in protocol.STATUSES if status not in named]
    assert not missing, f"docs/protocol.md does not name: {missing}"
