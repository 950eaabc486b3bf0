"""The unmodified E2B SDK (e2b-code-interpreter, sync and async) against a real server.

The SDK is pointed at the appliance the way docs/e2b.md tells a user: E2B_API_URL and
E2B_SANDBOX_URL at `http://HOST:PORT/e2b`, a tenant's token as E2B_API_KEY.
"""

from __future__ import annotations

import base64
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from e2b import (
    AuthenticationException,
    CommandExitException,
    FileType,
    NotFoundException,
    RateLimitException,
    SandboxException,
    SandboxQuery,
    TimeoutException,
)
from e2b_code_interpreter import AsyncSandbox, Sandbox

from tests.support import Server, scaled, start_server

ALICE = "alice-e2b-token-0123456789"
BOB = "bob-e2b-token-0123456789ab"
CAROL = "carol-e2b-token-0123456789"  # a tenant allowed one session


def tenants_file(root: Path) -> Path:
    path = root / "tenants.toml"
    path.write_text(
        f'[[tenant]]\nname = "alice"\ntoken = "{ALICE}"\n\n'
        f'[[tenant]]\nname = "bob"\ntoken = "{BOB}"\n\n'
        f'[[tenant]]\nname = "carol"\ntoken = "{CAROL}"\nmax_sessions = 1\n'
    )
    path.chmod(0o600)
    return path


def point_sdk(mp: pytest.MonkeyPatch, srv: Server, key: str = ALICE) -> None:
    """Point the unmodified SDK at the server's E2B prefix (both of its URLs) with `key`."""
    mp.setenv("E2B_API_URL", srv.http + "/e2b")
    mp.setenv("E2B_SANDBOX_URL", srv.http + "/e2b")
    mp.setenv("E2B_API_KEY", key)


@pytest.fixture(scope="module")
def e2bsrv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("e2b")
    # Preloaded, and a generous cell limit: a cold matplotlib import takes seconds on a busy
    # small machine.
    srv = start_server(
        tmp,
        SANDBOX_AUTH_TOKENS_FILE=str(tenants_file(tmp)),
        SANDBOX_POOL_SIZE="2",
        SANDBOX_PRELOAD="matplotlib,pandas",
        SANDBOX_MAX_EXEC_MS=str(int(scaled(120_000))),
    )
    yield srv
    srv.stop()


