"""Run one cell in a jail: hand over the code, turn what comes back into events, enforce limits.

Limits enforced here, by the server (never by the code's goodwill): wall clock, output
bytes, disk quota. The wall clock holds whatever the client does: an event the client does
not take before the run's deadline ends the run (`timeout`) like any other overrun, so a
client that stops reading cannot keep a jail, a slot or the server's memory.
Memory, processes and file size are limits of the jail itself: its cgroup (memory counting
every process, /tmp and page cache; CPU; pids) where cgroups are enforcing, else rlimits. With
a cgroup, an OOM kill anywhere in it ends the run `memory_limit`, and `done.cpu_ms` /
`done.max_rss_mb` are the group's (every process of the run, not the driver alone).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable
from pathlib import Path

from appliance.core.domain import CellOutcome, RunRequest
from appliance.core.errors import Cancelled, MemoryLimit, OutputLimit, RunLimit, RunTimeout
from appliance.core.events import CellError, CellEvent, Display, Emit, Output, Result, Started
from appliance.core.tasks import within
from appliance.sandbox import channel, fstree
from appliance.sandbox.cgroups import Counters, Group
from appliance.sandbox.held import Bound, OverBound, held_bytes
from appliance.sandbox.jail import Jail, tmp_of
from appliance.sandbox.process import Event, Exited, InterruptRequest, Overflow, Stream, Violation

INTERRUPT_GRACE_S = 0.8
DISK_CHECK_S = 0.25
MAX_DISK_ENTRIES = 100_000  # files + directories a run may create (inodes), at most ...
ENTRY_BYTES = 4096  # ... and one per block of its disk quota: empty files cost inodes, not blocks


# What the check as a cell ends may look at on the event loop (well under a millisecond): a
# thread hop there and back costs about as much as the whole check of a small run
# (benchmarks/results/micro-opts.md), so a run that left little is checked in place, and any
# other in a thread.
INLINE_ENTRIES = 64  # files and directories in the run directory
INLINE_PROCESSES = 4  # processes below the sandbox's init
INLINE_HELD = Bound(fds=64, threads=8, maps_bytes=96 * 1024)  # per table / process


def stdin_ops(data: str, eof: bool) -> list[bytes]:
    """The channel ops that hand `data` (then an end of file) to the running cell's stdin."""
    return ([channel.stdin_op(data)] if data else []) + ([channel.stdin_eof_op()] if eof else [])


async def run_cell(  # noqa: PLR0913 (the cell's inputs and limits, passed down rather than stored on a shared object)
    jail: Jail,
    req: RunRequest,
    emit: Emit,
    *,
    timeout_ms: int,
    max_output_bytes: int,
    max_disk_mb: int,
    keep_alive: bool,
    started: Callable[[], None] | None = None,
    first: Started | None = None,
    op: bytes | None = None,
) -> CellOutcome:
    """Run req.code in jail and stream its events through emit; returns how the cell ended.

    `op` replaces the `run` op the cell sends the driver (a session's `snapshot` or `restore`,
    which the driver does like a cell, under the same limits).
    keep_alive (sessions): on a limit, first try to stop only the cell (KeyboardInterrupt);
    otherwise the caller kills the jail, so here the cell is simply abandoned.
    `started` is called once the code is on its way to the driver: stdin written after
    that belongs to this cell. `first` (the run's `Started`) is sent then, before any
    event of the cell's: the jail starts on the code while it goes out.
    """
    group = jail.cgroup
    base = jail.cell_baseline()
    outcome = await _run_cell(
        jail,
        req,
        emit,
        timeout_ms=timeout_ms,
        max_output_bytes=max_output_bytes,
        max_disk_mb=max_disk_mb,
        keep_alive=keep_alive,
        started=started,
        base=base,
        first=first,
        op=op,
    )
    if group is not None and base is not None:
        _account(group, base, outcome)
    return outcome


def memory_limit(group: Group) -> MemoryLimit:
    """What a run whose group hit its memory limit is told."""
    return MemoryLimit(
        f"the run hit its memory limit ({group.limits.memory_mb} MiB: SANDBOX_MEMORY_MB or the run's memory_mb) "
        "for all its processes, /tmp and page cache together; the kernel killed a process of it"
    )


