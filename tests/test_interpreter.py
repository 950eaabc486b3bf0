"""The in-jail driver runs cells the way IPython does: results, displays, figures, errors."""

from __future__ import annotations

import base64
from collections.abc import Iterator

import pytest

from appliance_client.client import AsyncClient, Execution
from tests.support import Server, start_server


@pytest.fixture(scope="module")
def science(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Default preload (numpy, pandas, matplotlib) so jails start warm with them."""
    srv = start_server(tmp_path_factory.mktemp("sci"), SANDBOX_PRELOAD="numpy,pandas,matplotlib")
    yield srv
    srv.stop()


async def run(server: Server, code: str) -> Execution:
    async with AsyncClient(server.url) as c:
        return await c.execute(code)


async def test_the_last_expression_becomes_a_result(science: Server) -> None:
    ex = await run(science, "x = 21\nx*2")
    assert ex.status == "ok" and ex.results == [{"text/plain": "42"}]


async def test_a_statement_at_the_end_gives_no_result(science: Server) -> None:
    ex = await run(science, "x = 1\ny = x")
    assert ex.results == [] and ex.status == "ok"


async def test_a_none_value_gives_no_result(science: Server) -> None:
    ex = await run(science, "print('side effect')")
    assert ex.results == [] and ex.stdout == "side effect\n"


async def test_a_dataframe_result_carries_an_html_table(science: Server) -> None:
    ex = await run(science, "import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': [3, 4]})")
    data = ex.results[0]
    assert "<table" in data["text/html"] and "a  b" in data["text/plain"]


async def test_a_matplotlib_figure_left_open_arrives_as_a_png_display(science: Server) -> None:
    ex = await run(science, "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.title('t')\nNone")
    assert len(ex.displays) == 1, ex.frames
    png = base64.b64decode(ex.displays[0]["image/png"])
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 1000
    assert "Figure" in ex.displays[0]["text/plain"]


async def test_plt_show_publishes_the_figure_once_and_closes_it(science: Server) -> None:
    code = "import matplotlib.pyplot as plt\nplt.plot([1, 2])\nplt.show()\nprint(len(plt.get_fignums()))"
    ex = await run(science, code)
    assert len(ex.displays) == 1 and ex.stdout == "0\n"
    assert ex.stderr == "", ex.stderr


async def test_display_is_a_builtin_and_honours_repr_methods(science: Server) -> None:
    code = (
        "class Rich:\n"
        "    def _repr_html_(self): return '<b>bold</b>'\n"
        "    def _repr_markdown_(self): return '**bold**'\n"
        "    def _repr_json_(self): return {'k': [1, 2]}\n"
        "    def _repr_png_(self): return b'\\x89PNG fake'\n"
        "    def __repr__(self): return 'Rich()'\n"
        "display(Rich())\nprint('after')\nRich()"
    )
    ex = await run(science, code)
    shown = ex.displays[0]
    assert shown["text/html"] == "<b>bold</b>" and shown["text/markdown"] == "**bold**"
    assert shown["application/json"] == {"k": [1, 2]} and shown["text/plain"] == "Rich()"
    assert base64.b64decode(shown["image/png"]) == b"\x89PNG fake"
    assert ex.results[0]["text/html"] == "<b>bold</b>"
    kinds = [f["type"] for f in ex.frames]
    assert kinds.index("display") < kinds.index("stream") < kinds.index("result"), "frames keep program order"


async def test_an_exception_gives_an_error_frame_naming_the_users_line(science: Server) -> None:
    ex = await run(science, "def f():\n    return 1/0\n\nf()")
    assert ex.status == "error" and ex.exit_code == 1 and ex.error is not None
    assert ex.error["ename"] == "ZeroDivisionError" and ex.error["evalue"] == "division by zero"
    tb = "\n".join(ex.error["traceback"])
    assert "return 1/0" in tb and "line 2" in tb and "in f" in tb
    assert "driver.py" not in tb, "the driver's own frames are not shown"


async def test_a_syntax_error_is_an_error_frame(science: Server) -> None:
    ex = await run(science, "def broken(:\n    pass")
    assert ex.status == "error" and ex.error is not None and ex.error["ename"] == "SyntaxError"
    assert any("def broken(:" in line for line in ex.error["traceback"])


async def test_a_cell_is_compiled_whole_before_any_of_it_runs(science: Server) -> None:
    # As Python compiles a file before it runs a line of it: the last expression's error (a
    # `yield` outside a function is found by the compiler, not the parser) stops the print too.
    ex = await run(science, "print('ran')\n(yield 1)")
    assert ex.status == "error" and ex.error is not None and ex.error["ename"] == "SyntaxError"
    assert ex.stdout == ""


async def test_a_cell_of_one_expression_parses_as_python_does(science: Server) -> None:
    indented = await run(science, "  1 + 1")
    assert indented.error is not None and indented.error["ename"] == "IndentationError"
    failing = await run(science, "1 / 0")
    assert failing.error is not None and failing.error["ename"] == "ZeroDivisionError"
    assert any("1 / 0" in line for line in failing.error["traceback"])
    assert (await run(science, "# a comment\n(6 *\n 7)  # and another")).results == [{"text/plain": "42"}]


async def test_a_cell_too_deep_to_compile_is_its_error_and_the_session_lives(science: Server) -> None:
    # The compiler's own limits (its recursion depth, its memory) end the cell, not the interpreter.
    async with AsyncClient(science.url) as c, c.session() as session:
        await session.execute("x = 7")
        deep = await session.execute("y = 1" + " + 1" * 100_000)
        assert deep.status == "error" and deep.error is not None and deep.error["ename"] == "RecursionError"
        unary = await session.execute("-" * 100_000 + "1")
        # (the parser's MemoryError: a run that raises one ends `memory_limit`, as any does)
        assert unary.error is not None and unary.error["ename"] == "MemoryError"
        assert (await session.execute("x")).results == [{"text/plain": "7"}]


async def test_sys_exit_sets_the_exit_code(science: Server) -> None:
    ok = await run(science, "import sys\nprint('bye')\nsys.exit(0)")
    assert ok.status == "ok" and ok.exit_code == 0 and ok.stdout == "bye\n"
    bad = await run(science, "raise SystemExit(5)")
    assert bad.status == "error" and bad.exit_code == 5


async def test_a_repr_that_raises_falls_back_and_the_cell_ends_cleanly(science: Server) -> None:
    ex = await run(science, "class Bad:\n    def __repr__(self): raise RuntimeError('no')\nBad()")
    assert ex.status == "ok"
    assert ex.results[0]["text/plain"] == "<Bad object; repr failed: RuntimeError>"


async def test_a_huge_repr_is_truncated(science: Server) -> None:
    ex = await run(science, "class Huge:\n    def __repr__(self): return 'x' * 10_000_000\nHuge()")
    assert ex.status == "ok"
    text = ex.results[0]["text/plain"]
    assert len(text) < 300_000 and "truncated" in text


async def test_numpy_results_render_like_a_notebook(science: Server) -> None:
    ex = await run(science, "import numpy as np\nnp.arange(3)")
    assert ex.results[0]["text/plain"] == "array([0, 1, 2])"
