"""Enforcement layer (b): a daemon-side CUDA MPS memory limit for each run.

The MPS daemon fixes a client's pinned device memory limit when the client connects, from
the limit its server holds at that moment; later changes affect only later clients. Every
jail runs as the same uid and so talks to the same MPS server. Per-run limits are therefore
made by arming, one run at a time per device:

  1. note the server's clients;
  2. set the server's limit to the run's budget;
  3. have the jail's driver create its CUDA context (its MPS client) before any code runs;
  4. set the limit back to the resting value (SANDBOX_GPU_MARGIN_MB), so that any client
     connecting later (a child process, a reset context) gets only that;
  5. check the clients that appeared: the run's own must be among them, or the run is
     refused; any other (a neighbour's process that connected inside the window and got
     this budget) is terminated and its run stopped.

Before any probe, what stands in a jailed client's way is checked (`jail_blockers`, pure):
the real daemon keeps its clients' shared memory in /dev/shm, which a GPU jail does not see
(firejail `--private-dev` mounts an empty one; `--keep-dev-shm` would hand every run the
host's writable /dev/shm, so the appliance does not use it); the GPU must be in
EXCLUSIVE_PROCESS compute mode, or a client that avoids MPS gets a context with no limit;
and the daemon's PIDs must be this server's (a daemon in another container reports PIDs of
its own namespace, which never match a run's). Any of these makes the layer "not enforcing"
on that device, with the exact reasons in /readyz and `appliance_gpu_mps_blocked` in
/metrics; the watchdog alone then guards GPU memory. With the real daemon the first always
holds today, so layer (b) reads "not enforcing" on real GPUs.

Nothing else is assumed: at startup each device is probed with a real jail (arm a small budget,
allocate under and over it, try to raise the limit from inside, read it back) and the layer
reports `enforcing` only where the probe proved it. SANDBOX_GPU_MPS=require refuses to start
otherwise. A control command failing mid-run refuses the run (`internal`), never runs it
with a limit left unknown.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from appliance.core.domain import File, Request
from appliance.core.errors import ApplianceError, GpuLimitUnavailable, JailExited
from appliance.core.events import CellError, Event, Output
from appliance.gpu.backend import GpuBackendError
from appliance.gpu.ledger import Grant
from appliance.gpu.mps import MpsControl
from appliance.sandbox import channel, proctree
from appliance.sandbox.cell import run_cell

if TYPE_CHECKING:
    from appliance.sandbox.jail import Jail, JailFactory

log = logging.getLogger("appliance.gpu")

CONTEXT_TIMEOUT_S = 30.0
PROBE_BUDGET_MB = 256
PROBE_SMALL_MB = 64  # must fit under the probe budget
PROBE_BIG_MB = 1024  # must not
CUDA_SUCCESS, CUDA_ERROR_OUT_OF_MEMORY = 0, 2

# Runs in the probe jail. Parameters arrive in a file, never spliced into the source.
PROBE_CODE = """\
import ctypes, json, os, shutil, subprocess
p = json.load(open("mps-probe.json"))
cu = ctypes.CDLL(os.environ["APPLIANCE_LIBCUDA"])
ctx, ptr = ctypes.c_void_p(), ctypes.c_uint64()
cu.cuInit(0)
cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0)
cu.cuCtxSetCurrent(ctx)
small = cu.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(p["small_mb"] << 20))
big = cu.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(p["big_mb"] << 20))
tamper = "no control binary in the jail"
tool = shutil.which("nvidia-cuda-mps-control")
if tool:
    line = "set_device_pinned_mem_limit %d %s %dM\\n" % (p["server"], p["uuid"], p["big_mb"] * 4)
    done = subprocess.run([tool], input=line, capture_output=True, text=True, timeout=10)
    tamper = (done.stdout + done.stderr).strip()[:200] or "accepted"
