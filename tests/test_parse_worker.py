"""The big-frame parser's child process: the same answers as the codec, refusals that keep the
frame's id, a child killed mid-parse that refuses only that frame, a caller that goes away
mid-parse that does not leave its reply for the next frame, and no child after its server."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import pytest

from appliance.sandbox import proctree
from appliance.wire import protocol
from appliance.wire.parse_worker import ParseWorker
from appliance.wire.protocol import ExecuteRequest, Limits, ProtocolError
from tests.support import scaled

LIMITS = Limits(max_message_bytes=16 << 20, max_upload_bytes=8 << 20)
# Every entry validated: ~3.5 s of the child's time for 540,000 of them, so a kill or a cancel
# 0.3 s in lands mid-parse.
SLOW = Limits(max_message_bytes=16 << 20, max_upload_bytes=8 << 20, max_upload_files=1_000_000)


def frame(request_id: str, entries: int = 1) -> str:
    files = [{"path": f"f{i:06d}", "data": ""} for i in range(entries)]
    body = {"type": "execute", "id": request_id, "code": "print(1)", "files": files}
    return json.dumps(body, separators=(",", ":"))


def gone(pid: int) -> bool:
    return proctree.state(pid) in ("Z", "X", "")


@pytest.fixture
async def worker() -> AsyncIterator[ParseWorker]:
    w = ParseWorker()
    await w.start()
    yield w
    await w.close()


async def test_the_child_answers_as_the_codec_does(worker: ParseWorker) -> None:
    raw = frame("same", entries=3)
    assert await worker.parse(raw, LIMITS) == protocol.parse_client_frame(raw, LIMITS)
    with pytest.raises(ProtocolError) as refused:
        await worker.parse(frame("many", entries=1001), LIMITS)
    assert refused.value.request_id == "many" and "SANDBOX_MAX_UPLOAD_FILES" in refused.value.message
    with pytest.raises(ProtocolError, match="not valid JSON"):
        await worker.parse(b"{not json", LIMITS)


async def test_a_child_killed_mid_parse_refuses_that_frame_only(worker: ParseWorker) -> None:
    first = worker.pid
    assert first is not None
    heavy = asyncio.create_task(worker.parse(frame("heavy", entries=540_000), SLOW))
    await asyncio.sleep(0.3)  # the frame is in the child's hands
    os.kill(first, signal.SIGKILL)
    with pytest.raises(ProtocolError, match="parser process failed"):
        await heavy
    message = await worker.parse(frame("next"), LIMITS)
    assert isinstance(message, ExecuteRequest) and message.id == "next"
    assert worker.pid not in (None, first)


async def test_a_caller_gone_mid_parse_leaves_no_reply_for_the_next(worker: ParseWorker) -> None:
    heavy = asyncio.create_task(worker.parse(frame("heavy", entries=540_000), SLOW))
    await asyncio.sleep(0.3)
    heavy.cancel()
    message = await worker.parse(frame("after"), LIMITS)
    assert isinstance(message, ExecuteRequest) and message.id == "after"


async def test_a_closed_worker_parses_nothing_and_its_child_is_gone(worker: ParseWorker) -> None:
    pid = worker.pid
    assert pid is not None
    await worker.close()
    assert gone(pid)
    with pytest.raises(ProtocolError, match="shutting down"):
        await worker.parse(frame("late"), LIMITS)


def test_the_child_exits_when_its_server_is_killed() -> None:
    """kill -9 of the server closes the child's stdin: the child must not outlive it."""
    code = (
        "import asyncio, os\n"
        "from appliance.wire.parse_worker import ParseWorker\n"
        "async def main():\n"
        "    w = ParseWorker()\n"
        "    await w.start()\n"
        "    print(w.pid, flush=True)\n"
        "    await asyncio.sleep(60)\n"
        "asyncio.run(main())\n"
    )
    server = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        child = int(server.stdout.readline())
        assert not gone(child)
    finally:
        server.kill()
        server.wait()
    deadline = time.monotonic() + scaled(10)
    while not gone(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(child), "the parser child outlived its server"


async def test_screen_counts_every_json_value_and_refuses_one_over(worker: ParseWorker) -> None:
    # The object and its 2 keys, the list and its 1 and 2, the inner object, its key and null, "x".
    body = json.dumps({"a": [1, 2, {"b": None}], "c": "x"})
    await worker.screen(body, 10, LIMITS)
    with pytest.raises(ProtocolError, match="more than 9 JSON values"):
        await worker.screen(body, 9, LIMITS)
    with pytest.raises(ProtocolError, match="not valid JSON"):
        await worker.screen(b'{"a": ', 100, LIMITS)
    with pytest.raises(ProtocolError, match="nested too deeply"):
        await worker.screen("[" * 100_000 + "]" * 100_000, 10**9, LIMITS)
