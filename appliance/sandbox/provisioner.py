"""What a mode adds to the sandbox's jails, behind one interface (as jupyter_client's
provisioners put a kernel's start and stop behind one base class).

The composition root (`appliance.runtime.lifecycle.provisioner_for`) picks one provisioner
for the process: `PlainProvisioner` (here) runs every jail from the CPU pools;
`appliance.gpu.provisioner.GpuProvisioner` wraps them with GPU mode (device pools, the
memory ledger, the watchdog, MPS). The lifecycle calls the same steps, in the same order,
whichever it was given, and has no GPU branches of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from appliance.core.domain import RunRequest
from appliance.core.tasks import TaskScope
from appliance.sandbox.cgroups import Hierarchy
from appliance.sandbox.devices import GpuDevice
from appliance.sandbox.jail import JailFactory
from appliance.sandbox.lease import LeaseSource, PoolLeases
from appliance.sandbox.pool import ProfilePools
from appliance.sandbox.profiles import Profile

MakeFactory = Callable[[GpuDevice, Profile], JailFactory]  # a jail factory for one device's pool


class Provisioner(Protocol):
    """The mode's steps, called by the lifecycle in this order: `check_host` (fail closed),
    `start` (after the CPU pools), then `readiness`/`update_gauges` while serving, `close`.
    The run service is given it as its `appliance.core.ports.GpuBudget` (`budget_mb`)."""

    @property
    def offload(self) -> bool:
        """Whether the jails' model tools are expected to offload to a GPU (the tool probe)."""

    def budget_mb(self, req: RunRequest) -> int:
        """The GPU memory a run holds (the run service's `GpuBudget`); 0: no GPU."""

    def check_host(self, cgroups: Hierarchy | None) -> None:
        """What the mode needs from the host; StartupError naming what to fix."""

    async def start(self, make_factory: MakeFactory, cpu: PoolLeases, owner: TaskScope) -> LeaseSource:
        """Start the mode's pools and tasks (owned by `owner`) beside the CPU pools; the lease
        source runs take jails from, which wraps `cpu`."""

    def pool_sets(self) -> list[ProfilePools]:
        """The mode's pools besides the CPU ones (for the gauges)."""

    def readiness(self, tools: dict[str, Any] | None) -> tuple[list[str], dict[str, Any]]:
        """(problems, fields) the mode adds to /readyz; `tools` is the tool probe's report."""

    def update_gauges(self) -> None:
        """Move the mode's own series (when /metrics is scraped)."""

    async def close(self) -> None:
        """Stop the mode's tasks and pools, and the CPU pool `start` was given."""


class PlainProvisioner:
    """CPU jails only: runs lease from the CPU pools; nothing to check, report or stop besides."""

    def __init__(self) -> None:
        self.cpu: PoolLeases | None = None

    @property
    def offload(self) -> bool:
        return False

    def budget_mb(self, req: RunRequest) -> int:
        return 0

    def check_host(self, cgroups: Hierarchy | None) -> None:
        return None

    async def start(self, make_factory: MakeFactory, cpu: PoolLeases, owner: TaskScope) -> LeaseSource:
        self.cpu = cpu
        return cpu

    def pool_sets(self) -> list[ProfilePools]:
        return []

    def readiness(self, tools: dict[str, Any] | None) -> tuple[list[str], dict[str, Any]]:
        return [], {}

    def update_gauges(self) -> None:
        return None

    async def close(self) -> None:
        if self.cpu is not None:
            await self.cpu.close()
