"""The client is a distribution of its own (client/, `appliance_client`): it imports nothing of
the server package, and what it carries of the server's (the protocol facts it needs, the tools'
definitions, the rendering of a run as a tool result) agrees with the server's own, checked here
against the published schema (docs/protocol.schema.json) and the server's modules."""

from __future__ import annotations

import ast
import base64
import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.api import mcp_tools, tool_calls
from appliance.wire import protocol
from appliance_client import agents, cli, mcp_server
from appliance_client.client import CellOptions, Execution, request_frame
from appliance_client.protocol import GpuRequest
from tests.support import REPO

CLIENT = REPO / "client"
SCHEMA = json.loads((REPO / "docs" / "protocol.schema.json").read_text())


def schema_of(name: str) -> dict[str, Any]:
    return {"$ref": f"#/$defs/{name}", "$defs": SCHEMA["$defs"]}


class TestApart:
    def test_no_client_module_imports_the_server_package(self) -> None:
        found = []
        for path in sorted((CLIENT / "appliance_client").rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = []
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                found += [
                    f"{path.name}: {n}" for n in names if n == "appliance" or n.startswith("appliance.")
                ]
        assert found == []

    def test_the_client_loads_with_no_server_module(self, tmp_path: Path) -> None:
        # From a folder that is not the checkout, with only client/ on the path: every module of
        # the client imports, and no module of the server package comes with them.
        code = (
            "import sys\n"
            "import appliance_client.client, appliance_client.agents, appliance_client.protocol\n"
            "import appliance_client.cli, appliance_client.mcp_server, appliance_client.mcp_bridge\n"
            "print(sorted(m for m in sys.modules if m == 'appliance' or m.startswith('appliance.')))\n"
        )
        env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(CLIENT)}
        done = subprocess.run(
            [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.strip() == "[]"

    def test_its_commands_take_their_own_arguments(self, capsys: pytest.CaptureFixture[str]) -> None:
        assert cli.mcp_main(["--url", "ws://127.0.0.1:9", "--max-chars", "10"]) == 2
        assert "--max-chars must be at least 200" in capsys.readouterr().err
        with pytest.raises(SystemExit):
            cli.exec_main(["--help"])
        assert capsys.readouterr().out.startswith("usage: appliance-exec [-h]")

    def test_the_client_has_its_own_project(self) -> None:
        project = (CLIENT / "pyproject.toml").read_text()
        assert 'name = "appliance-client"' in project and "appliance-mcp" in project
        makefile = (REPO / "Makefile").read_text()
        assert "pip install -q -e './client[mcp]'" in makefile


class TestProtocolFacts:
    def test_gpu_request_has_the_schema_fields(self) -> None:
        gpu = SCHEMA["$defs"]["GpuRequest"]
        assert set(GpuRequest.__dataclass_fields__) == set(gpu["properties"]) == set(gpu["required"])
        jsonschema.validate(GpuRequest(memory_mb=512).to_wire(), schema_of("GpuRequest"))
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(GpuRequest(memory_mb=0).to_wire(), schema_of("GpuRequest"))

    def test_every_option_the_client_sends_is_an_execute_field(self) -> None:
        fields = set(SCHEMA["$defs"]["ExecuteRequest"]["properties"])
        # Options whose field is spelt otherwise on the wire: egress_allow is `egress.allow`,
        # egress_ask (a callback) `egress.ask`.
        spelt = {"egress_allow": "egress", "egress_ask": "egress"}
        options = {spelt.get(o, o) for o in CellOptions.__optional_keys__}
        assert options | {"session", "code", "type"} <= fields
        assert {"allow", "ask"} <= set(SCHEMA["$defs"]["EgressRequest"]["properties"])

    def test_the_execute_frames_the_client_builds_are_valid_and_parse_on_the_server(self) -> None:
        frames = [
            request_frame("print(1)", "r1"),
            request_frame(
                "x",
                "r2",
                session="new",
                timeout_ms=500,
                files={"a.bin": b"\x00\x01", "b.txt": "hé"},
                gpu=GpuRequest(memory_mb=512),
                stdin_eof=True,
            ),
            request_frame("x", "r3", egress_allow=["api.example.com:443"], egress_ask=lambda request: True),
        ]
        limits = protocol.Limits(1 << 20, 1 << 20, gpu_enabled=True, max_upload_files=8)
        for frame in frames:
            jsonschema.validate(frame, schema_of("ExecuteRequest"))
            parsed = protocol.parse_client_frame(json.dumps(frame), limits)
            assert isinstance(parsed, protocol.ExecuteRequest) and parsed.code == frame["code"]


class TestToolsAgree:
    def test_the_tool_definitions_are_the_same(self) -> None:
        for name in (
            "TOOL_NAME",
            "TOOL_DESCRIPTION",
            "CLOSE_SESSION_TOOL",
            "CLOSE_SESSION_DESCRIPTION",
            "RUN_PYTHON_PARAMETERS",
            "CLOSE_SESSION_PARAMETERS",
            "DEFAULT_MAX_CHARS",
            "MAX_FRAMES",
        ):
            assert getattr(agents, name) == getattr(tool_calls, name), name

    def test_both_mcp_servers_list_the_same_tools_and_keep_the_same_bounds(self) -> None:
        assert [t.model_dump() for t in mcp_server.tools()] == [t.model_dump() for t in mcp_tools.tools()]
        for name in (
            "SERVER_NAME",
            "SERVER_INSTRUCTIONS",
            "LIST_MODELS_TOOL",
            "LIST_MODELS_DESCRIPTION",
            "LIST_MODELS_PARAMETERS",
            "RESOURCE_FILES",
            "RESOURCE_BYTES",
            "RESOURCE_BYTES_ALL",
            "RESOURCE_NOT_FOUND",
            "CLOSE_TIMEOUT_S",
        ):
            assert getattr(mcp_server, name) == getattr(mcp_tools, name), name

    @pytest.mark.parametrize(
        "arguments",
        [
            {"code": "1"},
            '{"code": "1", "keep_state": true}',
            {"code": "1", "keep_state": None, "session": None, "files": None},
            {
                "code": "1",
                "session": "s-1",
                "files": [{"path": "a", "content": "aGk=", "encoding": "base64"}],
            },
            {"code": "1", "files": [{"path": "a", "content": "hi", "encoding": None}]},
            "not json",
            "[1]",
            {"code": 1},
            {"code": "1", "bogus": 2, "other": 3},
            {"code": "1", "keep_state": "yes"},
            {"code": "1", "session": 5},
            {"code": "1", "files": "a"},
            {"code": "1", "files": [{"path": "a"}]},
            {"code": "1", "files": [{"path": "a", "content": "%%", "encoding": "base64"}]},
            {"code": "1", "files": [{"path": "a", "content": "x", "encoding": "latin-1"}]},
        ],
    )
    def test_arguments_are_checked_alike(self, arguments: str | dict[str, Any]) -> None:
        def outcome(parse: Any, error: type[Exception]) -> object:
            try:
                args = parse(arguments)
            except error as exc:
                return ("refused", str(exc))
            return (args.code, args.keep_state, args.session, args.files)

        assert outcome(agents.parse_arguments, agents.ToolArgumentError) == outcome(
            tool_calls.parse_arguments, tool_calls.ToolArgumentError
        )


PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n fake").decode()
TRACEBACK = [
    "Traceback (most recent call last):",
    *[f'  File "<cell>", line {i}, in f{i}\n    f{i + 1}()' for i in range(6)],
    "\x1b[31mZeroDivisionError\x1b[0m: division by zero",
]


def run_frames(status: str = "ok", *, session: str | None = None, **done: Any) -> list[dict[str, Any]]:
    return [protocol.start_frame("r", "run-1", session, 0, 1000), protocol.done_frame("r", status, **done)]


FRAME_SETS: dict[str, list[dict[str, Any]]] = {
    "printed and a value": [
        protocol.start_frame("r", "run-1", None, 0, 1000),
        protocol.stream_frame("r", "stdout", "4\n"),
        protocol.stream_frame("r", "stderr", "careful\n"),
        protocol.result_frame("r", {"text/plain": "42"}),
        protocol.done_frame("r", "ok", exit_code=0, duration_ms=12),
    ],
    "a figure, a display and a value that is an image": [
        protocol.start_frame("r", "run-1", "s-1", 0, 1000),
        protocol.display_frame("r", {"image/png": PNG, "text/plain": "<Figure>"}),
        protocol.display_frame("r", {"text/html": "<b>x</b>"}),
        protocol.display_frame("r", {"text/plain": "shown"}),
        protocol.result_frame("r", {"image/jpeg": PNG, "text/plain": "<Image>"}),
        protocol.done_frame("r", "ok", duration_ms=3, session="s-1"),
    ],
    "an exception with a long traceback": [
        protocol.start_frame("r", "run-1", None, 0, 1000),
        protocol.error_frame("r", "ZeroDivisionError", "division by zero", TRACEBACK),
        protocol.done_frame("r", "error", exit_code=1),
    ],
    "stopped by its time limit": [
        protocol.start_frame("r", "run-1", None, 0, 1000),
        protocol.stream_frame("r", "stdout", "tick\n" * 50),
        protocol.error_frame("r", "KeyboardInterrupt", "", TRACEBACK[:3]),
        protocol.done_frame("r", "timeout", message="the run exceeded 1000 ms"),
    ],
    "a non-zero exit and no message": run_frames("error", exit_code=3),
    "rejected": run_frames("rejected", message="'code' must be a string"),
    "busy": run_frames("busy"),
    "files, one too big": [
        protocol.start_frame("r", "run-1", None, 0, 1000),
        protocol.file_frame("r", "a.txt", 5, base64.b64encode(b"alpha").decode()),
        protocol.file_frame("r", "big.bin", 1 << 30, None, message="too big"),
        protocol.done_frame("r", "ok"),
    ],
}


def both(frames: list[dict[str, Any]], max_chars: int, images: bool = True) -> tuple[object, object]:
    execution = Execution(id="r")
    outcome = tool_calls.Outcome()
    for frame in frames:
        execution.add(dict(frame))
        outcome.add(frame)
    client = agents.tool_result(execution, max_chars, images)
    server = tool_calls.tool_result(outcome, max_chars, images)

    def plain(result: Any) -> object:
        return (
            result.text,
            [(i.mime, i.data) for i in result.images],
            [(f.path, f.size, f.data) for f in result.files],
            result.is_error,
            result.run,
        )

    return plain(client), plain(server)


class TestResultsAgree:
    @pytest.mark.parametrize("name", sorted(FRAME_SETS))
    @pytest.mark.parametrize("max_chars", [200, 600, 8000])
    @pytest.mark.parametrize("images", [True, False])
    def test_a_run_reads_the_same_to_a_model_either_way(
        self, name: str, max_chars: int, images: bool
    ) -> None:
        client, server = both(FRAME_SETS[name], max_chars, images)
        assert client == server

    @settings(max_examples=150, deadline=None)
    @given(
        run=st.fixed_dictionaries(
            {
                "stdout": st.text(max_size=3000),
                "stderr": st.text(max_size=3000),
                "value": st.one_of(st.none(), st.text(max_size=3000)),
                "message": st.one_of(st.none(), st.text(max_size=500)),
                "status": st.sampled_from(sorted(protocol.STATUSES)),
            }
        ),
        max_chars=st.integers(min_value=200, max_value=4000),
    )
    def test_any_output_is_cut_the_same_way(self, run: dict[str, Any], max_chars: int) -> None:
        frames: list[Mapping[str, Any]] = [protocol.start_frame("r", "run-1", None, 0, 1000)]
        if run["stdout"]:
            frames.append(protocol.stream_frame("r", "stdout", run["stdout"]))
        if run["stderr"]:
            frames.append(protocol.stream_frame("r", "stderr", run["stderr"]))
        if run["value"] is not None:
            frames.append(protocol.result_frame("r", {"text/plain": run["value"]}))
        frames.append(protocol.done_frame("r", run["status"], message=run["message"]))
        client, server = both([dict(f) for f in frames], max_chars)
        assert client == server
