"""The run service: admission, tenants, sessions, one-shot runs, outputs.

Its public methods are the whole API the transports (server.py, rest.py) use: `identify`
a caller, `submit` a request (a `Run` handle to feed stdin, interrupt, await), open and
close sessions, and read `readiness` and `metrics_text`. What a run says goes to its
caller's `Emit` as the events of appliance.core.events (the transports spell them as frames);
`execute` sends exactly one `Done` per request, whatever happens.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from typing import Any

from appliance.core.admission import Admission, request_size
from appliance.core.domain import CellOutcome, Gpu, PipeFull, Request, RunRequest
from appliance.core.egress import REQUEST, Approvals, Narrowing, Rules, parse_rules
from appliance.core.egressask import EgressAsks
from appliance.core.egresssecrets import Secrets
from appliance.core.errors import (
    ApplianceError,
    Busy,
    GpuMemoryLimit,
    JailFailure,
    RequestRejected,
    SettingsError,
    status_of,
)
from appliance.core.events import Done, Emit, Event, FileOut, Started
from appliance.core.ports import (
    Catalogue,
    Cells,
    Clock,
    GpuBudget,
    Jail,
    Lease,
    Metrics,
    NoGpu,
    NoSnapshots,
    Outputs,
    Runtime,
    SnapshotInfo,
    Snapshots,
)
from appliance.core.sessions import Session, SessionRegistry
from appliance.core.tasks import TaskScope, within
from appliance.core.tenants import Tenants, owner_of
from appliance.core.tenants import load as load_tenants
from appliance.settings import Settings

log = logging.getLogger("appliance.core.service")

StdinOps = Callable[[str, bool], Sequence[bytes]]  # (data, eof) -> the channel bytes for them


class Run:
    """One request in flight, as its connection holds it: stdin, interrupt, its task."""

    def __init__(self, rid: str, max_stdin_bytes: int, stdin_ops: StdinOps) -> None:
        self.id = rid
        self.task: asyncio.Task[None] | None = None
        self._max_stdin = max_stdin_bytes
        self._stdin_ops = stdin_ops
        self._jail: Jail | None = None
        self._pending: list[bytes] = []  # stdin that came before the run had a jail
        self._interrupt: str | None = None
        self.egress: Narrowing = ()  # the tenant's and the request's allowlists (names mode)
        self.egress_secrets: Secrets | None = None  # the tenant's headers at the egress proxy
        self.asks: EgressAsks | None = None  # live approval (`egress.ask`), once the run is admitted
        self._answerers: set[object] = set()  # who follows the run able to answer its asks

    def watch(self, answerer: object) -> None:
        """`answerer` (a WebSocket connection) follows the run and may answer its asks."""
        self._answerers.add(answerer)

    def unwatch(self, answerer: object) -> None:
        """`answerer` is gone; when it was the last, every pending ask is refused at once."""
        self._answerers.discard(answerer)
        if not self._answerers and self.asks is not None:
            self.asks.orphaned()

    def answerable(self) -> bool:
        return bool(self._answerers)

    def decide_egress(self, flow: str, allow: bool, scope: str) -> None:
        """The client's answer to one of this run's asks; RequestRejected when it waits on none."""
        if self.asks is None or not self.asks.knows(flow):
            raise RequestRejected(f"no egress request {flow!r} waits for a decision")
        self.asks.decide(flow, allow, scope)

    def in_session(self, approvals: Approvals) -> None:
        """The run is a cell of a session: answers for the session are kept in `approvals`."""
        if self.asks is not None:
            self.asks.session = approvals

    def knows_flow(self, flow: str) -> bool:
        return self.asks is not None and self.asks.knows(flow)

    def stdin(self, data: str, eof: bool) -> None:
        """Feed the run's stdin; RequestRejected when more than SANDBOX_MAX_STDIN_BYTES would wait."""
        for op in self._stdin_ops(data, eof):
            if self._jail is None:
                if sum(map(len, self._pending)) + len(op) > self._max_stdin:
                    raise RequestRejected(self._over_stdin())
                self._pending.append(op)
                continue
            try:
                self._jail.process.write(op, limit=self._max_stdin)
            except PipeFull:
                raise RequestRejected(self._over_stdin()) from None
            except OSError:
                return  # the jail is gone; the run is ending

    def interrupt(self, reason: str = "the run was interrupted") -> None:
        """Stop the run (done status `cancelled`); before it has a jail, as soon as it gets one."""
        self._interrupt = reason
        if self._jail is not None:
            self._jail.process.interrupt(reason)

    def _over_stdin(self) -> str:
        return (
            f"stdin for {self.id!r} is refused: more than SANDBOX_MAX_STDIN_BYTES ({self._max_stdin}) "
            "would wait for the run to read it"
        )

    def _attach(self, jail: Jail) -> None:
        """The run's code was handed to the jail: what came early goes after it, in order."""
        self._jail = jail
        for op in self._pending:
            with contextlib.suppress(OSError):
                jail.process.write(op)
        self._pending.clear()
        if self._interrupt is not None:
            jail.process.interrupt(self._interrupt)

    def _detach(self) -> None:
        self._jail = None


