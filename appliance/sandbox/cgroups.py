"""Per-run cgroups: a run's limits rendered as file writes (pure), and thin I/O that applies them.

One group per jail, for v1 (one directory per controller: memory, cpu, cpuacct, pids, freezer) or
v2 (one directory in a delegated subtree). `render_v1` / `render_v2` turn `GroupLimits` into ordered writes and
hold all the policy; `Hierarchy` only makes directories, writes files, reads counters and removes.

Layout, under the server's own cgroup of each controller (so the host's placement of the server,
and any limit on it, still holds over its runs):

    appliance/srv-<pid ns>-<pid>-<starttime>/<jail id>/     one instance directory per server process

The instance name is the server's record (`appliance.sandbox.instance`): a group whose server is
no longer alive (no process with that pid and that start time in this PID namespace) is a
leftover of a server killed with -9, and `purge_dead` removes it at the next start; a live
server's groups, and those of servers in other PID namespaces, are never touched.

A process joins its group before it executes anything of the jail: the launcher (a shell,
`firejail.join_argv`, the first thing the server executes) writes "0" (itself) into each
`Group.procs_files()` and only then execs the rest. So firejail and everything it forks are
counted from their first instruction; no window exists in which a child could fork outside the
group, which moving a pid in after spawn would leave open.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from appliance.core.errors import StartupError
from appliance.sandbox import instance as server_instance
from appliance.sandbox import signals

CGROUP_ROOT = Path("/sys/fs/cgroup")
BASE = "appliance"  # our subtree under the server's own cgroup of each controller
CPU_PERIOD_US = 100_000
V1_CONTROLLERS = ("memory", "cpu", "cpuacct", "pids", "freezer")
V2_CONTROLLERS = ("memory", "cpu", "pids")
MODES = ("auto", "require", "off")
TCP_LIMIT = "memory.kmem.tcp.limit_in_bytes"  # v1 socket accounting (`render_v1`)
RUN_WEIGHT = 100  # v2 cpu.weight of a run (v1 cpu.shares 1024): equal per run
IDLE_WEIGHT = 10  # a jail starting for the pool (ready, it waits at RUN_WEIGHT): ~ nice 10
REMOVE_WAIT_S = 5.0
# A session's jail is frozen between cells (`Group.freeze`): the file that asks for it, what it
# is written, and what the kernel says once every task is frozen, per cgroup version.
FREEZE_FILE = {1: ("freezer", "freezer.state"), 2: ("", "cgroup.freeze")}
FREEZE_STATE = {1: ("freezer", "freezer.state"), 2: ("", "cgroup.events")}
FREEZE_VALUE = {1: ("FROZEN", "THAWED"), 2: ("1", "0")}
_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY
# What a run's path reads and writes (handout weight, cell-start and cell-end counters, peak
# reset): Group.prime keeps these open. (controller, file, open flags) per cgroup version.
PATH_FILES: dict[int, tuple[tuple[str, str, int], ...]] = {
    1: (
        ("cpu", "cpu.shares", os.O_WRONLY),
        ("cpuacct", "cpuacct.usage", os.O_RDONLY),
        ("memory", "memory.oom_control", os.O_RDONLY),
        ("memory", "memory.max_usage_in_bytes", os.O_RDONLY),
        ("memory", "memory.max_usage_in_bytes", os.O_WRONLY),
        ("memory", "memory.stat", os.O_RDONLY),  # shmem, as a cell ends (`shmem_bytes`)
        ("freezer", "freezer.state", os.O_WRONLY),  # asked and confirmed after a session's cell
        ("freezer", "freezer.state", os.O_RDONLY),
        ("pids", ".", _DIRECTORY),  # files opened anew (cgroup.procs as a cell ends) from here
    ),
    2: (
        ("", "cpu.weight", os.O_WRONLY),
        ("", "cpu.stat", os.O_RDONLY),
        ("", "memory.events", os.O_RDONLY),
        ("", "memory.peak", os.O_RDONLY),
        ("", "memory.stat", os.O_RDONLY),
        ("", "memory.swap.current", os.O_RDONLY),
        ("", "cgroup.freeze", os.O_WRONLY),
        ("", "cgroup.events", os.O_RDONLY),
        ("", ".", _DIRECTORY),
    ),
}
MEMBERS = {1: "pids", 2: ""}
# A jail group's sub-group for the commands started in it from outside (`Group.command_group`).
# The in-jail driver knows the name too (appliance/inside/driver.py::COMMANDS_GROUP).
COMMANDS = "commands"
COMMAND_PREFIX = "c"  # one command's group in it: c<number> (`Group.command_group`)
KILL_PASSES = 64  # passes over a command's group until one finds no process left unkilled
READ_BYTES = 65536  # one read of a group file  # the controller whose cgroup.procs `Group.members` reads


@dataclass(frozen=True)
class GroupLimits:
    """What one group may use: memory (incl. tmpfs and page cache), CPUs, processes, CPU weight."""

    memory_mb: int
    cpus: float
    max_procs: int
    weight: int = RUN_WEIGHT

    def idle(self) -> GroupLimits:
        """The same limits at idle weight: a jail starting for the pool must not take CPU from running work."""
        return replace(self, weight=IDLE_WEIGHT)


@dataclass(frozen=True)
class Write:
    """One file write into a group: controller (v1 directory; "" on v2), file name, value."""

    controller: str
    file: str
    value: str


def _quota_us(cpus: float) -> int:
    return max(1000, round(cpus * CPU_PERIOD_US))


def _shares(weight: int) -> int:
    return max(2, weight * 1024 // RUN_WEIGHT)


def render_v1(limits: GroupLimits, memsw: bool, lowering: bool, tcpmem: bool = False) -> tuple[Write, ...]:
    """The writes that give a v1 group `limits`; memsw: swap accounting exists (swap then off);
    tcpmem: the kernel has v1 socket accounting (memory.kmem.tcp.*).

    v1 refuses memory.memsw.limit_in_bytes below memory.limit_in_bytes, so when the memory limit
    goes down (`lowering`) memory goes first, and when it goes up memsw goes first.

    v1 charges no socket buffer to memory.limit_in_bytes: queued TCP and UDP data is host memory
    no limit of the run's sees (hundreds of loopback pairs queue gigabytes). Writing
    memory.kmem.tcp.limit_in_bytes turns on the group's socket accounting: every socket its
    processes make from then on (TCP and UDP alike) charges a separate counter, capped here at
    the run's memory limit; past it a send blocks or fails (EAGAIN/ENOBUFS) and datagrams are
    dropped. It is written before any process joins, so no socket of the run escapes it. v2
    charges socket memory to memory.max itself."""
    mem = str(limits.memory_mb * 1024 * 1024)
    memory = [Write("memory", "memory.limit_in_bytes", mem)]
    if memsw:
        swap = [Write("memory", "memory.memsw.limit_in_bytes", mem)]
        memory = memory + swap if lowering else swap + memory
    if tcpmem:
        memory.append(Write("memory", TCP_LIMIT, mem))
    return (
        Write("memory", "memory.swappiness", "0"),
        *memory,
        Write("cpu", "cpu.cfs_period_us", str(CPU_PERIOD_US)),
        Write("cpu", "cpu.cfs_quota_us", str(_quota_us(limits.cpus))),
        Write("cpu", "cpu.shares", str(_shares(limits.weight))),  # equal per run, whatever its processes
        Write("pids", "pids.max", str(limits.max_procs)),
    )


def render_v2(limits: GroupLimits) -> tuple[Write, ...]:
    """The writes that give a v2 group `limits` (memory.max counts tmpfs and page cache)."""
    return (
        Write("", "memory.max", str(limits.memory_mb * 1024 * 1024)),
        Write("", "memory.swap.max", "0"),
        Write("", "memory.oom.group", "1"),  # an OOM kill takes the whole run, not one child
        Write("", "cpu.max", f"{_quota_us(limits.cpus)} {CPU_PERIOD_US}"),
        Write("", "cpu.weight", str(limits.weight)),
        Write("", "pids.max", str(limits.max_procs)),
    )


def render(
    version: int, limits: GroupLimits, memsw: bool, lowering: bool, tcpmem: bool = False
) -> tuple[Write, ...]:
    """render_v1 or render_v2 by version."""
    return render_v1(limits, memsw, lowering, tcpmem) if version == 1 else render_v2(limits)


def changes(
    version: int, old: GroupLimits, new: GroupLimits, memsw: bool, tcpmem: bool = False
) -> tuple[Write, ...]:
    """Only the writes that differ between `old` and `new`, in the order `new` needs: what a
    warm jail's handout costs (idle -> run limits differ in the CPU weight: one write)."""
    lowering = new.memory_mb < old.memory_mb
    before = set(render(version, old, memsw, lowering, tcpmem))
    return tuple(w for w in render(version, new, memsw, lowering, tcpmem) if w not in before)


