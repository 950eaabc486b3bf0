"""One jail: a run directory plus a verified firejail process running the driver.

`JailFactory.launch()` makes a jail in an explicit order:
  1. create the run directory (owned by the sandbox uid),
  2. render the spec to a firejail argv (pure),
  3. start firejail as the sandbox uid with a clean environment,
  4. wait for the driver's `ready` event and verify its self-check,
and `Jail.destroy()` undoes all of it, whatever happened.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import re
import secrets
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from appliance.core.errors import JailExited, JailFailure, JailStartFailed, RequestRejected, StartupError
from appliance.core.ports import Workspace
from appliance.core.tasks import TaskScope
from appliance.sandbox import checks, fstree, nslimits, proctree, runfs, signals
from appliance.sandbox.cgroups import CommandGroup, Counters, Group, GroupLimits, Hierarchy
from appliance.sandbox.devices import GpuDevice
from appliance.sandbox.egressintercept import trust_env
from appliance.sandbox.firejail import (
    bind_table,
    binds_argv,
    drop_argv,
    join_argv,
    launcher_env,
    oom_argv,
    oom_join_argv,
    render_argv,
)
from appliance.sandbox.host import HostFacts
from appliance.sandbox.jailexec import JailCommand, JoinSpec, command_argv
from appliance.sandbox.network import EgressNetwork, JailLink, enter_argv, expected_interfaces, proxy_env
from appliance.sandbox.process import JailProcess
from appliance.sandbox.spec import ETC_FILES, JailLimits, JailSpec, jail_env
from appliance.sandbox.uids import Held, Uids
from appliance.sandbox.workdir import RunDirs, driver_of
from appliance.settings import Settings

log = logging.getLogger("appliance.sandbox")


@functools.cache
def _tmp_unsized() -> None:
    """Say once that jails' /tmp cannot be sized by the kernel here (`Jail.pin`)."""
    log.warning(
        "the jails' /tmp cannot be opened to size it (no ptrace access to the jail, as in a "
        "container without CAP_SYS_PTRACE): /tmp is bounded by the server's disk check only",
    )


@functools.cache
def _uncapped(why: str) -> None:
    """Say once per reason that jails run without their per-namespace caps (`nslimits`)."""
    log.warning(
        "jails' inotify and fanotify counts are not capped per jail: together they may exhaust "
        "root's on the host",
        extra={"reason": why},
    )


READY_TIMEOUT_S = 60.0
UID_WAIT_S = 30.0  # the longest a launch waits for a free uid of SANDBOX_UID_RANGE
FREEZE_WAIT_S = 2.0  # the longest a session's jail may take to freeze before the session ends
FREEZE_POLL_S = 0.0005  # the first wait between two looks at the freezer state (doubling)


