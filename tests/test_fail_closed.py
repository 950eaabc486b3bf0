"""Fail closed: a run that cannot be jailed exactly as configured does not run."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from appliance.sandbox.proctree import descendants
from appliance_client.client import AsyncClient
from tests.support import REPO, start_server

UNSHARE = ["unshare", "--pid", "--fork", "--mount-proc"]


async def test_runs_under_a_foreign_pid_namespace_are_still_jailed(tmp_path: Path) -> None:
    # Docker containers look like this to firejail: PID 1 is not an init it knows.
    server = start_server(tmp_path, wrap=UNSHARE)
    try:
        async with AsyncClient(server.url) as c:
            ex = await c.execute("print(open('/proc/self/status').read())")
        status = dict(line.split(":\t", 1) for line in ex.stdout.splitlines() if ":\t" in line)
        assert status["Seccomp"].strip() == "2" and status["NoNewPrivs"].strip() == "1"
        assert ex.status == "ok"
    finally:
        # unshare ignores SIGTERM while it waits; the server is its child (PID 1 in there).
        for pid in descendants(server.proc.pid)[:1]:
            os.kill(pid, signal.SIGTERM)
        server.proc.wait(60)


def test_firejail_that_would_run_code_unjailed_is_refused() -> None:
    # Without container=docker, firejail 0.9.72 under a foreign PID namespace prints
    # "an existing sandbox was detected" and runs the program with no sandbox at all.
    script = textwrap.dedent(
        """
        import asyncio, sys
        from appliance.runtime import logs
        from appliance import settings
        from appliance.core.errors import JailFailure
        from appliance.sandbox import jail as jail_mod
        from appliance.sandbox.host import inspect
        from appliance.sandbox.workdir import RunDirs, stage_runtime

        logs.configure()
        jail_mod.launcher_env = lambda: {"PATH": "/usr/bin:/bin"}  # what a naive launcher passes

        async def main() -> None:
            s = settings.from_env({"SANDBOX_PRELOAD": "", "SANDBOX_PYTHON": sys.executable})
            host = inspect(s.firejail, s.uid, s.python)
            dirs = RunDirs(s.tmp_root, host.uid, host.gid)
            dirs.prepare()
            factory = jail_mod.JailFactory(s, host, stage_runtime(s.tmp_root, s.python), dirs)
            try:
                await factory.launch()
            except JailFailure as exc:
                print("REFUSED:", exc.message)
            else:
                print("RAN UNJAILED")
            dirs.remove_instance()

        asyncio.run(main())
        """
    )
    out = subprocess.run(
        [*UNSHARE, sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert "REFUSED: the jail failed its self-check" in out.stdout, out.stdout + out.stderr
    assert "Seccomp is 0" in out.stderr and "shares the server's PID namespace" in out.stderr


def serve_once(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full = {"PATH": "/usr/bin:/bin", "SANDBOX_PYTHON": sys.executable, "SANDBOX_PRELOAD": "", **env}
    return subprocess.run(
        [sys.executable, "-m", "appliance", "serve", "--port", "0"],
        env=full,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )


@pytest.mark.parametrize(
    ("env", "fragment"),
    [
        ({"SANDBOX_MEMORY_MB": "lots"}, "SANDBOX_MEMORY_MB: expected an integer"),
        ({"SANDBOX_MAX_EXEC_MS": "0"}, "SANDBOX_MAX_EXEC_MS: must be at least 1"),
        ({"SANDBOX_GPU": "maybe"}, "SANDBOX_GPU: expected"),
        ({"SANDBOX_TMP_ROOT": "relative/dir"}, "SANDBOX_TMP_ROOT: must be an absolute path"),
        ({"SANDBOX_AUTH_TOKEN": "short"}, "SANDBOX_AUTH_TOKEN"),
        ({"SANDBOX_FIREJAIL": "/nonexistent/firejail"}, "firejail not found"),
        ({"SANDBOX_UID": "4242"}, "SANDBOX_UID=4242 has no passwd entry"),
        ({"SANDBOX_TMP_ROOT": "/root"}, "SANDBOX_TMP_ROOT is not reachable by the sandbox uid"),
    ],
)
def test_startup_refuses_invalid_settings_naming_the_problem(env: dict[str, str], fragment: str) -> None:
    out = serve_once(env)
    assert out.returncode == 2
    assert fragment in out.stderr, out.stderr


def test_startup_refuses_a_firejail_that_is_not_setuid(tmp_path: Path) -> None:
    copy = tmp_path / "firejail"
    shutil.copyfile("/usr/bin/firejail", copy)  # the same binary without the setuid bit
    copy.chmod(0o755)
    out = serve_once({"SANDBOX_FIREJAIL": str(copy)})
    assert out.returncode == 2 and "is not setuid root" in out.stderr