@dataclass(frozen=True)
class Counters:
    """A group's counters at one moment: CPU time (ns), OOM kills, processes refused."""

    cpu_ns: int
    oom_kills: int
    pids_refused: int


def parse_keyed(text: str) -> dict[str, int]:
    """Parse a "key value" per line file (memory.events, cpu.stat, memory.oom_control)."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("-").isdigit():
            out[parts[0]] = int(parts[1])
    return out


def keyed_value(text: str, key: str) -> int | None:
    """`parse_keyed(text).get(key)` without parsing the other lines."""
    needle, value = key + " ", None
    at = text.find(needle)
    while at >= 0:
        end = text.find("\n", at)
        if at == 0 or text[at - 1] == "\n":  # a whole key at a line's start
            parts = text[at : end if end >= 0 else len(text)].split()
            if len(parts) == 2 and parts[1].lstrip("-").isdigit():
                value = int(parts[1])
        at = text.find(needle, end) if end >= 0 else -1
    return value


def counters_v1(read: Callable[[str, str], str]) -> Counters:
    """Counters from v1 files; read(controller, file) returns the file's text."""
    return Counters(
        cpu_ns=int(read("cpuacct", "cpuacct.usage")),
        oom_kills=parse_keyed(read("memory", "memory.oom_control")).get("oom_kill", 0),
        pids_refused=parse_keyed(read("pids", "pids.events")).get("max", 0),
    )


