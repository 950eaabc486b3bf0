"""Sessions are bound to the credential that opened them (checked in-process, real jails)."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator

import pytest

from appliance.api.frames import framed
from appliance.core.service import RunService
from appliance.core.tenants import owner_of
from appliance.runtime.lifecycle import build_service
from appliance.settings import from_env
from appliance.wire import protocol

# Starts the server's lifecycle in process (jails, root): never in the fast tier (tests/tiers.py).
pytestmark = pytest.mark.host


@pytest.fixture
async def appliance() -> AsyncIterator[RunService]:
    app = build_service(
        from_env({"SANDBOX_PRELOAD": "", "SANDBOX_POOL_SIZE": "0", "SANDBOX_PYTHON": sys.executable})
    )
    await app.start(canary_port=0)
    yield app
    await app.close()


async def run(app: RunService, owner: str, code: str, session: str | None) -> list[protocol.Frame]:
    frames: list[protocol.Frame] = []

    async def collect(frame: protocol.Frame) -> None:
        frames.append(frame)

    req = protocol.ExecuteRequest(id="t", code=code, session=session)
    await app.execute(req, owner, framed(req.id, collect))
    return frames


async def test_another_owners_session_looks_exactly_like_a_missing_one(appliance: RunService) -> None:
    alice, mallory = owner_of("alice-token"), owner_of("mallory-token")
    opened = await run(appliance, alice, "secret = 'alice only'", "new")
    sid = opened[-1]["session"]
    assert opened[-1]["status"] == "ok" and isinstance(sid, str)
    theirs = (await run(appliance, mallory, "secret", sid))[-1]
    missing = (await run(appliance, mallory, "secret", "f" * 32))[-1]
    assert theirs["status"] == missing["status"] == "rejected"
    assert str(theirs["message"]).replace(sid, "X") == str(missing["message"]).replace("f" * 32, "X")
    assert not await appliance.close_session(sid, mallory)
    mine = await run(appliance, alice, "secret", sid)
    assert mine[-2]["data"] == {"text/plain": "'alice only'"}
    assert await appliance.close_session(sid, alice)
