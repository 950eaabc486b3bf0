"""Walk and remove directory trees a run made, safely, as the privileged server.

Jailed code controls everything under its run directory: how deep it nests, what is a
link, and what it renames while the server looks (`renameat2(RENAME_EXCHANGE)` swaps a
directory for a symlink atomically). So both operations here

- never recurse (a loop with an explicit stack: a 100,000-deep tree costs a list, not
  the interpreter's stack),
- reach every directory by a descriptor opened relative to its parent's descriptor with
  `O_DIRECTORY | O_NOFOLLOW`, never by a path: a name swapped for a symlink fails to open
  (ELOOP/ENOTDIR) instead of leading to the host, and a directory moved while it is open
  stays the directory that was opened,
- never cross into another filesystem (a jail's /tmp holds bind mounts of the runtime).

`Walk` holds one descriptor per level, so it stops at `max_depth` and says so
(`too_deep`); `remove_tree` holds at most `REMOVE_HELD_FDS` and flattens anything deeper
by renaming it up to the top of the tree it removes, so no depth is too deep for it.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("appliance.sandbox.fstree")

# Deepest directory a walk enters below its root. One descriptor is held per level, so this
# also bounds what one walk costs of the server's descriptors. Real trees are a few dozen
# levels deep (node_modules, site-packages); a run nesting deeper is stopped by the disk
# watchdog, whose quota cannot be measured past this.
MAX_DEPTH = 128
REMOVE_HELD_FDS = 32  # descriptors remove_tree holds at most; deeper directories are moved up

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


@dataclass(frozen=True)
class Entry:
    """One entry below a walk's root, as lstat saw it.

    `dir_fd` is the open directory holding it, valid only until the walk moves on: open the
    entry with `open_file(entry)` (relative to that descriptor, links refused)."""

    rel: str  # path below the root, "/"-separated
    name: str
    dir_fd: int
    stat: os.stat_result

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.stat.st_mode)


def open_dir(path: Path | str) -> int:
    """A descriptor of the directory `path`, its last component not followed if a link."""
    return os.open(path, DIR_FLAGS)


def reopen_dir(dir_fd: int) -> int:
    """A descriptor of the directory dir_fd is open on, with a file position of its own: a walk
    reads it to the end, and another walk of the same directory may be under way."""
    return os.open(".", DIR_FLAGS, dir_fd=dir_fd)


def open_file(entry: Entry) -> int:
    """Open a walked entry for reading relative to its directory's descriptor, O_NOFOLLOW."""
    return os.open(entry.name, FILE_FLAGS, dir_fd=entry.dir_fd)


@dataclass
class Walk:
    """Every entry below `root`, depth first in name order, without following links.

    Iterate it once. Directories deeper than `max_depth` are not entered: `too_deep` counts
    them. With `one_fs`, entries on another filesystem than root are neither yielded nor
    entered. Entries that vanish mid-walk are skipped (the tree may be live). With
    `list_limit`, no directory is listed past that many entries (plus one, to show there were
    more): for a caller that stops counting there, so one huge directory costs no more."""

    root: Path | int  # a path, or an open descriptor of the directory (left open)
    max_depth: int = MAX_DEPTH
    one_fs: bool = True
    list_limit: int | None = None
    too_deep: int = 0
    errors: int = 0
    _device: int = field(default=-1, repr=False)

    def __iter__(self) -> Iterator[Entry]:
        for rel, name, dir_fd, st in self._walk(named=True):
            yield Entry(rel, name, dir_fd, st)

    def stats(self) -> Iterator[os.stat_result]:
        """The lstat of every entry, as `iter` would find them but in no set order (what
        a count needs, without an Entry, a path or a sort for each)."""
        for _rel, _name, _dir_fd, st in self._walk(named=False):
            yield st

    def _walk(self, named: bool) -> Iterator[tuple[str, str, int, os.stat_result]]:
        """(path below root, name, open directory, lstat) of each entry; the path and the
        name order only when `named`."""
        try:
            fd = open_dir(self.root) if not isinstance(self.root, int) else reopen_dir(self.root)
        except OSError:
            self.errors += 1
            return
        # Each frame: (descriptor, its path below root, its entries not yet handled).
        stack: list[tuple[int, str, list[tuple[str, os.stat_result]]]] = []
        try:
            self._device = os.fstat(fd).st_dev
            stack.append((fd, "", self._list(fd, named)))
            while stack:
                dir_fd, rel, pending = stack[-1]
                if not pending:
                    stack.pop()
                    os.close(dir_fd)
                    continue
                name, st = pending.pop()
                child_rel = (f"{rel}/{name}" if rel else name) if named else ""
                yield child_rel, name, dir_fd, st
                if not stat.S_ISDIR(st.st_mode):
                    continue
                if len(stack) > self.max_depth - 1:
                    self.too_deep += 1
                    continue
                try:
                    child = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
                except OSError:  # gone, or swapped for a link/file since it was listed
                    self.errors += 1
                    continue
                try:
                    cst = os.fstat(child)
                except OSError:
                    os.close(child)
                    self.errors += 1
                    continue
                if self.one_fs and cst.st_dev != self._device:
                    os.close(child)
                    continue
                stack.append((child, child_rel, self._list(child, named)))
        finally:
            for dir_fd, _rel, _pending in stack:
                os.close(dir_fd)

    def _list(self, dir_fd: int, ordered: bool = True) -> list[tuple[str, os.stat_result]]:
        """(name, lstat) of a directory's entries, in reverse name order (popped from the end)
        if `ordered`."""
        found: list[tuple[str, os.stat_result]] = []
        try:
            with os.scandir(dir_fd) as it:
                for entry in it:
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    if self.one_fs and st.st_dev != self._device:
                        continue
                    found.append((entry.name, st))
                    if self.list_limit is not None and len(found) > self.list_limit:
                        break
        except OSError:
            self.errors += 1
        if ordered:
            found.sort(key=lambda item: item[0], reverse=True)
        return found


