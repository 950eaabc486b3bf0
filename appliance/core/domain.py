"""The run service's own data: a run request and how a cell ended.

A request reaches the core as any object of `RunRequest`'s shape: the wire's `ExecuteRequest`
is one (the api layer hands it over as it parsed it, not copied), `Request` is the core's
own, for the runs it makes itself (a session's first cell, the canary, the MPS probe). What
a run tells its caller are the events of `appliance.core.events`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from appliance.core.egress import Flow


class Upload(Protocol):
    """A file the request writes into the run's working directory before the code starts."""

    @property
    def path(self) -> str: ...

    @property
    def data(self) -> bytes: ...


class GpuAsk(Protocol):
    """The GPU share a request asks for."""

    @property
    def memory_mb(self) -> int: ...


class EgressAsk(Protocol):
    """The hosts a request narrows its run's egress to (names mode), as `host:port` rules
    (None: not narrowed), and whether a host left out is asked about rather than refused."""

    @property
    def allow(self) -> Sequence[str] | None: ...

    @property
    def ask(self) -> bool: ...


class RunRequest(Protocol):
    """What a run is asked to do; validated already (the codec refuses what breaks a limit)."""

    @property
    def id(self) -> str: ...

    @property
    def code(self) -> str: ...

    @property
    def session(self) -> str | None: ...

    @property
    def timeout_ms(self) -> int | None: ...

    @property
    def files(self) -> Sequence[Upload]: ...

    @property
    def gpu(self) -> GpuAsk | None: ...

    @property
    def stdin_eof(self) -> bool: ...

    @property
    def memory_mb(self) -> int | None:
        """A memory limit below SANDBOX_MEMORY_MB for this run (or the session it opens)."""

    @property
    def from_snapshot(self) -> str | None:
        """A snapshot id: the new session this request opens starts from it."""

    @property
    def egress(self) -> EgressAsk | None: ...


@dataclass(frozen=True, slots=True)
class File:
    path: str
    data: bytes


@dataclass(frozen=True, slots=True)
class Gpu:
    memory_mb: int


@dataclass(frozen=True, slots=True)
class Request:
    """A run request the core makes itself (a `RunRequest`)."""

    id: str
    code: str
    session: str | None = None
    timeout_ms: int | None = None
    files: Sequence[Upload] = ()
    gpu: GpuAsk | None = None
    stdin_eof: bool = False
    memory_mb: int | None = None
    from_snapshot: str | None = None
    egress: EgressAsk | None = None


@dataclass
class CellOutcome:
    """How one cell ended: what its `done` reports."""

    status: str
    exit_code: int | None = None
    cpu_ms: int | None = None
    max_rss_mb: float | None = None
    message: str | None = None
    interpreter_alive: bool = True
    output_bytes: int = 0
    import_ms: int | None = None
    files_skipped: int | None = None  # outputs/ files not returned (SANDBOX_MAX_OUTPUTS_BYTES)
    egress: tuple[Flow, ...] | None = None  # names mode: the cell's flows through the egress proxy
    egress_omitted: int | None = None  # flows past the ledger's bound


class PipeFull(Exception):
    """A bounded write would have buffered more than its limit for the jail's driver."""