def counters_v2(read: Callable[[str, str], str]) -> Counters:
    """Counters from v2 files; read("", file) returns the file's text."""
    return Counters(
        cpu_ns=parse_keyed(read("", "cpu.stat")).get("usage_usec", 0) * 1000,
        oom_kills=parse_keyed(read("", "memory.events")).get("oom_kill", 0),
        pids_refused=parse_keyed(read("", "pids.events")).get("max", 0),
    )


def is_frozen(version: int, state: str) -> bool:
    """Whether a group's freezer state file (v1 freezer.state, v2 cgroup.events) says every task
    of it is frozen: v1 passes through FREEZING (some tasks not yet stopped) to FROZEN."""
    if version == 1:
        return state.strip() == "FROZEN"
    return parse_keyed(state).get("frozen") == 1


def owned_kb_of_stat(version: int, stat: str) -> int:
    """Anonymous + shmem (tmpfs, /dev/shm) memory of a group from its memory.stat, in KiB: what
    a run owns, leaving out file pages the kernel can drop (a mmapped model, libraries)."""
    k = parse_keyed(stat)
    if version == 1:
        total = k.get("total_rss", k.get("rss", 0)) + k.get("total_shmem", k.get("shmem", 0))
    else:
        total = k.get("anon", 0) + k.get("shmem", 0)
    return total // 1024


def shmem_of_stat(version: int, stat: str, swap: str | None) -> int | None:
    """Bytes of shmem (tmpfs, memfds, /dev/shm) a group holds, in memory or in swap, from its
    memory.stat (and v2's memory.swap.current), counted high: swapped anonymous pages too.
    None where the files cannot say (no swap accounting: a swapped page would go uncounted)."""
    # Two keys of forty lines, looked up where they stand: a cell's end reads this.
    if version == 1:
        shmem, swapped = keyed_value(stat, "total_shmem"), keyed_value(stat, "total_swap")
    else:
        shmem = keyed_value(stat, "shmem")
        swapped = int(swap) if swap is not None and swap.strip().isdigit() else None
    if shmem is None or swapped is None:
        return None
    return shmem + swapped


