"""Run one cell in a jail: send the code, turn what comes back into frames, enforce limits.

Limits enforced here, by the server (never by the code's goodwill): wall clock,
output bytes, disk quota. Memory, processes and file size are rlimits of the jail.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from appliance import protocol
from appliance.errors import Cancelled, OutputLimit, RunLimit, RunTimeout
from appliance.jail.jail import Jail
from appliance.jail.process import Event, Exited, Overflow, Stream
from appliance.jail.workdir import disk_usage
from appliance.protocol import ExecuteRequest, Frame

Emit = Callable[[Frame], Awaitable[None]]

INTERRUPT_GRACE_S = 0.8
DISK_CHECK_S = 0.25
MAX_DISK_ENTRIES = 100_000  # files + directories a run may create (inodes), at most ...
ENTRY_BYTES = 4096  # ... and one per block of its disk quota: empty files cost inodes, not blocks


@dataclass(frozen=True)
class Violation:
    """Put on a jail's item queue by a watchdog: the run broke a limit."""

    error: RunLimit


@dataclass(frozen=True)
class InterruptRequest:
    """Put on a jail's item queue when the client sends `interrupt` (or the server stops)."""

    reason: str = "the run was interrupted"


@dataclass
class CellOutcome:
    status: str
    exit_code: int | None = None
    cpu_ms: int | None = None
    max_rss_mb: float | None = None
    message: str | None = None
    interpreter_alive: bool = True
    output_bytes: int = 0


@dataclass
class ActiveRun:
    """What the connection can reach while a request runs: its stdin and interrupt."""

    id: str
    jail: Jail | None = None
    pending_stdin: list[dict[str, Any]] = field(default_factory=list)
    interrupted: bool = False
    reason: str = "the run was interrupted"

    async def stdin(self, data: str, eof: bool) -> None:
        messages = []
        if data:
            messages.append({"op": "stdin", "data": data})
        if eof:
            messages.append({"op": "stdin_eof"})
        if self.jail is None:
            self.pending_stdin.extend(messages)
            return
        for msg in messages:
            with contextlib.suppress(OSError):
                await self.jail.process.send(msg)

    def interrupt(self, reason: str = "the run was interrupted") -> None:
        self.interrupted = True
        self.reason = reason
        if self.jail is not None:
            self.jail.process.items.put_nowait(InterruptRequest(reason))  # type: ignore[arg-type]


