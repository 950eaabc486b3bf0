"""The one seam between the appliance and the GPUs: `GpuBackend`, with plain data in and out.

Two implementations: `appliance.gpu.nvml.NvmlBackend` (the real one, over NVML) and
`appliance.gpu.simulated.SimulatedBackend` (for machines without a GPU). The rest of the
code never sees NVML types or errors: a backend raises `GpuBackendError` only.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

# Compute modes as NVML names them (nvmlComputeMode_t); a backend reports one of these per device,
# or "UNKNOWN(<n>)" for a value it does not know (refused at startup: fail closed).
COMPUTE_DEFAULT = "DEFAULT"
COMPUTE_EXCLUSIVE_THREAD = "EXCLUSIVE_THREAD"  # deprecated (removed from CUDA), still a value NVML can report
COMPUTE_PROHIBITED = "PROHIBITED"
COMPUTE_EXCLUSIVE_PROCESS = "EXCLUSIVE_PROCESS"


class GpuBackendError(Exception):
    """The backend could not answer (driver gone, NVML error, injected fault)."""


@dataclass(frozen=True)
class Device:
    """One GPU as the backend sees it; memory in MiB."""

    index: int  # NVML index == /dev/nvidia<minor> on ordinary hosts (see `minor`)
    uuid: str
    name: str
    total_mb: int
    used_mb: int
    minor: int  # the /dev/nvidia<minor> node of this device
    mig: bool = False  # MIG mode enabled: the whole GPU is not one schedulable device


@dataclass(frozen=True)
class ProcessUsage:
    """GPU memory one host process holds on one device (MiB).

    used_mb is None where NVML cannot tell (usedGpuMemory NVML_VALUE_NOT_AVAILABLE: MPS clients,
    some drivers and virtualised GPUs). Never read it as 0: the process's memory is unknown.
    """

    pid: int
    uuid: str
    used_mb: int | None


class GpuBackend(abc.ABC):
    """What the ledger, the watchdog and /readyz need to know about the GPUs."""

    name: str = "abstract"
    # Whether the devices are real, with /dev/nvidia* nodes the host must have (NVML), or exist
    # only in memory (the simulated backend): the startup checks of device nodes apply to the first.
    real_devices: bool = False

    @abc.abstractmethod
    def devices(self) -> list[Device]:
        """Every device with its current total and used memory."""

    @abc.abstractmethod
    def processes(self) -> list[ProcessUsage]:
        """Per-PID memory use on every device (host PIDs, as the server sees them)."""

    @abc.abstractmethod
    def mps_active(self) -> bool:
        """Whether a CUDA MPS control daemon serves these GPUs (daemon-side limits possible)."""

    @abc.abstractmethod
    def compute_mode(self, uuid: str) -> str:
        """The device's compute mode: one of the COMPUTE_* names, or "UNKNOWN(<n>)"."""

    def exclusive_process(self, uuid: str) -> bool:
        """Whether the device only takes contexts through MPS (compute mode EXCLUSIVE_PROCESS).

        Without it a client that avoids the MPS daemon gets a context with no daemon-side limit.
        """
        return self.compute_mode(uuid) == COMPUTE_EXCLUSIVE_PROCESS

    def close(self) -> None:  # noqa: B027 (optional hook: most backends hold nothing)
        """Release the backend (NVML shutdown); idempotent."""