class Hierarchy:
    """A writable cgroup tree (v1 or v2); this server's runs get groups in its instance directory."""

    def __init__(
        self,
        version: int,
        dirs: Mapping[str, Path],
        memsw: bool = False,
        instance: str | None = None,
        tcpmem: bool = False,
    ) -> None:
        self.version = version
        self.base = dict(dirs)  # controller -> our base directory ("" -> base on v2)
        self.memsw = memsw
        self.tcpmem = tcpmem  # v1: socket buffers charged per group (`render_v1`)
        self.instance = instance or server_instance.name()
        self.dirs = {c: d / self.instance for c, d in self.base.items()}
        self.label = f"cgroup-v{version}"

    def socket_gap(self) -> str | None:
        """Why the runs' socket buffers are not bounded by their groups, or None when they are
        (v2 charges them to memory.max; v1 where memory.kmem.tcp.* exists, `render_v1`)."""
        if self.version == 1 and not self.tcpmem:
            return f"cgroup v1 without {TCP_LIMIT}: the runs' socket buffers are not bounded per run"
        return None

    def prepare(self) -> None:
        """Make this instance's directories (v2: and let its groups use the controllers)."""
        for d in self.dirs.values():
            d.mkdir(exist_ok=True)
        if self.version == 2:
            _enable_v2(self.dirs[""])

    def group(self, name: str, limits: GroupLimits) -> Group:
        """Make group `name` with `limits`; it is empty until a process joins (`procs_files`)."""
        paths = {c: d / name for c, d in self.dirs.items()}
        made: list[Path] = []
        g: Group | None = None
        try:
            for p in paths.values():
                p.mkdir()
                made.append(p)
            g = Group(self, name, paths, limits)
            for w in render(self.version, limits, self.memsw, lowering=True, tcpmem=self.tcpmem):
                g._write(w)
            g.prime()
        except BaseException:
            if g is not None:
                g._close_kept()
            for p in made:
                with contextlib.suppress(OSError):
                    p.rmdir()
            raise
        return g

    def purge_dead(self) -> list[str]:
        """Remove the instance directories of servers that are gone (killed with -9), their groups
        and whatever still runs in them; returns the instances removed. Live servers' are kept,
        and so are those of servers in other PID namespaces (`appliance.sandbox.instance`)."""
        dead: set[str] = set()
        for d in self.base.values():
            with contextlib.suppress(FileNotFoundError):
                for entry in d.iterdir():
                    owner = server_instance.parse(entry.name)
                    if owner is None or entry.name == self.instance or not entry.is_dir():
                        continue
                    if server_instance.gone(owner):  # never one of another PID namespace's
                        dead.add(entry.name)
        for name in sorted(dead):
            _remove_instance({c: d / name for c, d in self.base.items()})
        return sorted(dead)

    def close(self) -> None:
        """At shutdown: remove this instance's groups (and anything left in them) and its directories."""
        _remove_instance(self.dirs)


def _remove_instance(dirs: Mapping[str, Path]) -> None:
    names: set[str] = set()
    for d in dirs.values():
        with contextlib.suppress(FileNotFoundError):
            names |= {p.name for p in d.iterdir() if p.is_dir()}
    for n in names:
        remove_paths({c: d / n for c, d in dirs.items()})
    for d in dirs.values():
        with contextlib.suppress(OSError):
            d.rmdir()


def remove_paths(paths: Mapping[str, Path]) -> None:
    """Kill every process in these group directories, then remove them (waits for the kernel to
    let go of the dead: a directory with a dying task in it cannot be removed yet). A group's
    sub-groups (a jail's COMMANDS group) go first, the same way: a directory with one in it
    cannot be removed.

    A frozen group (a session's between cells, or a dead server's) is thawed once its tasks
    are sent SIGKILL, never before: a v1 frozen task takes the signal only as it thaws, and
    then dies before it runs another instruction of its own."""
    _remove_subgroups(paths)
    deadline = time.monotonic() + REMOVE_WAIT_S
    left = dict(paths)
    while left:
        for c, p in list(left.items()):
            try:
                pids = (p / "cgroup.procs").read_text().split()
            except FileNotFoundError:
                del left[c]
                continue
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    signals.kill(int(pid))
            if c in ("freezer", ""):
                _thaw_path(p, 1 if c else 2)
            try:
                p.rmdir()
                del left[c]
            except FileNotFoundError:
                del left[c]
            except OSError:
                if time.monotonic() > deadline:
                    raise
        if left:  # the killed are still leaving (PID-namespace teardown): a short wait
            time.sleep(0.001)


