"""tests/tiers.py: what puts a test in the fast tier, and the guard that keeps it honest."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests import support, tiers


def test_a_module_that_names_a_server_helper_is_not_fast(tmp_path: Path) -> None:
    hosted, pure = tmp_path / "test_hosted.py", tmp_path / "test_pure.py"
    hosted.write_text("from tests.support import start_server\n\ndef test_x():\n    start_server\n")
    pure.write_text("import json\n\ndef test_y():\n    assert json.loads('1') == 1\n")
    assert tiers.HOST_NAMES & tiers.names_in(hosted)
    assert not tiers.HOST_NAMES & tiers.names_in(pure)


def test_the_guard_fails_a_test_that_starts_a_server_or_a_privileged_tool(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tiers.guard(monkeypatch)
    for start in (getattr(support, name) for name in ("start_server", "jail_factory")):
        with pytest.raises(AssertionError, match=r"pytest\.mark\.host"):
            start(Path("/nonexistent"))
    for argv in (["firejail", "--version"], ["sudo", "true"], [sys.executable, "-m", "appliance", "serve"]):
        with pytest.raises(AssertionError, match=r"pytest\.mark\.host"):
            subprocess.run(argv, check=False)
    # What a fast test may run still runs.
    assert (
        subprocess.run([sys.executable, "-c", "print(2 + 2)"], capture_output=True, text=True).stdout == "4\n"
    )


def test_this_suite_classifies_itself(request: pytest.FixtureRequest) -> None:
    # These tests are pure: they are in the fast tier, and so run under the guard in every run.
    assert request.node.get_closest_marker("fast") is not None
