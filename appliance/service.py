"""The appliance's run service: admission, jails (pooled or cold), sessions, outputs, canary.

`Appliance.execute` is the one entry for every transport; it sends exactly one
`done` per request, whatever happens.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from appliance import canary, outputs, protocol
from appliance.admission import Admission
from appliance.errors import ApplianceError, RequestRejected, StartupError, status_of
from appliance.jail.host import HostFacts, inspect, readable_ancestors_problem
from appliance.jail.jail import Jail, JailFactory, _python_roots
from appliance.jail.network import EgressNetwork, check_prerequisites
from appliance.jail.pool import JailPool
from appliance.jail.workdir import RunDirs, stage_runtime
from appliance.metrics import Metrics
from appliance.protocol import ExecuteRequest, Frame
from appliance.runner import ActiveRun, CellOutcome, Emit, run_cell
from appliance.sessions import Session, SessionRegistry
from appliance.settings import Settings
from appliance.tenants import Tenants
from appliance.tenants import load as load_tenants

if TYPE_CHECKING:  # GPU modules are imported at run time only in GPU mode
    from appliance.gpu.ledger import Grant
    from appliance.gpu.runs import GpuRuns

log = logging.getLogger("appliance.service")

class Appliance:
    """Everything that runs code; transports call `execute` and friends."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.metrics = Metrics()
        self.admission = Admission(settings.max_concurrency, settings.max_queue)
        self.sessions = SessionRegistry(settings.max_sessions, settings.session_idle_s)
        self.host: HostFacts | None = None
        self.factory: JailFactory | None = None
        self.pool: JailPool | None = None
        self.dirs: RunDirs | None = None
        self.ready_problems: list[str] = ["starting"]
        self.canary_port = 0
        self.network: EgressNetwork | None = None
        self.tenants: Tenants | None = None
        if settings.auth_tokens_file is not None:
            self.tenants = Tenants(load_tenants(settings.auth_tokens_file))
            self.sessions.owner_limits = self.tenants.session_limits()
        self.gpu: GpuRuns | None = None  # GPU mode (SANDBOX_GPU=1) only
        self._tasks: set[asyncio.Task[Any]] = set()
        self._teardowns: set[asyncio.Task[None]] = set()

    # -- lifecycle -------------------------------------------------------------------------
    def check_host(self) -> HostFacts:
        """Fail-closed startup checks; raises StartupError with what to fix."""
        s = self.settings
        if s.open_ports:
            check_prerequisites()  # before inspect: /run/netns must exist when /run is judged
        host = inspect(s.firejail, s.uid, s.python)
        for root in _python_roots(s.python):
            problem = readable_ancestors_problem(root, host.uid)
            if problem:
                raise StartupError(f"SANDBOX_PYTHON's environment is not reachable in the jail: {problem}")
        if s.gpu and self.gpu is None:
            from appliance.gpu.runs import GpuRuns  # GPU mode only: NVML is never loaded otherwise

            self.gpu = GpuRuns.open(s)  # no driver / no GPU: StartupError, startup stops
        problem = readable_ancestors_problem(s.tmp_root, host.uid)
        if problem:  # firejail, running as the sandbox uid, must reach the run directories
            raise StartupError(f"SANDBOX_TMP_ROOT is not reachable by the sandbox uid: {problem}")
        self.host = host
        return host

    async def start(self, canary_port: int) -> None:
        host = self.host or self.check_host()
        self.dirs = RunDirs(self.settings.tmp_root, host.uid, host.gid)
        removed = self.dirs.prepare()
        if removed:
            log.info("purged stale run directories", extra={"dirs": [str(p) for p in removed]})
        runtime = await asyncio.to_thread(stage_runtime, self.settings.tmp_root, self.settings.python)
        if self.settings.open_ports:
            self.network = EgressNetwork(self.settings)
            await self.network.start()
        self.factory = JailFactory(self.settings, host, runtime, self.dirs, self.network)
        self.pool = JailPool(self.factory, self.settings.pool_size, max_size=self.settings.pool_max)
        self.pool.start()
        if self.gpu is not None:  # one factory + warm pool per GPU, each jail seeing only its GPU
            network, dirs = self.network, self.dirs
            self.gpu.start(lambda dev: JailFactory(self.settings, host, runtime, dirs, network, gpu=dev))
            await self.gpu.probe_mps()  # layer (b) is reported as enforcing only where proven
        self.sessions.start()
        self.canary_port = canary_port
        log.info("appliance started", extra={
            "firejail": host.firejail, "firejail_version": host.firejail_version,
            "jail_uid": host.uid, "memory_cap": "RLIMIT_AS", "pool_size": self.settings.pool_size,
        })
        self._spawn(self._canary_loop())

    def _teardown(self, jail: Jail) -> None:
        task = asyncio.create_task(jail.destroy())
        self._teardowns.add(task)
        task.add_done_callback(self._teardowns.discard)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._teardowns, return_exceptions=True)
        await self.sessions.close_all()
        if self.pool is not None:
            await self.pool.close()
        if self.gpu is not None:
            await self.gpu.close()
        if self.network is not None:
            await self.network.close()
        if self.dirs is not None:
            self.dirs.remove_instance()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- readiness -----------------------------------------------------------------------
    async def _canary_loop(self) -> None:
        while True:
            self.ready_problems = await self.canary()
            if self.ready_problems:
                log.error("canary failed; not ready", extra={"problems": self.ready_problems})
            await asyncio.sleep(300 if not self.ready_problems else 5)

    async def canary(self) -> list[str]:
        """Run the probe in a real jail; every way it is less confined than promised is a problem."""
        frames: list[Frame] = []

        async def collect(frame: Frame) -> None:
            frames.append(frame)

        hosts = [str(a) for a in self.network.policy.host_addresses] if self.network and self.network.policy else []
        req = ExecuteRequest(id="canary", code=canary.probe_code(self.canary_port or 9100, hosts))
        await self.execute(req, owner="canary", emit=collect, active=ActiveRun("canary"), canary=True)
        done = frames[-1] if frames else {}
        stdout = "".join(f["text"] for f in frames if f.get("type") == "stream" and f.get("name") == "stdout")
        found = canary.judge(done.get("status"), stdout, {self.host.uid if self.host else self.settings.uid})
        if found and done.get("message"):
            found[0] += f": {done.get('message')}"
        return found

    # -- runs ----------------------------------------------------------------------------
    async def execute(
        self, req: ExecuteRequest, owner: str, emit: Emit, active: ActiveRun, canary: bool = False,
    ) -> None:
        """Run one request end to end; always emits exactly one `done`."""
        started = time.monotonic()
        outcome: CellOutcome | None = None
        session_id: str | None = None
        quota = contextlib.ExitStack()  # the tenant's in-flight slot, held to the end of the run
        try:
            if self.tenants is not None:
                quota.enter_context(self.tenants.request(owner))
            session: Session | None = None
            if req.session not in (None, "new"):
                session = self.sessions.get(req.session, owner)
                if session.lock.locked():
                    raise RequestRejected(f"session {req.session} is busy with another request")
            elif req.session == "new":
                self.sessions.check_capacity(owner)
            self.metrics.queue_depth.set(self.admission.waiting + 1)
            async with self._gpu_grant(req, probe=canary) as grant, self.admission.slot() as slot_ms:
                queued_ms = slot_ms + (grant.queued_ms if grant is not None else 0)
                self.metrics.queue_depth.set(self.admission.waiting)
                self.metrics.queue_seconds.observe(queued_ms / 1000)
                self.metrics.active_runs.set(self.admission.active)
                if session is not None:
                    session_id = session.id
                    async with session.lock:
                        outcome = await self._session_cell(session, req, emit, active, queued_ms)
                elif req.session == "new":
                    outcome, session_id = await self._new_session(req, owner, emit, active, queued_ms)
                else:
                    outcome = await self._one_shot(req, emit, active, queued_ms, grant)
        except asyncio.CancelledError:
            self._count("cancelled", started)
            raise
        except Exception as exc:
            status, message = status_of(exc)
            if not isinstance(exc, ApplianceError):
                log.exception("run failed", extra={"request": req.id})
            self._count(status, started)
            await _safe_emit(emit, protocol.done_frame(
                req.id, status, duration_ms=_ms_since(started), message=message, session=session_id))
            return
        finally:
            quota.close()
            self.metrics.active_runs.set(self.admission.active)
        assert outcome is not None
        self._count(outcome.status, started)
        self.metrics.bytes_streamed.inc(outcome.output_bytes)
        await _safe_emit(emit, protocol.done_frame(
            req.id, outcome.status, exit_code=outcome.exit_code, duration_ms=_ms_since(started),
            cpu_ms=outcome.cpu_ms, max_rss_mb=outcome.max_rss_mb, message=outcome.message,
            session=session_id,
        ))

    def _count(self, status: str, started: float) -> None:
        self.metrics.runs.labels(status=status).inc()
        self.metrics.run_seconds.observe(time.monotonic() - started)

    async def _take_jail(self) -> Jail:
        assert self.pool is not None and self.factory is not None
        before = self.pool.cold_starts
        spawned_before = self.factory.spawned
        jail = await self.pool.take()
        if self.pool.cold_starts > before:
            self.metrics.cold_starts.inc()
        self.metrics.jails_spawned.inc(self.factory.spawned - spawned_before)
        self._update_pool_gauges()
        return jail

    def _update_pool_gauges(self) -> None:
        if self.pool is not None:
            self.metrics.pool_ready.set(len(self.pool.ready))
            self.metrics.pool_starting.set(self.pool.starting)
            self.metrics.pool_target.set(self.pool.target())
            self.metrics.jail_pss.set(self.pool.jail_pss_kb * 1024)
        self.metrics.sessions.set(len(self.sessions))

    def _timeout_ms(self, req: ExecuteRequest) -> int:
        limit = self.settings.max_exec_ms
        return min(req.timeout_ms, limit) if req.timeout_ms else limit

    async def _cell(self, jail: Jail, req: ExecuteRequest, emit: Emit, active: ActiveRun,
                    keep_alive: bool) -> CellOutcome:
        s = self.settings
        return await run_cell(
            jail, req, emit, timeout_ms=self._timeout_ms(req), max_output_bytes=s.max_output_bytes,
            max_disk_mb=s.max_disk_mb, active=active, keep_alive=keep_alive,
        )

    @contextlib.asynccontextmanager
    async def _gpu_grant(self, req: ExecuteRequest, probe: bool) -> AsyncIterator[Grant | None]:
        """GPU mode: the run's GPU reservation, held (queued FIFO) before it takes a run slot.
        The readiness probe (a CPU-only canary) takes none."""
        if self.gpu is None or probe:
            yield None
            return
        async with self.gpu.grant(req) as grant:
            yield grant

    async def _one_shot(self, req: ExecuteRequest, emit: Emit, active: ActiveRun, queued_ms: int,
                        grant: Grant | None = None) -> CellOutcome:
        run_id = secrets.token_hex(8)
        gpu = self.gpu if grant is not None else None
        jail = await (gpu.take_jail(grant) if gpu is not None and grant is not None else self._take_jail())
        try:
            if gpu is not None and grant is not None:
                await gpu.arm(jail, grant)  # MPS: the daemon-side limit, before any code runs
                await gpu.write_grant(jail, grant)
            await emit(protocol.start_frame(req.id, run_id, None, queued_ms, self._timeout_ms(req),
                                            grant.frame() if grant is not None else None))
            with gpu.watch(run_id, jail, grant) if gpu is not None and grant is not None else contextlib.nullcontext():
                outcome = await self._cell(jail, req, emit, active, keep_alive=False)
            # SIGKILL goes to every process of the run now: none runs another instruction of
            # its code. Files are read, and GPU memory handed back, only once all are gone.
            jail.process.signal_kill()
            if gpu is not None or outputs.has_any(jail.workdir):
                await jail.process.kill()
                await self._send_outputs(jail, req.id, run_id, None, emit)
            return outcome
        finally:
            if gpu is not None:
                await jail.destroy()
            else:
                self._teardown(jail)  # reaping and removing the directory need not delay `done`

    async def _new_session(self, req: ExecuteRequest, owner: str, emit: Emit, active: ActiveRun,
                           queued_ms: int) -> tuple[CellOutcome, str]:
        jail = await self._take_jail()
        try:
            session = self.sessions.add(owner, jail)
        except BaseException:
            await jail.destroy()
            raise
        self._update_pool_gauges()
        async with session.lock:
            return await self._session_cell(session, req, emit, active, queued_ms), session.id

    async def _session_cell(self, session: Session, req: ExecuteRequest, emit: Emit, active: ActiveRun,
                            queued_ms: int) -> CellOutcome:
        run_id = secrets.token_hex(8)
        jail = session.jail
        uid = self.host.uid if self.host else self.settings.uid
        if not jail.alive:
            await self.sessions.close(session.id)
            raise RequestRejected(f"session {session.id} has ended (its interpreter is gone)")
        await emit(protocol.start_frame(req.id, run_id, session.id, queued_ms, self._timeout_ms(req)))
        before = await asyncio.to_thread(outputs.snapshot, jail.workdir, uid)
        try:
            outcome = await self._cell(jail, req, emit, active, keep_alive=True)
        except BaseException:
            await self.sessions.close(session.id)  # a cell cut off mid-way leaves no usable state
            self._update_pool_gauges()
            raise
        session.last_used = time.monotonic()
        if not outcome.interpreter_alive:
            await jail.process.kill()
        await self._send_outputs(jail, req.id, run_id, before, emit)
        if not outcome.interpreter_alive:
            await self.sessions.close(session.id)
            self._update_pool_gauges()
            note = "the session has ended: its interpreter could not be recovered"
            outcome.message = f"{outcome.message}; {note}" if outcome.message else note
        return outcome

    async def close_session(self, session_id: str, owner: str) -> bool:
        closed = await self.sessions.close(session_id, owner)
        self._update_pool_gauges()
        return closed

    async def _send_outputs(self, jail: Jail, rid: str, run_id: str, before: outputs.Snapshot | None,
                            emit: Emit) -> None:
        uid = self.host.uid if self.host else self.settings.uid
        files = await asyncio.to_thread(
            outputs.collect, jail.workdir, uid, before, self.settings.max_file_out_bytes)
        for item in files:
            data = base64.b64encode(item.data).decode() if item.data is not None else None
            await emit(protocol.file_frame(rid, item.path, item.size, data, item.message))
        if self.settings.outputs_dir is not None and files:
            try:
                await asyncio.to_thread(outputs.persist, files, self.settings.outputs_dir, run_id)
            except OSError as exc:
                log.error("could not persist outputs", extra={"run": run_id, "error": str(exc)})


async def _safe_emit(emit: Emit, frame: Frame) -> None:
    with contextlib.suppress(Exception):
        await emit(frame)


def _ms_since(started: float) -> int:
    return int((time.monotonic() - started) * 1000)