def _account(group: Group, base: Counters, outcome: CellOutcome) -> None:
    """The group's counters into the outcome: CPU and peak memory of the whole run, and an OOM
    kill anywhere in it (a child, the driver) makes an ok/error run `memory_limit`."""
    try:
        now = group.counters(pids=False)
        peak = group.peak_mb()
    except OSError:
        return
    outcome.cpu_ms = max(0, now.cpu_ns - base.cpu_ns) // 1_000_000
    outcome.max_rss_mb = peak
    if now.oom_kills > base.oom_kills and outcome.status in ("ok", "error"):
        error = memory_limit(group)
        outcome.status, outcome.message = error.status, error.message


async def _run_cell(  # noqa: C901, PLR0912, PLR0913, PLR0915 (one cell's event loop: each event kind and limit is a branch over the same state)
    jail: Jail,
    req: RunRequest,
    emit: Emit,
    *,
    timeout_ms: int,
    max_output_bytes: int,
    max_disk_mb: int,
    keep_alive: bool,
    started: Callable[[], None] | None,
    base: Counters | None,
    first: Started | None,
    op: bytes | None = None,
) -> CellOutcome:
    loop = asyncio.get_running_loop()
    process = jail.process
    deadline = loop.time() + timeout_ms / 1000
    process.write(
        op
        if op is not None
        else channel.run_op(req.code, [(f.path, f.data) for f in req.files], req.stdin_eof)
    )
    # Made once the code is on its way: the driver starts on it meanwhile.
    timed_out = RunTimeout(f"the run exceeded its {timeout_ms} ms time limit")
    over = OutputLimit(f"the run wrote more than SANDBOX_MAX_OUTPUT_BYTES ({max_output_bytes} bytes)")
    if started is not None:
        started()
    # The disk watchdog's first look is DISK_CHECK_S in: a timer until then, not a task (most
    # cells end sooner, and a task to make and cancel cost each of them more than a timer).
    watchdogs: list[asyncio.Task[None]] = []
    watch = loop.call_later(
        DISK_CHECK_S,
        lambda: watchdogs.append(
            asyncio.create_task(_disk_watchdog(jail, max_disk_mb, base.oom_kills if base else None))
        ),
    )
    sent = 0
    memory_error = False
    stopping: RunLimit | None = None

    def ended(error: RunLimit) -> CellOutcome:
        return CellOutcome(error.status, message=error.message, interpreter_alive=False, output_bytes=sent)

    try:
        if first is not None:
            try:
                async with asyncio.timeout_at(deadline):
                    await emit(first)
            except TimeoutError:
                process.stop(timed_out)  # the client did not take it in the run's time
        # Whether the pipe may be read in place (`ready_item`) instead of waiting: only after a
        # wait that yielded to the event loop, so that however fast the driver writes, the run
        # yields between two reads of its pipe and cannot hold the loop.
        may_read = False
        while True:
            ready = process.ready_item() if may_read else None
            if ready is not None:
                item = ready
                may_read = False
            else:
                may_read = not process.has_pending()  # then `next` waits, and the loop runs
                try:
                    async with asyncio.timeout_at(deadline):
                        item = await process.next()
                except TimeoutError:
                    if stopping is not None:  # the cell ignored the interrupt: give it up
                        return ended(stopping)
                    item = Violation(timed_out)
            if isinstance(item, InterruptRequest):
                item = Violation(Cancelled(item.reason))
            if isinstance(item, Violation):
                if stopping is not None:
                    continue
                stopping = item.error
                if not keep_alive:
                    return ended(stopping)
                with contextlib.suppress(OSError):
                    process.write(channel.interrupt_op())
                deadline = loop.time() + INTERRUPT_GRACE_S
                continue
            if isinstance(item, Overflow):
                process.stop(OutputLimit(f"an output object exceeded {item.nbytes} bytes"))
                continue
            if isinstance(item, Exited):
                if stopping is None:  # the disk as at "done" below: never over the quota and ok
                    stopping = await final_disk_check(jail, max_disk_mb)
                if stopping is not None:
                    return ended(stopping)
                code = await _exit_code(jail)
                return CellOutcome(
                    "ok" if code == 0 else "error",
                    exit_code=code,
                    interpreter_alive=False,
                    output_bytes=sent,
                    message=None if code == 0 else f"the interpreter exited with code {code}",
                )
            if isinstance(item, Event) and item.body["ev"] == "done":
                body = item.body
                outcome = CellOutcome(
                    "ok" if body["exit_code"] == 0 else "error",
                    exit_code=body["exit_code"],
                    cpu_ms=body["cpu_ms"],
                    max_rss_mb=body["max_rss_mb"],
                    output_bytes=sent,
                    import_ms=body["import_ms"],
                )
                if stopping is None:
                    # A cell can write past the quota and end between two of the watchdog's
                    # checks: look once more, so that it never ends ok over the quota.
                    stopping = await final_disk_check(jail, max_disk_mb)
                if stopping is not None:
                    outcome.status, outcome.message = stopping.status, stopping.message
                elif memory_error:
                    outcome.status = "memory_limit"
                    outcome.message = "the run ran out of memory (SANDBOX_MEMORY_MB)"
                return outcome
            sent += item.nbytes
            if sent > max_output_bytes:
                process.stop(over)  # taken next, before anything already waiting behind it
                continue
            event = _event_for(item)
            if event is None or stopping is not None:
                continue
            if isinstance(item, Event) and item.body["ev"] == "error" and item.body["memory"]:
                memory_error = True
            try:
                async with asyncio.timeout_at(deadline):
                    await emit(event)
            except TimeoutError:
                process.stop(timed_out)  # the client did not take the event in the run's time
    finally:
        # Not awaited: that would only wait a turn of the event loop for the cancellation to
        # land, between the cell's end and its `done`. A check it left running in a thread
        # finishes there, and its verdict goes nowhere.
        watch.cancel()
        for watchdog in watchdogs:
            watchdog.cancel()


