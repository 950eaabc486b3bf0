"""Per-run cgroups: rendering of limits (pure), and real v1/v2 groups where this host has them."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from appliance.sandbox import cgroups, instance
from appliance.sandbox.cgroups import GroupLimits, Write, changes, render_v1, render_v2
from appliance.sandbox.firejail import JAIL_OOM_SCORE_ADJ, JOIN_FAILED, join_argv, oom_join_argv
from tests.support import descriptors_on

# Needs root, firejail or a real server: never in the fast tier (tests/tiers.py).
pytestmark = pytest.mark.host

L = GroupLimits(memory_mb=1024, cpus=1.5, max_procs=64)


def test_v2_rendering_turns_swap_off_and_quotas_cpu() -> None:
    w = {x.file: x.value for x in render_v2(L)}
    assert w["memory.max"] == str(1024 << 20) and w["memory.swap.max"] == "0"
    assert w["cpu.max"] == "150000 100000" and w["pids.max"] == "64" and w["memory.oom.group"] == "1"
    assert w["cpu.weight"] == "100" and {x.file: x.value for x in render_v2(L.idle())}["cpu.weight"] == "10"


def test_v1_memsw_order_follows_direction() -> None:
    files = [x.file for x in render_v1(L, memsw=True, lowering=True)]
    assert files.index("memory.limit_in_bytes") < files.index("memory.memsw.limit_in_bytes")
    files = [x.file for x in render_v1(L, memsw=True, lowering=False)]
    assert files.index("memory.memsw.limit_in_bytes") < files.index("memory.limit_in_bytes")
    assert Write("cpu", "cpu.cfs_quota_us", "150000") in render_v1(L, memsw=False, lowering=True)
    assert Write("cpu", "cpu.shares", "1024") in render_v1(L, memsw=False, lowering=True)


def test_v1_socket_accounting_is_capped_at_the_memory_limit() -> None:
    """v1 charges socket buffers only once memory.kmem.tcp.limit_in_bytes is written."""
    w = {x.file: x.value for x in render_v1(L, memsw=True, lowering=True, tcpmem=True)}
    assert w["memory.kmem.tcp.limit_in_bytes"] == w["memory.limit_in_bytes"] == str(1024 << 20)
    assert "memory.kmem.tcp.limit_in_bytes" not in {x.file for x in render_v1(L, memsw=True, lowering=True)}
    bigger = GroupLimits(memory_mb=2048, cpus=1.5, max_procs=64)
    moved = {x.file: x.value for x in changes(1, L, bigger, memsw=True, tcpmem=True)}
    assert moved["memory.kmem.tcp.limit_in_bytes"] == str(2048 << 20)
    assert changes(1, L.idle(), L, memsw=True, tcpmem=True) == (Write("cpu", "cpu.shares", "1024"),)


def test_a_handout_writes_only_the_cpu_weight() -> None:
    """Idle -> run limits is the take path's cost: one file write, on either version."""
    assert changes(1, L.idle(), L, memsw=True) == (Write("cpu", "cpu.shares", "1024"),)
    assert changes(2, L.idle(), L, memsw=False) == (Write("", "cpu.weight", "100"),)
    assert changes(1, L, L, memsw=True) == ()
    bigger = GroupLimits(memory_mb=2048, cpus=1.5, max_procs=64)
    assert [w.file for w in changes(1, L, bigger, memsw=True)] == [
        "memory.memsw.limit_in_bytes",
        "memory.limit_in_bytes",
    ]


def test_counters_and_owned_memory_parse_both_versions() -> None:
    files = {
        ("cpuacct", "cpuacct.usage"): "2500000000\n",
        ("memory", "memory.oom_control"): "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n",
        ("pids", "pids.events"): "max 7\n",
    }
    c = cgroups.counters_v1(lambda c, f: files[(c, f)])
    assert (c.cpu_ns, c.oom_kills, c.pids_refused) == (2_500_000_000, 3, 7)
    v2 = {
        "cpu.stat": "usage_usec 1500\nuser_usec 1000\n",
        "memory.events": "low 0\noom 1\noom_kill 1\n",
        "pids.events": "max 0\n",
    }
    c = cgroups.counters_v2(lambda _, f: v2[f])
    assert (c.cpu_ns, c.oom_kills, c.pids_refused) == (1_500_000, 1, 0)
    stat1 = "cache 999999999\nrss 1048576\nshmem 1\ntotal_rss 4194304\ntotal_shmem 2097152\nmapped_file 5\n"
    assert cgroups.owned_kb_of_stat(1, stat1) == 6 * 1024  # file pages (cache, mapped) left out
    assert cgroups.owned_kb_of_stat(2, "anon 1048576\nfile 99999999\nshmem 1048576\n") == 2048


