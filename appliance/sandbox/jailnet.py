"""A TCP connection to a port inside a jail's own network namespace (E2B's `get_host`).

A jail has a network namespace of its own (loopback only, or its egress link), so a server
started in it listens where the host cannot reach. The server makes the socket inside that
namespace instead: a short-lived thread enters the namespace (setns through the pidfd of the
jail's init: the namespace of that very process, never of one that reused its PID), makes
the socket, and ends (a thread's namespace is its own; the thread is never reused). The
socket keeps the namespace it was made in, so connecting it to 127.0.0.1:PORT reaches the
jail's loopback and nothing else: no route of the host's, no other jail's, and the jail's
network is opened to nothing (no veth, no forwarded port, no listening socket on the host).
"""

from __future__ import annotations

import ctypes
import socket
import threading

from appliance.sandbox import syscalls

CLONE_NEWNET = 0x40000000
LOOPBACK = "127.0.0.1"


class Unreachable(Exception):
    """No socket could be made in the jail's network namespace (gone, or not permitted)."""


def socket_in(pidfd: int) -> socket.socket:
    """A new, unconnected TCP socket in the network namespace of the process `pidfd` holds.
    Blocking for the life of one thread that makes one socket (microseconds)."""
    number = syscalls.number("setns")
    if number is None:
        raise Unreachable("entering a jail's network is not supported on this architecture")
    made: list[socket.socket] = []
    failed: list[str] = []

    def enter_and_make() -> None:
        if syscalls.syscall(number, pidfd, CLONE_NEWNET) != 0:
            failed.append(f"setns: errno {ctypes.get_errno()}")
            return
        try:
            made.append(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
        except OSError as exc:
            failed.append(str(exc))

    worker = threading.Thread(target=enter_and_make, name="jail-netns-socket", daemon=True)
    worker.start()
    worker.join()
    if not made:
        raise Unreachable(failed[0] if failed else "no socket was made")
    return made[0]
