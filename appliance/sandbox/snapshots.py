"""Session snapshots, the sandbox's side (appliance.core.ports.Snapshots): the jail writes and
reads its own state (`appliance.inside.snapshot`, the only code that ever reads a pickle); the
server copies the bytes, with size checks, and keeps them under SANDBOX_SNAPSHOT_DIR.

Layout (docs/snapshots.md):
    <SANDBOX_SNAPSHOT_DIR>/                0700 the server's, checked from `/` at startup (`trust`)
        t-<hash of the tenant>/            0700, one per tenant (as SANDBOX_OUTPUTS_DIR's)
            <id>/                          0700, 32 hex digits
                archive.tar                0600, the jail's archive, byte for byte
                manifest.json              0600, written by the server: sizes, settings, skipped
            .new-<id>/                     a snapshot being written (renamed to <id> when whole)

Every directory and file is opened relative to a checked descriptor, O_NOFOLLOW, and must be
the server's own: a link or another owner's entry is an unknown snapshot, never followed.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import re
import secrets
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from appliance.core.domain import Request
from appliance.core.errors import (
    Cancelled,
    JailFailure,
    MemoryLimit,
    OutputLimit,
    RequestRejected,
    RunLimit,
    RunTimeout,
    StartupError,
    UnknownSnapshot,
)
from appliance.core.events import CellError, Display, Event
from appliance.core.ports import Jail as AnyJail
from appliance.core.ports import SavedState, SnapshotInfo
from appliance.sandbox import channel, fstree, trust
from appliance.sandbox.cell import run_cell
from appliance.sandbox.jail import Jail
from appliance.sandbox.outputs import tenant_dir
from appliance.settings import Settings

log = logging.getLogger("appliance.sandbox.snapshots")

SETTING = "SANDBOX_SNAPSHOT_DIR"
ARCHIVE = "archive.tar"
MANIFEST = "manifest.json"
NEW = ".new-"
MAX_MANIFEST_BYTES = 1 << 20
MAX_SKIPPED = 1000  # entries of a jail's `skipped` list kept (it bounds its own too)
MAX_REASON = 300
ID = re.compile(r"[0-9a-f]{32}")
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
COPY_CHUNK = 1 << 20


_LIMITS: dict[str, type[RunLimit]] = {e.status: e for e in (RunTimeout, MemoryLimit, OutputLimit, Cancelled)}


def _own(jail: AnyJail) -> Jail:
    if not isinstance(jail, Jail):
        raise TypeError(f"not a jail of this sandbox: {type(jail).__name__}")
    return jail


class SnapshotStore:
    """The kept snapshots: blocking I/O (call it in a thread), every path by descriptor."""

    def __init__(self, root: Path, max_bytes: int, max_count: int) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.max_count = max_count
        self.uid = os.geteuid()
        self._lock = threading.Lock()  # a tenant's count is checked and its snapshot published together

    # -- directories -------------------------------------------------------------------------
    def check(self) -> None:
        """Startup: the root made (0700) or found wholly the server's own, every ancestor
        checked from `/`; StartupError naming the path otherwise (a link, another owner, a mode
        that lets others write: someone else may have made it). Half-written snapshots left
        by a server that died are removed."""
        with self._root() as fd:
            for entry in os.scandir(fd):
                if not entry.name.startswith("t-") or not entry.is_dir(follow_symlinks=False):
                    continue
                with trust.held(self._tenant_fd(fd, entry.name)) as tenant:
                    for inner in os.scandir(tenant):
                        if inner.name.startswith(NEW):
                            fstree.remove_tree(self.root / entry.name / inner.name)

    @contextlib.contextmanager
    def _root(self) -> Iterator[int]:
        parent, name = self.root.parent, self.root.name
        if not name:
            raise StartupError(f"{SETTING}: {self.root} cannot be the filesystem's root")
        with trust.held(trust.open_root(parent, self.uid, SETTING)) as parent_fd:
            fd = trust.ensure_dir(parent_fd, parent, name, 0o700, self.uid, SETTING)
        with trust.held(fd):
            yield fd

    def _tenant_fd(self, root_fd: int, name: str) -> int:
        return trust.ensure_dir(root_fd, self.root, name, 0o700, self.uid, SETTING)

    @contextlib.contextmanager
    def _tenant(self, owner: str) -> Iterator[int]:
        with self._root() as root_fd, trust.held(self._tenant_fd(root_fd, tenant_dir(owner))) as fd:
            yield fd

    def _snapshot_fd(self, tenant_fd: int, snapshot_id: str) -> int:
        """A snapshot's directory, or UnknownSnapshot (a bad id, none, a link, not ours)."""
        if not ID.fullmatch(snapshot_id):
            raise _unknown(snapshot_id)
        try:
            fd = os.open(snapshot_id, fstree.DIR_FLAGS, dir_fd=tenant_fd)
        except OSError:
            raise _unknown(snapshot_id) from None
        if trust.policy(os.fstat(fd), self.uid, ancestor=False) is not None:
            os.close(fd)
            raise _unknown(snapshot_id)
        return fd

    def _count(self, tenant_fd: int) -> int:
        return sum(1 for e in os.scandir(tenant_fd) if ID.fullmatch(e.name))

    # -- operations ------------------------------------------------------------------------------
    def check_quota(self, owner: str) -> None:
        with self._tenant(owner) as fd:
            if self._count(fd) >= self.max_count:
                raise RequestRejected(self._over_count())

    def _over_count(self) -> str:
        return (
            f"this tenant keeps {self.max_count} snapshots already (SANDBOX_MAX_SNAPSHOTS); "
            "delete one first (DELETE /v1/snapshots/{id})"
        )

    def keep(self, source_fd: int, owner: str, meta: dict[str, Any]) -> SnapshotInfo:
        """Copy the archive open at source_fd (a jail's, regular, checked by the caller) in as a
        new snapshot of owner's, within SANDBOX_MAX_SNAPSHOT_MB and SANDBOX_MAX_SNAPSHOTS."""
        snapshot_id = secrets.token_hex(16)
        with self._tenant(owner) as tenant:
            if self._count(tenant) >= self.max_count:
                raise RequestRejected(self._over_count())
            staging = NEW + snapshot_id
            os.mkdir(staging, 0o700, dir_fd=tenant)
            try:
                with trust.held(os.open(staging, fstree.DIR_FLAGS, dir_fd=tenant)) as fd:
                    size = self._copy_in(source_fd, fd)
                    info = SnapshotInfo(
                        id=snapshot_id,
                        bytes=size,
                        created=time.time(),
                        gpu_mb=int(meta["gpu_mb"]),
                        profile=str(meta["profile"]),
                        skipped=tuple(meta["skipped"]),
                    )
                    _write(fd, MANIFEST, json.dumps({"format": 1, **info.as_dict()}).encode())
                with self._lock:
                    if self._count(tenant) >= self.max_count:
                        raise RequestRejected(self._over_count())
                    os.rename(staging, snapshot_id, src_dir_fd=tenant, dst_dir_fd=tenant)
            except BaseException:
                fstree.remove_tree(self.root / tenant_dir(owner) / staging)
                raise
        return info

    def _copy_in(self, source_fd: int, dir_fd: int) -> int:
        out = os.open(ARCHIVE, NEW_FILE, 0o600, dir_fd=dir_fd)
        try:
            return _copy(source_fd, out, self.max_bytes, self._over_size)
        finally:
            os.close(out)

    def _over_size(self, size: int) -> str:
        return (
            f"the snapshot is over SANDBOX_MAX_SNAPSHOT_MB ({self.max_bytes // (1024 * 1024)} MiB; "
            f"{size} bytes or more): keep less in the session's globals or files"
        )

    def find(self, owner: str, snapshot_id: str) -> SnapshotInfo:
        with self._tenant(owner) as tenant, trust.held(self._snapshot_fd(tenant, snapshot_id)) as fd:
            try:
                with trust.held(os.open(MANIFEST, FILE_FLAGS, dir_fd=fd)) as mfd:
                    st = os.fstat(mfd)
                    if (
                        not stat.S_ISREG(st.st_mode)
                        or st.st_uid != self.uid
                        or st.st_size > MAX_MANIFEST_BYTES
                    ):
                        raise _unknown(snapshot_id)
                    data = os.read(mfd, MAX_MANIFEST_BYTES + 1)
            except OSError:
                raise _unknown(snapshot_id) from None
        return _manifest(snapshot_id, data)

    def delete(self, owner: str, snapshot_id: str) -> bool:
        with self._tenant(owner) as tenant:
            try:
                os.close(self._snapshot_fd(tenant, snapshot_id))
            except UnknownSnapshot:
                return False
            # Out of the tenant's listing first (a rename is atomic), then removed at leisure.
            gone = NEW + secrets.token_hex(16)
            os.rename(snapshot_id, gone, src_dir_fd=tenant, dst_dir_fd=tenant)
        fstree.remove_tree(self.root / tenant_dir(owner) / gone)
        return True

    def copy_out(  # noqa: PLR0913 (the snapshot, and where and as whom its copy goes)
        self, owner: str, snapshot_id: str, dest_dir_fd: int, name: str, uid: int, gid: int
    ) -> None:
        """The archive into a jail's run directory as `name`, owned by the jail's uid: bytes
        only, within SANDBOX_MAX_SNAPSHOT_MB."""
        with self._tenant(owner) as tenant, trust.held(self._snapshot_fd(tenant, snapshot_id)) as fd:
            try:
                src = os.open(ARCHIVE, FILE_FLAGS, dir_fd=fd)
            except OSError:
                raise _unknown(snapshot_id) from None
            with trust.held(src):
                st = os.fstat(src)
                if not stat.S_ISREG(st.st_mode) or st.st_uid != self.uid:
                    raise _unknown(snapshot_id)
                out = os.open(name, NEW_FILE, 0o600, dir_fd=dest_dir_fd)
                try:
                    os.fchown(out, uid, gid)
                    _copy(src, out, self.max_bytes, self._over_size)
                finally:
                    os.close(out)


