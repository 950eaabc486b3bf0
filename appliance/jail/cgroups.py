"""Per-run cgroups: a run's limits rendered as file writes (pure), and thin I/O that applies them.

One group per jail, for v1 (one directory per controller: memory, cpu, cpuacct, pids) or v2 (one
directory in a delegated subtree). `render_v1` / `render_v2` turn `Limits` into ordered writes and
hold all the policy; `Hierarchy` only makes directories, writes files, reads counters and removes.

A process joins its group before it executes anything: `Group.preexec` writes "0" (the writer
itself) into fds of cgroup.procs opened beforehand, in the forked child, before exec. So the
jail's first process (firejail) and everything it forks are counted from their first instruction;
no window exists in which a child could fork outside the group, which moving a pid in after
spawn would leave open.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from appliance.errors import StartupError

CGROUP_ROOT = Path("/sys/fs/cgroup")
BASE = "appliance"              # our subtree under each controller (v1) or the delegated root (v2)
CPU_PERIOD_US = 100_000
V1_CONTROLLERS = ("memory", "cpu", "cpuacct", "pids")
V2_CONTROLLERS = ("memory", "cpu", "pids")
MODES = ("auto", "require", "off")


@dataclass(frozen=True)
class Limits:
    """What one group may use: memory (incl. tmpfs and page cache), CPUs, processes."""

    memory_mb: int
    cpus: float
    max_procs: int


@dataclass(frozen=True)
class Write:
    """One file write into a group: controller (v1 directory; "" on v2), file name, value."""

    controller: str
    file: str
    value: str


def _quota_us(cpus: float) -> int:
    return max(1000, int(round(cpus * CPU_PERIOD_US)))


def render_v1(limits: Limits, memsw: bool, lowering: bool) -> tuple[Write, ...]:
    """The writes that give a v1 group `limits`; memsw: swap accounting exists (swap then off).

    v1 refuses memory.memsw.limit_in_bytes below memory.limit_in_bytes, so when the memory limit
    goes down (`lowering`) memory goes first, and when it goes up memsw goes first."""
    mem = str(limits.memory_mb * 1024 * 1024)
    memory = [Write("memory", "memory.limit_in_bytes", mem)]
    if memsw:
        swap = [Write("memory", "memory.memsw.limit_in_bytes", mem)]
        memory = memory + swap if lowering else swap + memory
    return (
        Write("memory", "memory.swappiness", "0"),
        *memory,
        Write("cpu", "cpu.cfs_period_us", str(CPU_PERIOD_US)),
        Write("cpu", "cpu.cfs_quota_us", str(_quota_us(limits.cpus))),
        Write("cpu", "cpu.shares", "1024"),       # equal weight per run, whatever its process count
        Write("pids", "pids.max", str(limits.max_procs)),
    )


def render_v2(limits: Limits) -> tuple[Write, ...]:
    """The writes that give a v2 group `limits` (memory.max counts tmpfs and page cache)."""
    return (
        Write("", "memory.max", str(limits.memory_mb * 1024 * 1024)),
        Write("", "memory.swap.max", "0"),
        Write("", "memory.oom.group", "1"),       # an OOM kill takes the whole run, not one child
        Write("", "cpu.max", f"{_quota_us(limits.cpus)} {CPU_PERIOD_US}"),
        Write("", "cpu.weight", "100"),
        Write("", "pids.max", str(limits.max_procs)),
    )


@dataclass(frozen=True)
class Usage:
    """A group's counters: CPU time, peak memory, OOM kills, processes refused at pids.max."""

    cpu_ms: int
    max_rss_mb: int
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


def usage_v1(read: Callable[[str, str], str]) -> Usage:
    """Usage from v1 files; read(controller, file) returns the file's text."""
    oom = parse_keyed(read("memory", "memory.oom_control"))
    return Usage(
        cpu_ms=int(read("cpuacct", "cpuacct.usage")) // 1_000_000,
        max_rss_mb=int(read("memory", "memory.max_usage_in_bytes")) // (1024 * 1024),
        oom_kills=oom.get("oom_kill", 0),
        pids_refused=parse_keyed(read("pids", "pids.events")).get("max", 0),
    )


def usage_v2(read: Callable[[str, str], str]) -> Usage:
    """Usage from v2 files; read("", file) returns the file's text."""
    peak = read("", "memory.peak").strip()
    return Usage(
        cpu_ms=parse_keyed(read("", "cpu.stat")).get("usage_usec", 0) // 1000,
        max_rss_mb=int(peak) // (1024 * 1024) if peak.isdigit() else 0,
        oom_kills=parse_keyed(read("", "memory.events")).get("oom_kill", 0),
        pids_refused=parse_keyed(read("", "pids.events")).get("max", 0),
    )