print(json.dumps({"small": small, "big": big, "tamper": tamper}))
"""


@dataclass
class DeviceMps:
    """Layer (b) on one device: proven or not, and why."""

    enforcing: bool = False
    note: str = "not probed yet"
    broken: str | None = None  # a control command failed; runs are refused until it works again
    blocked: tuple[str, ...] = ()  # jail_blockers' codes: why a jailed client cannot be limited


# What stands in a jailed MPS client's way: code -> reason (the codes label /metrics).
BLOCK_DEV_SHM = (
    "dev_shm",
    "MPS clients need the daemon's shared memory in /dev/shm, and a GPU jail's "
    "/dev/shm is private and empty (firejail --private-dev); --keep-dev-shm would give every "
    "run the host's writable /dev/shm, so the appliance does not use it",
)
BLOCK_COMPUTE_MODE = (
    "compute_mode",
    "the GPU is not in EXCLUSIVE_PROCESS compute mode, so a client that "
    "avoids MPS would get a context with no limit (nvidia-smi -i <index> -c EXCLUSIVE_PROCESS)",
)
BLOCK_PID_NAMESPACE = "pid_namespace"


def jail_blockers(needs_dev_shm: bool, exclusive: bool, pid_problem: str | None) -> list[tuple[str, str]]:
    """Why a GPU jail's CUDA client cannot be held to a daemon-side limit, as (code, reason) (pure).

    Empty when nothing known stands in the way (the startup probe must still prove it).
    """
    found = []
    if needs_dev_shm:
        found.append(BLOCK_DEV_SHM)
    if not exclusive:
        found.append(BLOCK_COMPUTE_MODE)
    if pid_problem:
        found.append((BLOCK_PID_NAMESPACE, pid_problem))
    return found


class MpsLimiter:
    """Arms each GPU run's MPS client with its budget; one instance per server."""

    def __init__(
        self, control: MpsControl, uid: int, resting_mb: int, libcuda: str, on_intruder: Callable[[int], None]
    ) -> None:
        self.control = control
        self.uid = uid
        self.resting_mb = max(1, resting_mb)
        self.libcuda = libcuda
        self.on_intruder = on_intruder  # a host PID that connected in another run's window
        self.devices: dict[str, DeviceMps] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self.armed = 0
        self.intruders = 0

    # -- readiness ---------------------------------------------------------------------------
    @property
    def enforcing(self) -> bool:
        return bool(self.devices) and all(d.enforcing and not d.broken for d in self.devices.values())

    def problems(self) -> list[str]:
        """Devices whose limits are unknown now (a control command failed): /readyz is 503."""
        return [
            f"MPS limits on {uuid} are unknown: {d.broken}" for uuid, d in self.devices.items() if d.broken
        ]

    def layer(self) -> dict[str, Any]:
        """Layer (b) for /readyz: whether it enforces, why (per device), and what it did."""
        unproven = [
            f"{uuid}: {d.broken or d.note}" for uuid, d in self.devices.items() if d.broken or not d.enforcing
        ]
        note = "; ".join(unproven) if unproven else "proved on every device by the startup probe"
        return {
            "available": True,
            "enforcing": self.enforcing,
            "note": note,
            "daemon": self.control.name,
            "pipe_dir": str(self.control.pipe_dir),
            "resting_mb": self.resting_mb,
            "armed": self.armed,
            "intruders": self.intruders,
            "devices": {
                uuid: {
                    "enforcing": d.enforcing and not d.broken,
                    "note": d.broken or d.note,
                    "blocked": list(d.blocked),
                }
                for uuid, d in self.devices.items()
            },
        }

    # -- per run -----------------------------------------------------------------------------
    async def arm(self, jail: Jail, grant: Grant) -> None:
        """Give the jail's CUDA client the grant's budget as its daemon-side limit (see module doc).

        No-op on a device where the probe did not prove enforcement (the watchdog still runs).
        Raises GpuLimitUnavailable when the limit could not be set: the run must not start.
        """
        device = self.devices.get(grant.uuid)
        if device is None or not device.enforcing:
            return
        async with self._lock(grant.uuid):
            if device.broken:
                await self._recover(grant.uuid, device)
            try:
                server, new = await self._window(jail, grant)
            except GpuBackendError as exc:
                device.broken = str(exc)
                log.error("MPS limit could not be set", extra={"device": grant.uuid, "error": str(exc)})
                raise GpuLimitUnavailable(
                    "the run's GPU memory limit could not be set on the MPS daemon; nothing ran"
                ) from exc
        ours = set(proctree.tree(jail.process.pid))
        for pid in sorted(new - ours):
            await self._evict(server, pid)
        if not new & ours:
            raise GpuLimitUnavailable(
                "the run's CUDA client did not appear on the MPS server while its limit was set "
                "(it existed before, or did not use MPS); nothing ran"
            )
        self.armed += 1

    async def _window(self, jail: Jail, grant: Grant) -> tuple[int, set[int]]:
        """Steps 1-4, the limit held at the budget for as short as possible.
        Returns the server and the PIDs of the clients that connected meanwhile."""
        server = await asyncio.to_thread(self.control.server_for, self.uid)
        before = await asyncio.to_thread(self.control.clients, server)
        await asyncio.to_thread(self.control.set_limit, server, grant.uuid, grant.memory_mb)
        try:
            await open_cuda_context(jail, self.libcuda)
        finally:
            await asyncio.to_thread(self.control.set_limit, server, grant.uuid, self.resting_mb)
        after = await asyncio.to_thread(self.control.clients, server)
        return server, after - before

    async def _evict(self, server: int, pid: int) -> None:
        self.intruders += 1
        log.warning("a CUDA client connected inside another run's MPS window; terminated", extra={"pid": pid})
        with contextlib.suppress(GpuBackendError):
            await asyncio.to_thread(self.control.terminate_client, server, pid)
        self.on_intruder(pid)

    async def _recover(self, uuid: str, device: DeviceMps) -> None:
        try:
            await self.set_resting(uuid)
        except GpuBackendError as exc:
            device.broken = str(exc)
            raise GpuLimitUnavailable(
                f"GPU runs on {uuid} are paused: the MPS daemon does not answer ({exc})"
            ) from exc
        device.broken = None

    async def set_resting(self, uuid: str) -> int:
        """Resting limits on the daemon (for servers started later) and on our server."""
        await asyncio.to_thread(self.control.set_default_limit, uuid, self.resting_mb)
        server = await asyncio.to_thread(self.control.server_for, self.uid)
        await asyncio.to_thread(self.control.set_limit, server, uuid, self.resting_mb)
        return server

    def _lock(self, uuid: str) -> asyncio.Lock:
        return self._locks.setdefault(uuid, asyncio.Lock())

    # -- startup: what stands in the way, then the probe -------------------------------------
    def check_blockers(self, uuid: str, exclusive: bool) -> DeviceMps | None:
        """Record the device as not enforcing when `jail_blockers` finds anything; None when nothing
        stands in the way. Called before the device's jails are made: a blocked device's jails
        do not join MPS (no pipe directory), since a jailed client could not connect anyway."""
        blockers = jail_blockers(
            self.control.needs_dev_shm(), exclusive, self.control.pid_namespace_problem()
        )
        if not blockers:
            return None
        device = self.devices[uuid] = DeviceMps(
            enforcing=False,
            note="not enforcing: " + "; ".join(reason for _, reason in blockers),
            blocked=tuple(code for code, _ in blockers),
        )
        return device

    async def probe(self, uuid: str, factory: JailFactory, exclusive: bool, total_mb: int) -> DeviceMps:
        """Prove, with a real jail on this device, that a run cannot pass its MPS limit.

        Where it is not proven, the limits the probe left are lifted to the device's size:
        runs then join MPS unarmed, under the watchdog alone, and must not inherit the
        resting limit as their whole budget.
        """
        device = await self._probe(uuid, factory, exclusive)
        if not device.enforcing:
            with contextlib.suppress(GpuBackendError):
                await asyncio.to_thread(self.control.set_default_limit, uuid, total_mb)
                server = await asyncio.to_thread(self.control.server_for, self.uid)
                await asyncio.to_thread(self.control.set_limit, server, uuid, total_mb)
        return device

    async def _probe(self, uuid: str, factory: JailFactory, exclusive: bool) -> DeviceMps:
        known = self.devices.get(uuid)
        if known is not None and known.blocked:
            return known
        blocked = await asyncio.to_thread(self.check_blockers, uuid, exclusive)
        if blocked is not None:
            return blocked
        device = self.devices[uuid] = DeviceMps(enforcing=False, note="probing")
        try:
            server = await self.set_resting(uuid)
            jail = await factory.launch()
        except (GpuBackendError, ApplianceError) as exc:
            device.note = f"probe could not start: {exc}"
            return device
        try:
            device.enforcing = True  # so that arm() arms the probe jail
            await self.arm(
                jail, Grant(ticket=0, index=0, uuid=uuid, minor=0, memory_mb=PROBE_BUDGET_MB, queued_ms=0)
            )
            result = await _run_probe(
                jail, {"small_mb": PROBE_SMALL_MB, "big_mb": PROBE_BIG_MB, "server": server, "uuid": uuid}
            )
            after = await asyncio.to_thread(self.control.limit, server, uuid)
        except (GpuBackendError, ApplianceError, ValueError) as exc:
            device.enforcing, device.note = False, f"probe failed: {exc}"
            return device
        finally:
            await jail.destroy()
        device.enforcing, device.note = judge_probe(result, after, self.resting_mb)
        return device


