"""The GPU watchdog on real process trees, with per-PID usage from the simulated backend."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from appliance.core.errors import GpuMemoryLimit, MemoryLimit, RunLimit
from appliance.core.tasks import TaskScope
from appliance.gpu.ledger import GpuLedger
from appliance.gpu.simulated import SimulatedBackend
from appliance.gpu.watchdog import GpuWatchdog, descendants
from tests.support import until, until_async


@pytest.fixture
def trees() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Two real process trees (a shell with a grandchild), standing in for two runs' jails."""
    procs = [subprocess.Popen(["sh", "-c", "sleep 60 & wait"], start_new_session=True) for _ in range(2)]
    until(lambda: all(descendants(p.pid) - {p.pid} for p in procs), 10, "each shell's sleep started")
    yield procs
    for p in procs:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def grandchild(root: int) -> int:
    kids = descendants(root) - {root}
    assert kids, "the shell's child should be visible through /proc/<pid>/task/*/children"
    return max(kids)


def make(backend: SimulatedBackend, host_memory_mb: int | None = None) -> tuple[GpuWatchdog, GpuLedger]:
    ledger = GpuLedger(backend.devices(), margin_mb=100, max_wait_ms=1000)
    return GpuWatchdog(backend, ledger, margin_mb=100, host_memory_mb=host_memory_mb, interval_s=0.05), ledger


async def watch_both(
    trees: list[subprocess.Popen[bytes]],
) -> tuple[SimulatedBackend, GpuWatchdog, GpuLedger, dict[str, RunLimit]]:
    """Runs "a" and "b" (1000 MiB each) watched on the two trees; `stopped` collects their stops."""
    backend = SimulatedBackend((16384,))
    watchdog, ledger = make(backend)
    a, b = await ledger.acquire(1000), await ledger.acquire(1000)
    stopped: dict[str, RunLimit] = {}

    def keep_first(key: str) -> Callable[[RunLimit], None]:
        def stop(error: RunLimit) -> None:
            stopped.setdefault(key, error)

        return stop

    watchdog.watch("a", trees[0].pid, a, keep_first("a"))
    watchdog.watch("b", trees[1].pid, b, keep_first("b"))
    return backend, watchdog, ledger, stopped


def test_descendants_follow_every_thread_s_children() -> None:
    proc = subprocess.Popen(["sh", "-c", "sh -c 'sleep 30 & wait' & wait"], start_new_session=True)
    try:

        def cmdlines() -> set[bytes]:
            found = set()
            for pid in descendants(proc.pid):
                with contextlib.suppress(OSError):  # a process between fork and exec, or gone
                    found.add(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0])
            return found

        # sh, sh, sleep: the innermost starts a moment after the outer shell.
        until(lambda: b"sleep" in cmdlines(), 10, "the grandchild sleep among the descendants")
        found = descendants(proc.pid)
        assert proc.pid in found and len(found) >= 3
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


async def test_an_over_budget_run_is_stopped_while_its_neighbour_keeps_running(
    trees: list[subprocess.Popen[bytes]],
) -> None:
    backend, watchdog, _ledger, stopped = await watch_both(trees)
    backend.set_usage(grandchild(trees[0].pid), 0, 1101)  # budget 1000 + margin 100 exceeded
    backend.set_usage(grandchild(trees[1].pid), 0, 1100)  # exactly at the limit: allowed
    result = await watchdog.check()
    assert result is not None and result.gpu_mb == {"a": 1101, "b": 1100}
    assert set(stopped) == {"a"} and isinstance(stopped["a"], GpuMemoryLimit)
    assert stopped["a"].status == "gpu_memory_limit" and "1101 MiB" in stopped["a"].message
    await watchdog.check()
    assert set(stopped) == {"a"}, "a run is stopped once; the neighbour is never touched"


async def test_a_backend_fault_mid_run_stops_watched_runs_after_the_grace_and_recovers() -> None:
    backend = SimulatedBackend((16384,))
    watchdog, ledger = make(backend)
    stopped: list[RunLimit] = []
    watchdog.watch("a", 1, await ledger.acquire(10), stopped.append)
    backend.inject_fault("GPU is lost")
    for _ in range(watchdog.fault_grace - 1):
        assert await watchdog.check() is None
    assert not stopped and not watchdog.healthy and "GPU is lost" in (watchdog.last_error or "")
    await watchdog.check()
    assert (
        len(stopped) == 1
        and stopped[0].status == "internal"
        and "could not be measured" in stopped[0].message
    )
    backend.inject_fault(None)
    assert await watchdog.check() is not None
    assert watchdog.healthy and watchdog.last_error is None


async def test_each_poll_reconciles_the_ledger(trees: list[subprocess.Popen[bytes]]) -> None:
    backend = SimulatedBackend((16384,))
    watchdog, ledger = make(backend)
    grant = await ledger.acquire(4000)
    watchdog.watch("a", trees[0].pid, grant, lambda e: None)
    backend.set_usage(grandchild(trees[0].pid), 0, 3000)  # ours: covered by the grant
    backend.set_usage(999_999, 0, 2000)  # someone else's
    await watchdog.check()
    assert ledger.snapshot()[0]["foreign_mb"] == 2000


