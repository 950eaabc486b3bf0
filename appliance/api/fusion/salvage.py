"""`fetch_files` of a run whose jail ended with it (a time limit, a kill), read from the host.

The fetch cell (`languages.fetch_cell`) needs a live interpreter; a run killed by its limit
(a /run_code program, a /run_jupyter cell, a kernel the OOM killer took) has none, and its
session is closed with it. SandboxFusion still returns such a run's files
(a trainer reads what a program wrote before it hung), so the engine holds the session's
working directory before the run (`Jail.hold_workspace`): a descriptor of it, and the
directory kept past the jail's end until the engine releases the hold, after this read. So
the files are there whether the directory is a tmpfs of its own (a root server) or a plain
directory (a server that cannot mount), and the release removes it, as the jail's end would
have (on every path: the engine releases it in a `finally`, and a server that stops removes
its whole instance directory).

The program had the whole run to arrange the directory: every name is walked by descriptor
and only a regular, singly linked file of the jail's uid is read (`workfiles.open_file`: no
link followed at any step, a FIFO opened without blocking and refused). The engine reads
only once the jail has ended (`HeldWorkspace.jail_ended`): its processes were killed with
the PID namespace's init and reaped, so nothing of the run changes the directory any more,
and a file it was writing holds whatever it had written. Each file is bounded by
SANDBOX_MAX_FILE_OUT_BYTES and all of them by SANDBOX_MAX_OUTPUTS_BYTES, counted in the
bytes read, as the fetch cell's files are. Blocking: run `read_closing` in a thread.
"""

from __future__ import annotations

import base64
import os

from appliance.core.ports import Workspace
from appliance.sandbox import workfiles
from appliance.sandbox.workfiles import FileProblem

CHUNK = 1 << 20


def _read_bounded(fd: int, limit: int) -> bytes | None:
    """At most `limit` bytes of fd; None when it holds more."""
    chunks: list[bytes] = []
    got = 0
    while True:
        chunk = os.read(fd, min(CHUNK, limit + 1 - got))
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        got += len(chunk)
        if got > limit:
            return None


def read(
    ws: Workspace, names: tuple[str, ...], max_file_bytes: int, max_total_bytes: int
) -> tuple[dict[str, str], list[str]]:
    """(name -> base64 data, why each other name was left out)."""
    files: dict[str, str] = {}
    notes: list[str] = []
    total = 0
    for name in names:
        parts = tuple(p for p in name.split("/") if p not in ("", "."))
        if not parts or ".." in parts:  # shapes.check_name refused these already; fail closed
            notes.append(f"{name!r} not fetched: not a name inside the working directory")
            continue
        try:
            fd, size = workfiles.open_file(ws, parts, name)
        except FileProblem as exc:
            if exc.kind != "not_found":  # a missing file is left out silently, as SandboxFusion does
                notes.append(f"{name!r} not fetched: {exc.message}")
            continue
        try:
            if size > max_file_bytes:
                notes.append(
                    f"{name!r} not fetched: larger than SANDBOX_MAX_FILE_OUT_BYTES ({max_file_bytes})"
                )
                continue
            data = _read_bounded(fd, min(max_file_bytes, max_total_bytes - total))
        except OSError as exc:
            notes.append(f"{name!r} not fetched: {exc.strerror or exc}")
            continue
        finally:
            os.close(fd)
        if data is None:
            notes.append(
                f"{name!r} not fetched: past SANDBOX_MAX_FILE_OUT_BYTES ({max_file_bytes}) or, with the "
                f"files before it, SANDBOX_MAX_OUTPUTS_BYTES ({max_total_bytes})"
            )
            continue
        total += len(data)
        files[name] = base64.b64encode(data).decode()
    return files, notes


def read_closing(
    ws: Workspace, names: tuple[str, ...], max_file_bytes: int, max_total_bytes: int
) -> tuple[dict[str, str], list[str]]:
    """`read`, then close ws.fd: a descriptor made for this reader alone, so that nobody closes
    it while it is in use."""
    try:
        return read(ws, names, max_file_bytes, max_total_bytes)
    finally:
        os.close(ws.fd)
