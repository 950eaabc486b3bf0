"""Files a run wrote under /workspace/outputs: read safely, returned as frames, persisted.

The server reads the run directory on the host as a privileged user, so every step
refuses links: directories are walked with fwalk (no symlinks followed) and files are
opened O_NOFOLLOW and must be regular, owned by the sandbox uid and singly linked.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

Snapshot = dict[str, tuple[int, int]]


@dataclass(frozen=True)
class OutputFile:
    path: str              # relative to outputs/
    size: int
    data: bytes | None     # None when over the size cap
    message: str | None = None


def _walk(outputs: Path, uid: int) -> dict[str, tuple[int, int, int, int]]:
    """path -> (dir_fd-independent) (size, mtime_ns, ino, dev) of eligible regular files."""
    found: dict[str, tuple[int, int, int, int]] = {}
    if not outputs.is_dir() or outputs.is_symlink():
        return found
    for root, _dirs, files, root_fd in os.fwalk(outputs, follow_symlinks=False):
        rel_root = os.path.relpath(root, outputs)
        for name in files:
            try:
                st = os.stat(name, dir_fd=root_fd, follow_symlinks=False)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode) or st.st_uid != uid or st.st_nlink != 1:
                continue
            rel = name if rel_root == "." else os.path.join(rel_root, name)
            found[rel] = (st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)
    return found


def has_any(workdir: Path) -> bool:
    """Whether outputs/ holds anything at all (a cheap check before a full, careful walk)."""
    try:
        with os.scandir(workdir / "outputs") as it:
            return any(True for _ in it)
    except OSError:
        return False


def snapshot(workdir: Path, uid: int) -> Snapshot:
    """What outputs/ holds now, to tell later which files a cell changed."""
    return {rel: (v[0], v[1]) for rel, v in _walk(workdir / "outputs", uid).items()}


def collect(workdir: Path, uid: int, before: Snapshot | None, max_file_bytes: int) -> list[OutputFile]:
    """The files under outputs/ that are new or changed since `before` (all, if None)."""
    outputs = workdir / "outputs"
    result: list[OutputFile] = []
    for rel, (size, mtime, _ino, _dev) in sorted(_walk(outputs, uid).items()):
        if before is not None and before.get(rel) == (size, mtime):
            continue
        if size > max_file_bytes:
            result.append(OutputFile(rel, size, None, f"larger than SANDBOX_MAX_FILE_OUT_BYTES ({max_file_bytes})"))
            continue
        data = _read_nofollow(outputs, rel, uid, max_file_bytes)
        if data is None:
            continue
        result.append(OutputFile(rel, len(data), data))
    return result


def _read_nofollow(outputs: Path, rel: str, uid: int, limit: int) -> bytes | None:
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
    parts = rel.split(os.sep)
    try:
        dir_fd = os.open(outputs, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        for part in parts[:-1]:
            nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
            os.close(dir_fd)
            dir_fd = nxt
        fd = os.open(parts[-1], flags, dir_fd=dir_fd)
    except OSError:
        os.close(dir_fd)
        return None
    os.close(dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != uid or st.st_nlink != 1:
            return None
        data = os.read(fd, limit + 1)
        return data if len(data) <= limit else None
    finally:
        os.close(fd)


def persist(files: list[OutputFile], root: Path, run_id: str) -> None:
    """Copy files into root/<run_id>/ (a directory made fresh for this run)."""
    if not files:
        return
    base = root / run_id
    base.mkdir(parents=True, exist_ok=True)
    for item in files:
        if item.data is None:
            continue
        target = base / item.path
        target.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "wb") as fh:
            fh.write(item.data)