async def run_cell(
    jail: Jail, req: ExecuteRequest, emit: Emit, *, timeout_ms: int, max_output_bytes: int,
    max_disk_mb: int, active: ActiveRun, keep_alive: bool,
) -> CellOutcome:
    """Run req.code in jail and stream its frames; returns how the cell ended.

    keep_alive (sessions): on a limit, first try to stop only the cell (KeyboardInterrupt);
    otherwise the caller kills the jail, so here the cell is simply abandoned.
    """
    rid = req.id
    items = jail.process.items
    active.jail = jail
    message: dict[str, Any] = {
        "op": "run", "code": req.code, "stdin_eof": req.stdin_eof,
        "files": [{"path": f.path, "data": base64.b64encode(f.data).decode()} for f in req.files],
    }
    await jail.process.send(message)
    for pending in active.pending_stdin:
        await jail.process.send(pending)
    active.pending_stdin.clear()
    if active.interrupted:
        items.put_nowait(InterruptRequest(active.reason))  # type: ignore[arg-type]
    watchdog = asyncio.create_task(_disk_watchdog(jail, max_disk_mb))
    deadline = time.monotonic() + timeout_ms / 1000
    sent = 0
    memory_error = False
    stopping: RunLimit | None = None
    # A limit this loop detects is handled next, before anything already queued behind
    # it (such as the cell's `done`): queued, it would arrive too late to count.
    overrun: Violation | None = None
    item: Any
    try:
        while True:
            remaining = deadline - time.monotonic()
            try:
                if overrun is not None:
                    item, overrun = overrun, None
                else:
                    item = await asyncio.wait_for(items.get(), max(remaining, 0.0))
            except TimeoutError:
                if stopping is not None:  # the cell ignored the interrupt: give it up
                    return CellOutcome(stopping.status, message=stopping.message,
                                       interpreter_alive=False, output_bytes=sent)
                item = Violation(RunTimeout(f"the run exceeded its {timeout_ms} ms time limit"))
            if isinstance(item, InterruptRequest):
                item = Violation(Cancelled(item.reason))
            if isinstance(item, Violation):
                if stopping is not None:
                    continue
                stopping = item.error
                if not keep_alive:
                    return CellOutcome(stopping.status, message=stopping.message,
                                       interpreter_alive=False, output_bytes=sent)
                with contextlib.suppress(OSError):
                    await jail.process.send({"op": "interrupt"})
                deadline = time.monotonic() + INTERRUPT_GRACE_S
                continue
            if isinstance(item, Stream):
                sent += item.nbytes
                if sent > max_output_bytes:
                    overrun = Violation(OutputLimit(
                        f"the run wrote more than SANDBOX_MAX_OUTPUT_BYTES ({max_output_bytes} bytes)"))
                    continue
                if item.text and stopping is None:
                    await emit(protocol.stream_frame(rid, item.name, item.text))
                continue
            if isinstance(item, Overflow):
                overrun = Violation(OutputLimit(
                    f"an output object exceeded {item.nbytes} bytes"))
                continue
            if isinstance(item, Exited):
                code = await _exit_code(jail)
                if stopping is not None:
                    return CellOutcome(stopping.status, message=stopping.message,
                                       interpreter_alive=False, output_bytes=sent)
                status = "ok" if code == 0 else "error"
                return CellOutcome(status, exit_code=code, interpreter_alive=False, output_bytes=sent,
                                   message=None if code == 0 else f"the interpreter exited with code {code}")
            if isinstance(item, Event):
                body = item.body
                kind = body.get("ev")
                if kind == "done":
                    exit_code = _int_or_none(body.get("exit_code"))
                    outcome = CellOutcome(
                        "ok" if exit_code == 0 else "error", exit_code=exit_code,
                        cpu_ms=_int_or_none(body.get("cpu_ms")),
                        max_rss_mb=_float_or_none(body.get("max_rss_mb")), output_bytes=sent,
                    )
                    if stopping is not None:
                        outcome.status, outcome.message = stopping.status, stopping.message
                    elif memory_error:
                        outcome.status = "memory_limit"
                        outcome.message = "the run ran out of memory (SANDBOX_MEMORY_MB)"
                    return outcome
                sent += item.nbytes
                if sent > max_output_bytes:
                    overrun = Violation(OutputLimit(
                        f"the run wrote more than SANDBOX_MAX_OUTPUT_BYTES ({max_output_bytes} bytes)"))
                    continue
                if stopping is not None:
                    continue
                frame = _frame_for(rid, body)
                if frame is not None:
                    if frame["type"] == "error" and body.get("memory"):
                        memory_error = True
                    await emit(frame)
    finally:
        watchdog.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watchdog
        active.jail = None


def _frame_for(rid: str, body: dict[str, Any]) -> Frame | None:
    """Only these driver events become frames; the server stamps the id itself."""
    kind = body.get("ev")
    data = body.get("data")
    if kind == "stream":
        name, text = body.get("name"), body.get("text")
        if name in ("stdout", "stderr") and isinstance(text, str) and text:
            return protocol.stream_frame(rid, str(name), text)
        return None
    if kind in ("result", "display") and isinstance(data, dict):
        return (protocol.result_frame if kind == "result" else protocol.display_frame)(rid, data)
    if kind == "error":
        tb = body.get("traceback")
        return protocol.error_frame(
            rid, str(body.get("ename", "Error")), str(body.get("evalue", "")),
            [str(line) for line in tb] if isinstance(tb, list) else [],
        )
    return None


async def _disk_watchdog(jail: Jail, max_disk_mb: int) -> None:
    limit = max_disk_mb * 1024 * 1024
    max_entries = min(MAX_DISK_ENTRIES, limit // ENTRY_BYTES)
    while True:
        await asyncio.sleep(DISK_CHECK_S)
        used, entries = await asyncio.to_thread(disk_usage, jail.workdir)
        # The jail's private /tmp is a tmpfs (host memory): it counts against the same quota.
        tmp = jail.private_tmp
        if tmp is not None:
            tmp_used, tmp_entries = await asyncio.to_thread(disk_usage, tmp)
            used, entries = used + tmp_used, entries + tmp_entries
        if used > limit:
            jail.process.items.put_nowait(Violation(OutputLimit(  # type: ignore[arg-type]
                f"the run wrote more than SANDBOX_MAX_DISK_MB ({max_disk_mb} MiB) to disk")))
            return
        if entries > max_entries:
            jail.process.items.put_nowait(Violation(OutputLimit(  # type: ignore[arg-type]
                f"the run created more than {max_entries} files and directories")))
            return


async def _exit_code(jail: Jail) -> int | None:
    try:
        code = await asyncio.wait_for(jail.process.wait(), 2.0)
    except TimeoutError:
        return None
    return code


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _float_or_none(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None