@dataclass
class Jail:
    """A started, verified jail. Single-use unless a session keeps it."""

    id: str
    workdir: Path
    process: JailProcess
    dirs: RunDirs
    created: float = field(default_factory=time.monotonic)
    link: JailLink | None = None  # egress mode: the jail's own network namespace
    network: EgressNetwork | None = None
    cgroup: Group | None = None  # the jail's own cgroup (memory, cpu, pids), when enforcing
    baseline: Counters | None = None  # the group's counters when it became ready (`make_ready`)
    tmp_fd: int | None = None  # its private /tmp, open from `pin` until `destroy`
    workdir_fd: int | None = None  # its run directory, open from `pin` until `destroy`
    workdir_dev: int | None = None  # the run directory's filesystem, read at `pin`
    held: Held | None = None  # its uid (`uids`), given back once the jail is gone
    uids: Uids | None = None
    join: JoinSpec | None = None  # how a command joins it from outside (`start_command`)
    commands_starting: int = 0  # commands being started: the jail must not freeze meanwhile
    commands: list[JailCommand] = field(default_factory=list)  # started here, not yet ended
    commands_made: int = 0  # commands' groups made so far (each command's is numbered)
    # Groups of ended commands not yet removed (a process was still leaving, or a daemon it
    # left still runs): tried again as the next command starts (`CommandTree.release`).
    lingering: list[CommandGroup] = field(default_factory=list)
    holds: int = 0  # workspaces held past the jail's end, not yet released (`hold_workspace`)
    ended: bool = False  # destroyed: its processes killed and reaped, its cgroup removed
    _destroyed: bool = False
    _workdir_kept: bool = False  # destroyed while held: the last release removes the directory
    _emptied: bool = False  # its cgroup removed: no live process of its uid left (`uids`)

    @property
    def uid(self) -> int:
        """The uid the jail's code runs as."""
        return self.held.uid if self.held is not None else self.dirs.uid

    @property
    def alive(self) -> bool:
        return not self._destroyed and self.process.is_running()

    def open_workspace(self) -> Workspace | None:
        """A descriptor of the run directory of the caller's own (`ports.Jail`). Opened from
        the pinned one in the event loop's thread, where `destroy` closes it: never a number
        closed and reused meanwhile."""
        if self._destroyed or self.workdir_fd is None or self.workdir_dev is None:
            return None
        try:
            fd = fstree.reopen_dir(self.workdir_fd)
        except OSError:
            return None
        gid = self.held.gid if self.held is not None else self.dirs.gid
        return Workspace(fd=fd, dev=self.workdir_dev, uid=self.uid, gid=gid)

    def hold_workspace(self) -> WorkspaceHold | None:
        """`open_workspace`, and the run directory kept until the hold is released, even past
        `destroy` (`ports.Jail`): a server that cannot mount removes a plain directory's files
        with it, and a descriptor alone would then reach an empty directory."""
        ws = self.open_workspace()
        if ws is None:
            return None
        self.holds += 1
        return WorkspaceHold(self, ws)

    async def _let_go(self) -> None:
        """A hold released: the last one of a destroyed jail removes its directory."""
        self.holds -= 1
        if self.holds or not self._workdir_kept:
            return
        self._workdir_kept = False
        # The thread is started before the first wait: a caller cancelled meanwhile (its
        # client gone, the server stopping) does not stop the removal.
        await asyncio.to_thread(self._remove_workdir)

    async def start_command(
        self, argv: Sequence[str], env: dict[str, str], cwd: str, stdin: bool, tasks: TaskScope
    ) -> JailCommand:
        """Run a command in this jail beside its interpreter (appliance.sandbox.jailexec): as
        its uid, in its namespaces, under its seccomp filters and rlimits, in a cgroup of its
        own below its cgroup's COMMANDS sub-group. A frozen jail (a session between cells) is
        thawed first, and stays thawed while a command's launcher lives or its group holds a
        process (`commands_running`). JailFailure when it cannot be started here; ValueError
        for a command `env` would misread."""
        if self.join is None or not self.alive:
            raise JailFailure("commands cannot be started in this jail")
        self.commands_starting += 1
        try:
            procs: list[Path] = []
            tree: CommandTree | None = None
            if self.cgroup is not None:
                self.commands_made += 1
                stale, self.lingering = self.lingering, []
                try:
                    left, made = await asyncio.to_thread(
                        _make_command_group, self.cgroup, self.commands_made, stale
                    )
                    self.lingering += left
                    tree = CommandTree(self, made)
                    procs = made.procs_files()
                    self.thaw()
                except OSError as exc:
                    raise JailFailure(f"the jail's commands group could not be made: {exc}") from exc
            argv_all = command_argv(self.join, self.process.pid, procs, argv, env, cwd)
            try:
                command = await JailCommand.start(argv_all, stdin, tasks, tree)
            except OSError as exc:
                raise JailFailure(f"could not start the command: {exc}") from exc
            # Counted before `commands_starting` drops: its launcher joins the group only from
            # now on, and must never join a frozen one (`commands_running`).
            self.commands.append(command)
            return command
        finally:
            self.commands_starting -= 1

    def commands_running(self) -> bool:
        """Whether a command started from outside is starting, is not yet ended, or left a
        process in its group. A launcher that lives counts even before it joined its group
        (it joins after the start returns): frozen then, it would freeze as it joined, and a
        kill would not land until a thaw that nothing asks for."""
        if self.commands_starting:
            return True
        self.commands = [c for c in self.commands if c.running]
        if self.commands:
            return True
        if self.cgroup is None:
            return False
        try:
            return bool(self.cgroup.commands_members())
        except (OSError, ValueError):
            return True  # not known: not frozen (the commands' limits are the jail's anyway)

    def kill_command(self, group: CommandGroup) -> None:
        """SIGKILL every process of one command's group (`CommandTree`). Held by a freezer (not
        by the server's: it freezes no jail a command runs in; one found so anyway), they
        take it only once thawed: the jail is thawed, so that the kill lands."""
        try:
            killed = group.kill()
            held = bool(killed) and group.held()
        except (OSError, ValueError):
            return  # the group is gone: so is the command's tree (the jail's teardown)
        if held and self.cgroup is not None:
            log.warning("a killed command was frozen: its jail is thawed", extra={"jail": self.id})
            with contextlib.suppress(OSError):
                self.cgroup.thaw()

    def pin(self) -> None:
        """The driver is up and no code has run: pin the jail's processes (`JailProcess.pin`)
        and open its private /tmp, whose tmpfs counts what the run keeps there: a cell's end
        then reads that count with one fstatvfs instead of a path lookup through /proc into
        another mount namespace. The run directory is opened too: a cell's end reads its
        tmpfs's count, or walks it, from there.

        Where run directories are sized tmpfs (`RunDirs.sizes`), the /tmp gets the same sizes
        here, before any code runs (`runfs.resize`): OSError if it cannot, and such a jail
        must not be used (fail closed)."""
        self.process.pin()
        with contextlib.suppress(OSError):  # the server made it; the jail cannot mount over it
            fd = fstree.open_dir(self.workdir)
            self.workdir_fd, self.workdir_dev = fd, os.fstat(fd).st_dev
        tmp = tmp_of(self.process.inits())
        if tmp is not None:
            with contextlib.suppress(OSError):
                self.tmp_fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        sizes = self.dirs.sizes
        if sizes is not None:
            if self.tmp_fd is None:
                # A server without ptrace access to the jail (a container's root lacks
                # CAP_SYS_PTRACE) cannot open /proc/PID/root: /tmp then keeps the bound the
                # server's check gives it, as before run filesystems were sized.
                _tmp_unsized()
                return
            runfs.resize(self.tmp_fd, sizes)

    def run_processes(self, inits: list[int]) -> list[int]:
        """Every process of the jail below firejail's own two (its launcher and the sandbox's
        init, `inits`): what the run made, orphans included. From the cgroup's member list,
        one read, where the jail has a group (nothing of it can leave it); else from /proc."""
        if self.cgroup is not None:
            try:
                members = self.cgroup.members()
            except (OSError, ValueError):
                members = None
            if members is not None:
                skip = {self.process.pid, *inits}
                return [pid for pid in members if pid not in skip]
        return proctree.below(inits)

    async def freeze(self) -> None:
        """Between a session's cells: freeze every process of the jail, and kill what is not the
        jail's own (`JailProcess.ready_pids`): what a thread of the cell started after the cell
        ended its leftovers. Nothing of a frozen jail runs, so a session holds no CPU outside
        SANDBOX_MAX_CONCURRENCY. Confirmed, not assumed: JailFailure unless the kernel says
        every task is frozen within FREEZE_WAIT_S (a task in an uninterruptible wait may not
        be). A jail without a cgroup has no freezer: nothing is done (rlimits mode)."""
        group = self.cgroup
        if group is None:
            return
        if self.commands_running():
            # A command's processes (a server it started) run on between cells: only what the
            # cells left is killed, the jail is not frozen (docs/e2b.md).
            self._kill_leftovers(group)
            return
        try:
            await self._freeze(group)
        except BaseException:
            # Fail closed: the jail is killed, then thawed, so that it dies without running on.
            self.process.signal_kill()
            with contextlib.suppress(OSError):
                group.thaw()
            raise

    def _kill_leftovers(self, group: Group) -> None:
        """Kill every process of the group's own (not its COMMANDS sub-group's) that is not the
        jail's: what the cells left behind."""
        own = set(self.process.ready_pids())
        try:
            members = group.members() or group.pids()
        except (OSError, ValueError):
            members = []
        for pid in members:
            if pid not in own:
                with contextlib.suppress(ProcessLookupError):
                    signals.kill(pid)

    async def _freeze(self, group: Group) -> None:
        loop = asyncio.get_running_loop()
        try:
            group.freeze()
            deadline = loop.time() + FREEZE_WAIT_S
            wait = 0.0  # the first look again after one turn of the loop: most freezes are done by then
            while not group.is_frozen():
                if self.commands_running():
                    # A command is being started meanwhile (it thawed the group): not frozen.
                    group.thaw()
                    self._kill_leftovers(group)
                    return
                if loop.time() > deadline:
                    raise JailFailure(f"the session's jail did not freeze within {FREEZE_WAIT_S} s")
                await asyncio.sleep(wait)
                wait = min(wait * 2 or FREEZE_POLL_S, 0.05)
            # Frozen, the member list holds still. On v1 a killed process dies as the group
            # thaws, before it runs again; on v2 it dies now.
            own = set(self.process.ready_pids())
            for pid in group.members() or group.pids():
                if pid not in own:
                    with contextlib.suppress(ProcessLookupError):
                        signals.kill(pid)
        except OSError as exc:
            raise JailFailure(f"the session's jail could not be frozen: {exc}") from exc

    def thaw(self) -> None:
        """Let a frozen jail run again (a session's next cell); OSError if the kernel refused."""
        if self.cgroup is not None and self.cgroup.frozen:
            self.cgroup.thaw()

    def make_ready(self, limits: GroupLimits) -> None:
        """A pooled jail, started at idle CPU weight, becomes ready to hand out: the run's cgroup
        limits (they differ in the weight only) and the baseline its first cell is measured from
        (CPU time, OOM kills, a new peak reading). Done here, off the run's path: waiting ready,
        the jail runs nothing, so neither changes until a run has it. OSError if the group
        cannot be written: such a jail must not be handed out."""
        if self.cgroup is not None:
            self.cgroup.set_limits(limits)
            self.baseline = _measure_from_now(self.cgroup)

    def limit_memory(self, memory_mb: int) -> None:
        """Lower the group's memory limit for the rest of this jail's life (a run or session
        that asked for less than SANDBOX_MEMORY_MB); never raises it. RequestRejected where
        the kernel cannot hold the jail to it: no cgroup (rlimits mode), or the kernel
        refused the write (v1: the jail already holds more than that)."""
        group = self.cgroup
        if group is None:
            raise RequestRejected(
                f"a memory limit of {memory_mb} MiB cannot be enforced here: this server runs without "
                "cgroups (rlimits mode); leave the limit out to run under SANDBOX_MEMORY_MB"
            )
        if memory_mb >= group.limits.memory_mb:
            return
        try:
            group.set_limits(replace(group.limits, memory_mb=memory_mb))
        except OSError as exc:
            raise RequestRejected(
                f"a memory limit of {memory_mb} MiB could not be set on the run's cgroup ({exc.strerror}): "
                "the interpreter may already hold more"
            ) from None

    def cell_baseline(self) -> Counters | None:
        """The group's counters a cell is measured from: those taken when the jail became ready,
        for its first cell; else read now, with a new peak reading. None without a group."""
        base, self.baseline = self.baseline, None
        if base is None and self.cgroup is not None:
            with contextlib.suppress(OSError):
                base = _measure_from_now(self.cgroup)
        return base

    async def destroy(self) -> None:
        """Kill every process of the jail, reap them, remove the run directory and the cgroup.
        A held run directory (`hold_workspace`) stays, with the jail's uid, until its last
        hold is released."""
        if self._destroyed:
            return
        self._destroyed = True
        killed = False
        try:
            if self.cgroup is not None and self.cgroup.frozen:
                # A frozen task takes SIGKILL only as it thaws (v1): the kill goes first, so
                # that nothing of the jail runs between the thaw and its end.
                self.process.signal_kill()
                with contextlib.suppress(OSError):
                    self.cgroup.thaw()
            await self.process.kill()
            killed = True
        finally:
            if self.tmp_fd is not None:  # an open directory keeps its tmpfs, and its pages, alive
                os.close(self.tmp_fd)
                self.tmp_fd = None
            if self.workdir_fd is not None:
                os.close(self.workdir_fd)
                self.workdir_fd = None
            self._workdir_kept = self.holds > 0
            try:
                await asyncio.to_thread(self._remove, not self._workdir_kept)
                self.ended = killed
            finally:
                if self.network is not None and self.link is not None:
                    await self.network.release(self.link)

    def _remove(self, workdir: bool) -> None:
        """Remove the cgroup and, unless it is held, the run directory (`_remove_workdir`)."""
        try:
            if workdir:
                self.dirs.remove(self.workdir)
        finally:
            try:
                if self.cgroup is not None:  # also kills anything of the jail still in it
                    self.cgroup.remove()
                    # It held every process of the jail: none is left (`uids`' docstring).
                    self._emptied = True
            finally:
                # The uid goes back once its processes are gone, and with them its files: a
                # held directory keeps it (no other jail is given the uid of files still there).
                if workdir:
                    self._give_back_uid()

    def _remove_workdir(self) -> None:
        try:
            self.dirs.remove(self.workdir)
        finally:
            self._give_back_uid()

    def _give_back_uid(self) -> None:
        if self.uids is not None and self.held is not None:
            self.uids.give_back(self.held, emptied=self._emptied)


