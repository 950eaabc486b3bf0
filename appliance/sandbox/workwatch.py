"""Watch a directory of a jail's working directory for changes, with inotify (E2B's watch_dir).

Each directory watched is first opened by descriptor from the working directory
(`workfiles.open_dir`: one O_NOFOLLOW step at a time), then handed to inotify as
`/proc/self/fd/N`, a name for that very open directory: no link the jail planted, nor a
rename meanwhile, can make the server watch anything else. A recursive watch adds each
directory that appears below, reached the same way.

Bounded: at most `max_dirs` directories per watch (inotify watches are root's, counted
against the host's `max_user_watches`), and at most `max_events` events waiting to be read;
past either, or when the kernel's own queue overflows, the watch ends with `failed` saying
why. Consecutive identical events (a file written in many small writes) are kept once.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import os
import posixpath
import struct
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


class DirWatch:
    """A watch of `parts` below the workspace; it owns ws's descriptor from here on."""

    def __init__(
        self, ws: Workspace, parts: tuple[str, ...], recursive: bool, max_dirs: int, max_events: int
    ) -> None:
        """Blocking (opens and walks the directory): build it in a thread, then `start`."""
        self.ws = ws
        self._ws_open = True
        self.fd = -1
        self.parts = parts
        self.recursive = recursive
        self.max_dirs = max_dirs
        self.max_events = max_events
        self.changes: deque[Change] = deque()
        self.failed: str | None = None
        self.ended = False
        self.wake = asyncio.Event()
        self._dirs: dict[int, str] = {}  # inotify watch descriptor -> directory below the root
        self._loop: asyncio.AbstractEventLoop | None = None
        fd = _LIBC.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            self.close()
            raise FileProblem("invalid", f"cannot watch: {os.strerror(err)}")
        self.fd = fd
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
        if len(self._dirs) >= self.max_dirs:
            raise FileProblem(
                "too_many", f"more than {self.max_dirs} directories to watch; watch a narrower one"
            )
        if os.fstat(dir_fd).st_dev != self.ws.dev:
            return  # another filesystem: not entered
        wd = _LIBC.inotify_add_watch(self.fd, f"/proc/self/fd/{dir_fd}".encode(), MASK | IN_ONLYDIR)
        if wd < 0:
            err = ctypes.get_errno()
            raise FileProblem("invalid", f"cannot watch {rel or 'the directory'}: {os.strerror(err)}")
        self._dirs[wd] = rel

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Deliver changes from now on (in the loop's thread)."""
        self._loop = loop
        loop.add_reader(self.fd, self._readable)

    def take(self) -> list[Change]:
        taken = list(self.changes)
        self.changes.clear()
        self.wake.clear()
        return taken

    def _end(self, why: str | None) -> None:
        if not self.ended:
            self.ended = True
            self.failed = why
            self.wake.set()

    def _readable(self) -> None:
        try:
            buf = os.read(self.fd, READ_BYTES)
        except BlockingIOError:
            return
        except OSError as exc:
            self._end(f"the watch failed: {exc.strerror}")
            self.close()
            return
        offset = 0
        while offset + HEADER.size <= len(buf):
            wd, mask, _cookie, length = HEADER.unpack_from(buf, offset)
            raw = buf[offset + HEADER.size : offset + HEADER.size + length]
            offset += HEADER.size + length
            self._event(wd, mask, raw.rstrip(b"\0").decode(errors="surrogateescape"))
        if self.ended:
            self.close()

    def _event(self, wd: int, mask: int, name: str) -> None:
        if self.ended:
            return
        if mask & IN_Q_OVERFLOW:
            self._end("too many changes at once: the kernel's event queue overflowed")
            return
        rel = self._dirs.get(wd)
        if rel is None:
            return
        if mask & IN_IGNORED:
            del self._dirs[wd]
            if rel == "" or not self._dirs:
                self._end(None)  # the watched directory is gone
            return
        if mask & (IN_DELETE_SELF | IN_MOVE_SELF):
            if rel == "":
                self._end(None)
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
            self._end(str(exc))
        finally:
            os.close(sub)

    def _note(self, change: Change) -> None:
        if self.changes and self.changes[-1] == change:
            return
        if len(self.changes) >= self.max_events:
            self._end(f"more than {self.max_events} changes not yet read: the watch was stopped")
            return
        self.changes.append(change)
        self.wake.set()

    def close(self) -> None:
        if self._loop is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self.fd)
            self._loop = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self._ws_open:
            os.close(self.ws.fd)
            self._ws_open = False
        self._end(self.failed)
