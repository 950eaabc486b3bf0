"""Stateful sessions: a leased jail kept across requests, bound to the token that opened it.

Between cells a session holds only its interpreter, frozen: the driver kills every process a
cell left behind before that cell's `done`, and the server freezes the jail's cgroup (and kills
what a thread started meanwhile) before it sends it (`Jail.freeze`), so threads the interpreter
keeps run only in a cell. What the interpreter keeps (files, memory) stays under watch: `check` runs on every idle session each CHECK_S, and a session it finds over
a limit is ended; its next request learns why.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from appliance.core.egress import SESSION, Approvals
from appliance.core.errors import Busy, RequestRejected, UnknownSession
from appliance.core.ports import Clock, Jail, Lease
from appliance.core.tasks import TaskScope, cancel_and_wait, checkpoint

log = logging.getLogger("appliance.core.sessions")

CHECK_S = 1.0
REMEMBER_ENDED = 1024  # why recently ended sessions ended, for their next request


@dataclass
class Session:
    id: str
    owner: str
    lease: Lease
    jail: Jail
    last_used: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Called once the session's jail and lease are gone (a tenant's GPU quota, for one).
    on_close: list[Callable[[], None]] = field(default_factory=list)
    # The client's egress answers given with "scope": "session" (live approval).
    egress_approvals: Approvals = field(default_factory=lambda: Approvals(SESSION))

    @property
    def gpu_mb(self) -> int:
        """The GPU budget this session holds for its whole life (0: none)."""
        return self.lease.gpu.memory_mb if self.lease.gpu is not None else 0


Check = Callable[[Session], Awaitable[str | None]]


class SessionRegistry:
    """Live sessions; at most `limit`; each ends after `idle_s` without a request."""

    def __init__(
        self,
        limit: int,
        idle_s: float,
        check: Check | None = None,
        owner_limits: dict[str, int] | None = None,
        *,
        clock: Clock = time.monotonic,
    ) -> None:
        self.limit = limit
        self.clock = clock
        self.idle_s = idle_s
        self.owner_limits = owner_limits or {}  # per-tenant max_sessions (appliance.core.tenants)
        self._check = check
        self._sessions: dict[str, Session] = {}
        self._ended: OrderedDict[str, tuple[str, str]] = OrderedDict()  # id -> (owner, why)
        self._reaper: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self._sessions)

    def gpu_held(self) -> tuple[int, int]:
        """(sessions holding a GPU budget, MiB they hold together)."""
        held = [s.gpu_mb for s in self._sessions.values() if s.gpu_mb > 0]
        return len(held), sum(held)

    def start(self, owner: TaskScope) -> None:
        if self._reaper is None:
            self._reaper = owner.spawn(self._watch_idle(), name="session-reaper")

    def check_capacity(self, owner: str | None = None) -> None:
        if len(self._sessions) >= self.limit:
            raise RequestRejected(f"too many sessions (SANDBOX_MAX_SESSIONS={self.limit}); close one first")
        quota = self.owner_limits.get(owner) if owner is not None else None
        if quota is not None and sum(1 for s in self._sessions.values() if s.owner == owner) >= quota:
            raise Busy(f"this tenant is at its session quota (max_sessions={quota}); close one first")

    def add(self, owner: str, lease: Lease, jail: Jail) -> Session:
        self.check_capacity(owner)
        session = Session(
            id=secrets.token_hex(16), owner=owner, lease=lease, jail=jail, last_used=self.clock()
        )  # 128 random bits
        self._sessions[session.id] = session
        return session

    def get(self, session_id: str, owner: str) -> Session:
        session = self._sessions.get(session_id)
        # Another owner's session is reported exactly like a missing one.
        if session is None or not hmac.compare_digest(session.owner, owner):
            ended = self._ended.get(session_id)
            if ended is not None and hmac.compare_digest(ended[0], owner):
                raise UnknownSession(f"session {session_id} has ended: {ended[1]}")
            raise UnknownSession(f"no such session {session_id!r} (it may have expired or been closed)")
        return session

    async def close(self, session_id: str, owner: str | None = None, reason: str | None = None) -> bool:
        """End a session and its jail; `reason` is told to its next request."""
        session = self._sessions.get(session_id)
        if session is None or (owner is not None and not hmac.compare_digest(session.owner, owner)):
            return False
        del self._sessions[session_id]
        if reason is not None:
            self._ended[session_id] = (session.owner, reason)
            while len(self._ended) > REMEMBER_ENDED:
                self._ended.popitem(last=False)
        try:
            await session.lease.end()
        finally:
            for release in session.on_close:
                release()
        return True

    async def _watch_idle(self) -> None:
        while True:
            checkpoint()
            await asyncio.sleep(min(CHECK_S, self.idle_s / 2))
            now = self.clock()
            for session in list(self._sessions.values()):
                if session.lock.locked():
                    continue  # a cell runs: its own watchdogs hold the limits
                if now - session.last_used > self.idle_s:
                    await self.close(session.id, reason="it was idle too long (SANDBOX_SESSION_IDLE_S)")
                    continue
                why = await self._check(session) if self._check is not None else None
                if why is not None and not session.lock.locked() and session.id in self._sessions:
                    log.warning("session ended between cells", extra={"session": session.id, "reason": why})
                    await self.close(session.id, reason=why)

    async def close_all(self) -> None:
        if self._reaper is not None:
            await cancel_and_wait(self._reaper)
        for session_id in list(self._sessions):
            await self.close(session_id)