@dataclass
class WorkspaceHold:
    """A descriptor of a jail's run directory that keeps the directory past the jail's end
    (`Jail.hold_workspace`; `ports.HeldWorkspace`)."""

    jail: Jail
    workspace: Workspace
    _released: bool = False

    @property
    def jail_ended(self) -> bool:
        return self.jail.ended

    async def release(self) -> None:
        if self._released:
            return
        self._released = True
        try:
            os.close(self.workspace.fd)
        finally:
            await self.jail._let_go()


@dataclass(frozen=True)
class CommandTree:
    """A command's processes as appliance.sandbox.jailexec kills and lets go of them: its own
    cgroup, in the jail it runs in."""

    jail: Jail
    group: CommandGroup

    def kill(self) -> None:
        self.jail.kill_command(self.group)

    def release(self) -> None:
        gone = False
        with contextlib.suppress(OSError):
            gone = self.group.release()
        if not gone:
            self.jail.lingering.append(self.group)


def _make_command_group(
    group: Group, number: int, stale: list[CommandGroup]
) -> tuple[list[CommandGroup], CommandGroup]:
    """A new command's group, and of the ended commands' groups `stale`, those still there
    (blocking: a thread). OSError if the new one cannot be made."""
    left = []
    for old in stale:
        try:
            if not old.release():
                left.append(old)
        except OSError:
            left.append(old)
    return left, group.command_group(number)


