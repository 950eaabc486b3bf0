"""The unmodified E2B SDK's `sandbox.commands` (envd's Process service over Connect) and
`get_host` (servers inside sandboxes, through the port proxy) against a real server and
real jails.

One server for the module; one shared sandbox (one jail) for most tests, a second and a
third only where two sandboxes are the point.
"""

from __future__ import annotations

import asyncio
import secrets
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import CommandExitException, NotFoundException
from e2b_code_interpreter import AsyncSandbox, Sandbox
from websockets.exceptions import WebSocketException
from websockets.sync.client import connect as ws_connect

from appliance.sandbox import cgroups
from tests.support import Server, cmdline, start_server
from tests.test_e2b_sdk import ALICE, BOB, point_sdk, tenants_file, until


@pytest.fixture(scope="module")
def e2bsrv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("e2b-commands")
    srv = start_server(tmp, SANDBOX_AUTH_TOKENS_FILE=str(tenants_file(tmp)), SANDBOX_POOL_SIZE="2")
    yield srv
    srv.stop()


@pytest.fixture(autouse=True)
def sdk_env(e2bsrv: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    point_sdk(monkeypatch, e2bsrv)


@pytest.fixture(scope="module")
def shared(e2bsrv: Server) -> Iterator[Sandbox]:
    mp = pytest.MonkeyPatch()
    point_sdk(mp, e2bsrv)
    sb = Sandbox.create(envs={"FROM_SANDBOX": "yes"})
    yield sb
    sb.kill()
    mp.undo()


def proxied(srv: Server, sb: Sandbox, port: int, path: str = "/", token: str | None = None) -> httpx.Response:
    """A request to `port` in the sandbox the way `get_host` names it: its Host."""
    return httpx.get(
        srv.http + path,
        headers={
            "Host": sb.get_host(port),
            "E2B-Traffic-Access-Token": token if token is not None else str(sb.traffic_access_token),
        },
        timeout=10,
    )


def serving(srv: Server, sb: Sandbox, port: int) -> bool:
    return proxied(srv, sb, port).status_code == 200


def test_a_foreground_command_streams_to_its_callbacks_and_returns_its_result(shared: Sandbox) -> None:
    out: list[str] = []
    err: list[str] = []
    result = shared.commands.run(
        "echo one; echo two >&2; echo three", on_stdout=out.append, on_stderr=err.append
    )
    assert result.exit_code == 0
    assert result.stdout == "one\nthree\n"
    assert result.stderr == "two\n"
    assert "".join(out) == "one\nthree\n"
    assert "".join(err) == "two\n"


def test_a_failing_command_raises_with_its_exit_code_and_output(shared: Sandbox) -> None:
    with pytest.raises(CommandExitException) as caught:
        shared.commands.run("echo why >&2; exit 3")
    assert caught.value.exit_code == 3
    assert caught.value.stderr == "why\n"
    with pytest.raises(CommandExitException) as missing:
        shared.commands.run("no-such-program-here")
    assert missing.value.exit_code == 127


def test_envs_cwd_and_the_jail_it_runs_in(shared: Sandbox) -> None:
    shared.commands.run("mkdir -p sub/dir")
    result = shared.commands.run(
        'pwd; echo "$MINE $FROM_SANDBOX"; id -u; cat /proc/self/status | grep -E "^(NoNewPrivs|Seccomp):"',
        envs={"MINE": "mine"},
        cwd="/home/user/sub/dir",
    )
    lines = result.stdout.splitlines()
    assert lines[0] == "/workspace/sub/dir"  # E2B's /home/user is the jail's working directory
    assert lines[1] == "mine yes"  # the command's envs, and the sandbox's
    assert int(lines[2]) != 0
    assert "NoNewPrivs:\t1" in lines[3:]
    assert "Seccomp:\t2" in lines[3:]  # the jail's seccomp filter, as its cells have
    # What a cell wrote, a command reads: one filesystem.
    shared.run_code("open('from_cell.txt', 'w').write('cell')")
    assert shared.commands.run("cat from_cell.txt").stdout == "cell"


def test_background_stdin_list_connect_and_kill(shared: Sandbox) -> None:
    cat = shared.commands.run("cat", background=True, stdin=True)
    assert cat.pid in [p.pid for p in shared.commands.list()]
    listed = next(p for p in shared.commands.list() if p.pid == cat.pid)
    assert listed.cmd == "/bin/bash"
    assert listed.args == ["-l", "-c", "cat"]
    shared.commands.send_stdin(cat.pid, "first\n")
    again = shared.commands.connect(cat.pid)  # a second stream of the same command
    shared.commands.send_stdin(cat.pid, "second\n")
    shared.commands.close_stdin(cat.pid)
    assert cat.wait().stdout == "first\nsecond\n"
    # From the moment it connected (cat may have echoed "first" after that, or before).
    assert again.wait().stdout in ("second\n", "first\nsecond\n")
    assert cat.pid not in [p.pid for p in shared.commands.list()]

    sleeper = shared.commands.run("sleep 600", background=True)
    assert shared.commands.kill(sleeper.pid) is True
    with pytest.raises(CommandExitException) as killed:
        sleeper.wait()
    assert killed.value.exit_code == 137  # SIGKILL's
    assert shared.commands.kill(sleeper.pid) is False  # not there any more
    with pytest.raises(NotFoundException):
        shared.commands.connect(sleeper.pid)


def jail_group_of(sb: Sandbox) -> tuple[Path, int]:
    """The directory of the sandbox's jail's cgroup that its freezer is asked through, and the
    cgroup version: from where a command of its runs (`/proc/self/cgroup`, seen from inside)."""
    tree, missing = cgroups.detect()
    assert tree is not None, missing
    lines = sb.commands.run("cat /proc/self/cgroup").stdout.splitlines()
    mark = ":freezer:" if tree.version == 1 else "0::"
    path = next(line for line in lines if mark in line).split(":", 2)[2]
    root = Path("/sys/fs/cgroup/freezer" if tree.version == 1 else "/sys/fs/cgroup")
    return root / path.split("/" + cgroups.COMMANDS)[0].lstrip("/"), tree.version


def commands_processes(group: Path) -> list[str]:
    """The command lines of every process in the jail group's commands sub-group, and below."""
    return [
        cmdline(int(pid))
        for procs in (group / cgroups.COMMANDS).rglob("cgroup.procs")
        for pid in procs.read_text().split()
    ]


def test_a_kill_ends_the_whole_command_even_in_a_frozen_jail() -> None:
    """A kill ends every process of the command (a background child too), and lands even where
    the jail's cgroup is frozen (as a session's jail is between cells: a v1 frozen task takes
    a SIGKILL only once thawed). It used to end the command's first process only, and in a
    frozen jail nothing: the command stayed listed and the sandbox's end hung on it."""
    sb = Sandbox.create()
    group, version = jail_group_of(sb)
    state, (frozen, thawed) = cgroups.FREEZE_FILE[version][1], cgroups.FREEZE_VALUE[version]
    try:
        tree = sb.commands.run("sleep 600 & sleep 700", background=True)
        assert until(lambda: {"sleep 600", "sleep 700"} <= {c.strip() for c in commands_processes(group)})
        (group / state).write_text(frozen)
        events = group / cgroups.FREEZE_STATE[version][1]
        assert until(lambda: cgroups.is_frozen(version, events.read_text()))
        assert tree.kill() is True
        assert until(lambda: tree.pid not in {p.pid for p in sb.commands.list()})
        assert until(lambda: commands_processes(group) == [])
        assert sb.run_code("6 * 7").text == "42"  # the sandbox goes on
        # Each command's group goes once it has ended (at the latest as the next one starts).
        assert sb.commands.run("true").exit_code == 0
        assert until(lambda: not [p for p in (group / cgroups.COMMANDS).iterdir() if p.is_dir()])
    finally:
        (group / state).write_text(thawed)  # whatever happened, the sandbox can end
        sb.kill()


def test_a_server_started_with_a_command_is_reached_through_get_host(e2bsrv: Server, shared: Sandbox) -> None:
    shared.commands.run("mkdir -p site && echo hello-from-the-jail > site/index.html")
    server = shared.commands.run(
        "python -m http.server 8123 --bind 127.0.0.1 --directory site", background=True
    )
    assert until(lambda: serving(e2bsrv, shared, 8123))
    assert proxied(e2bsrv, shared, 8123, "/index.html").text == "hello-from-the-jail\n"
    # By E2B's headers on E2B_SANDBOX_URL too.
    by_headers = httpx.get(
        e2bsrv.http + "/e2b/index.html",
        headers={
            "E2b-Sandbox-Id": shared.sandbox_id,
            "E2b-Sandbox-Port": "8123",
            "X-Access-Token": str(shared.traffic_access_token),
        },
        timeout=10,
    )
    assert by_headers.status_code == 200
    assert by_headers.text == "hello-from-the-jail\n"
    # A cell runs and ends; the server keeps serving (the jail is not frozen under it).
    assert shared.run_code("1 + 1").text == "2"
    assert proxied(e2bsrv, shared, 8123, "/index.html").status_code == 200
    # A port nothing listens on.
    closed = proxied(e2bsrv, shared, 8124)
    assert closed.status_code == 502
    assert "not open" in closed.text
    server.kill()


def test_a_websocket_server_in_the_sandbox_echoes_through_the_proxy(e2bsrv: Server, shared: Sandbox) -> None:
    echo = (
        "from websockets.sync.server import serve\n"
        "def echo(ws):\n"
        "    for m in ws: ws.send(m)\n"
        "serve(echo, '127.0.0.1', 8765).serve_forever()\n"
    )
    shared.run_code(f"open('echo_server.py', 'w').write({echo!r})")
    server = shared.commands.run("python echo_server.py", background=True)
    headers = {
        "E2b-Sandbox-Id": shared.sandbox_id,
        "E2b-Sandbox-Port": "8765",
        "X-Access-Token": str(shared.traffic_access_token),
    }
    ws_url = e2bsrv.http.replace("http://", "ws://") + "/e2b/"

    def echoed() -> bool:
        try:
            with ws_connect(ws_url, additional_headers=headers, open_timeout=5) as ws:
                ws.send("ping")
                got = ws.recv(timeout=5)
                ws.send(b"\x00\x01")
                return got == "ping" and ws.recv(timeout=5) == b"\x00\x01"
        except (OSError, TimeoutError, WebSocketException):
            return False

    assert until(echoed)
    # By get_host's name too: the Host is the sandbox's (the socket goes to the appliance).
    sock = socket.create_connection(("127.0.0.1", e2bsrv.port))
    with ws_connect(
        f"ws://{shared.get_host(8765)}/",
        sock=sock,
        additional_headers={"E2B-Traffic-Access-Token": str(shared.traffic_access_token)},
        open_timeout=5,
    ) as ws:
        ws.send("by host")
        assert ws.recv(timeout=5) == "by host"
    server.kill()


def test_two_sandboxes_are_isolated_and_see_nothing_of_the_server(e2bsrv: Server, shared: Sandbox) -> None:
    marker = f"sleep 600.{secrets.randbelow(10**6)}"
    shared.commands.run(marker, background=True)
    shared.commands.run("echo mine > only_here.txt")
    assert "only_here.txt" in shared.commands.run("ls -a").stdout
    mp = pytest.MonkeyPatch()
    point_sdk(mp, e2bsrv, BOB)
    try:
        other = Sandbox.create()
        try:
            procs = other.commands.run("ps -eo args").stdout
            assert marker not in procs
            assert "only_here.txt" not in other.commands.run("ls -a").stdout
            env = other.commands.run("env").stdout
            assert "SANDBOX_AUTH" not in env
            assert ALICE not in env and BOB not in env
            assert "E2B_API_KEY" not in env
            # Another sandbox's commands are not this one's.
            assert not other.commands.list()
            with pytest.raises(NotFoundException):
                other.commands.connect(shared.commands.list()[0].pid)
        finally:
            other.kill()
    finally:
        mp.undo()


def test_the_async_sdk_runs_commands_too(e2bsrv: Server) -> None:
    async def scenario() -> None:
        sb = await AsyncSandbox.create()
        try:
            out: list[str] = []
            result = await sb.commands.run("echo async; exit 0", on_stdout=out.append)
            assert result.stdout == "async\n"
            assert out == ["async\n"]
            handle = await sb.commands.run("cat", background=True, stdin=True)
            await sb.commands.send_stdin(handle.pid, "in\n")
            listed = [p.pid for p in await sb.commands.list()]
            assert handle.pid in listed
            assert await sb.commands.kill(handle.pid) is True
            with pytest.raises(CommandExitException):
                await handle.wait()
            with pytest.raises(CommandExitException) as caught:
                await sb.commands.run("exit 5")
            assert caught.value.exit_code == 5
        finally:
            await sb.kill()

    asyncio.run(scenario())
