"""Malformed input gets a `rejected` done naming the problem; the connection stays usable."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
import websockets

from tests.support import Server, start_server

TOKEN = "s3cret-token-for-tests"


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(
        tmp_path_factory.mktemp("bad"),
        SANDBOX_AUTH_TOKEN=TOKEN,
        SANDBOX_MAX_MESSAGE_BYTES="65536",
        SANDBOX_MAX_UPLOAD_BYTES="1024",
    )
    yield srv
    srv.stop()


async def exchange(ws: websockets.ClientConnection, raw: str | bytes) -> dict[str, object]:
    await ws.send(raw)
    return dict(json.loads(await ws.recv()))


async def assert_still_usable(ws: websockets.ClientConnection) -> None:
    await ws.send(json.dumps({"id": "after", "code": "print('ok')"}))
    frames: list[dict[str, Any]] = []
    while not frames or frames[-1]["type"] != "done":
        frames.append(json.loads(await ws.recv()))
    assert frames[-1]["status"] == "ok" and frames[-1]["id"] == "after"


def connect(server: Server, token: str | None = TOKEN) -> websockets.connect:
    headers = {"Authorization": f"Bearer {token}"} if token else None
    return websockets.connect(server.url, additional_headers=headers)


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        ("this is not json", "not valid JSON"),
        ("[1, 2, 3]", "must be a JSON object, got array"),
        ('"a string"', "must be a JSON object, got string"),
        ("{}", "missing required field 'code'"),
        ('{"code": 42}', "'code' must be a string, got number"),
        ('{"code": null}', "'code' must be a string, got null"),
        ('{"type": "launch_missiles", "code": "1"}', "unknown type 'launch_missiles'"),
        ('{"type": 7, "code": "1"}', "'type' must be a string"),
        ('{"code": "1", "timeout_ms": -5}', "'timeout_ms' must be a positive integer"),
        ('{"code": "1", "timeout_ms": "soon"}', "'timeout_ms' must be a positive integer"),
        ('{"code": "1", "session": 12}', "'session' must be null"),
        ('{"code": "1", "files": "nope"}', "'files' must be a list"),
        ('{"code": "1", "files": [{"path": "/etc/x", "data": ""}]}', "absolute paths are not allowed"),
        ('{"code": "1", "files": [{"path": "../x", "data": ""}]}', "climbs out"),
        ('{"code": "1", "files": [{"path": "a.txt", "data": "***"}]}', "not valid base64"),
        ('{"code": "1", "gpu": {"memory_mb": 100}}', "SANDBOX_GPU"),
        ('{"type": "stdin", "id": "nobody", "data": "x"}', "no running request"),
        ('{"type": "interrupt", "id": "nobody"}', "no running request"),
        ('{"type": "close_session", "session": "nope"}', "no such session"),
    ],
)
async def test_bad_frames_are_rejected_with_a_reason_and_the_connection_stays_usable(
    guarded: Server, raw: str, fragment: str
) -> None:
    async with connect(guarded) as ws:
        done = await exchange(ws, raw)
        assert done["type"] == "done" and done["status"] == "rejected"
        assert fragment in str(done["message"]), done["message"]
        await assert_still_usable(ws)


async def test_a_rejected_frame_echoes_its_id(guarded: Server) -> None:
    async with connect(guarded) as ws:
        done = await exchange(ws, json.dumps({"id": "mine", "code": 5}))
        assert done["id"] == "mine" and done["status"] == "rejected"


async def test_an_oversized_frame_is_rejected_and_the_connection_stays_usable(guarded: Server) -> None:
    async with connect(guarded) as ws:
        done = await exchange(ws, json.dumps({"code": "#" + "x" * 70000}))
        assert done["status"] == "rejected" and "SANDBOX_MAX_MESSAGE_BYTES" in str(done["message"])
        await assert_still_usable(ws)


async def test_uploads_over_the_size_limit_are_rejected(guarded: Server) -> None:
    import base64

    data = base64.b64encode(b"x" * 2048).decode()
    async with connect(guarded) as ws:
        done = await exchange(ws, json.dumps({"code": "1", "files": [{"path": "a", "data": data}]}))
        assert done["status"] == "rejected" and "SANDBOX_MAX_UPLOAD_BYTES" in str(done["message"])


async def test_a_duplicate_id_while_the_first_runs_is_rejected_without_disturbing_it(guarded: Server) -> None:
    async with connect(guarded) as ws:
        # The first runs until it reads a line, sent only once the duplicate has been answered.
        await ws.send(json.dumps({"id": "same", "code": "print(input())"}))
        await ws.send(json.dumps({"id": "same", "code": "print('second')"}))
        frames: list[dict[str, Any]] = []
        while len([f for f in frames if f["type"] == "done"]) < 2:
            frames.append(json.loads(await ws.recv()))
            if frames[-1]["type"] == "done" and len([f for f in frames if f["type"] == "done"]) == 1:
                await ws.send(json.dumps({"type": "stdin", "id": "same", "data": "first\n"}))
    dones = [f for f in frames if f["type"] == "done"]
    assert dones[0]["status"] == "rejected" and "already in use" in dones[0]["message"]
    assert dones[1]["status"] == "ok"
    assert "".join(f["text"] for f in frames if f["type"] == "stream") == "first\n"


@pytest.mark.parametrize("token", [None, "wrong-token-value"])
async def test_a_missing_or_wrong_token_gets_401_before_the_upgrade(
    guarded: Server, token: str | None
) -> None:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession() as http:
        async with http.get(guarded.http + "/exec", headers=headers) as resp:
            assert resp.status == 401
    with pytest.raises(websockets.InvalidStatus) as err:
        async with connect(guarded, token):
            pass
    assert err.value.response.status_code == 401


async def test_healthz_stays_open_without_a_token(guarded: Server) -> None:
    assert guarded.get("/healthz")[0] == 200


async def test_the_server_token_never_reaches_the_logs(guarded: Server) -> None:
    async with connect(guarded) as ws:
        await assert_still_usable(ws)
    assert TOKEN not in guarded.logs()