def test_instance_names_round_trip_and_reject_strangers() -> None:
    assert instance.parse(instance.name_of(42, 123456, 4026531836)) == instance.Owner(4026531836, 42, 123456)
    # Names older servers wrote: cgroups (pid, start) and run directories (pid).
    assert instance.parse("srv-42-123456") == instance.Owner(None, 42, 123456)
    assert instance.parse("srv-42") == instance.Owner(None, 42, None)
    for name in ("srv-x-1", "other-1-2", "srv-1-2-3-4", "srv-", ".probe-9", "srv-1--2"):
        assert instance.parse(name) is None
    assert instance.start_time(os.getpid()) is not None
    mine = instance.parse(instance.name())
    assert mine is not None and mine.pid_ns == instance.pid_namespace() and not instance.gone(mine)


@pytest.fixture
def tree() -> Iterator[cgroups.Hierarchy]:
    found, missing = cgroups.detect()
    if found is None:
        pytest.skip("no writable cgroup hierarchy: " + "; ".join(missing))
    found.prepare()
    yield found
    found.close()
    assert not any(d.exists() for d in found.dirs.values())


def test_a_live_group_bounds_its_socket_buffers(tree: cgroups.Hierarchy) -> None:
    """A group made here carries the socket limit where the kernel has v1 socket accounting
    (test_dos.py's socket attack proves the kernel then enforces it); v2 needs none."""
    g = tree.group(f"t-{uuid.uuid4().hex[:8]}", L)
    try:
        if tree.version == 1:
            assert tree.tcpmem and tree.socket_gap() is None, "this kernel lost v1 socket accounting"
            limit = (g.paths["memory"] / "memory.kmem.tcp.limit_in_bytes").read_text().strip()
            assert limit == str(1024 << 20)
        else:
            assert tree.socket_gap() is None
    finally:
        g.remove()


def test_real_group_oom_kills_a_process_over_the_memory_limit(tree: cgroups.Hierarchy) -> None:
    g = tree.group(f"t-{uuid.uuid4().hex[:8]}", GroupLimits(memory_mb=64, cpus=1.0, max_procs=16))
    try:
        p = subprocess.run(
            [*join_argv(g.procs_files()), sys.executable, "-c", "b = bytearray(200 << 20)"],
            capture_output=True,
        )
        assert p.returncode == -9
        c = g.counters()
        assert c.oom_kills >= 1 and g.oom_kills() == c.oom_kills
        assert 0 < g.peak_mb() <= 64 and c.cpu_ns > 0
    finally:
        g.remove()
    assert not any(p.exists() for p in g.paths.values())


def test_real_group_pids_limit_stops_a_fork_bomb(tree: cgroups.Hierarchy) -> None:
    g = tree.group(f"t-{uuid.uuid4().hex[:8]}", GroupLimits(memory_mb=256, cpus=1.0, max_procs=8))
    code = (
        "import os, time\ntry:\n  for _ in range(50):\n    if os.fork() == 0:\n      time.sleep(30)\n"
        "      os._exit(0)\nexcept OSError:\n  print('refused', flush=True)\n  time.sleep(30)"
    )
    p = subprocess.Popen([*join_argv(g.procs_files()), sys.executable, "-c", code], stdout=subprocess.PIPE)
    out = p.stdout.readline() if p.stdout else b""
    assert b"refused" in out and len(g.pids()) <= 8 and g.counters().pids_refused >= 1
    g.remove()  # kills the sleeping children too
    assert not any(x.exists() for x in g.paths.values())
    p.wait()
    assert p.returncode == -9


def test_a_handout_moves_a_group_from_idle_to_run_weight(tree: cgroups.Hierarchy) -> None:
    g = tree.group(f"t-{uuid.uuid4().hex[:8]}", L.idle())
    try:
        key = "cpu" if tree.version == 1 else ""
        name = "cpu.shares" if tree.version == 1 else "cpu.weight"
        idle = (g.paths[key] / name).read_text().strip()
        g.set_limits(L)
        assert (idle, (g.paths[key] / name).read_text().strip()) in (("102", "1024"), ("10", "100"))
    finally:
        g.remove()


