"""E2B's paths onto the jail's working directory; pure.

E2B's user lives in /home/user; the appliance's jailed code in /workspace. Both name the
same directory here: the working directory of the sandbox's default context (what
`run_code` sees as its cwd and $HOME). A relative path, `~` and `~/...` are relative to it.
Nothing outside it is reachable: any other absolute path is refused.

`..` is taken lexically (`/home/user/a/../b` is `/home/user/b`), never by following a link:
no link in the sandbox is ever followed by the server.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass

HOME = "/home/user"
WORKDIR = "/workspace"
ROOTS = (HOME, WORKDIR)
MAX_PATH_CHARS = 4096
MAX_NAME_CHARS = 255
MAX_PARTS = 128  # fstree.MAX_DEPTH: no deeper path is walked


class BadPath(ValueError):
    pass


@dataclass(frozen=True)
class Target:
    parts: tuple[str, ...]  # below the working directory
    root: str  # how the caller named the working directory: paths are reported the same way

    @property
    def shown(self) -> str:
        return self.under(self.parts)

    def under(self, parts: tuple[str, ...] | list[str]) -> str:
        return posixpath.join(self.root, *parts) if parts else self.root

    def child(self, rel: str) -> str:
        """The path of an entry `rel` ("a/b") below this target, as reported."""
        return self.under([*self.parts, *rel.split("/")])


def resolve(path: str) -> Target:
    """The working-directory path E2B's `path` names; BadPath when it names none."""
    if len(path) > MAX_PATH_CHARS:
        raise BadPath(f"path longer than {MAX_PATH_CHARS} characters")
    if "\x00" in path:
        raise BadPath("a path holds no NUL character")
    if path in ("", "~") or path.startswith("~/"):
        path = HOME + path[1:]
    elif not path.startswith("/"):
        path = f"{HOME}/{path}"
    norm = posixpath.normpath(path)
    if norm.startswith("//"):
        norm = "/" + norm.lstrip("/")
    for root in ROOTS:
        if norm == root or norm.startswith(root + "/"):
            parts = tuple(p for p in norm[len(root) :].split("/") if p)
            if len(parts) > MAX_PARTS:
                raise BadPath(f"path deeper than {MAX_PARTS} levels")
            if any(len(p.encode()) > MAX_NAME_CHARS for p in parts):
                raise BadPath(f"a path's name is longer than {MAX_NAME_CHARS} bytes")
            return Target(parts, root)
    raise BadPath(
        f"{path[:200]!r} is outside the sandbox's working directory: only {HOME} (the same as "
        f"{WORKDIR}) and paths below it are reachable"
    )
