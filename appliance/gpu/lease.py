"""GPU mode: backend, ledger, watchdog and one jail pool per device, behind one lease.

Startup (appliance.runtime.lifecycle): `GpuLeases.open(settings)` (a missing driver stops startup
here), `start(make_factory, cpu)`, `probe_mps()`. Per run, one context manager:

    async with gpu.lease(request) as lease:   # GPU memory reserved, FIFO (or `busy`)
        jail = await lease.take()             # the device's warm jail, MPS limit armed,
        ...                                   # budget file written, watchdog watching
    # leaving: unwatched, killed, removed; the reservation handed back; ledger reconciled

A run that asks for no GPU (budget 0) gets a CPU lease from the `PoolLeases` it was given.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from appliance.core.domain import RunRequest
from appliance.core.errors import GpuMemoryLimit, RequestRejected, StartupError
from appliance.core.tasks import TaskScope
from appliance.gpu import hostcheck
from appliance.gpu.backend import (
    COMPUTE_DEFAULT,
    COMPUTE_EXCLUSIVE_PROCESS,
    COMPUTE_PROHIBITED,
    Device,
    GpuBackend,
    GpuBackendError,
    ProcessUsage,
)
from appliance.gpu.ledger import GpuLedger, Grant
from appliance.gpu.mps import DaemonControl, MpsControl, control_socket_present
from appliance.gpu.mps_limits import MpsLimiter
from appliance.gpu.watchdog import GpuWatchdog
from appliance.sandbox.channel import GRANT_FILE
from appliance.sandbox.devices import GpuDevice, gpu_device
from appliance.sandbox.host import readable_ancestors_problem
from appliance.sandbox.jail import Jail, JailFactory
from appliance.sandbox.lease import Lease, LeaseSource, PoolLeases
from appliance.sandbox.pool import ProfilePools
from appliance.sandbox.profiles import Profile, choose, imports_of
from appliance.settings import Settings

log = logging.getLogger("appliance.gpu")


def budget_mb(settings: Settings, req: RunRequest) -> int:
    """A run's GPU budget: its own, else SANDBOX_GPU_DEFAULT_MB (0: the run gets no GPU)."""
    return req.gpu.memory_mb if req.gpu is not None else settings.gpu_default_mb


def open_backend(settings: Settings) -> GpuBackend:
    """The backend SANDBOX_GPU_BACKEND names; StartupError (clear, actionable) if it cannot start."""
    if settings.gpu_backend == "simulated":
        from appliance.gpu.simulated import SimulatedBackend

        return SimulatedBackend(
            settings.gpu_simulate_mb, settings.gpu_simulate_file, mps=settings.gpu_simulate_mps != "off"
        )
    from appliance.gpu.nvml import NvmlBackend  # the only import of NVML, and only here

    try:
        return NvmlBackend()
    except GpuBackendError as exc:
        raise StartupError(str(exc)) from exc


def open_mps(settings: Settings, backend: GpuBackend) -> tuple[MpsControl | None, str]:
    """The MPS control daemon runs will join, or None and why not."""
    if settings.gpu_mps == "off":
        return None, "not used (SANDBOX_GPU_MPS=off)"
    if settings.gpu_simulate_mps != "off":
        from appliance.gpu.mps_simulated import SimulatedMps
        from appliance.gpu.simulated import SimulatedBackend

        if not isinstance(backend, SimulatedBackend):  # settings allow it with that backend only
            raise StartupError("SANDBOX_GPU_SIMULATE_MPS needs the simulated GPU backend")
        return SimulatedMps(settings.gpu_mps_pipe_dir, backend, enforce=settings.gpu_simulate_mps == "on"), ""
    if not backend.mps_active():
        return None, "no CUDA MPS control daemon on this host"
    problem = readable_ancestors_problem(settings.gpu_mps_pipe_dir, settings.uid)
    if problem:
        return None, f"the MPS pipe directory is not reachable by the sandbox uid: {problem}"
    if not control_socket_present(settings.gpu_mps_pipe_dir):
        return None, (
            f"an MPS control daemon runs, but {settings.gpu_mps_pipe_dir} holds no control socket "
            "(set SANDBOX_GPU_MPS_PIPE_DIR to its CUDA_MPS_PIPE_DIRECTORY)"
        )
    try:
        return DaemonControl(settings.gpu_mps_pipe_dir), ""
    except GpuBackendError as exc:
        return None, str(exc)


