"""The adversarial suite's harness: a hostile-looking real server per module, and the audit report.

Every test marked with `common.attack(...)` becomes one row of the report: its class
comes from the file, `contained` is whether the test passed, `observed` is what the
test recorded with the `observe` fixture (or the failure, when it failed).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Generator, Iterator
from pathlib import Path

import pluggy
import pytest

from security.audit import REPORT_DIR_ENV, AuditRow, default_meta, write_report
from tests.attacks.common import AWS_SECRET, TOKEN
from tests.support import Server, reachable_tmp_root, start_server

MIN_ATTACKS = 60
CLASS_OF_FILE = {
    "test_escape": "escape",
    "test_exfiltration": "exfiltration",
    "test_dos": "denial of service",
    "test_protocol_abuse": "protocol abuse",
    "test_transport": "transport and time",
    "test_cross_site": "cross-site requests",
    "test_filesystem": "filesystem and IPC",
    "test_egress": "egress by name",
    "test_snapshots": "snapshots",
    "test_e2b_files": "E2B files",
    "test_e2b_commands": "E2B commands and ports",
}
OBSERVED = pytest.StashKey[str]()
ROWS = pytest.StashKey[list[AuditRow]]()
ATTACKS = pytest.StashKey[int]()
DESELECTED = pytest.StashKey[bool]()


@pytest.fixture(scope="module")
def tmp_root() -> Iterator[Path]:
    """A SANDBOX_TMP_ROOT of this module's own (reachable by the sandbox uid), removed after."""
    with reachable_tmp_root("appliance-attacks-") as root:
        yield root


def hostile_server(base: Path, tmp_root: Path, host: str = "127.0.0.1", **env: str) -> Server:
    """A real server holding secrets in its environment, pool off so leftovers are visible."""
    settings = {
        "SANDBOX_POOL_SIZE": "0",
        "SANDBOX_TMP_ROOT": str(tmp_root),
        "SANDBOX_AUTH_TOKEN": TOKEN,
        "AWS_SECRET_ACCESS_KEY": AWS_SECRET,
        "SANDBOX_MAX_EXEC_MS": "6000",
        "SANDBOX_MEMORY_MB": "512",
        "SANDBOX_MAX_DISK_MB": "64",
        "SANDBOX_MAX_OUTPUT_BYTES": "262144",
        "SANDBOX_MAX_MESSAGE_BYTES": "1048576",
        "SANDBOX_MAX_UPLOAD_BYTES": "65536",
        "SANDBOX_MAX_CONCURRENCY": "4",
    }
    settings.update(env)
    return start_server(base, host=host, settings=settings)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory, tmp_root: Path) -> Iterator[Server]:
    """The module's hostile server."""
    srv = hostile_server(tmp_path_factory.mktemp("attack-server"), tmp_root)
    yield srv
    srv.stop()


@pytest.fixture
def observe(request: pytest.FixtureRequest) -> Callable[[str], None]:
    """Record what the attack actually did, for the report."""

    def record(text: str) -> None:
        request.node.stash[OBSERVED] = text

    return record


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "attack(name, expected): one attack of the security audit")
    config.stash[ROWS] = []
    config.stash[ATTACKS] = 0
    config.stash[DESELECTED] = False


def pytest_deselected(items: list[pytest.Item]) -> None:
    if items:
        items[0].config.stash[DESELECTED] = True


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    config.stash[ATTACKS] = sum(1 for item in items if item.get_closest_marker("attack"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pluggy.Result[pytest.TestReport], None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    marker = item.get_closest_marker("attack")
    if marker is None or report.when not in ("setup", "call"):
        return
    if report.when == "setup" and report.passed:
        return
    module = item.path.stem  # the test file: test_escape.py -> test_escape
    observed = item.stash.get(OBSERVED, "")
    if not report.passed:
        crash = getattr(report.longrepr, "reprcrash", None)
        failure = str(crash.message) if crash is not None else str(report.longrepr)
        observed = f"{observed} FAILED: {failure}".strip()
    item.config.stash[ROWS].append(
        AuditRow(
            attack=marker.kwargs["name"],
            cls=CLASS_OF_FILE.get(module, module),
            expected=marker.kwargs["expected"],
            observed=observed or "(nothing recorded)",
            contained=report.passed,
            test=item.nodeid,
        )
    )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Write the report when `python -m security.audit` (`make audit`) asked for it, and only then:
    `make test` runs the same attacks but leaves the committed report as it is."""
    config = session.config
    rows = config.stash[ROWS]
    explicit = os.environ.get(REPORT_DIR_ENV)
    if not rows or not explicit:
        return
    complete = (
        not config.stash[DESELECTED]
        and config.stash[ATTACKS] >= MIN_ATTACKS
        and len(rows) == config.stash[ATTACKS]
    )
    if not complete:
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(
                f"audit report not written: {len(rows)} of {config.stash[ATTACKS]} attacks ran"
            )
        return
    md, _ = write_report(rows, Path(explicit), default_meta())
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        uncontained = sum(1 for r in rows if not r.contained)
        reporter.write_line(f"audit report: {md} ({len(rows)} attacks, {uncontained} uncontained)")
