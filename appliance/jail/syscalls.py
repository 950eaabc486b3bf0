"""Linux system calls the standard library does not wrap, called by number through libc's
syscall(2): kcmp (the held-file search), sched_setattr and sched_getattr (the server's slice)."""

from __future__ import annotations

import ctypes
import functools
import os

_NUMBERS = {
    "x86_64": {"kcmp": 312, "sched_setattr": 314, "sched_getattr": 315},
    "aarch64": {"kcmp": 272, "sched_setattr": 274, "sched_getattr": 275},
}.get(os.uname().machine, {})


def number(name: str) -> int | None:
    """The system call's number on this machine's architecture; None where it is not known."""
    return _NUMBERS.get(name)


def syscall(*args: int) -> int:
    """libc's syscall(2) with these arguments, the number first; its return value (-1 and
    ctypes.get_errno() on failure). Every argument is passed as a C long: the wrapper reads
    its variadic arguments so."""
    return int(_libc().syscall(*(ctypes.c_long(a) for a in args)))


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)
