"""The one place the server signals a process (tests/test_signals.py keeps it so).

Every kill of a jail's process, a cgroup's member, a dead server's jail, and every "is it
still there" goes through here, so what may be signalled is decided once: a PID that names
no single process (0: our own process group; negative: a group, or every process we may
signal) is refused before the kernel sees it, since a count read from /proc or a cgroup file
that came out 0 or -1 would otherwise kill the server itself. The callers keep their own
policy (what to kill, what a vanished process means): these raise what the kernel says.

Signalling by pidfd (`kill_by_pidfd`) is preferred where the caller holds one: it cannot
reach another process that reused the PID. A child the server started through asyncio is
signalled by `kill_child`, never by its own `send_signal`/`kill`: those poll it first
(waitpid, WNOHANG), which races asyncio's waiter thread, and when the poll wins the waiter
finds no child and reports an exit status of 255 for it (a killed command's end told as
"exit 255, no signal"). A `subprocess.Popen` the server waits for itself is signalled
through its own object. The code inside a jail (appliance.inside) signals within its own PID
namespace and cannot import this module.
"""

from __future__ import annotations

import os
import signal
from typing import Protocol


class Child(Protocol):
    """A child process the server started (an `asyncio.subprocess.Process`)."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...


def kill(pid: int, sig: signal.Signals = signal.SIGKILL) -> None:
    """Send sig (SIGKILL unless told) to the one process pid. ProcessLookupError if it is
    gone, PermissionError if it is not ours to signal; ValueError for a PID that names no
    single process."""
    os.kill(_one(pid), sig)


def kill_by_pidfd(fd: int, sig: signal.Signals = signal.SIGKILL) -> None:
    """Send sig (SIGKILL unless told) to the process a pidfd holds. ProcessLookupError if it
    has exited."""
    signal.pidfd_send_signal(fd, sig)


def child_pidfd(pid: int) -> int | None:
    """A pidfd of the server's child pid, opened as it is spawned (so before anything reaps
    it); None when it has exited and been reaped already."""
    try:
        return os.pidfd_open(_one(pid))
    except ProcessLookupError:
        return None


def kill_child(child: Child, sig: signal.Signals = signal.SIGKILL) -> None:
    """Send sig (SIGKILL unless told) to a child started through asyncio that has not been
    reaped, without reaping it (the module's docstring says why); nothing once it has."""
    if child.returncode is not None:
        return
    fd = child_pidfd(child.pid)
    if fd is None:
        return
    try:
        signal.pidfd_send_signal(fd, sig)
    except ProcessLookupError:
        pass
    finally:
        os.close(fd)


def exists(pid: int) -> bool | None:
    """Whether a process pid exists: True, False, or None when it exists but is not ours to
    signal (so nothing more is known of it). Sends no signal (signal 0 only checks)."""
    try:
        os.kill(_one(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return None
    return True


def _one(pid: int) -> int:
    if isinstance(pid, bool) or pid <= 0:
        raise ValueError(f"not the PID of one process: {pid}")
    return pid
