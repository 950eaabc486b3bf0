"""Which E2B sandboxes live, whose they are, and when they end; pure (the clock is passed in).

A sandbox holds one or more code contexts, each an appliance session (one jail, its own
interpreter). A sandbox is found only by its owner (control API) or by its id together with
its access token (sandbox traffic); anything else reads as missing, so another tenant's
sandbox looks exactly like one that never existed.
"""

from __future__ import annotations

import asyncio
import hmac
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Context:
    id: str
    session: str  # the appliance session that holds its interpreter
    cwd: str
    executions: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one call at a time, as a kernel


@dataclass
class Sandbox:
    id: str
    owner: str
    template: str
    token: str
    started_at: float  # wall clock, seconds
    end_at: float
    metadata: dict[str, str]
    envs: dict[str, str]
    default: str = ""  # the default context's id
    gpu_mb: int = 0  # the GPU budget each of its contexts asks for (metadata gpu_memory_mb; 0: none)
    # Paused: the snapshot its default context was kept as, its jails ended (None: running).
    paused: str | None = None
    paused_executions: int = 0  # the default context's execution count, carried over a pause
    # Pause, resume and kill one at a time: a kill waits for a pause, so no snapshot is left behind.
    transition: asyncio.Lock = field(default_factory=asyncio.Lock)
    contexts: dict[str, Context] = field(default_factory=dict)
    # Set once the sandbox is gone or paused: what lives as long as its jail does (envd's
    # watchers and process streams) ends with it. A resume starts a new one.
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    on_end: list[Callable[[], None]] = field(default_factory=list)  # called once, as it ends

    @property
    def state(self) -> str:
        return "running" if self.paused is None else "paused"


def new_id() -> str:
    return secrets.token_hex(10)  # 80 random bits; the access token holds 256 more


def new_token() -> str:
    return secrets.token_urlsafe(32)


class Registry:
    def __init__(self) -> None:
        self._live: dict[str, Sandbox] = {}

    def __len__(self) -> int:
        return len(self._live)

    def add(self, sandbox: Sandbox) -> None:
        self._live[sandbox.id] = sandbox

    def owned(self, sandbox_id: str, owner: str) -> Sandbox | None:
        found = self._live.get(sandbox_id)
        if found is None or not hmac.compare_digest(found.owner, owner):
            return None
        return found

    def reached(self, sandbox_id: str, token: str | None) -> Sandbox | None:
        """The sandbox sandbox traffic names, when its access token matches (constant time)."""
        found = self._live.get(sandbox_id)
        if found is None or token is None or not hmac.compare_digest(found.token.encode(), token.encode()):
            return None
        return found

    def of_owner(self, owner: str) -> list[Sandbox]:
        return [s for s in self._live.values() if hmac.compare_digest(s.owner, owner)]

    def remove(self, sandbox_id: str) -> Sandbox | None:
        return self._live.pop(sandbox_id, None)

    def expired(self, now: float) -> list[Sandbox]:
        return [s for s in self._live.values() if s.end_at <= now]

    def all(self) -> list[Sandbox]:
        return list(self._live.values())


@dataclass(frozen=True)
class SnapshotEntry:
    """An E2B snapshot: a session snapshot of a sandbox's default context, kept in the run
    service's store under the same id (so it counts against SANDBOX_MAX_SNAPSHOTS there)."""

    id: str
    owner: str
    sandbox_id: str  # the sandbox it was taken of
    name: str  # the name the caller gave ("" for none)
    created: float


class SnapshotBook:
    """Each tenant's E2B snapshots, newest last. Bounded by the store's per-tenant quota: an
    entry is added only once the store has kept the snapshot."""

    def __init__(self) -> None:
        self._of: dict[str, dict[str, SnapshotEntry]] = {}

    def add(self, entry: SnapshotEntry) -> None:
        self._of.setdefault(entry.owner, {})[entry.id] = entry

    def of_owner(self, owner: str) -> list[SnapshotEntry]:
        return sorted(self._of.get(owner, {}).values(), key=lambda e: (e.created, e.id))

    def find(self, owner: str, ref: str) -> SnapshotEntry | None:
        """A tenant's snapshot by id, or the newest one of that name; None for anything else
        (another tenant's id too)."""
        mine = self._of.get(owner, {})
        if ref in mine:
            return mine[ref]
        named = [e for e in self.of_owner(owner) if e.name and e.name == ref]
        return named[-1] if named else None

    def remove(self, owner: str, snapshot_id: str) -> SnapshotEntry | None:
        mine = self._of.get(owner, {})
        entry = mine.pop(snapshot_id, None)
        if not mine:
            self._of.pop(owner, None)
        return entry
