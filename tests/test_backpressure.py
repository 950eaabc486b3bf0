"""Backpressure with the real server: a full queue is 429 + Retry-After over HTTP (REST,
SandboxFusion's /run_code, the E2B API) and `busy` + retry_after_ms over WebSocket; the
client sends a refused request again, and under a flood every request runs exactly once
(counted by the jails themselves, in their persisted outputs)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import secrets
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest

from appliance_client.client import AsyncClient, Execution
from tests.support import Server, metric, scaled, start_server, until_async

HOLD = "print('up', flush=True)\ninput()\nprint('released')"


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    """One slot and one place in line: the third request at once is refused."""
    outdir = tmp_path_factory.mktemp("marks")
    srv = start_server(
        tmp_path_factory.mktemp("backpressure"),
        SANDBOX_MAX_CONCURRENCY="1",
        SANDBOX_MAX_QUEUE="1",
        SANDBOX_OUTPUTS_DIR=str(outdir),
    )
    yield srv, outdir
    srv.stop()


BUSY = 'appliance_runs_total{status="busy"}'
OK = 'appliance_runs_total{status="ok"}'


@contextlib.asynccontextmanager
async def full_queue(server: Server, client: AsyncClient) -> AsyncIterator[None]:
    """Hold the one slot (a run waiting for stdin) and the one place in line, until the caller
    is done; then release both and check they ran."""
    up = asyncio.Event()
    holder = asyncio.create_task(client.execute(HOLD, id="holder", on_stdout=lambda _: up.set()))
    await up.wait()
    queued = asyncio.create_task(client.execute("print('queued')", id="queued"))
    await until_async(
        lambda: metric(server, "appliance_queue_depth") == 1, scaled(30), "the second request waits in line"
    )
    try:
        yield
    finally:
        await client.stdin("holder", "\n", eof=True)
        held, waited = await holder, await queued
        assert held.stdout == "up\nreleased\n" and waited.stdout == "queued\n", (held.frames, waited.frames)


async def test_a_full_queue_is_busy_with_a_hint_on_websocket_and_429_with_retry_after_on_rest(
    small: tuple[Server, Path],
) -> None:
    server, _ = small
    async with AsyncClient(server.url, retry_busy_s=0) as c:
        async with full_queue(server, c), aiohttp.ClientSession() as http:
            refused = await c.execute("print('never')")
            async with http.post(server.http + "/v1/exec", json={"code": "print('never')"}) as rest:
                rest_status, rest_headers, rest_body = rest.status, rest.headers, await rest.json()
            async with http.post(server.http + "/v1/sessions", json={"code": "print('never')"}) as opened:
                open_status, open_headers = opened.status, opened.headers
            async with http.post(
                server.http + "/run_code", json={"code": "print(1)", "language": "python"}
            ) as fused:
                fused_status, fused_headers, fused_body = fused.status, fused.headers, await fused.json()
            e2b = {"X-API-Key": "anyone"}  # no token is set: any key is taken
            new = {"templateID": "code-interpreter-v1"}
            async with http.post(server.http + "/e2b/sandboxes", json=new, headers=e2b) as sandbox:
                e2b_status, e2b_headers = sandbox.status, sandbox.headers
    # WebSocket: one `done`, busy, with the hint; nothing ran.
    assert [f["type"] for f in refused.frames] == ["done"] and refused.status == "busy", refused.frames
    hint = refused.frames[0]["retry_after_ms"]
    assert isinstance(hint, int) and 100 <= hint <= 30_000 and refused.retry_after_ms == hint
    assert "queue is full" in (refused.message or "") and refused.stdout == ""
    # REST: 429, Retry-After in whole seconds that cover the frame's own hint.
    assert rest_status == 429 and rest_body["type"] == "done" and rest_body["status"] == "busy", rest_body
    assert int(rest_headers["Retry-After"]) == max(1, math.ceil(rest_body["retry_after_ms"] / 1000))
    assert open_status == 429 and int(open_headers["Retry-After"]) >= 1
    # SandboxFusion's route: the same 429 and Retry-After, its own body.
    assert fused_status == 429 and int(fused_headers["Retry-After"]) >= 1
    assert fused_body["status"] == "SandboxError" and "queue is full" in fused_body["message"], fused_body
    # The E2B API's: the same 429 and Retry-After (creating a sandbox opens a session: a run).
    assert e2b_status == 429 and int(e2b_headers["Retry-After"]) >= 1
    assert metric(server, BUSY) >= 5


async def test_the_client_sends_a_refused_request_again_once_the_queue_has_room(
    small: tuple[Server, Path],
) -> None:
    server, _ = small
    async with AsyncClient(server.url) as c, AsyncClient(server.url, retry_busy_s=scaled(120)) as patient:
        before = metric(server, BUSY)
        async with full_queue(server, c):
            later = asyncio.create_task(patient.execute("print('at last')"))
            await until_async(
                lambda: metric(server, BUSY) > before, scaled(30), "the request is refused once"
            )
        ex = await later  # the slot and the line are free again
    assert ex.status == "ok" and ex.stdout == "at last\n", ex.frames
    assert patient.busy_retries >= 1 and not any(f.get("status") == "busy" for f in ex.frames)


async def test_a_flood_of_clients_on_a_small_queue_runs_every_request_exactly_once(
    small: tuple[Server, Path],
) -> None:
    server, outdir = small
    clients, each = 6, 2
    tokens = [secrets.token_hex(6) for _ in range(clients * each)]
    busy_before, ok_before = metric(server, BUSY), metric(server, OK)

    async def one(client: AsyncClient, token: str) -> Execution:
        # Each run marks its own token in outputs/, which the server persists per run.
        return await client.execute(f"open('outputs/mark-{token}.txt', 'w').write('{token}')")

    async def flood(share: list[str]) -> list[Execution]:
        async with AsyncClient(server.url, retry_busy_s=scaled(240), retry_busy_attempts=200) as c:
            return list(await asyncio.gather(*(one(c, t) for t in share)))

    shares = [tokens[i::clients] for i in range(clients)]
    results = [ex for part in await asyncio.gather(*(flood(s) for s in shares)) for ex in part]
    assert [ex.status for ex in results] == ["ok"] * len(tokens), [
        (ex.status, ex.message) for ex in results if not ex.ok
    ]
    # Counted inside the jails: each token's file was written by exactly one run.
    marks = Counter(p.name[len("mark-") : -len(".txt")] for p in outdir.rglob("mark-*.txt"))
    assert {t: marks[t] for t in tokens} == dict.fromkeys(tokens, 1)
    assert metric(server, OK) - ok_before == len(tokens)
    # The flood did overflow the queue (1 slot, 1 place): requests were refused and sent again.
    assert metric(server, BUSY) > busy_before


async def test_the_line_holds_a_bounded_sum_of_request_bytes(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Ten places in line but 4 KiB of requests in all (SANDBOX_MAX_QUEUE_BYTES): a request
    that would push the waiting bytes over it is refused `busy`, one that fits still waits."""
    server = start_server(
        tmp_path_factory.mktemp("queue-bytes"),
        SANDBOX_MAX_CONCURRENCY="1",
        SANDBOX_MAX_QUEUE="10",
        SANDBOX_MAX_QUEUE_BYTES="4096",
    )
    try:
        async with AsyncClient(server.url, retry_busy_s=0) as c:
            up = asyncio.Event()
            holder = asyncio.create_task(c.execute(HOLD, id="holder", on_stdout=lambda _: up.set()))
            await up.wait()
            big = asyncio.create_task(c.execute("print('big')" + " " * 3000, id="big"))
            await until_async(lambda: metric(server, "appliance_queue_depth") == 1, scaled(30), "big waits")
            refused = await c.execute("print('over')" + " " * 2000)
            small_one = asyncio.create_task(c.execute("print('small')", id="small"))
            await until_async(lambda: metric(server, "appliance_queue_depth") == 2, scaled(30), "small waits")
            await c.stdin("holder", "\n", eof=True)
            held, waited, fitted = await holder, await big, await small_one
    finally:
        server.stop()
    assert refused.status == "busy" and "SANDBOX_MAX_QUEUE_BYTES" in (refused.message or ""), refused.frames
    assert refused.retry_after_ms is not None and refused.stdout == ""
    assert held.stdout == "up\nreleased\n" and waited.stdout == "big\n" and fitted.stdout == "small\n"
