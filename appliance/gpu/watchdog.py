"""The GPU watchdog: polls per-PID GPU memory, maps host PIDs to runs, stops over-budget runs.

A jail's processes are not the server's children (firejail forks them), so a run is
known by its root: the firejail PID. Its processes are that PID and every descendant,
found through `/proc/<pid>/task/<tid>/children`. Each poll (in a thread) reads the
backend once, sums each run's usage, and reports:

- runs whose GPU memory exceeds their grant + margin (-> `gpu_memory_limit`);
- runs whose owned host memory (anonymous + shmem, `appliance.sandbox.memory`; not mmapped
  model files or CUDA libraries) exceeds SANDBOX_MEMORY_MB (GPU jails have no RLIMIT_AS,
  so this is their host memory cap -> `memory_limit`);
- runs whose GPU memory NVML cannot tell (usedGpuMemory unavailable for one of their
  processes): with `strict` (SANDBOX_GPU_ENFORCE=strict) each is stopped (`internal`) and
  GPU runs are refused from then on (the host cannot report what the budget needs); with
  best-effort the gap is only recorded (`unavailable`, shown in /readyz and /metrics);
- a backend fault: after `fault_grace` consecutive failures every watched run is
  stopped (`internal`), since its budget can no longer be enforced (fail closed).
  Any other exception in a poll (a plain `Exception` from pynvml, a bug here) fails
  closed at once, without the grace: it is no transient driver hiccup. Either way GPU
  admissions pause and /readyz is 503 until a poll succeeds again; the loop itself
  never dies (a watchdog task that ended anyway reads as unhealthy).

The same poll reconciles the ledger, so queued runs see freed memory promptly.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from appliance.core.errors import GpuMemoryLimit, MemoryLimit, RunLimit
from appliance.core.tasks import TaskScope, cancel_and_wait, checkpoint
from appliance.gpu.backend import Device, GpuBackend, GpuBackendError, ProcessUsage
from appliance.gpu.hostcheck import unavailable_text
from appliance.gpu.ledger import GpuLedger, Grant
from appliance.sandbox import proctree
from appliance.sandbox.memory import ProcMemory, RunMemory

log = logging.getLogger("appliance.gpu")


class GpuMonitorFailed(RunLimit):
    """GPU memory could not be measured, so the budget could not be enforced."""

    status = "internal"


def descendants(root: int) -> set[int]:
    """root and every process below it."""
    return set(proctree.tree(root))


def run_ids(root: int) -> set[int]:
    """Every process and thread ID of the run rooted at root: what NVML's IDs are matched against."""
    return proctree.task_ids(descendants(root))


@dataclass
class WatchedRun:
    key: str
    root_pid: int
    grant: Grant
    stop: Callable[[RunLimit], None]  # called once, on the event loop, to end the run
    peak_mb: int = 0
    stopped: bool = False
    ids: set[int] = field(default_factory=set)  # every process/thread ID seen: what a reclaim waits on


@dataclass
class PollResult:
    devices: list[Device]
    processes: list[ProcessUsage]
    taken_at: float = 0.0  # monotonic time the reading began
    pids: dict[str, set[int]] = field(default_factory=dict)  # run key -> its host PIDs and TIDs
    gpu_mb: dict[str, int] = field(default_factory=dict)  # run key -> GPU MiB in use
    host_mb: dict[str, int] = field(default_factory=dict)  # run key -> resident MiB
    unknown: dict[str, list[int]] = field(
        default_factory=dict
    )  # run key -> its IDs NVML lists without memory


