"""Chaos: parts of a real appliance killed, stopped or starved mid-run. Every request still
ends with exactly one `done`, nothing of the run survives, and the server keeps serving."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import websockets

from appliance.sandbox import runfs
from appliance.sandbox.proctree import descendants
from tests.attacks.common import assert_contained, leftovers, run
from tests.support import REPO, Server, cmdline, reachable_tmp_root, run_root, scaled, start_server

SLEEPER = "import time\nprint('started', flush=True)\ntime.sleep(60)"


@pytest.fixture(scope="module")
def chaos_root() -> Iterator[Path]:
    with reachable_tmp_root("appliance-chaos-") as root:
        yield root


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, chaos_root: Path) -> Iterator[Server]:
    srv = start_server(
        tmp_path_factory.mktemp("chaos"),
        SANDBOX_POOL_SIZE="0",
        SANDBOX_TMP_ROOT=str(chaos_root),
        SANDBOX_MAX_EXEC_MS="8000",
    )
    yield srv
    srv.stop()


def parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as fh:
        return int(fh.read().rsplit(")", 1)[1].split()[1])


def jail_processes(server_pid: int) -> dict[str, int]:
    """The running jail's outer firejail, its namespace init and the driver."""
    found: dict[str, int] = {}
    for pid in descendants(server_pid):
        cmd = cmdline(pid)
        if "firejail" in cmd.split(" ")[0]:
            found["init" if parent(pid) != server_pid else "firejail"] = pid
        elif "driver.py" in cmd:
            found["driver"] = pid
    return found


async def start_sleeper(server: Server) -> tuple[Any, dict[str, int]]:
    ws = await websockets.connect(server.url)
    await ws.send(json.dumps({"id": "victim", "code": SLEEPER}))
    while (json.loads(await asyncio.wait_for(ws.recv(), scaled(30)))).get("type") != "stream":
        pass
    return ws, jail_processes(server.proc.pid)


async def rest_of(ws: Any) -> list[dict[str, Any]]:
    frames: list[dict[str, Any]] = []
    while not frames or frames[-1]["type"] != "done":
        frames.append(json.loads(await asyncio.wait_for(ws.recv(), scaled(30))))
    await ws.close()
    return frames


@pytest.mark.parametrize("part", ["firejail", "init", "driver"])
async def test_kill_9_of_a_jail_part_mid_run_still_ends_with_one_done(server: Server, part: str) -> None:
    ws, procs = await start_sleeper(server)
    assert set(procs) == {"firejail", "init", "driver"}, procs
    os.kill(procs[part], signal.SIGKILL)
    frames = await rest_of(ws)
    assert [f["type"] for f in frames].count("done") == 1
    # The sleeper sleeps a minute: unnoticed, the kill would end it `timeout` at the run's limit.
    assert frames[-1]["status"] in ("error", "internal"), frames[-1]
    await assert_contained(server)


async def test_a_sigstopped_jail_is_still_ended_by_the_wall_clock(server: Server) -> None:
    ws, procs = await start_sleeper(server)
    for pid in procs.values():
        os.kill(pid, signal.SIGSTOP)
    frames = await rest_of(ws)
    assert frames[-1]["status"] == "timeout", frames[-1]
    await assert_contained(server)


@pytest.fixture
def small_tmpfs() -> Iterator[Path]:
    mount = Path(tempfile.mkdtemp(prefix="appliance-tmpfs-", dir="/tmp"))
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=24m,mode=755", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.fail(f"cannot mount a tmpfs here (needs root/CAP_SYS_ADMIN): {done.stderr}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)
    os.rmdir(mount)


