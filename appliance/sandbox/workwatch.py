"""Watch a directory of a jail's working directory for changes, with inotify (E2B's watch_dir).

Each directory watched is first opened by descriptor from the working directory
(`workfiles.open_dir`: one O_NOFOLLOW step at a time), then handed to inotify as
`/proc/self/fd/N`, a name for that very open directory: no link the jail planted, nor a
rename meanwhile, can make the server watch anything else. A recursive watch adds each
directory that appears below, reached the same way.

A sandbox's watches share one inotify instance (`Inotify`): root's instances are the host's,
128 kept for root's own programs (`nslimits.HOST_SHARE`), so watches must not cost one each
(and one sandbox's flood of events overflows only its own queue). Bounded: at most
`max_dirs` directories per watch and `Inotify.max_watches` per instance (inotify watches
are root's, counted against the host's `max_user_watches`), and
at most `max_events` events waiting to be read; past either, or when the kernel's queue
overflows, the watch ends with `failed` saying why. Consecutive identical events (a file
written in many small writes) are kept once.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import os
import posixpath
import struct
import threading
from collections import deque
from dataclasses import dataclass

from appliance.core.ports import Workspace
from appliance.sandbox import fstree, workfiles
from appliance.sandbox.workfiles import FileProblem

IN_MODIFY = 0x2
IN_ATTRIB = 0x4
IN_MOVED_FROM = 0x40
IN_MOVED_TO = 0x80
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
IN_ONLYDIR = 0x1000000
IN_ISDIR = 0x40000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC
MASK = (
    IN_MODIFY
    | IN_ATTRIB
    | IN_MOVED_FROM
    | IN_MOVED_TO
    | IN_CREATE
    | IN_DELETE
    | IN_DELETE_SELF
    | IN_MOVE_SELF
)
HEADER = struct.Struct("iIII")
READ_BYTES = 64 * 1024

# What each inotify mask means, as envd names it (fsnotify's mapping).
KINDS = (
    (IN_CREATE | IN_MOVED_TO, "create"),
    (IN_MODIFY, "write"),
    (IN_DELETE, "remove"),
    (IN_MOVED_FROM, "rename"),
    (IN_ATTRIB, "chmod"),
)


@dataclass(frozen=True)
class Change:
    name: str  # below the watched directory, "/"-separated
    kind: str  # create, write, remove, rename, chmod


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


_LIBC = _libc()


class Inotify:
    """One inotify instance for several watches, its events routed by watch descriptor to
    the watches that asked (two watching one directory share its descriptor).

    Watches are added from worker threads (a watch is built in one) and events dispatched in
    the loop's thread: the routing table is under a lock."""

    def __init__(self, max_watches: int) -> None:
        self.max_watches = max_watches
        self.fd = -1
        self._subs: dict[int, dict[DirWatch, str]] = {}  # wd -> watch -> its directory below its root
        self._count = 0
        self._lock = threading.RLock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    def add(self, watch: DirWatch, dir_fd: int, rel: str) -> int:
        with self._lock:
            if self._closed:
                raise FileProblem("not_found", "the watches ended (their sandbox is gone)")
            if self._count >= self.max_watches:
                raise FileProblem(
                    "too_many",
                    f"the server watches {self.max_watches} directories already; stop a watch first",
                )
            if self.fd < 0:
                fd = _LIBC.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
                if fd < 0:
                    raise FileProblem("invalid", f"cannot watch: {os.strerror(ctypes.get_errno())}")
                self.fd = fd
            # The open directory itself, by its /proc name: nothing the jail did to the path
            # since it was opened changes what is watched.
            wd: int = _LIBC.inotify_add_watch(self.fd, f"/proc/self/fd/{dir_fd}".encode(), MASK | IN_ONLYDIR)
            if wd < 0:
                err = ctypes.get_errno()
                raise FileProblem("invalid", f"cannot watch {rel or 'the directory'}: {os.strerror(err)}")
            subs = self._subs.setdefault(wd, {})
            if watch not in subs:
                self._count += 1
            subs[watch] = rel
            return wd

    def remove(self, watch: DirWatch, wd: int) -> None:
        with self._lock:
            subs = self._subs.get(wd)
            if subs is None or subs.pop(watch, None) is None:
                return
            self._count -= 1
            if not subs:
                del self._subs[wd]
                _LIBC.inotify_rm_watch(self.fd, wd)  # fails harmlessly if the directory is gone

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            if self._loop is None and self.fd >= 0 and not self._closed:
                self._loop = loop
                loop.add_reader(self.fd, self._readable)

    def _readable(self) -> None:
        try:
            buf = os.read(self.fd, READ_BYTES)
        except BlockingIOError:
            return
        except OSError as exc:
            self._to_all(f"the watch failed: {exc.strerror}")
            return
        offset = 0
        while offset + HEADER.size <= len(buf):
            wd, mask, _cookie, length = HEADER.unpack_from(buf, offset)
            raw = buf[offset + HEADER.size : offset + HEADER.size + length]
            offset += HEADER.size + length
            name = raw.rstrip(b"\0").decode(errors="surrogateescape")
            if mask & IN_Q_OVERFLOW:
                self._to_all("too many changes at once: the kernel's event queue overflowed")
                continue
            with self._lock:
                targets = list(self._subs.get(wd, {}).items())
                if mask & IN_IGNORED:  # the directory is gone: so is its descriptor
                    self._count -= len(self._subs.pop(wd, {}))
            for watch, rel in targets:
                watch.event(wd, rel, mask, name)

    def close(self) -> None:
        """Stop reading and close the instance (its watches are gone with it)."""
        with self._lock:
            self._closed = True
            if self._loop is not None:
                self._loop.remove_reader(self.fd)
                self._loop = None
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1
            self._subs.clear()
            self._count = 0

    def _to_all(self, why: str) -> None:
        with self._lock:
            watches = {w for subs in self._subs.values() for w in subs}
        for watch in watches:
            watch.fail(why)