def _copy(src: int, dst: int, limit: int, over: Any) -> int:
    """Copy src to dst in the kernel, at most `limit` bytes: RequestRejected past it."""
    st = os.fstat(src)
    if st.st_size > limit:
        raise RequestRejected(over(st.st_size))
    total = 0
    while True:
        try:
            n = os.copy_file_range(src, dst, COPY_CHUNK)
        except OSError:  # across filesystems where the kernel cannot: through user space
            n = os.write(dst, os.read(src, COPY_CHUNK))
        if n == 0:
            return total
        total += n
        if total > limit:
            raise RequestRejected(over(total))


def _write(dir_fd: int, name: str, data: bytes) -> None:
    fd = os.open(name, NEW_FILE, 0o600, dir_fd=dir_fd)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)


def _unknown(snapshot_id: str) -> UnknownSnapshot:
    shown = snapshot_id if len(snapshot_id) <= 64 else snapshot_id[:64] + "…"
    return UnknownSnapshot(f"no such snapshot {shown!r}")


def _manifest(snapshot_id: str, data: bytes) -> SnapshotInfo:
    """The server's own manifest, read back (checked all the same: it lives on a disk)."""
    try:
        obj = json.loads(data)
        skipped = obj["skipped"]
        info = SnapshotInfo(
            id=snapshot_id,
            bytes=int(obj["bytes"]),
            created=float(obj["created"]),
            gpu_mb=int(obj["gpu_memory_mb"]),
            profile=str(obj["profile"]),
            skipped=tuple(str(s) for s in skipped) if isinstance(skipped, list) else (),
        )
    except (ValueError, KeyError, TypeError) as exc:
        log.error("unreadable snapshot manifest", extra={"snapshot": snapshot_id, "error": str(exc)})
        raise _unknown(snapshot_id) from None
    return info


