"""The client's retry of `busy` (appliance_client.retry), against a fake server that says
`busy` as often as a test wants: backoff that honours the hint, a deadline and an attempts
bound, and nothing sent again unless the answer was `busy` (nothing ran)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import pytest
from aiohttp import web
from websockets.asyncio.server import ServerConnection, serve

from appliance_client.client import AsyncClient, Client, ClientError, ConnectionLost
from appliance_client.retry import BusyRetry, hint_of_done, hint_of_header

Reply = Callable[[int, dict[str, Any]], Sequence[dict[str, Any] | None]]  # (nth execute, frame) -> frames


def busy(rid: str, hint_ms: int) -> dict[str, Any]:
    return {
        "type": "done",
        "id": rid,
        "status": "busy",
        "message": "the run queue is full",
        "retry_after_ms": hint_ms,
    }


def ran(rid: str) -> list[dict[str, Any]]:
    return [
        {
            "type": "start",
            "id": rid,
            "run": "r",
            "session": None,
            "queued_ms": 0,
            "gpu": None,
            "timeout_ms": 1,
        },
        {"type": "stream", "id": rid, "name": "stdout", "text": "ran\n"},
        {"type": "done", "id": rid, "status": "ok", "exit_code": 0, "duration_ms": 1, "message": None},
    ]


@asynccontextmanager
async def fake(reply: Reply) -> AsyncIterator[tuple[str, list[dict[str, Any]]]]:
    """A WebSocket server answering each execute frame with reply(n, frame); a None among them
    drops the connection (no closing handshake). Yields its URL and every frame it received."""
    received: list[dict[str, Any]] = []

    async def handler(ws: ServerConnection) -> None:
        async for raw in ws:
            frame = json.loads(raw)
            received.append(frame)
            for out in reply(len(received), frame):
                if out is None:
                    ws.transport.abort()
                    return
                await ws.send(json.dumps(out))

    async with serve(handler, "127.0.0.1", 0) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        yield f"ws://127.0.0.1:{port}", received


def quick(deadline_s: float = 30, attempts: int = 10) -> BusyRetry:
    """The same policy with waits of milliseconds, so that a test does not sleep for long."""
    return BusyRetry(deadline_s, attempts, first_s=0.001, max_s=0.004)


async def test_a_busy_request_is_sent_again_until_it_runs_and_only_the_run_is_seen() -> None:
    async with fake(lambda n, f: [busy(f["id"], 1)] if n <= 3 else ran(f["id"])) as (url, received):
        async with AsyncClient(url) as c:
            c.busy_retry = quick()
            ex = await c.execute("print('ran')", id="r1")
    assert ex.status == "ok" and ex.stdout == "ran\n"
    assert [f["type"] for f in ex.frames] == ["start", "stream", "done"]  # the refusals are not in it
    assert len(received) == 4 and all(f == received[0] for f in received)  # same id, same code
    assert c.busy_retries == 3


async def test_retries_stop_after_the_attempts_and_the_last_busy_is_the_answer() -> None:
    async with fake(lambda n, f: [busy(f["id"], 1)]) as (url, received):
        async with AsyncClient(url) as c:
            c.busy_retry = quick(attempts=3)
            ex = await c.execute("pass")
    assert len(received) == 3
    assert ex.status == "busy" and ex.retry_after_ms == 1 and ex.error is not None and ex.error.name == "Busy"


async def test_a_hint_past_the_deadline_is_not_waited_for() -> None:
    async with fake(lambda n, f: [busy(f["id"], 5000)]) as (url, received):
        async with AsyncClient(url, retry_busy_s=1) as c:
            ex = await c.execute("pass")
    assert len(received) == 1 and ex.status == "busy" and ex.retry_after_ms == 5000


async def test_retrying_off_answers_the_first_busy() -> None:
    async with fake(lambda n, f: [busy(f["id"], 1)]) as (url, received):
        async with AsyncClient(url, retry_busy_s=0) as c:
            assert (await c.execute("pass")).status == "busy"
        async with AsyncClient(url, retry_busy_attempts=1) as c:
            assert (await c.execute("pass")).status == "busy"
    assert len(received) == 2


@pytest.mark.parametrize("status", ["rejected", "error", "internal", "timeout"])
async def test_no_other_answer_is_sent_again(status: str) -> None:
    done = {"type": "done", "status": status, "exit_code": None, "duration_ms": 1, "message": "no"}
    async with fake(lambda n, f: [{**done, "id": f["id"]}]) as (url, received):
        async with AsyncClient(url) as c:
            c.busy_retry = quick()
            assert (await c.execute("pass")).status == status
    assert len(received) == 1


async def test_a_request_that_started_is_never_sent_again_even_if_its_connection_drops() -> None:
    def reply(n: int, frame: dict[str, Any]) -> Sequence[dict[str, Any] | None]:
        return [busy(frame["id"], 1)] if n == 1 else [*ran(frame["id"])[:1], None]

    async with fake(reply) as (url, received):
        async with AsyncClient(url) as c:
            c.busy_retry = quick()
            stream = c.stream("pass", id="once")
            first = await anext(stream)
            assert first.type == "start"
            with pytest.raises(ConnectionLost):
                await anext(stream.__aiter__())  # the connection drops: its outcome is unknown
            await stream.aclose()
    assert len(received) == 2  # the refused send and the admitted one; nothing after the start


async def test_the_sync_client_takes_the_same_settings() -> None:
    async with fake(lambda n, f: [busy(f["id"], 1)]) as (url, received):
        import asyncio

        def run() -> str:
            with Client(url, retry_busy_s=5, retry_busy_attempts=2) as c:
                c.async_client.busy_retry = quick(5, 2)
                return c.execute("pass").status

        assert await asyncio.to_thread(run) == "busy"
    assert len(received) == 2


class TestPolicy:
    def test_the_wait_is_the_backoff_or_the_hint_whichever_is_longer_plus_jitter(self) -> None:
        policy = BusyRetry(deadline_s=100, attempts=10, first_s=0.1, max_s=2.0, jitter=0.5)
        assert policy.delay(1, 0, None, rand=lambda: 0.0) == pytest.approx(0.1)
        assert policy.delay(3, 0, None, rand=lambda: 0.0) == pytest.approx(0.4)
        assert policy.delay(9, 0, None, rand=lambda: 0.0) == pytest.approx(2.0)  # capped
        assert policy.delay(1, 0, 1.5, rand=lambda: 0.0) == pytest.approx(1.5)  # never before the hint
        assert policy.delay(1, 0, 1.5, rand=lambda: 1.0) == pytest.approx(2.25)  # up to +50 %
        waits = {policy.delay(2, 0, None) for _ in range(50)}
        assert len(waits) > 1 and all(w is not None and 0.2 <= w <= 0.3 for w in waits)

    def test_it_gives_up_after_the_attempts_or_past_the_deadline(self) -> None:
        policy = BusyRetry(deadline_s=10, attempts=3)
        assert policy.delay(2, 0, None) is not None
        assert policy.delay(3, 0, None) is None
        assert policy.delay(1, 9.0, 2.0) is None  # the hint would end past the deadline
        assert BusyRetry(deadline_s=0).delay(1, 0, None) is None

    @pytest.mark.parametrize(("deadline", "attempts"), [(-1, 3), (float("nan"), 3), (5, 0), (5, True)])
    def test_nonsense_settings_are_refused(self, deadline: float, attempts: int) -> None:
        with pytest.raises(ValueError, match="busy retry"):
            BusyRetry(deadline, attempts)

    def test_hints_are_read_from_the_frame_and_from_retry_after(self) -> None:
        assert hint_of_done({"retry_after_ms": 1500}) == 1.5
        assert hint_of_done({"retry_after_ms": "soon"}) is None and hint_of_done({}) is None
        assert hint_of_header("3") == 3.0 and hint_of_header(None) is None and hint_of_header("x") is None
        assert hint_of_header("Wed, 21 Oct 2015 07:28:00 GMT", now=lambda: 1445412470.0) == 10.0


@asynccontextmanager
async def fake_http(refusals: int) -> AsyncIterator[tuple[str, list[str]]]:
    """An HTTP server whose snapshot route answers 429 + Retry-After `refusals` times, then 201."""
    seen: list[str] = []

    async def snapshot(request: web.Request) -> web.Response:
        seen.append(request.path)
        if len(seen) <= refusals:
            return web.json_response(
                {"error": "busy", "status": "busy"}, status=429, headers={"Retry-After": "0"}
            )
        return web.json_response({"snapshot": "s1", "bytes": 1}, status=201)

    app = web.Application()
    app.router.add_post("/v1/sessions/{sid}/snapshot", snapshot)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"ws://127.0.0.1:{port}", seen
    finally:
        await runner.cleanup()


async def test_a_rest_call_answered_429_is_sent_again_under_the_same_policy() -> None:
    async with fake_http(refusals=2) as (url, seen):
        c = AsyncClient(url, lazy=True)
        c.busy_retry = quick()
        assert await c.snapshot("abc") == {"snapshot": "s1", "bytes": 1}
    assert len(seen) == 3
    async with fake_http(refusals=2) as (url, seen):
        with pytest.raises(ClientError, match="answered 429"):
            await AsyncClient(url, lazy=True, retry_busy_s=0).snapshot("abc")
    assert len(seen) == 1
