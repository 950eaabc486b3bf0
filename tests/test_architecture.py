"""The layers of the house, checked.

The layer rules themselves are import-linter contracts (pyproject.toml, `[tool.importlinter]`;
`make lint` runs `lint-imports`). Here: the contracts hold, they catch a planted upward import
(so they can fail), and what is staged into a jail imports nothing but the standard library and
itself, whatever the depth of the import (a function-level import counts). The installed
package needs no checkout. And the docs name the code truly: every path ARCHITECTURE.md,
SECURITY.md, CONTRIBUTING.md, README.md and docs/*.md give exists, every `path::name` is
defined there, and ARCHITECTURE.md describes every import-linter contract.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from appliance.sandbox import workdir

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "appliance"
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"],
        cwd=root,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_layer_contracts_hold() -> None:
    done = lint_imports(ROOT)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


@pytest.mark.parametrize(
    ("module", "bad_import"),
    [
        ("appliance/core/admission.py", "import aiohttp"),
        ("appliance/core/tenants.py", "from appliance.wire import protocol"),
        ("appliance/sandbox/pool.py", "from appliance.api import server"),
        ("appliance/inside/magics.py", "from appliance.sandbox import pool"),
        ("appliance/runtime/canary.py", "from appliance_client.client import Client"),
        ("appliance/runtime/lifecycle.py", "from appliance.wire import protocol"),
    ],
)
def test_the_contracts_catch_a_planted_import(tmp_path: Path, module: str, bad_import: str) -> None:
    shutil.copytree(PACKAGE, tmp_path / "appliance", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    planted = tmp_path / module
    planted.write_text(planted.read_text() + f"\n\ndef _planted() -> None:\n    {bad_import}  # noqa\n")
    done = lint_imports(tmp_path)
    assert done.returncode != 0 and "BROKEN" in done.stdout, done.stdout[-3000:]


def _imports(path: Path) -> set[str]:
    """Every absolute module a file imports, at any depth of its code."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: a relative import"
            found |= {f"{node.module}.{a.name}" for a in node.names} if node.module else set()
    return found


# Imported lazily by the tools and the display code, when jailed code uses them, and by the
# snapshot code (cloudpickle, a dependency of the appliance), when a snapshot is asked for.
JAIL_THIRD_PARTY = {
    "numpy",
    "matplotlib",
    "llama_cpp",
    "pywhispercpp",
    "PIL",
    "pandas",
    "IPython",
    "cloudpickle",
}


def test_what_a_jail_is_given_imports_only_the_standard_library_and_itself() -> None:
    staged = {f"appliance.{'.'.join(rel.with_suffix('').parts[1:])}" for _, rel in workdir.runtime_sources()}
    staged = {name.removesuffix(".__init__") for name in staged}
    for source, rel in workdir.runtime_sources():
        for name in _imports(source):
            top = name.split(".")[0]
            if top == "appliance":
                owner = name if name in staged else name.rsplit(".", 1)[0]
                assert owner in staged or owner == "appliance", (
                    f"{rel} imports {name}: not staged into a jail"
                )
            else:
                assert top in sys.stdlib_module_names or top in JAIL_THIRD_PARTY, f"{rel} imports {name}"


def test_every_module_of_inside_is_staged() -> None:
    staged = {source for source, _ in workdir.runtime_sources()}
    assert set((PACKAGE / "inside").rglob("*.py")) <= staged
    assert PACKAGE / "tools" / "__init__.py" in staged


CHECKOUT_ONLY = {"tests", "benchmarks", "security", "examples"}


def test_the_installed_package_imports_nothing_that_only_a_checkout_has() -> None:
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and node.level == 0
                else []
            )
            for name in names:
                assert name.split(".")[0] not in CHECKOUT_ONLY, f"{path.relative_to(ROOT)} imports {name}"
            # Nor reaches into the checkout by path (`repo / "tests" / "attacks"`, as the audit
            # did when it was `appliance audit`). `appliance bench` is the one command that
            # looks for benchmarks/ beside the package, and says so when it is not there.
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
                part = node.right.value if isinstance(node.right, ast.Constant) else None
                assert part not in {"tests", "security", "examples"}, (
                    f"{path.relative_to(ROOT)} reads {part}/"
                )


@pytest.mark.host  # runs the attack suite: real servers
def test_the_audit_runs_the_attack_suite_from_the_checkout(tmp_path: Path) -> None:
    """`make audit` is `python -m security.audit`: it collects tests/attacks with its report
    plugin (here no attack is selected, so nothing runs and no report is written)."""
    done = subprocess.run(
        [sys.executable, "-m", "security.audit", "--out", str(tmp_path), "--", "-k", "no_attack_is_named_so"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == pytest.ExitCode.NO_TESTS_COLLECTED, done.stdout[-2000:] + done.stderr[-2000:]
    deselected = int(done.stdout.split(" deselected")[0].rsplit(None, 1)[-1])
    assert deselected > 100, done.stdout[-2000:]
    assert "no report was written" in done.stderr
    assert not list(tmp_path.iterdir())


ARCHITECTURE = ROOT / "ARCHITECTURE.md"
# A backticked path whose first folder is one of the repository's (not `outputs/`, a jail's
# folder), optionally naming what it defines: `appliance/core/service.py::RunService.execute`.
NAMED_PATH = re.compile(
    r"`((?:appliance|tests|benchmarks|scripts|docs|security|images|deploy|examples|\.github)"
    r"/[\w./-]*)(?:::([\w.]+))?`"
)


def _defines(path: Path, dotted: str) -> bool:
    """Whether the module at path defines `dotted` (a function, class, or a class's member)."""
    scope: list[ast.stmt] = ast.parse(path.read_text()).body
    for part in dotted.split("."):
        found: ast.stmt | None = None
        for node in scope:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == part:
                found = node
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                found = node if node.target.id == part else found
            elif isinstance(node, ast.Assign):
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
                found = node if part in names else found
        if found is None:
            return False
        scope = found.body if isinstance(found, ast.ClassDef) else []
    return True


DOCS = [
    "ARCHITECTURE.md",
    "SECURITY.md",
    "CONTRIBUTING.md",
    "README.md",
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")),
]


def test_architecture_md_names_the_code_by_path() -> None:
    named = NAMED_PATH.findall(ARCHITECTURE.read_text())
    assert len(named) > 100, "ARCHITECTURE.md's paths are not found: has the pattern drifted?"


@pytest.mark.parametrize("doc", DOCS)
def test_every_path_and_name_a_doc_gives_exists(doc: str) -> None:
    named = NAMED_PATH.findall((ROOT / doc).read_text())
    missing = sorted({path for path, _ in named if not (ROOT / path).exists()})
    assert not missing, f"{doc} names paths that do not exist: {missing}"
    undefined = sorted(
        f"{path}::{name}"
        for path, name in set(named)
        if name and path.endswith(".py") and not _defines(ROOT / path, name)
    )
    assert not undefined, f"{doc} names what its module does not define: {undefined}"


def test_architecture_md_names_every_layer_contract() -> None:
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    text = " ".join(ARCHITECTURE.read_text().split())
    unnamed = [c["name"] for c in contracts if f'"{c["name"]}"' not in text]
    assert not unnamed, f"ARCHITECTURE.md does not describe these import-linter contracts: {unnamed}"