def mig_problem(devices: list[Device]) -> str | None:
    """Why GPU mode refuses these devices (MIG mode on), naming the fix; None if it does not.

    A MIG-enabled GPU is addressed by its instances' UUIDs and needs /dev/nvidia-caps; the
    appliance schedules whole GPUs by index, so it refuses rather than guess. Scheduling
    MIG instances as devices is not supported (future work).
    """
    mig = [d for d in devices if d.mig]
    if not mig:
        return None
    names = ", ".join(f"{d.index} ({d.uuid})" for d in mig)
    return (
        f"SANDBOX_GPU=1 but MIG mode is enabled on GPU {names}: the appliance schedules whole GPUs "
        "and cannot schedule MIG instances. Disable MIG (nvidia-smi -i <index> -mig 0, then reset the "
        "GPU or reboot); running on MIG instances by UUID is not supported yet"
    )


ERROR_46 = "CUDA error 46 (CUDA_ERROR_DEVICES_UNAVAILABLE)"


def compute_mode_problem(
    device: Device, mode: str, daemon: bool, joins_mps: bool, why_not: str
) -> str | None:
    """Why GPU mode refuses this device in compute mode `mode`, naming the fix; None if it runs (pure).

    The decision per mode (docs/gpu.md, "Compute modes"):
    - DEFAULT: runs.
    - EXCLUSIVE_PROCESS with the device's jails joining MPS (`joins_mps`): runs; that is what
      MPS needs.
    - EXCLUSIVE_PROCESS with an MPS daemon the jails cannot join: refused. The daemon holds the
      device's only context, so every jailed run fails with CUDA error 46.
    - EXCLUSIVE_PROCESS without a daemon: refused, not clamped to one run at a time. One
      process per device may hold a context, so a run's child process, a killed run's context
      not yet torn down, or any other process on the host would make runs fail with CUDA
      error 46 inside their code. Serialising the appliance would still leave those failures,
      and would silently give up the shared GPU that GPU mode is for.
    - PROHIBITED: refused; no process may create a context.
    - EXCLUSIVE_THREAD (deprecated) or a mode this code does not know: refused (fail closed).
    """
    if mode == COMPUTE_DEFAULT or (mode == COMPUTE_EXCLUSIVE_PROCESS and joins_mps):
        return None
    where = f"GPU {device.index} ({device.uuid}) is in {mode} compute mode"
    fix = f"set it back with `nvidia-smi -i {device.index} -c DEFAULT`"
    if mode == COMPUTE_EXCLUSIVE_PROCESS and daemon:
        return (
            f"{where} with an MPS control daemon: the daemon holds the GPU's only context and a "
            f"jail cannot join MPS ({why_not}), so every GPU run would fail with {ERROR_46}; {fix} "
            "(and stop the daemon: echo quit | nvidia-cuda-mps-control), or leave GPU mode off"
        )
    if mode == COMPUTE_EXCLUSIVE_PROCESS:
        return (
            f"{where}: one process at a time may hold a context on it, so concurrent runs, a run's "
            f"child processes and a killed run's context not yet torn down would fail with {ERROR_46}; {fix}"
        )
    if mode == COMPUTE_PROHIBITED:
        return f"{where}: no process may create a context on it, so every GPU run would fail with {ERROR_46}; {fix}"
    return f"{where}, which the appliance does not run on (one context per thread, or unknown); {fix}"


