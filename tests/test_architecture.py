"""The layers of the house, checked.

The layer rules themselves are import-linter contracts (pyproject.toml, `[tool.importlinter]`;
`make lint` runs `lint-imports`). Here: the contracts hold, they catch a planted upward import
(so they can fail), and what is staged into a jail imports nothing but the standard library and
itself, whatever the depth of the import (a function-level import counts).
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
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
        ("appliance/runtime/canary.py", "from appliance.client import Client"),
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


# Imported lazily by the tools and the display code, when jailed code uses them; never needed.
JAIL_THIRD_PARTY = {"numpy", "matplotlib", "llama_cpp", "pywhispercpp", "PIL", "pandas", "IPython"}


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