class DirWatch:
    """A watch of `parts` below the workspace; it owns ws's descriptor from here on."""

    def __init__(  # noqa: PLR0913 (what is watched, how, and its bounds)
        self,
        hub: Inotify,
        ws: Workspace,
        parts: tuple[str, ...],
        recursive: bool,
        max_dirs: int,
        max_events: int,
    ) -> None:
        """Blocking (opens and walks the directory): build it in a thread, then `start`."""
        self.hub = hub
        self.ws = ws
        self._ws_open = True
        self.parts = parts
        self.recursive = recursive
        self.max_dirs = max_dirs
        self.max_events = max_events
        self.changes: deque[Change] = deque()
        self.failed: str | None = None
        self.ended = False
        self.wake = asyncio.Event()
        self._wds: set[int] = set()
        try:
            top = workfiles.open_dir(ws, parts)
            try:
                self._add(top, "")
                if recursive:
                    for entry in fstree.Walk(top, list_limit=max_dirs * 64):
                        if not entry.is_dir:
                            continue
                        sub = os.open(entry.name, fstree.DIR_FLAGS, dir_fd=entry.dir_fd)
                        try:
                            self._add(sub, entry.rel)
                        finally:
                            os.close(sub)
            finally:
                os.close(top)
        except BaseException:
            self.close()
            raise

    def _add(self, dir_fd: int, rel: str) -> None:
        if len(self._wds) >= self.max_dirs:
            raise FileProblem(
                "too_many", f"more than {self.max_dirs} directories to watch; watch a narrower one"
            )
        if os.fstat(dir_fd).st_dev != self.ws.dev:
            return  # another filesystem: not entered
        self._wds.add(self.hub.add(self, dir_fd, rel))

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Deliver changes from now on (in the loop's thread)."""
        self.hub.start(loop)

    def take(self) -> list[Change]:
        taken = list(self.changes)
        self.changes.clear()
        self.wake.clear()
        return taken

    def fail(self, why: str | None) -> None:
        """End the watch, saying why (None: its directory is gone)."""
        if not self.ended:
            self.ended = True
            self.failed = why
            self.wake.set()

    def event(self, wd: int, rel: str, mask: int, name: str) -> None:
        """One inotify event of a directory this watch holds (`rel` below its root)."""
        if self.ended:
            return
        if mask & IN_IGNORED:
            self._wds.discard(wd)
            if rel == "" or not self._wds:
                self.fail(None)  # the watched directory is gone
            return
        if mask & (IN_DELETE_SELF | IN_MOVE_SELF):
            if rel == "":
                self.fail(None)
            return
        path = posixpath.join(rel, name) if rel else name
        kind = next((kind for bits, kind in KINDS if mask & bits), None)
        if kind is not None and not name.startswith(workfiles.UPLOAD_PREFIX):  # the server's own upload
            self._note(Change(path, kind))
        if self.recursive and mask & IN_ISDIR and mask & (IN_CREATE | IN_MOVED_TO):
            self._follow(path)

    def _follow(self, path: str) -> None:
        """Watch a directory that appeared below (a recursive watch)."""
        try:
            sub = workfiles.open_dir(self.ws, (*self.parts, *path.split("/")))
        except FileProblem:
            return  # gone again, or swapped for a link: nothing to watch
        try:
            self._add(sub, path)
        except FileProblem as exc:
            self.fail(str(exc))
        finally:
            os.close(sub)

    def _note(self, change: Change) -> None:
        if self.changes and self.changes[-1] == change:
            return
        if len(self.changes) >= self.max_events:
            self.fail(f"more than {self.max_events} changes not yet read: the watch was stopped")
            return
        self.changes.append(change)
        self.wake.set()

    def close(self) -> None:
        for wd in list(self._wds):
            self.hub.remove(self, wd)
        self._wds.clear()
        if self._ws_open:
            os.close(self.ws.fd)
            self._ws_open = False
        self.fail(self.failed)
