"""Live approval of egress (`"egress": {"ask": true}`): one run's pending asks and the client's
answers to them.

The egress proxy asks here when a flow is refused by the request's own allowlist alone
(appliance.core.egress.decide_name marks it askable). An answer remembered for the run or
the session settles it at once; else, when a client that can answer follows the run, an
`EgressAsked` event goes out (the api layer frames it as `egress_request`) and the flow
waits, at most `wait_s`, for `decide` (the client's `egress_decision`). Every way it can go
unanswered is a refusal saying why: the time is up, the client went, the cell ended, nobody
that can answer follows the run (REST, MCP), or the run's bounds (MAX_PENDING_ASKS hosts
waiting at once, MAX_ASKS asks in all) are reached. Connections to a host already waiting
join its ask rather than ask again.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable
from dataclasses import dataclass

from appliance.core.egress import MAX_ASKS, RUN, SESSION, Answer, Approvals, ask_refusal
from appliance.core.errors import RequestRejected
from appliance.core.events import EgressAsked, Emit

MAX_DECIDED = MAX_ASKS  # decided flow ids kept, to tell "already decided" from "unknown"


@dataclass
class _Pending:
    flow: str
    host: str
    port: int
    future: asyncio.Future[Answer]


class EgressAsks:
    """One run's asks. `answerable` says whether a client that can answer follows the run now."""

    def __init__(self, emit: Emit, wait_s: float, answerable: Callable[[], bool]) -> None:
        self._emit = emit
        self.wait_s = wait_s
        self._answerable = answerable
        self.run = Approvals(RUN)
        self.session: Approvals | None = None  # the session's, when the run is a session's cell
        self._pending: dict[str, _Pending] = {}  # flow id -> ask
        self._by_host: dict[tuple[str, int], _Pending] = {}
        self._decided: dict[str, str] = {}  # flow id -> what became of it
        self.asked = 0
        self.closed = False

    def knows(self, flow: str) -> bool:
        return flow in self._pending or flow in self._decided

    async def ask(self, host: str, port: int) -> tuple[Answer, str | None]:
        """The answer for host:port, and the flow id it was asked under (None: not asked)."""
        for remembered in (self.run, self.session):
            answer = remembered.answer(host, port) if remembered is not None else None
            if answer is not None:
                return answer, None
        if self.closed:
            return Answer(False, why="the cell ended"), None
        waiting = self._by_host.get((host, port))
        if waiting is None:
            refusal = ask_refusal(len(self._by_host), self.asked, self._answerable())
            if refusal is not None:
                return Answer(False, why=refusal), None
            waiting = self._open(host, port)
            try:
                await self._emit(EgressAsked(waiting.flow, host, port, int(self.wait_s * 1000)))
            except Exception:  # noqa: BLE001 (whatever stopped the frame, nobody can answer it)
                self._settle(waiting, Answer(False, why="the client could not be asked"), "unasked")
        try:
            async with asyncio.timeout(self.wait_s):
                answer = await asyncio.shield(waiting.future)
        except TimeoutError:
            late = f"no answer within SANDBOX_EGRESS_ASK_MS ({int(self.wait_s * 1000)} ms)"
            self._settle(waiting, Answer(False, why=late), "timed out")
            answer = waiting.future.result()  # the refusal, or an answer that came at the same turn
        return answer, waiting.flow

    def _open(self, host: str, port: int) -> _Pending:
        flow = "f-" + secrets.token_hex(8)
        pending = _Pending(flow, host, port, asyncio.get_running_loop().create_future())
        self._pending[flow] = pending
        self._by_host[(host, port)] = pending
        self.asked += 1
        return pending

    def _settle(self, pending: _Pending, answer: Answer, what: str) -> None:
        if self._pending.pop(pending.flow, None) is None:
            return
        if self._by_host.get((pending.host, pending.port)) is pending:
            del self._by_host[(pending.host, pending.port)]
        if len(self._decided) < MAX_DECIDED:
            self._decided[pending.flow] = what
        if not pending.future.done():
            pending.future.set_result(answer)

    def decide(self, flow: str, allow: bool, scope: str) -> None:
        """The client's answer; RequestRejected (and nothing changes) for a flow this run does
        not wait on."""
        pending = self._pending.get(flow)
        if pending is None:
            what = self._decided.get(flow)
            if what is not None:
                raise RequestRejected(f"egress request {flow!r} was already decided ({what})")
            raise RequestRejected(f"no egress request {flow!r} waits for a decision")
        if scope not in (RUN, SESSION):
            raise RequestRejected('\'scope\' must be "run" or "session"')
        if scope == SESSION and self.session is None:
            scope = RUN  # a one-shot run is its own session
        remembered = self.session if scope == SESSION and self.session is not None else self.run
        remembered.remember(pending.host, pending.port, allow)
        if allow:
            answer = Answer(True, rule=f"approved by the client for the {scope}")
        else:
            answer = Answer(False, why=f"the client denied it for the {scope}")
        self._settle(pending, answer, "allowed" if allow else "denied")

    def orphaned(self) -> None:
        """Nobody that can answer follows the run any more: every pending ask is refused now."""
        self._refuse_all("the client that could answer went away", "its client went away")

    def close(self) -> None:
        """The cell is over: nothing more is asked, and what waits is refused."""
        self.closed = True
        self._refuse_all("the cell ended", "the cell ended")

    def _refuse_all(self, why: str, what: str) -> None:
        for pending in list(self._pending.values()):
            self._settle(pending, Answer(False, why=why), what)
