"""The example agent loop (examples/agent_loop.py), driven by its scripted model against a real
server: the model's tool calls become real runs and what it reads back is checked."""

from __future__ import annotations

from appliance_client.client import AsyncClient
from examples.agent_loop import Message, ScriptedModel, answer_with_stdout, last_tool_text, run_agent
from tests.support import Server
from tests.test_agents_sdk import CHAT_MESSAGES, chat_order_problems, valid


async def test_the_loop_runs_the_models_code_and_the_model_answers_from_the_result(server: Server) -> None:
    model = ScriptedModel(["print(2**100)", answer_with_stdout])
    async with AsyncClient(server.url) as client:
        transcript = await run_agent(model, client, "What is 2**100?")
    assert transcript.answer == "The result is 1267650600228229401496703205376."
    assert len(transcript.results) == 1 and not transcript.results[0].is_error
    roles = [m["role"] for m in transcript.messages]
    assert roles == ["system", "user", "assistant", "tool", "assistant"]
    assert transcript.messages[3]["tool_call_id"] == transcript.messages[2]["tool_calls"][0]["id"]


async def test_a_figure_reaches_the_model_as_an_image_and_an_error_as_an_error(server: Server) -> None:
    def saw(messages: list[Message]) -> str:
        return "saw: " + last_tool_text(messages)[:200]

    figure = "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.show()"
    model = ScriptedModel([figure, "1 / 0", saw])
    async with AsyncClient(server.url) as client:
        transcript = await run_agent(model, client, "Plot something, then divide by zero.")
    first, second = transcript.results
    assert len(first.images) == 1 and first.images[0].mime == "image/png" and not first.is_error
    image_messages = [
        m for m in transcript.messages if m["role"] == "user" and isinstance(m["content"], list)
    ]
    assert image_messages and image_messages[0]["content"][1]["image_url"]["url"].startswith(
        "data:image/png;base64,"
    )
    assert second.is_error and "ZeroDivisionError" in second.text
    assert transcript.answer is not None and "ZeroDivisionError" in transcript.answer


async def test_parallel_calls_are_answered_by_contiguous_tool_messages_then_the_figures(
    server: Server,
) -> None:
    figure = "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.show()"
    model = ScriptedModel([[figure, "print(6 * 7)", figure], answer_with_stdout])
    async with AsyncClient(server.url) as client:
        transcript = await run_agent(model, client, "Plot twice and multiply.")
    roles = [m["role"] for m in transcript.messages]
    assert roles == ["system", "user", "assistant", "tool", "tool", "tool", "user", "assistant"]
    assert chat_order_problems(transcript.messages) == []
    valid(CHAT_MESSAGES, transcript.messages)  # as openai's own types take them
    images = transcript.messages[6]["content"]
    assert [p["type"] for p in images] == ["text", "image_url", "text", "image_url"]
    assert "call_1_1" in images[0]["text"] and "call_1_3" in images[2]["text"]