class Hierarchy:
    """A writable cgroup tree (v1 or v2) under which the appliance makes its runs' groups."""

    def __init__(self, version: int, dirs: Mapping[str, Path], memsw: bool = False) -> None:
        self.version = version
        self.dirs = dict(dirs)          # controller -> our base directory ("" -> base on v2)
        self.memsw = memsw

    def group(self, name: str, limits: Limits) -> Group:
        """Make group `name` with `limits`; it is empty until a process joins via preexec."""
        paths = {c: d / name for c, d in self.dirs.items()}
        for p in paths.values():
            p.mkdir()
        g = Group(self, name, paths)
        try:
            g.set_limits(limits, lowering=True)
        except BaseException:
            g.remove()
            raise
        return g

    def purge(self) -> int:
        """Remove leftover groups (a server killed with -9 left them); returns how many."""
        names: set[str] = set()
        for d in self.dirs.values():
            names |= {p.name for p in d.iterdir() if p.is_dir()}
        for n in names:
            Group(self, n, {c: d / n for c, d in self.dirs.items() if (d / n).is_dir()}).remove()
        return len(names)


class Group:
    """One run's group: limits, joining, counters, removal."""

    def __init__(self, tree: Hierarchy, name: str, paths: Mapping[str, Path]) -> None:
        self.tree = tree
        self.name = name
        self.paths = dict(paths)
        self._fds: list[int] = []

    def _write(self, w: Write) -> None:
        (self.paths[w.controller] / w.file).write_text(w.value)

    def _read(self, controller: str, file: str) -> str:
        return (self.paths[controller] / file).read_text()

    def set_limits(self, limits: Limits, lowering: bool) -> None:
        """Apply `limits` (a warm jail's idle limits, then the run's when handed out)."""
        writes = (render_v1(limits, self.tree.memsw, lowering) if self.tree.version == 1
                  else render_v2(limits))
        for w in writes:
            self._write(w)

    def open_join(self) -> None:
        """Open cgroup.procs of every controller now, so preexec only has to write."""
        self.close_join()
        self._fds = [os.open(p / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC) for p in self.paths.values()]

    def preexec(self) -> None:
        """In the forked child before exec: join the group (writing 0 moves the writer)."""
        for fd in self._fds:
            os.write(fd, b"0")

    def close_join(self) -> None:
        """Close the fds open_join opened (in the parent, after spawn)."""
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    def usage(self) -> Usage:
        """The group's counters, for done.cpu_ms / done.max_rss_mb / the memory_limit status."""
        return usage_v1(self._read) if self.tree.version == 1 else usage_v2(self._read)

    def pids(self) -> list[int]:
        """Every process in the group."""
        out: set[int] = set()
        for p in self.paths.values():
            with contextlib.suppress(FileNotFoundError):
                out |= {int(x) for x in (p / "cgroup.procs").read_text().split()}
        return sorted(out)

    def remove(self) -> None:
        """Kill what is left in the group and remove its directories."""
        self.close_join()
        for _ in range(100):
            left = self.pids()
            if not left:
                break
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            os.sched_yield()
        for p in self.paths.values():
            with contextlib.suppress(FileNotFoundError):
                p.rmdir()


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


def detect(root: Path = CGROUP_ROOT) -> tuple[Hierarchy | None, list[str]]:
    """Find a writable hierarchy under root: v2 when root is cgroup2, else v1 controllers.

    Returns (hierarchy or None, what is missing)."""
    missing: list[str] = []
    if (root / "cgroup.controllers").is_file():
        have = set((root / "cgroup.controllers").read_text().split())
        lacking = [c for c in V2_CONTROLLERS if c not in have]
        if lacking:
            return None, [f"cgroup v2 controllers not delegated: {', '.join(lacking)}"]
        why = _writable_base(root)
        if why:
            return None, [why]
        base = root / BASE
        try:
            (base / "cgroup.subtree_control").write_text("+memory +cpu +pids")
        except OSError as e:
            return None, [f"{base}/cgroup.subtree_control: {e.strerror or e}"]
        return Hierarchy(2, {"": base}), []
    dirs: dict[str, Path] = {}
    for c in V1_CONTROLLERS:
        d = root / c
        if not (d / "cgroup.procs").is_file():
            missing.append(f"cgroup v1 controller {c} not mounted at {d}")
            continue
        why = _writable_base(d)
        if why:
            missing.append(why)
        else:
            dirs[c] = d / BASE
    if missing:
        return None, missing
    memsw = (dirs["memory"] / "memory.memsw.limit_in_bytes").exists()
    return Hierarchy(1, dirs, memsw=memsw), []


def open_hierarchy(mode: str, root: Path = CGROUP_ROOT) -> tuple[Hierarchy | None, str]:
    """The hierarchy for SANDBOX_CGROUPS=mode, and a line for /readyz saying who enforces limits.

    off: None. auto: None when nothing is writable (rlimits stay). require: StartupError naming
    what is missing. A found hierarchy is purged of leftovers first."""
    if mode == "off":
        return None, "cgroups off: memory and processes limited by rlimits only; no CPU limit"
    tree, missing = detect(root)
    if tree is None:
        if mode == "require":
            raise StartupError("SANDBOX_CGROUPS=require: " + "; ".join(missing))
        return None, "cgroups unavailable (" + "; ".join(missing) + "): rlimits only"
    tree.purge()
    return tree, f"cgroup v{tree.version} enforces memory, cpu and pids per run"