def usage(root: Path | int, max_entries: int, max_depth: int = MAX_DEPTH) -> tuple[int, int, int]:
    """(bytes allocated, entries, directories too deep to enter) below root (a path, or an open
    descriptor of the directory) on its own filesystem; counting stops once entries exceed
    max_entries."""
    walk = Walk(root, max_depth=max_depth, list_limit=max_entries)
    total = entries = 0
    for st in walk.stats():
        entries += 1
        total += st.st_blocks * 512
        if entries > max_entries:
            break
    return total, entries, walk.too_deep


def remove_tree(path: Path) -> bool:
    """Remove path and everything below it, whatever its depth; True when it is gone.

    Never raises for what the tree holds: what cannot be removed is logged and left. The
    parent of `path` is the server's own directory; nothing below it is trusted."""
    try:
        parent = open_dir(path.parent)
    except OSError as exc:
        log.error("cannot open the parent of a tree to remove", extra={"path": str(path), "error": str(exc)})
        return False
    try:
        remove_at(parent, path.name)
        return True
    except OSError as exc:
        log.error("could not remove a tree completely", extra={"path": str(path), "error": str(exc)})
        return False
    finally:
        os.close(parent)


def remove_at(parent: int, name: str) -> None:
    """Remove entry `name` of the open directory `parent` and, a directory, everything below
    it, following no link and entering no other filesystem; gone already is done. OSError
    for what could not be removed."""
    try:
        st = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=parent)
        return
    _empty(parent, name, st.st_dev)
    os.rmdir(name, dir_fd=parent)


def _empty(parent: int, name: str, device: int) -> None:  # noqa: C901 (an iterative walk holding few descriptors; each branch one kind of entry)
    """Empty directory `name` (in `parent`) without recursion, holding at most
    REMOVE_HELD_FDS descriptors: a directory found deeper is renamed into the top
    directory and emptied from there later."""
    top = os.open(name, DIR_FLAGS, dir_fd=parent)
    # Frames: (descriptor, subdirectories still to empty and remove).
    stack: list[tuple[int, list[str]]] = []
    moved = 0
    try:
        stack.append((top, _unlink_files(top, device)))
        while stack:
            dir_fd, subdirs = stack[-1]
            if not subdirs:
                stack.pop()
                os.close(dir_fd)
                if stack:
                    up_fd, up_subdirs = stack[-1]
                    with contextlib.suppress(FileNotFoundError):
                        os.rmdir(up_subdirs.pop(), dir_fd=up_fd)
                continue
            sub = subdirs[-1]
            if len(stack) >= REMOVE_HELD_FDS:
                # Too deep to hold another descriptor: move it to the top and take it up there.
                while True:
                    moved += 1
                    flat = f".appliance-rm-{moved}"
                    try:
                        os.rename(sub, flat, src_dir_fd=dir_fd, dst_dir_fd=top)
                        break
                    except FileExistsError:
                        continue
                    except OSError as exc:
                        if exc.errno == errno.ENOTEMPTY:  # a directory of that name exists
                            continue
                        raise
                subdirs.pop()
                stack[0][1].insert(0, flat)
                continue
            try:
                child = os.open(sub, DIR_FLAGS, dir_fd=dir_fd)
            except FileNotFoundError:
                subdirs.pop()
                continue
            if os.fstat(child).st_dev != device:  # a mount point: not ours to empty
                os.close(child)
                raise OSError(16, f"a mount point lies under the tree: {sub!r}")
            stack.append((child, _unlink_files(child, device)))
    finally:
        for dir_fd, _subdirs in stack:
            os.close(dir_fd)


def _unlink_files(dir_fd: int, device: int) -> list[str]:
    """Unlink every non-directory in dir_fd; return the names of its subdirectories."""
    subdirs: list[str] = []
    with os.scandir(dir_fd) as it:
        names = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
    for name, is_dir in names:
        if is_dir:
            subdirs.append(name)
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=dir_fd)
    return subdirs
