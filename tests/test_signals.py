"""appliance.sandbox.signals is the one place the server signals a process: no other module of
the package calls the kernel's kill functions, and what it refuses never reaches the kernel."""

from __future__ import annotations

import ast
import asyncio
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from appliance.core.tasks import TaskScope
from appliance.sandbox import jailexec, proctree, signals
from tests.support import REPO, scaled, until_async

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


@pytest.fixture
def held_waiter(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[list[int], threading.Event]]:
    """asyncio's waiter thread (a blocking waitpid) held until the event is set; the PIDs it
    waits for are listed. subprocess's own polls (WNOHANG, bound at its import) pass."""
    waited: list[int] = []
    gate = threading.Event()
    real = os.waitpid

    def held(pid: int, options: int) -> tuple[int, int]:
        if options == 0:
            waited.append(pid)
            gate.wait(scaled(30))
        return real(pid, options)

    monkeypatch.setattr(os, "waitpid", held)
    try:
        yield waited, gate
    finally:
        gate.set()


async def exited(waited: list[int]) -> int:
    """The PID of the one child the waiter holds, once it has exited (a zombie, unreaped)."""
    await until_async(lambda: waited and proctree.state(waited[0]) == "Z", 30, "the child exited")
    return waited[0]


async def test_a_command_signalled_as_it_exits_keeps_its_own_end(
    held_waiter: tuple[list[int], threading.Event],
) -> None:
    """A command's kill that came just as its launcher exited went through asyncio's
    `send_signal`, which reaps first (a poll): asyncio's waiter then found no child and the
    end read "exit 255, no signal" (a CI run's killed command). Here the waiter is held until
    the launcher has exited and been signalled: the end is still its own."""
    waited, gate = held_waiter
    async with TaskScope("commands") as tasks:
        command = await jailexec.JailCommand.start(["sh", "-c", "exit 7"], False, tasks)
        pid = await exited(waited)
        command.send_signal(signal.SIGKILL)
        assert proctree.state(pid) == "Z"  # signalled, not reaped
        gate.set()
        ended = await asyncio.wait_for(command.wait(), scaled(30))
    assert (ended.exit_code, ended.signal, ended.error) == (7, None, None)


async def test_kill_child_neither_reaps_nor_reaches_a_reaped_child(
    held_waiter: tuple[list[int], threading.Event],
) -> None:
    waited, gate = held_waiter
    proc = await asyncio.create_subprocess_exec("sh", "-c", "exit 3")
    pid = await exited(waited)
    signals.kill_child(proc)
    assert proctree.state(pid) == "Z"
    gate.set()
    assert await asyncio.wait_for(proc.wait(), scaled(30)) == 3
    signals.kill_child(proc)  # reaped: nothing is sent, nothing raised
