"""Which server made a directory on shared ground, and whether that server is gone.

Every server keeps its run directories under SANDBOX_TMP_ROOT and its per-run cgroups under
its own cgroup, each in an instance directory of its own. Other appliance servers on the host
may share both: a second server, or servers in containers that mount the same temp root or
share the host's cgroup tree. A server removes what a server killed with -9 left behind (its
jails outlive it: firejail is setuid, no parent-death signal reaches it), so for every
instance directory it must tell a dead server from a live one.

A process ID cannot tell that across PID namespaces: a server in a container and one on the
host may have the same PID, and neither sees the other in /proc. So an instance is named by
the server's PID namespace, its PID there and its start time (PIDs are reused), and a server
judges only the instances of its own PID namespace: another namespace's it leaves alone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from appliance.sandbox import signals

PREFIX = "srv-"


@dataclass(frozen=True)
class Owner:
    """The server an instance directory's name says made it."""

    pid_ns: int | None  # its PID namespace (the inode of /proc/PID/ns/pid); None: an older name
    pid: int  # its PID in that namespace
    start: int | None  # its start time (clock ticks since boot); None: an older run-directory name


def pid_namespace() -> int:
    """This process's PID namespace, as the inode of /proc/self/ns/pid."""
    return os.stat("/proc/self/ns/pid").st_ino


def start_time(pid: int) -> int | None:
    """A process's start time (field 22 of /proc/PID/stat), or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def name_of(pid: int, start: int, pid_ns: int) -> str:
    """The instance directory's name for the server `pid` of namespace `pid_ns`, started at `start`."""
    return f"{PREFIX}{pid_ns}-{pid}-{start}"


def name(pid: int | None = None) -> str:
    """The instance directory's name for process `pid` of this PID namespace (default: this one)."""
    pid = os.getpid() if pid is None else pid
    return name_of(pid, start_time(pid) or 0, pid_namespace())


def parse(text: str) -> Owner | None:
    """The owner an instance directory's name gives, or None for a name that is not one. Names
    of older servers are understood too: `srv-PID-START` (cgroups), `srv-PID` (run directories)."""
    if not text.startswith(PREFIX):
        return None
    parts = text[len(PREFIX) :].split("-")
    if not parts or not all(p.isdigit() for p in parts):
        return None
    numbers = [int(p) for p in parts]
    if len(numbers) == 3:
        return Owner(numbers[0], numbers[1], numbers[2])
    if len(numbers) == 2:
        return Owner(None, numbers[0], numbers[1])
    if len(numbers) == 1:
        return Owner(None, numbers[0], None)
    return None


def gone(owner: Owner) -> bool:
    """Whether the server that made the instance is gone, as far as this server can tell. One
    in another PID namespace is never judged gone: this server cannot see it. An older name
    (no namespace in it) is judged as this namespace's, as servers that wrote it did."""
    if owner.pid_ns is not None and owner.pid_ns != pid_namespace():
        return False
    if owner.start is not None:
        return start_time(owner.pid) != owner.start
    try:
        return signals.exists(owner.pid) is False
    except ValueError:  # not a PID of one process: nothing this server can judge gone
        return False
