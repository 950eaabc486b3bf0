"""smolagents' E2B executor, unmodified, against a real server through the E2B SDK.

No model is needed to prove the executor: the first test drives `E2BExecutor` exactly as a
`CodeAgent` does between model calls (send_tools, send_variables, then each code action);
the second runs a `CodeAgent` with `executor_type="e2b"` whose model is a scripted list of
replies (the model is not what is under test; the agent's loop, its prompts' code-block
parsing and the executor are smolagents' own).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from e2b import NotFoundException
from e2b_code_interpreter import Sandbox
from smolagents import CodeAgent
from smolagents.default_tools import FinalAnswerTool
from smolagents.models import ChatMessage, MessageRole, Model
from smolagents.monitoring import AgentLogger, LogLevel
from smolagents.remote_executors import E2BExecutor
from smolagents.utils import AgentError

from tests.support import Server, start_server
from tests.test_e2b_sdk import point_sdk

KEY = "smolagents-e2b-token-012345"


@pytest.fixture(scope="module")
def e2bsrv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp("e2b-smolagents"), SANDBOX_AUTH_TOKEN=KEY)
    yield srv
    srv.stop()


@pytest.fixture(autouse=True)
def sdk_env(e2bsrv: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    point_sdk(monkeypatch, e2bsrv, KEY)


def test_the_executor_runs_a_code_agents_actions_and_returns_the_final_answer() -> None:
    executor = E2BExecutor(additional_imports=["numpy"], logger=AgentLogger(LogLevel.OFF))
    sandbox_id = executor.sandbox.sandbox_id
    try:
        # What CodeAgent sends before its first step: its tools (final_answer, patched to raise
        # with the answer) and the run's state.
        executor.send_tools({"final_answer": FinalAnswerTool()})
        executor.send_variables({"numbers": [3, 4, 5]})
        out = executor("import numpy as np\ntotal = int(np.sum(numbers))\nprint('summing', numbers)\ntotal")
        assert (out.output, out.logs, out.is_final_answer) == ("12", "summing [3, 4, 5]\n", False)
        with pytest.raises(AgentError) as caught:
            executor("total / 0")
        assert "ZeroDivisionError" in str(caught.value) and "division by zero" in str(caught.value)
        out = executor("final_answer({'total': total, 'n': len(numbers)})")  # state outlived the error
        assert out.is_final_answer and out.output == {"total": 12, "n": 3}
    finally:
        executor.cleanup()
    with pytest.raises(NotFoundException):  # cleanup killed it
        Sandbox.get_info(sandbox_id)


class Scripted(Model):  # type: ignore[misc]  # smolagents ships no types
    """A model that answers with the next of its replies, whatever it is asked."""

    def __init__(self, replies: list[str]) -> None:
        super().__init__(model_id="scripted")
        self.replies = list(replies)
        self.asked = 0

    def generate(self, messages: list[Any], **kwargs: Any) -> ChatMessage:
        self.asked += 1
        return ChatMessage(role=MessageRole.ASSISTANT, content=self.replies.pop(0))


def test_a_code_agent_with_the_e2b_executor_reaches_its_final_answer() -> None:
    model = Scripted(
        [
            "Thought: count the words.\n<code>\nwords = 'the appliance speaks e2b'.split()\nprint(len(words))\n</code>",
            "Thought: answer.\n<code>\nfinal_answer(len(words) * 10)\n</code>",
        ]
    )
    agent = CodeAgent(tools=[], model=model, executor_type="e2b", max_steps=4, verbosity_level=LogLevel.OFF)
    try:
        answer = agent.run("How many words, times ten?")
        assert answer == 40
        assert model.asked == 2
        observations = [getattr(step, "observations", None) for step in agent.memory.steps]
        assert any(o is not None and "4" in o for o in observations), observations
    finally:
        agent.cleanup()
