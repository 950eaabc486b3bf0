"""What the run service stands on, from startup to shutdown: host checks, run directories,
the jail factories and pools, the readiness canary and the gauges. What a mode adds (GPU mode:
device pools, ledger, watchdog, MPS) is its provisioner's (appliance.sandbox.provisioner),
chosen once here by `provisioner_for`.

Startup refuses (StartupError, naming what to fix) rather than run jails less confined
than configured. `started` is set once jails can be leased; runs that arrive before
wait for it (appliance.core.service).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

from appliance.core.domain import Request
from appliance.core.errors import StartupError
from appliance.core.events import Event, Output
from appliance.core.ports import Snapshots
from appliance.core.service import RunService
from appliance.core.tasks import TaskScope, checkpoint
from appliance.inside.tools.catalogue import catalogue
from appliance.runtime import canary, toolprobe
from appliance.runtime.egresslog import EgressAudit
from appliance.runtime.metrics import Metrics
from appliance.sandbox import cgroups, nslimits, outputs, runfs, sched, uids
from appliance.sandbox.cell import disk_entries, run_cell
from appliance.sandbox.egressintercept import Interception, load_interception
from appliance.sandbox.firejail import lower_own_oom_score
from appliance.sandbox.host import HostFacts, inspect, readable_ancestors_problem
from appliance.sandbox.jail import JailFactory, python_roots
from appliance.sandbox.jailcells import JailCells
from appliance.sandbox.lease import LeaseSource, PoolLeases
from appliance.sandbox.network import EgressNetwork, check_prerequisites
from appliance.sandbox.pool import ProfilePools
from appliance.sandbox.profiles import Profile
from appliance.sandbox.provisioner import PlainProvisioner, Provisioner
from appliance.sandbox.snapshots import JailSnapshots, SnapshotStore
from appliance.sandbox.wheels import check_wheelhouse, stage_wheel_cache
from appliance.sandbox.workdir import RunDirs, open_base, stage_runtime
from appliance.settings import Settings

log = logging.getLogger("appliance.runtime.lifecycle")

CANARY_EVERY_S = 300.0
CANARY_RETRY_S = 5.0
CANARY_TIMEOUT_MS = 15000


def build_service(settings: Settings) -> RunService:
    """The run service on its real parts: this process's metrics, its lifecycle (host checks,
    pools, canary) as lease source, cells in firejail jails. It speaks the core's events; the
    transports (appliance.api) spell them as frames."""
    metrics = Metrics()
    provisioner = provisioner_for(settings, metrics)
    return RunService(
        settings,
        runtime=Lifecycle(settings, metrics, provisioner),
        cells=JailCells(settings),
        metrics=metrics,
        catalogue=catalogue,
        gpu=provisioner,
        snapshots=snapshots_for(settings),
    )


def snapshots_for(settings: Settings) -> Snapshots | None:
    """Session snapshots where SANDBOX_SNAPSHOT_DIR is set (checked at startup), else none."""
    if settings.snapshot_dir is None:
        return None
    store = SnapshotStore(
        settings.snapshot_dir, settings.max_snapshot_mb * 1024 * 1024, settings.max_snapshots
    )
    return JailSnapshots(settings, store)


def provisioner_for(settings: Settings, metrics: Metrics) -> Provisioner:
    """The one place the mode is chosen: SANDBOX_GPU=1 wraps the sandbox's jails with GPU mode;
    otherwise the plain provisioner (and no GPU module, NVML least of all, is ever imported)."""
    if settings.gpu:
        from appliance.gpu.provisioner import GpuProvisioner  # GPU mode only: NVML is never loaded otherwise

        return GpuProvisioner(settings, metrics)
    return PlainProvisioner()


class Lifecycle:
    """Owns every long-lived resource of one appliance process."""

    def __init__(self, settings: Settings, metrics: Metrics, provisioner: Provisioner | None = None) -> None:
        self.settings = settings
        self.metrics = metrics
        self.provisioner: Provisioner = provisioner if provisioner is not None else PlainProvisioner()
        self.host: HostFacts | None = None
        self.dirs: RunDirs | None = None
        self.uids: uids.Uids | None = None  # the uids jails run as (SANDBOX_UID_RANGE)
        self.network: EgressNetwork | None = None
        self.audit: EgressAudit | None = None
        self.interception: Interception | None = None  # names mode: the hosts given secrets
        self.cpu: PoolLeases | None = None
        self._leases: LeaseSource | None = None  # the provisioner's, wrapping the CPU pools
        self.started = asyncio.Event()
        self.ready_problems: list[str] = ["starting"]
        self.canary_port = 0
        self.tools: toolprobe.ToolProbe | None = None  # what llama.cpp / whisper.cpp can do here
        self.cgroups: cgroups.Hierarchy | None = None  # per-run groups, where they can be made
        self.cgroups_missing: list[str] = []  # why not (SANDBOX_CGROUPS=auto falls back)
        self._cgroups_checked = False
        # Owns every background task below the connections: canary, sweeper, pool refills (and
        # their jail starts), teardowns, tool probe, the provisioner's (GPU watchdog).
        self.tasks = TaskScope("lifecycle")
        self._task: asyncio.Task[None] | None = None
        self._sweeper: asyncio.Task[None] | None = None  # SANDBOX_OUTPUTS_RETENTION_S
        self._tidier: asyncio.Task[None] | None = None  # uids kept ready go back to the host
        self._counted: dict[str, Counter[str]] = {
            k: Counter() for k in ("cold", "runs", "imported", "spawned")
        }

    @property
    def leases(self) -> LeaseSource:
        """Where runs take jails: the provisioner's lease source (the CPU pools, or GPU mode's
        device pools wrapping them)."""
        source = self._leases
        if source is None or not self.started.is_set():
            raise RuntimeError("Lifecycle.leases before start()")
        return source

    @property
    def uid(self) -> int:
        return self.host.uid if self.host is not None else self.settings.uid

    # -- startup -----------------------------------------------------------------------------
    def check_host(self) -> HostFacts:  # noqa: C901 (the fail-closed startup checks, one branch per requirement, in order)
        """Fail-closed startup checks; raises StartupError with what to fix."""
        s = self.settings
        if not self._cgroups_checked:  # require: refuse to start, naming what is missing
            self.cgroups, self.cgroups_missing = cgroups.open_hierarchy(s.cgroups)
            self._cgroups_checked = True
            if self.cgroups is None and s.cgroups == "auto":
                log.warning(
                    "cgroups unavailable; memory and processes are limited by rlimits only, CPU not at all",
                    extra={"missing": self.cgroups_missing},
                )
            gap = self.cgroups.socket_gap() if self.cgroups is not None else None
            if gap is not None:
                log.warning(gap)
                self.cgroups_missing = [gap]
        if s.open_ports or s.egress_allow_domains:
            check_prerequisites()  # before inspect: /run/netns must exist when /run is judged
        # Before listening: a malformed secrets file or an unusable CA stops startup.
        self.interception = load_interception(s)
        host = inspect(s.firejail, s.uid, s.python)
        # A jail of SANDBOX_UID_RANGE owns nothing on the host: what it must reach, it reaches as
        # "other" (checked as the range's last uid; SANDBOX_UID's own check follows).
        reach = (
            [host.uid]
            if host.run_as_uid is None or s.uid_range[1] == host.uid
            else [s.uid_range[1], host.uid]
        )

        def unreachable(path: Path) -> str | None:
            return next(filter(None, (readable_ancestors_problem(path, uid) for uid in reach)), None)

        for root in python_roots(s.python):
            problem = unreachable(root)
            if problem:
                raise StartupError(f"SANDBOX_PYTHON's environment is not reachable in the jail: {problem}")
        # The mode's own requirements (GPU mode: no driver, no GPU, or a host where budgets
        # cannot be enforced stops startup here).
        self.provisioner.check_host(self.cgroups)
        problem = unreachable(s.tmp_root)
        if problem:  # firejail, running as the sandbox uid, must reach the run directories
            raise StartupError(f"SANDBOX_TMP_ROOT is not reachable by the sandbox uid: {problem}")
        with open_base(s.tmp_root, os.geteuid()):  # before listening: a squatted root stops startup
            pass
        if s.wheelhouse is not None:
            check_wheelhouse(s.wheelhouse)
            problem = unreachable(s.wheelhouse)
            if problem:  # pip in the jail reads the wheels as the sandbox uid
                raise StartupError(f"SANDBOX_WHEELHOUSE is not reachable by the sandbox uid: {problem}")
        self.host = host
        return host

    async def start(self, canary_port: int) -> None:
        """Directories, runtime, network, pools, the provisioner's start; then the canary loop."""
        s = self.settings
        await self.tasks.open()
        # First, so that the jails started below (and the executor's threads) inherit it.
        refused = sched.request_slice()
        if refused is None:
            log.info("short scheduler slice", extra={"slice_us": sched.SLICE_NS // 1000})
        else:
            log.info("default scheduler slice", extra={"reason": refused})
        host = self.host or self.check_host()
        refused = lower_own_oom_score()  # a global OOM picks a jail (1000), not the server
        if refused is not None:
            log.warning("the server's oom_score_adj stays as it is", extra={"reason": refused})
        self.dirs = RunDirs(
            s.tmp_root, host.uid, host.gid, runfs.for_server(s.max_disk_mb, disk_entries(s.max_disk_mb))
        )
        if self.dirs.sizes is None:
            log.warning(
                "run directories are not size-limited by the kernel (the server is not root): "
                "SANDBOX_MAX_DISK_MB is the server's check only"
            )
        removed = self.dirs.prepare()
        self.uids = jail_uids = self._jail_uids(host)
        if removed:
            log.info("purged stale run directories", extra={"dirs": [str(p) for p in removed]})
        runtime = await asyncio.to_thread(stage_runtime, s.tmp_root, s.python)
        if toolprobe.wanted(s.models_dir, self.provisioner.offload):
            self.tools = toolprobe.ToolProbe(s.python, self.provisioner.offload)
            self.tools.start(runtime, self.tasks)
        cache = None
        if s.wheelhouse is not None:  # unpacked once here, so runs need not install again
            cache = await asyncio.to_thread(stage_wheel_cache, s.wheelhouse, s.tmp_root)
        if s.open_ports or s.egress_allow_domains:
            self.audit = EgressAudit(self.metrics, s.egress_log)
            self.network = EgressNetwork(s, self.audit, self.interception)
            await self.network.start()
        network, dirs, groups = self.network, self.dirs, self.cgroups
        profiles = tuple(Profile(name, modules) for name, modules in s.preload_profiles)
        pools = ProfilePools.build(
            profiles,
            lambda p: JailFactory(
                s,
                host,
                runtime,
                dirs,
                network,
                preload=p.modules,
                wheel_cache=cache,
                cgroups=groups,
                uids=jail_uids,
            ),
            s.pool_size,
            max_size=s.pool_max,
        )
        pools.start(self.tasks)
        self.cpu = PoolLeases(pools, self.tasks)
        # The mode's pools beside the CPU ones (GPU mode: per device, each jail seeing only its
        # device, sharing no uid), and the lease source runs take from.
        self._leases = await self.provisioner.start(
            lambda dev, p: JailFactory(
                s,
                host,
                runtime,
                dirs,
                network,
                gpu=dev,
                preload=p.modules,
                wheel_cache=cache,
                cgroups=groups,
            ),
            self.cpu,
            self.tasks,
        )
        self.canary_port = canary_port
        self.started.set()
        log.info(
            "appliance started",
            extra={
                "firejail": host.firejail,
                "firejail_version": host.firejail_version,
                "jail_uid": host.uid,
                "jail_uids": len(jail_uids.candidates),
                "memory_cap": self.limits()["memory"],
                "pool_size": s.pool_size,
            },
        )
        self._task = self.tasks.spawn(self._canary_loop(), name="canary")
        if jail_uids.exclusive:
            self._tidier = self.tasks.spawn(self._tidy_uids(jail_uids), name="uids-tidier")
        if s.outputs_dir is not None and s.outputs_retention_s > 0:
            self._sweeper = self.tasks.spawn(
                self._sweep_outputs(s.outputs_dir, s.outputs_retention_s), name="outputs-sweeper"
            )

    def _jail_uids(self, host: HostFacts) -> uids.Uids:
        """The uids jails run as: one each from SANDBOX_UID_RANGE where the server is root and
        the range holds more than SANDBOX_UID, else SANDBOX_UID shared by all (`uids`).
        StartupError when the lock directory is not the server's own."""
        s = self.settings
        first, last = s.uid_range
        candidates: tuple[int, ...] = ()
        if host.run_as_uid is None:  # the server is the sandbox uid: it cannot switch to others
            if last > first:
                log.warning(
                    "SANDBOX_UID_RANGE is ignored: a server that is not root runs every jail as itself "
                    "(SANDBOX_UID), so jails share its per-uid kernel limits"
                )
        else:
            candidates, skipped = uids.usable(first, last, host.uid)
            if skipped:
                log.warning(
                    "uids of SANDBOX_UID_RANGE that have a host account or group are left out",
                    extra={"uids": list(skipped)},
                )
            if not candidates:
                log.warning(
                    "SANDBOX_UID_RANGE holds no uid besides SANDBOX_UID: every jail runs as it, and "
                    "jails share its per-uid kernel limits (inotify instances, descriptors in flight, ...)"
                )
        # The counts a jail's user namespace charges to root (nslimits): room for every jail of
        # the range at its cap, and the host's own share.
        for problem in nslimits.raise_host(last - first + 1):
            log.warning("a host limit stays below what the jails may hold", extra={"problem": problem})
        jail_uids = uids.Uids(uids.HOST_LOCK_ROOT, host.uid, host.gid, candidates)
        try:
            jail_uids.prepare()
        except OSError as exc:
            raise StartupError(
                f"cannot make the uids' lock directory under {uids.HOST_LOCK_ROOT}: {exc}"
            ) from exc
        return jail_uids

    async def _tidy_uids(self, jail_uids: uids.Uids) -> None:
        """Uids this server keeps ready past their jails go back to the host after `uids.KEEP_S`
        unused, whether or not another jail starts meanwhile."""
        while True:
            await asyncio.sleep(uids.KEEP_S)
            jail_uids.tidy()

    async def _sweep_outputs(self, root: Path, retention_s: int) -> None:
        """Remove persisted runs past their retention, now and then (a tenth of it, 1 s to 1 h)."""
        every = min(max(retention_s / 10, 1.0), 3600.0)
        while True:
            try:
                removed = await asyncio.to_thread(outputs.sweep, root, retention_s, time.time())
            except OSError as exc:
                log.error("could not sweep persisted outputs", extra={"error": str(exc)})
            else:
                if removed:
                    log.info("removed persisted outputs past their retention", extra={"runs": removed})
            checkpoint()
            await asyncio.sleep(every)

    async def close(self) -> None:
        """In order: the canary and sweeper, the tool probe, the pools (each cancels its refill
        loop, whose scope ends its jail starts, then waits for teardowns and destroys the ready
        jails); then the scope cancels whatever task is left, before the network, directories,
        uids and cgroups the tasks stood on go."""
        await self.tasks.cancel(self._task, self._sweeper, self._tidier)
        if self.tools is not None:
            await self.tools.close()
        await self.provisioner.close()  # and the CPU pool it was given
        await self.tasks.close()
        if self.network is not None:
            await self.network.close()
        if self.audit is not None:
            self.audit.close()
        if self.dirs is not None:
            self.dirs.remove_instance()
        if self.uids is not None:
            self.uids.close()
        if self.cgroups is not None:
            await asyncio.to_thread(self.cgroups.close)

    def limits(self) -> dict[str, str]:
        """Which layer enforces each per-run limit (/readyz "limits")."""
        if self.cgroups is not None:
            label = self.cgroups.label
            return {"memory": label, "cpu": label, "pids": label}
        return {"memory": "rlimit", "cpu": "none", "pids": "rlimit"}

    # -- readiness ---------------------------------------------------------------------------
    async def _canary_loop(self) -> None:
        while True:
            self.ready_problems = await self.canary()
            checkpoint()  # a close that came as the probe ended: never on to the next sleep
            if self.ready_problems:
                log.error("canary failed; not ready", extra={"problems": self.ready_problems})
            await asyncio.sleep(CANARY_EVERY_S if not self.ready_problems else CANARY_RETRY_S)

    async def canary(self) -> list[str]:
        """Run the probe in a real (CPU) jail; every way it is less confined than promised is a problem."""
        if self.cpu is None:
            raise RuntimeError("Lifecycle.canary before start()")
        stdout: list[str] = []

        async def collect(event: Event) -> None:
            if isinstance(event, Output) and event.name == "stdout":
                stdout.append(event.text)

        policy = self.network.policy if self.network is not None else None
        hosts = [str(a) for a in policy.host_addresses] if policy is not None else []
        req = Request(
            id="canary", code=canary.CANARY_CODE, files=(canary.params_file(self.canary_port or 9100, hosts),)
        )
        try:
            async with self.cpu.lease(req) as lease:
                jail = await lease.take()
                outcome = await run_cell(
                    jail,
                    req,
                    collect,
                    timeout_ms=CANARY_TIMEOUT_MS,
                    max_output_bytes=self.settings.max_output_bytes,
                    max_disk_mb=self.settings.max_disk_mb,
                    keep_alive=False,
                )
        except Exception as exc:  # noqa: BLE001 (any failure to run the probe is itself the finding: fail closed)
            return [f"canary could not run: {type(exc).__name__}: {exc}"]
        allowed = self.uids.all() if self.uids is not None else {self.uid}
        found = canary.judge(outcome.status, "".join(stdout), allowed)
        if found and outcome.message:
            found[0] += f": {outcome.message}"
        return found

    def readiness(self) -> tuple[list[str], dict[str, Any]]:
        """(problems, details) for /readyz: every reason not to send runs here now."""
        problems = list(self.ready_problems)
        cpu = self.cpu.pools if self.cpu is not None else None
        body: dict[str, Any] = {
            "pool_ready": sum(len(p.ready) for p in cpu.pools.values()) if cpu is not None else 0,
            "pools": {
                profile.name: {
                    "modules": list(profile.modules),
                    "ready": len(pool.ready),
                    "starting": pool.starting,
                    "target": pool.target(),
                }
                for profile, pool in cpu.pools.items()
            }
            if cpu is not None
            else {},
            "memory_cap": self.limits()["memory"],
            "limits": self.limits(),
            "cgroups": {
                "mode": self.settings.cgroups,
                "enforcing": self.cgroups is not None,
                "missing": self.cgroups_missing,
            },
            "firejail": self.host.firejail_version if self.host else None,
        }
        if self.tools is not None:  # per binding: does it import, can it offload to a GPU
            body["tools"] = self.tools.report()
            problems += self.tools.problems()
        found, fields = self.provisioner.readiness(body.get("tools"))  # GPU mode: each layer
        problems += found
        body.update(fields)
        return problems, body

    def _pool_sets(self) -> list[ProfilePools]:
        return [self.cpu.pools, *self.provisioner.pool_sets()] if self.cpu is not None else []

    def update_gauges(self) -> None:
        """Pool gauges and counters, read from the pools (when /metrics is scraped)."""
        m = self.metrics
        self.provisioner.update_gauges()
        sets = self._pool_sets()
        if not sets:
            return
        cpu = sets[0]
        m.pool_ready.set(sum(len(p.ready) for p in cpu.pools.values()))
        m.pool_starting.set(sum(p.starting for p in cpu.pools.values()))
        m.pool_target.set(sum(p.target() for p in cpu.pools.values()))
        m.jail_pss.set(max(p.jail_pss_kb for p in cpu.pools.values()) * 1024)
        for profile, pool in cpu.pools.items():
            m.profile_ready.labels(profile=profile.name).set(len(pool.ready))
            m.profile_target.labels(profile=profile.name).set(pool.target())
            m.profile_pss.labels(profile=profile.name).set(pool.jail_pss_kb * 1024)
        cold: Counter[str] = Counter()
        runs: Counter[str] = Counter()
        imported: Counter[str] = Counter()
        spawned = 0
        for pools in sets:
            runs.update(pools.runs)
            imported.update(pools.imported)
            for profile, pool in pools.pools.items():
                cold[profile.name] += pool.cold_starts
                spawned += pool.factory.spawned
        m.cold_starts.inc(sum(cold.values()) - sum(self._counted["cold"].values()))
        m.jails_spawned.inc(spawned - self._counted["spawned"]["all"])
        for name, value in cold.items():
            m.profile_cold_starts.labels(profile=name).inc(value - self._counted["cold"][name])
        for name, value in runs.items():
            m.profile_runs.labels(profile=name).inc(value - self._counted["runs"][name])
        for name, value in imported.items():
            m.preloaded_imports.labels(module=name).inc(value - self._counted["imported"][name])
        self._counted = {"cold": cold, "runs": runs, "imported": imported, "spawned": Counter(all=spawned)}
