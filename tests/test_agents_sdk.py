"""appliance_client.agents against the official SDKs' own types (openai, anthropic): every tool
definition and every message a turn renders is validated as the SDK's typed request params,
parallel tool calls and images included, and the order of the messages is the one each API
requires. The SDKs are never asked to send anything: this is offline, on their types.

The model's side of each conversation is built from the SDKs' own response types (what
`chat.completions.create`, `responses.create` and `messages.create` return), and the calls run
for real on a real appliance."""

from __future__ import annotations

import base64
import copy
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from anthropic.types import MessageParam, ToolParam, ToolUseBlock
from anthropic.types import TextBlock as AnthropicText
from openai.lib._pydantic import _ensure_strict_json_schema  # the SDK's own strict-mode rules
from openai.types.chat import (
    ChatCompletion,
    ChatCompletionMessage,
    ChatCompletionMessageParam,
    ChatCompletionToolParam,
)
from openai.types.chat.chat_completion import Choice
from openai.types.chat.chat_completion_message_function_tool_call import (
    ChatCompletionMessageFunctionToolCall,
    Function,
)
from openai.types.responses import (
    FunctionToolParam,
    ResponseFunctionToolCall,
    ResponseInputParam,
    ResponseReasoningItem,
)
from pydantic import TypeAdapter

from appliance_client import agents
from appliance_client.client import AsyncClient, Execution
from tests.support import Server

CHAT_MESSAGES = TypeAdapter(list[ChatCompletionMessageParam])
CHAT_TOOL = TypeAdapter(ChatCompletionToolParam)
RESPONSES_INPUT = TypeAdapter(ResponseInputParam)
RESPONSES_TOOL = TypeAdapter(FunctionToolParam)
ANTHROPIC_MESSAGES = TypeAdapter(list[MessageParam])
ANTHROPIC_TOOL = TypeAdapter(ToolParam)

FIGURE = "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.show()"


def materialised(value: Any) -> Any:
    """`value` with every lazily validated iterable read (pydantic validates an Iterable[...]
    field item by item only as it is read; reading them all validates them all)."""
    if isinstance(value, dict):
        return {key: materialised(item) for key, item in value.items()}
    if isinstance(value, str | bytes):
        return value
    if isinstance(value, list | tuple) or hasattr(value, "__next__"):
        return [materialised(item) for item in value]
    return value


def valid(adapter: TypeAdapter[Any], value: Any) -> None:
    """`value` is valid as the SDK type, down to the last nested part, and the SDK's type drops
    nothing from it (a key the type does not know would be dropped, so it must be equal)."""
    assert materialised(adapter.validate_python(value)) == value


def chat_order_problems(messages: list[dict[str, Any]]) -> list[str]:
    """What breaks Chat Completions' rule: an assistant message with tool_calls is followed at
    once by one tool message per call (any order among them), before any other message; a tool
    message appears nowhere else."""
    problems = []
    i = 0
    while i < len(messages):
        message = messages[i]
        if message["role"] == "tool":
            problems.append(f"message {i}: a tool message not right after its assistant message")
        calls = message.get("tool_calls") or []
        if message["role"] == "assistant" and calls:
            wanted = {call["id"] for call in calls}
            answers = messages[i + 1 : i + 1 + len(wanted)]
            got = {m.get("tool_call_id") for m in answers if m["role"] == "tool"}
            if got != wanted or len(answers) != len(wanted):
                problems.append(
                    f"message {i}: its calls {sorted(wanted)} are answered by {sorted(map(str, got))}"
                )
            i += 1 + len(answers)
            continue
        i += 1
    return problems


def has_image_part(message: dict[str, Any]) -> bool:
    content = message.get("content")
    return isinstance(content, list) and any(part.get("type") == "image_url" for part in content)


