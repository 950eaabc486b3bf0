"""`until_gone`: a handler learns that its client's connection closed within GONE_POLL_S,
all waiting requests checked by one timer of the event loop (appliance.api.transport)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import cast

from aiohttp import web

from appliance.api import transport
from appliance.api.transport import GONE_POLL_S, until_gone


@dataclass
class FakeTransport:
    closing: bool = False

    def is_closing(self) -> bool:
        return self.closing


@dataclass
class FakeRequest:
    transport: FakeTransport | None = field(default_factory=FakeTransport)


def request(fake: FakeRequest) -> web.Request:
    return cast(web.Request, fake)


async def test_only_the_request_whose_connection_closed_returns() -> None:
    a, b = FakeRequest(), FakeRequest()
    wait_a = asyncio.create_task(until_gone(request(a)))
    wait_b = asyncio.create_task(until_gone(request(b)))
    await asyncio.sleep(0)
    assert a.transport is not None
    a.transport.closing = True
    await asyncio.wait_for(wait_a, 10 * GONE_POLL_S)
    assert not wait_b.done()
    b.transport = None  # aiohttp drops the transport of a finished connection
    await asyncio.wait_for(wait_b, 10 * GONE_POLL_S)


async def test_a_request_gone_already_returns_at_once() -> None:
    await asyncio.wait_for(until_gone(request(FakeRequest(transport=None))), GONE_POLL_S / 2)


async def test_a_cancelled_wait_leaves_nothing_polled_and_the_timer_stops() -> None:
    waiting = asyncio.create_task(until_gone(request(FakeRequest())))
    await asyncio.sleep(0)
    watch = transport._WATCHES[asyncio.get_running_loop()]
    assert watch._waiting and watch._timer is not None
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    assert not watch._waiting
    done = FakeRequest()
    other = asyncio.create_task(until_gone(request(done)))
    await asyncio.sleep(0)
    assert done.transport is not None
    done.transport.closing = True
    await asyncio.wait_for(other, 10 * GONE_POLL_S)
    assert not watch._waiting and watch._timer is None  # the last tick found none to poll
