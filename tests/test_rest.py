"""The REST mirror: NDJSON frames over plain HTTP, sessions, OpenAPI docs."""

from __future__ import annotations

import json
from collections.abc import Iterator

import aiohttp
import pytest

from tests.support import Server, start_server

TOKEN = "rest-token-123456"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def restsrv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp("rest"), SANDBOX_AUTH_TOKEN=TOKEN)
    yield srv
    srv.stop()


async def post_exec(server: Server, body: object) -> tuple[int, str, list[dict[str, object]]]:
    async with aiohttp.ClientSession(headers=AUTH) as http:
        async with http.post(server.http + "/v1/exec", json=body) as resp:
            text = await resp.text()
            ctype = resp.headers.get("Content-Type", "")
    frames = [json.loads(line) for line in text.splitlines() if line.strip()]
    return resp.status, ctype, frames


async def test_exec_streams_the_same_frames_as_ndjson(restsrv: Server) -> None:
    status, ctype, frames = await post_exec(restsrv, {"id": "h1", "code": "print('over http')\n6*7"})
    assert status == 200 and ctype.startswith("application/x-ndjson")
    assert [f["type"] for f in frames] == ["start", "stream", "result", "done"]
    assert frames[1]["text"] == "over http\n" and frames[2]["data"] == {"text/plain": "42"}
    assert all(f["id"] == "h1" for f in frames) and frames[-1]["status"] == "ok"


async def test_exec_frames_arrive_while_the_code_runs(restsrv: Server) -> None:
    import time

    arrivals = []
    async with aiohttp.ClientSession(headers=AUTH) as http:
        body = {"code": "import time\nprint('a', flush=True)\ntime.sleep(1.2)\nprint('b')"}
        async with http.post(restsrv.http + "/v1/exec", json=body) as resp:
            async for line in resp.content:
                if line.strip():
                    arrivals.append((time.monotonic(), json.loads(line)))
    first = next(t for t, f in arrivals if f["type"] == "stream")
    assert arrivals[-1][0] - first >= 0.9


async def test_a_bad_request_is_a_400_with_a_rejected_done(restsrv: Server) -> None:
    status, _, frames = await post_exec(restsrv, {"code": 1})
    assert status == 400 and frames[0]["status"] == "rejected" and "'code' must be a string" in frames[0]["message"]


async def test_rest_needs_the_token(restsrv: Server) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.post(restsrv.http + "/v1/exec", json={"code": "1"}) as resp:
            assert resp.status == 401


async def test_sessions_open_run_and_close_over_rest(restsrv: Server) -> None:
    async with aiohttp.ClientSession(headers=AUTH) as http:
        async with http.post(restsrv.http + "/v1/sessions", json={"code": "v = 'persisted'"}) as resp:
            assert resp.status == 201
            sid = (await resp.json())["session"]
        async with http.post(restsrv.http + "/v1/exec", json={"code": "v", "session": sid}) as resp:
            frames = [json.loads(x) for x in (await resp.text()).splitlines()]
        assert frames[-2]["data"]["text/plain"] == "'persisted'"
        async with http.delete(restsrv.http + f"/v1/sessions/{sid}") as resp:
            assert resp.status == 204
        async with http.delete(restsrv.http + f"/v1/sessions/{sid}") as resp:
            assert resp.status == 404


async def test_openapi_and_docs_are_served(restsrv: Server) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(restsrv.http + "/openapi.json") as resp:
            spec = await resp.json()
        async with http.get(restsrv.http + "/docs") as resp:
            page = await resp.text()
    assert spec["openapi"].startswith("3.") and "/v1/exec" in spec["paths"] and "/v1/sessions/{session_id}" in spec["paths"]
    assert "<table" in page and "/v1/exec" in page