class GpuWatchdog:
    """Polls the backend every `interval_s`; one instance per server."""

    def __init__(  # noqa: PLR0913 (its collaborators and clock injected, so tests pass fakes)
        self,
        backend: GpuBackend,
        ledger: GpuLedger,
        *,
        margin_mb: int,
        host_memory_mb: int | None,
        interval_s: float,
        fault_grace: int = 3,
        memory: RunMemory | None = None,
        strict: bool = True,
    ) -> None:
        self.backend = backend
        self.ledger = ledger
        self.margin_mb = margin_mb
        self.host_memory_mb = host_memory_mb
        self.interval_s = interval_s
        self.fault_grace = fault_grace
        self.memory = memory if memory is not None else ProcMemory()  # a cgroup reading fits here too
        self.strict = strict
        # Set once a run's process is listed without its memory: a fact about this host's NVML.
        self.unavailable: str | None = None
        self.runs: dict[str, WatchedRun] = {}
        self.faults = 0
        self.last_error: str | None = None
        self.polls = 0
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    @property
    def healthy(self) -> bool:
        """False while the backend fails or the polling task is gone: budgets are not being enforced."""
        return self.faults == 0 and not self._dead()

    @property
    def paused(self) -> bool:
        """Whether GPU admissions must be refused now (fail closed)."""
        return self.faults >= self.fault_grace or self._dead()

    def _dead(self) -> bool:
        task = self._task
        if task is None or not task.done() or self._closing:
            return False
        if self.last_error is None:
            self.last_error = "the GPU watchdog task ended"
        return True

    def watch(self, key: str, root_pid: int, grant: Grant, stop: Callable[[RunLimit], None]) -> None:
        self.runs[key] = WatchedRun(key, root_pid, grant, stop)

    def unwatch(self, key: str) -> WatchedRun | None:
        return self.runs.pop(key, None)

    def stop_owner(self, pid: int, error: RunLimit) -> bool:
        """Stop the watched run whose processes include host PID `pid`; False if none does."""
        for run in list(self.runs.values()):
            if not run.stopped and pid in run_ids(run.root_pid):
                self._stop(run, error)
                return True
        return False

    def start(self, owner: TaskScope) -> None:
        if self._task is None:
            self._task = owner.spawn(self._loop(), name="gpu-watchdog")

    async def close(self) -> None:
        self._closing = True
        if self._task is not None:
            await cancel_and_wait(self._task)

    async def _loop(self) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.check()
            except Exception as exc:  # noqa: BLE001 (a bug in the fault path itself: still fail closed)
                self._on_fault(f"{type(exc).__name__}: {exc}", unexpected=True)
            checkpoint()
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))

    async def check(self) -> PollResult | None:
        """One poll: measure, reconcile, stop what broke its budget. Returns the measurement.

        Never raises (but for cancellation): a failure is a fault (see the module doc)."""
        try:
            return await self._check()
        except GpuBackendError as exc:
            self._on_fault(str(exc))
        except Exception as exc:  # noqa: BLE001 (pynvml raises plain Exceptions too: fail closed)
            self._on_fault(f"{type(exc).__name__}: {exc}", unexpected=True)
        return None

    async def _check(self) -> PollResult:  # noqa: C901, PLR0912 (one poll's findings in order: unmeasurable, over budget, gone)
        roots = {key: run.root_pid for key, run in self.runs.items()}
        result = await asyncio.to_thread(self.measure, roots)
        if self.faults:
            log.warning("GPU backend recovered", extra={"after_faults": self.faults})
        self.faults = 0
        self.last_error = None
        self.polls += 1
        ours = set().union(*result.pids.values()) if result.pids else set()
        for key, ids in result.pids.items():
            if key in self.runs:
                self.runs[key].ids |= ids
        self.ledger.load(result.devices, result.processes, ours, result.taken_at)
        for key, unknown_ids in result.unknown.items():
            run = self.runs.get(key)
            if run is None or run.stopped:
                continue
            text = unavailable_text(f"the run's process {', '.join(map(str, unknown_ids))}")
            if self.unavailable is None:
                log.error("GPU memory of a run cannot be measured", extra={"run": key, "error": text})
            self.unavailable = text
            if self.strict:  # an unknown reading is never "within budget"
                self._stop(run, GpuMonitorFailed(f"{text}; the run was stopped (SANDBOX_GPU_ENFORCE=strict)"))
        for key, used in result.gpu_mb.items():
            run = self.runs.get(key)
            if run is None or run.stopped:
                continue
            run.peak_mb = max(run.peak_mb, used)
            limit = run.grant.memory_mb + self.margin_mb
            if used > limit:
                self._stop(
                    run,
                    GpuMemoryLimit(
                        f"the run used {used} MiB of GPU memory; its budget is {run.grant.memory_mb} MiB "
                        f"(+{self.margin_mb} MiB margin)"
                    ),
                )
        if self.host_memory_mb is not None:
            for key, used in result.host_mb.items():
                run = self.runs.get(key)
                if run is not None and not run.stopped and used > self.host_memory_mb:
                    self._stop(
                        run,
                        MemoryLimit(
                            f"the run used {used} MiB of host memory (anonymous and shared memory; "
                            f"SANDBOX_MEMORY_MB={self.host_memory_mb})"
                        ),
                    )
        return result

    def measure(self, roots: dict[str, int]) -> PollResult:
        """Backend + /proc in one go (blocking; runs in a thread)."""
        taken_at = time.monotonic()
        devices = self.backend.devices()
        processes = self.backend.processes()
        result = PollResult(devices, processes, taken_at)
        by_pid: dict[int, int] = {}
        unknown: set[int] = set()
        for proc in processes:
            if proc.used_mb is None:
                unknown.add(proc.pid)
            else:
                by_pid[proc.pid] = by_pid.get(proc.pid, 0) + proc.used_mb
        for key, root in roots.items():
            pids = descendants(root)
            ids = proctree.task_ids(pids)  # NVML may name a thread (the context's creator), not its process
            result.pids[key] = ids
            result.gpu_mb[key] = sum(by_pid.get(i, 0) for i in ids)
            if ids & unknown:
                result.unknown[key] = sorted(ids & unknown)
            if self.host_memory_mb is not None:
                result.host_mb[key] = self.memory.owned_mb(root, pids)
        return result

    def _on_fault(self, message: str, unexpected: bool = False) -> None:
        """A poll failed. Backend errors get `fault_grace` tries; anything else stops runs at once."""
        self.faults = max(self.faults + 1, self.fault_grace if unexpected else 0)
        self.last_error = message
        log.error(
            "GPU watchdog poll failed",
            extra={"error": message, "consecutive": self.faults, "unexpected": unexpected},
        )
        if self.faults >= self.fault_grace:
            for run in list(self.runs.values()):
                if not run.stopped:
                    self._stop(
                        run,
                        GpuMonitorFailed(
                            f"GPU memory could not be measured (the GPU watchdog failed: {message}), so the "
                            "run's budget could not be enforced; it was stopped"
                        ),
                    )

    def _stop(self, run: WatchedRun, error: RunLimit) -> None:
        run.stopped = True
        log.warning("stopping run", extra={"run": run.key, "reason": error.message})
        run.stop(error)