# -- the jail's part -------------------------------------------------------------------------------
class JailSnapshots:
    """appliance.core.ports.Snapshots over firejail jails and a SnapshotStore."""

    enabled = True

    def __init__(self, settings: Settings, store: SnapshotStore) -> None:
        self.settings = settings
        self.store = store

    def check_host(self) -> None:
        self.store.check()

    def check_quota(self, owner: str) -> None:
        self.store.check_quota(owner)

    async def save(self, jail: AnyJail, timeout_ms: int) -> SavedState:
        report = await self._op(_own(jail), channel.snapshot_op(), timeout_ms, "taken")
        skipped = report.get("skipped")
        listed = [str(s)[:MAX_REASON] for s in skipped[:MAX_SKIPPED]] if isinstance(skipped, list) else []
        return SavedState(skipped=tuple(listed))

    async def keep(
        self, jail: AnyJail, owner: str, saved: SavedState, *, gpu_mb: int, profile: str
    ) -> SnapshotInfo:
        own = _own(jail)
        meta = {"gpu_mb": gpu_mb, "profile": profile, "skipped": saved.skipped}
        return await asyncio.to_thread(self._keep, own, owner, meta)

    def _keep(self, jail: Jail, owner: str, meta: dict[str, Any]) -> SnapshotInfo:
        workdir = jail.workdir_fd if jail.workdir_fd is not None else None
        with contextlib.ExitStack() as stack:
            if workdir is None:
                workdir = stack.enter_context(trust.held(fstree.open_dir(jail.workdir)))
            try:
                # The jail's file: opened without following a link, never blocking (a FIFO), and
                # taken only as a regular file; read as bytes, never parsed here.
                src = os.open(channel.SNAPSHOT_ARCHIVE, FILE_FLAGS, dir_fd=workdir)
            except OSError as exc:
                raise JailFailure(f"the session's jail wrote no snapshot ({exc.strerror})") from exc
            try:
                with trust.held(src):
                    if not stat.S_ISREG(os.fstat(src).st_mode):
                        raise JailFailure("the session's jail wrote no snapshot (not a regular file)")
                    return self.store.keep(src, owner, meta)
            except OSError as exc:  # the store's disk (full, read-only): said, not an anonymous 500
                raise JailFailure(f"the snapshot could not be stored ({exc.strerror})") from exc
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(channel.SNAPSHOT_ARCHIVE, dir_fd=workdir)

    async def find(self, owner: str, snapshot_id: str) -> SnapshotInfo:
        return await asyncio.to_thread(self.store.find, owner, snapshot_id)

    async def delete(self, owner: str, snapshot_id: str) -> bool:
        return await asyncio.to_thread(self.store.delete, owner, snapshot_id)

    async def restore(self, jail: AnyJail, owner: str, snapshot_id: str, timeout_ms: int) -> None:
        own = _own(jail)
        await asyncio.to_thread(self._place, own, owner, snapshot_id)
        await self._op(own, channel.restore_op(), timeout_ms, "restored")

    def _place(self, jail: Jail, owner: str, snapshot_id: str) -> None:
        with contextlib.ExitStack() as stack:
            workdir = jail.workdir_fd
            if workdir is None:
                workdir = stack.enter_context(trust.held(fstree.open_dir(jail.workdir)))
            gid = jail.held.gid if jail.held is not None else jail.dirs.gid
            try:
                self.store.copy_out(owner, snapshot_id, workdir, channel.SNAPSHOT_ARCHIVE, jail.uid, gid)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                    raise RequestRejected(
                        "the snapshot does not fit in a new session's disk quota (SANDBOX_MAX_DISK_MB): "
                        "it needs room for its archive and what it unpacks"
                    ) from None
                raise JailFailure(
                    f"the snapshot could not be copied into the new session ({exc.strerror})"
                ) from exc

    async def _op(self, jail: Jail, op: bytes, timeout_ms: int, what: str) -> dict[str, Any]:
        """Run a `snapshot` or `restore` op in the jail like a cell, under the cell's limits;
        its report (the `Display` of SNAPSHOT_MIME), or why it failed."""
        displays: list[Display] = []
        errors: list[CellError] = []

        async def collect(event: Event) -> None:
            if isinstance(event, Display) and len(displays) < 64:
                displays.append(event)
            elif isinstance(event, CellError) and not errors:
                errors.append(event)

        req = Request(id=f"snapshot-{secrets.token_hex(4)}", code="", stdin_eof=True)
        s = self.settings
        outcome = await run_cell(
            jail,
            req,
            collect,
            timeout_ms=timeout_ms,
            max_output_bytes=s.max_output_bytes,
            max_disk_mb=s.max_disk_mb,
            keep_alive=True,
            op=op,
        )
        if outcome.status != "ok" or errors:
            why = outcome.message or "; ".join(f"{e.ename}: {e.evalue}" for e in errors)
            message = f"the snapshot could not be {what}: {why or outcome.status}"
            if not outcome.interpreter_alive:
                raise JailFailure(message)
            limit = _LIMITS.get(outcome.status)
            raise limit(message) if limit is not None else RequestRejected(message)
        for shown in displays:
            data = shown.data
            if isinstance(data.get(channel.SNAPSHOT_MIME), dict):
                report: dict[str, Any] = data[channel.SNAPSHOT_MIME]
                return report
        raise RequestRejected(f"the snapshot could not be {what}: the jail sent no report")
