"""The languages /run_code serves, and the cell that runs each one in the jail.

Python runs as the jail's own interpreter runs any cell (preloaded, in-process: a script's
`__name__` is "__main__", `sys.exit(n)` is its exit code, an uncaught exception exits 1 with
its traceback on stderr). Every other language is a toolchain of the image run as a child of
that cell: the source goes into the jail's private /tmp, the child inherits the jail's
stdout and stderr (so the server sees its output as it comes), and the cell exits with its
exit code. A compiled language compiles in a cell of its own, under `compile_timeout`, before
the run's cell, in the same jail.

A language is offered only where its toolchain is installed on the host under a directory
the jail sees (/usr, /bin): `available` looks once, at startup.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass

WORKDIR = "/tmp/fusion"  # noqa: S108 (the jail's private /tmp, never the host's: gone with the jail)
JAIL_VISIBLE = ("/usr/", "/bin/", "/sbin/")  # top-level trees a jail sees (sandbox.spec)


@dataclass(frozen=True)
class Language:
    name: str
    source: str  # the file the code is written to, under WORKDIR
    run: tuple[str, ...]  # argv; "{src}" and "{bin}" are filled in; argv[0] a tool name
    compile: tuple[str, ...] | None = None

    @property
    def tools(self) -> tuple[str, ...]:
        names = [self.run[0]] + ([self.compile[0]] if self.compile else [])
        return tuple(n for n in names if not n.startswith("{"))


PYTHON = "python"
# SandboxFusion's names for them. Python needs no tool: it is the jail's interpreter.
CATALOGUE = (
    Language("bash", "main.sh", ("bash", "{src}")),
    Language("nodejs", "main.js", ("node", "{src}")),
    Language("perl", "main.pl", ("perl", "{src}")),
    Language("ruby", "main.rb", ("ruby", "{src}")),
    Language("php", "main.php", ("php", "-f", "{src}")),
    Language("lua", "main.lua", ("lua", "{src}")),
    Language("cpp", "main.cpp", ("{bin}",), ("g++", "-std=c++17", "-O2", "{src}", "-o", "{bin}")),
    Language("go", "main.go", ("{bin}",), ("go", "build", "-o", "{bin}", "{src}")),
    Language("rust", "main.rs", ("{bin}",), ("rustc", "-O", "{src}", "-o", "{bin}")),
)


def available(which: Callable[[str], str | None] = shutil.which) -> dict[str, tuple[str, ...]]:
    """Language name -> the tools' absolute paths, for each language whose tools are all
    installed where a jail sees them (PATH of the host's /usr and /bin)."""
    found: dict[str, tuple[str, ...]] = {PYTHON: ()}
    for lang in CATALOGUE:
        paths = [which(t) for t in lang.tools]
        if all(p is not None and p.startswith(JAIL_VISIBLE) for p in paths):
            found[lang.name] = tuple(p for p in paths if p is not None)
    return found


def by_name() -> Mapping[str, Language]:
    return {lang.name: lang for lang in CATALOGUE}


def _argv(template: tuple[str, ...], lang: Language, tools: Mapping[str, str]) -> list[str]:
    src, binary = f"{WORKDIR}/{lang.source}", f"{WORKDIR}/main"
    return [tools.get(a, a).replace("{src}", src).replace("{bin}", binary) for a in template]


def _child_cell(argv: list[str], source: str | None, lang: Language, feed_stdin: bool) -> str:
    """A cell that (optionally) writes the source, runs argv as a child on the jail's own
    stdout/stderr, and exits with its exit code (a signal's death as 128 + signal)."""
    lines = ["import os as _o, subprocess as _s, sys as _y", f"_o.makedirs({WORKDIR!r}, exist_ok=True)"]
    if source is not None:
        path = f"{WORKDIR}/{lang.source}"
        lines.append(f"with open({path!r}, 'w', encoding='utf-8') as _f: _f.write({json.dumps(source)})")
    stdin = "_y.stdin.read().encode()" if feed_stdin else "b''"
    lines += [
        f"_r = _s.run({argv!r}, input={stdin}).returncode",
        "_y.exit(_r if _r >= 0 else 128 - _r)",
    ]
    return "\n".join(lines) + "\n"


def compile_cell(lang: Language, code: str, tools: Mapping[str, str]) -> str | None:
    """The compile step's cell (it writes the source too); None for a language with none."""
    if lang.compile is None:
        return None
    return _child_cell(_argv(lang.compile, lang, tools), code, lang, feed_stdin=False)


def run_cell(lang: Language, code: str, tools: Mapping[str, str]) -> str:
    """The run step's cell: the program, fed the cell's stdin."""
    source = None if lang.compile is not None else code  # compiled: written by the compile cell
    return _child_cell(_argv(lang.run, lang, tools), source, lang, feed_stdin=True)


def tool_paths(lang: Language, paths: tuple[str, ...]) -> dict[str, str]:
    """Tool name -> its absolute path, for `_argv`."""
    return dict(zip(lang.tools, paths, strict=True))


FETCH_DIR = "outputs/.fusion-fetch"


def fetch_cell(names: tuple[str, ...]) -> str:
    """A cell that copies each named workspace file (a regular file, reached without following
    a link at any step) to outputs/.fusion-fetch/<index>, where the server reads outputs
    back within its bounds (SANDBOX_MAX_FILE_OUT_BYTES and the others). A name that is
    missing or not a regular file is skipped."""
    return (
        "def _fusion_fetch(names):\n"
        "    import os, stat\n"
        f"    os.makedirs({FETCH_DIR!r}, exist_ok=True)\n"
        "    for i, name in enumerate(names):\n"
        "        fd = os.open('.', os.O_RDONLY | os.O_DIRECTORY)\n"
        "        try:\n"
        "            parts = [p for p in name.split('/') if p not in ('', '.')]\n"
        "            for p in parts[:-1]:\n"
        "                nxt = os.open(p, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)\n"
        "                os.close(fd)\n"
        "                fd = nxt\n"
        "            src = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)\n"
        "        except OSError:\n"
        "            continue\n"
        "        finally:\n"
        "            os.close(fd)\n"
        "        try:\n"
        "            if not stat.S_ISREG(os.fstat(src).st_mode):\n"
        "                continue\n"
        f"            with os.fdopen(src, 'rb', closefd=False) as fin, open({FETCH_DIR!r} + '/' + str(i), 'wb') as fout:\n"
        "                while chunk := fin.read(1 << 20):\n"
        "                    fout.write(chunk)\n"
        "        finally:\n"
        "            os.close(src)\n"
        f"_fusion_fetch({json.dumps(list(names))})\n"
        "del _fusion_fetch\n"
    )
