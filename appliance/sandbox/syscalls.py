"""Linux system calls the standard library does not wrap, called by number through libc's
syscall(2): kcmp (the held-file search), sched_setattr and sched_getattr (the server's slice),
setns (Python 3.12 has os.setns; the server runs on 3.11 too: sockets in a jail's network)."""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable

_NUMBERS = {
    "x86_64": {"kcmp": 312, "sched_setattr": 314, "sched_getattr": 315, "setns": 308},
    "aarch64": {"kcmp": 272, "sched_setattr": 274, "sched_getattr": 275, "setns": 268},
}.get(os.uname().machine, {})


def number(name: str) -> int | None:
    """The system call's number on this machine's architecture; None where it is not known."""
    return _NUMBERS.get(name)


MAX_ARGS = 6  # what syscall(2) passes on to the kernel after the number


def syscall(*args: int) -> int:
    """libc's syscall(2) with these arguments, the number first; its return value (-1 and
    ctypes.get_errno() on failure). Every argument is passed as a C long (the wrapper reads
    its variadic arguments so), the unused ones as 0, which the kernel does not read."""
    if not 1 <= len(args) <= MAX_ARGS + 1:
        raise TypeError(f"syscall takes a number and at most {MAX_ARGS} arguments")
    return int(_syscall()(*args, *(0,) * (MAX_ARGS + 1 - len(args))))


@functools.cache
def _syscall() -> Callable[..., int]:
    """syscall(2) with its arguments typed once: a call converts its ints in C, and does not
    make a ctypes object of each (the held-file search calls it as each cell ends)."""
    fn = ctypes.CDLL(None, use_errno=True).syscall
    fn.restype = ctypes.c_long
    fn.argtypes = [ctypes.c_long] * (MAX_ARGS + 1)
    return fn
