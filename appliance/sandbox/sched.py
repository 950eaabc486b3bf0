"""The server's place in the CPU scheduler: a short EEVDF slice, asked for once at startup.

Every run wakes the server several times (the client's frame, the driver's output, its
`done`), and each time what it does next is on the run's critical path. Linux's EEVDF
scheduler (6.12 on) lets a task ask for a shorter slice than the default (a base scaled by
the CPU count): its virtual deadline comes sooner, so a woken
server is picked before tasks with the default slice that are waiting or running, instead of
after them. Its share of the CPU (its weight, its nice value) does not change, so it takes
nothing from other work over time; it only waits less: the warm round trip it saves is in
`benchmarks/results/floor.md` (the server's scheduler slice).

The processes the server starts from then on inherit the slice (it passes to children like
the nice value), jails included. That grants jailed code nothing: a process may ask for any
slice for itself with sched_setattr(2), no privilege needed, and the slice does not change
its weight. Kernels before 6.12 accept the request and keep no custom slice: the read-back
says so, and the server runs as it did.
"""

from __future__ import annotations

import ctypes
import os
import struct

from appliance.sandbox import syscalls

SLICE_NS = 100_000  # the shortest the kernel grants (it clamps to 0.1-100 ms)

# struct sched_attr, first version (48 bytes): size, policy, flags, nice, priority, runtime,
# deadline, period. For SCHED_OTHER the kernel reads the slice from runtime and the nice value
# from nice, so the nice value in effect is passed back in, not reset to 0.
_ATTR = struct.Struct("=IIQiIQQQ")
_SET, _GET = syscalls.number("sched_setattr"), syscalls.number("sched_getattr")


def attr(nice: int, slice_ns: int) -> bytes:
    """A sched_attr asking for SCHED_OTHER at `nice` with a slice of `slice_ns`."""
    return _ATTR.pack(_ATTR.size, os.SCHED_OTHER, 0, nice, 0, slice_ns, 0, 0)


def slice_of(raw: bytes) -> int:
    """The slice (sched_runtime) of a sched_attr the kernel filled in."""
    return int(_ATTR.unpack_from(raw)[5])


def current_slice(pid: int = 0) -> int | None:
    """The slice the kernel reports for pid (0: this thread), in ns; None where it cannot say
    (an unknown architecture, or the call failed). A kernel before 6.12 reports 0."""
    if _GET is None:
        return None
    buf = ctypes.create_string_buffer(_ATTR.size)
    if syscalls.syscall(_GET, pid, ctypes.addressof(buf), _ATTR.size, 0) != 0:
        return None
    return slice_of(buf.raw)


def request_slice(slice_ns: int = SLICE_NS) -> str | None:
    """Ask for `slice_ns` as this thread's slice; threads and processes it starts from now on
    inherit it. Only from the normal policy (one an operator chose, batch or real-time, is
    left as it is) and with the nice value kept. None once the kernel reports that slice in
    effect, else why not: a hint to the scheduler, so nothing depends on it."""
    if _SET is None:
        return f"no sched_setattr number known for {os.uname().machine}"
    policy = os.sched_getscheduler(0)
    if policy != os.SCHED_OTHER:
        return f"the server runs under scheduling policy {policy}, left as it is"
    nice = os.getpriority(os.PRIO_PROCESS, 0)  # this thread's, as sched_setattr(0) sets
    buf = ctypes.create_string_buffer(attr(nice, slice_ns), _ATTR.size)
    if syscalls.syscall(_SET, 0, ctypes.addressof(buf), 0) != 0:
        return f"sched_setattr: {os.strerror(ctypes.get_errno())}"
    granted = current_slice()
    if granted != slice_ns:
        return f"the kernel keeps no custom slice for this policy (it reports {granted})"
    return None