async def test_a_full_temp_root_fails_runs_cleanly_and_the_server_recovers(
    tmp_path: Path, small_tmpfs: Path
) -> None:
    srv = start_server(
        tmp_path / "srv", SANDBOX_POOL_SIZE="0", SANDBOX_TMP_ROOT=str(small_tmpfs), SANDBOX_MAX_DISK_MB="256"
    )
    try:
        # The run tries to fill the temp root: a clean error in the jail (the file size limit,
        # or ENOSPC), and where run directories are tmpfs of their own (`runfs`, a root server)
        # the temp root does not even see it.
        before = os.statvfs(small_tmpfs).f_bfree
        flood = await run(
            srv,
            "with open('big', 'wb') as f:\n    while True:\n        f.write(b'x' * (1 << 20))",
            token=None,
        )
        refused = ("No space left", "File too large")
        assert flood.status == "error" and flood.error and any(r in flood.error["evalue"] for r in refused), (
            flood
        )
        if os.geteuid() == 0:
            assert os.statvfs(small_tmpfs).f_bfree >= before - 64, "the run wrote to the temp root"
        assert (await run(srv, "print('recovered')", token=None)).stdout == "recovered\n"
        # The host fills it: runs fail with a done, never hang or crash the server.
        filler = small_tmpfs / "filler"
        with open(filler, "wb") as fh:
            try:
                while True:
                    fh.write(b"\0" * (1 << 20))
                    fh.flush()
            except OSError:
                pass
        starved = await run(srv, "open('f', 'wb').write(b'x' * (1 << 20))", token=None)
        # A run's own tmpfs (root server) does not need the temp root's space: it may succeed.
        allowed = ("ok", "error", "internal") if os.geteuid() == 0 else ("error", "internal")
        assert starved.status in allowed, starved
        assert srv.proc.poll() is None and srv.get("/healthz")[0] == 200
        filler.unlink()
        assert (await run(srv, "print('recovered again')", token=None)).stdout == "recovered again\n"
        assert leftovers(srv) == ([], [])  # teardown may finish just after `done`
    finally:
        srv.stop()


async def start_and_kill_9(server: Server, code: str) -> dict[str, int]:
    """Start code in a jail, wait for its first output, then kill -9 the server."""
    ws = await websockets.connect(server.url)
    await ws.send(json.dumps({"id": "victim", "code": code}))
    while (json.loads(await asyncio.wait_for(ws.recv(), scaled(30)))).get("type") != "stream":
        pass
    procs = jail_processes(server.proc.pid)
    assert set(procs) == {"firejail", "init", "driver"}, procs
    server.proc.kill()
    server.proc.wait()
    ws.transport.abort()
    return procs


def living(pids: dict[str, int]) -> list[int]:
    return [p for p in pids.values() if os.path.exists(f"/proc/{p}") and cmdline(p)]


async def test_a_server_killed_mid_run_takes_its_running_jail_with_it(
    tmp_path: Path, chaos_root: Path
) -> None:
    server = start_server(tmp_path / "srv", SANDBOX_POOL_SIZE="0", SANDBOX_TMP_ROOT=str(chaos_root))
    procs = await start_and_kill_9(server, SLEEPER)
    # The driver sees its control pipe close mid-cell and kills its whole PID namespace.
    deadline = time.monotonic() + scaled(5)
    while living(procs) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert living(procs) == []


# Any server that starts meanwhile purges a dead server's groups and what runs in them (as it
# should), so under pytest-xdist another worker's server could end this jail before the restart.
@pytest.mark.exclusive
async def test_a_restart_purges_jails_that_outlived_a_killed_server(tmp_path: Path, chaos_root: Path) -> None:
    first = start_server(tmp_path / "first", SANDBOX_POOL_SIZE="0", SANDBOX_TMP_ROOT=str(chaos_root))
    instance = run_root(chaos_root, first.proc.pid)
    # A cell spinning in C holds the GIL, so the driver cannot act on the closed pipe; and
    # firejail is setuid, so no parent-death signal reaches it: this jail outlives its server ...
    spin = "print('spinning', flush=True)\nimport re\nre.match(r'(a+)+$', 'a' * 64 + 'b')"
    procs = await start_and_kill_9(first, spin)
    await asyncio.sleep(1)
    assert living(procs), "expected the GIL-holding jail to outlive its server until a restart"
    assert instance.exists()
    if os.geteuid() == 0:  # a root server's run directories are tmpfs mounts (`runfs`)
        assert runfs.mounts_under(instance), "expected the dead server's run tmpfs still mounted"
    second = start_server(tmp_path / "second", SANDBOX_POOL_SIZE="0", SANDBOX_TMP_ROOT=str(chaos_root))
    try:
        # ... and the restart on the same SANDBOX_TMP_ROOT kills it and removes its directories.
        deadline = time.monotonic() + scaled(10)
        while living(procs) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert living(procs) == []
        assert not instance.exists() and runfs.mounts_under(instance) == []
        assert "purged stale run directories" in second.logs()
        assert (await run(second, "print('fresh')", token=None)).stdout == "fresh\n"
    finally:
        second.stop()


