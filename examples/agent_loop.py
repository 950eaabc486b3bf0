"""An agent loop: a model answers a question by calling `run_python` on the appliance.

    python examples/agent_loop.py "What is 2**100?"                       # scripted model
    python examples/agent_loop.py --model qwen2.5-0.5b-instruct.gguf "..."  # a local model

With `--model`, a GGUF model (a path, or a name inside SANDBOX_MODELS_DIR) is run by
llama-cpp-python's chat completion with tools (OpenAI's message format). Without one, a
scripted model plays the same part: it asks for tool calls (several at once, as OpenAI's
models do), then answers from what the tools returned. Either way the loop is the one an API
server runs: the assistant message goes into the history, its tool calls go to the appliance,
and `appliance_client.agents.openai_messages` renders the whole turn (every tool message, then one
user message with the figures), until the model answers in plain text.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from appliance_client import agents
from appliance_client.client import AsyncClient

Message = dict[str, Any]


class ChatModel(Protocol):
    """What the loop needs of a model: OpenAI-style messages in, one assistant message out."""

    def complete(self, messages: list[Message], tools: list[dict[str, Any]]) -> Message: ...


Step = str | list[str] | Callable[[list[Message]], str]


@dataclass
class ScriptedModel:
    """A model that follows a script: each step is code to run (a tool call), several pieces of
    code (parallel tool calls in one assistant message, as OpenAI's models make by default), or
    a function of the conversation so far that gives the final answer."""

    steps: list[Step]
    calls: int = 0

    def complete(self, messages: list[Message], tools: list[dict[str, Any]]) -> Message:
        step = self.steps[min(self.calls, len(self.steps) - 1)]
        self.calls += 1
        if callable(step):
            return {"role": "assistant", "content": step(messages)}
        codes = [step] if isinstance(step, str) else step
        calls = [
            {
                "id": f"call_{self.calls}_{n}",
                "type": "function",
                "function": {"name": agents.TOOL_NAME, "arguments": json.dumps({"code": code})},
            }
            for n, code in enumerate(codes, 1)
        ]
        return {"role": "assistant", "content": None, "tool_calls": calls}


@dataclass
class LlamaModel:
    """A local GGUF model through llama-cpp-python's chat completion with tools."""

    path: str
    llm: Any = field(init=False)

    def __post_init__(self) -> None:
        import llama_cpp

        models = os.environ.get("SANDBOX_MODELS_DIR", "")
        path = self.path if os.path.isabs(self.path) or not models else os.path.join(models, self.path)
        self.llm = llama_cpp.Llama(
            model_path=path, n_ctx=4096, chat_format="chatml-function-calling", verbose=False
        )

    def complete(self, messages: list[Message], tools: list[dict[str, Any]]) -> Message:
        reply = self.llm.create_chat_completion(messages=messages, tools=tools, tool_choice="auto")
        message: Message = reply["choices"][0]["message"]
        return message


@dataclass
class Transcript:
    """What happened: the conversation, the answer, and the runs the model asked for."""

    messages: list[Message]
    answer: str | None
    results: list[agents.ToolResult]


async def run_agent(
    model: ChatModel, client: AsyncClient, question: str, max_turns: int = 6, max_chars: int = 4000
) -> Transcript:
    """Ask, run the model's tool calls on the appliance, and return once it answers."""
    tools = agents.openai_tools()
    messages: list[Message] = [
        {
            "role": "system",
            "content": "Answer the user's question. Use run_python to compute; then answer in one sentence.",
        },
        {"role": "user", "content": question},
    ]
    dispatcher = agents.Dispatcher(client, max_chars=max_chars)
    results: list[agents.ToolResult] = []
    async with dispatcher:
        for _ in range(max_turns):
            reply = model.complete(messages, tools)
            messages.append(reply)  # the assistant message first: its tool messages answer it
            calls = reply.get("tool_calls") or []
            if not calls:
                return Transcript(messages, str(reply.get("content") or ""), results)
            # Every call of the turn, then the messages for all of them: the tool messages
            # together, then the figures (a user message between tool messages is refused).
            answered = [
                (call["id"], await dispatcher.call(call["function"]["name"], call["function"]["arguments"]))
                for call in calls
            ]
            results += [result for _, result in answered]
            messages += agents.openai_messages(answered)
        return Transcript(messages, None, results)


def last_tool_text(messages: list[Message]) -> str:
    """The text of the most recent tool message (what the scripted model answers from)."""
    return next(str(m["content"]) for m in reversed(messages) if m.get("role") == "tool")


def answer_with_stdout(messages: list[Message]) -> str:
    text = last_tool_text(messages)
    after = text.split("--- stdout ---\n", 1)
    lines = after[1].strip().splitlines() if len(after) == 2 else []
    return f"The result is {lines[0].strip()}." if lines else f"The run said: {text}"


async def main_async(args: argparse.Namespace) -> int:
    model: ChatModel
    if args.model:
        model = LlamaModel(args.model)
    else:
        model = ScriptedModel([f"print({args.code})" if args.code else "print(2**100)", answer_with_stdout])
    async with AsyncClient(args.url, args.token) as client:
        transcript = await run_agent(model, client, args.question)
    for result in transcript.results:
        print(f"--- tool result ({len(result.images)} images) ---\n{result.text}")
    print(f"--- answer ---\n{transcript.answer}")
    return 0 if transcript.answer else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("question", nargs="?", default="What is 2**100?")
    parser.add_argument("--url", default=os.environ.get("APPLIANCE_URL", "ws://127.0.0.1:9100/exec"))
    parser.add_argument("--token", default=os.environ.get("SANDBOX_AUTH_TOKEN"))
    parser.add_argument("--model", help="a GGUF chat model (else the scripted model)")
    parser.add_argument("--code", help="the scripted model's expression to print (default 2**100)")
    return asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    raise SystemExit(main())
