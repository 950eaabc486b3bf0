"""A jail's working directory, read and written from outside by the server (E2B's files).

The server is root here and the directory is the jailed code's: it may hold links to
anywhere, names swapped for links while the server looks (`renameat2(RENAME_EXCHANGE)`),
FIFOs, hard links and mount points. So, like `outputs` and `fstree`:

- every path is walked from the run directory's descriptor one component at a time, each
  directory opened `O_DIRECTORY | O_NOFOLLOW` relative to the last (a link anywhere on the
  way fails with ELOOP/ENOTDIR instead of being followed), and never onto another
  filesystem; the last component is acted on with the *at calls, which follow no link;
- a file is read only if, opened `O_NOFOLLOW | O_NONBLOCK` (a FIFO does not block), it is
  regular, owned by the jail's uid and singly linked;
- a file is written by creating a new name `O_EXCL` (never opening what is there), handing
  it to the jail's uid, and renaming it over the target: a link at the target is replaced,
  not followed; directories made on the way are the jail's uid's too;
- a listing stops at the depth asked (at most `fstree.MAX_DEPTH`) and at `max_entries`.

What is written counts against the run directory's own tmpfs (SANDBOX_MAX_DISK_MB): ENOSPC
is the kernel's answer, reported as `FileProblem("no_space")`.

Every function here blocks; callers run them in a thread.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from dataclasses import dataclass

from appliance.core.ports import Workspace
from appliance.sandbox import fstree

FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
UPLOAD_PREFIX = ".appliance-upload-"
DIR_MODE = 0o755
FILE_MODE = 0o644


@dataclass
class FileProblem(Exception):
    """A file operation refused or failed, as the caller should hear it.

    kind: not_found, exists, not_dir, is_dir, refused (a link, a special or foreign file),
    invalid, too_many, no_space."""

    kind: str
    message: str

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class Info:
    name: str
    kind: str  # file, dir, symlink, other
    size: int
    mode: int  # st_mode
    mtime: float
    uid: int
    gid: int
    target: str | None = None  # a link's text, never followed


def kind_of(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "other"


def info_of(name: str, st: os.stat_result, dir_fd: int | None) -> Info:
    target = None
    if stat.S_ISLNK(st.st_mode) and dir_fd is not None:
        with contextlib.suppress(OSError):
            target = os.readlink(name, dir_fd=dir_fd)
    return Info(name, kind_of(st.st_mode), st.st_size, st.st_mode, st.st_mtime, st.st_uid, st.st_gid, target)


def _problem(exc: OSError, what: str) -> FileProblem:
    code = exc.errno
    if code == errno.ENOENT:
        return FileProblem("not_found", f"{what}: no such file or directory")
    if code in (errno.ELOOP, errno.EMLINK):
        return FileProblem("refused", f"{what}: a symbolic link is on the way (links are not followed)")
    if code == errno.ENOTDIR:
        return FileProblem("not_dir", f"{what}: not a directory (or a link to one, which is not followed)")
    if code == errno.EISDIR:
        return FileProblem("is_dir", f"{what}: is a directory")
    if code == errno.EEXIST:
        return FileProblem("exists", f"{what}: already exists")
    if code == errno.ENOTEMPTY:
        return FileProblem("exists", f"{what}: the destination is a directory that is not empty")
    if code in (errno.ENOSPC, errno.EDQUOT):
        return FileProblem("no_space", f"{what}: the sandbox's disk is full (SANDBOX_MAX_DISK_MB)")
    if code == errno.ENAMETOOLONG:
        return FileProblem("invalid", f"{what}: name too long")
    return FileProblem("invalid", f"{what}: {os.strerror(code) if code else exc}")


def _enter(dir_fd: int, name: str, ws: Workspace, create: bool, what: str) -> int:
    """Open directory `name` of dir_fd (made first if `create`), following no link, on the
    workspace's filesystem only."""
    made = False
    if create:
        try:
            os.mkdir(name, DIR_MODE, dir_fd=dir_fd)
            made = True
        except FileExistsError:
            pass
        except OSError as exc:
            raise _problem(exc, what) from None
    try:
        fd = os.open(name, fstree.DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        raise _problem(exc, what) from None
    try:
        st = os.fstat(fd)
        if st.st_dev != ws.dev:
            raise FileProblem("refused", f"{what}: another filesystem is mounted there")
        if made and st.st_uid == os.geteuid():
            os.fchown(fd, ws.uid, ws.gid)  # the jail's own, as if it had made it
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_dir(ws: Workspace, parts: tuple[str, ...], create: bool = False, shown: str = "") -> int:
    """A descriptor of the directory `parts` below the workspace (made, with its parents, if
    `create`); the caller closes it."""
    fd = fstree.reopen_dir(ws.fd)
    try:
        for i, part in enumerate(parts):
            nxt = _enter(fd, part, ws, create, shown or "/".join(parts[: i + 1]))
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def stat_path(ws: Workspace, parts: tuple[str, ...], shown: str) -> Info:
    """What is at `parts` (a link as a link)."""
    if not parts:
        st = os.fstat(ws.fd)
        return info_of("", st, None)
    parent = open_dir(ws, parts[:-1], shown=shown)
    try:
        st = os.stat(parts[-1], dir_fd=parent, follow_symlinks=False)
        return info_of(parts[-1], st, parent)
    except OSError as exc:
        raise _problem(exc, shown) from None
    finally:
        os.close(parent)


def listing(
    ws: Workspace, parts: tuple[str, ...], depth: int, max_entries: int, shown: str
) -> list[tuple[str, Info]]:
    """(path below `parts`, info) of every entry down to `depth` levels (1: its children);
    FileProblem("too_many") past max_entries."""
    top = open_dir(ws, parts, shown=shown)
    try:
        walk = fstree.Walk(top, max_depth=max(1, min(depth, fstree.MAX_DEPTH)), list_limit=max_entries)
        found: list[tuple[str, Info]] = []
        for entry in walk:
            if len(found) >= max_entries:
                raise FileProblem(
                    "too_many",
                    f"{shown}: more than {max_entries} entries to list; list a narrower directory or a smaller depth",
                )
            found.append((entry.rel, info_of(entry.name, entry.stat, entry.dir_fd)))
        return found
    finally:
        os.close(top)


def make_dir(ws: Workspace, parts: tuple[str, ...], shown: str) -> Info:
    """Make directory `parts` and its parents; FileProblem("exists") if it is there."""
    if not parts:
        raise FileProblem("exists", f"{shown}: already exists")
    parent = open_dir(ws, parts[:-1], create=True, shown=shown)
    try:
        try:
            os.mkdir(parts[-1], DIR_MODE, dir_fd=parent)
        except OSError as exc:
            raise _problem(exc, shown) from None
        fd = _enter(parent, parts[-1], ws, False, shown)
        try:
            st = os.fstat(fd)
            if st.st_uid == os.geteuid():
                os.fchown(fd, ws.uid, ws.gid)
            return info_of(parts[-1], os.fstat(fd), None)
        finally:
            os.close(fd)
    finally:
        os.close(parent)


def move(ws: Workspace, source: tuple[str, ...], dest: tuple[str, ...], shown: tuple[str, str]) -> Info:
    """Rename source to dest (dest's parents made); what moves is the entry, a link as a link."""
    if not source or not dest:
        raise FileProblem("invalid", "the working directory itself cannot be moved or replaced")
    src_dir = open_dir(ws, source[:-1], shown=shown[0])
    try:
        dst_dir = open_dir(ws, dest[:-1], create=True, shown=shown[1])
        try:
            try:
                os.rename(source[-1], dest[-1], src_dir_fd=src_dir, dst_dir_fd=dst_dir)
                st = os.stat(dest[-1], dir_fd=dst_dir, follow_symlinks=False)
            except OSError as exc:
                raise _problem(exc, f"{shown[0]} -> {shown[1]}") from None
            return info_of(dest[-1], st, dst_dir)
        finally:
            os.close(dst_dir)
    finally:
        os.close(src_dir)


def remove(ws: Workspace, parts: tuple[str, ...], shown: str) -> None:
    """Remove what is at `parts` (a directory with everything below it; a link, not what it names)."""
    if not parts:
        raise FileProblem("invalid", "the working directory itself cannot be removed")
    parent = open_dir(ws, parts[:-1], shown=shown)
    try:
        try:
            os.stat(parts[-1], dir_fd=parent, follow_symlinks=False)
            fstree.remove_at(parent, parts[-1])
        except OSError as exc:
            raise _problem(exc, shown) from None
    finally:
        os.close(parent)


def open_file(ws: Workspace, parts: tuple[str, ...], shown: str) -> tuple[int, int]:
    """(descriptor, size) of the regular file at `parts`, the jail's own and singly linked."""
    if not parts:
        raise FileProblem("is_dir", f"{shown}: is a directory")
    parent = open_dir(ws, parts[:-1], shown=shown)
    try:
        try:
            fd = os.open(parts[-1], FILE_FLAGS, dir_fd=parent)
        except OSError as exc:
            raise _problem(exc, shown) from None
    finally:
        os.close(parent)
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise FileProblem("is_dir", f"{shown}: is a directory")
        if not stat.S_ISREG(st.st_mode):
            raise FileProblem("refused", f"{shown}: not a regular file")
        if st.st_uid != ws.uid or st.st_nlink != 1 or st.st_dev != ws.dev:
            raise FileProblem(
                "refused", f"{shown}: not a file of the sandbox's own (another owner, or hard-linked)"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


class NewFile:
    """A file being written: a fresh name in its directory, renamed over the target at `commit`."""

    def __init__(self, ws: Workspace, parts: tuple[str, ...], shown: str) -> None:
        if not parts:
            raise FileProblem("is_dir", f"{shown}: is a directory")
        self.name = parts[-1]
        self.shown = shown
        self.temp = UPLOAD_PREFIX + secrets.token_hex(8)
        self.fd: int | None = None
        self.dir_fd = open_dir(ws, parts[:-1], create=True, shown=shown)
        self.size = 0
        try:
            self.fd = os.open(self.temp, NEW_FILE_FLAGS, FILE_MODE, dir_fd=self.dir_fd)
            os.fchown(self.fd, ws.uid, ws.gid)
        except OSError as exc:
            self.abort()
            raise _problem(exc, shown) from None

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        try:
            while view and self.fd is not None:
                n = os.write(self.fd, view)
                view = view[n:]
                self.size += n
        except OSError as exc:
            raise _problem(exc, self.shown) from None

    def commit(self) -> None:
        try:
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None
            os.rename(self.temp, self.name, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
        except OSError as exc:
            self.abort()
            raise _problem(exc, self.shown) from None
        self._close_dir()

    def abort(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.dir_fd >= 0:
            with contextlib.suppress(OSError):
                os.unlink(self.temp, dir_fd=self.dir_fd)
        self._close_dir()

    def _close_dir(self) -> None:
        if self.dir_fd >= 0:
            os.close(self.dir_fd)
            self.dir_fd = -1
