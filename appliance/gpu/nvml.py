"""The real GPU backend over NVML (`nvidia-ml-py`, imported as `pynvml`).

The only module that imports pynvml, and only when an `NvmlBackend` is created (that
is, when SANDBOX_GPU=1 selects it). NVML errors are translated here into
`GpuBackendError`, `raise ... from exc`; nothing NVML-typed leaves this file.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any

from appliance.gpu.backend import (
    COMPUTE_DEFAULT,
    COMPUTE_EXCLUSIVE_PROCESS,
    COMPUTE_EXCLUSIVE_THREAD,
    COMPUTE_PROHIBITED,
    Device,
    GpuBackend,
    GpuBackendError,
    ProcessUsage,
)

MIB = 1024 * 1024
MPS_DAEMON = "nvidia-cuda-mps-control"

# Why NVML could not start, in words an operator can act on.
NO_DRIVER_HINT = (
    "install the NVIDIA driver (it ships libnvidia-ml.so.1) and load its kernel module "
    "(nvidia-smi must work), or unset SANDBOX_GPU"
)


class NvmlBackend(GpuBackend):
    """GPUs as NVML reports them. Creating it initialises NVML or raises GpuBackendError."""

    name = "nvml"
    real_devices = True

    def __init__(self) -> None:
        try:
            import pynvml  # nvidia-ml-py: the maintained bindings (the `pynvml` package is deprecated)
        except ImportError as exc:
            raise GpuBackendError(
                "the nvidia-ml-py package is not installed; install the appliance with its "
                "'gpu' extra (pip install '.[gpu]')"
            ) from exc
        self._nvml: Any = pynvml
        self._lock = threading.Lock()  # NVML is thread-safe, but init/shutdown pairs must not race
        self._open = False
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise GpuBackendError(_init_problem(pynvml, exc)) from exc
        self._open = True

    def devices(self) -> list[Device]:
        nv = self._nvml
        with self._lock:
            try:
                out = []
                for i in range(nv.nvmlDeviceGetCount()):
                    handle = nv.nvmlDeviceGetHandleByIndex(i)
                    mem = nv.nvmlDeviceGetMemoryInfo(handle)
                    out.append(
                        Device(
                            index=i,
                            uuid=_text(nv.nvmlDeviceGetUUID(handle)),
                            name=_text(nv.nvmlDeviceGetName(handle)),
                            total_mb=int(mem.total // MIB),
                            used_mb=int(mem.used // MIB),
                            minor=int(nv.nvmlDeviceGetMinorNumber(handle)),
                            mig=_mig_enabled(nv, handle),
                        )
                    )
                return out
            except nv.NVMLError as exc:
                raise GpuBackendError(f"NVML failed listing devices: {exc}") from exc

    def processes(self) -> list[ProcessUsage]:
        nv = self._nvml
        with self._lock:
            try:
                out: dict[tuple[int, str], int | None] = {}
                for i in range(nv.nvmlDeviceGetCount()):
                    handle = nv.nvmlDeviceGetHandleByIndex(i)
                    uuid = _text(nv.nvmlDeviceGetUUID(handle))
                    procs = list(nv.nvmlDeviceGetComputeRunningProcesses(handle))
                    # Under MPS, clients are listed here (Volta and later), not in the list above.
                    getter = getattr(nv, "nvmlDeviceGetMPSComputeRunningProcesses", None)
                    if getter is not None:
                        with contextlib.suppress(nv.NVMLError_NotSupported):
                            procs += list(getter(handle))
                    for proc in procs:
                        used = proc.usedGpuMemory
                        # None: NVML cannot tell (pynvml's reading of NVML_VALUE_NOT_AVAILABLE: MPS
                        # clients, some drivers, virtualised GPUs). It stays None, never 0: the
                        # watchdog refuses to call an unknown reading "within budget".
                        mb = int(used // MIB) if isinstance(used, int) else None
                        key = (int(proc.pid), uuid)
                        if key not in out:
                            out[key] = mb
                        else:  # listed twice (compute and MPS): unknown if either is
                            seen = out[key]
                            out[key] = None if mb is None or seen is None else max(seen, mb)
                return [ProcessUsage(pid=pid, uuid=uuid, used_mb=mb) for (pid, uuid), mb in out.items()]
            except nv.NVMLError as exc:
                raise GpuBackendError(f"NVML failed listing processes: {exc}") from exc

    def mps_active(self) -> bool:
        return mps_daemon_running()

    def compute_mode(self, uuid: str) -> str:
        nv = self._nvml
        names = {
            nv.NVML_COMPUTEMODE_DEFAULT: COMPUTE_DEFAULT,
            nv.NVML_COMPUTEMODE_EXCLUSIVE_THREAD: COMPUTE_EXCLUSIVE_THREAD,
            nv.NVML_COMPUTEMODE_PROHIBITED: COMPUTE_PROHIBITED,
            nv.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS: COMPUTE_EXCLUSIVE_PROCESS,
        }
        with self._lock:
            try:
                handle = nv.nvmlDeviceGetHandleByUUID(uuid.encode())
                mode = nv.nvmlDeviceGetComputeMode(handle)
            except nv.NVMLError_NotSupported:
                # A device that cannot report a compute mode cannot be set to one either
                # (nvidia-smi -c needs the same support): its contexts behave as DEFAULT.
                return COMPUTE_DEFAULT
            except nv.NVMLError as exc:
                raise GpuBackendError(f"NVML failed reading the compute mode: {exc}") from exc
        return names.get(mode, f"UNKNOWN({mode})")

    def close(self) -> None:
        with self._lock:
            if self._open:
                self._open = False
                with contextlib.suppress(self._nvml.NVMLError):
                    self._nvml.nvmlShutdown()


def _init_problem(nv: Any, exc: Exception) -> str:
    """The startup message for a failed nvmlInit."""
    if isinstance(exc, nv.NVMLError_LibraryNotFound):
        return f"SANDBOX_GPU=1 but the NVML library (libnvidia-ml.so.1) was not found: {NO_DRIVER_HINT}"
    if isinstance(exc, nv.NVMLError_DriverNotLoaded):
        return f"SANDBOX_GPU=1 but the NVIDIA kernel driver is not loaded: {NO_DRIVER_HINT}"
    if isinstance(exc, nv.NVMLError_NoPermission):
        return "SANDBOX_GPU=1 but NVML refused access (run the server as root or in the video group)"
    return f"SANDBOX_GPU=1 but NVML could not start: {exc}"


def _mig_enabled(nv: Any, handle: Any) -> bool:
    """Whether MIG mode is on now (GPUs without MIG support answer NotSupported: off)."""
    try:
        current, _pending = nv.nvmlDeviceGetMigMode(handle)
    except nv.NVMLError_NotSupported:
        return False
    return bool(current == nv.NVML_DEVICE_MIG_ENABLE)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def mps_daemon_running() -> bool:
    """Whether an MPS control daemon runs on this host (looked up by process name in /proc)."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return False
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/comm") as fh:
                if fh.read().strip() == MPS_DAEMON[:15]:  # comm is cut to 15 characters
                    return True
        except OSError:
            continue
    return False
