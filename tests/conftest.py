from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import tiers
from tests.support import Server, start_server


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "fast: set by tests/tiers.py: needs no server, jail, firejail or root")
    config.addinivalue_line(
        "markers", "host: needs root, firejail, mounts or cgroups (never in the fast tier)"
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    tiers.classify(items)


@pytest.fixture(autouse=True)
def _fast_tier_guard(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fast test that reaches for a server, a jail or a privileged tool fails (tests/tiers.py)."""
    if request.node.get_closest_marker("fast") is not None:
        tiers.guard(monkeypatch)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A real appliance with a small warm pool and no preload (fast)."""
    srv = start_server(tmp_path_factory.mktemp("server"))
    yield srv
    srv.stop()


@pytest.fixture
def fresh_tmp(tmp_path: Path) -> Path:
    return tmp_path