def _remove_subgroups(paths: Mapping[str, Path]) -> None:
    subs: dict[str, set[str]] = {}
    for c, p in paths.items():
        with contextlib.suppress(OSError):
            subs[c] = {e.name for e in os.scandir(p) if e.is_dir(follow_symlinks=False)}
    for name in sorted(set().union(*subs.values()) if subs else set()):
        remove_paths({c: p / name for c, p in paths.items() if name in subs.get(c, ())})


def _thaw_path(path: Path, version: int) -> None:
    controller_file = FREEZE_FILE[version][1]
    with contextlib.suppress(OSError):  # none there (an older v1 tree), or the group is gone
        (path / controller_file).write_text(FREEZE_VALUE[version][1])


class Group:
    """One run's group: limits, joining, counters, removal."""

    def __init__(self, tree: Hierarchy, name: str, paths: Mapping[str, Path], limits: GroupLimits) -> None:
        self.tree = tree
        self.name = name
        self.paths = dict(paths)
        self.limits = limits
        self._kept: dict[tuple[str, str, int], int] = {}
        self._joined: dict[tuple[str, str], str] = {}  # (controller, file) -> its path
        self._removed = False
        self.frozen = False  # asked to freeze and not thawed since (`freeze`, `thaw`)

    # Raw descriptors, not open(): these run on a run's path (handout, cell start and end).
    # The files a run's path reads or writes are opened once, when the group is made (off the
    # path: a pool refill), and kept: a cgroup file read again at offset 0 is generated anew,
    # so one pread/pwrite does what open+write/read+close did.
    def prime(self) -> None:
        """Open and keep the descriptors of the files a run's path uses (PATH_FILES)."""
        for controller, file, flags in PATH_FILES[self.tree.version]:
            key = (controller, file, flags)
            if key not in self._kept:
                with contextlib.suppress(FileNotFoundError):  # e.g. memory.peak before 5.19
                    self._kept[key] = os.open(self._path(controller, file), flags | os.O_CLOEXEC)

    def _path(self, controller: str, file: str) -> str:
        """A file of the group, its path joined once: a file opened anew on a run's path
        (cgroup.procs, as a cell ends) does not pay for a pathlib join each time."""
        key = (controller, file)
        path = self._joined.get(key)
        if path is None:
            path = self._joined[key] = os.fspath(self.paths[controller] / file)
        return path

    def _open(self, controller: str, file: str, flags: int) -> int:
        """Open a file of the group anew: from the controller's kept directory where there is
        one (one name to look up, not the whole path down the hierarchy), else by its path."""
        directory = self._kept.get((controller, ".", _DIRECTORY))
        if directory is not None:
            return os.open(file, flags | os.O_CLOEXEC, dir_fd=directory)
        return os.open(self._path(controller, file), flags | os.O_CLOEXEC)

    def _write(self, w: Write) -> None:
        fd = self._kept.get((w.controller, w.file, os.O_WRONLY))
        if fd is not None:
            os.pwrite(fd, w.value.encode(), 0)
            return
        fd = self._open(w.controller, w.file, os.O_WRONLY)
        try:
            os.write(fd, w.value.encode())
        finally:
            os.close(fd)

    def _read(self, controller: str, file: str) -> str:
        fd = self._kept.get((controller, file, os.O_RDONLY))
        if fd is not None:
            return os.pread(fd, READ_BYTES, 0).decode()
        fd = self._open(controller, file, os.O_RDONLY)
        try:
            return os.read(fd, READ_BYTES).decode()
        finally:
            os.close(fd)

    def _close_kept(self) -> None:
        for fd in self._kept.values():
            os.close(fd)
        self._kept = {}

    def set_limits(self, limits: GroupLimits) -> None:
        """Move to `limits` writing only what changes (a warm jail handed out: one write)."""
        for w in changes(self.tree.version, self.limits, limits, self.tree.memsw, self.tree.tcpmem):
            self._write(w)
        self.limits = limits

    def freeze(self) -> None:
        """Ask the kernel to freeze every task of the group, those it forks meanwhile included;
        `is_frozen` says when all are. Until `thaw` nothing of the group runs, and a signal to
        one of its tasks (SIGKILL too, on v1) takes effect only then."""
        controller, file = FREEZE_FILE[self.tree.version]
        self.frozen = True  # from the request on: whoever ends the group must thaw it
        self._write(Write(controller, file, FREEZE_VALUE[self.tree.version][0]))

    def is_frozen(self) -> bool:
        """Whether every task of the group is frozen now (one read)."""
        return is_frozen(self.tree.version, self._read(*FREEZE_STATE[self.tree.version]))

    def thaw(self) -> None:
        """Let the group's tasks run again (OSError if the kernel refused)."""
        controller, file = FREEZE_FILE[self.tree.version]
        self._write(Write(controller, file, FREEZE_VALUE[self.tree.version][1]))
        self.frozen = False

    def procs_files(self) -> list[Path]:
        """The cgroup.procs of each controller: a process writing "0" into all of them has
        joined the group (`firejail.join_argv`)."""
        return [p / "cgroup.procs" for p in self.paths.values()]

    def command_group(self, number: int) -> CommandGroup:
        """A group of one command's own, in the group's COMMANDS sub-group, made now (OSError if
        it cannot be): where a command started in the jail from outside runs, with all it
        forks (appliance.sandbox.jailexec). A sub-group's processes count against every limit
        of the jail's group (v1 with use_hierarchy, v2 always), freeze with it and die with
        it; they are not in the group's own cgroup.procs, which tells them from a cell's
        leftovers (`members`); and one command's group tells its processes from another's,
        so that a kill ends the whole of that command and nothing else (`CommandGroup.kill`)."""
        paths = {c: p / COMMANDS / f"{COMMAND_PREFIX}{number}" for c, p in self.paths.items()}
        for p in paths.values():
            with contextlib.suppress(FileExistsError):
                p.parent.mkdir()
            p.mkdir()
        return CommandGroup(self.tree.version, paths)

    def commands_members(self) -> list[int]:
        """The processes of the COMMANDS sub-group and of every command's group in it (none
        when it was never made)."""
        top = self.paths[MEMBERS[self.tree.version]] / COMMANDS
        out: list[int] = []
        try:
            groups = [top, *(Path(e.path) for e in os.scandir(top) if e.is_dir(follow_symlinks=False))]
        except FileNotFoundError:
            return []
        for g in groups:
            with contextlib.suppress(FileNotFoundError):  # a command's group removed meanwhile
                out += [int(x) for x in (g / "cgroup.procs").read_text().split()]
        return out

    def counters(self, pids: bool = True) -> Counters:
        """CPU time, OOM kills and (unless pids=False: a cell needs only the first two) refused forks."""
        read = self._read if pids else self._read_no_pids
        return counters_v1(read) if self.tree.version == 1 else counters_v2(read)

    def _read_no_pids(self, controller: str, file: str) -> str:
        return "" if file == "pids.events" else self._read(controller, file)

    def oom_kills(self) -> int:
        """OOM kills in the group so far (one file read: the watchdog polls it)."""
        if self.tree.version == 1:
            return parse_keyed(self._read("memory", "memory.oom_control")).get("oom_kill", 0)
        return parse_keyed(self._read("", "memory.events")).get("oom_kill", 0)

    def reset_peak(self) -> None:
        """Start a new peak-memory reading (v1: memory.max_usage_in_bytes; v2 keeps memory.peak
        over the group's life, which a reset would need the reading's own fd for)."""
        if self.tree.version == 1:
            self._write(Write("memory", "memory.max_usage_in_bytes", "0"))

    def peak_mb(self) -> float:
        """Peak memory of the group (every process, tmpfs, page cache) since reset_peak, in MiB."""
        raw = (
            self._read("memory", "memory.max_usage_in_bytes")
            if self.tree.version == 1
            else self._read("", "memory.peak")
        ).strip()
        return round(int(raw) / (1024 * 1024), 1) if raw.isdigit() else 0.0

    def owned_mb(self) -> int:
        """Anonymous + shmem memory of the group, in MiB (what the GPU watchdog caps)."""
        key = "memory" if self.tree.version == 1 else ""
        return owned_kb_of_stat(self.tree.version, self._read(key, "memory.stat")) // 1024

    def shmem_bytes(self) -> int | None:
        """Shmem the group's processes made (`shmem_of_stat`): at least every byte of every
        memfd they hold, however it is held (kept descriptors: pread each time)."""
        if self.tree.version == 1:
            return shmem_of_stat(1, self._read("memory", "memory.stat"), None)
        try:
            swap: str | None = self._read("", "memory.swap.current")
        except FileNotFoundError:  # no swap controller: a swapped page would go uncounted
            swap = None
        return shmem_of_stat(2, self._read("", "memory.stat"), swap)

    def members(self) -> list[int] | None:
        """The group's processes from one read of its cgroup.procs (a cell's end asks), or None
        where the list did not fit that read. Opened anew each time: v1 keeps the list an open
        file first read, so a kept descriptor would not see processes come and go."""
        raw = self._read(MEMBERS[self.tree.version], "cgroup.procs")
        if len(raw) >= READ_BYTES:
            return None
        return [int(x) for x in raw.split()]

    def pids(self) -> list[int]:
        """Every process in the group."""
        out: set[int] = set()
        for procs in self.procs_files():
            with contextlib.suppress(FileNotFoundError):
                out |= {int(x) for x in procs.read_text().split()}
        return sorted(out)

    def remove(self) -> None:
        """Kill what is left in the group and remove its directories (blocking: a thread)."""
        self._close_kept()  # an open file of a group keeps nothing of it alive, but is ours
        if not self._removed:
            remove_paths(self.paths)
            self._removed = True


