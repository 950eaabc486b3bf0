"""appliance.sandbox.signals is the one place the server signals a process: no other module of
the package calls the kernel's kill functions, and what it refuses never reaches the kernel."""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from appliance.sandbox import signals
from tests.support import REPO

PACKAGE = REPO / "appliance"
THE_ONE = PACKAGE / "sandbox" / "signals.py"
# The code that runs inside a jail signals within the jail's own PID namespace (a cell's
# leftovers, its own interrupt) and may import nothing of the host: it is not the server.
INSIDE = PACKAGE / "inside"
KILLERS = {"os": {"kill", "killpg"}, "signal": {"pidfd_send_signal", "pthread_kill"}}


def signal_calls(path: Path) -> Iterator[str]:
    """`module.name` for each kernel kill function the file calls or imports."""
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.attr in KILLERS.get(node.value.id, ())
        ):
            yield f"{node.value.id}.{node.attr} (line {node.lineno})"
        elif isinstance(node, ast.ImportFrom) and node.module in KILLERS:
            for alias in node.names:
                if alias.name in KILLERS[node.module]:
                    yield f"from {node.module} import {alias.name} (line {node.lineno})"


def test_no_module_but_signals_calls_the_kernels_kill_functions() -> None:
    found = {
        str(path.relative_to(REPO)): calls
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != THE_ONE and INSIDE not in path.parents
        if (calls := list(signal_calls(path)))
    }
    assert found == {}


def test_the_check_finds_a_call_in_each_spelling(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "import os, signal\nfrom os import killpg\n"
        "os.kill(1, 9)\nsignal.pidfd_send_signal(3, 9)\nsignal.pthread_kill(1, 2)\n"
    )
    assert len(list(signal_calls(source))) == 4
    assert list(signal_calls(THE_ONE))  # the one place is found too: the test is not blind


@pytest.mark.parametrize("pid", [0, -1, -12345, True])
def test_a_pid_that_names_no_single_process_is_refused(pid: int) -> None:
    with pytest.raises(ValueError, match="not the PID of one process"):
        signals.kill(pid)
    with pytest.raises(ValueError, match="not the PID of one process"):
        signals.exists(pid)


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_a_process_is_killed_by_pid_and_then_gone(child: subprocess.Popen[bytes]) -> None:
    assert signals.exists(child.pid) is True
    signals.kill(child.pid)
    assert child.wait() == -signal.SIGKILL
    assert signals.exists(child.pid) is False
    with pytest.raises(ProcessLookupError):
        signals.kill(child.pid)


def test_a_process_is_signalled_by_pidfd_with_the_signal_asked(child: subprocess.Popen[bytes]) -> None:
    fd = os.pidfd_open(child.pid)
    try:
        signals.kill_by_pidfd(fd, signal.SIGTERM)
        assert child.wait() == -signal.SIGTERM
        with pytest.raises(ProcessLookupError):
            signals.kill_by_pidfd(fd)
    finally:
        os.close(fd)
