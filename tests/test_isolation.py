"""What a run must not see or reach: the server's env, other runs, host secrets, the network."""

from __future__ import annotations

import ast
import asyncio
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from appliance_client.client import AsyncClient, Execution
from tests.support import REPO, Server, start_server

SECRET = "AKIAFAKESECRET0123456789"


@pytest.fixture(scope="module")
def secretive(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # A minute per run: one test walks the whole filesystem (some 200,000 entries on a host
    # with a checkout and its virtualenv), which took over 15 s under the full suite's load.
    srv = start_server(
        tmp_path_factory.mktemp("iso"),
        AWS_SECRET_ACCESS_KEY=SECRET,
        SANDBOX_AUTH_TOKEN="token-" + SECRET,
        SANDBOX_MAX_EXEC_MS="60000",
    )
    yield srv
    srv.stop()


async def run(server: Server, code: str) -> Execution:
    async with AsyncClient(server.url, token="token-" + SECRET) as c:
        return await c.execute(code)


async def test_the_servers_environment_does_not_reach_the_code(secretive: Server) -> None:
    ex = await run(
        secretive, "import os\nprint(sorted(os.environ))\nprint(open('/proc/1/environ','rb').read())"
    )
    assert SECRET not in ex.stdout + ex.stderr
    assert "AWS_SECRET_ACCESS_KEY" not in ex.stdout and "SANDBOX_AUTH_TOKEN" not in ex.stdout


async def test_a_run_cannot_read_etc_shadow(secretive: Server) -> None:
    ex = await run(secretive, "open('/etc/shadow').read()")
    assert ex.status == "error" and ex.error is not None
    assert ex.error["ename"] in ("PermissionError", "FileNotFoundError")


async def test_a_run_cannot_see_another_runs_files(secretive: Server) -> None:
    # The writer holds its file until the reader's walk of the whole filesystem is over
    # (it waits on stdin), and must then end ok: a walk that outlasted the writer's run
    # would find nothing whether or not runs are isolated, and would prove nothing.
    async with AsyncClient(secretive.url, token="token-" + SECRET) as c:
        written = asyncio.Event()

        async def write() -> list[dict[str, object]]:
            frames: list[dict[str, object]] = []
            code = (
                "import os, sys\nopen('private.txt','w').write('run A secret')\n"
                "print(os.path.realpath('.'), flush=True)\nsys.stdin.readline()"
            )
            async for frame in c.stream(code, id="writer"):
                frames.append(frame)
                if frame.get("type") == "stream":
                    written.set()
            return frames

        writer = asyncio.create_task(write())
        await asyncio.wait_for(written.wait(), 30)
        reader = await c.execute(
            "import os\nfound = []\n"
            "for root, dirs, files in os.walk('/'):\n"
            "    if root.startswith(('/proc', '/sys')):\n        dirs[:] = []; continue\n"
            "    found += [os.path.join(root, f) for f in files if f == 'private.txt']\n"
            "print(found)\nprint(os.listdir('/tmp'))"
        )
        await c.stdin("writer", "done\n", eof=True)
        frames = await writer
    assert frames[-1].get("status") == "ok", frames[-1]  # the file was there for the whole walk
    assert reader.status == "ok" and reader.stdout.splitlines()[:1] == ["[]"], (
        reader.status,
        reader.message,
        reader.stdout,
        reader.error,
    )
    assert "run A secret" not in reader.stdout


async def test_a_run_cannot_reach_the_server_or_any_host_port_on_loopback(secretive: Server) -> None:
    code = (
        f"import socket\nfor port in ({secretive.port}, 22, 80):\n"
        "    s = socket.socket(); s.settimeout(1)\n"
        "    try:\n        s.connect(('127.0.0.1', port)); print('reached', port)\n"
        "    except OSError as e:\n        print('refused', port, e.errno)\n"
        "print(socket.if_nameindex())"
    )
    ex = await run(secretive, code)
    assert "reached" not in ex.stdout
    assert ex.stdout.count("refused") == 3
    assert "[(1, 'lo')]" in ex.stdout


async def test_a_run_has_no_route_to_any_outside_address(secretive: Server) -> None:
    code = (
        "import socket\ns = socket.socket(); s.settimeout(1)\n"
        "try:\n    s.connect(('169.254.169.254', 80)); print('reached')\n"
        "except OSError as e:\n    print('unreachable', e.errno)"
    )
    ex = await run(secretive, code)
    assert ex.stdout.startswith("unreachable"), ex.stdout


async def test_the_host_filesystem_is_hidden_except_system_dirs(secretive: Server) -> None:
    code = (
        "import os\nprint(sorted(os.listdir('/')))\n"
        f"print(os.path.exists({str(REPO)!r} + '/appliance'))\n"
        "for path in ('/root', '/home', '/var', '/opt', '/run/user'):\n"
        "    try:\n        print(path, os.listdir(path))\n"
        "    except OSError as e:\n        print(path, 'denied', e.errno)"
    )
    ex = await run(secretive, code)
    lines = ex.stdout.splitlines()
    assert lines[1] == "False", "the repository must not be visible in the jail"
    venv = Path(sys.prefix)  # whitelisted read-only: the only thing its ancestors may show
    for line in lines[2:]:
        path = Path(line.split(" ", 1)[0])
        if path in venv.parents:
            assert line == f"{path} {[venv.relative_to(path).parts[0]]}", line
        else:
            assert "denied" in line or line.endswith("[]"), line


async def test_the_python_environment_is_read_only(secretive: Server) -> None:
    code = f"open({sys.prefix!r} + '/pwned', 'w')"
    ex = await run(secretive, code)
    assert ex.status == "error" and ex.error is not None
    assert ex.error["ename"] in ("PermissionError", "OSError")


async def test_no_gpu_or_other_device_nodes_in_cpu_mode(secretive: Server) -> None:
    ex = await run(secretive, "import os\nprint(sorted(os.listdir('/dev')))")
    devices = ast.literal_eval(ex.stdout)  # the run's own listing
    assert not [d for d in devices if d.startswith("nvidia")]
    assert set(devices) <= {
        "full",
        "null",
        "random",
        "urandom",
        "zero",
        "tty",
        "pts",
        "ptmx",
        "shm",
        "stdin",
        "stdout",
        "stderr",
        "fd",
        "log",
    }


PROBE = (
    "import socket, sys\n"
    "for port in map(int, sys.argv[1:]):\n"
    "    s = socket.socket(); s.settimeout(1)\n"
    "    try:\n        s.connect(('127.0.0.1', port)); print('reached', port)\n"
    "    except OSError as e:\n        print('refused', port, e.errno)\n"
)


async def test_host_ports_that_listen_are_reached_from_the_host_and_refused_from_a_run(
    secretive: Server,
) -> None:
    # Guards the loopback test above: it must not pass just because nothing listens. The same
    # probe reaches the server's port and one this test listens on when run on the host, and
    # reaches neither from inside a jail.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        ports = [secretive.port, listener.getsockname()[1]]
        args = [str(p) for p in ports]
        on_host = subprocess.run(
            [sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=60
        )
        in_jail = await run(secretive, f"import sys\nsys.argv[1:] = {args!r}\n" + PROBE)
    assert on_host.stdout.split("\n")[:2] == [f"reached {p}" for p in ports], on_host
    assert in_jail.stdout.count("refused") == 2 and "reached" not in in_jail.stdout, in_jail.stdout