def test_kept_descriptors_read_fresh_counters_and_close_with_the_group(tree: cgroups.Hierarchy) -> None:
    g = tree.group(f"t-{uuid.uuid4().hex[:8]}", L.idle())
    paths = list(g.paths.values())
    try:
        kept = descriptors_on(*paths)
        assert kept, "the run path's files are kept open from the group's making"
        members = g.paths[cgroups.MEMBERS[tree.version]]
        assert str(members) in kept, "and the directory `members` opens cgroup.procs from"
        before = g.counters(pids=False).cpu_ns
        spin = "import time\nt = time.process_time() + 0.2\nwhile time.process_time() < t: pass"
        proc = subprocess.Popen([*join_argv(g.procs_files()), sys.executable, "-c", spin])
        proc.wait(30)
        g.set_limits(L)  # a kept descriptor's write still lands
        key = "cpu" if tree.version == 1 else ""
        name = "cpu.shares" if tree.version == 1 else "cpu.weight"
        assert (g.paths[key] / name).read_text().strip() in ("1024", "100")
        assert g.counters(pids=False).cpu_ns > before + 100_000_000  # read anew at offset 0, not at EOF
    finally:
        g.remove()
    assert descriptors_on(*paths) == []


def test_members_are_the_groups_processes_read_anew_each_time(tree: cgroups.Hierarchy) -> None:
    """A cell's end reads the group's member list (the processes its held-files search looks
    at): it must list every process that joined and drop one as soon as it is gone."""
    g = tree.group(f"t-{uuid.uuid4().hex[:8]}", L)
    procs = [subprocess.Popen([*join_argv(g.procs_files()), "sleep", "60"]) for _ in range(2)]
    try:
        deadline = time.monotonic() + 30
        while set(g.members() or []) != {p.pid for p in procs} and time.monotonic() < deadline:
            time.sleep(0.01)
        assert set(g.members() or []) == {p.pid for p in procs}
        procs[0].kill()
        procs[0].wait()
        assert g.members() == [procs[1].pid]
    finally:
        g.remove()
        for p in procs:
            p.wait()


@pytest.mark.exclusive  # any server starting meanwhile (another worker's) would purge the planted dead instance first
def test_purge_removes_only_dead_servers_groups(tree: cgroups.Hierarchy) -> None:
    """A server killed with -9 leaves its instance directory; the next start removes it, and the
    processes still in it, but never the directory of a server that is still alive, nor one of
    a server in another PID namespace (its PID says nothing here)."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    here = instance.pid_namespace()
    gone = cgroups.Hierarchy(
        tree.version, tree.base, tree.memsw, instance=instance.name_of(dead.pid, 1, here)
    )  # no such process (start time)
    alive = cgroups.Hierarchy(tree.version, tree.base, tree.memsw, instance=instance.name(os.getppid()))
    # The same dead-looking PID, in a namespace that is not this one: a live server elsewhere.
    foreign = cgroups.Hierarchy(
        tree.version, tree.base, tree.memsw, instance=instance.name_of(dead.pid, 1, here + 1)
    )
    for h in (gone, alive, foreign):
        h.prepare()
    other = foreign.group("j3", L)
    leftover = gone.group("j1", L)
    sleeper = subprocess.Popen([*join_argv(leftover.procs_files()), "sleep", "60"])
    deadline = time.monotonic() + 30  # the launcher joins as it starts, after Popen returns
    while sleeper.pid not in leftover.pids() and time.monotonic() < deadline:
        time.sleep(0.01)
    keep = alive.group("j2", L)
    try:
        purged = tree.purge_dead()  # a dead server's instance another test left goes too
        assert gone.instance in purged and alive.instance not in purged and foreign.instance not in purged
        assert sleeper.wait(timeout=10) == -9
        assert not any(d.exists() for d in gone.dirs.values())
        assert all(p.exists() for p in keep.paths.values())
        assert all(p.exists() for p in other.paths.values())
    finally:
        alive.close()
        gone.close()
        foreign.close()
        if sleeper.poll() is None:
            sleeper.kill()


def placement(lines: list[str]) -> dict[str, str]:
    """Controller ("" on v2) -> the path /proc/self/cgroup's lines give for it."""
    placed = {}
    for line in lines:
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(","):
            placed[c] = path
    return placed


def test_the_oom_score_and_the_join_in_one_shell_fail_closed_and_place_what_follows(
    tree: cgroups.Hierarchy, tmp_path: Path
) -> None:
    """`oom_join_argv` (every jail root starts with a cgroup): one shell writes the OOM score,
    joins every controller's group and execs what follows; a failed join runs nothing."""
    g = tree.group(f"t-{uuid.uuid4().hex[:8]}", L)
    marker = tmp_path / "ran"
    try:
        procs = g.procs_files()
        missing = procs[-1].parent / "gone" / "cgroup.procs"
        argv = oom_join_argv([*procs[:-1], missing])
        p = subprocess.run([*argv, "sh", "-c", f"touch {marker}; echo ran"], capture_output=True, timeout=30)
        assert p.returncode == JOIN_FAILED and b"ran" not in p.stdout and not marker.exists()
        assert argv.count("sh") == 2  # `sh -c SCRIPT sh ...`: one shell, its $0
        look = "cat /proc/self/oom_score_adj; cat /proc/self/cgroup"
        p = subprocess.run([*oom_join_argv(procs), "sh", "-c", look], capture_output=True, timeout=30)
        assert p.returncode == 0, p.stderr
        adj, *lines = p.stdout.decode().splitlines()
        assert int(adj) == JAIL_OOM_SCORE_ADJ
        placed = placement(lines)
        assert all(placed[c].endswith(f"/{g.name}") for c in g.paths), (placed, list(g.paths))
    finally:
        g.remove()


