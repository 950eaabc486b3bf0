"""What the run service stands on, as interfaces: the composition root
(appliance.runtime.lifecycle.build_service) gives it the real ones, tests give it fakes.

Each is the narrowest shape the service uses: it never sees a firejail, a cgroup, a pipe,
a Prometheus registry or the wire codec, only these. What it says to a caller are the
events of appliance.core.events, which the api layer spells as frames.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from appliance.core.domain import CellOutcome, RunRequest
from appliance.core.egress import Narrowing
from appliance.core.egressask import EgressAsks
from appliance.core.egresssecrets import Secrets
from appliance.core.errors import RequestRejected
from appliance.core.events import Emit, GpuShare, Started

Clock = Callable[[], float]  # monotonic seconds (time.monotonic)


# -- jails -------------------------------------------------------------------------------------
class JailProcess(Protocol):
    """The jail's interpreter, as the service reaches it between the sandbox's own steps."""

    def write(self, data: bytes, limit: int | None = None) -> None:
        """Queue channel bytes for the driver; PipeFull past `limit`, OSError once it is gone."""

    def interrupt(self, reason: str) -> None:
        """Ask the current cell to stop (it ends `cancelled`)."""

    async def kill(self) -> None:
        """Kill every process of the jail and reap them."""


@dataclass(frozen=True)
class Workspace:
    """A jail's working directory as the server reaches it from outside (E2B's files).

    Everything in it is the jailed code's to arrange, links and renames included: whoever
    holds one walks it by descriptor and follows nothing (appliance.sandbox.fstree)."""

    fd: int  # a descriptor of the run directory of the caller's own, to close when done
    dev: int  # the run directory's filesystem: nothing on another one is entered
    uid: int  # the uid the jail's code runs as: what it makes is its own
    gid: int


class HeldWorkspace(Protocol):
    """A jail's working directory that outlives the jail until `release` (`Jail.hold_workspace`)."""

    @property
    def workspace(self) -> Workspace: ...

    @property
    def jail_ended(self) -> bool:
        """Whether the jail has ended: every process of it killed, and the launcher reaped."""

    async def release(self) -> None:
        """Close the descriptor; a jail that has ended has its directory removed now. Idempotent;
        the removal is under way even if the caller is cancelled as it waits."""


class Jail(Protocol):
    """A leased jail: single-use, unless a session keeps it (frozen between its cells)."""

    @property
    def alive(self) -> bool: ...

    @property
    def process(self) -> JailProcess: ...

    def thaw(self) -> None: ...

    async def freeze(self) -> None:
        """Stop everything in the jail until `thaw`; JailFailure when it cannot."""

    def limit_memory(self, memory_mb: int) -> None:
        """Lower the jail's memory limit (its cgroup) to memory_mb for the rest of its life;
        never raises it. RequestRejected when the kernel cannot enforce it (no cgroup, or
        the jail already holds more), before anything of the run's code ran."""

    def open_workspace(self) -> Workspace | None:
        """A new descriptor of the jail's working directory, with its owner; None when the
        jail is gone or never had its directory open."""

    def hold_workspace(self) -> HeldWorkspace | None:
        """`open_workspace`, and the directory kept past the jail's end until the hold is
        released (what a time-limited run left is read after it: SandboxFusion's fetch)."""


class Lease(Protocol):
    """One run's (or session's) hold on a jail and on what it costs (a GPU grant)."""

    @property
    def profile(self) -> str: ...

    @property
    def queued_ms(self) -> int: ...

    @property
    def gpu(self) -> GpuShare | None:
        """The GPU share the lease holds (None: a CPU run)."""

    async def take(self) -> Jail:
        """The lease's ready jail (called once, inside the run's admission slot)."""

    def keep(self) -> None:
        """A session holds the lease past the request; it calls `end` itself."""

    async def end(self) -> None:
        """Kill, reap and remove the jail, and hand back what it held; idempotent."""


class GpuBudget(Protocol):
    """What a run's GPU ask amounts to: the provisioner's answer (GPU mode's counts the ask or
    SANDBOX_GPU_DEFAULT_MB; without GPU mode every run is 0, `NoGpu`)."""

    def budget_mb(self, req: RunRequest) -> int:
        """MiB of GPU memory the run (or the session it opens) holds; 0: it gets no GPU."""


