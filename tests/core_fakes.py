"""Fakes of what the run service stands on (appliance.core.ports), for core unit tests that
need no root, no firejail and no server: a lease source handing out jails that are objects,
cells run by a script, a clock moved by hand, metrics that remember what they were told."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from appliance.api.frames import framed
from appliance.core.domain import CellOutcome, PipeFull, RunRequest
from appliance.core.egress import Narrowing
from appliance.core.egressask import EgressAsks
from appliance.core.egresssecrets import Secrets
from appliance.core.errors import JailFailure
from appliance.core.events import Emit, GpuShare, Output, Started
from appliance.core.ports import GpuBudget, Jail, OutputFile, Outputs
from appliance.core.service import RunService
from appliance.core.tasks import TaskScope
from appliance.settings import from_env
from appliance.wire import protocol


class FakeClock:
    """Monotonic seconds that move only when a test moves them."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FakeProcess:
    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.interrupts: list[str] = []
        self.killed = False

    def write(self, data: bytes, limit: int | None = None) -> None:
        if self.killed:
            raise OSError("the jail is gone")
        if limit is not None and len(data) > limit:
            raise PipeFull(f"more than {limit} bytes")
        self.written.append(data)

    def interrupt(self, reason: str) -> None:
        self.interrupts.append(reason)

    async def kill(self) -> None:
        self.killed = True


class FakeJail:
    def __init__(self, number: int) -> None:
        self.number = number
        self.process = FakeProcess()
        self.frozen = False
        self.ended = False
        self.refuse_freeze: str | None = None  # freeze() fails with this

    @property
    def alive(self) -> bool:
        return not self.ended and not self.process.killed

    def thaw(self) -> None:
        self.frozen = False

    async def freeze(self) -> None:
        if self.refuse_freeze is not None:
            raise JailFailure(self.refuse_freeze)
        self.frozen = True

    def limit_memory(self, memory_mb: int) -> None:
        self.memory_mb = memory_mb

    def open_workspace(self) -> None:
        return None

    def hold_workspace(self) -> None:
        return None


class FakeLease:
    def __init__(self, source: FakeLeases) -> None:
        self.profile = "default"
        self.queued_ms = 0
        self.gpu: GpuShare | None = source.gpu
        self.jail: FakeJail | None = None
        self.kept = False
        self.ended = False
        self._source = source

    async def take(self) -> FakeJail:
        self.jail = self._source.new_jail()
        return self.jail

    def keep(self) -> None:
        self.kept = True

    async def end(self) -> None:
        if self.ended:
            return
        self.ended = True
        if self.jail is not None:
            self.jail.ended = True


class FakeLeases:
    """A lease source; `fail` makes every lease raise it instead."""

    def __init__(self) -> None:
        self.leases: list[FakeLease] = []
        self.fail: BaseException | None = None
        self.gpu: GpuShare | None = None  # the grant each lease holds (GPU mode)
        self.jails = 0

    def new_jail(self) -> FakeJail:
        self.jails += 1
        return FakeJail(self.jails)

    @contextlib.asynccontextmanager
    async def lease(self, req: RunRequest) -> AsyncIterator[FakeLease]:
        if self.fail is not None:
            raise self.fail
        lease = FakeLease(self)
        self.leases.append(lease)
        try:
            yield lease
        finally:
            if not lease.kept:
                await lease.end()


Script = Callable[[FakeJail, RunRequest, Emit], Awaitable[CellOutcome]]


async def echo(jail: FakeJail, req: RunRequest, emit: Emit) -> CellOutcome:
    """A cell that prints its code and ends ok."""
    await emit(Output("stdout", req.code))
    return CellOutcome("ok", exit_code=0, output_bytes=len(req.code))


class FakeFile:
    def __init__(self, path: str, data: bytes | None, message: str | None = None) -> None:
        self.path, self.data, self.message = path, data, message
        self.size = len(data) if data is not None else 0


class FakeOutputs:
    """The files a run left (one batch), and why others were left out."""

    def __init__(self, files: Sequence[OutputFile] = (), note: str | None = None, skipped: int = 0) -> None:
        self.files = files
        self._note = note
        self._skipped = skipped

    async def batches(self) -> AsyncGenerator[Sequence[OutputFile], None]:
        if self.files:
            yield self.files

    def note(self) -> str | None:
        return self._note

    @property
    def skipped(self) -> int:
        return self._skipped