async def _shielded(taking: Coroutine[Any, Any, Held | None], uids: Uids) -> Held | None:
    """A uid taken in a thread. A launch cancelled meanwhile (its run's client gone) does not stop
    the thread: the uid it locks is given back before the cancellation goes on."""
    task = asyncio.ensure_future(taking)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            held = await task
            if held is not None:
                await asyncio.to_thread(uids.give_back, held)
        raise


def _measure_from_now(group: Group) -> Counters:
    """The group's counters now (CPU time, OOM kills) and a new peak reading from here: what a
    cell is measured from. OSError if the group cannot be read or written."""
    base = group.counters(pids=False)
    group.reset_peak()
    return base


def tmp_of(inner: list[int]) -> Path | None:
    """A jail's private /tmp as the host sees it, from the children of its firejail process
    (the sandbox's init, whose mount namespace holds that tmpfs)."""
    return Path(f"/proc/{inner[0]}/root/tmp") if inner else None


class JailFactory:
    """Makes jails for one server: holds the settings and host facts every spec needs."""

    def __init__(  # noqa: PLR0913 (the pool's collaborators, injected)
        self,
        settings: Settings,
        host: HostFacts,
        runtime: Path,
        dirs: RunDirs,
        network: EgressNetwork | None = None,
        gpu: GpuDevice | None = None,
        preload: tuple[str, ...] | None = None,
        wheel_cache: Path | None = None,
        cgroups: Hierarchy | None = None,
        uids: Uids | None = None,
    ) -> None:
        self.settings = settings
        # A uid per jail (`uids`), but not for GPU jails: an MPS daemon serves one uid at a time.
        self.uids = uids if uids is not None and uids.exclusive and gpu is None else None
        self.cgroups = cgroups  # enforcing: every jail gets its own group before it starts
        self.run_limits = GroupLimits(
            memory_mb=settings.memory_mb, cpus=settings.cpus, max_procs=settings.max_procs
        )
        self.preload = settings.preload if preload is None else preload  # this factory's profile
        self.gpu = gpu  # GPU mode: every jail made here sees only this device
        self.host = host
        self.runtime = runtime
        self.dirs = dirs
        self.network = network
        self.expected = checks.Expected(
            uid=host.uid,
            host_pid_ns=host.pid_ns,
            host_net_ns=host.net_ns,
            interfaces=expected_interfaces(network is not None),
            etc=jail_etc(network is not None),
        )
        self._env = jail_env(settings, settings.python, runtime, self.preload)
        self._readable = (*python_roots(settings.python), runtime)
        self._driver = driver_of(runtime)
        self._hooks_hidden = own_hooks(settings.python)
        if settings.models_dir is not None:
            self._readable += (settings.models_dir,)
        if settings.wheelhouse is not None:  # whitelisted read-only, like every readable path
            self._readable += (settings.wheelhouse,)
        if wheel_cache is not None:  # the server's unpacked wheels (appliance.sandbox.wheels)
            self._readable += (wheel_cache,)
            self._env = tuple(sorted((*self._env, ("APPLIANCE_WHEEL_CACHE", str(wheel_cache)))))
        interception = network.interception if network is not None else None
        bundle = interception.ca.bundle_dir if interception is not None else None
        if (
            interception is not None and bundle is not None
        ):  # names mode with secrets: trust the appliance's CA
            self._readable += (bundle,)
            ca = interception.ca
            if ca.bundle is not None and ca.ca_file is not None:
                self._env = tuple(sorted((*self._env, *trust_env(ca.bundle, ca.ca_file))))
        if gpu is not None:
            self._env = tuple(sorted(self._env + gpu_env(settings, gpu)))
            if settings.gpu_libcuda.startswith("/"):  # a driver library outside the usual paths
                self._readable += (Path(settings.gpu_libcuda).parent,)
        self.spawned = 0

    def spec(self, workdir: Path, link: JailLink | None = None, held: Held | None = None) -> JailSpec:
        s = self.settings
        return JailSpec(
            workdir=workdir,
            uid=held.uid if held is not None else self.host.uid,
            gid=held.gid if held is not None else self.host.gid,
            python=s.python,
            driver=self._driver,
            limits=JailLimits(
                memory_mb=s.memory_mb,
                max_procs=s.max_procs,
                file_mb=s.max_file_mb,
                open_files=s.max_open_files,
            ),
            readable=self._readable,
            root_entries=self.host.root_entries,
            run_entries=self.host.run_entries,
            env=self._link_env(link),
            netns=link.netns if link is not None else None,
            dns=s.egress_dns if link is not None and 53 in s.open_ports else (),
            devices=self.gpu.nodes if self.gpu else (),
            gpu=self.gpu is not None,
            gpu_hidden=self.gpu.hidden if self.gpu else (),
            gpu_shared=(self.gpu.mps_pipe_dir,) if self.gpu and self.gpu.mps_pipe_dir else (),
            hooks_hidden=self._hooks_hidden,
        )

    def _link_env(self, link: JailLink | None) -> tuple[tuple[str, str], ...]:
        """The environment, with the jail's own proxy in names mode."""
        policy = self.network.policy if self.network is not None else None
        if link is None or policy is None or policy.proxy_port is None:
            return self._env
        return tuple(sorted((*self._env, *proxy_env(policy, link))))

    async def launch(self, nice: int = 0) -> Jail:
        """Start and verify a new jail, or raise JailFailure (and leave nothing behind).

        nice > 0 starts it at lower CPU priority (pool refills) and, with cgroups, at idle CPU
        weight; the pool sets both back for runs once it is ready (`make_ready`).
        """
        jail_id = secrets.token_hex(8)
        held = await self._take_uid()
        try:
            return await self._launch_as(jail_id, nice, held)
        except BaseException:
            if held is not None and self.uids is not None:
                await asyncio.to_thread(self.uids.give_back, held)
            raise

    async def _take_uid(self) -> Held | None:
        """A uid of SANDBOX_UID_RANGE held for the new jail alone, with its accounts staged;
        None where jails share the sandbox uid. Waits while every uid is held (by this
        server's jails or another's), up to UID_WAIT_S: JailFailure then."""
        uids = self.uids
        if uids is None:
            return None
        deadline = time.monotonic() + UID_WAIT_S
        pause = 0.01
        while True:
            try:
                held = await _shielded(asyncio.to_thread(uids.take), uids)
            except (OSError, StartupError) as exc:
                raise JailFailure(f"could not take a uid for the jail: {exc}") from exc
            if held is not None:
                break
            if time.monotonic() > deadline:
                raise JailFailure(
                    f"no uid of SANDBOX_UID_RANGE was free for {UID_WAIT_S:.0f} s: every one is held by a "
                    "jail (widen the range)"
                )
            await asyncio.sleep(pause)  # uids are freed by other servers too: nothing to wait on
            pause = min(pause * 2, 0.25)
        try:
            await asyncio.to_thread(self.dirs.accounts_for, held.uid, held.gid)
        except BaseException as exc:
            await asyncio.to_thread(uids.give_back, held)
            if isinstance(exc, (OSError, StartupError)):
                raise JailFailure(f"could not stage the jail's accounts: {exc}") from exc
            raise
        return held

    async def _launch_as(self, jail_id: str, nice: int, held: Held | None) -> Jail:
        group = None
        if self.cgroups is not None:  # fail closed: no group, no jail
            limits = self.run_limits.idle() if nice > 0 else self.run_limits
            try:
                group = self.cgroups.group(jail_id, limits)
            except OSError as exc:
                if group is not None:
                    await asyncio.to_thread(group.remove)
                raise JailFailure(f"could not make the jail's cgroup: {exc}") from exc
        try:
            return await self._launch(jail_id, nice, group, held)
        except BaseException:
            if group is not None:
                await asyncio.to_thread(group.remove)
            raise

    async def _make_workdir(self, jail_id: str, held: Held | None) -> tuple[Path, Path | None]:
        """The jail's run directory, and its bind table (`_binds`) where there is one, made in a
        thread. A run cancelled meanwhile (its client gone) does not stop the thread: the
        directory is made, then removed, before the cancellation goes on, so no run directory
        outlives a run that never got its jail."""
        uid, gid = (held.uid, held.gid) if held is not None else (None, None)
        binds = self._binds(held, self.dirs.path(jail_id), self._etc(held))
        making = asyncio.ensure_future(asyncio.to_thread(self.dirs.create, jail_id, uid, gid, binds))
        try:
            workdir = await asyncio.shield(making)
            return workdir, (None if binds is None else self.dirs.binds_path(jail_id))
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await making
            await asyncio.to_thread(self.dirs.remove, self.dirs.path(jail_id))
            raise

    def _launcher(
        self, link: JailLink | None, group: Group | None, held: Held | None, table: Path | None
    ) -> list[str]:
        """What runs before firejail, outermost first: join the jail's cgroup (as root), give it
        its binds, `table` (a private mount namespace: `_binds`), enter its network namespace, and
        drop to the jail's uid. All of it is exec'd programs, so the server spawns with vfork and
        never forks itself (`firejail.join_argv`)."""
        uid, gid = (held.uid, held.gid) if held is not None else (self.host.uid, self.host.gid)
        # In egress mode root enters the namespace and drops to the sandbox uid itself.
        prefix = enter_argv(link, uid, gid) if link is not None else []
        if link is None and self.host.run_as_uid is not None:
            prefix = drop_argv(uid, gid)
        if table is not None:
            prefix = binds_argv(table, prefix)
        # Root: the jail is the OOM killer's first choice (with a cgroup, in the join's shell).
        as_root = self.host.run_as_uid is not None
        if group is not None and as_root:
            prefix = oom_join_argv(group.procs_files()) + prefix
        elif group is not None:
            prefix = join_argv(group.procs_files()) + prefix
        elif as_root:
            prefix = oom_argv() + prefix
        return prefix

    def _binds(self, held: Held | None, workdir: Path, etc: Path | None) -> str | None:
        """The launcher's bind table for the jail (`firejail.bind_table`): where root starts it,
        its minimal accounts (the jail's /etc/passwd and /etc/group list only root and the
        sandbox user), the run directory as /workspace, and the prepared /etc. None where the
        server is the sandbox uid itself (it cannot mount)."""
        uid, gid = (held.uid, held.gid) if held is not None else (self.host.uid, self.host.gid)
        accounts = self.dirs.accounts_for(uid, gid) if held is not None else self.dirs.accounts
        if accounts is None or (self.network is None and self.host.run_as_uid is None):
            if etc is not None:  # the render left --private-etc out: never start it without its /etc
                raise JailFailure("the prepared /etc cannot be mounted for this jail")
            return None
        return bind_table(*accounts, workdir, etc)

    def _join_spec(self, spec: JailSpec, held: Held | None, workdir: Path) -> JoinSpec:
        """How commands join the jail later (appliance.sandbox.jailexec): as it was launched."""
        uid, gid = (held.uid, held.gid) if held is not None else (self.host.uid, self.host.gid)
        as_root = self.host.run_as_uid is not None
        accounts = self.dirs.accounts_for(uid, gid) if held is not None else self.dirs.accounts
        return JoinSpec(
            firejail=self.host.firejail,
            uid=uid,
            gid=gid,
            as_root=as_root,
            accounts=accounts if as_root else None,
            workdir=workdir,
            env=spec.env,
            limits=spec.limits,
            gpu=spec.gpu,
        )

    def _etc(self, held: Held | None) -> Path | None:
        """The prepared /etc where the launcher mounts for the jail (`_binds`): root starts it
        (in egress mode too: root enters the jail's network namespace)."""
        mounts = self.network is not None or self.host.run_as_uid is not None
        accounts = held is not None or self.dirs.accounts is not None
        return self.dirs.etc if mounts and accounts else None

    async def _launch(  # noqa: C901 (one jail's launch steps in order, each undone if a later one fails)
        self, jail_id: str, nice: int, group: Group | None, held: Held | None
    ) -> Jail:
        workdir, table = await self._make_workdir(jail_id, held)
        link: JailLink | None = None
        if self.network is not None:  # egress mode: the filtered namespace first, firejail inside it
            try:
                link = await self.network.attach(jail_id)
            except BaseException:
                await asyncio.to_thread(self.dirs.remove, workdir)
                raise
        spec = dataclasses.replace(self.spec(workdir, link, held), nice=nice, etc=self._etc(held))
        try:
            process = await JailProcess.spawn(
                lambda fd: (
                    self._launcher(link, group, held, table) + render_argv(spec, fd, self.host.firejail)
                ),
                env=launcher_env(),
                max_event_bytes=self.settings.max_output_bytes + 65536,
            )
        except BaseException as exc:  # a cancelled run's too: it leaves nothing behind
            await asyncio.to_thread(self.dirs.remove, workdir)
            if link is not None and self.network is not None:
                await self.network.release(link)
            if isinstance(exc, OSError):
                raise JailFailure(f"could not start firejail: {exc}") from exc
            raise
        self.spawned += 1
        jail = Jail(
            id=jail_id,
            workdir=workdir,
            process=process,
            dirs=self.dirs,
            link=link,
            network=self.network,
            cgroup=group,
            held=held,
            uids=self.uids,
            join=self._join_spec(spec, held, workdir),
        )
        try:
            ready = await jail.process.wait_event("ready", READY_TIMEOUT_S)
        except JailExited as exc:
            await jail.destroy()
            log.error("jail exited before ready", extra={"output": exc.output, "jail": jail.id})
            raise JailStartFailed("the jail exited before it was ready") from exc
        except TimeoutError as exc:
            await jail.destroy()
            raise JailFailure("jail did not become ready in time") from exc
        except BaseException:
            await jail.destroy()
            raise
        if ready["ev"] != "ready":
            await jail.destroy()
            raise JailFailure(f"the jail sent {ready['ev']!r} where its ready event was due")
        expected = self.expected if held is None else dataclasses.replace(self.expected, uid=held.uid)
        found = checks.problems(ready["check"], expected)
        if found:
            await jail.destroy()
            log.error("jail refused: self-check failed", extra={"problems": found, "jail": jail_id})
            raise JailFailure("the jail failed its self-check; the run was refused")
        if ready["preload_failed"]:
            log.warning("preload failed", extra={"modules": ready["preload_failed"]})
        try:
            jail.pin()
        except OSError as exc:
            await jail.destroy()
            raise JailFailure(f"could not size the jail's writable space: {exc}") from exc
        await self._cap(jail)
        return jail

    async def _cap(self, jail: Jail) -> None:
        """Cap the counts the jail's user namespace charges to root (`nslimits`) before any code
        runs. A jail the server cannot cap is used uncapped, said once in the log: one it cannot
        reach (no ptrace access, as in a container), or one firejail gave no user namespace of
        its own (as where firejail cannot make one: capping that namespace would cap the host's).
        The caps bound a denial of service between jails; the jail's isolation is its
        self-check's to verify, not theirs."""
        inits = jail.process.inits()
        try:
            why = await nslimits.cap_jail(inits[0]) if inits else "its sandbox's init is gone"
        except BaseException:
            await jail.destroy()
            raise
        if why is not None:
            _uncapped(why)


