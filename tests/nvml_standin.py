"""The stand-in NVML library (tests/stub_libnvidia_ml.c): built by the tests, driven by a state file.

`build(folder)` compiles `libnvidia-ml.so.1` (SONAME included) into folder. pynvml (nvidia-ml-py)
finds it by its ordinary lookup, `CDLL("libnvidia-ml.so.1")`: in a child process through
LD_LIBRARY_PATH, in this one by loading it first by path (`preload`), since the dynamic loader
answers a bare SONAME with a library already loaded under it.

`Host` writes the simulated host the library reads on every call ($STUB_NVML_STATE): devices,
and the processes holding memory on them by host PID. For each process it records the PID
namespace the process lives in and its PID there (from /proc/PID/status's NSpid), so that the
library can translate PIDs into its caller's namespace and hide the ones the caller cannot
see, as the driver does.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support import REPO

SOURCE = REPO / "tests" / "stub_libnvidia_ml.c"
SONAME = "libnvidia-ml.so.1"
MODES = {"DEFAULT": 0, "EXCLUSIVE_THREAD": 1, "PROHIBITED": 2, "EXCLUSIVE_PROCESS": 3}


def build(folder: Path) -> Path:
    """Compile the stand-in into folder/libnvidia-ml.so.1 (gcc is part of the suite's setup)."""
    if shutil.which("gcc") is None:
        pytest.fail("gcc is needed to build tests/stub_libnvidia_ml.c (apt-get install gcc)")
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / SONAME
    subprocess.run(
        [
            "gcc",
            "-shared",
            "-fPIC",
            "-O1",
            "-Wall",
            "-Werror",
            f"-Wl,-soname,{SONAME}",
            "-o",
            str(out),
            str(SOURCE),
        ],
        check=True,
    )
    return out


def preload(library: Path) -> None:
    """Load the stand-in into this process, so that pynvml's CDLL(SONAME) gets it."""
    ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)


def pid_namespace(pid: int | str = "self") -> int:
    return os.stat(f"/proc/{pid}/ns/pid").st_ino


def ns_pid(pid: int) -> tuple[int, int]:
    """(the PID namespace pid lives in, pid's number there); pid as given where /proc cannot say."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        inner = int(next(line for line in status.splitlines() if line.startswith("NSpid:")).split()[-1])
        return pid_namespace(pid), inner
    except (OSError, StopIteration, ValueError):
        return pid_namespace(), pid


@dataclass
class Proc:
    device: int
    pid: int  # host PID (the writer's namespace)
    used_mb: int | None  # None: NVML_VALUE_NOT_AVAILABLE
    ns: int
    inner: int
    freed_at_ms: int = 0
    mps: bool = False


@dataclass
class Host:
    """The simulated host the stand-in reads (re-written on every change)."""

    state: Path
    devices: list[tuple[int, int, str, int, int]] = field(
        default_factory=list
    )  # minor, total, uuid, mig, mode
    foreign_mb: dict[int, int] = field(default_factory=dict)
    procs: dict[tuple[int, int], Proc] = field(default_factory=dict)
    fault: int = 0
    init_error: int = 0

    def add_device(
        self,
        total_mb: int,
        minor: int | None = None,
        uuid: str | None = None,
        mig: int = 0,
        mode: str = "DEFAULT",
    ) -> str:
        index = len(self.devices)
        uuid = uuid or f"GPU-{index:08x}-5ee0-4c2b-9f7a-00000000{index:04x}"
        self.devices.append((index if minor is None else minor, total_mb, uuid, mig, MODES[mode]))
        self.write()
        return uuid

    def use(self, pid: int, used_mb: int | None, device: int = 0, mps: bool = False) -> None:
        """pid holds used_mb MiB on device (None: NVML cannot tell how much)."""
        ns, inner = ns_pid(pid)
        self.procs[(device, pid)] = Proc(device, pid, used_mb, ns, inner, mps=mps)
        self.write()

    def free(self, pid: int, after_s: float = 0.0, device: int = 0) -> None:
        """pid's memory is freed after_s from now; listed (dead or not) until then."""
        proc = self.procs.get((device, pid))
        if proc is not None:
            proc.freed_at_ms = int((time.time() + after_s) * 1000) or 1
            self.write()

    def write(self) -> None:
        lines = [f"hostns {pid_namespace()}"]
        if self.init_error:
            lines.append(f"init {self.init_error}")
        if self.fault:
            lines.append(f"fault {self.fault}")
        for i, (minor, total, uuid, mig, mode) in enumerate(self.devices):
            lines.append(
                f"device {minor} {total} {self.foreign_mb.get(i, 0)} {mig} {mode} {uuid} Stand-in H200"
            )
        for p in self.procs.values():
            used = "na" if p.used_mb is None else str(p.used_mb)
            kind = "mps" if p.mps else "compute"
            lines.append(f"proc {p.device} {p.pid} {used} {p.ns} {p.inner} {p.freed_at_ms} {kind}")
        tmp = self.state.with_suffix(".tmp")
        tmp.write_text("\n".join(lines) + "\n")
        tmp.replace(self.state)