def judge_probe(result: dict[str, Any], limit_after: int | None, resting_mb: int) -> tuple[bool, str]:
    """Whether the probe proved the limit (pure). Returns (enforcing, note)."""
    if result.get("small") != CUDA_SUCCESS:
        return False, (
            f"an allocation of {PROBE_SMALL_MB} MiB under a {PROBE_BUDGET_MB} MiB limit failed "
            f"(CUDA error {result.get('small')}): a preloaded module may create the CUDA context "
            "before the limit is set"
        )
    if result.get("big") != CUDA_ERROR_OUT_OF_MEMORY:
        return False, (
            f"an allocation of {PROBE_BIG_MB} MiB over a {PROBE_BUDGET_MB} MiB limit was not refused "
            f"(CUDA result {result.get('big')}): the daemon does not enforce the limit"
        )
    if limit_after != resting_mb:
        return False, (
            f"the server's limit was {limit_after} MiB after the probe, not the resting "
            f"{resting_mb} MiB: jailed code could change it ({result.get('tamper')})"
        )
    return True, (
        f"proved: {PROBE_SMALL_MB} MiB allowed and {PROBE_BIG_MB} MiB refused under a "
        f"{PROBE_BUDGET_MB} MiB limit; the limit could not be raised from the jail"
    )


