"""Files a jail's processes keep alive without a name: unlinked-but-open files and memfds.

The disk watchdog walks the run directory and the jail's /tmp, which cannot see a file
that was unlinked while a descriptor or a mapping still holds it, nor a `memfd_create`
file: both still take disk or tmpfs memory until their last holder goes. This module
finds them through /proc (every descriptor table and the mappings of each of the jail's
processes, read by the root server; links there are the kernel's, not the code's) so the
quota can count them.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass

from appliance.sandbox import syscalls

DELETED = b" (deleted)\n"  # how maps ends the path of a file with no name left


@dataclass(frozen=True)
class Bound:
    """How much a search may look at before it gives up (`OverBound`): descriptors per table,
    threads and maps bytes per process. A search on the event loop must stay short whatever
    the run left."""

    fds: int
    threads: int
    maps_bytes: int


class OverBound(Exception):
    """A bounded search met more than its bound; nothing was decided."""


def _targets(pid: int, bound: Bound | None) -> Iterable[str]:
    for base in _descriptor_tables(pid, bound):
        try:
            names = os.listdir(base)
        except OSError:
            names = []
        if bound is not None and len(names) > bound.fds:
            raise OverBound(f"{base} holds {len(names)} descriptors")
        for name in names:
            yield f"{base}/{name}"
    yield from _unnamed_mappings(pid, bound)


def _descriptor_tables(pid: int, bound: Bound | None) -> list[str]:
    """The fd directories of every descriptor table in process pid: its own (/proc/PID/fd is
    its leader thread's), and that of each thread with a table of its own. A thread gets one
    with unshare(CLONE_FILES), or when cloned without CLONE_FILES; what it holds open is in
    no other table, so a search of the process's alone would miss it."""
    tables = [f"/proc/{pid}/fd"]
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except (OSError, ValueError):
        return tables
    if bound is not None and len(tids) > bound.threads:
        raise OverBound(f"process {pid} has {len(tids)} threads")
    tables += [f"/proc/{pid}/task/{tid}/fd" for tid in tids if tid != pid and not _same_table(pid, tid)]
    return tables


_KCMP = syscalls.number("kcmp")
KCMP_FILES = 2


def _same_table(pid: int, tid: int) -> bool:
    """Whether thread tid shares its descriptor table with pid's leader: kcmp(2), one syscall.
    Where it cannot tell (no kcmp here, a thread gone), the thread's own table is searched."""
    if _KCMP is None:
        return False
    return syscalls.syscall(_KCMP, pid, tid, KCMP_FILES, 0, 0) == 0


def _unnamed_mappings(pid: int, bound: Bound | None = None) -> Iterable[str]:
    """The map_files entries of the mappings whose file has no name left.

    A process maps hundreds of named files (its interpreter, every library, each several
    times), and a stat of each was most of what a disk check cost. /proc/PID/maps lists
    the same mappings in one read, and the kernel ends the path of a file whose last name
    is gone (unlinked, O_TMPFILE, memfd) with " (deleted)"; a newline in a name is escaped
    there, so a line cannot be forged. Only those are looked at: a file that still has a
    name is not held without one (st_nlink > 0), so nothing the quota counts is skipped."""
    try:
        fd = os.open(f"/proc/{pid}/maps", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return
    chunks: list[bytes] = []
    size = 0
    try:
        while chunk := os.read(fd, 1 << 18 if bound is None else bound.maps_bytes + 1):
            chunks.append(chunk)
            size += len(chunk)
            if bound is not None and size > bound.maps_bytes:
                raise OverBound(f"process {pid} maps more than {bound.maps_bytes} bytes of ranges")
    except OSError:
        return
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if not data.endswith(b"\n"):  # every line ends so; the last one too, were it cut short
        data += b"\n"
    # Found by substring search (in C), not by splitting every line: a preloaded driver maps
    # some 600 ranges, of which only the few (if any) with a " (deleted)" path matter.
    at = data.find(DELETED)
    while at != -1:
        start_of_line = data.rfind(b"\n", 0, at) + 1
        span = data[start_of_line : data.index(b" ", start_of_line)]
        start, _, end = span.partition(b"-")
        at = data.find(DELETED, at + len(DELETED))
        try:  # map_files names the range without the zero padding maps may show
            yield f"/proc/{pid}/map_files/{int(start, 16):x}-{int(end, 16):x}"
        except ValueError:
            continue


def held_bytes(pids: Iterable[int], devices: set[int], bound: Bound | None = None) -> int:
    """Bytes allocated to regular files the processes hold open or mapped that have no name
    left (st_nlink 0) on one of `devices` (the run directory's; the jail's /tmp's where its
    tmpfs does not count them itself), and to
    memfds. Each file counts once, however many holders it has. With `bound`, OverBound
    rather than look at more than it allows of any process."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for pid in pids:
        for path in _targets(pid, bound):
            try:
                st = os.stat(path)  # follows the kernel's magic link to the open file itself
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 0:
                continue
            key = (st.st_dev, st.st_ino)
            if key in seen:
                continue
            if st.st_dev not in devices and not _is_memfd(path):
                continue  # e.g. a host library replaced while the jail maps it: not the run's
            seen.add(key)
            total += st.st_blocks * 512
    return total


def _is_memfd(path: str) -> bool:
    try:
        return os.readlink(path).startswith("/memfd:")
    except OSError:
        return False
