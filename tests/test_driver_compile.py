"""How the driver compiles a cell (appliance.inside.driver.compile_cell): a one-expression
cell straight from its source, anything else through `ast`, to the same code either way, and
with none of the driver's own `__future__` imports."""

from __future__ import annotations

import ast
from types import CodeType

import pytest

from appliance.inside import driver

pytestmark = pytest.mark.fast


def through_ast(source: str) -> tuple[CodeType | None, CodeType | None]:
    """The `ast` route alone: the statements, and the last expression apart."""
    tree = ast.parse(source, mode="exec")
    last = None
    if tree.body and isinstance(tail := tree.body[-1], ast.Expr):
        tree.body.pop()
        last = compile(ast.Expression(tail.value), "<cell>", "eval", dont_inherit=True)
    return (compile(tree, "<cell>", "exec", dont_inherit=True) if tree.body else None), last


@pytest.mark.parametrize(
    "source",
    [
        "print(2+2)",
        "1 + 1",
        "df.head()\n",
        "# a comment\nx",
        "(1,\n 2)",
        "[i for i in range(3)]",
        "\n\nx.y(z)",
    ],
)
def test_a_one_expression_cell_compiles_to_what_the_ast_route_makes(source: str) -> None:
    body, last = driver.compile_cell(source, "<cell>")
    slow_body, slow_last = through_ast(source)
    assert body is None and slow_body is None
    assert last == slow_last and last is not None and slow_last is not None
    assert list(last.co_positions()) == list(slow_last.co_positions())  # tracebacks point alike


@pytest.mark.parametrize("source", ["x = 1\nx", "1;", "import os", "for i in []: pass\ni"])
def test_other_cells_take_the_ast_route(source: str) -> None:
    body, last = driver.compile_cell(source, "<cell>")
    slow_body, slow_last = through_ast(source)
    assert body == slow_body and last == slow_last


@pytest.mark.parametrize("source", ["  1", "yield 1", "1 +"])
def test_a_cell_that_does_not_compile_raises_as_python_does(source: str) -> None:
    with pytest.raises(SyntaxError):
        driver.compile_cell(source, "<cell>")


def test_the_drivers_own_future_imports_do_not_reach_the_cell() -> None:
    # driver.py has `from __future__ import annotations`: inherited, a cell's annotations
    # would be strings, which `python file.py` never makes them.
    body, last = driver.compile_cell("def f(x: int): pass\nf.__annotations__", "<cell>")
    namespace: dict[str, object] = {}
    assert body is not None and last is not None
    exec(body, namespace)  # noqa: S102 (the test's own code)
    assert eval(last, namespace) == {"x": int}  # noqa: S307
    _, expression = driver.compile_cell("(lambda: 1).__code__.co_flags", "<cell>")
    assert expression is not None
    assert not eval(expression) & 0x1000000  # noqa: S307 (CO_FUTURE_ANNOTATIONS)