def warm_jails(server_pid: int) -> dict[str, int]:
    """Each jail's firejail launcher, its sandbox's init and the driver under it (what lives as
    long as the jail: not the short-lived helpers firejail or the driver may run)."""
    from appliance.sandbox.proctree import children

    found: dict[str, int] = {}
    for launcher in children(server_pid):
        if "firejail" not in cmdline(launcher).split(" ")[0]:
            continue
        found[f"firejail {launcher}"] = launcher
        for init in children(launcher):
            found[f"init {init}"] = init
            for driver in children(init):
                if "driver.py" in cmdline(driver):
                    found[f"driver {driver}"] = driver
    return found


def _cgroup_instances(pid: int) -> list[Path]:
    """The cgroup instance directories of server `pid` (of this PID namespace), where there are any."""
    from appliance.sandbox import cgroups, instance

    tree, _ = cgroups.detect()
    if tree is None:
        return [Path("/")]  # no cgroups here: nothing to have removed
    return [d / instance.name(pid) for d in tree.base.values() if (d / instance.name(pid)).is_dir()]


async def test_a_server_in_another_pid_namespace_leaves_a_live_servers_jails_alone(
    tmp_path: Path, chaos_root: Path
) -> None:
    """Two servers share the temp root and the cgroup tree, one in a PID namespace of its own
    (a container): it cannot see the other's PID, which it must not take for a dead server's.
    It used to: it killed the live server's warm jails and removed its run directories and
    groups, and that server's next run had no cgroup instance to make a group in."""
    first = start_server(tmp_path / "first", SANDBOX_POOL_SIZE="2", SANDBOX_TMP_ROOT=str(chaos_root))
    second: Server | None = None
    try:
        instance = run_root(chaos_root, first.proc.pid)
        # The warm jails, once the server is ready, every pool holds its target (one above it
        # retires a jail by itself) and none comes or goes for half a second (the startup
        # canary's jail is torn down after its run).
        warm: dict[str, int] = {}
        deadline = time.monotonic() + scaled(60)
        while time.monotonic() < deadline:
            status, body = first.get("/readyz")
            pools = json.loads(body).get("pools", {})
            settled = status == 200 and bool(pools)
            settled = settled and all(
                p["ready"] == p["target"] and p["starting"] == 0 for p in pools.values()
            )
            now = warm_jails(first.proc.pid)
            if settled and now and now == warm:
                break
            warm = now
            await asyncio.sleep(0.5)
        assert warm, "no warm jail"
        second = start_server(
            tmp_path / "second",
            wrap=["unshare", "--pid", "--fork", "--mount-proc"],
            SANDBOX_POOL_SIZE="1",
            SANDBOX_TMP_ROOT=str(chaos_root),
        )
        assert living(warm) == list(warm.values()), "the other namespace's server killed them"
        assert instance.exists() and _cgroup_instances(first.proc.pid), "the other server removed them"
        assert (await run(first, "print('still here')", token=None)).stdout == "still here\n"
    finally:
        if second is not None:
            # unshare ignores SIGTERM while it waits; the server is its child (PID 1 in there).
            for pid in descendants(second.proc.pid)[:1]:
                os.kill(pid, signal.SIGTERM)
            second.proc.wait(60)
        first.stop()


def serve_with(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("SANDBOX_")}
    full.update({"SANDBOX_PYTHON": sys.executable, "SANDBOX_PRELOAD": ""}, **env)
    return subprocess.run(
        [sys.executable, "-m", "appliance", "serve", "--host", "127.0.0.1", "--port", "0"],
        env=full,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )


def test_startup_refuses_a_missing_firejail() -> None:
    out = serve_with({"SANDBOX_FIREJAIL": "/nonexistent/firejail"})
    assert out.returncode == 2 and "firejail not found" in out.stderr, out.stderr


def test_startup_refuses_a_firejail_that_is_not_setuid(tmp_path: Path) -> None:
    copy = tmp_path / "firejail"
    shutil.copy(shutil.which("firejail") or "/usr/bin/firejail", copy)  # copies drop the setuid bit
    os.chmod(copy, 0o755)
    out = serve_with({"SANDBOX_FIREJAIL": str(copy)})
    assert out.returncode == 2 and "is not setuid root" in out.stderr, out.stderr
