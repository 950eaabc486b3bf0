"""Notebook lines (`!cmd`, `%pip install`): the translation is pure (checked as text), and the
lines run in a real jail on a real server (checked end to end)."""

from __future__ import annotations

import ast
import importlib.metadata
import re
from collections.abc import Iterator

import pytest

from appliance.inside.notebook import HOOK, SUPPORTED, translate
from appliance_client.client import AsyncClient, Execution
from tests.support import SANDBOX_UIDS, Server, start_server


class TestTranslation:
    def test_a_shell_line_becomes_a_call_with_the_command_as_a_literal(self) -> None:
        assert translate("!ls -l '/tmp'") == f"{HOOK}.shell(\"ls -l '/tmp'\")\n"

    def test_pip_in_both_spellings_goes_to_pip(self) -> None:
        for line in (
            "%pip install a b==1",
            "!pip install a b==1",
            "!python -m pip install a b==1",
            "%pip3 install a b==1",
            "!pip3 install a b==1",
        ):
            assert translate(line) == f"{HOOK}.pip('install a b==1')\n", line

    def test_indentation_and_line_numbers_are_kept(self) -> None:
        code = "for i in range(2):\n    !echo hi\n    x = 1\ny = 2\n"
        out = translate(code)
        assert out.splitlines()[1] == f"    {HOOK}.shell('echo hi')"
        assert len(out.splitlines()) == len(code.splitlines())
        ast.parse(out)

    def test_a_backslash_continued_command_is_one_command_and_keeps_the_numbering(self) -> None:
        out = translate("!echo a \\\n  b\nz = 1")
        assert out.splitlines() == [f"{HOOK}.shell('echo a  b')", "", "z = 1"]

    def test_lines_inside_strings_and_brackets_are_left_alone(self) -> None:
        code = 's = """\n!not a command\n%not a magic\n"""\nx = (1\n% 2)\n'
        assert translate(code) == code

    def test_code_without_notebook_lines_is_returned_as_is(self) -> None:
        code = "a = 1 % 2\nprint('!')\n"
        assert translate(code) is code

    def test_a_hostile_command_stays_a_string(self) -> None:
        out = translate("!echo '); import os; os.system('x') #")
        tree = ast.parse(out)
        call = tree.body[0].value  # type: ignore[attr-defined]
        assert isinstance(call, ast.Call) and isinstance(call.args[0], ast.Constant)
        assert len(tree.body) == 1

    def test_bash_cell_magic_runs_the_rest_as_one_script(self) -> None:
        assert translate("%%bash\necho 1\necho 2\n") == f"{HOOK}.shell('echo 1\\necho 2\\n')\n"

    def test_matplotlib_inline_is_accepted_and_does_nothing(self) -> None:
        assert translate("%matplotlib inline\nx = 1") == "pass\nx = 1"

    @pytest.mark.parametrize(
        ("code", "lineno"), [("%timeit 1+1", 1), ("%%time\nx = 1", 1), ("x = 1\n%cd /tmp", 2)]
    )
    def test_an_unknown_magic_is_a_syntax_error_naming_the_supported_ones(
        self, code: str, lineno: int
    ) -> None:
        with pytest.raises(SyntaxError) as caught:
            translate(code, "<cell-1>")
        assert "unsupported magic %" in caught.value.msg and SUPPORTED in caught.value.msg
        assert caught.value.filename == "<cell-1>" and caught.value.lineno == lineno

    def test_an_empty_bang_is_a_syntax_error(self) -> None:
        with pytest.raises(SyntaxError, match="needs a shell command"):
            translate("!")


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp("notebook"))
    yield srv
    srv.stop()


async def run(server: Server, code: str, **options: object) -> Execution:
    async with AsyncClient(server.url) as c:
        return await c.execute(code, **options)  # type: ignore[arg-type]


def stream_texts(ex: Execution) -> list[tuple[str, str]]:
    return [(f["name"], f["text"]) for f in ex.frames if f["type"] == "stream"]


