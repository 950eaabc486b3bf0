"""The warm pool: single-use jails, as isolated as cold ones, replaced when they die."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Unpack

import pytest

from appliance.core.tasks import TaskScope
from appliance.sandbox import proctree
from appliance.sandbox.jail import JailFactory
from appliance.sandbox.pool import JailPool, mem_available_kb
from appliance.sandbox.process import JailProcess
from appliance.sandbox.proctree import descendants
from appliance_client.client import AsyncClient, Execution, RequestOptions
from tests.support import (
    Server,
    descriptors_on,
    jail_factory,
    reachable_tmp_root,
    run_root,
    start_server,
    until,
    until_async,
)


@pytest.fixture(scope="module")
def pooled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp("pool"), SANDBOX_POOL_SIZE="2")
    yield srv
    srv.stop()


async def run(server: Server, code: str, **fields: Unpack[RequestOptions]) -> Execution:
    async with AsyncClient(server.url) as c:
        return await c.execute(code, **fields)


def metric(server: Server, name: str) -> float:
    _, body = server.get("/metrics")
    for line in body.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as fh:
            return fh.read().strip()
    except OSError:  # it exited between the listing and the read (a teardown in progress)
        return ""


async def wait_pool_ready(server: Server, count: int) -> None:
    # Refills start niced and weighted low: on a busy machine they wait their turn.
    await until_async(lambda: metric(server, "appliance_pool_ready") >= count, 60, "the pool refilled")


async def test_nothing_one_pooled_run_leaves_is_visible_to_the_next(pooled: Server) -> None:
    await wait_pool_ready(pooled, 2)
    leave = (
        "import os, subprocess, builtins, sys\nopen('left.txt','w').write('x')\n"
        "os.environ['LEFT'] = '1'\nbuiltins.LEFT = 1\nsys.modules['json'].LEFT = 1\n"
        "subprocess.Popen(['sleep', '300'])\nglobal_left = 1"
    )
    assert (await run(pooled, leave)).status == "ok"
    look = (
        "import os, json, builtins\n"
        "print(os.path.exists('left.txt'), 'LEFT' in os.environ, hasattr(builtins, 'LEFT'),\n"
        "      hasattr(json, 'LEFT'), 'global_left' in globals())\n"
        "print([p for p in os.listdir('/proc') if p.isdigit() and 'sleep' in open(f'/proc/{p}/cmdline').read()])"
    )
    for _ in range(3):  # whichever jail of the pool serves it
        ex = await run(pooled, look)
        assert ex.stdout == "False False False False False\n[]\n", ex.stdout


async def test_a_pooled_run_is_not_nice_though_its_jail_started_nice(pooled: Server) -> None:
    await wait_pool_ready(pooled, 2)
    # Every thread of the driver (a bare jail: main and control), and a process it starts.
    code = (
        "import os, subprocess\n"
        "print(sorted({os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir('/proc/self/task')}))\n"
        "print(subprocess.run(['nice'], capture_output=True, text=True).stdout.strip())"
    )
    for _ in range(3):  # whichever jail of the pool serves it
        ex = await run(pooled, code)
        assert ex.status == "ok" and ex.stdout == "[0]\n0\n", ex.stdout


async def test_a_jail_killed_while_idle_is_replaced(pooled: Server) -> None:
    await wait_pool_ready(pooled, 2)
    replaced_before = metric(pooled, "appliance_jails_spawned_total")
    firejails = [p for p in descendants(pooled.proc.pid) if comm(p) == "firejail"]
    victim = firejails[0]
    await kill_and_wait(victim)  # killed while idle: gone before the run arrives
    ex = await run(pooled, "print('served')")
    assert ex.status == "ok" and ex.stdout == "served\n"
    await wait_pool_ready(pooled, 2)
    # The whole tree, zombies included: the pool must reap what it killed.
    assert victim not in proctree.tree(pooled.proc.pid)
    assert metric(pooled, "appliance_pool_ready") == 2
    assert metric(pooled, "appliance_jails_spawned_total") >= replaced_before


async def kill_and_wait(pid: int) -> None:
    """SIGKILL pid and wait until it has exited (its pidfd turns readable as it does)."""
    fd = os.pidfd_open(pid)
    try:
        signal.pidfd_send_signal(fd, signal.SIGKILL)
        exited = asyncio.Event()
        asyncio.get_running_loop().add_reader(fd, exited.set)
        try:
            await asyncio.wait_for(exited.wait(), 10)
        finally:
            asyncio.get_running_loop().remove_reader(fd)
    finally:
        os.close(fd)


async def test_a_jail_whose_firejail_was_killed_is_dead_at_once() -> None:
    # The sandbox outlives firejail by milliseconds (its parent-death signal; far longer on a
    # busy host): a pool that looked at the sandbox alone handed such a jail to a run.
    with jail_factory() as factory:
        jail = await factory.launch()
        try:
            assert jail.alive
            await kill_and_wait(jail.process.pid)
            assert not jail.alive
        finally:
            await jail.destroy()


async def test_an_empty_pool_still_serves_runs_with_cold_jails(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    srv = start_server(tmp_path_factory.mktemp("nopool"), SANDBOX_POOL_SIZE="0")
    try:
        results = await asyncio.gather(*(run(srv, f"print({i})") for i in range(6)))
        assert [r.stdout for r in results] == [f"{i}\n" for i in range(6)]
        assert metric(srv, "appliance_cold_starts_total") >= 6
        assert metric(srv, "appliance_pool_ready") == 0
    finally:
        srv.stop()


async def test_a_burst_drains_the_pool_and_falls_back_to_cold_starts(pooled: Server) -> None:
    await wait_pool_ready(pooled, 2)
    before = metric(pooled, "appliance_cold_starts_total")
    results = await asyncio.gather(*(run(pooled, "print('burst')") for _ in range(8)))
    assert all(r.status == "ok" and r.stdout == "burst\n" for r in results)
    assert metric(pooled, "appliance_cold_starts_total") > before


async def test_metrics_report_runs_pool_and_memory(pooled: Server) -> None:
    await run(pooled, "print(1)")
    _, body = pooled.get("/metrics")
    for name in (
        'appliance_runs_total{status="ok"}',
        "appliance_run_duration_seconds_bucket",
        "appliance_queue_wait_seconds_bucket",
        "appliance_pool_ready",
        "appliance_pool_starting",
        "appliance_cold_starts_total",
        "appliance_jails_spawned_total",
        "appliance_sessions_active",
        "appliance_bytes_streamed_total",
        "appliance_jail_pss_bytes",
    ):
        assert name in body, name
    assert metric(pooled, "appliance_jail_pss_bytes") > 1_000_000


def test_the_pool_target_grows_with_the_arrival_rate_within_its_bounds() -> None:
    from appliance.sandbox.pool import pool_target

    base: dict[str, Any] = dict(
        floor=2, ceiling=8, start_s=0.8, have=2, jail_pss_kb=80_000, mem_available_kb=16_000_000
    )
    assert pool_target(arrivals_per_s=0.0, **base) == 2  # idle: the floor
    assert pool_target(arrivals_per_s=4.0, **base) == 5  # 4/s * 0.8 s * 1.5 = 4.8
    assert pool_target(arrivals_per_s=100.0, **base) == 8  # never past the ceiling
    assert pool_target(arrivals_per_s=100.0, **{**base, "floor": 0}) == 0  # pooling off stays off


def test_the_pool_target_never_grows_past_what_memory_affords() -> None:
    from appliance.sandbox.pool import MEMORY_RESERVE_KB, pool_target

    tight = MEMORY_RESERVE_KB + 2 * 80_000  # room for two more jails
    assert (
        pool_target(
            floor=2,
            ceiling=16,
            arrivals_per_s=50.0,
            start_s=1.0,
            have=3,
            jail_pss_kb=80_000,
            mem_available_kb=tight,
        )
        == 5
    )
    assert (
        pool_target(
            floor=2,
            ceiling=16,
            arrivals_per_s=50.0,
            start_s=1.0,
            have=2,
            jail_pss_kb=80_000,
            mem_available_kb=MEMORY_RESERVE_KB,
        )
        == 2
    )


async def test_runs_go_on_when_the_servers_temp_directory_is_removed_under_it(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    import shutil

    from appliance.sandbox import runfs

    with reachable_tmp_root("appliance-gone-") as root:
        srv = start_server(tmp_path_factory.mktemp("gone"), SANDBOX_TMP_ROOT=str(root), SANDBOX_POOL_SIZE="1")
        try:
            await wait_pool_ready(srv, 1)
            instance = run_root(root, srv.proc.pid)
            # The server may remove a jail's directory at the same moment: that one is gone too.
            # Run directories are tmpfs mounts (`runfs`): an operator must detach them first.
            runfs.unmount_under(instance)
            shutil.rmtree(instance, onerror=_unless_already_gone)
            results = [await run(srv, f"print({i})") for i in range(3)]
            assert [r.stdout for r in results] == ["0\n", "1\n", "2\n"], results
            await wait_pool_ready(srv, 1)
            assert instance.is_dir() and oct(instance.stat().st_mode & 0o777) == "0o711"
            assert (instance / "etc" / "ld.so.cache").is_file(), "the jails' /etc was not prepared again"
        finally:
            srv.stop()


def _unless_already_gone(func: object, path: str, exc_info: tuple[type, BaseException, object]) -> None:
    if not isinstance(exc_info[1], FileNotFoundError):
        raise exc_info[1]


async def test_a_cold_start_that_fails_before_the_driver_is_up_is_tried_once_more() -> None:
    from appliance.core.errors import JailStartFailed
    from appliance.sandbox.jail import Jail, JailFactory
    from appliance.sandbox.pool import JailPool

    class FirstStartFails(JailFactory):
        """Injects one transient start failure (firejail exiting during setup), then real jails."""

        failures = 1

        async def launch(self, nice: int = 0) -> Jail:
            if self.failures:
                self.failures -= 1
                raise JailStartFailed("the jail exited before it was ready")
            return await super().launch(nice)

    with jail_factory(cls=FirstStartFails) as factory:
        assert isinstance(factory, FirstStartFails)
        pool = JailPool(factory, size=0)
        try:
            jail = await pool.take()
            assert jail.alive and factory.failures == 0
            await jail.destroy()
            factory.failures = 2  # fails twice: the run is refused, nothing is left
            with pytest.raises(JailStartFailed):
                await pool.take()
        finally:
            await pool.close()


async def test_a_launch_cancelled_anywhere_leaves_no_run_directory_and_no_process() -> None:
    # A run whose client goes while its jail cold-starts is cancelled mid-launch: in the
    # thread that makes its run directory, while firejail spawns, or while the driver starts.
    # The directory a thread went on to make was left behind (a flaky attack-suite failure).
    with jail_factory() as factory:
        for delay in (0, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.03, 0.1):
            task = asyncio.create_task(factory.launch())
            await asyncio.sleep(delay)
            task.cancel()
            try:
                jail = await task
            except asyncio.CancelledError:
                pass
            else:  # it was ready before the cancellation came
                await jail.destroy()
            left = [p.name for p in factory.dirs.instance.iterdir() if p != factory.dirs.etc]
            assert left == [], f"cancelled {delay} s in"
            assert jail_processes_of(factory) == [], f"cancelled {delay} s in"


async def test_a_jail_holds_its_run_directory_open_until_it_is_destroyed() -> None:
    # A cell's end walks the run directory from a descriptor opened as the jail was pinned,
    # and reads its private /tmp's count through another: both close with the jail, or every
    # jail would leak descriptors of the server (and the /tmp one its tmpfs's pages).
    with jail_factory() as factory:
        jail = await factory.launch()
        try:
            assert jail.workdir_fd is not None
            assert os.readlink(f"/proc/self/fd/{jail.workdir_fd}") == str(jail.workdir)
            assert jail.workdir_dev == os.stat(jail.workdir).st_dev
            assert jail.tmp_fd is not None
        finally:
            await jail.destroy()
        assert jail.workdir_fd is None
        assert jail.tmp_fd is None
        assert descriptors_on(jail.workdir) == []


def jail_processes_of(factory: JailFactory) -> list[int]:
    """This test process's descendants whose command line names the factory's run directories
    (firejail's does; a module's server and its pool are other processes)."""
    found = []
    for pid in descendants(os.getpid()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                if os.fsencode(factory.dirs.instance) in fh.read():
                    found.append(pid)
        except OSError:
            continue
    return found


def test_the_memory_the_pool_sizes_by_is_the_kernels_memavailable() -> None:
    def listed() -> int:
        lines = Path("/proc/meminfo").read_text().splitlines()
        return next(int(line.split()[1]) for line in lines if line.startswith("MemAvailable:"))

    assert mem_available_kb() > 0
    # The kernel's figure moves between two reads: the same line, within a few MiB. Another
    # test's allocation between the two can move it further, so a pair is read until one agrees.
    until(
        lambda: abs(mem_available_kb() - listed()) < 64 * 1024, 5, "two reads of MemAvailable within 64 MiB"
    )


async def test_the_pool_measures_its_jails_pss_once_for_jails_started_together(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each measurement reads every process's smaps_rollup (a walk of its address space); the
    jails of one pool start alike, so two started one after the other are measured once."""
    measured: list[int] = []
    real = JailProcess.pss_kb

    def counted(self: JailProcess) -> int:
        measured.append(self.pid)
        return real(self)

    monkeypatch.setattr(JailProcess, "pss_kb", counted)
    with jail_factory() as factory:
        pool = JailPool(factory, size=2)
        try:
            async with TaskScope("test-pool") as scope:
                pool.start(scope)
                async with asyncio.timeout(120):
                    while len(pool.ready) < 2:
                        await asyncio.sleep(0.05)  # polling the pool's own state, not a pause
                assert len(measured) == 1, measured
                assert pool.jail_pss_kb > 1000
                await pool.close()
        finally:
            await pool.close()