def _event_for(item: Stream | Event) -> CellEvent | None:
    """Only these driver events reach the caller (validated already by the channel's decoder);
    an empty write says nothing."""
    if isinstance(item, Stream):
        return Output(item.name, item.text) if item.text else None
    body = item.body
    if body["ev"] == "stream":
        return Output(body["name"], body["text"]) if body["text"] else None
    if body["ev"] == "result":
        return Result(body["data"])
    if body["ev"] == "display":
        return Display(body["data"])
    if body["ev"] == "error":
        return CellError(body["ename"], body["evalue"], body["traceback"])
    return None


async def final_disk_check(jail: Jail, max_disk_mb: int) -> OutputLimit | None:
    """`disk_violation` as a cell ends: on the event loop within the INLINE_ bounds, else in a thread."""
    try:
        return disk_violation(jail, max_disk_mb, inline=True)
    except OverBound:
        return await asyncio.to_thread(disk_violation, jail, max_disk_mb)


def disk_violation(jail: Jail, max_disk_mb: int, inline: bool = False) -> OutputLimit | None:  # noqa: C901, PLR0912 (one walk of the jail's files; each branch is one place a file can hide)
    """Whether the jail's files are over the disk quota, in bytes or in entries: its run
    directory, its private /tmp (a tmpfs of host memory), and what its processes hold with
    no name left (unlinked-but-open files, memfds). Blocking: run it in a thread, or `inline`,
    which makes it raise OverBound rather than look at more than the INLINE_ bounds allow.

    Where the run directory is a tmpfs of its own (`runfs`: the kernel also stops writes
    just past the quota) it is counted as the private /tmp is, by the kernel (`tmpfs_usage`):
    that count sees files held only by a descriptor in flight (SCM_RIGHTS), which no walk
    or search of descriptor tables can. Else the tree is walked by descriptor without
    following links (`fstree`), so a directory swapped for a symlink mid-walk leads nowhere;
    one nested deeper than the walk may go cannot be measured, and is over the quota."""
    limit = max_disk_mb * 1024 * 1024
    max_entries = disk_entries(max_disk_mb)
    walk_max = min(max_entries, INLINE_ENTRIES) if inline else max_entries
    root = jail.workdir_fd if jail.workdir_fd is not None else jail.workdir
    devices: set[int] = set()
    # A run directory that is a tmpfs of its own (`runfs`) is counted as /tmp is, by the
    # kernel: every page and inode on it, files no process holds included (in flight).
    own = tmpfs_usage(root) if jail.dirs.sizes is not None else None
    if own is not None:
        used, entries, too_deep = own[0], own[1], 0
    else:
        used, entries, too_deep = fstree.usage(root, walk_max)
        if entries > walk_max < max_entries:
            raise OverBound(f"the run directory holds more than {walk_max} entries")
        if jail.workdir_dev is not None:
            devices.add(jail.workdir_dev)
        else:
            with contextlib.suppress(OSError):
                devices.add(os.stat(jail.workdir).st_dev)
    inner = jail.process.inits()  # firejail's sandbox init: its namespace holds the /tmp
    # The /tmp held open since the jail was pinned, else found through the init's root.
    counted = tmpfs_usage(jail.tmp_fd) if jail.tmp_fd is not None else None
    tmp = None if counted is not None else tmp_of(inner)
    if counted is not None:
        used, entries = used + counted[0], entries + counted[1]
    elif tmp is not None:
        counted = tmpfs_usage(tmp)
        if counted is None:  # no block count to read: walk it, and look for its held files
            if inline:
                raise OverBound("the private /tmp keeps no count of its own")
            b, n, d = fstree.usage(tmp, max_entries)
            used, entries, too_deep = used + b, entries + n, too_deep + d
            with contextlib.suppress(OSError):
                devices.add(os.stat(tmp).st_dev)
        else:
            used, entries = used + counted[0], entries + counted[1]
    if too_deep:
        return OutputLimit(
            f"the run nested directories deeper than {fstree.MAX_DEPTH} levels "
            "(its disk use cannot be measured past that)"
        )
    if entries > max_entries:
        return OutputLimit(f"the run created more than {max_entries} files and directories")
    if used <= limit:
        if not devices and _memfds_fit(jail, limit - used):
            return None
        # Not firejail's own two (the launcher, `root`, and the sandbox's root-owned init):
        # they run firejail's code only and take no descriptors from the run. Everything
        # below them is searched, orphans included (reparented to that init, its children).
        processes = jail.run_processes(inner)
        if inline and len(processes) > INLINE_PROCESSES:
            raise OverBound(f"{len(processes)} processes are left to search")
        used += held_bytes(processes, devices, INLINE_HELD if inline else None)
    if used > limit:
        return OutputLimit(f"the run wrote more than SANDBOX_MAX_DISK_MB ({max_disk_mb} MiB) to disk")
    return None