@dataclass(frozen=True)
class CommandGroup:
    """One command's group, below its jail's (`Group.command_group`): the command's launcher
    joins it before anything of the command runs, so it holds the command and all it forks."""

    version: int
    paths: Mapping[str, Path]

    def procs_files(self) -> list[Path]:
        return [p / "cgroup.procs" for p in self.paths.values()]

    def members(self) -> list[int]:
        try:
            raw = (self.paths[MEMBERS[self.version]] / "cgroup.procs").read_text()
        except FileNotFoundError:
            return []
        return [int(x) for x in raw.split()]

    def kill(self) -> list[int]:
        """SIGKILL every process of the group; the pids sent it. Pass after pass, until a pass
        finds none not sent it yet: a process with a SIGKILL pending forks no more, so what a
        pass misses is only what one not yet killed forked meanwhile (v1 has no cgroup.kill)."""
        killed: set[int] = set()
        for _ in range(KILL_PASSES):
            fresh = [pid for pid in self.members() if pid not in killed]
            if not fresh:
                break
            for pid in fresh:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    signals.kill(pid)
                killed.add(pid)
        return sorted(killed)

    def held(self) -> bool:
        """Whether the group's tasks are held by a freezer (its own or an ancestor's: the jail's,
        a session's between cells): on v1 a held task takes a SIGKILL only once thawed."""
        controller, file = FREEZE_STATE[self.version]
        try:
            state = (self.paths[controller] / file).read_text()
        except (FileNotFoundError, KeyError):
            return False
        if self.version == 1:
            return state.strip() != FREEZE_VALUE[1][1]
        return parse_keyed(state).get("frozen") == 1

    def release(self) -> bool:
        """Remove the group once the command has ended, if nothing of it is left there (a
        daemon it left keeps it: the jail tries again later, `Jail.lingering`, and its group's
        removal takes it at the end); whether it is gone. Blocking:
        a process killed a moment ago may still be leaving (a short wait, as `remove_paths`)."""
        deadline = time.monotonic() + REMOVE_WAIT_S
        left = list(self.paths.values())
        while left:
            if self.members():
                return False
            try:
                left[-1].rmdir()
            except FileNotFoundError:
                pass
            except OSError:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.001)
                continue
            left.pop()
        return True


