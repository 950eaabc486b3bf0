from __future__ import annotations

from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

from tests import exclusive, tiers
from tests.support import Server, start_server


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "fast: set by tests/tiers.py: needs no server, jail, firejail or root")
    config.addinivalue_line(
        "markers", "host: needs root, firejail, mounts or cgroups (never in the fast tier)"
    )
    config.addinivalue_line("markers", "exclusive: runs while no other test runs (tests/exclusive.py)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Under pytest-xdist, `make test` distributes by file (--dist loadfile): a module stays on
    # one worker, so its module-scoped server and fixtures are made once and never twice at once.
    tiers.classify(items)
    if hasattr(config, "workerinput"):  # an xdist worker: its collection order is the schedule's
        items[:] = schedule_order(items)


def schedule_order(items: list[pytest.Item]) -> list[pytest.Item]:
    """The order `make test` hands modules to workers (it passes --no-loadscope-reorder, so xdist
    keeps it): modules holding a `slow` test first, then those that start servers or jails,
    then the fast tier's (tests/tiers.py: no server, no jail; a second or so a module), each
    group by test count, most first (xdist's own order). A long module handed out last is the
    suite's tail while the other workers idle (the soak: one test, a minute); handed out first,
    it runs beside the short ones, and the fast tier's modules fill the gaps at the end.
    Each module's tests keep their order."""
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::", 1)[0], []).append(item)

    def rank(tests: list[pytest.Item]) -> tuple[bool, bool, int]:
        slow = any(t.get_closest_marker("slow") for t in tests)
        fast = all(t.get_closest_marker("fast") for t in tests)
        return (not slow, fast, -len(tests))

    return [item for tests in sorted(modules.values(), key=rank) for item in tests]


TURNS = pytest.StashKey[exclusive.Turns]()


def _exclusive(item: pytest.Item | None) -> bool:
    return item is not None and item.get_closest_marker("exclusive") is not None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    root = exclusive.lock_root(item.config)
    if root is None:
        yield
        return
    turns = item.config.stash.setdefault(TURNS, exclusive.Turns(root))
    with turns.turn(_exclusive(item), _exclusive(nextitem)):
        yield


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
