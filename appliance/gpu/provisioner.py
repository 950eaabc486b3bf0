"""GPU mode as a provisioner wrapping the sandbox's (appliance.sandbox.provisioner).

Every difference GPU mode makes to startup, health and shutdown is here: opening the backend
(a missing driver, an unenforceable host: StartupError), the tools the GPU jails preload,
the device pools and the watchdog, the MPS probe, the GPU fields of /readyz and /metrics.
Runs take jails from `appliance.gpu.lease.GpuLeases`, which wraps the CPU pools' lease
source (a run that asks for no GPU gets a CPU jail).
"""

from __future__ import annotations

from typing import Any, Protocol

from appliance.core.domain import RunRequest
from appliance.core.errors import StartupError
from appliance.core.ports import Gauge, Histogram
from appliance.core.tasks import TaskScope
from appliance.gpu.lease import GpuLeases, budget_mb
from appliance.sandbox.cgroups import Hierarchy
from appliance.sandbox.host import import_problem
from appliance.sandbox.lease import LeaseSource, PoolLeases
from appliance.sandbox.memory import CgroupMemory
from appliance.sandbox.pool import ProfilePools
from appliance.sandbox.provisioner import MakeFactory
from appliance.settings import Settings

GPU_TOOL_MODULES = ("llama_cpp", "pywhispercpp.model")  # what a GPU jail's tools stand on


class GaugeFamily(Protocol):
    def labels(self, *values: str, **labels: str) -> Gauge: ...


class GpuMetrics(Protocol):
    """The series GPU mode moves (appliance.runtime.metrics.Metrics has them)."""

    @property
    def gpu_reclaim_seconds(self) -> Histogram: ...

    @property
    def gpu_reclaim_timeouts(self) -> Gauge: ...

    @property
    def gpu_degraded(self) -> GaugeFamily: ...

    @property
    def gpu_mps_enforcing(self) -> GaugeFamily: ...

    @property
    def gpu_mps_blocked(self) -> GaugeFamily: ...


class GpuProvisioner:
    """GPU mode's startup, lease source, health and shutdown (SANDBOX_GPU=1)."""

    def __init__(self, settings: Settings, metrics: GpuMetrics, opener: type[GpuLeases] = GpuLeases) -> None:
        self.settings = settings
        self.metrics = metrics
        self.opener = opener  # how the lease source is opened (tests: one on a given backend)
        self.gpu: GpuLeases | None = None  # opened by check_host

    @property
    def offload(self) -> bool:
        return True

    def budget_mb(self, req: RunRequest) -> int:
        """The run's GPU budget (what its tenant's GPU quota is charged): its ask, else the default."""
        return budget_mb(self.settings, req)

    def check_host(self, cgroups: Hierarchy | None) -> None:
        """Open the backend and judge the host (strict: any gap is a StartupError); the GPU
        jails' tools must import in SANDBOX_PYTHON."""
        s = self.settings
        if self.gpu is None:
            self.gpu = self.opener.open(s, cgroup_memory=cgroups is not None)
            if cgroups is not None:  # the watchdog's host-memory reading: the run's group
                self.gpu.watchdog.memory = CgroupMemory(cgroups)
        # GPU mode's warm jails preload the model tools; a jail that cannot would only say so
        # in a log line, and every run would pay the import (or fail) instead.
        tools = tuple(m for m in s.preload if m in GPU_TOOL_MODULES)
        problem = import_problem(s.python, tools)
        if problem is not None:
            raise StartupError(
                f"GPU mode preloads {', '.join(tools)} (SANDBOX_PRELOAD) but SANDBOX_PYTHON ({s.python}) "
                f"cannot import them: {problem}; install the gpu extra (pip install '.[gpu]') into it, "
                f"or leave them out of SANDBOX_PRELOAD"
            )

    def _leases(self) -> GpuLeases:
        if self.gpu is None:
            raise RuntimeError("GpuProvisioner used before check_host()")
        return self.gpu

    async def start(self, make_factory: MakeFactory, cpu: PoolLeases, owner: TaskScope) -> LeaseSource:
        """Warm pools per GPU (and profile), each jail seeing only its GPU; the watchdog; then
        the MPS probe (layer (b) is reported as enforcing only where proven)."""
        gpu = self._leases()
        gpu.start(make_factory, cpu, owner)
        await gpu.probe_mps()
        return gpu

    def pool_sets(self) -> list[ProfilePools]:
        return list(self.gpu.pools.values()) if self.gpu is not None else []

    def readiness(self, tools: dict[str, Any] | None) -> tuple[list[str], dict[str, Any]]:
        """Each enforcement layer, available or not, and what makes GPU mode not ready now."""
        gpu = self.gpu
        if gpu is None:  # before check_host: nothing opened yet
            return [], {}
        layers = gpu.layers()
        if tools is not None and isinstance(layers.get("shaping"), dict):
            # Shaping is load_llm's: available where llama_cpp imports in the jails' Python, as
            # the startup probe found (not merely where this process finds the module).
            llama = tools.get("llama_cpp") or {}
            layers["shaping"]["available"] = llama.get("available") is True
            layers["shaping"]["gpu_offload"] = llama.get("gpu_offload")
        return gpu.problems(), {"gpu": layers}

    def update_gauges(self) -> None:
        gpu, m = self.gpu, self.metrics
        if gpu is None:
            return
        ledger = gpu.ledger
        waits, ledger.reclaim_waits_s = ledger.reclaim_waits_s, []
        for wait in waits:
            m.gpu_reclaim_seconds.observe(wait)
        m.gpu_reclaim_timeouts.set(sum(b.reclaim_timeouts for b in ledger.books.values()))
        for reason in gpu.degradation():
            m.gpu_degraded.labels(reason=reason).set(1)
        mps = gpu.mps
        for uuid in gpu.devices:
            device = mps.devices.get(uuid) if mps is not None else None
            m.gpu_mps_enforcing.labels(device=uuid).set(
                1 if device is not None and device.enforcing and not device.broken else 0
            )
            for reason in device.blocked if device is not None else ():
                m.gpu_mps_blocked.labels(device=uuid, reason=reason).set(1)

    async def close(self) -> None:
        """The watchdog, the CPU pool it was given, the device pools, MPS, the backend."""
        if self.gpu is not None:
            await self.gpu.close()
