"""Process trees as /proc shows them (every thread's children, not only the main thread's)."""

from __future__ import annotations

import os


def _read(path: str) -> bytes:
    """A /proc file's bytes. A raw read: a text-mode open() cost twice as long, and the
    disk check at every cell's end reads several of these."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def children(pid: int) -> list[int]:
    """Direct children of pid, forked by any of its threads."""
    found: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tids:
        try:
            found.extend(int(k) for k in _read(f"/proc/{pid}/task/{tid}/children").split())
        except (OSError, ValueError):
            continue
    return found


def tree(root: int) -> list[int]:
    """root and every live process below it."""
    return [root, *below([root])]


def below(tops: list[int]) -> list[int]:
    """Every live process below any of tops (tops themselves left out)."""
    found: list[int] = []
    seen = set(tops)
    stack = list(tops)
    while stack:
        for kid in children(stack.pop()):
            if kid not in seen:
                seen.add(kid)
                found.append(kid)
                stack.append(kid)
    return found


def descendants(root: int) -> list[int]:
    """Every process below root that is still running: root itself and zombies left out.

    The one meaning of "descendants" in the house: a zombie holds no memory, no files and
    runs nothing, so whoever asks "is anything of this run left?" should not see it.
    """
    return [pid for pid in tree(root)[1:] if state(pid) not in ("Z", "X", "")]


def state(pid: int) -> str:
    """The one-letter state /proc gives pid (R, S, D, Z, ...), or "" when it is gone."""
    try:  # after the last ")": the command name in parentheses may hold anything
        return _read(f"/proc/{pid}/stat").rsplit(b")", 1)[1].split()[0].decode("ascii")
    except (OSError, IndexError, UnicodeDecodeError):
        return ""


def task_ids(pids: set[int]) -> set[int]:
    """Every task (thread) ID of these processes, the process IDs included.

    NVML may report the thread that created a CUDA context instead of its process.
    """
    found = set(pids)
    for pid in pids:
        try:
            found.update(int(t) for t in os.listdir(f"/proc/{pid}/task"))
        except (OSError, ValueError):
            continue
    return found