class TestToolDefinitions:
    def test_chat_completions_tools_are_the_sdks_tool_params_strict_or_not(self) -> None:
        for strict in (False, True):
            for tool in agents.openai_tools(strict=strict):
                valid(CHAT_TOOL, tool)
            assert [t["function"]["name"] for t in agents.openai_tools(strict)] == [
                "run_python",
                "close_session",
            ]
        assert "strict" not in agents.openai_tool()["function"]
        assert agents.openai_tool(strict=True)["function"]["strict"] is True

    def test_responses_tools_are_function_tool_params_with_name_parameters_and_strict(self) -> None:
        tools = agents.responses_tools()
        for tool in tools:
            valid(RESPONSES_TOOL, tool)
            assert tool["type"] == "function" and tool["strict"] is True and tool["parameters"]
        assert [t["name"] for t in tools] == ["run_python", "close_session"]
        assert agents.responses_tool() == tools[0]

    def test_the_strict_schema_is_a_fixed_point_of_the_sdks_strict_rules(self) -> None:
        # openai's own normaliser closes every object and requires every property; a schema
        # that already follows strict mode comes out of it unchanged.
        for tool in agents.responses_tools():
            schema = tool["parameters"]
            assert _ensure_strict_json_schema(copy.deepcopy(schema), path=(), root=schema) == schema
            jsonschema.Draft202012Validator.check_schema(schema)
        strict = agents.strict_schema(agents.RUN_PYTHON_PARAMETERS)
        assert strict["additionalProperties"] is False and strict["required"] == list(strict["properties"])
        files = strict["properties"]["files"]
        assert files["type"] == ["array", "null"] and files["items"]["additionalProperties"] is False
        assert strict["properties"]["code"]["type"] == "string", "a required field stays non-null"
        assert "default" not in json.dumps(strict)

    def test_the_original_schema_is_not_strict_so_the_check_can_fail(self) -> None:
        schema = copy.deepcopy(agents.RUN_PYTHON_PARAMETERS)
        assert _ensure_strict_json_schema(copy.deepcopy(schema), path=(), root=schema) != schema

    def test_what_a_strict_model_sends_is_valid_and_parses_with_null_as_not_given(self) -> None:
        schema = agents.responses_tool()["parameters"]
        sent = {"code": "print(1)", "keep_state": None, "session": None, "files": None}
        jsonschema.validate(sent, schema)
        args = agents.parse_arguments(json.dumps(sent))
        assert (args.code, args.keep_state, args.session, args.files) == ("print(1)", False, None, {})
        with_file = {**sent, "files": [{"path": "a.txt", "content": "hi", "encoding": None}]}
        jsonschema.validate(with_file, schema)
        assert agents.parse_arguments(with_file).files == {"a.txt": b"hi"}
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({"code": "1"}, schema)  # strict: every field is sent

    def test_anthropic_tools_are_the_sdks_tool_params(self) -> None:
        for tool in agents.anthropic_tools():
            valid(ANTHROPIC_TOOL, tool)


def image_result(call: str = "") -> agents.ToolResult:
    ex = Execution(id="r1")
    png = base64.b64encode(b"\x89PNG\r\n\x1a\n" + call.encode()).decode()
    for frame in (
        {"type": "display", "data": {"text/plain": "<Figure>", "image/png": png}},
        {"type": "done", "status": "ok", "exit_code": 0},
    ):
        ex.add(frame)
    return agents.tool_result(ex)


