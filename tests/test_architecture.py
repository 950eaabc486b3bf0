"""The layers of the house, checked: each module imports only its own layer and those below.

    base (protocol, settings, errors, ...) -> jail -> gpu -> run service -> transports -> cli

`appliance.tools` and the in-jail driver run inside jails: they may import only the driver
channel (and, for tools, each other). Function-level imports count too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "appliance"

LAYERS: dict[str, set[str]] = {
    "base": {"base"},
    "jail": {"base", "jail"},
    "gpu": {"base", "jail", "gpu"},
    "service": {"base", "jail", "gpu", "service"},
    "transport": {"base", "service", "transport"},
    "cli": {"base", "jail", "gpu", "service", "transport", "cli"},
}
BASE = {
    "errors",
    "protocol",
    "settings",
    "logs",
    "metrics",
    "canary",
    "admission",
    "tenants",
    "outputs",
    "fstree",
    "openapi",
    "client",
    "schema",
    "agents",
    "mcp_tools",
    "mcp_bridge",
}
SERVICE = {"lifecycle", "service", "sessions", "toolprobe"}
TRANSPORT = {"server", "rest", "transport", "cors", "mcp_http", "parse_worker", "framebudget", "wsmeter"}
CLI = {"cli", "__main__", "audit", "local", "__init__"}
IN_JAIL = {
    "appliance.jail.driver",
    "appliance.jail.channel",
    "appliance.jail.appliance_mpl",
    "appliance.jail.notebook",
    "appliance.jail.magics",
}
# Pure, standard-library-only tool modules the run service may share with the jail, so that
# one reading of a model file gives the same answer inside (appliance.tools.models()) and
# outside (GET /v1/models).
SHARED_TOOLS = {"appliance.tools.catalogue"}
# What in-jail code may import of the package: the modules staged into the jail's runtime.
IN_JAIL_IMPORTABLE = {"appliance.jail.channel", "appliance.jail.notebook", "appliance.jail.magics"}


def layer_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) >= 2 and parts[1] in ("jail", "gpu", "tools"):
        return parts[1]
    name = parts[1] if len(parts) > 1 else "__init__"
    for layer, names in (("base", BASE), ("service", SERVICE), ("transport", TRANSPORT), ("cli", CLI)):
        if name in names:
            return layer
    raise AssertionError(f"{module} is in no layer: add it to tests/test_architecture.py")


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        name = ".".join(rel.parts)
        found[name.removesuffix(".__init__")] = path
    return found


def imports_of(path: Path, module: str) -> set[str]:
    """Every appliance module this file imports, at any depth of its code."""
    found: set[str] = set()
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("appliance")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            if not base.startswith("appliance"):
                continue
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in modules() else base)
    return found - {module}


ALL = modules()


def violations(module: str, targets: set[str]) -> list[str]:
    """Every import of `module` that its layer does not allow."""
    mine = layer_of(module)
    found = []
    for target in sorted(targets - {"appliance"}):
        if module in IN_JAIL or mine == "tools":
            if not (
                target in IN_JAIL_IMPORTABLE or (mine == "tools" and target.startswith("appliance.tools"))
            ):
                found.append(f"{module} runs in the jail and may not import {target}")
            continue
        theirs = layer_of(target)
        if target in SHARED_TOOLS and mine in ("service", "transport", "cli"):
            continue
        if theirs == "tools":
            found.append(f"{module} imports {target}: the in-jail tools are not a library of the server")
        elif theirs not in LAYERS[mine]:
            found.append(f"{module} ({mine}) imports {target} ({theirs}): an upward import")
    return found


@pytest.mark.parametrize("module", sorted(ALL))
def test_each_module_imports_only_its_layer_and_below(module: str) -> None:
    assert violations(module, imports_of(ALL[module], module)) == []


def test_packages_do_not_import_each_other_in_a_cycle() -> None:
    edges: dict[str, set[str]] = {}
    for module, path in ALL.items():
        src = layer_of(module)
        for target in imports_of(path, module):
            if target != "appliance":
                edges.setdefault(src, set()).add(layer_of(target))
    for a, targets in edges.items():
        for b in targets - {a}:
            assert a not in edges.get(b, set()), f"{a} and {b} import each other"


def test_the_checker_finds_an_upward_or_in_jail_import(tmp_path: Path) -> None:
    fake = tmp_path / "fake.py"
    fake.write_text("def f():\n    from appliance.server import serve\n    from appliance.jail import pool\n")
    assert violations("appliance.jail.cell", imports_of(fake, "appliance.jail.cell")) == [
        "appliance.jail.cell (jail) imports appliance.server (transport): an upward import"
    ]
    assert violations("appliance.jail.driver", imports_of(fake, "appliance.jail.driver")) == [
        "appliance.jail.driver runs in the jail and may not import appliance.jail.pool",
        "appliance.jail.driver runs in the jail and may not import appliance.server",
    ]
