"""How much host memory a run owns: the reading the GPU watchdog caps at SANDBOX_MEMORY_MB.

GPU jails have no RLIMIT_AS (CUDA reserves huge virtual ranges), so the watchdog caps
this reading instead. It must count what the run owns, not what it maps: a GGUF model
mmapped by llama.cpp and the CUDA libraries are file-backed pages the kernel can drop,
and count in RSS (statm) but not here.

`RunMemory` is the seam: `ProcMemory` (today's, from /proc) sums, over every process of
the run, the proportional share of anonymous and shared-memory (shmem/tmpfs mapped)
pages from /proc/PID/smaps_rollup (Pss_Anon + Pss_Shmem: pages shared by a fork are
counted once across the run). `CgroupMemory`, used where per-run cgroups are enforcing,
reads the same two kinds of pages from the run's memory cgroup; it also sees tmpfs files
the run wrote but does not map, which /proc cannot.
"""

from __future__ import annotations

import abc
import os
from pathlib import Path, PurePosixPath

from appliance.sandbox.cgroups import Hierarchy, owned_kb_of_stat

PAGE_KB = os.sysconf("SC_PAGE_SIZE") // 1024
OWNED_FIELDS = ("Pss_Anon:", "Pss_Shmem:")


class RunMemory(abc.ABC):
    """The host memory a run owns, in MiB."""

    @abc.abstractmethod
    def owned_mb(self, root: int, pids: set[int]) -> int:
        """Memory owned by the run rooted at `root`, whose live processes are `pids`."""


class ProcMemory(RunMemory):
    """Anonymous + shmem memory from /proc/PID/smaps_rollup, summed over the run's processes."""

    def owned_mb(self, root: int, pids: set[int]) -> int:
        return sum(owned_kb(pid) for pid in pids) // 1024


def owned_kb(pid: int) -> int:
    """One process's proportional anonymous + shmem memory in KiB (0 if it is gone).

    Falls back to statm's resident - shared (anonymous pages only) on kernels without the
    Pss_Anon/Pss_Shmem fields (before 5.8).
    """
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            text = fh.read()
    except OSError:
        return 0
    found = [int(line.split()[1]) for line in text.splitlines() if line.startswith(OWNED_FIELDS)]
    if len(found) == len(OWNED_FIELDS):
        return sum(found)
    try:
        with open(f"/proc/{pid}/statm") as fh:
            fields = fh.read().split()
        return max(0, int(fields[1]) - int(fields[2])) * PAGE_KB
    except (OSError, ValueError, IndexError):
        return 0


class CgroupMemory(RunMemory):
    """The run's own memory cgroup (appliance.sandbox.cgroups): anonymous + shmem pages of every
    process of the run, and tmpfs files it wrote but does not map, which /proc cannot see. A
    process not in one of this server's groups is read from /proc instead."""

    def __init__(self, tree: Hierarchy) -> None:
        self.tree = tree
        self.controller = "memory" if tree.version == 1 else ""
        self._fallback = ProcMemory()

    def group_dir(self, pid: int) -> Path | None:
        """The directory of the group of ours that pid is in, or None."""
        try:
            with open(f"/proc/{pid}/cgroup") as fh:
                text = fh.read()
        except OSError:
            return None
        for line in text.splitlines():
            parts = line.split(":", 2)
            if len(parts) != 3 or (
                parts[1] != "" if self.controller == "" else "memory" not in parts[1].split(",")
            ):
                continue
            path = PurePosixPath(parts[2])
            if path.parent.name == self.tree.instance and path.name:
                return self.tree.dirs[self.controller] / path.name
        return None

    def owned_mb(self, root: int, pids: set[int]) -> int:
        group = self.group_dir(root)
        if group is None:
            return self._fallback.owned_mb(root, pids)
        try:
            stat = (group / "memory.stat").read_text()
        except OSError:
            return self._fallback.owned_mb(root, pids)
        return owned_kb_of_stat(self.tree.version, stat) // 1024
