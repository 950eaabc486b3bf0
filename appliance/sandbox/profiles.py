"""Preload profiles: which warm jail a run should get, from what its code imports. Pure.

Every warm jail has imported its profile's modules before any run (SANDBOX_PRELOAD_PROFILES;
by default `bare` with nothing and `science` with numpy, pandas and matplotlib, plus
`tools` with the model libraries in GPU mode). A run goes to the smallest profile that
covers the modules its code imports among those any profile preloads: stdlib-only code
gets a bare jail, several times cheaper to start; pandas code gets a jail that has pandas
already. Code whose imports the scan cannot see (importlib, exec, __import__) still works:
it imports at run time, slower but correct.

The scan runs on the server's event loop for every run, so its cost is bounded whatever the
code: a pattern over at most SCAN_CHARS characters, linear, and no `ast.parse` (some shapes
make the parser quadratic: tens of KiB of `import a.a.a…` hold the loop for most of a
second). Longer code is not scanned at all and gets the largest profile, which preloads the
most.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Code longer than this is not scanned (it gets the largest profile): the scan of the longest
# code it takes, in its most costly shape, is well under a millisecond of the event loop.
SCAN_CHARS = 16 * 1024
# An import statement starts a line or follows `;` or a `:` (`try: import numpy`). The
# pattern may also see one in a string: that costs a larger profile, never a wrong result.
IMPORT_RE = re.compile(
    r"(?:^|[;:])[ \t]*(?:from[ \t]+([A-Za-z_]\w*)(?:\.[\w.]*)?[ \t]+import\b|import[ \t]+([^\n#;]+))", re.M
)
# The top-level package of each name in an `import a.b as c, d` list.
LISTED_RE = re.compile(r"(?:^|,)[ \t(]*([A-Za-z_]\w*)")


@dataclass(frozen=True)
class Profile:
    """One kind of warm jail: a name and the modules its jails import before any run."""

    name: str
    modules: tuple[str, ...]

    @property
    def tops(self) -> frozenset[str]:
        """The top-level packages it preloads (`matplotlib` for `matplotlib.pyplot`)."""
        return frozenset(m.split(".", 1)[0] for m in self.modules)


def imports_of(code: str) -> frozenset[str] | None:
    """Top-level names of the modules the code imports anywhere (functions, branches included);
    None for code longer than SCAN_CHARS, which is not scanned."""
    if len(code) > SCAN_CHARS:
        return None
    if "import" not in code:
        # Every import statement spells the keyword in ASCII (a look-alike such as a
        # full-width one is a syntax error): most one-shot runs stop here.
        return frozenset()
    found: set[str] = set()
    for match in IMPORT_RE.finditer(code):
        if match.group(1):
            found.add(match.group(1))
        else:
            found.update(LISTED_RE.findall(match.group(2)))
    return frozenset(found)


def choose(profiles: tuple[Profile, ...], imports: frozenset[str] | None) -> Profile:
    """The smallest profile that preloads every import any profile could; failing that (no
    single profile has them all), the one that has the most of them, the larger on a tie.
    Code that was not scanned (None) gets the largest."""
    if not profiles:
        raise ValueError("no preload profiles")
    if imports is None:
        return max(profiles, key=lambda p: len(p.modules))
    if not imports:  # every profile covers nothing: the smallest (what follows would say so too)
        return min(profiles, key=lambda p: len(p.modules))
    known = frozenset().union(*(p.tops for p in profiles))
    wanted = imports & known
    covering = [p for p in profiles if wanted <= p.tops]
    if covering:
        return min(covering, key=lambda p: len(p.modules))
    return max(profiles, key=lambda p: (len(wanted & p.tops), len(p.modules)))
