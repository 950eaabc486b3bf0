"""Trust only directories the server owns: the temp root's chain, checked by descriptor.

The server (root) runs code it staged under SANDBOX_TMP_ROOT in every jail and writes the
jail's passwd there, so a directory someone else made or can write in would let them
put code or files in front of every tenant. Before it uses or reuses anything there the
server checks, one component at a time from `/` and each relative to its parent's
descriptor (`O_DIRECTORY | O_NOFOLLOW`, then fstat: no path is looked up twice, no link
is followed):

- every ancestor of the root is a directory owned by root or by the server's uid, and no
  one else may write in it, unless it is sticky and root-owned (`/tmp`: others may add
  entries there but never rename or remove root's);
- every directory the server makes or reuses below the root is owned by the server's uid
  and writable by it alone.

A directory that fails is not repaired (someone else may hold it open or have planted a
file in it already): startup stops (StartupError, exit 2) naming the path and the fix.
Modes are set with fchmod on the descriptor that was checked. `policy` is pure; the rest is
thin I/O around it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from appliance.core.errors import StartupError
from appliance.sandbox import fstree

WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH


def policy(st: os.stat_result, server_uid: int, ancestor: bool) -> str | None:
    """Why a directory (as fstat saw it) cannot be trusted by a server of uid server_uid, or
    None. An ancestor may be root's even when the server is not root, and a sticky root-owned
    one (/tmp) may be writable by others; a directory of the server's own may not."""
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    owners = {0, server_uid} if ancestor else {server_uid}
    if st.st_uid not in owners:
        return f"is owned by uid {st.st_uid}, not by the server (uid {server_uid})"
    if st.st_mode & WRITABLE_BY_OTHERS:
        if ancestor and st.st_mode & stat.S_ISVTX and st.st_uid == 0:
            return None
        return f"is writable by others (mode {stat.filemode(st.st_mode)})"
    return None


TMP_ROOT = "SANDBOX_TMP_ROOT"


def fix_for(path: Path, setting: str = TMP_ROOT) -> str:
    where = " (the default is /run)" if setting == TMP_ROOT else ""
    return (
        f"check what it holds, then remove it (rm -rf {path}) or set {setting} to a directory "
        f"only root can write in{where}"
    )


def refusal(path: Path, why: str, setting: str = TMP_ROOT) -> StartupError:
    return StartupError(
        f"{setting}: {path} {why}: the server trusts only what it owns; {fix_for(path, setting)}"
    )


def open_root(root: Path, server_uid: int, setting: str = TMP_ROOT) -> int:
    """A descriptor of `root` (an absolute path), every component from `/` checked as an
    ancestor (a missing one is made, 0755); StartupError naming the first that fails."""
    if not root.is_absolute():
        raise StartupError(f"{setting}: {root} is not an absolute path")
    fd = os.open("/", fstree.DIR_FLAGS)
    path = Path("/")
    try:
        _check(fd, path, server_uid, ancestor=True, setting=setting)
        for part in root.parts[1:]:
            path = path / part
            with contextlib.suppress(FileExistsError):  # made here (as before): its parent is checked
                os.mkdir(part, 0o755, dir_fd=fd)
            try:
                child = os.open(part, fstree.DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                raise refusal(path, _open_problem(exc), setting) from exc
            os.close(fd)
            fd = child
            _check(fd, path, server_uid, ancestor=True, setting=setting)
    except BaseException:
        os.close(fd)
        raise
    return fd


def ensure_dir(  # noqa: PLR0913 (the directory, its mode, and whose setting it is)
    parent_fd: int, parent: Path, name: str, mode: int, server_uid: int, setting: str = TMP_ROOT
) -> int:
    """A descriptor of directory `name` in the (checked) directory parent_fd, made with `mode`
    if absent; an existing one must be the server's own and writable by it alone (its mode
    is then set to `mode`, by descriptor). StartupError otherwise."""
    path = parent / name
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, 0o700, dir_fd=parent_fd)  # 0700 until checked and set below
    try:
        fd = os.open(name, fstree.DIR_FLAGS, dir_fd=parent_fd)
    except OSError as exc:
        raise refusal(path, _open_problem(exc), setting) from exc
    try:
        _check(fd, path, server_uid, ancestor=False, setting=setting)
        os.fchmod(fd, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def tree_problem(dir_fd: int, server_uid: int) -> str | None:
    """Why a staged read-only tree (the runtime, the wheel cache) is not wholly the server's
    own, or None: every entry below must be a directory or regular file of the server's uid,
    writable by it alone; a link, a device or another owner means someone else made it."""
    walk = fstree.Walk(dir_fd)
    for entry in walk:
        st = entry.stat
        if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
            return f"{entry.rel} is not a regular file or directory"
        if st.st_uid != server_uid:
            return f"{entry.rel} is owned by uid {st.st_uid}"
        if st.st_mode & WRITABLE_BY_OTHERS:
            return f"{entry.rel} is writable by others"
    if walk.errors or walk.too_deep:
        return "it could not be read whole"
    return None


def _check(fd: int, path: Path, server_uid: int, ancestor: bool, setting: str = TMP_ROOT) -> None:
    why = policy(os.fstat(fd), server_uid, ancestor)
    if why is not None:
        raise refusal(path, why, setting)


def _open_problem(exc: OSError) -> str:
    if exc.errno in (errno.ELOOP, errno.ENOTDIR):  # O_NOFOLLOW met a link, or not a directory
        return "is a symbolic link or not a directory"
    return f"cannot be opened ({exc.strerror})"


@contextlib.contextmanager
def held(fd: int) -> Iterator[int]:
    """Close a descriptor from open_root / ensure_dir when the block ends."""
    try:
        yield fd
    finally:
        os.close(fd)