@pytest.fixture(autouse=True)
def sdk_env(e2bsrv: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    point_sdk(monkeypatch, e2bsrv)


@pytest.fixture
def sandbox() -> Iterator[Sandbox]:
    sb = Sandbox.create()
    yield sb
    sb.kill()


def until(check: Callable[[], bool], within_s: float = 20.0) -> bool:
    """Poll check until it holds (True) or the scaled deadline passes (False)."""
    deadline = time.monotonic() + scaled(within_s)
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return check()


def test_create_info_list_kill() -> None:
    tag = os.urandom(6).hex()
    sb = Sandbox.create(metadata={"tag": tag, "kind": "test"}, timeout=120)
    try:
        info = sb.get_info()
        assert info.sandbox_id == sb.sandbox_id
        assert info.metadata == {"tag": tag, "kind": "test"}
        assert info.template_id == "code-interpreter-v1"
        assert 110 <= (info.end_at - info.started_at).total_seconds() <= 120
        listed = Sandbox.list(query=SandboxQuery(metadata={"tag": tag})).next_items()
        assert [s.sandbox_id for s in listed] == [sb.sandbox_id]
        assert Sandbox.list(query=SandboxQuery(metadata={"tag": tag, "kind": "other"})).next_items() == []
        assert sb.is_running()
    finally:
        assert sb.kill() is True
    assert not sb.is_running()
    with pytest.raises(NotFoundException):
        Sandbox.get_info(sb.sandbox_id)
    assert Sandbox.kill(sb.sandbox_id) is False  # the SDK's answer for a sandbox not there


def test_list_pages_through_every_sandbox_once() -> None:
    tag = os.urandom(6).hex()
    made = [Sandbox.create(metadata={"page": tag}) for _ in range(3)]
    try:
        paginator = Sandbox.list(query=SandboxQuery(metadata={"page": tag}), limit=2)
        pages = []
        while paginator.has_next:
            pages.append([s.sandbox_id for s in paginator.next_items()])
        assert [len(p) for p in pages] == [2, 1]
        assert sorted(sid for page in pages for sid in page) == sorted(s.sandbox_id for s in made)
    finally:
        for sb in made:
            sb.kill()


def test_timeout_ends_the_sandbox_and_set_timeout_moves_it() -> None:
    sb = Sandbox.create(timeout=3600)
    sb.set_timeout(3)  # not 1: the info is read before it ends, even on a stalled machine
    info = sb.get_info()
    assert (info.end_at - info.started_at).total_seconds() < 60
    assert until(lambda: not sb.is_running())
    with pytest.raises(NotFoundException):
        sb.run_code("1")
    with pytest.raises(NotFoundException):
        sb.set_timeout(10)


def test_connect_reaches_the_same_interpreter(sandbox: Sandbox) -> None:
    sandbox.run_code("kept = 'across connections'")
    again = Sandbox.connect(sandbox.sandbox_id)
    assert again.run_code("kept").text == "'across connections'"


def test_run_code_streams_to_callbacks(sandbox: Sandbox) -> None:
    out: list[str] = []
    err: list[str] = []
    results: list[str | None] = []
    execution = sandbox.run_code(
        "import sys\nprint('hello')\nprint('warn', file=sys.stderr)\n6 * 7",
        on_stdout=lambda m: out.append(m.line),
        on_stderr=lambda m: err.append(m.line),
        on_result=lambda r: results.append(r.text),
    )
    assert "".join(out) == "hello\n"
    assert "".join(err) == "warn\n"
    assert results == ["42"]
    assert execution.text == "42"
    assert execution.results[0].is_main_result
    assert execution.logs.stdout == ["hello\n"]
    assert execution.execution_count == 1
    assert sandbox.run_code("1").execution_count == 2


def test_matplotlib_png(sandbox: Sandbox) -> None:
    execution = sandbox.run_code(
        "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [1, 4, 9])\nplt.show()"
    )
    assert execution.error is None, execution.error
    pngs = [r.png for r in execution.results if r.png]
    assert len(pngs) == 1
    assert base64.b64decode(pngs[0]).startswith(b"\x89PNG\r\n\x1a\n")


def test_dataframe_html(sandbox: Sandbox) -> None:
    execution = sandbox.run_code("import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': [3, 4]})")
    assert execution.error is None, execution.error
    result = execution.results[0]
    assert result.is_main_result
    assert result.html is not None and "<table" in result.html
    assert result.text is not None and "a" in result.text


def test_an_error_comes_back_typed(sandbox: Sandbox) -> None:
    seen: list[object] = []
    execution = sandbox.run_code("def f():\n    return 1 / 0\nf()", on_error=seen.append)
    assert execution.error is not None
    assert execution.error.name == "ZeroDivisionError"
    assert execution.error.value == "division by zero"
    assert "return 1 / 0" in execution.error.traceback
    assert seen == [execution.error]


def test_state_across_calls_and_separate_contexts(sandbox: Sandbox) -> None:
    sandbox.run_code("x = 41")
    assert sandbox.run_code("x + 1").text == "42"
    ctx = sandbox.create_code_context()
    assert ctx.language == "python"
    execution = sandbox.run_code("x", context=ctx)
    assert execution.error is not None and execution.error.name == "NameError"
    sandbox.run_code("x = 'other'", context=ctx)
    assert sandbox.run_code("x").text == "41"
    assert ctx.id in [c.id for c in sandbox.list_code_contexts()]
    sandbox.restart_code_context(ctx)
    assert sandbox.run_code("x", context=ctx).error is not None  # a restart forgets
    sandbox.remove_code_context(ctx)
    assert ctx.id not in [c.id for c in sandbox.list_code_contexts()]
    with pytest.raises(NotFoundException):
        sandbox.run_code("1", context=ctx)


def test_env_vars_of_the_sandbox_and_of_one_call() -> None:
    sb = Sandbox.create(envs={"GREETING": "hello"})
    try:
        assert sb.run_code("import os\nos.environ['GREETING']").text == "'hello'"
        once = sb.run_code("os.environ['GREETING']", envs={"GREETING": "once", "EXTRA": "1"})
        assert once.text == "'once'"
        assert once.execution_count == 2  # the server's own cells are not counted
        assert sb.run_code("os.environ['GREETING'], os.environ.get('EXTRA')").text == "('hello', None)"
    finally:
        sb.kill()


def test_two_sandboxes_are_isolated() -> None:
    one, two = Sandbox.create(), Sandbox.create()
    try:
        one.run_code("secret = 'one'\nopen('mine.txt', 'w').write('one')")
        assert two.run_code("secret").error is not None
        seen = two.run_code("import os\nos.path.exists('mine.txt'), sorted(os.environ)")
        assert seen.text is not None and seen.text.startswith("(False,")
        assert "SANDBOX_AUTH_TOKENS_FILE" not in seen.text and "E2B_API_KEY" not in seen.text
        with pytest.raises(NotFoundException):
            Sandbox.get_info(one.sandbox_id, api_key=BOB)  # another tenant's reads as missing
    finally:
        one.kill()
        two.kill()


def test_files_round_trip(sandbox: Sandbox) -> None:
    files = sandbox.files
    assert files.write("/home/user/rt/hello.txt", "héllo").path == "/home/user/rt/hello.txt"
    assert files.read("rt/hello.txt") == "héllo"  # relative paths are /home/user's
    blob = bytes(i % 251 for i in range(70_000))
    files.write("rt/blob.bin", blob)
    assert bytes(files.read("rt/blob.bin", format="bytes")) == blob
    files.write_files([{"path": "rt/m/1.txt", "data": "1"}, {"path": "/home/user/rt/m/2.txt", "data": b"2"}])
    listed = sorted(e.path for e in files.list("rt", depth=2))
    assert listed == [f"/home/user/rt/{p}" for p in ("blob.bin", "hello.txt", "m", "m/1.txt", "m/2.txt")]
    assert files.make_dir("rt/d/e") is True
    assert files.make_dir("rt/d/e") is False
    assert files.get_info("rt/d").type == FileType.DIR
    files.rename("rt/d", "rt/d2")
    assert not files.exists("rt/d")
    files.remove("rt/d2")
    assert not files.exists("rt/d2")
    watch = files.watch_dir("/home/user/rt")
    sandbox.run_code("open('rt/by-code.txt', 'w').write('from run_code')")
    seen: list[str] = []

    def written() -> bool:
        seen.extend(e.name for e in watch.get_new_events())
        return "by-code.txt" in seen

    assert until(written), seen
    watch.stop()
    assert files.read("rt/by-code.txt") == "from run_code"
    assert sandbox.run_code("open('rt/hello.txt').read()").text == "'héllo'"
    with pytest.raises(SandboxException):
        files.read("/etc/passwd")


def test_commands_foreground_background_stdin_kill(sandbox: Sandbox) -> None:
    out: list[str] = []
    err: list[str] = []
    result = sandbox.commands.run("echo out; echo err >&2", on_stdout=out.append, on_stderr=err.append)
    assert (result.exit_code, result.stdout, result.stderr) == (0, "out\n", "err\n")
    assert "".join(out) == "out\n" and "".join(err) == "err\n"
    with pytest.raises(CommandExitException) as caught:
        sandbox.commands.run("exit 3")
    assert caught.value.exit_code == 3
    cat = sandbox.commands.run("cat", background=True, stdin=True)
    sandbox.commands.send_stdin(cat.pid, "typed\n")
    assert cat.pid in [p.pid for p in sandbox.commands.list()]
    assert sandbox.commands.kill(cat.pid) is True
    with pytest.raises(CommandExitException) as killed:
        cat.wait()
    assert killed.value.exit_code == 137
    assert cat.pid not in [p.pid for p in sandbox.commands.list()]


def test_a_server_in_the_sandbox_is_reached_through_get_host(e2bsrv: Server, sandbox: Sandbox) -> None:
    sandbox.commands.run("echo served > index.html")
    sandbox.commands.run("python -m http.server 8000 --bind 127.0.0.1", background=True)
    headers = {"Host": sandbox.get_host(8000), "E2B-Traffic-Access-Token": str(sandbox.traffic_access_token)}

    def served() -> bool:
        return httpx.get(e2bsrv.http + "/index.html", headers=headers, timeout=10).text == "served\n"

    assert until(served)


def test_a_wrong_key_is_refused() -> None:
    with pytest.raises(AuthenticationException):
        Sandbox.create(api_key="not-a-tenant-token-at-all")
    with pytest.raises(AuthenticationException):
        Sandbox.list(api_key="not-a-tenant-token-at-all").next_items()


def test_unknown_template_lists_the_templates() -> None:
    with pytest.raises(SandboxException) as caught:
        Sandbox.create(template="no-such-template")
    assert "code-interpreter-v1" in str(caught.value) and "base" in str(caught.value)


def test_other_languages_name_what_is_supported(sandbox: Sandbox) -> None:
    with pytest.raises(SandboxException) as caught:
        sandbox.run_code("console.log(1)", language="javascript")
    assert "python" in str(caught.value)
    with pytest.raises(SandboxException) as caught:
        sandbox.create_code_context(language="r")
    assert "python" in str(caught.value)


def test_pause_and_snapshots_say_not_supported(sandbox: Sandbox) -> None:
    with pytest.raises(SandboxException) as caught:
        sandbox.pause()
    assert "pause is not supported" in str(caught.value)
    with pytest.raises(SandboxException) as caught:
        sandbox.create_snapshot()
    assert "snapshots is not supported" in str(caught.value)


def test_a_run_code_timeout_raises_and_the_context_lives_on(sandbox: Sandbox) -> None:
    sandbox.run_code("kept = 1")
    with pytest.raises(TimeoutException):
        sandbox.run_code("import time\ntime.sleep(60)", timeout=1)

    def answers() -> bool:  # the cell is interrupted once the server sees the client gone
        try:
            return bool(sandbox.run_code("kept").text == "1")
        except SandboxException:
            return False  # still busy with the interrupted cell

    assert until(answers)


def test_a_tenant_quota_applies() -> None:
    first = Sandbox.create(api_key=CAROL)
    try:
        with pytest.raises(RateLimitException):
            Sandbox.create(api_key=CAROL)  # max_sessions = 1
        with pytest.raises(SandboxException):
            first.create_code_context()  # a context is a session too
    finally:
        first.kill()


async def test_async_sdk() -> None:
    sb = await AsyncSandbox.create(metadata={"async": "yes"})
    try:
        lines: list[str] = []

        async def on_stdout(message: object) -> None:
            lines.append(str(message))

        execution = await sb.run_code("print('from async')\n2 ** 10", on_stdout=on_stdout)
        assert execution.text == "1024"
        assert lines == ["from async\n"]
        ctx = await sb.create_code_context()
        assert (await sb.run_code("2 ** 10", context=ctx)).text == "1024"
        listed = await (AsyncSandbox.list(query=SandboxQuery(metadata={"async": "yes"}))).next_items()
        assert sb.sandbox_id in [s.sandbox_id for s in listed]
    finally:
        await sb.kill()
    assert not await sb.is_running()


def test_calls_on_one_context_take_turns_and_keep_their_env_vars(sandbox: Sandbox) -> None:
    from concurrent.futures import ThreadPoolExecutor

    sandbox.run_code("import os, time\nseen = []")
    code = "time.sleep(0.2)\nseen.append(os.environ.get('WHO'))\nos.environ.get('WHO')"
    with ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(lambda who: sandbox.run_code(code, envs={"WHO": who}).text, "abcd"))
    assert texts == ["'a'", "'b'", "'c'", "'d'"]  # each cell saw its own call's value
    assert sorted(eval(str(sandbox.run_code("seen").text))) == ["a", "b", "c", "d"]  # noqa: S307 (a list repr of ours)
    assert sandbox.run_code("'WHO' in os.environ").text == "False"
