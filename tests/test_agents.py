"""appliance_client.agents: one tool definition for two model APIs, and tool results a model can read
within a budget, checked on real runs against a real server and real jails."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator

import jsonschema
import pytest

from appliance_client import agents
from appliance_client.client import AsyncClient, Execution
from tests.support import Server, start_server


@pytest.fixture(scope="module")
def science(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp("agents"), SANDBOX_PRELOAD="matplotlib")
    yield srv
    srv.stop()


async def run(server: Server, code: str, **options: object) -> Execution:
    async with AsyncClient(server.url) as c:
        return await c.execute(code, **options)  # type: ignore[arg-type]


class TestToolDefinitions:
    def test_openai_and_anthropic_formats_carry_the_same_schema(self) -> None:
        openai, anthropic = agents.openai_tool(), agents.anthropic_tool()
        assert openai["type"] == "function" and openai["function"]["name"] == "run_python"
        assert anthropic["name"] == "run_python"
        assert openai["function"]["parameters"] == anthropic["input_schema"] == agents.RUN_PYTHON_PARAMETERS
        assert openai["function"]["description"] == anthropic["description"]
        jsonschema.Draft202012Validator.check_schema(agents.RUN_PYTHON_PARAMETERS)

    def test_both_tool_lists_name_run_python_and_close_session(self) -> None:
        assert [t["function"]["name"] for t in agents.openai_tools()] == ["run_python", "close_session"]
        assert [t["name"] for t in agents.anthropic_tools()] == ["run_python", "close_session"]

    def test_arguments_from_a_json_string_or_a_mapping_are_checked(self) -> None:
        args = agents.parse_arguments(
            json.dumps(
                {
                    "code": "1",
                    "files": [
                        {"path": "a.txt", "content": "hé"},
                        {"path": "b.bin", "content": "AAE=", "encoding": "base64"},
                    ],
                }
            )
        )
        assert args.files == {"a.txt": "hé".encode(), "b.bin": b"\x00\x01"} and not args.keep_state
        assert agents.parse_arguments({"code": "x", "keep_state": True}).keep_state

    @pytest.mark.parametrize(
        ("arguments", "problem"),
        [
            ("{not json", "not valid JSON"),
            ({}, "'code' is required"),
            ({"code": 1}, "'code' is required"),
            ({"code": "", "keep_state": "yes"}, "'keep_state' must be true or false"),
            ({"code": "", "colour": 1}, "unknown argument"),
            ({"code": "", "files": [{"path": "a"}]}, "string 'path' and 'content'"),
            ({"code": "", "files": [{"path": "a", "content": "!!", "encoding": "base64"}]}, "not base64"),
        ],
    )
    def test_bad_arguments_get_a_message_for_the_model(self, arguments: object, problem: str) -> None:
        with pytest.raises(agents.ToolArgumentError, match=problem):
            agents.parse_arguments(arguments)  # type: ignore[arg-type]


class TestBudget:
    def test_cut_keeps_head_and_tail_and_says_how_much_it_cut(self) -> None:
        text = "A" * 5000 + "B" * 5000
        out = agents.cut(text, 1000)
        assert len(out) <= 1000 and out.startswith("A") and out.endswith("B")
        dropped = int(out.split("[… ")[1].split(" characters cut")[0])
        assert dropped + out.count("A") + out.count("B") == len(text)

    def test_text_under_the_budget_is_untouched(self) -> None:
        assert agents.cut("short", 100) == "short"

    def test_a_tiny_budget_is_refused(self) -> None:
        with pytest.raises(ValueError, match="at least 200"):
            agents.tool_result(Execution(id="x"), max_chars=50)


class TestOnRealRuns:
    async def test_a_run_that_printed_a_lot_stays_inside_the_budget_with_a_marker(
        self, science: Server
    ) -> None:
        ex = await run(
            science,
            "print('first line')\nfor i in range(20000): print(i)\n"
            "import sys; print('the end', file=sys.stderr)\n'value'",
        )
        assert ex.status == "ok" and len(ex.stdout) > 100_000
        for budget in (300, 2000, 8000):
            result = agents.tool_result(ex, max_chars=budget)
            assert len(result.text) <= budget, budget
            assert "characters cut …]" in result.text
            assert "status: ok" in result.text
        text = agents.tool_result(ex, max_chars=4000).text
        assert "first line" in text and "19999" in text  # head and tail of stdout
        assert "the end" in text and "'value'" in text  # small sections stay whole
        assert not agents.tool_result(ex, max_chars=4000).is_error

    async def test_a_short_run_comes_back_whole_without_a_marker(self, science: Server) -> None:
        ex = await run(science, "print('hi')\n6*7")
        text = agents.tool_result(ex).text
        assert "cut" not in text and "--- stdout ---\nhi\n" in text and "--- result ---\n42" in text

    async def test_an_error_shows_its_last_frames_and_says_how_many_were_cut(self, science: Server) -> None:
        code = "def f(n):\n    if n == 0:\n        raise ValueError('deep')\n    return f(n - 1)\nf(10)"
        ex = await run(science, code)
        assert ex.status == "error"
        result = agents.tool_result(ex)
        assert result.is_error and "ValueError: deep" in result.text
        assert "earlier frames cut" in result.text
        assert result.text.count('  File "') == agents.MAX_FRAMES
        assert "\x1b[" not in result.text

    async def test_a_figure_becomes_a_base64_image_block_in_both_formats(self, science: Server) -> None:
        ex = await run(science, "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nNone")
        result = agents.tool_result(ex)
        assert len(result.images) == 1 and result.images[0].mime == "image/png"
        assert base64.b64decode(result.images[0].data).startswith(b"\x89PNG")
        assert "image #1 attached" in result.text and result.images[0].data not in result.text
        block = result.anthropic("toolu_1")
        assert block["type"] == "tool_result" and block["tool_use_id"] == "toolu_1"
        assert block["content"][1] == {
            "type": "image",
            "source": {"type": "base64", "media_type": "image/png", "data": result.images[0].data},
        }
        tool_msg, user_msg = agents.openai_messages([("call_1", result)])
        assert tool_msg == {"role": "tool", "tool_call_id": "call_1", "content": result.text}
        assert user_msg["content"][1]["image_url"]["url"] == "data:image/png;base64," + result.images[0].data

    async def test_without_images_a_figure_is_only_named(self, science: Server) -> None:
        ex = await run(science, "import matplotlib.pyplot as plt\nplt.plot([1, 2])\nNone")
        result = agents.tool_result(ex, images=False)
        assert (
            result.images == []
            and "Figure" in result.text
            and len(agents.openai_messages([("c", result)])) == 1
        )

    async def test_files_are_listed_with_names_and_sizes(self, science: Server) -> None:
        ex = await run(
            science,
            "import os\nos.makedirs('outputs', exist_ok=True)\n"
            "open('outputs/a.csv', 'w').write('x,y\\n' * 10)",
            files={"in.txt": b"data"},
        )
        result = agents.tool_result(ex)
        assert "--- files ---\noutputs/a.csv (40 bytes)" in result.text
        assert [(f.path, f.size, f.data) for f in result.files] == [("a.csv", 40, b"x,y\n" * 10)]

    async def test_a_timeout_is_an_error_result_with_the_servers_message(self, science: Server) -> None:
        ex = await run(science, "import time\nprint('before')\ntime.sleep(30)", timeout_ms=1500)
        result = agents.tool_result(ex)
        assert result.is_error and "status: timeout" in result.text and "before" in result.text


class TestDispatcher:
    async def test_keep_state_calls_share_one_session_until_close_session(self, science: Server) -> None:
        async with AsyncClient(science.url) as c:
            tools = agents.Dispatcher(c)
            first = await tools.call("run_python", json.dumps({"code": "x = 41", "keep_state": True}))
            assert not first.is_error and tools.session is not None
            second = await tools.call("run_python", {"code": "x + 1", "keep_state": True})
            assert "--- result ---\n42" in second.text
            fresh = await tools.call("run_python", {"code": "x"})
            assert fresh.is_error and "NameError" in fresh.text
            closed = await tools.call("close_session", {})
            assert closed.text == "session closed" and tools.session is None

    async def test_an_unknown_tool_or_bad_arguments_answer_the_model(self, science: Server) -> None:
        async with AsyncClient(science.url) as c:
            tools = agents.Dispatcher(c)
            assert "unknown tool 'rm'" in (await tools.call("rm", {})).text
            bad = await tools.call("run_python", {"cod": "1"})
            assert bad.is_error and "unknown argument(s): cod" in bad.text
