"""Real abuse against real jails: each ends with the right status, leaves nothing behind,
and the next run works."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Unpack

import pytest

from appliance_client.client import AsyncClient, Execution, RequestOptions
from tests.support import Server, jail_factory, jail_processes, metric, scaled, start_server, until_async


@pytest.fixture(scope="module")
def tight(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """No pool (so any process of the sandbox uid under the server is a leftover), small limits."""
    srv = start_server(
        tmp_path_factory.mktemp("limits"),
        SANDBOX_POOL_SIZE="0",
        SANDBOX_MAX_EXEC_MS="4000",
        SANDBOX_MEMORY_MB="256",
        SANDBOX_MAX_PROCS="32",
        SANDBOX_MAX_FILE_MB="8",
        SANDBOX_MAX_DISK_MB="24",
        SANDBOX_MAX_OUTPUT_BYTES="200000",
    )
    yield srv
    srv.stop()


async def run(server: Server, code: str, **fields: Unpack[RequestOptions]) -> Execution:
    async with AsyncClient(server.url) as c:
        return await c.execute(code, **fields)


async def assert_contained(server: Server) -> None:
    left = jail_processes(server)
    assert left == [], f"processes of the sandbox uid survived the run: {left}"
    ok = await run(server, "print('still fine')")
    assert ok.status == "ok" and ok.stdout == "still fine\n"


async def test_an_infinite_loop_ends_with_timeout(tight: Server) -> None:
    ex = await run(tight, "while True: pass", timeout_ms=1500)
    assert ex.status == "timeout" and "1500 ms" in (ex.message or "")
    assert ex.duration_ms is not None
    await assert_contained(tight)


async def test_a_silent_sleep_ends_with_timeout_too(tight: Server) -> None:
    ex = await run(tight, "import time\ntime.sleep(60)", timeout_ms=1000)
    assert ex.status == "timeout"
    await assert_contained(tight)


async def test_a_loop_that_keeps_printing_still_times_out(tight: Server) -> None:
    ex = await run(
        tight,
        "import time\nwhile True:\n    print('.', end='', flush=True); time.sleep(0.05)",
        timeout_ms=1500,
    )
    assert ex.status == "timeout" and ex.stdout.startswith(".")
    await assert_contained(tight)


async def test_a_fork_bomb_is_capped_and_cleaned_up(tight: Server) -> None:
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    ex = await run(tight, code, timeout_ms=3000)
    assert ex.status in ("timeout", "error")
    await assert_contained(tight)


async def test_a_fork_bomb_hits_the_process_limit(tight: Server) -> None:
    code = (
        "import os, time\nkids = 0\n"
        "try:\n    for _ in range(1000):\n        if os.fork() == 0:\n            time.sleep(30); os._exit(0)\n"
        "        kids += 1\nexcept OSError as e:\n    print('refused after', kids, e.errno)\n"
    )
    ex = await run(tight, code, timeout_ms=3000)
    assert "refused after" in ex.stdout, ex
    assert int(ex.stdout.split()[2]) < 32
    await assert_contained(tight)


async def test_a_memory_bomb_ends_with_memory_limit(tight: Server) -> None:
    ex = await run(tight, "blocks = []\nwhile True:\n    blocks.append(bytearray(16 * 1024 * 1024))")
    assert ex.status == "memory_limit", ex
    assert ex.error is not None and ex.error["ename"] == "MemoryError"
    await assert_contained(tight)


async def test_one_huge_allocation_ends_with_memory_limit(tight: Server) -> None:
    ex = await run(tight, "x = bytearray(2 * 1024 ** 3)")
    assert ex.status == "memory_limit"
    await assert_contained(tight)


async def test_a_file_larger_than_the_file_limit_fails_with_efbig(tight: Server) -> None:
    code = "with open('big', 'wb') as f:\n    f.write(b'x' * (9 * 1024 * 1024))"
    ex = await run(tight, code)
    assert ex.status == "error" and ex.error is not None
    assert "File too large" in ex.error["evalue"]
    await assert_contained(tight)


async def test_filling_the_disk_with_many_files_ends_with_output_limit(tight: Server) -> None:
    code = (
        "import os\nfor i in range(10000):\n    with open(f'f{i}', 'wb') as f:\n"
        "        f.write(os.urandom(4 * 1024 * 1024))"
    )
    ex = await run(tight, code, timeout_ms=4000)
    assert ex.status == "output_limit" and "SANDBOX_MAX_DISK_MB" in (ex.message or ""), ex
    await assert_contained(tight)


@pytest.mark.parametrize("end", ["", "\nimport os\nos._exit(0)"], ids=["returns", "exits"])
async def test_a_cell_that_writes_past_the_disk_quota_and_ends_at_once_ends_with_output_limit(
    tight: Server, end: str
) -> None:
    # 28 MiB in four files under the 8 MiB file limit, then done, well inside one disk check
    # interval: the quota is checked once more when the cell ends (it used to end ok).
    code = "for i in range(4):\n    open(f'f{i}', 'wb').write(b'0' * (7 << 20))" + end
    ex = await run(tight, code, timeout_ms=4000)
    assert ex.status == "output_limit" and "SANDBOX_MAX_DISK_MB (24 MiB)" in (ex.message or ""), ex
    await assert_contained(tight)


# The check as a cell ends runs on the event loop while the run left little to look at
# (appliance.sandbox.cell INLINE_*), else in a thread: past each of those bounds the verdict must
# be the same. Each variant holds 28 MiB in run-directory files with no name left (only the
# search for held files can see them) and adds what pushes that search past one bound.
HOLD_28_MIB = (
    "import os\nkeep = []\nfor i in range(4):\n"
    "    fd = os.open(f'h{i}', os.O_CREAT | os.O_RDWR, 0o600)\n"
    "    os.write(fd, b'0' * (7 << 20))\n"
    "    os.unlink(f'h{i}')\n"
    "    keep.append(fd)\n"
)
PAST_INLINE_BOUNDS = {
    "within": HOLD_28_MIB,
    "entries": HOLD_28_MIB + "for i in range(200):\n    open(f'e{i}', 'w').close()\n",
    "descriptors": HOLD_28_MIB + "nulls = [open('/dev/null') for _ in range(100)]\n",
    "threads": HOLD_28_MIB
    + "import threading\nfor _ in range(12):\n"
    + "    threading.Thread(target=threading.Event().wait, daemon=True).start()\n",
    "mappings": HOLD_28_MIB
    + (
        "import mmap\n"
        "maps = [mmap.mmap(-1, 4096, prot=mmap.PROT_READ | (mmap.PROT_WRITE if i % 2 else 0))"
        " for i in range(3000)]\n"
    ),
}


@pytest.mark.parametrize("code", list(PAST_INLINE_BOUNDS.values()), ids=list(PAST_INLINE_BOUNDS))
async def test_held_files_count_at_a_cells_end_whatever_else_the_run_left(tight: Server, code: str) -> None:
    ex = await run(tight, code, timeout_ms=4000)
    assert ex.status == "output_limit" and "SANDBOX_MAX_DISK_MB (24 MiB)" in (ex.message or ""), ex
    await assert_contained(tight)


async def test_the_check_on_the_loop_gives_up_past_its_process_bound_and_the_full_one_does_not() -> None:
    """A cell's leftover processes are killed before its `done` (and firejail ends them when
    the interpreter exits), so a run cannot reach the check's process bound that way; the
    bound is checked here on a live jail whose cell still runs six children holding the files."""
    from appliance.sandbox import channel
    from appliance.sandbox.cell import INLINE_PROCESSES, disk_violation
    from appliance.sandbox.held import OverBound
    from appliance.wire import protocol

    # memfds: on no filesystem of the run's, so only the search of its processes finds them
    # (a file unlinked in the run directory is counted by its tmpfs, with no search).
    held = HOLD_28_MIB.replace("os.open(f'h{i}', os.O_CREAT | os.O_RDWR, 0o600)", "os.memfd_create(f'h{i}')")
    code = (
        held.replace("    os.unlink(f'h{i}')\n", "    os.set_inheritable(fd, True)\n")
        + "import subprocess, time\n"
        + "kids = [subprocess.Popen(['sleep', '30'], close_fds=False) for _ in range(6)]\n"
        + "print('held', flush=True)\ntime.sleep(30)\n"
    )
    with jail_factory({"SANDBOX_MAX_DISK_MB": "24"}) as factory:
        jail = await factory.launch()
        try:
            req = protocol.ExecuteRequest(code=code)
            jail.process.write(channel.run_op(req.code, [], True))
            await jail.process.wait_event("stream", 30)
            kids = jail.run_processes(jail.process.inits())
            assert len(kids) > INLINE_PROCESSES, kids
            with pytest.raises(OverBound):
                disk_violation(jail, 24, inline=True)
            found = disk_violation(jail, 24)
            assert found is not None and "SANDBOX_MAX_DISK_MB (24 MiB)" in found.message
        finally:
            await jail.destroy()


MEMFD_HELD = (
    "import os, time\nfd = os.memfd_create('m')\nos.write(fd, b'0' * ({mib} << 20))\n"
    "open('named', 'wb').write(b'0' * ({named} << 20))\nprint('held', flush=True)\ntime.sleep(30)\n"
)


async def test_a_run_whose_shmem_fits_what_is_left_is_not_searched_and_one_that_may_not_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the run directory and /tmp are counted by their tmpfs, what a cell's end has left
    to find is memfds, whose pages are shmem of the jail's group: a group whose shmem fits in
    what is left of the quota cannot hold more, and is not searched. One whose shmem might
    not fit is searched, and a memfd that takes the run over the quota is found."""
    from appliance.sandbox import cell, cgroups, channel
    from appliance.wire import protocol

    tree, missing = cgroups.open_hierarchy("require")
    assert tree is not None, missing
    from appliance.sandbox.held import held_bytes

    searched: list[int] = []

    def counted(*args: Any) -> int:
        searched.append(1)
        return held_bytes(*args)

    monkeypatch.setattr(cell, "held_bytes", counted)
    try:
        with jail_factory({"SANDBOX_MAX_DISK_MB": "24"}) as factory:
            factory.cgroups = tree
            for mib, named, over in ((2, 1, False), (18, 7, True)):
                jail = await factory.launch()
                try:
                    assert jail.dirs.sizes is not None and jail.tmp_fd is not None  # both counted
                    code = MEMFD_HELD.format(mib=mib, named=named)
                    jail.process.write(channel.run_op(protocol.ExecuteRequest(code=code).code, [], True))
                    await jail.process.wait_event("stream", 30)
                    assert jail.cgroup is not None
                    shmem = jail.cgroup.shmem_bytes()
                    assert shmem is not None and shmem >= (mib + named) << 20  # the bound holds both
                    searched.clear()
                    found = cell.disk_violation(jail, 24, inline=True)
                    if over:  # 7 MiB named and 18 held: over 24, which only the search can see
                        assert searched and found is not None and "(24 MiB)" in found.message
                    else:
                        assert not searched and found is None
                finally:
                    await jail.destroy()
    finally:
        tree.close()