class GpuLeases(LeaseSource):
    """Everything GPU mode adds to a run."""

    def __init__(self, settings: Settings, backend: GpuBackend, cgroup_memory: bool = False) -> None:  # noqa: C901 (GPU mode's startup checks in order, each failing closed with its own message)
        self.settings = settings
        self.backend = backend
        raw = backend  # the simulated MPS daemon needs the simulated backend itself
        try:
            devices = backend.devices()
            processes = backend.processes()
        except GpuBackendError as exc:
            raise StartupError(f"SANDBOX_GPU=1 but the GPUs could not be read: {exc}") from exc
        if not devices:
            raise StartupError("SANDBOX_GPU=1 but no GPU was found")
        problem = mig_problem(devices)
        if problem:
            raise StartupError(problem)
        # What the watchdog needs from the host (fail closed): strict stops here, best-effort
        # runs on with each gap in /readyz and /metrics, and GPUs no jail could use left out.
        facts = hostcheck.read_facts(devices, processes, cgroup_memory, backend.real_devices)
        found = hostcheck.gaps(facts)
        if found and settings.gpu_enforce == "strict":
            raise StartupError(hostcheck.startup_error(found))
        self.degraded: dict[str, str] = {}
        for gap in found:
            self.degraded[gap.reason] = "; ".join(filter(None, (self.degraded.get(gap.reason), gap.text)))
            log.warning(
                "GPU mode degraded (SANDBOX_GPU_ENFORCE=best-effort)",
                extra={"reason": gap.reason, "gap": gap.text},
            )
        unusable = {uuid for gap in found for uuid in gap.devices}
        if unusable:
            devices = [d for d in devices if d.uuid not in unusable]
            if not devices:
                raise StartupError(
                    "SANDBOX_GPU=1 but no GPU can be given to a jail: "
                    + "; ".join(g.text for g in found if g.devices)
                )
            self.backend = backend = Without(backend, frozenset(unusable))
        self.ledger = GpuLedger(
            devices, settings.gpu_margin_mb, settings.gpu_queue_ms, settings.gpu_reclaim_ms
        )
        self.ledger.load(devices, processes, ours=())  # startup reconciliation: all in use is foreign
        self.devices = {d.uuid: d for d in devices}
        self.watchdog = GpuWatchdog(
            backend,
            self.ledger,
            margin_mb=settings.gpu_margin_mb,
            host_memory_mb=settings.memory_mb,
            interval_s=settings.gpu_poll_ms / 1000,
            strict=settings.gpu_enforce == "strict",
        )
        self.profiles = tuple(Profile(name, mods) for name, mods in settings.preload_profiles)
        self.pools: dict[str, ProfilePools] = {}  # device UUID -> its pools, one per profile
        self.factories: dict[str, JailFactory] = {}  # device UUID -> the fullest profile's (MPS probe)
        self.cpu: PoolLeases | None = None  # runs that ask for no GPU
        control, self.mps_note = open_mps(settings, raw)
        if control is None and settings.gpu_mps == "require":
            raise StartupError(f"SANDBOX_GPU_MPS=require but MPS cannot be used: {self.mps_note}")
        self.mps = (
            None
            if control is None
            else MpsLimiter(control, settings.uid, settings.gpu_margin_mb, settings.gpu_libcuda, self._evict)
        )
        try:
            self._refuse_compute_modes(devices)
        except BaseException:
            if self.mps is not None:
                self.mps.control.close()
            raise

    def _refuse_compute_modes(self, devices: list[Device]) -> None:
        """StartupError naming every device whose compute mode no run could use (`compute_mode_problem`)."""
        daemon = self.mps is not None
        with contextlib.suppress(Exception):
            daemon = daemon or self.backend.mps_active()
        found = []
        for dev in devices:
            try:
                mode = self.backend.compute_mode(dev.uuid)
            except GpuBackendError as exc:  # unreadable: refuse rather than guess (fail closed)
                raise StartupError(
                    f"SANDBOX_GPU=1 but the compute mode of GPU {dev.index} could not be read: {exc}"
                ) from exc
            joins, why_not = False, self.mps_note
            if mode == COMPUTE_EXCLUSIVE_PROCESS and self.mps is not None:
                blocked = self.mps.check_blockers(dev.uuid, exclusive=True)
                joins, why_not = blocked is None, blocked.note if blocked is not None else ""
            problem = compute_mode_problem(dev, mode, daemon, joins, why_not)
            if problem:
                found.append(problem)
        if found:
            raise StartupError("SANDBOX_GPU=1 but " + "; ".join(found))

    @classmethod
    def open(cls, settings: Settings, cgroup_memory: bool = False) -> GpuLeases:
        backend = open_backend(settings)
        try:
            return cls(settings, backend, cgroup_memory)
        except BaseException:
            backend.close()
            raise

    def start(
        self, make_factory: Callable[[GpuDevice, Profile], JailFactory], cpu: PoolLeases, owner: TaskScope
    ) -> None:
        """Warm pools per device and profile; start the watchdog (their tasks are `owner`'s)."""
        self.cpu = cpu
        fullest = max(self.profiles, key=lambda p: len(p.modules))
        for dev in self.devices.values():
            pipe_dir = None
            if self.mps is not None and self.mps.check_blockers(dev.uuid, self._exclusive(dev.uuid)) is None:
                pipe_dir = self.mps.control.pipe_dir  # only jails that can be limited join MPS
            device = gpu_device(dev.index, dev.uuid, dev.minor, mps_pipe_dir=pipe_dir)
            pools = ProfilePools.build(
                self.profiles, functools.partial(make_factory, device), self.settings.pool_size
            )
            pools.start(owner)
            self.pools[dev.uuid] = pools
            self.factories[dev.uuid] = pools.pools[fullest].factory
        self.watchdog.start(owner)
        log.info("GPU mode started", extra={"backend": self.backend.name, "devices": self.ledger.snapshot()})

    async def probe_mps(self) -> None:
        """Prove layer (b) on every device with a real jail; StartupError where it is required."""
        if self.mps is None:
            return
        for uuid, factory in self.factories.items():
            exclusive = await asyncio.to_thread(self._exclusive, uuid)
            device = await self.mps.probe(uuid, factory, exclusive, self.devices[uuid].total_mb)
            log.info("MPS probe", extra={"device": uuid, "enforcing": device.enforcing, "note": device.note})
            if self.settings.gpu_mps == "require" and not device.enforcing:
                raise StartupError(
                    f"SANDBOX_GPU_MPS=require but MPS limits are not enforced on {uuid}: {device.note}"
                )

    def _exclusive(self, uuid: str) -> bool:
        """Whether the device is in EXCLUSIVE_PROCESS compute mode (unreadable: taken as not)."""
        try:
            return self.backend.exclusive_process(uuid)
        except GpuBackendError:
            return False

    async def close(self) -> None:
        await self.watchdog.close()
        if self.cpu is not None:
            await self.cpu.close()
        for pool in self.pools.values():
            await pool.close()
        if self.mps is not None:
            self.mps.control.close()
        self.backend.close()

    # -- per run ---------------------------------------------------------------------------
    def budget_mb(self, req: RunRequest) -> int:
        return budget_mb(self.settings, req)

    @contextlib.asynccontextmanager
    async def lease(self, req: RunRequest) -> AsyncIterator[Lease]:
        """Hold the run's GPU reservation (in line, FIFO) and, once taken, its armed jail."""
        mb = self.budget_mb(req)
        if mb <= 0:
            if self.cpu is None:
                raise RuntimeError("GpuLeases.lease before start()")
            async with self.cpu.lease(req) as cpu_lease:
                yield cpu_lease
            return
        # A session ("new") holds this grant for its whole life: the service keeps the lease
        # and the ledger counts it like a run until the session ends (SessionRegistry.close).
        if self.watchdog.paused:
            raise RequestRejected(f"GPU runs are paused: the GPU backend fails ({self.watchdog.last_error})")
        if self.watchdog.unavailable is not None and self.watchdog.strict:
            raise RequestRejected(
                f"GPU runs are refused: {self.watchdog.unavailable}; {hostcheck.BEST_EFFORT}"
            )
        profile = choose(self.profiles, imports_of(req.code))
        grant = await self.ledger.acquire(mb)
        async with GpuLease(self, grant, profile) as lease:  # ended unless a session keeps it
            yield lease

    async def _take(self, lease: GpuLease) -> Jail:
        grant = lease.grant
        jail = await self.pools[grant.uuid].pools[lease.preload].take()
        lease.jail = jail
        if self.mps is not None:
            await self.mps.arm(jail, grant)  # layer (b): the daemon-side limit, before any code
        body = {**dataclasses.asdict(grant.share()), "margin_mb": self.settings.gpu_margin_mb}
        await asyncio.to_thread(_write_file, jail.workdir / GRANT_FILE, json.dumps(body))
        self.watchdog.watch(lease.key, jail.process.pid, grant, jail.process.stop)
        return jail

    async def _end(self, lease: GpuLease) -> None:
        watched = self.watchdog.unwatch(lease.key)
        try:
            if lease.jail is not None:
                await lease.jail.destroy()
        finally:
            # Held until NVML no longer lists the run (SANDBOX_GPU_RECLAIM_MS at most): a kill is not a free.
            self.ledger.release(lease.grant, watched.ids if watched is not None else ())
            with contextlib.suppress(Exception):  # reconcile at once; the watchdog retries anyway
                await self.watchdog.check()

    def _evict(self, pid: int) -> None:
        """A process that got another run's MPS limit: stop the run it belongs to."""
        self.watchdog.stop_owner(
            pid,
            GpuMemoryLimit(
                "the run opened a CUDA client while another run's GPU memory limit was being set; "
                "that client was terminated"
            ),
        )

    # -- readiness -------------------------------------------------------------------------
    def layers(self) -> dict[str, Any]:
        """Each enforcement layer and whether it works now (for /readyz)."""
        mps = False
        with contextlib.suppress(Exception):
            mps = self.backend.mps_active()
        return {
            "backend": self.backend.name,
            "enforce": self.settings.gpu_enforce,
            "degraded": self.degradation(),
            "devices": self.ledger.snapshot(),
            "queued": self.ledger.waiting,
            "watchdog": {
                "available": self.watchdog.healthy,
                "polls": self.watchdog.polls,
                "error": self.watchdog.last_error,
            },
            "mps": self.mps.layer()
            if self.mps is not None
            else {"available": mps, "enforcing": False, "note": self.mps_note},
            # Whether llama.cpp imports in the jails' Python is the tools probe's answer (the run
            # service fills it in); a module this process can find says nothing about that.
            "shaping": {"available": False},
        }

    def degradation(self) -> dict[str, str]:
        """Each reason budgets are enforced only in part now (best-effort; strict refuses instead)."""
        found = dict(self.degraded)
        if self.watchdog.unavailable is not None:
            found[hostcheck.PER_PROCESS] = self.watchdog.unavailable
        return found

    def problems(self) -> list[str]:
        """What makes GPU mode not ready now (for /readyz)."""
        found = [] if self.watchdog.healthy else [f"GPU watchdog cannot measure: {self.watchdog.last_error}"]
        if self.watchdog.unavailable is not None and self.watchdog.strict:
            found.append(f"GPU runs are refused: {self.watchdog.unavailable}; {hostcheck.BEST_EFFORT}")
        return found + (self.mps.problems() if self.mps is not None else [])