class TestRenderingOffline:
    def test_the_old_one_call_rendering_fails_the_order_check_with_parallel_calls(self) -> None:
        # What examples/agent_loop.py and the README built before: tool, user, tool.
        assistant = {
            "role": "assistant",
            "tool_calls": [
                {"id": f"call_{n}", "type": "function", "function": {"name": "run_python", "arguments": "{}"}}
                for n in (1, 2)
            ],
        }
        old_way: list[dict[str, Any]] = [assistant]
        for n in (1, 2):
            with pytest.warns(DeprecationWarning, match="parallel tool calls"):
                old_way += image_result().openai(f"call_{n}")
        assert chat_order_problems(old_way), "the check must catch a user message between tool messages"
        new_way = [assistant, *agents.openai_messages([(f"call_{n}", image_result()) for n in (1, 2)])]
        assert chat_order_problems(new_way) == []
        valid(CHAT_MESSAGES, new_way)
        assert [m["role"] for m in new_way] == ["assistant", "tool", "tool", "user"]
        labels = [p["text"] for p in new_way[-1]["content"] if p["type"] == "text"]
        assert labels == [
            "Images from the run_python call call_1:",
            "Images from the run_python call call_2:",
        ]

    def test_a_responses_output_carries_its_images_as_input_image_data_urls(self) -> None:
        item = image_result().responses("call_1")
        valid(RESPONSES_INPUT, [item])
        text, image = item["output"]
        assert text["type"] == "input_text" and "image #1 attached" in text["text"]
        assert image["type"] == "input_image" and image["image_url"].startswith("data:image/png;base64,")
        plain = agents.tool_result(Execution(id="x")).responses("call_2")
        assert isinstance(plain["output"], str)
        valid(RESPONSES_INPUT, [plain])


@pytest.fixture
async def client(server: Server) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(server.url) as c:
        yield c


def chat_call(call_id: str, name: str, arguments: dict[str, Any]) -> ChatCompletionMessageFunctionToolCall:
    return ChatCompletionMessageFunctionToolCall(
        id=call_id, type="function", function=Function(name=name, arguments=json.dumps(arguments))
    )


async def test_a_chat_completions_turn_with_parallel_calls_and_a_figure_is_what_the_api_takes(
    client: AsyncClient,
) -> None:
    # The assistant message as the SDK returns it: three parallel calls, one of them close_session
    # (the call that crashed the README's loop), one that draws a figure.
    reply = ChatCompletionMessage(
        role="assistant",
        content=None,
        tool_calls=[
            chat_call("call_fig", "run_python", {"code": FIGURE, "keep_state": True}),
            chat_call("call_sum", "run_python", {"code": "print(sum(range(10)))"}),
            chat_call("call_end", "close_session", {}),
        ],
    )
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Use run_python."},
        {"role": "user", "content": "Plot, add, and clean up."},
        reply.to_dict(),  # the assistant turn goes first
    ]
    async with agents.Dispatcher(client) as tools:
        messages += await tools.openai_turn(reply.tool_calls)
    valid(CHAT_MESSAGES, messages)
    assert chat_order_problems(messages) == []
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "tool", "tool", "user"]
    fig, total, end = messages[3:6]
    assert "image #1 attached" in fig["content"] and "45" in total["content"]
    assert end["content"] == "session closed"
    assert has_image_part(messages[6]) and "call_fig" in messages[6]["content"][0]["text"]


async def test_a_turn_answers_dicts_as_well_as_sdk_objects_and_no_calls_with_nothing(
    client: AsyncClient,
) -> None:
    tools = agents.Dispatcher(client)
    calls = [
        {"id": "c1", "type": "function", "function": {"name": "run_python", "arguments": '{"code": "1"}'}}
    ]
    answered = await tools.openai_turn(calls)
    assert [m["role"] for m in answered] == ["tool"] and answered[0]["tool_call_id"] == "c1"
    assert await tools.openai_turn(None) == []
    bad = await tools.openai_turn(
        [{"id": "c2", "type": "function", "function": {"name": "run_python", "arguments": "{oops"}}]
    )
    assert "not valid JSON" in bad[0]["content"], "a model's bad JSON is answered, not raised"


