"""Live egress approval's pure and in-process parts: which refusals may be asked about, one
run's asks (appliance.core.egressask) and their bounds, the wire's decision frame. The real
thing, with jails and a client answering, is in tests/test_egress_ask_live.py."""

from __future__ import annotations

import asyncio
import json

import pytest

from appliance.core.egress import (
    MAX_ASKS,
    MAX_PENDING_ASKS,
    SESSION,
    Answer,
    Approvals,
    Layers,
    Rule,
    decide_name,
)
from appliance.core.egressask import EgressAsks
from appliance.core.errors import RequestRejected
from appliance.core.events import EgressAsked, Event
from appliance.wire import protocol

SERVER = (Rule("api.example.com", 443), Rule("example.org", 443, wildcard=True))
LIMITS = protocol.Limits(1 << 20, 1 << 20)


def test_only_the_requests_own_layer_can_be_asked_about() -> None:
    tenant = ("tenant", (Rule("api.example.com", 443), Rule("a.example.org", 443)))
    request = ("request", (Rule("api.example.com", 443),))
    layers = Layers(SERVER, (tenant, request), ask=True)
    assert decide_name(layers, "api.example.com", 443).allowed
    asked = decide_name(layers, "a.example.org", 443)  # the server and tenant allow it
    assert not asked.allowed and asked.askable and "request's allowlist" in str(asked.why)
    assert not decide_name(layers, "b.example.org", 443).askable  # the tenant's list refuses it
    assert not decide_name(layers, "other.test", 443).askable  # the server's list refuses it
    assert not decide_name(layers, "a.example.org", 80).askable
    assert not decide_name(Layers(SERVER, (tenant, request)), "a.example.org", 443).askable  # no ask


class Asking:
    """One run's asks with a recorded emit and a switch for whether a client follows it."""

    def __init__(self, wait_s: float = 30.0) -> None:
        self.told: list[EgressAsked] = []
        self.told_one = asyncio.Event()
        self.following = True
        self.asks = EgressAsks(self.emit, wait_s, lambda: self.following)

    async def emit(self, event: Event) -> None:
        assert isinstance(event, EgressAsked)
        self.told.append(event)
        self.told_one.set()

    async def asked(
        self, host: str, port: int = 443
    ) -> tuple[asyncio.Task[tuple[Answer, str | None]], EgressAsked]:
        self.told_one.clear()
        before = len(self.told)
        task: asyncio.Task[tuple[Answer, str | None]] = asyncio.create_task(self.asks.ask(host, port))
        await self.told_one.wait()
        assert len(self.told) == before + 1
        return task, self.told[-1]


async def test_an_allowed_ask_goes_on_and_is_remembered_for_the_run() -> None:
    a = Asking()
    task, told = await a.asked("x.example.org")
    assert (told.host, told.port, told.timeout_ms) == ("x.example.org", 443, 30000)
    assert told.flow.startswith("f-") and a.asks.knows(told.flow)
    a.asks.decide(told.flow, True, "run")
    answer, flow = await task
    assert answer.allow and answer.rule == "approved by the client for the run" and flow == told.flow
    again, flow = await a.asks.ask("x.example.org", 443)  # remembered: not asked again
    assert again.allow and flow is None and len(a.told) == 1


async def test_a_denial_and_a_decision_for_an_unknown_or_decided_flow() -> None:
    a = Asking()
    with pytest.raises(RequestRejected, match="no egress request 'f-nope' waits"):
        a.asks.decide("f-nope", True, "run")
    task, told = await a.asked("x.example.org")
    a.asks.decide(told.flow, False, "run")
    answer, _ = await task
    assert not answer.allow and answer.why == "the client denied it for the run"
    with pytest.raises(RequestRejected, match=r"already decided \(denied\)"):
        a.asks.decide(told.flow, True, "run")  # changes nothing:
    assert not (await a.asks.ask("x.example.org", 443))[0].allow