class TestInTheJail:
    async def test_shell_output_arrives_in_order_with_prints(self, plain: Server) -> None:
        ex = await run(plain, "print('one')\n!echo two\nprint('three')\n!echo four >&2\nprint('five')")
        assert ex.status == "ok", ex.frames
        assert ex.stdout == "one\ntwo\nthree\nfive\n"
        order = "".join(text for _, text in stream_texts(ex))
        assert order == "one\ntwo\nthree\nfour\nfive\n"

    async def test_the_command_runs_in_the_same_jail_as_the_cell(self, plain: Server) -> None:
        ex = await run(
            plain,
            "open('made_by_python.txt', 'w').write('x')\n!id -u; pwd; ls made_by_python.txt; echo $HOME",
        )
        uid, *rest = ex.stdout.split()
        assert int(uid) in SANDBOX_UIDS, ex.frames  # the jail's own uid (SANDBOX_UID_RANGE)
        assert rest == ["/workspace", "made_by_python.txt", "/workspace"], ex.frames

    async def test_a_failing_command_shows_its_exit_status_and_the_cell_goes_on(self, plain: Server) -> None:
        ex = await run(plain, "!sh -c 'exit 3'\nprint('after', _exit_code)")
        assert ex.status == "ok" and "[command exited with status 3]" in ex.stderr
        assert ex.stdout == "after 3\n"

    async def test_the_last_line_being_a_command_gives_no_result(self, plain: Server) -> None:
        ex = await run(plain, "!echo hi")
        assert ex.results == [] and ex.stdout == "hi\n"

    async def test_the_driver_loads_package_metadata_only_for_pip(self, plain: Server) -> None:
        # importlib.metadata brings some 40 modules (zipfile, bz2, lzma and their libraries)
        # into the driver that imports it: only `%pip` needs it, not every jail.
        probe = "import sys\nprint([m for m in ('importlib.metadata', 'zipfile', 'bz2', 'lzma') if m in sys.modules])"
        assert (await run(plain, probe)).stdout == "[]\n"

    async def test_a_command_in_a_loop_body(self, plain: Server) -> None:
        ex = await run(plain, "for i in range(3):\n    !echo loop")
        assert ex.stdout == "loop\n" * 3

    async def test_a_hung_command_ends_with_the_runs_timeout(self, plain: Server) -> None:
        ex = await run(plain, "!sleep 60", timeout_ms=1500)
        assert ex.status == "timeout", ex.frames

    async def test_an_unknown_magic_is_an_error_before_anything_runs(self, plain: Server) -> None:
        ex = await run(plain, "print('ran')\n%timeit 1")
        assert ex.status == "error" and ex.stdout == ""
        assert ex.error is not None and ex.error.name == "SyntaxError"
        assert "unsupported magic %timeit" in ex.error.value and "%pip install" in ex.error.value

    async def test_pip_without_a_wheelhouse_ends_the_cell_saying_it_is_off(self, plain: Server) -> None:
        ex = await run(plain, "%pip install no-such-dist-here\nprint('went on')")
        assert ex.status == "error" and ex.stdout == "", ex.frames
        assert ex.error is not None and ex.error.name == "PipError"
        assert "pip install no-such-dist-here: pip install is off on this appliance" in ex.error.value
        assert "SANDBOX_WHEELHOUSE" in ex.error.value

    async def test_pip_install_of_what_is_installed_is_satisfied_without_a_wheelhouse(
        self, plain: Server
    ) -> None:
        # As pip answers; smolagents' E2B executor asks for what its final_answer imports.
        version = importlib.metadata.version("numpy")
        ex = await run(plain, f"!pip install pillow numpy=={version}\nprint(_exit_code)")
        assert ex.status == "ok", (ex.stdout, ex.stderr, ex.error)
        assert (
            ex.stdout
            == f"Requirement already satisfied: pillow\nRequirement already satisfied: numpy=={version}\n0\n"
        )
        ex = await run(plain, "%pip install numpy==0.0.1")  # another version: pip's call, and it is off
        assert ex.error is not None and "pip install is off" in ex.error.value

    async def test_pip_subcommands_other_than_install_and_list_are_refused(self, plain: Server) -> None:
        ex = await run(plain, "!pip uninstall -y numpy")
        assert ex.status == "error" and ex.error is not None and ex.error.name == "PipError"
        assert "only `pip install <package> ...` and `pip list` are supported" in ex.error.value

    async def test_pip_list_without_a_wheelhouse_lists_what_is_importable(self, plain: Server) -> None:
        ex = await run(plain, "%pip list\nprint(_exit_code)")
        assert ex.status == "ok", (ex.stdout, ex.stderr)
        assert re.search(r"^pip\s+\d", ex.stdout, re.M), ex.stdout
        assert "%pip install is off on this appliance (no wheelhouse)" in ex.stdout
        assert ex.stdout.endswith("0\n")