class RunService:
    """Everything that runs code; one per appliance process. What it stands on is given to it
    (appliance.runtime.lifecycle.build_service assembles the real parts)."""

    def __init__(  # noqa: PLR0913 (one keyword per part the service is given)
        self,
        settings: Settings,
        *,
        runtime: Runtime,
        cells: Cells,
        metrics: Metrics,
        catalogue: Catalogue,
        gpu: GpuBudget | None = None,
        snapshots: Snapshots | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.lifecycle = runtime
        self.cells = cells
        self.clock = clock
        self._catalogue = catalogue
        self.gpu: GpuBudget = gpu if gpu is not None else NoGpu()  # what a run's GPU ask costs
        self.snapshots: Snapshots = snapshots if snapshots is not None else NoSnapshots()
        self.admission = Admission(
            settings.max_concurrency, settings.max_queue, clock, settings.queue_bytes()
        )
        self.tenants: Tenants | None = None
        session_limits: dict[str, int] = {}
        if settings.auth_tokens_file is not None:
            self.tenants = Tenants(load_tenants(settings.auth_tokens_file))
            session_limits = self.tenants.session_limits()
        self.sessions = SessionRegistry(
            settings.max_sessions, settings.session_idle_s, self._between_cells, session_limits, clock=clock
        )
        self.warnings: list[str] = []  # how this server is exposed less safely than it could be (/readyz)
        self.tasks = TaskScope("service")  # the session reaper's owner

    # -- lifecycle ---------------------------------------------------------------------------
    def check_host(self) -> None:
        """Fail-closed startup checks (StartupError naming what to fix), before listening."""
        self.lifecycle.check_host()
        self.snapshots.check_host()

    async def start(self, canary_port: int) -> None:
        await self.lifecycle.start(canary_port)
        await self.tasks.open()
        self.sessions.start(self.tasks)

    async def close(self) -> None:
        await self.sessions.close_all()
        await self.tasks.close()
        await self.lifecycle.close()

    # -- callers -----------------------------------------------------------------------------
    def identify(self, token: str | None) -> str | None:
        """The owner name of a caller presenting `token` (None: not allowed). Constant time."""
        if self.tenants is not None:
            return owner_of(token) if self.tenants.identify(token) is not None else None
        expected = self.settings.auth_token
        if expected is not None and not hmac.compare_digest((token or "").encode(), expected.encode()):
            return None
        return owner_of(token)

    @property
    def requires_token(self) -> bool:
        """Whether every API caller must present a bearer token (SANDBOX_AUTH_TOKEN or tenants)."""
        return self.tenants is not None or self.settings.auth_token is not None

    def may_read_metrics(self, token: str | None) -> bool:
        """/metrics: only SANDBOX_METRICS_TOKEN when set; else any caller's token when tokens
        are configured; open only where everything is. Constant time."""
        expected = self.settings.metrics_token
        if expected is not None:
            return hmac.compare_digest((token or "").encode(), expected.encode())
        if not self.requires_token:
            return True
        return token is not None and self.identify(token) is not None

    def over_rate(self, owner: str) -> str | None:
        """Why this caller may send no costly frame now (its tenant's rate bucket is empty), or None."""
        return self.tenants.over_rate(owner) if self.tenants is not None else None

    def charge_rejected(self, owner: str) -> None:
        """A frame of this caller's was refused: it costs a rate token, like a run."""
        if self.tenants is not None:
            self.tenants.charge(owner)

    # -- runs --------------------------------------------------------------------------------
    def submit(self, req: RunRequest, owner: str, emit: Emit, tasks: TaskScope) -> Run:
        """Start running req as a task of `tasks` (its caller's scope: a connection, a request);
        the returned Run takes its stdin and interrupt."""
        run = self._new_run(req)
        run.task = tasks.spawn(self.execute(req, owner, emit, run), name=f"run-{req.id}")
        return run

    async def execute(  # noqa: C901, PLR0912, PLR0915 (one run's steps in order; every exception maps to done.status here, in one place)
        self, req: RunRequest, owner: str, emit: Emit, run: Run | None = None, *, cell: bool = True
    ) -> None:
        """Run one request end to end; always emits exactly one `Done`. `cell=False` (a new
        session, no snapshot) opens the session without running a cell (`open_session`)."""
        run = run or self._new_run(req)
        started = self.clock()
        outcome: CellOutcome | None = None
        session_id: str | None = None
        profile = "?"
        # The tenant's in-flight slot, held to the end of the run, and its GPU quota, to the end
        # of the run or of the session it opens (both empty without tenants).
        tenants = self.tenants
        quota = contextlib.ExitStack()
        gpu_quota = contextlib.ExitStack()
        try:
            if tenants is not None:
                quota.enter_context(tenants.request(owner))
            run.egress = self._egress_narrowing(req, owner)
            run.egress_secrets = tenants.egress_secrets(owner) if tenants is not None else None
            if req.egress is not None and req.egress.ask:
                run.asks = EgressAsks(emit, self.settings.egress_ask_ms / 1000, run.answerable)
            session: Session | None = None
            restoring = req.from_snapshot
            if restoring is not None:
                req = await self._from_snapshot(req, owner, restoring)
            if req.session is not None and req.session != "new":
                session = self.sessions.get(req.session, owner)
                if session.lock.locked():
                    raise RequestRejected(f"session {req.session} is busy with another request")
                if req.memory_mb is not None:
                    raise RequestRejected(
                        f"session {req.session}'s memory limit was set when it opened; leave 'memory_mb' out"
                    )
                _check_session_gpu(session, req)
            else:
                if req.session == "new":
                    self.sessions.check_capacity(owner)
                gpu_mb = self.gpu.budget_mb(req)
                if tenants is not None:
                    gpu_quota.callback(tenants.hold_gpu(owner, gpu_mb))
            if not self.lifecycle.started.is_set():
                await self._until_started(req)
            if self.admission.must_wait():  # the gauge counts this request while it waits
                self.metrics.queue_depth.set(self.admission.waiting + 1)
            if session is not None:
                session_id, profile = session.id, session.lease.profile
                async with self.admission.slot(request_size(req)) as slot_ms, session.lock:
                    self._admitted(slot_ms)
                    outcome = await self._session_cell(session, req, emit, run, slot_ms)
            else:
                async with (
                    self.lifecycle.leases.lease(req) as lease,
                    self.admission.slot(request_size(req)) as slot_ms,
                ):
                    queued_ms = slot_ms + lease.queued_ms
                    profile = lease.profile
                    # The gauges move at the task's first wait, once the code is on its way to
                    # the jail, not on the path that gets it there.
                    asyncio.get_running_loop().call_soon(self._admitted, queued_ms)
                    jail = await lease.take()
                    if req.memory_mb is not None and req.memory_mb < self.settings.memory_mb:
                        jail.limit_memory(req.memory_mb)  # before any of the run's code
                    if req.session == "new":
                        session = self.sessions.add(owner, lease, jail)
                        lease.keep()
                        # The GPU quota is held as long as the session lives.
                        session.on_close.append(gpu_quota.pop_all().close)
                        async with session.lock:
                            if restoring is not None:
                                await self._restore(session, restoring)
                            session_id = session.id
                            if cell or restoring is not None:
                                outcome = await self._session_cell(session, req, emit, run, queued_ms)
                            else:
                                outcome = await self._opened(session)
                    else:
                        outcome = await self._one_shot(jail, lease, req, emit, run, queued_ms, owner)
        except asyncio.CancelledError:
            self._count("cancelled", started)
            raise
        except Exception as exc:
            status, message = status_of(exc)
            if not isinstance(exc, ApplianceError):
                log.exception("run failed", extra={"request": req.id})
            self._count(status, started)
            await _safe_emit(
                emit,
                Done(
                    status,
                    duration_ms=self._ms_since(started),
                    message=message,
                    session=session_id,
                    retry_after_ms=self.retry_after_ms(exc) if isinstance(exc, Busy) else None,
                ),
            )
            return
        finally:
            gpu_quota.close()
            quota.close()
        if outcome is None:
            self.metrics.active_runs.set(self.admission.active)
            raise RuntimeError(f"run {req.id} ended without an outcome")
        duration_ms = self._ms_since(started)
        await _safe_emit(
            emit,
            Done(
                outcome.status,
                exit_code=outcome.exit_code,
                duration_ms=duration_ms,
                cpu_ms=outcome.cpu_ms,
                max_rss_mb=outcome.max_rss_mb,
                message=outcome.message,
                session=session_id,
                import_ms=outcome.import_ms,
                files_skipped=outcome.files_skipped,
                egress=outcome.egress,
                egress_omitted=outcome.egress_omitted,
            ),
        )
        # Counted once `done` is on its way (nothing yields in between: a scrape that follows
        # `done` sees the run): the client does not wait for the bookkeeping.
        self._count(outcome.status, started, duration_ms / 1000)
        self.metrics.bytes_streamed.inc(outcome.output_bytes)
        if outcome.import_ms is not None:
            self.metrics.import_seconds.labels(profile=profile).observe(outcome.import_ms / 1000)

    async def open_session(self, req: RunRequest, owner: str, first_cell: bool = True) -> list[Event]:
        """Open a session running req's code first; the events it sent (the last is `Done`).
        first_cell=False: req's code must be empty, and no cell runs (no `Started`): the
        session is opened (admitted, counted, its jail leased), a jail round trip sooner."""
        if not first_cell and req.code:
            raise ValueError("a session opened without a first cell has no code to run")
        events: list[Event] = []

        async def collect(event: Event) -> None:
            events.append(event)

        await self.execute(session_opener(req), owner, collect, cell=first_cell)
        return events

    async def _opened(self, session: Session) -> CellOutcome:
        """A session opened without a cell. Its jail is left as the warm pool kept it, not
        frozen: none of the session's code has run in it yet, and its interpreter waits on its
        pipe as a pool jail does (the first cell freezes it after, as every cell does).
        Freezing it here cost more than a cell on a loaded host: the cgroup v1 freezer waits
        for each of its tasks to be scheduled."""
        if not session.jail.alive:
            await self.sessions.close(session.id, reason="its interpreter is gone")
            raise JailFailure(f"session {session.id} has ended: its interpreter is gone")
        self.metrics.sessions.set(len(self.sessions))
        return CellOutcome("ok")

    # -- snapshots -----------------------------------------------------------------------------
    async def snapshot_session(self, session_id: str, owner: str) -> SnapshotInfo:
        """Keep a session's state (its files, its globals that pickle) as a snapshot of its
        tenant's: the jail writes it, between two cells, under an admission slot and the
        cell's limits; the server keeps the bytes. The session goes on as it was."""
        store = self.snapshots
        session = self.sessions.get(session_id, owner)
        if session.lock.locked():
            raise RequestRejected(f"session {session_id} is busy with another request")
        await asyncio.to_thread(store.check_quota, owner)
        async with self.admission.slot(), session.lock:
            jail = session.jail
            if not jail.alive:
                await self.sessions.close(session.id, reason="its interpreter is gone")
                raise RequestRejected(f"session {session.id} has ended (its interpreter is gone)")
            try:
                jail.thaw()
            except OSError as exc:
                await self.sessions.close(session.id, reason="its jail could not be thawed")
                raise JailFailure(
                    f"session {session.id} has ended: its jail could not be thawed ({exc})"
                ) from exc
            try:
                saved = await store.save(jail, self.settings.max_exec_ms)
            except JailFailure:
                await self.sessions.close(session.id, reason="its interpreter did not survive a snapshot")
                raise
            except BaseException:
                await self._refreeze(session)
                raise
            if not await self._refreeze(session):
                raise JailFailure(f"session {session.id} has ended: its jail could not be frozen")
            session.last_used = self.clock()
            return await store.keep(jail, owner, saved, gpu_mb=session.gpu_mb, profile=session.lease.profile)

    async def find_snapshot(self, snapshot_id: str, owner: str) -> SnapshotInfo:
        return await self.snapshots.find(owner, snapshot_id)

    async def delete_snapshot(self, snapshot_id: str, owner: str) -> bool:
        return await self.snapshots.delete(owner, snapshot_id)

    async def _refreeze(self, session: Session) -> bool:
        """Freeze a session's jail again after a snapshot; a jail that does not freeze ends."""
        if not session.jail.alive:
            await self.sessions.close(session.id, reason="its interpreter is gone")
            return False
        try:
            await session.jail.freeze()
        except JailFailure:
            await self.sessions.close(session.id, reason="its jail could not be frozen between cells")
            return False
        return True

    async def _from_snapshot(self, req: RunRequest, owner: str, snapshot_id: str) -> RunRequest:
        """A request that opens a session from a snapshot, with the snapshot's GPU budget as its
        ask (admitted as any new GPU session's); RequestRejected when it cannot be."""
        if req.session != "new":
            raise RequestRejected('\'from_snapshot\' opens a new session: send it with "session": "new"')
        info = await self.snapshots.find(owner, snapshot_id)
        if info.gpu_mb == 0:
            return req
        if not self.settings.gpu:
            raise RequestRejected(
                f"snapshot {snapshot_id} is of a GPU session ({info.gpu_mb} MiB); this appliance runs "
                "without SANDBOX_GPU"
            )
        if req.gpu is not None and req.gpu.memory_mb != info.gpu_mb:
            raise RequestRejected(
                f"snapshot {snapshot_id} is of a session with a GPU budget of {info.gpu_mb} MiB; its "
                f"restore asks for that again (omit 'gpu', or ask for {info.gpu_mb})"
            )
        return Request(
            id=req.id,
            code=req.code,
            session="new",
            timeout_ms=req.timeout_ms,
            files=req.files,
            gpu=Gpu(info.gpu_mb),
            stdin_eof=req.stdin_eof,
            memory_mb=req.memory_mb,
            from_snapshot=snapshot_id,
            egress=req.egress,
        )

    async def _restore(self, session: Session, snapshot_id: str) -> None:
        """A new session's jail reads the snapshot before its first cell; if it cannot, the
        session ends and the request says why."""
        try:
            await self.snapshots.restore(session.jail, session.owner, snapshot_id, self.settings.max_exec_ms)
        except BaseException:
            await self.sessions.close(session.id, reason="its snapshot could not be restored")
            raise

    async def close_session(self, session_id: str, owner: str) -> bool:
        closed = await self.sessions.close(session_id, owner)
        self.metrics.sessions.set(len(self.sessions))
        return closed

    async def models(self) -> dict[str, Any]:
        """The model catalogue (GET /v1/models): what SANDBOX_MODELS_DIR holds, from the headers."""
        root = self.settings.models_dir
        if root is None:
            return {"models_dir": None, "models": []}
        found = await asyncio.to_thread(self._catalogue, str(root))
        return {"models_dir": str(root), "models": [m.as_dict() for m in found]}

    def retry_after_ms(self, exc: Busy | None = None) -> int:
        """When a request refused `busy` should come back: the refuser's own hint where it had
        one (a rate bucket's refill), else the run queue's estimate (appliance.core.backpressure)."""
        if exc is not None and exc.retry_after_ms is not None:
            return exc.retry_after_ms
        return self.admission.retry_after_ms()

    # -- what the server reports ---------------------------------------------------------------
    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """(ready, body) for /readyz."""
        problems, body = self.lifecycle.readiness()
        gpu_sessions, gpu_mb = self.sessions.gpu_held()
        body["sessions"] = {"open": len(self.sessions), "gpu": gpu_sessions, "gpu_memory_mb": gpu_mb}
        if self.warnings:  # a warning never makes the server unready: it says what to fix
            body["warning"] = "; ".join(self.warnings)
        return not problems, {
            "status": "ready" if not problems else "not ready",
            "problems": problems,
            **body,
        }

    def metrics_text(self) -> bytes:
        self.lifecycle.update_gauges()
        self.metrics.sessions.set(len(self.sessions))
        gpu_sessions, gpu_mb = self.sessions.gpu_held()
        self.metrics.gpu_sessions.set(gpu_sessions)
        self.metrics.gpu_session_memory.set(gpu_mb * 1024 * 1024)
        return self.metrics.render()

    # -- internals -----------------------------------------------------------------------------
    def _new_run(self, req: RunRequest) -> Run:
        return Run(req.id, self.settings.max_stdin_bytes, self.cells.stdin_ops)

    def _ms_since(self, started: float) -> int:
        return int((self.clock() - started) * 1000)

    async def _until_started(self, req: RunRequest) -> None:
        """A request that came while the appliance starts waits for it, within the queue's
        bounds and the run's own time limit; then `busy`, never `internal`."""
        started = self.lifecycle.started
        if started.is_set():
            return
        async with self.admission.slot(request_size(req)):
            try:
                await within(started.wait(), self._timeout_ms(req) / 1000)
            except TimeoutError:
                raise Busy(
                    "the appliance is still starting (its jail pool is not up yet); try again shortly"
                ) from None

    def _egress_narrowing(self, req: RunRequest, owner: str) -> Narrowing:
        """The allowlists a run's flows are held to besides the server's: its tenant's, then its
        own (names mode). A request that asks for one where there is no proxy to hold it to is
        refused rather than run with more than it asked for."""
        narrowing: list[tuple[str, Rules]] = []
        tenant_rules = self.tenants.egress_rules(owner) if self.tenants is not None else None
        if tenant_rules is not None:
            narrowing.append(("tenant", tenant_rules))
        ask = req.egress
        if ask is not None:
            if not self.settings.egress_allow_domains:
                raise RequestRejected(
                    "'egress' narrows egress by name, but this appliance allows none "
                    "(SANDBOX_EGRESS_ALLOW_DOMAINS is not set)"
                )
            if ask.allow is not None or ask.ask:  # with `ask` and no list: every host is asked about
                try:
                    narrowing.append((REQUEST, parse_rules(ask.allow or (), "egress.allow")))
                except SettingsError as exc:
                    raise RequestRejected(exc.message) from None
        return tuple(narrowing)

    def _admitted(self, queued_ms: int) -> None:
        self.metrics.queue_depth.set(self.admission.waiting)
        self.metrics.queue_seconds.observe(queued_ms / 1000)
        self.metrics.active_runs.set(self.admission.active)

    def _count(self, status: str, started: float, seconds: float | None = None) -> None:
        """A run is over (its slot is given back): the gauge of runs holding a slot, the run's
        status and its duration (`seconds`, else the time since `started`)."""
        self.metrics.active_runs.set(self.admission.active)
        self.metrics.runs.labels(status=status).inc()
        self.metrics.run_seconds.observe(self.clock() - started if seconds is None else seconds)

    def _timeout_ms(self, req: RunRequest) -> int:
        limit = self.settings.max_exec_ms
        return min(req.timeout_ms, limit) if req.timeout_ms else limit

    async def _cell(  # noqa: PLR0913 (the run's parts, passed down rather than stored on a shared object)
        self, jail: Jail, req: RunRequest, emit: Emit, run: Run, keep_alive: bool, start: Started
    ) -> CellOutcome:
        try:
            return await self.cells.run(
                jail,
                req,
                emit,
                timeout_ms=self._timeout_ms(req),
                keep_alive=keep_alive,
                started=lambda: run._attach(jail),
                egress=run.egress,
                egress_secrets=run.egress_secrets,
                first=start,
                asks=run.asks,
            )
        finally:
            run._detach()
            if run.asks is not None:
                run.asks.close()  # nothing is asked after the cell, and nothing waits past it

    async def _one_shot(  # noqa: PLR0913 (the run's parts, passed down rather than stored on a shared object)
        self, jail: Jail, lease: Lease, req: RunRequest, emit: Emit, run: Run, queued_ms: int, owner: str
    ) -> CellOutcome:
        run_id = secrets.token_hex(8)
        start = Started(run_id, None, queued_ms, self._timeout_ms(req), lease.gpu)
        outcome = await self._cell(jail, req, emit, run, keep_alive=False, start=start)
        # The jail is SIGKILLed as the lease ends (`PoolLeases.teardown`), as `done` goes out;
        # files are read only once every process of the run is gone, so a run with outputs
        # is killed here, and waited for.
        if self.cells.has_outputs(jail):
            await jail.process.kill()
            await self._send_outputs(jail, run_id, None, emit, outcome, owner)
        return outcome

    async def _session_cell(
        self, session: Session, req: RunRequest, emit: Emit, run: Run, queued_ms: int
    ) -> CellOutcome:
        run_id = secrets.token_hex(8)
        jail = session.jail
        if not jail.alive:
            await self.sessions.close(session.id, reason="its interpreter is gone")
            raise RequestRejected(f"session {session.id} has ended (its interpreter is gone)")
        start = Started(run_id, session.id, queued_ms, self._timeout_ms(req), session.lease.gpu)
        run.in_session(session.egress_approvals)
        before = await self.cells.snapshot(jail)
        try:
            jail.thaw()  # frozen since its last cell (`Jail.freeze`)
        except OSError as exc:
            await self.sessions.close(session.id, reason="its jail could not be thawed")
            raise JailFailure(
                f"session {session.id} has ended: its jail could not be thawed ({exc})"
            ) from exc
        try:
            outcome = await self._cell(jail, req, emit, run, keep_alive=True, start=start)
            # Between cells the jail does nothing: frozen before its outputs are read and its
            # `done` goes out, still under the session's lock. Fail closed: a jail that does
            # not freeze is ended, never left running unaccounted.
            unfrozen: str | None = None
            if outcome.interpreter_alive:
                try:
                    await jail.freeze()
                except JailFailure as exc:
                    log.warning(
                        "session jail not frozen", extra={"session": session.id, "error": exc.message}
                    )
                    unfrozen, outcome.interpreter_alive = exc.message, False
        except BaseException:
            await self.sessions.close(session.id, reason="a cell was cut off mid-way")
            raise
        session.last_used = self.clock()
        if not outcome.interpreter_alive:
            await jail.process.kill()
        await self._send_outputs(jail, run_id, before, emit, outcome, session.owner)
        if unfrozen is not None:
            await self.sessions.close(session.id, reason="its jail could not be frozen between cells")
            note = "the session has ended: its jail could not be frozen between cells"
            outcome.message = f"{outcome.message}; {note}" if outcome.message else note
        elif not outcome.interpreter_alive:
            await self.sessions.close(session.id, reason="its interpreter could not be recovered")
            note = "the session has ended: its interpreter could not be recovered"
            outcome.message = f"{outcome.message}; {note}" if outcome.message else note
        elif outcome.status == GpuMemoryLimit.status:
            # What went over may still hold the memory (a thread, a cached model): a GPU
            # session that broke its budget ends, and its grant goes back to the ledger.
            await self.sessions.close(session.id, reason="a cell went over the session's GPU memory budget")
            note = "the session has ended: a cell went over its GPU memory budget"
            outcome.message = f"{outcome.message}; {note}" if outcome.message else note
        self.metrics.sessions.set(len(self.sessions))
        return outcome

    async def _between_cells(self, session: Session) -> str | None:
        """Why an idle session must end now (a watchdog's verdict, its files over the disk
        quota), or None."""
        return await self.cells.between_cells(session.jail)

    async def _send_outputs(  # noqa: PLR0913 (the run's parts, passed down rather than stored on a shared object)
        self,
        jail: Jail,
        run_id: str,
        before: object | None,
        emit: Emit,
        outcome: CellOutcome,
        owner: str,
    ) -> None:
        """Stream outputs/ as `FileOut` events (the sandbox persists them), one batch in memory
        at a time, within SANDBOX_MAX_OUTPUTS_BYTES; what was left out is said in the outcome."""
        found: Outputs = self.cells.outputs(jail, before, owner, run_id)
        async with contextlib.aclosing(found.batches()) as batches:
            async for batch in batches:
                for item in batch:
                    await emit(FileOut(item.path, item.size, item.data, item.message))
                del batch
        note = found.note()
        if note is None:
            return
        outcome.files_skipped = found.skipped or None
        if outcome.status == "ok":
            outcome.status, outcome.message = "output_limit", note
        else:
            outcome.message = f"{outcome.message}; {note}" if outcome.message else note


def session_opener(req: RunRequest) -> Request:
    """The request that opens a session running req's code first (its stdin closed)."""
    return Request(
        id=req.id,
        code=req.code,
        session="new",
        timeout_ms=req.timeout_ms,
        files=req.files,
        gpu=req.gpu,
        stdin_eof=True,
        memory_mb=req.memory_mb,
        from_snapshot=req.from_snapshot,
        egress=req.egress,
    )


def _check_session_gpu(session: Session, req: RunRequest) -> None:
    """A later cell runs under the budget the session opened with: it may repeat it, not change it.

    The session's contract with its client, in any mode: a session opened without a GPU (as
    every session is without GPU mode) refuses a cell that asks for one."""
    if req.gpu is None:
        return
    if session.gpu_mb == 0:
        raise RequestRejected(f"session {session.id} has no GPU; a later cell cannot ask for one")
    if req.gpu.memory_mb != session.gpu_mb:
        raise RequestRejected(
            f"session {session.id} holds a GPU budget of {session.gpu_mb} MiB for its whole life; a later "
            f"cell cannot ask for {req.gpu.memory_mb} MiB (omit 'gpu', or open a new session)"
        )


async def _safe_emit(emit: Emit, event: Event) -> None:
    with contextlib.suppress(Exception):
        await emit(event)