class Without(GpuBackend):
    """A backend with some GPUs left out (best-effort: GPUs no jail could be given)."""

    def __init__(self, inner: GpuBackend, left_out: frozenset[str]) -> None:
        self.inner = inner
        self.left_out = left_out
        self.name = inner.name
        self.real_devices = inner.real_devices

    def devices(self) -> list[Device]:
        return [d for d in self.inner.devices() if d.uuid not in self.left_out]

    def processes(self) -> list[ProcessUsage]:
        return [p for p in self.inner.processes() if p.uuid not in self.left_out]

    def mps_active(self) -> bool:
        return self.inner.mps_active()

    def compute_mode(self, uuid: str) -> str:
        return self.inner.compute_mode(uuid)

    def close(self) -> None:
        self.inner.close()


class GpuLease(Lease):
    """A run's GPU reservation and, once taken, its jail on the reserved device."""

    def __init__(self, source: GpuLeases, grant: Grant, profile: Profile) -> None:
        super().__init__(profile.name, queued_ms=grant.queued_ms, gpu=grant.share())
        self.grant = grant
        self.preload = profile
        self.key = f"lease-{id(self):x}"
        self._source = source

    async def take(self) -> Jail:
        return await self._source._take(self)

    async def _end(self) -> None:
        await self._source._end(self)


def _write_file(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o444)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