def test_a_failing_join_stops_the_launcher_before_anything_runs(
    tree: cgroups.Hierarchy, tmp_path: Path
) -> None:
    """Fail closed: when the launcher cannot join every controller's group, nothing after it
    is executed, and it ends with JOIN_FAILED."""
    g = tree.group(f"t-{uuid.uuid4().hex[:8]}", L)
    marker = tmp_path / "ran"
    try:
        procs = g.procs_files()
        # The last controller's group is gone (as when a group is removed under a launch).
        missing = procs[-1].parent / "gone" / "cgroup.procs"
        p = subprocess.run(
            [*join_argv([*procs[:-1], missing]), "sh", "-c", f"touch {marker}; echo ran"],
            capture_output=True,
            timeout=30,
        )
        assert p.returncode == JOIN_FAILED and b"ran" not in p.stdout and not marker.exists()
        # And a join that works runs what follows, inside the group.
        p = subprocess.run([*join_argv(procs), "cat", "/proc/self/cgroup"], capture_output=True, timeout=30)
        assert p.returncode == 0
        placed = placement(p.stdout.decode().splitlines())
        assert all(placed[c].endswith(f"/{g.name}") for c in g.paths), (placed, list(g.paths))
    finally:
        g.remove()


def test_cgroup_memory_sees_tmpfs_files_that_proc_cannot(tree: cgroups.Hierarchy) -> None:
    """The GPU watchdog's reading (RunMemory) from the run's group: a tmpfs file the run wrote
    and closed is memory it owns, which /proc's mappings never show."""
    from appliance.sandbox.memory import CgroupMemory, ProcMemory

    g = tree.group(f"t-{uuid.uuid4().hex[:8]}", GroupLimits(memory_mb=512, cpus=1.0, max_procs=16))
    shm = f"/dev/shm/cgroup-test-{uuid.uuid4().hex[:8]}"
    p = subprocess.Popen(
        [
            *join_argv(g.procs_files()),
            sys.executable,
            "-c",
            f"open({shm!r}, 'wb').write(b'x' * (120 << 20))\n"
            "print('written', flush=True)\nimport time; time.sleep(30)",
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert p.stdout is not None and p.stdout.readline() == b"written\n"
        reading = CgroupMemory(tree)
        assert reading.group_dir(p.pid) == g.paths["memory" if tree.version == 1 else ""]
        assert reading.owned_mb(p.pid, {p.pid}) >= 120
        assert ProcMemory().owned_mb(p.pid, {p.pid}) < 120  # what the watchdog read before
        assert reading.group_dir(os.getpid()) is None  # not one of ours: /proc is read instead
    finally:
        p.kill()
        p.wait()
        os.unlink(shm)
        g.remove()


@pytest.mark.parametrize(
    "text",
    [
        "shmem 4096\nswap 0\ntotal_shmem 8192\ntotal_swap 4096\ntotal_rss 99\n",
        "total_shmem 1\nshmem 2",  # no newline at the end
        "file_shmem 5\nshmem_thp 6\nshmem 7\n",  # keys that end or start like another
        "shmem\nshmem x\nshmem 1 2\nshmem -3\n",  # lines parse_keyed skips
        "",
        "\n\nshmem 9\n\n",
    ],
)
def test_one_key_read_in_place_is_what_parsing_every_line_gives(text: str) -> None:
    for key in ("shmem", "total_shmem", "total_swap", "swap", "file_shmem", "shmem_thp"):
        assert cgroups.keyed_value(text, key) == cgroups.parse_keyed(text).get(key), (text, key)


def test_shmem_is_read_high_and_not_at_all_where_swap_goes_uncounted() -> None:
    v1 = "shmem 4096\nswap 0\ntotal_shmem 8192\ntotal_swap 4096\ntotal_rss 99\n"
    assert cgroups.shmem_of_stat(1, v1, None) == 8192 + 4096  # the hierarchy's, swap included
    assert cgroups.shmem_of_stat(1, "total_shmem 8192\n", None) is None  # no swap accounting
    assert cgroups.shmem_of_stat(2, "anon 5\nshmem 8192\n", "4096\n") == 8192 + 4096
    assert cgroups.shmem_of_stat(2, "anon 5\nshmem 8192\n", None) is None
    assert cgroups.shmem_of_stat(2, "anon 5\n", "0\n") is None
