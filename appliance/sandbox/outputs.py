"""Files a run wrote under /workspace/outputs: read safely, streamed as `file` events, persisted.

The server reads the run directory on the host as a privileged user, so every step
refuses links: directories are walked by descriptor (`jail.fstree`, no symlink followed,
no recursion on the code's depth) and files are opened O_NOFOLLOW relative to their
directory and must be regular, owned by the sandbox uid and singly linked.

What a run gets back is bounded three times: each file by SANDBOX_MAX_FILE_OUT_BYTES, all of
a run's files together by SANDBOX_MAX_OUTPUTS_BYTES, counted in the bytes actually read (a
sparse file costs its apparent size, not its blocks) and at least a block (BLOCK) per file and
per directory it needs (an empty file still costs an inode and a frame), and their number,
directories included, by SANDBOX_MAX_OUTPUT_FILES. Files are read one at a time as they
are sent (`stream`), never all at once; persistence writes the same files as they pass.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from appliance.sandbox import fstree

Snapshot = dict[str, tuple[int, int]]
CHUNK = 1 << 20
BLOCK = 4096  # what the smallest file or directory costs against the budget


@dataclass(frozen=True)
class OutputFile:
    path: str  # relative to outputs/
    size: int
    data: bytes | None  # None when over the size cap
    message: str | None = None


@dataclass
class Tally:
    """What a streamed collection sent and left out; filled in as `stream` goes."""

    budget: int
    max_entries: int = 1000  # files and the directories they need (SANDBOX_MAX_OUTPUT_FILES)
    sent_bytes: int = 0  # charged: each file and new directory at least BLOCK
    entries: int = 0
    skipped: int = 0  # files not returned: past the budget or the entry cap
    too_deep: int = 0  # directories under outputs/ too deep to be read
    dirs: set[str] = field(default_factory=set)  # directories already charged

    def charge(self, rel: str, size: int) -> bool:
        """Count a file of `size` bytes at `rel` (and the directories it needs, once each);
        False, counting nothing, when that would pass the budget or the entry cap."""
        parts = rel.split("/")[:-1]
        new = [d for d in ("/".join(parts[: i + 1]) for i in range(len(parts))) if d not in self.dirs]
        cost = max(size, BLOCK) + BLOCK * len(new)
        if self.sent_bytes + cost > self.budget or self.entries + 1 + len(new) > self.max_entries:
            return False
        self.sent_bytes += cost
        self.entries += 1 + len(new)
        self.dirs.update(new)
        return True

    def note(self) -> str | None:
        """Why some files did not come back, for the run's `done`; None when all did."""
        parts = []
        if self.skipped:
            parts.append(
                f"{self.skipped} outputs/ file(s) not returned: together they pass "
                f"SANDBOX_MAX_OUTPUTS_BYTES ({self.budget} bytes, at least {BLOCK} per file or "
                f"directory) or SANDBOX_MAX_OUTPUT_FILES ({self.max_entries} files and directories)"
            )
        if self.too_deep:
            parts.append(f"outputs/ directories nested deeper than {fstree.MAX_DEPTH} levels were not read")
        return "; ".join(parts) or None


def _eligible(st: os.stat_result, uid: int) -> bool:
    return stat.S_ISREG(st.st_mode) and st.st_uid == uid and st.st_nlink == 1


def has_any(workdir: Path) -> bool:
    """Whether outputs/ holds anything at all (a cheap check before a full, careful walk)."""
    try:
        with os.scandir(os.path.join(workdir, "outputs")) as it:
            return any(True for _ in it)
    except OSError:
        return False


def snapshot(workdir: Path, uid: int) -> Snapshot:
    """What outputs/ holds now, to tell later which files a cell changed."""
    return {
        e.rel: (e.stat.st_size, e.stat.st_mtime_ns)
        for e in fstree.Walk(workdir / "outputs")
        if _eligible(e.stat, uid)
    }