def _own_path(controller: str, text: str) -> str:
    """The server's own cgroup path for a v1 controller ("" -> the v2 line) from /proc/self/cgroup."""
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and (controller in parts[1].split(",") if controller else parts[1] == ""):
            return parts[2].lstrip("/")
    return ""


def _enable_v2(d: Path) -> None:
    (d / "cgroup.subtree_control").write_text(" ".join("+" + c for c in V2_CONTROLLERS))


def _writable_base(d: Path) -> str | None:
    """Make our base directory under d; None when done, else why not."""
    try:
        (d / BASE).mkdir(exist_ok=True)
        probe = d / BASE / f".probe-{os.getpid()}"
        probe.mkdir(exist_ok=True)
        probe.rmdir()
    except OSError as e:
        return f"{d}: {e.strerror or e}"
    return None


def _detect_v2(root: Path, own: str) -> tuple[Hierarchy | None, list[str]]:
    top = root / own
    have = set((top / "cgroup.controllers").read_text().split())
    lacking = [c for c in V2_CONTROLLERS if c not in have]
    if lacking:
        return None, [f"cgroup v2 controllers not delegated to {top}: {', '.join(lacking)}"]
    try:
        # v2 lets no cgroup both hold processes and hand controllers to children: the server's
        # own processes move to a leaf (as a container's init or a Delegate=yes unit needs).
        procs = (top / "cgroup.procs").read_text().split()
        if procs:
            leaf = top / "server"
            leaf.mkdir(exist_ok=True)
            for pid in procs:
                with contextlib.suppress(ProcessLookupError):
                    (leaf / "cgroup.procs").write_text(pid)
        _enable_v2(top)
    except OSError as e:
        return None, [f"{top}: cannot delegate controllers to the runs' groups: {e.strerror or e}"]
    why = _writable_base(top)
    if why:
        return None, [why]
    try:
        _enable_v2(top / BASE)
    except OSError as e:
        return None, [f"{top / BASE}/cgroup.subtree_control: {e.strerror or e}"]
    return Hierarchy(2, {"": top / BASE}), []


