"""Process trees as /proc shows them (every thread's children, not only the main thread's)."""

from __future__ import annotations

import os


def children(pid: int) -> list[int]:
    """Direct children of pid, forked by any of its threads."""
    found: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as fh:
                found.extend(int(k) for k in fh.read().split())
        except (OSError, ValueError):
            continue
    return found


def tree(root: int) -> list[int]:
    """root and every live process below it."""
    found = [root]
    seen = {root}
    stack = [root]
    while stack:
        for kid in children(stack.pop()):
            if kid not in seen:
                seen.add(kid)
                found.append(kid)
                stack.append(kid)
    return found