class FakeCells:
    """Runs each cell by `script` (`echo` unless a test sets another); `running` is set once
    a cell has its code and has sent its `start`."""

    def __init__(self) -> None:
        self.script: Script = echo
        self.runs: list[tuple[FakeJail, str]] = []
        self.running = asyncio.Event()
        self.left = FakeOutputs()  # what each run leaves in outputs/
        self.read_outputs_of: list[tuple[FakeJail, bool]] = []  # (jail, was it killed first)

    def stdin_ops(self, data: str, eof: bool) -> list[bytes]:
        return ([b"stdin:" + data.encode()] if data else []) + ([b"eof"] if eof else [])

    async def run(  # noqa: PLR0913 (the port's signature)
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
        assert isinstance(jail, FakeJail)
        jail.process.write(b"run:" + req.code.encode())
        self.runs.append((jail, req.code))
        started()
        await emit(first)
        self.running.set()
        return await self.script(jail, req, emit)

    async def between_cells(self, jail: Jail) -> str | None:
        return None

    def has_outputs(self, jail: Jail) -> bool:
        return bool(self.left.files) or self.left.note() is not None

    async def snapshot(self, jail: Jail) -> object:
        return {}

    def outputs(self, jail: Jail, before: object | None, owner: str, run_id: str) -> Outputs:
        assert isinstance(jail, FakeJail)
        self.read_outputs_of.append((jail, jail.process.killed))
        return self.left


class FakeRuntime:
    def __init__(self, leases: FakeLeases) -> None:
        self.started = asyncio.Event()
        self._leases = leases

    @property
    def leases(self) -> FakeLeases:
        return self._leases

    def check_host(self) -> None:
        return None

    async def start(self, canary_port: int) -> None:
        self.started.set()

    async def close(self) -> None:
        return None

    def readiness(self) -> tuple[list[str], dict[str, Any]]:
        return [], {}

    def update_gauges(self) -> None:
        return None


class Series:
    """A gauge, counter and histogram at once: remembers every value it was given."""

    def __init__(self) -> None:
        self.values: list[float] = []
        self.children: dict[tuple[Any, ...], Series] = {}

    def set(self, value: float) -> None:
        self.values.append(value)

    def inc(self, amount: float = 1) -> None:
        self.values.append(amount)

    def observe(self, amount: float) -> None:
        self.values.append(amount)

    def labels(self, *values: str, **labels: str) -> Series:
        return self.children.setdefault(values or tuple(sorted(labels.items())), Series())

    def count(self, **labels: str) -> float:
        return sum(self.labels(**labels).values)


class FakeMetrics:
    def __init__(self) -> None:
        self.runs = Series()
        self.run_seconds = Series()
        self.queue_seconds = Series()
        self.queue_depth = Series()
        self.active_runs = Series()
        self.bytes_streamed = Series()
        self.import_seconds = Series()
        self.sessions = Series()
        self.gpu_sessions = Series()
        self.gpu_session_memory = Series()
        self.frames_refused = Series()
        self.frame_buffer = Series()
        self.run_logs = Series()
        self.run_log_bytes = Series()
        self.run_logs_evicted = Series()
        self.run_frames_dropped = Series()

    def render(self) -> bytes:
        return b""


class Core:
    """A RunService on fakes, with the fakes at hand."""

    def __init__(self, env: dict[str, str] | None = None, gpu: GpuBudget | None = None) -> None:
        self.clock = FakeClock()
        self.leases = FakeLeases()
        self.cells = FakeCells()
        self.metrics = FakeMetrics()
        self.runtime = FakeRuntime(self.leases)
        self.runtime.started.set()  # `start` would also start the idle-session reaper
        self.tasks = TaskScope("test")  # what submitted runs are tasks of (a connection's, in the server)
        self.service = RunService(
            from_env(env or {}),
            runtime=self.runtime,
            cells=self.cells,
            metrics=self.metrics,
            catalogue=lambda root: [],
            gpu=gpu,
            clock=self.clock,
        )

    async def run(self, code: str, owner: str = "alice", **fields: Any) -> list[protocol.Frame]:
        """Run one request to its `done`; the frames a client reads of the events it sent
        (each through the api's encoder, as every transport spells them)."""
        frames: list[protocol.Frame] = []

        async def collect(frame: protocol.Frame) -> None:
            frames.append(frame)

        req = protocol.ExecuteRequest(code=code, **fields)
        await self.service.execute(req, owner, framed(req.id, collect))
        return frames


async def until(condition: Callable[[], bool], turns: int = 1000) -> None:
    """Let the event loop run until `condition` holds (at most `turns` turns; no clock involved)."""
    for _ in range(turns):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("the condition never held")