async def test_a_responses_turn_with_parallel_calls_and_a_figure_is_valid_input(client: AsyncClient) -> None:
    # The output items as the SDK returns them: reasoning, then two function calls in parallel.
    output = [
        ResponseReasoningItem(id="rs_1", type="reasoning", summary=[]),
        ResponseFunctionToolCall(
            type="function_call",
            id="fc_1",
            call_id="call_fig",
            name="run_python",
            arguments=json.dumps({"code": FIGURE, "keep_state": None, "session": None, "files": None}),
            status="completed",
        ),
        ResponseFunctionToolCall(
            type="function_call",
            id="fc_2",
            call_id="call_end",
            name="close_session",
            arguments="{}",
            status="completed",
        ),
    ]
    inputs: list[Any] = [{"role": "user", "content": "Plot something."}]
    inputs += [item.to_dict() for item in output]
    answered = await agents.Dispatcher(client).responses_turn(output)
    inputs += answered
    valid(RESPONSES_INPUT, inputs)
    assert [(i["type"], i["call_id"]) for i in answered] == [
        ("function_call_output", "call_fig"),
        ("function_call_output", "call_end"),
    ]
    figure = answered[0]["output"]
    assert [part["type"] for part in figure] == ["input_text", "input_image"]
    image = base64.b64decode(figure[1]["image_url"].removeprefix("data:image/png;base64,"))
    assert image.startswith(b"\x89PNG")


async def test_an_anthropic_turn_with_parallel_tool_uses_and_a_figure_is_valid(client: AsyncClient) -> None:
    content = [
        AnthropicText(type="text", text="Let me plot and count."),
        ToolUseBlock(type="tool_use", id="toolu_fig", name="run_python", input={"code": FIGURE}),
        ToolUseBlock(type="tool_use", id="toolu_len", name="run_python", input={"code": "len('four')"}),
        ToolUseBlock(type="tool_use", id="toolu_end", name="close_session", input={}),
    ]
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Plot something."},
        {"role": "assistant", "content": [block.to_dict() for block in content]},
    ]
    answer = await agents.Dispatcher(client).anthropic_turn(content)
    messages.append(answer)
    valid(ANTHROPIC_MESSAGES, messages)
    # Every tool_use is answered in the very next user message, each by its id.
    assert answer["role"] == "user"
    assert [b["tool_use_id"] for b in answer["content"]] == ["toolu_fig", "toolu_len", "toolu_end"]
    figure = answer["content"][0]["content"]
    assert [part["type"] for part in figure] == ["text", "image"]
    assert "--- result ---\n4" in answer["content"][1]["content"][0]["text"]


class ScriptedOpenAI:
    """Stands in for `openai.OpenAI()`: `chat.completions.create` checks what it is sent as the
    API would (the SDK's types, the tools, the order) and answers with the SDK's own response
    types: first two parallel calls (a figure and close_session), then a plain answer."""

    def __init__(self) -> None:
        self.sent: list[list[dict[str, Any]]] = []
        self.chat = self
        self.completions = self

    def create(self, model: str, messages: list[Any], tools: list[dict[str, Any]]) -> ChatCompletion:
        for tool in tools:
            valid(CHAT_TOOL, tool)
        valid(CHAT_MESSAGES, messages)
        assert chat_order_problems(messages) == [], messages
        self.sent.append(copy.deepcopy(messages))
        if len(self.sent) == 1:
            message = ChatCompletionMessage(
                role="assistant",
                content=None,
                tool_calls=[
                    chat_call("call_a", "run_python", {"code": FIGURE}),
                    chat_call("call_b", "close_session", {}),
                ],
            )
        else:
            message = ChatCompletionMessage(role="assistant", content="The maximum is near x = 7.85.")
        choice = Choice(index=0, finish_reason="stop", message=message)
        return ChatCompletion(id="c", choices=[choice], created=0, model=model, object="chat.completion")


def readme_loop() -> str:
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    after = readme.split("The loop in ten lines:", 1)[1]
    return after.split("```python\n", 1)[1].split("```", 1)[0]


def test_the_readmes_loop_runs_as_written_and_sends_what_the_api_takes(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = ScriptedOpenAI()
    monkeypatch.setattr(openai, "OpenAI", lambda: llm)
    code = readme_loop()
    assert "http://127.0.0.1:9100" in code
    exec(code.replace("http://127.0.0.1:9100", server.http), {"m": "a-model"})  # noqa: S102 (our own README)
    assert len(llm.sent) == 2
    second = llm.sent[1]
    assert [m["role"] for m in second] == ["user", "assistant", "tool", "tool", "user"]
    assert second[3]["content"] == "there was no open session"  # close_session answered, no crash
    assert has_image_part(second[4])
