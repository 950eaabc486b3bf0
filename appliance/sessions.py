"""Stateful sessions: a jail kept across requests, bound to the token that opened it."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass, field

from appliance.errors import Busy, RequestRejected
from appliance.jail.jail import Jail


def owner_of(token: str | None) -> str:
    """A stable, non-reversible name for the credential that made a request."""
    return hashlib.sha256((token or "").encode()).hexdigest()


@dataclass
class Session:
    id: str
    owner: str
    jail: Jail
    last_used: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class SessionRegistry:
    """Live sessions; at most `limit`; each ends after `idle_s` without a request."""

    def __init__(self, limit: int, idle_s: float) -> None:
        self.limit = limit
        self.idle_s = idle_s
        self._sessions: dict[str, Session] = {}
        self.owner_limits: dict[str, int] = {}  # per-tenant max_sessions (appliance.tenants)
        self._reaper: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self._sessions)

    def start(self) -> None:
        if self._reaper is None:
            self._reaper = asyncio.create_task(self._reap_idle(), name="session-reaper")

    def check_capacity(self, owner: str | None = None) -> None:
        if len(self._sessions) >= self.limit:
            raise RequestRejected(f"too many sessions (SANDBOX_MAX_SESSIONS={self.limit}); close one first")
        quota = self.owner_limits.get(owner) if owner is not None else None
        if quota is not None and sum(1 for s in self._sessions.values() if s.owner == owner) >= quota:
            raise Busy(f"this tenant is at its session quota (max_sessions={quota}); close one first")

    def add(self, owner: str, jail: Jail) -> Session:
        self.check_capacity(owner)
        session = Session(id=secrets.token_hex(16), owner=owner, jail=jail)  # 128 random bits
        self._sessions[session.id] = session
        return session

    def get(self, session_id: str, owner: str) -> Session:
        session = self._sessions.get(session_id)
        # Another owner's session is reported exactly like a missing one.
        if session is None or not hmac.compare_digest(session.owner, owner):
            raise RequestRejected(f"no such session {session_id!r} (it may have expired or been closed)")
        return session

    async def close(self, session_id: str, owner: str | None = None) -> bool:
        session = self._sessions.get(session_id)
        if session is None or (owner is not None and not hmac.compare_digest(session.owner, owner)):
            return False
        del self._sessions[session_id]
        await session.jail.destroy()
        return True

    async def _reap_idle(self) -> None:
        while True:
            await asyncio.sleep(min(5.0, self.idle_s / 2))
            now = time.monotonic()
            for session in list(self._sessions.values()):
                if not session.lock.locked() and now - session.last_used > self.idle_s:
                    await self.close(session.id)

    async def close_all(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        for session_id in list(self._sessions):
            await self.close(session_id)
