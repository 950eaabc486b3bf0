"""A simulated GPU backend: devices with total/used memory, per-PID usage, injectable faults.

Used by tests and the CPU benchmark on machines without a GPU. Its state comes from
two places, both optional:

- in-process calls (`set_usage`, `set_foreign_mb`, `inject_fault`), for unit tests and
  the benchmark;
- a JSON control file (`SANDBOX_GPU_SIMULATE_FILE`), re-read whenever it changes, so a
  test can drive a real server from outside::

      {"processes": [{"pid": 4242, "gpu": 0, "used_mb": 5000}],
       "foreign_mb": {"0": 1024},
       "fault": null}

  `processes` are host PIDs (as the server sees them) and the memory each "uses";
  `foreign_mb` is memory held on a device by something that is not a run (another
  tenant, the driver); `fault`, when a string, makes every call fail with it, like an
  NVML error. With `"fault_kind": "plain"` the fault is raised as a plain `Exception`,
  outside the backend's error type, as pynvml does for some failures
  (`NVMLLibraryMismatchError` derives from `Exception`, not from `NVMLError`).

`"usage_unavailable": true` reports every process's usage as unknown (None), as NVML does
where usedGpuMemory is NVML_VALUE_NOT_AVAILABLE (MPS, some drivers, virtualised GPUs); the
devices' used memory still counts it. `"report_tids": true` reports each live process's usage under the ID of its newest
thread other than the main one (where it has one), as NVML does when a worker thread
created the CUDA context. `"mig": [0]` puts those device indexes in MIG mode (read when devices are listed).
Every device is in DEFAULT compute mode, as a GPU is out of the box, unless
`"compute_mode": {"0": "EXCLUSIVE_PROCESS"}` (or PROHIBITED, EXCLUSIVE_THREAD) says otherwise. The simulated MPS daemon
(`mps_simulated.py`) reads `"mps_shm"` and `"mps_pid_namespace"` here too.

Device `i` has UUID `GPU-SIM-<i>` and device node minor `i`.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

from appliance.gpu.backend import COMPUTE_DEFAULT, Device, GpuBackend, GpuBackendError, ProcessUsage


class SimulatedBackend(GpuBackend):
    """Devices that exist only in memory; thread-safe (the watchdog polls from a thread)."""

    name = "simulated"

    def __init__(
        self, totals_mb: tuple[int, ...], control_file: Path | None = None, mps: bool = False
    ) -> None:
        self._totals = totals_mb
        self._control = control_file
        self._mps = mps
        self._lock = threading.Lock()
        self._usage: dict[int, tuple[int, int]] = {}  # pid -> (device index, MiB)
        self._foreign: dict[int, int] = {}
        self._fault: str | None = None
        self._fault_plain = False
        self._file_mtime: int | None = None
        self._file_state: dict[str, Any] = {}
        self.calls = 0

    # -- test hooks ------------------------------------------------------------------------
    def set_usage(self, pid: int, index: int, used_mb: int) -> None:
        """Make host process `pid` use `used_mb` MiB on device `index` (0 removes it)."""
        with self._lock:
            if used_mb <= 0:
                self._usage.pop(pid, None)
            else:
                self._usage[pid] = (index, used_mb)

    def set_foreign_mb(self, index: int, used_mb: int) -> None:
        """Memory held on device `index` by something other than a run."""
        with self._lock:
            self._foreign[index] = used_mb

    def inject_fault(self, message: str | None, plain: bool = False) -> None:
        """Make every call fail with `message` (None clears the fault).

        plain=True raises a bare `Exception`, not a GpuBackendError: what a backend bug or
        pynvml's `NVMLLibraryMismatchError` looks like to the caller.
        """
        with self._lock:
            self._fault = message
            self._fault_plain = plain

    # -- GpuBackend ------------------------------------------------------------------------
    def devices(self) -> list[Device]:
        usage, foreign = self._state()
        with self._lock:
            mig = set(self._read_control().get("mig") or [])
        out = []
        for i, total in enumerate(self._totals):
            used = foreign.get(i, 0) + sum(mb for dev, mb in usage.values() if dev == i)
            out.append(
                Device(
                    index=i,
                    uuid=f"GPU-SIM-{i}",
                    name="Simulated GPU",
                    total_mb=total,
                    used_mb=min(used, total),
                    minor=i,
                    mig=i in mig,
                )
            )
        return out

    def processes(self) -> list[ProcessUsage]:
        usage, _ = self._state()
        with self._lock:
            control = self._read_control()
        tids, unknown = bool(control.get("report_tids")), bool(control.get("usage_unavailable"))
        return [
            ProcessUsage(
                pid=_context_thread(pid) if tids else pid,
                uuid=f"GPU-SIM-{dev}",
                used_mb=None if unknown else mb,
            )
            for pid, (dev, mb) in sorted(usage.items())
            if 0 <= dev < len(self._totals)
        ]

    def mps_active(self) -> bool:
        return self._mps

    def compute_mode(self, uuid: str) -> str:
        # A GPU out of the box is in DEFAULT compute mode; only the control file's
        # "compute_mode": {"<index>": "EXCLUSIVE_PROCESS" | "PROHIBITED" | ...} says otherwise.
        with self._lock:
            modes = self._read_control().get("compute_mode") or {}
        index = uuid.rsplit("-", 1)[-1]
        mode = modes.get(index) if isinstance(modes, dict) else None
        return str(mode).upper() if mode else COMPUTE_DEFAULT

    def control_state(self) -> dict[str, Any]:
        """The control file's current content (the simulated MPS daemon reads its faults here)."""
        with self._lock:
            return dict(self._read_control())

    # -- internals -------------------------------------------------------------------------
    def _state(self) -> tuple[dict[int, tuple[int, int]], dict[int, int]]:
        with self._lock:
            self.calls += 1
            file_state = self._read_control()
            fault = self._fault or file_state.get("fault")
            if fault:
                if self._fault_plain if self._fault else file_state.get("fault_kind") == "plain":
                    raise Exception(f"simulated unexpected failure: {fault}")  # a plain Exception: the point
                raise GpuBackendError(f"simulated fault: {fault}")
            usage = dict(self._usage)
            foreign = dict(self._foreign)
        for item in file_state.get("processes") or []:
            try:
                usage[int(item["pid"])] = (int(item.get("gpu", 0)), int(item["used_mb"]))
            except (KeyError, TypeError, ValueError):
                continue
        for key, value in (file_state.get("foreign_mb") or {}).items():
            try:
                foreign[int(key)] = int(value)
            except (TypeError, ValueError):
                continue
        return usage, foreign

    def _read_control(self) -> dict[str, Any]:
        if self._control is None:
            return {}
        try:
            mtime = os.stat(self._control).st_mtime_ns
        except FileNotFoundError:
            self._file_state = {}
            return {}
        except OSError as exc:
            raise GpuBackendError(f"simulated control file unreadable: {exc}") from exc
        if mtime != self._file_mtime:
            try:
                state = json.loads(self._control.read_text())
            except (OSError, ValueError):
                return self._file_state  # half-written: keep the last good state
            self._file_state = state if isinstance(state, dict) else {}
            self._file_mtime = mtime
        return self._file_state


def _context_thread(pid: int) -> int:
    """The newest thread of pid other than its main one (pid itself when it has none)."""
    try:
        tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid)
    except (OSError, ValueError):
        return pid
    return tids[-1] if tids else pid
