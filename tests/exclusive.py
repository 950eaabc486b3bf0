"""Tests that must have the host to themselves while others run in parallel (pytest-xdist).

`make test` runs the suite in several pytest-xdist workers. Most tests share the host well
(each server scopes its jails, groups and directories to itself), but a few measure the host
as a whole (CPU shares against a neighbour, a latency) or look for what another server would
purge. Those are marked `exclusive`: such a test runs only while no other test runs, in any worker.

Two flock(2) locks in a directory of the test run's own (named by xdist's run id) do it, a
reader-writer lock with writer preference: every test holds `run.lock` shared from its setup
to its teardown (a module's server starts and stops inside its first and last test's);
an exclusive test takes `gate.lock` (so no test starts meanwhile), then `run.lock` exclusive
(so the running ones end first). Without xdist every test runs alone anyway: no lock is taken.

Taking the host costs the other workers the wait for their running tests to end (the longest
of them) besides the exclusive test itself. So a worker's exclusive tests in a row (a module
of them) take it once: `Turns` keeps the hold from one to the next when the next is
exclusive too, and lets it go after the last.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path


def lock_root(config: object) -> Path | None:
    """The run's lock directory in an xdist worker; None in any other pytest (without xdist,
    or one a test started: it inherits the worker's environment, not its config)."""
    workerinput: dict[str, object] | None = getattr(config, "workerinput", None)
    if workerinput is None:
        return None
    run_id = str(workerinput["testrunuid"])
    root = Path(tempfile.gettempdir()) / f"appliance-tests-{run_id}"
    root.mkdir(mode=0o700, exist_ok=True)
    return root


@contextlib.contextmanager
def _flock(path: Path, mode: int) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, mode)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases its lock


@contextlib.contextmanager
def turn(root: Path, exclusive: bool) -> Iterator[None]:
    """Hold the host for one test: shared, or alone when `exclusive`."""
    gate, run = root / "gate.lock", root / "run.lock"
    if exclusive:
        with _flock(gate, fcntl.LOCK_EX), _flock(run, fcntl.LOCK_EX):
            yield
        return
    with _flock(gate, fcntl.LOCK_EX):  # waits while an exclusive test holds or waits at the gate
        held = _flock(run, fcntl.LOCK_SH)
        held.__enter__()
    try:
        yield
    finally:
        held.__exit__(None, None, None)


class Turns:
    """One worker's turns, test after test: an exclusive hold carries over to the next test
    when that one is exclusive too."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._kept: ExitStack | None = None  # the hold the previous (exclusive) test left on

    @property
    def holding(self) -> bool:
        return self._kept is not None

    @contextlib.contextmanager
    def turn(self, exclusive: bool, next_exclusive: bool) -> Iterator[None]:
        held, self._kept = self._kept, None
        if held is not None and not exclusive:  # never: a hold is kept only for an exclusive test
            held.close()
            held = None
        if held is None:
            held = ExitStack()
            held.enter_context(turn(self.root, exclusive))
        try:
            yield
        finally:
            if exclusive and next_exclusive:
                self._kept = held
            else:
                held.close()