class NoGpu:
    """The service's default: no run holds GPU memory."""

    def budget_mb(self, req: RunRequest) -> int:
        return 0


class LeaseSource(Protocol):
    """Where runs take jails from (CPU pools, or GPU mode's device pools)."""

    def lease(self, req: RunRequest) -> contextlib.AbstractAsyncContextManager[Lease]:
        """Hold a lease for req (in line, where a GPU budget must wait); ended on leaving
        unless kept by a session."""


class OutputFile(Protocol):
    @property
    def path(self) -> str: ...

    @property
    def size(self) -> int: ...

    @property
    def data(self) -> bytes | None: ...

    @property
    def message(self) -> str | None: ...


class Outputs(Protocol):
    """A run's outputs/ files, read in batches; what was left out is known at the end."""

    def batches(self) -> AsyncGenerator[Sequence[OutputFile], None]: ...

    def note(self) -> str | None:
        """Why some files did not come back (for `done`), or None."""

    @property
    def skipped(self) -> int: ...


class Cells(Protocol):
    """The sandbox's work on a leased jail, for the run service."""

    def stdin_ops(self, data: str, eof: bool) -> list[bytes]:
        """Channel bytes that hand `data` (and an end of file) to the run's stdin."""

    async def run(  # noqa: PLR0913 (the cell, its limit and its hooks, keywords after the jail and request)
        self,
        jail: Jail,
        req: RunRequest,
        emit: Emit,
        *,
        timeout_ms: int,
        keep_alive: bool,
        started: Callable[[], None],
        first: Started,
        egress: Narrowing = (),
        egress_secrets: Secrets | None = None,
        asks: EgressAsks | None = None,
    ) -> CellOutcome:
        """Run req's code in the jail, `first` then its output events through emit, within
        the limits, its flows by name held to `egress` besides the server's allowlist (and
        their requests given `egress_secrets`' headers over the server's; a host only the
        request's list leaves out asked about through `asks`, when given); how it ended (its
        `Done` is the service's)."""

    async def between_cells(self, jail: Jail) -> str | None:
        """Why an idle session's jail must end now (a watchdog's verdict, over its disk
        quota), or None."""

    def has_outputs(self, jail: Jail) -> bool: ...

    async def snapshot(self, jail: Jail) -> object:
        """What outputs/ holds now, for `outputs` to send only what a cell changed."""

    def outputs(self, jail: Jail, before: object | None, owner: str, run_id: str) -> Outputs:
        """The new or changed outputs/ files (all, if before is None), kept where configured."""


# -- what the service stands on --------------------------------------------------------------
class Runtime(Protocol):
    """The long-lived machinery: host checks, pools, canary (appliance.runtime.lifecycle)."""

    @property
    def started(self) -> asyncio.Event: ...

    @property
    def leases(self) -> LeaseSource: ...

    def check_host(self) -> object:
        """Fail-closed startup checks: StartupError naming what to fix."""

    async def start(self, canary_port: int) -> None: ...

    async def close(self) -> None: ...

    def readiness(self) -> tuple[list[str], dict[str, Any]]:
        """(problems, details) for /readyz."""

    def update_gauges(self) -> None: ...


class ModelInfo(Protocol):
    def as_dict(self) -> dict[str, Any]: ...


Catalogue = Callable[[str], Sequence[ModelInfo]]  # the models a directory holds


# -- metrics -------------------------------------------------------------------------------------
class Gauge(Protocol):
    def set(self, value: float) -> None: ...


class Counter(Protocol):
    def inc(self, amount: float = 1) -> None: ...


class Histogram(Protocol):
    def observe(self, amount: float) -> None: ...


class CounterFamily(Protocol):
    def labels(self, *values: str, **labels: str) -> Counter: ...


class HistogramFamily(Protocol):
    def labels(self, *values: str, **labels: str) -> Histogram: ...