async def test_no_answer_in_time_is_a_denial_that_says_so() -> None:
    a = Asking(wait_s=0.05)
    answer, flow = await a.asks.ask("x.example.org", 443)
    assert not answer.allow and "no answer within SANDBOX_EGRESS_ASK_MS (50 ms)" in str(answer.why)
    assert flow is not None
    with pytest.raises(RequestRejected, match="already decided"):
        a.asks.decide(flow, True, "run")


async def test_the_client_going_refuses_what_waits_and_nothing_is_asked_without_one() -> None:
    a = Asking()
    task, _ = await a.asked("x.example.org")
    joined = asyncio.create_task(a.asks.ask("x.example.org", 443))  # a second connection joins
    await asyncio.sleep(0)
    a.following = False
    a.asks.orphaned()
    for waiting in (task, joined):
        answer, _ = await waiting
        assert not answer.allow and answer.why == "the client that could answer went away"
    later, flow = await a.asks.ask("y.example.org", 443)
    assert not later.allow and "no client that can answer" in str(later.why) and flow is None
    assert len(a.told) == 1


async def test_pending_and_total_asks_are_bounded() -> None:
    a = Asking()
    waiting = [(await a.asked(f"h{i}.example.org"))[0] for i in range(MAX_PENDING_ASKS)]
    over, _ = await a.asks.ask("more.example.org", 443)
    assert not over.allow and f"{MAX_PENDING_ASKS} hosts already wait" in str(over.why)
    a.asks.close()
    for task in waiting:
        answer, _ = await task
        assert answer.why == "the cell ended"
    b = Asking()
    for i in range(MAX_ASKS):
        task, told = await b.asked(f"h{i}.example.org")
        b.asks.decide(told.flow, False, "run")
        await task
    last, _ = await b.asks.ask("last.example.org", 443)
    assert not last.allow and f"asked the client about {MAX_ASKS} hosts" in str(last.why)
    assert len(b.told) == MAX_ASKS


async def test_a_session_answer_holds_for_the_sessions_later_cells() -> None:
    session = Approvals(SESSION)
    first = Asking()
    first.asks.session = session
    task, told = await first.asked("x.example.org")
    first.asks.decide(told.flow, True, "session")
    assert (await task)[0].allow
    later = Asking()  # the session's next cell
    later.asks.session = session
    answer, flow = await later.asks.ask("x.example.org", 443)
    assert answer.allow and answer.rule == "approved by the client for the session" and flow is None
    assert not later.told
    one_shot = Asking()  # not a session's cell: "session" keeps it for the run
    task, told = await one_shot.asked("x.example.org")
    one_shot.asks.decide(told.flow, True, "session")
    assert (await task)[0].allow
    assert (await one_shot.asks.ask("x.example.org", 443))[0].allow


def test_the_decision_frame_parses_and_a_bad_one_is_named() -> None:
    frame = {"type": "egress_decision", "flow": "f-1", "allow": True, "scope": "session", "id": "d1"}
    parsed = protocol.parse_client_frame(json.dumps(frame), LIMITS)
    assert isinstance(parsed, protocol.EgressDecisionMessage)
    assert (parsed.flow, parsed.allow, parsed.scope, parsed.id) == ("f-1", True, "session", "d1")
    for bad, said in (
        ({"type": "egress_decision", "allow": True}, "needs a 'flow'"),
        ({"type": "egress_decision", "flow": "f-1", "allow": "yes"}, "needs 'allow'"),
        ({"type": "egress_decision", "flow": "f-1", "allow": True, "scope": "forever"}, "'scope' must be"),
    ):
        with pytest.raises(protocol.ProtocolError, match=said):
            protocol.parse_client_frame(json.dumps(bad), LIMITS)
    ask = protocol.parse_client_frame(json.dumps({"code": "1", "egress": {"ask": True}}), LIMITS)
    assert isinstance(ask, protocol.ExecuteRequest) and ask.egress is not None
    assert ask.egress.ask and ask.egress.allow is None
