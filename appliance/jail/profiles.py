"""Preload profiles: which warm jail a run should get, from what its code imports. Pure.

Every warm jail has imported its profile's modules before any run (SANDBOX_PRELOAD_PROFILES;
by default `bare` with nothing and `science` with numpy, pandas and matplotlib, plus
`tools` with the model libraries in GPU mode). A run goes to the smallest profile that
covers the modules its code imports among those any profile preloads: stdlib-only code
gets a bare jail, several times cheaper to start; pandas code gets a jail that has pandas
already. Code whose imports the scan cannot see (importlib, exec, __import__) still works:
it imports at run time, slower but correct.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

# Code longer than this is scanned with a pattern instead of parsed: the scan runs on the
# server's event loop, and a pattern is linear in the code's size.
MAX_PARSE_CHARS = 64 * 1024
IMPORT_RE = re.compile(r"^[ \t]*(?:from[ \t]+([A-Za-z_][\w.]*)[ \t]+import\b|import[ \t]+([^\n#;]+))", re.M)


@dataclass(frozen=True)
class Profile:
    """One kind of warm jail: a name and the modules its jails import before any run."""

    name: str
    modules: tuple[str, ...]

    @property
    def tops(self) -> frozenset[str]:
        """The top-level packages it preloads (`matplotlib` for `matplotlib.pyplot`)."""
        return frozenset(m.split(".", 1)[0] for m in self.modules)


def imports_of(code: str) -> frozenset[str]:
    """Top-level names of the modules the code imports anywhere (functions, branches included)."""
    if "import" not in code:
        # Every import statement spells the keyword in ASCII (a look-alike such as a
        # full-width one is a syntax error), so this code imports nothing: no parse needed.
        # It is what most one-shot runs look like, and the scan runs on the event loop.
        return frozenset()
    if len(code) > MAX_PARSE_CHARS:
        return _imports_by_pattern(code)
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return _imports_by_pattern(code)
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".", 1)[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".", 1)[0])
    return frozenset(found)


def _imports_by_pattern(code: str) -> frozenset[str]:
    found: set[str] = set()
    for match in IMPORT_RE.finditer(code):
        if match.group(1):
            found.add(match.group(1).split(".", 1)[0])
        else:
            for part in match.group(2).split(","):
                name = part.strip().split(" ", 1)[0]
                if name:
                    found.add(name.split(".", 1)[0])
    return frozenset(found)


def choose(profiles: tuple[Profile, ...], imports: frozenset[str]) -> Profile:
    """The smallest profile that preloads every import any profile could; failing that (no
    single profile has them all), the one that has the most of them, the larger on a tie."""
    if not profiles:
        raise ValueError("no preload profiles")
    if not imports:  # every profile covers nothing: the smallest (what follows would say so too)
        return min(profiles, key=lambda p: len(p.modules))
    known = frozenset().union(*(p.tops for p in profiles))
    wanted = imports & known
    covering = [p for p in profiles if wanted <= p.tops]
    if covering:
        return min(covering, key=lambda p: len(p.modules))
    return max(profiles, key=lambda p: (len(wanted & p.tops), len(p.modules)))