async def test_the_run_owning_a_process_is_the_one_stopped(trees: list[subprocess.Popen[bytes]]) -> None:
    _backend, watchdog, _ledger, stopped = await watch_both(trees)
    error = GpuMemoryLimit("opened a CUDA client in another run's window")
    assert watchdog.stop_owner(grandchild(trees[1].pid), error) is True
    assert stopped == {"b": error}
    assert watchdog.stop_owner(os.getpid(), error) is False, "a process of no run stops nothing"
    assert watchdog.stop_owner(grandchild(trees[1].pid), error) is False, "a stopped run is not stopped twice"


async def test_a_plain_exception_from_the_backend_fails_closed_at_once_and_the_loop_survives() -> None:
    # pynvml raises exceptions outside NVMLError (NVMLLibraryMismatchError is a plain Exception).
    backend = SimulatedBackend((16384,))
    watchdog, ledger = make(backend)
    stopped: list[RunLimit] = []
    watchdog.watch("a", 1, await ledger.acquire(10), stopped.append)
    backend.inject_fault("NVML library mismatch", plain=True)
    tasks = await TaskScope("test").open()
    watchdog.start(tasks)
    try:
        await until_async(lambda: stopped, 10, "the run stopped", poll=0.01)
        assert len(stopped) == 1 and stopped[0].status == "internal"
        assert "NVML library mismatch" in stopped[0].message and "could not be measured" in stopped[0].message
        assert not watchdog.healthy and watchdog.paused and "Exception" in (watchdog.last_error or "")
        polls = backend.calls
        await until_async(lambda: backend.calls > polls, 10, "the polling loop alive after the exception")
        backend.inject_fault(None)
        await until_async(lambda: watchdog.healthy, 10, "the watchdog healthy again", poll=0.01)
        assert watchdog.healthy and not watchdog.paused
    finally:
        await watchdog.close()
        await tasks.close()


async def test_gpu_memory_nvml_reports_under_a_thread_id_is_the_run_s_and_is_enforced(tmp_path: Path) -> None:
    # The allocating context was created by a worker thread: NVML names that thread, not the process.
    control = tmp_path / "sim.json"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import threading, time\n"
            "threading.Thread(target=time.sleep, args=(60,)).start()\nprint('up', flush=True)\n"
            "time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
        control.write_text(
            json.dumps({"report_tids": True, "processes": [{"pid": proc.pid, "gpu": 0, "used_mb": 1101}]})
        )
        backend = SimulatedBackend((16384,), control_file=control)
        reported = backend.processes()[0].pid
        assert reported != proc.pid and reported in {int(t) for t in os.listdir(f"/proc/{proc.pid}/task")}
        watchdog, ledger = make(backend)
        stopped: list[RunLimit] = []
        watchdog.watch("a", proc.pid, await ledger.acquire(1000), stopped.append)
        result = await watchdog.check()
        assert result is not None and result.gpu_mb == {"a": 1101}
        assert len(stopped) == 1 and isinstance(stopped[0], GpuMemoryLimit)
        assert ledger.snapshot()[0]["foreign_mb"] == 0, "the thread's memory is the run's, not foreign"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


MAP_AND_HOLD = """\
import mmap, sys, time
kind, mb = sys.argv[1], int(sys.argv[2])
if kind == "file":   # a model file, mmapped and read through (what llama.cpp does with a GGUF)
    f = open(sys.argv[3], "rb")
    m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    total = sum(m[i] for i in range(0, len(m), 4096))
else:                # memory the run owns
    held = bytearray(b"\\x01") * (mb << 20)
print("up", flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize(("kind", "stopped_expected"), [("file", False), ("anon", True)])
async def test_host_memory_counts_what_the_run_owns_not_the_files_it_maps(
    tmp_path: Path, kind: str, stopped_expected: bool
) -> None:
    model = tmp_path / "model.bin"
    with open(model, "wb") as fh:
        fh.truncate(300 << 20)
        fh.seek(0)
        fh.write(b"\x07" * (300 << 20))  # real pages, so that reading them makes them resident
    proc = subprocess.Popen(
        [sys.executable, "-c", MAP_AND_HOLD, kind, "300", str(model)],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
        watchdog, ledger = make(SimulatedBackend((16384,)), host_memory_mb=200)
        stopped: list[RunLimit] = []
        watchdog.watch("a", proc.pid, await ledger.acquire(10), stopped.append)
        result = await watchdog.check()
        assert result is not None
        if stopped_expected:
            assert len(stopped) == 1 and isinstance(stopped[0], MemoryLimit) and result.host_mb["a"] >= 300
        else:
            statm_mb = (
                int(Path(f"/proc/{proc.pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20
            )
            assert statm_mb >= 300, "the mapped file is resident (what the old statm reading counted)"
            assert not stopped and result.host_mb["a"] < 200
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