def stream(  # noqa: C901 (one walk of outputs/; each branch refuses an unsafe or oversize entry)
    workdir: Path, uid: int, before: Snapshot | None, max_file_bytes: int, tally: Tally
) -> Generator[OutputFile, None, None]:
    """The files under outputs/ that are new or changed since `before` (all, if None), one at
    a time, read only when reached. Once the next file would pass the tally's budget it and
    every later one are skipped (counted in `tally.skipped`). Blocking: advance it in a thread."""
    walk = fstree.Walk(workdir / "outputs")
    try:
        for entry in walk:
            st = entry.stat
            if not _eligible(st, uid):
                continue
            if before is not None and before.get(entry.rel) == (st.st_size, st.st_mtime_ns):
                continue
            if tally.skipped:
                tally.skipped += 1
                continue
            if st.st_size > max_file_bytes:
                if not tally.charge(entry.rel, 0):  # its frame and entry still cost a block
                    tally.skipped += 1
                    continue
                yield OutputFile(
                    entry.rel, st.st_size, None, f"larger than SANDBOX_MAX_FILE_OUT_BYTES ({max_file_bytes})"
                )
                continue
            if not tally.charge(entry.rel, st.st_size):
                tally.skipped += 1
                continue
            data = _read(entry, uid, max_file_bytes)
            if data is None:
                continue
            if len(data) > max_file_bytes:  # it grew since it was listed
                yield OutputFile(
                    entry.rel, len(data), None, f"larger than SANDBOX_MAX_FILE_OUT_BYTES ({max_file_bytes})"
                )
                continue
            if len(data) > max(st.st_size, BLOCK):  # it grew since it was listed: charge the rest
                grown = len(data) - max(st.st_size, BLOCK)
                if tally.sent_bytes + grown > tally.budget:
                    tally.skipped += 1
                    continue
                tally.sent_bytes += grown
            yield OutputFile(entry.rel, len(data), data)
    finally:
        tally.too_deep = walk.too_deep


def next_batch(
    files: Iterator[OutputFile], max_bytes: int = 4 * CHUNK, max_items: int = 256
) -> list[OutputFile]:
    """The next few files of `stream` (up to max_bytes of data or max_items); [] at its end.
    Blocking: one thread hop per batch rather than per file."""
    batch: list[OutputFile] = []
    size = 0
    for item in files:
        batch.append(item)
        size += len(item.data or b"")
        if size >= max_bytes or len(batch) >= max_items:
            break
    return batch


def _read(entry: fstree.Entry, uid: int, limit: int) -> bytes | None:
    """Up to limit + 1 bytes of a walked file, or None when it is not (any more) eligible."""
    try:
        fd = fstree.open_file(entry)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not _eligible(st, uid) or st.st_ino != entry.stat.st_ino:
            return None
        chunks: list[bytes] = []
        got = 0
        while got <= limit:
            chunk = os.read(fd, min(CHUNK, limit + 1 - got))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)


class Persister:
    """Writes a run's files, as they are sent, under root/<tenant>/<run_id>/ (made fresh for it).

    Each tenant has a directory of its own (`tenant_dir`); every directory is 0700 and every
    file 0600, the server's: tenants never share one, and only the operator reads them.
    Paths are made one directory at a time relative to descriptors, O_NOFOLLOW: a name
    can never lead outside the run's own directory, and any depth the walk returns fits."""

    def __init__(self, root: Path, owner: str, run_id: str) -> None:
        self.root = root
        self.tenant = tenant_dir(owner)
        self.base = root / self.tenant / run_id
        self.run_id = run_id
        self._fd: int | None = None

    def _open_base(self) -> int:
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = fstree.open_dir(self.root)
        try:
            for name in (self.tenant, self.run_id):
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o700, dir_fd=fd)
                nxt = os.open(name, fstree.DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = nxt
            return fd
        except BaseException:
            os.close(fd)
            raise

    def write(self, item: OutputFile) -> None:
        if item.data is None:
            return
        if self._fd is None:
            self._fd = self._open_base()
        parts = item.path.split("/")
        dir_fd = os.dup(self._fd)
        try:
            for part in parts[:-1]:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o700, dir_fd=dir_fd)
                nxt = os.open(part, fstree.DIR_FLAGS, dir_fd=dir_fd)
                os.close(dir_fd)
                dir_fd = nxt
            fd = os.open(
                parts[-1],
                os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o600,
                dir_fd=dir_fd,
            )
            with os.fdopen(fd, "wb") as fh:
                fh.write(item.data)
        finally:
            os.close(dir_fd)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def tenant_dir(owner: str) -> str:
    """The directory name of a tenant's persisted outputs: a hash of its owner name (itself
    a hash of its token), the same for every run of that tenant, the token never derivable."""
    return "t-" + hashlib.sha256(b"outputs\0" + owner.encode()).hexdigest()[:32]


def sweep(root: Path, max_age_s: float, now: float) -> int:
    """Remove the persisted runs under root/<tenant>/ whose directory was last changed more
    than max_age_s before `now` (SANDBOX_OUTPUTS_RETENTION_S); how many went. Links and
    files at those levels are not the server's layout and are left alone."""
    removed = 0
    try:
        with os.scandir(root) as it:
            tenants = [e.path for e in it if e.is_dir(follow_symlinks=False)]
    except OSError:
        return 0
    for tenant in tenants:
        try:
            with os.scandir(tenant) as it:
                runs = [
                    (e.path, e.stat(follow_symlinks=False).st_mtime)
                    for e in it
                    if e.is_dir(follow_symlinks=False)
                ]
        except OSError:
            continue
        for path, mtime in runs:
            if now - mtime > max_age_s and fstree.remove_tree(Path(path)):
                removed += 1
    return removed