def detect(root: Path = CGROUP_ROOT, self_cgroup: str | None = None) -> tuple[Hierarchy | None, list[str]]:
    """Find a writable hierarchy under root, nested in the server's own cgroups: v2 when root is
    cgroup2, else the v1 controllers. Returns (hierarchy or None, what is missing)."""
    if self_cgroup is None:
        try:
            self_cgroup = Path("/proc/self/cgroup").read_text()
        except OSError:
            self_cgroup = ""
    if (root / "cgroup.controllers").is_file():
        return _detect_v2(root, _own_path("", self_cgroup))
    missing: list[str] = []
    dirs: dict[str, Path] = {}
    for c in V1_CONTROLLERS:
        mount = root / c
        if not (mount / "cgroup.procs").is_file():
            missing.append(f"cgroup v1 controller {c} not mounted at {mount}")
            continue
        d = mount / _own_path(c, self_cgroup)
        if not d.is_dir():  # our own group is not visible here (another cgroup namespace): the mount's root
            d = mount
        why = _writable_base(d)
        if why:
            missing.append(why)
        else:
            dirs[c] = d / BASE
    if missing:
        return None, missing
    memsw = (dirs["memory"].parent / "memory.memsw.limit_in_bytes").exists()
    # A kernel without it (v1 socket accounting is deprecated upstream) still gets groups; the
    # server warns at startup that socket buffers are not bounded per run (`socket_gap`).
    tcpmem = (dirs["memory"].parent / TCP_LIMIT).exists()
    return Hierarchy(1, dirs, memsw=memsw, tcpmem=tcpmem), []


def open_hierarchy(mode: str, root: Path = CGROUP_ROOT) -> tuple[Hierarchy | None, list[str]]:
    """The hierarchy for SANDBOX_CGROUPS=mode and what is missing when there is none.

    off: None. auto: None when nothing is writable (rlimits stay). require: StartupError naming
    what is missing. A found hierarchy gets this server's instance directory, and dead servers'
    leftovers are purged."""
    if mode == "off":
        return None, ["SANDBOX_CGROUPS=off"]
    tree, missing = detect(root)
    if tree is not None:
        try:
            tree.prepare()
        except OSError as e:
            missing = [f"{', '.join(map(str, tree.dirs.values()))}: {e.strerror or e}"]
            tree = None
    if tree is None:
        if mode == "require":
            raise StartupError(
                "SANDBOX_CGROUPS=require but no cgroup hierarchy can be used: " + "; ".join(missing)
            )
        return None, missing
    tree.purge_dead()
    return tree, []