class Metrics(Protocol):
    """The series the service moves, and the rendering of them all (/metrics)."""

    @property
    def runs(self) -> CounterFamily: ...

    @property
    def run_seconds(self) -> Histogram: ...

    @property
    def queue_seconds(self) -> Histogram: ...

    @property
    def queue_depth(self) -> Gauge: ...

    @property
    def active_runs(self) -> Gauge: ...

    @property
    def bytes_streamed(self) -> Counter: ...

    @property
    def import_seconds(self) -> HistogramFamily: ...

    @property
    def sessions(self) -> Gauge: ...

    @property
    def gpu_sessions(self) -> Gauge: ...

    @property
    def gpu_session_memory(self) -> Gauge: ...

    # The transports' own series, kept with the rest so that one registry renders them all.
    @property
    def frames_refused(self) -> CounterFamily: ...

    @property
    def frame_buffer(self) -> Gauge: ...

    @property
    def run_logs(self) -> Gauge: ...

    @property
    def run_log_bytes(self) -> Gauge: ...

    @property
    def run_logs_evicted(self) -> CounterFamily: ...

    @property
    def run_frames_dropped(self) -> Counter: ...

    def render(self) -> bytes: ...


# -- snapshots -------------------------------------------------------------------------------
@dataclass(frozen=True)
class SnapshotInfo:
    """A kept snapshot, as its manifest (written by the server) says."""

    id: str
    bytes: int
    created: float  # Unix time
    gpu_mb: int  # the GPU budget of the session it was taken of; a restore asks for it again
    profile: str  # the session's preload profile
    skipped: tuple[str, ...]  # "name: why", for what did not pickle or was not a file

    def as_dict(self) -> dict[str, Any]:
        return {
            "snapshot": self.id,
            "bytes": self.bytes,
            "created": self.created,
            "gpu_memory_mb": self.gpu_mb,
            "profile": self.profile,
            "skipped": list(self.skipped),
        }


@dataclass(frozen=True)
class SavedState:
    """What a session's jail reported as it wrote its state (untrusted, bounded): its
    `skipped` list goes into the manifest; the archive stays in the jail until `keep`."""

    skipped: tuple[str, ...]


class Snapshots(Protocol):
    """Session snapshots: the jail writes and reads its own state (the only place a pickle is
    ever read); the server keeps the bytes (appliance.sandbox.snapshots)."""

    @property
    def enabled(self) -> bool: ...

    def check_host(self) -> None:
        """Startup: the store's directory is the server's own (StartupError naming it)."""

    def check_quota(self, owner: str) -> None:
        """RequestRejected when this tenant keeps SANDBOX_MAX_SNAPSHOTS already."""

    async def save(self, jail: Jail, timeout_ms: int) -> SavedState:
        """Have the (thawed) jail write its state; RunLimit / JailFailure / RequestRejected."""

    async def keep(
        self, jail: Jail, owner: str, saved: SavedState, *, gpu_mb: int, profile: str
    ) -> SnapshotInfo:
        """Copy the (frozen) jail's state into the store, within the quotas, and drop it there."""

    async def find(self, owner: str, snapshot_id: str) -> SnapshotInfo:
        """A tenant's snapshot; UnknownSnapshot for any other id (another tenant's too)."""

    async def delete(self, owner: str, snapshot_id: str) -> bool: ...

    async def restore(self, jail: Jail, owner: str, snapshot_id: str, timeout_ms: int) -> None:
        """Copy the snapshot into a fresh jail and have it read it there; RunLimit / JailFailure /
        RequestRejected when it cannot."""


class NoSnapshots:
    """The service's default: snapshots are off (no SANDBOX_SNAPSHOT_DIR)."""

    enabled = False

    def check_host(self) -> None:
        return None

    def _off(self) -> RequestRejected:
        return RequestRejected("snapshots are off on this appliance (it has no SANDBOX_SNAPSHOT_DIR)")

    def check_quota(self, owner: str) -> None:
        raise self._off()

    async def save(self, jail: Jail, timeout_ms: int) -> SavedState:
        raise self._off()

    async def keep(
        self, jail: Jail, owner: str, saved: SavedState, *, gpu_mb: int, profile: str
    ) -> SnapshotInfo:
        raise self._off()

    async def find(self, owner: str, snapshot_id: str) -> SnapshotInfo:
        raise self._off()

    async def delete(self, owner: str, snapshot_id: str) -> bool:
        raise self._off()

    async def restore(self, jail: Jail, owner: str, snapshot_id: str, timeout_ms: int) -> None:
        raise self._off()