async def test_an_output_flood_ends_with_output_limit(tight: Server) -> None:
    ex = await run(tight, "while True:\n    print('x' * 1000)")
    assert ex.status == "output_limit", ex
    assert len(ex.stdout) <= 200000
    await assert_contained(tight)


async def test_a_stderr_flood_from_a_child_process_ends_with_output_limit(tight: Server) -> None:
    ex = await run(tight, "import subprocess\nsubprocess.run(['sh', '-c', 'yes err 1>&2'])")
    assert ex.status == "output_limit"
    await assert_contained(tight)


async def test_background_daemons_do_not_outlive_the_run(tight: Server) -> None:
    code = (
        "import subprocess, os\n"
        "subprocess.Popen(['sleep', '300'], start_new_session=True)\n"
        "if os.fork() == 0:\n    os.setsid()\n    import time; time.sleep(300)\n"
        "print('left them running')"
    )
    ex = await run(tight, code)
    assert ex.status == "ok" and ex.stdout == "left them running\n"
    await assert_contained(tight)


async def test_a_run_whose_client_disconnects_goes_on_and_an_attach_can_stop_it(tight: Server) -> None:
    async with AsyncClient(tight.url) as c:
        stream = c.stream("import time\nprint('started', flush=True)\ntime.sleep(60)")
        async for frame in stream:
            if frame["type"] == "start":
                run = str(frame["run"])
            if frame["type"] == "stream":
                break
        await stream.aclose()
        assert c._ws is not None
        c._ws.transport.abort()  # gone, without a Close
    async with AsyncClient(tight.url) as c:
        kinds = []
        async for frame in c.attach(run):
            kinds.append(frame.type)
            if frame.type != "done":
                await c.interrupt(frame.id)  # the attach's id reaches the run
    # It was still running (its 4 s limit may come first on a slow machine).
    assert kinds[:2] == ["start", "stream"] and frame["status"] in ("cancelled", "timeout"), (kinds, frame)
    await until_async(lambda: not jail_processes(tight), 10, "the run's teardown")
    await assert_contained(tight)