def _memfds_fit(jail: Jail, room: int) -> bool:
    """Whether whatever the run holds without a name is known to fit in `room` without a search.

    Where the run directory and /tmp are counted by their tmpfs (no `devices` to search),
    what is left to find is memfds, whose pages are shmem charged to the jail's group (every
    process of the jail is in it). So if the group's shmem, swapped pages included
    (`Group.shmem_bytes`), fits, no search could find more: the search (a read of every
    process's descriptor tables and maps) is left for the runs that might be over."""
    group = jail.cgroup
    if group is None:
        return False
    try:
        held = group.shmem_bytes()
    except OSError:
        return False
    return held is not None and held <= room


def disk_entries(max_disk_mb: int) -> int:
    """The files and directories a run may create under SANDBOX_MAX_DISK_MB."""
    return min(MAX_DISK_ENTRIES, max_disk_mb * 1024 * 1024 // ENTRY_BYTES)


def tmpfs_usage(tmp: Path | int) -> tuple[int, int] | None:
    """(bytes allocated, inodes in use) of the jail's private /tmp (a path, or a descriptor of
    it) as its tmpfs counts them, or None when it cannot say (no size limit: tmpfs then
    reports no block counts).

    The kernel's count is every page of every file on that filesystem, named or not: files
    unlinked while open or mapped, sparse files (holes take no page, as in st_blocks),
    fallocate'd ranges and pages written through a mapping. So it replaces both the walk of
    /tmp and the search for its held files, at the cost of one statvfs instead of a stat per
    entry and a read of every process's maps for that device. The runtime's bind mounts
    under /tmp are other filesystems: statvfs of /tmp does not count them (nor did the walk).
    """
    try:
        st = os.statvfs(tmp)
    except OSError:
        return None
    if st.f_blocks == 0 or st.f_files == 0:  # size=0 / nr_inodes=0: unlimited, uncounted
        return None
    return (st.f_blocks - st.f_bfree) * st.f_frsize, st.f_files - st.f_ffree


def _violation(jail: Jail, max_disk_mb: int, oom_base: int | None) -> RunLimit | None:
    group = jail.cgroup
    if group is not None and oom_base is not None:
        with contextlib.suppress(OSError):
            if group.oom_kills() > oom_base:  # v1 kills one process; the run ends, as on v2
                return memory_limit(group)
    return disk_violation(jail, max_disk_mb)


async def _disk_watchdog(jail: Jail, max_disk_mb: int, oom_base: int | None) -> None:
    """Look now, then every DISK_CHECK_S, until a look finds the run over a limit."""
    while True:
        found = await asyncio.to_thread(_violation, jail, max_disk_mb, oom_base)
        if found is not None:
            jail.process.stop(found)
            return
        await asyncio.sleep(DISK_CHECK_S)


async def _exit_code(jail: Jail) -> int | None:
    try:
        return await within(jail.process.wait(), 2.0)
    except TimeoutError:
        return None