async def open_cuda_context(jail: Jail, libcuda: str) -> None:
    """Have the jail's driver create its CUDA context now; GpuLimitUnavailable if it cannot."""
    jail.process.write(channel.cuda_context_op(libcuda))
    try:
        event = await jail.process.wait_event("cuda_context", CONTEXT_TIMEOUT_S)
    except JailExited:
        raise GpuLimitUnavailable("the jail exited while creating its CUDA context") from None
    except TimeoutError:
        raise GpuLimitUnavailable("the jail did not create its CUDA context in time") from None
    if event["ev"] != "cuda_context" or not event.get("ok"):
        raise GpuLimitUnavailable(f"the jail could not create its CUDA context: {event.get('error')}")


class _ProbeOutput:
    """The probe cell's output, recorded as it comes (its `Emit`): its stdout, and the first
    error it raised. Nothing of it leaves the server."""

    def __init__(self) -> None:
        self.stdout: list[str] = []
        self.error: str | None = None

    async def __call__(self, event: Event) -> None:
        if isinstance(event, Output) and event.name == "stdout":
            self.stdout.append(event.text)
        elif isinstance(event, CellError) and self.error is None:
            self.error = f"{event.ename}: {event.evalue}"


async def _run_probe(jail: Jail, params: dict[str, Any]) -> dict[str, Any]:
    output = _ProbeOutput()
    req = Request(
        id="mps-probe", code=PROBE_CODE, files=(File("mps-probe.json", json.dumps(params).encode()),)
    )
    outcome = await run_cell(
        jail,
        req,
        output,
        timeout_ms=30000,
        max_output_bytes=65536,
        max_disk_mb=16,
        keep_alive=False,
    )
    if outcome.status != "ok":
        detail = output.error or outcome.message
        raise ValueError(f"the probe run ended {outcome.status} ({detail})")
    lines = "".join(output.stdout).strip().splitlines()
    result = json.loads(lines[-1]) if lines else None
    if not isinstance(result, dict):
        raise ValueError("the probe printed no result")
    return result
