"""What GPU mode needs from the host to enforce budgets, checked at startup: fail closed.

Each gap names its cause, what it would silently break, and the fix. Under
SANDBOX_GPU_ENFORCE=strict (the default) any gap stops startup; under `best-effort` the
server runs on, and every gap is shown in /readyz (`gpu.degraded`) and /metrics
(`appliance_gpu_degraded{reason}`). `gaps` is pure; `read_facts` is the thin reader.
"""

from __future__ import annotations

import os
import stat
import threading
from dataclasses import dataclass, field
from pathlib import Path

from appliance.gpu.backend import Device, ProcessUsage

# firejail 0.9.72's --private-dev copies /dev/nvidia0 to /dev/nvidia9 only (its fs_dev.c lists
# those ten names), so a GPU whose node has a higher minor gets no node in a jail.
FIREJAIL_MAX_MINOR = 9
BEST_EFFORT = "or set SANDBOX_GPU_ENFORCE=best-effort to run degraded, said in /readyz and /metrics"

PER_PROCESS = "per_process_memory"
CHILDREN = "proc_children"
SMAPS = "smaps_rollup"
UVM = "nvidia_uvm"
MINOR = "device_minor"


@dataclass(frozen=True)
class HostFacts:
    children: bool  # /proc/<pid>/task/<tid>/children exists (CONFIG_PROC_CHILDREN)
    smaps_rollup: bool  # /proc/<pid>/smaps_rollup exists
    cgroup_memory: bool  # GPU runs' host memory is read from their memory cgroups
    nvidia_uvm: bool | None  # /dev/nvidia-uvm is a character device; None: simulated devices
    devices: tuple[Device, ...] = ()
    unknown_usage: tuple[ProcessUsage, ...] = ()  # processes NVML lists without their memory


@dataclass(frozen=True)
class Gap:
    reason: str
    text: str  # the cause, what it breaks, the fix
    devices: tuple[str, ...] = field(default=())  # UUIDs no run may be scheduled on


def unavailable_text(what: str) -> str:
    """The per-process-memory gap, for startup and for the watchdog."""
    return (
        f"NVML reports no per-process GPU memory ({what}: usedGpuMemory is NVML_VALUE_NOT_AVAILABLE, "
        "as under MPS, some drivers and virtualised GPUs), so the watchdog cannot measure a run's "
        "GPU memory and no budget is enforced; fix: run on a host whose driver reports per-process "
        "memory (a bare-metal or passthrough GPU without MPS)"
    )


def gaps(facts: HostFacts) -> list[Gap]:
    """Every gap in what the watchdog needs (pure)."""
    found: list[Gap] = []
    if facts.unknown_usage:
        pids = ", ".join(str(p.pid) for p in facts.unknown_usage[:5])
        found.append(Gap(PER_PROCESS, unavailable_text(f"processes {pids}")))
    if not facts.children:
        found.append(
            Gap(
                CHILDREN,
                "the kernel has no /proc/<pid>/task/<tid>/children (CONFIG_PROC_CHILDREN is off): the "
                "watchdog finds a run's processes through it, so no run's GPU or host memory would be "
                "attributed and no budget enforced; fix: a kernel built with CONFIG_PROC_CHILDREN=y "
                "(distribution kernels are)",
            )
        )
    if not facts.smaps_rollup and not facts.cgroup_memory:
        found.append(
            Gap(
                SMAPS,
                "no /proc/<pid>/smaps_rollup (a kernel older than 4.14) and no per-run memory cgroups: "
                "GPU jails have no RLIMIT_AS, and the watchdog's host-memory cap (SANDBOX_MEMORY_MB) "
                "would read 0 and never stop a run; fix: per-run cgroups (SANDBOX_CGROUPS, a memory "
                "controller the server can write) or a kernel with smaps_rollup",
            )
        )
    if facts.nvidia_uvm is False:
        found.append(
            Gap(
                UVM,
                "/dev/nvidia-uvm is missing or not a character device: CUDA creates it through the "
                "setuid nvidia-modprobe, which cannot run in a jail, so every GPU run would fail to "
                "create a CUDA context; fix: `nvidia-modprobe -u -c=0` before the appliance starts "
                "(at boot; docs/gpu.md, Host prerequisites)",
            )
        )
    for dev in facts.devices:
        if dev.minor > FIREJAIL_MAX_MINOR:
            found.append(
                Gap(
                    MINOR,
                    f"GPU {dev.index} ({dev.uuid}) is /dev/nvidia{dev.minor}: firejail 0.9.72's "
                    f"--private-dev brings /dev/nvidia0 to /dev/nvidia{FIREJAIL_MAX_MINOR} only, so a jail "
                    "on it would get no device node and every run there would fail; fix: run on GPUs "
                    f"whose minors are 0-{FIREJAIL_MAX_MINOR} (give this host or container only those), "
                    "or a firejail that passes higher minors (best-effort: this GPU is not scheduled)",
                    devices=(dev.uuid,),
                )
            )
    return found


def startup_error(found: list[Gap]) -> str:
    """The strict-mode startup message: every gap, and the way out."""
    return (
        "SANDBOX_GPU=1 but budgets cannot be enforced on this host: "
        + "; ".join(g.text for g in found)
        + f"; {BEST_EFFORT}"
    )


def read_facts(
    devices: list[Device], processes: list[ProcessUsage], cgroup_memory: bool, real_devices: bool
) -> HostFacts:
    """The facts `gaps` judges, read from this host's /proc and /dev."""
    tid = threading.get_native_id()
    uvm: bool | None = None
    if real_devices:
        try:
            uvm = stat.S_ISCHR(os.stat("/dev/nvidia-uvm").st_mode)
        except OSError:
            uvm = False
    return HostFacts(
        children=Path(f"/proc/{os.getpid()}/task/{tid}/children").exists(),
        smaps_rollup=Path(f"/proc/{os.getpid()}/smaps_rollup").exists(),
        cgroup_memory=cgroup_memory,
        nvidia_uvm=uvm,
        devices=tuple(devices),
        unknown_usage=tuple(p for p in processes if p.used_mb is None),
    )
