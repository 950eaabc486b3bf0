"""NVML's real code path: NvmlBackend and pynvml's own ctypes calls against a stand-in libnvidia-ml.

tests/stub_libnvidia_ml.c implements NVML's C ABI for every call appliance/gpu/nvml.py makes and
is as unkind as the driver: PIDs translated into the caller's PID namespace, processes the caller
cannot see left out, usedGpuMemory NVML_VALUE_NOT_AVAILABLE, a dead process listed until its
memory is freed, NVML_ERROR_INSUFFICIENT_SIZE first. pynvml (nvidia-ml-py, unmodified) loads it
by its ordinary lookup of libnvidia-ml.so.1.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from appliance.gpu.backend import GpuBackendError, ProcessUsage
from appliance.gpu.nvml import NvmlBackend
from tests import nvml_standin
from tests.nvml_standin import Host
from tests.support import REPO, scaled

# Needs root (unshare of a PID namespace): never in the fast tier (tests/tiers.py).
pytestmark = pytest.mark.host

MIB = 1 << 20


@pytest.fixture(scope="module")
def library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    lib = nvml_standin.build(tmp_path_factory.mktemp("nvml"))
    nvml_standin.preload(lib)
    return lib


@pytest.fixture
def host(library: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Host:
    state = tmp_path / "nvml.state"
    monkeypatch.setenv("STUB_NVML_STATE", str(state))  # the C library's getenv sees it
    return Host(state)


def sleeper(*wrap: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([*wrap, "sleep", "60"])


def test_pynvml_loads_the_stand_in_by_its_soname_and_nvml_backend_reads_every_field(host: Host) -> None:
    import pynvml

    h200 = host.add_device(143771, minor=0)
    other = host.add_device(81559, minor=3, mig=1, mode="EXCLUSIVE_PROCESS")
    host.foreign_mb[0] = 700
    host.write()
    backend = NvmlBackend()
    try:
        assert pynvml.nvmlLib is not None and "libnvidia-ml.so.1" in str(pynvml.nvmlLib)
        devices = backend.devices()
        assert [(d.index, d.uuid, d.minor, d.total_mb, d.used_mb, d.mig) for d in devices] == [
            (0, h200, 0, 143771, 700, False),
            (1, other, 3, 81559, 0, True),
        ]
        assert devices[0].name == "Stand-in H200"
        assert backend.compute_mode(h200) == "DEFAULT"
        assert backend.compute_mode(other) == "EXCLUSIVE_PROCESS"
        assert backend.processes() == []
    finally:
        backend.close()


def test_a_gpu_without_mig_support_reads_as_mig_off(host: Host) -> None:
    host.add_device(16384, mig=2)  # the stand-in answers NVML_ERROR_NOT_SUPPORTED
    backend = NvmlBackend()
    try:
        assert [d.mig for d in backend.devices()] == [False]
    finally:
        backend.close()


def test_the_process_list_asks_twice_and_reports_unavailable_memory_as_unknown_not_zero(
    host: Host, library: Path
) -> None:
    uuid = host.add_device(16384)
    me, child = os.getpid(), sleeper()
    try:
        host.use(me, 1200)
        host.use(child.pid, None)  # usedGpuMemory: NVML_VALUE_NOT_AVAILABLE
        # The ABI as pynvml relies on it: with count 0 and no array, INSUFFICIENT_SIZE and the count.
        lib = ctypes.CDLL(str(library))
        count, handle = ctypes.c_uint(0), ctypes.c_void_p()
        assert lib.nvmlInit_v2() == 0
        assert lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(handle)) == 0
        assert lib.nvmlDeviceGetComputeRunningProcesses_v3(handle, ctypes.byref(count), None) == 7
        assert count.value == 2
        assert lib.nvmlShutdown() == 0
        backend = NvmlBackend()
        try:
            procs = sorted(backend.processes(), key=lambda p: p.pid)
            assert procs == sorted(
                [ProcessUsage(me, uuid, 1200), ProcessUsage(child.pid, uuid, None)], key=lambda p: p.pid
            )
            # The device still counts what NVML cannot attribute.
            assert backend.devices()[0].used_mb == 1200
        finally:
            backend.close()
    finally:
        child.kill()
        child.wait()


def test_a_dead_process_stays_listed_until_its_memory_is_freed(host: Host) -> None:
    uuid = host.add_device(16384)
    child = sleeper()
    host.use(child.pid, 900)
    child.kill()
    child.wait()
    host.free(child.pid, after_s=scaled(5))
    backend = NvmlBackend()
    try:
        assert not Path(f"/proc/{child.pid}").exists()
        assert backend.processes() == [ProcessUsage(child.pid, uuid, 900)]  # dead, not yet freed
        assert backend.devices()[0].used_mb == 900
        deadline = time.monotonic() + scaled(20)
        while backend.processes() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert backend.processes() == [] and backend.devices()[0].used_mb == 0
    finally:
        backend.close()


def test_pids_are_translated_into_the_callers_namespace_and_unseen_processes_are_hidden(
    host: Host, library: Path
) -> None:
    # A process in a PID namespace of its own (as a jail's are) is listed to the host by its host
    # PID; a caller inside that namespace sees it by its PID there and not the host's processes.
    uuid = host.add_device(16384)
    inner = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", INNER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "LD_LIBRARY_PATH": str(library.parent), "PYTHONPATH": str(REPO)},
        text=True,
    )
    try:
        assert inner.stdout is not None and inner.stdin is not None
        ns = int(inner.stdout.readline())
        host_pid = next(
            int(p)
            for p in os.listdir("/proc")
            if p.isdigit() and _ns_of(int(p)) == ns and nvml_standin.ns_pid(int(p))[1] == 1
        )
        host.use(host_pid, 500)
        host.use(os.getpid(), 300)
        backend = NvmlBackend()
        try:
            assert sorted(p.pid for p in backend.processes()) == sorted([host_pid, os.getpid()])
        finally:
            backend.close()
        inner.stdin.write("go\n")
        inner.stdin.flush()
        seen = json.loads(inner.stdout.readline())
        assert seen == {"processes": [[1, uuid, 500]], "used_mb": 800}
    finally:
        inner.kill()
        inner.wait()


INNER = """
import json, os, sys
print(os.stat('/proc/self/ns/pid').st_ino, flush=True)
sys.stdin.readline()
from appliance.gpu.nvml import NvmlBackend
b = NvmlBackend()
print(json.dumps({'processes': [[p.pid, p.uuid, p.used_mb] for p in b.processes()],
                  'used_mb': b.devices()[0].used_mb}), flush=True)
"""


def _ns_of(pid: int) -> int:
    try:
        return nvml_standin.pid_namespace(pid)
    except OSError:
        return 0


def test_driver_errors_become_backend_errors_with_nvmls_own_words(host: Host) -> None:
    host.add_device(16384)
    host.init_error = 9  # NVML_ERROR_DRIVER_NOT_LOADED
    host.write()
    with pytest.raises(GpuBackendError, match="kernel driver is not loaded"):
        NvmlBackend()
    host.init_error = 0
    host.write()
    backend = NvmlBackend()
    try:
        host.fault = 15  # NVML_ERROR_GPU_IS_LOST, mid-run
        host.write()
        with pytest.raises(GpuBackendError, match="GPU is lost"):
            backend.devices()
        with pytest.raises(GpuBackendError, match="GPU is lost"):
            backend.processes()
    finally:
        backend.close()