def jail_etc(egress: bool) -> frozenset[str]:
    """The most a jail's /etc may list: ETC_FILES, and in egress mode the resolv.conf firejail
    writes for --dns."""
    return frozenset(ETC_FILES) | ({"resolv.conf"} if egress else set())


def gpu_env(settings: Settings, gpu: GpuDevice) -> tuple[tuple[str, str], ...]:
    """What a GPU jail adds to the environment: its one device, the CUDA library, MPS."""
    env = [("CUDA_VISIBLE_DEVICES", gpu.uuid), ("APPLIANCE_LIBCUDA", settings.gpu_libcuda)]
    if gpu.mps_pipe_dir is not None:
        env.append(("CUDA_MPS_PIPE_DIRECTORY", str(gpu.mps_pipe_dir)))
    return tuple(env)


# The `.pth` of an editable install of the appliance (or its client) in the jails' virtualenv.
OWN_HOOK = re.compile(r"__editable__\.appliance(_client)?-[^/]*\.pth")


def own_hooks(python: Path) -> tuple[Path, ...]:
    """The `.pth` files of the appliance's own editable installs in the jail interpreter's
    virtualenv (a development checkout's). Each makes every Python start in a jail import a
    finder (and pathlib, re, urllib ...) that maps the server's source tree, which a jail cannot
    see: it has the runtime staged instead. Hidden from jails, `site` skips them."""
    found: list[Path] = []
    for root in python_roots(python):
        for site in root.glob("lib/python3*/site-packages"):
            found += [path for path in site.iterdir() if OWN_HOOK.fullmatch(path.name)]
    return tuple(sorted(found))


def python_roots(python: Path) -> list[Path]:
    """The directories the jail's interpreter needs besides /usr: its virtualenv, if any."""
    venv = python.parent.parent
    if (venv / "pyvenv.cfg").exists():
        return [venv]
    return []
