"""tests/exclusive.py: an exclusive test holds the host alone; others share it."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest

from tests.conftest import schedule_order
from tests.exclusive import Turns, lock_root, turn


def can_lock(path: Path, mode: int) -> bool:
    """Whether another holder (a descriptor of its own) could take `mode` on path now."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def test_a_shared_turn_admits_other_shared_turns_and_holds_off_an_exclusive_one(tmp_path: Path) -> None:
    with turn(tmp_path, exclusive=False):
        assert can_lock(tmp_path / "run.lock", fcntl.LOCK_SH)
        assert not can_lock(tmp_path / "run.lock", fcntl.LOCK_EX)
        assert can_lock(tmp_path / "gate.lock", fcntl.LOCK_EX), "the gate is held only while entering"
        with turn(tmp_path, exclusive=False):  # another worker's test, beside it
            pass
    assert can_lock(tmp_path / "run.lock", fcntl.LOCK_EX)


def test_an_exclusive_turn_holds_off_every_other_test(tmp_path: Path) -> None:
    with turn(tmp_path, exclusive=True):
        assert not can_lock(tmp_path / "gate.lock", fcntl.LOCK_EX), "no test may start"
        assert not can_lock(tmp_path / "run.lock", fcntl.LOCK_SH), "no test may run"
    assert can_lock(tmp_path / "gate.lock", fcntl.LOCK_EX)
    assert can_lock(tmp_path / "run.lock", fcntl.LOCK_EX)


def test_locks_are_taken_only_in_an_xdist_worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert lock_root(SimpleNamespace()) is None, "no xdist, or a pytest a test started: no lock"
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    root = lock_root(SimpleNamespace(workerinput={"testrunuid": "abc123"}))
    assert root == tmp_path / "appliance-tests-abc123" and root.is_dir()
    assert root.stat().st_mode & 0o777 == 0o700


def test_exclusive_tests_in_a_row_take_the_host_once_and_give_it_back_after_the_last(
    tmp_path: Path,
) -> None:
    turns = Turns(tmp_path)
    with turns.turn(exclusive=True, next_exclusive=True):
        assert not can_lock(tmp_path / "run.lock", fcntl.LOCK_SH)
    # Between the two, another worker's test still cannot start: the host stays taken.
    assert turns.holding and not can_lock(tmp_path / "gate.lock", fcntl.LOCK_EX)
    assert not can_lock(tmp_path / "run.lock", fcntl.LOCK_SH)
    with turns.turn(exclusive=True, next_exclusive=False):
        assert not can_lock(tmp_path / "run.lock", fcntl.LOCK_SH)
    assert not turns.holding
    assert can_lock(tmp_path / "gate.lock", fcntl.LOCK_EX) and can_lock(tmp_path / "run.lock", fcntl.LOCK_EX)


def test_a_shared_test_before_an_exclusive_one_keeps_no_hold(tmp_path: Path) -> None:
    turns = Turns(tmp_path)
    with turns.turn(exclusive=False, next_exclusive=True):
        assert can_lock(tmp_path / "run.lock", fcntl.LOCK_SH)
    assert not turns.holding and can_lock(tmp_path / "run.lock", fcntl.LOCK_EX)


def test_slow_modules_are_handed_out_first_and_the_fast_tiers_last_most_tests_first() -> None:
    class Item(SimpleNamespace):
        def get_closest_marker(self, name: str) -> object | None:
            return name if name in self.marks else None

    def items(module: str, count: int, slow_at: int | None = None, fast: bool = False) -> list[Item]:
        return [
            Item(
                nodeid=f"{module}::t{i}",
                marks=({"slow"} if i == slow_at else set()) | ({"fast"} if fast else set()),
            )
            for i in range(count)
        ]

    collected = [
        *items("units.py", 9, fast=True),
        *items("a.py", 2),
        *items("b.py", 3),
        *items("soak.py", 1, slow_at=0),
        *items("units_few.py", 1, fast=True),
        *items("kit.py", 4, slow_at=2),
    ]
    order = [item.nodeid for item in schedule_order(cast(list[pytest.Item], collected))]
    assert order == [
        *(f"kit.py::t{i}" for i in range(4)),
        "soak.py::t0",
        *(f"b.py::t{i}" for i in range(3)),
        *(f"a.py::t{i}" for i in range(2)),
        *(f"units.py::t{i}" for i in range(9)),
        "units_few.py::t0",
    ]
