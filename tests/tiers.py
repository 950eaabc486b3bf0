"""The fast tier (`make test-fast`): tests that need no server, no jail, no firejail and no root.

A test belongs to it unless its module names the host machinery (`HOST_NAMES`: it starts a
server or a jail), it uses a fixture that starts a server (`HOST_FIXTURES`), or it (or its
module) is marked `host` (it needs root, firejail, mounts or cgroups without a server) or
`slow` (it loads real models or runs a long suite). The
classification is made at collection, from the module's code, so a new test lands in a tier
without anyone listing it.

A misclassified test cannot pass silently: every fast test, in every run (`make test` too),
runs with `guard` in place, which makes starting a server, a jail factory or firejail (or
another privileged tool) fail the test with a message that names the `host` marker.
"""

from __future__ import annotations

import ast
import functools
import itertools
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

# Names whose use in a test module means it starts a server or a jail.
HOST_NAMES = frozenset(
    {"start_server", "jail_factory", "hostile_server", "Server", "LocalServer", "JailFactory"}
)
# conftest fixtures that start a server.
HOST_FIXTURES = frozenset({"server", "target", "tenanted", "secretive"})
# Programs a fast test must not run: each needs root, or starts a jail or a container.
HOST_PROGRAMS = frozenset(
    {
        "firejail",
        "sudo",
        "setpriv",
        "unshare",
        "nsenter",
        "mount",
        "umount",
        "podman",
        "ip",
        "make",
        "runuser",
    }
)
# `python -m appliance` and these packages' modules start servers (the benchmarks, the audit).
SERVER_PACKAGES = frozenset({"benchmarks", "security"})
REFUSAL = (
    "this test is in the fast tier (no server, jail, firejail or root), but it {what}: "
    "mark it (or its module) `pytest.mark.host` (tests/tiers.py)"
)


@functools.cache
def names_in(path: Path) -> frozenset[str]:
    """Every name a module's code uses or imports, attributes included."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.alias):
            found.add((node.asname or node.name).rsplit(".", 1)[-1])
    return frozenset(found)


def is_fast(item: pytest.Item) -> bool:
    if item.get_closest_marker("host") is not None or item.get_closest_marker("slow") is not None:
        return False
    if HOST_FIXTURES & set(getattr(item, "fixturenames", ())):
        return False
    module: ModuleType | None = getattr(item, "module", None)
    return module is not None and not (HOST_NAMES & names_in(Path(str(module.__file__))))


def classify(items: Sequence[pytest.Item]) -> None:
    for item in items:
        if is_fast(item):
            item.add_marker(pytest.mark.fast)


def _refuse(what: str) -> Any:
    def refuse(*_args: object, **_kwargs: object) -> Any:
        raise AssertionError(REFUSAL.format(what=what))

    return refuse


class _HostlessPopen(subprocess.Popen):  # type: ignore[type-arg]
    def __init__(self, args: Any, *rest: Any, **kwargs: Any) -> None:
        argv = [args] if isinstance(args, str | bytes | os.PathLike) else list(args)
        program = os.path.basename(os.fsdecode(argv[0])) if argv else ""
        if kwargs.get("shell"):
            program = os.fsdecode(argv[0]).split(" ", 1)[0]
        if program in HOST_PROGRAMS:
            raise AssertionError(REFUSAL.format(what=f"runs {program}"))
        words = [os.fsdecode(a) for a in argv[1:]] if not kwargs.get("shell") else []
        for flag, module in itertools.pairwise(words):
            if flag == "-m" and (module == "appliance" or module.split(".")[0] in SERVER_PACKAGES):
                raise AssertionError(REFUSAL.format(what=f"runs python -m {module}"))
        super().__init__(args, *rest, **kwargs)


def guard(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the host machinery fail a fast test (see the module's docstring)."""
    from appliance.runtime import local
    from tests import support

    monkeypatch.setattr(support, "start_server", _refuse("starts a server"))
    monkeypatch.setattr(support, "jail_factory", _refuse("makes a jail factory"))
    monkeypatch.setattr(local, "start", _refuse("starts a server"))
    monkeypatch.setattr(subprocess, "Popen", _HostlessPopen)