async def test_past_the_queue_a_request_is_answered_busy_and_nothing_runs(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    import asyncio

    srv = start_server(tmp_path_factory.mktemp("busy"), SANDBOX_MAX_CONCURRENCY="1", SANDBOX_MAX_QUEUE="1")
    try:
        async with AsyncClient(srv.url, retry_busy_s=0) as c:
            # The second is sent once the first runs (its line came back), and the third once
            # the server has queued the second: no fixed sleeps for a busy machine to outlast.
            up = asyncio.Event()
            code = "import time\nprint('up', flush=True)\ntime.sleep(2)\nprint('first')"
            running = asyncio.create_task(c.execute(code, on_stdout=lambda _: up.set()))
            await asyncio.wait_for(up.wait(), scaled(30))
            queued = asyncio.create_task(c.execute("print('second')"))
            await until_async(lambda: metric(srv, "appliance_queue_depth") >= 1, 10, "the second run queued")
            refused = await c.execute("open('/workspace/outputs/ran', 'w')\nprint('third')")
            first, second = await running, await queued
        assert refused.status == "busy" and "queue is full" in (refused.message or "")
        assert refused.stdout == "" and [f["type"] for f in refused.frames] == ["done"]
        assert first.stdout == "up\nfirst\n" and second.stdout == "second\n"
        assert second.frames[0]["queued_ms"] > 0
    finally:
        srv.stop()


def test_disk_usage_stays_on_its_own_filesystem(tmp_path_factory: pytest.TempPathFactory) -> None:
    import subprocess

    from appliance.sandbox.fstree import usage

    root = tmp_path_factory.mktemp("du")
    (root / "own.bin").write_bytes(b"x" * 200_000)
    mnt = root / "mounted"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], check=True)
    try:
        (mnt / "other.bin").write_bytes(b"y" * 3_000_000)
        used, entries, _deep = usage(root, 1000)
        assert 200_000 <= used < 1_000_000 and entries == 1  # own.bin; the mount point is not ours
        inner, _, _ = usage(mnt, 1000)
        assert inner >= 3_000_000
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_the_count_sees_what_the_named_walk_sees(tmp_path: Path) -> None:
    # usage() walks without names or order (Walk.stats): the same entries, links not followed,
    # nothing past the depth bound, as the walk that names them.
    from appliance.sandbox.fstree import Walk, usage

    (tmp_path / "b" / "c").mkdir(parents=True)
    (tmp_path / "b" / "c" / "f.bin").write_bytes(b"x" * 70_000)
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / "sparse").write_bytes(b"")
    os.truncate(tmp_path / "sparse", 50_000_000)  # a hole takes no block
    (tmp_path / "to-host").symlink_to("/usr")
    deep = tmp_path / "d"
    for _ in range(5):
        deep = deep / "d"
    deep.mkdir(parents=True)
    named = list(Walk(tmp_path, max_depth=4))
    used, entries, too_deep = usage(tmp_path, 1000, max_depth=4)
    assert entries == len(named) == 10  # d/d/d/d is listed; what it holds is too deep
    assert used == sum(e.stat.st_blocks * 512 for e in named) < 1_000_000
    assert too_deep == 1
    assert sorted(e.rel for e in named)[:3] == ["a.txt", "b", "b/c"]
    assert usage(tmp_path, 3)[1] == 4  # counting stops just past the bound


async def test_files_held_in_the_private_tmp_with_no_name_count_when_the_cell_ends_at_once(
    tight: Server,
) -> None:
    # The private /tmp is measured by its tmpfs's own count (statvfs), not walked and not
    # searched for held files: 28 MiB in four files there, unlinked while still open (two)
    # or still mapped with their descriptor closed (two), then the cell ends inside one disk
    # check interval. Only a count that sees unnamed pages makes this output_limit.
    code = (
        "import mmap, os\nkeep = []\nfor i in range(4):\n"
        "    fd = os.open(f'/tmp/h{i}', os.O_CREAT | os.O_RDWR, 0o600)\n"
        "    os.write(fd, b'0' * (7 << 20))\n"
        "    os.unlink(f'/tmp/h{i}')\n"
        "    if i % 2:\n"
        "        keep.append(mmap.mmap(fd, 7 << 20))\n"
        "        os.close(fd)\n"
        "    else:\n"
        "        keep.append(fd)"
    )
    ex = await run(tight, code, timeout_ms=4000)
    assert ex.status == "output_limit" and "SANDBOX_MAX_DISK_MB (24 MiB)" in (ex.message or ""), ex
    await assert_contained(tight)
