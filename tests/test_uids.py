"""A uid per jail (appliance.sandbox.uids): held exclusively across servers, never one a process
still runs as, given back only once its processes are gone; the range leaves host accounts out."""

from __future__ import annotations

import asyncio
import fcntl
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from appliance.sandbox import uids
from appliance.sandbox.uids import Held, Uids
from appliance.sandbox.workdir import RunDirs, open_base
from tests.support import SANDBOX_UID, SANDBOX_UIDS, reachable_tmp_root, until, until_async

# Far from any account or jail of this host (tests of the real server use 1001 onwards).
FIRST = 3_900_000


@pytest.fixture
def root() -> Iterator[Path]:
    with reachable_tmp_root("appliance-uids-") as path:
        yield path


def running_as(uid: int) -> list[int]:
    """The processes of uid, once there are any (setpriv switches after it has started)."""
    return until(lambda: uids.processes_of(uid), 10, f"a process of uid {uid}")


def pool(root: Path, n: int = 3) -> Uids:
    u = Uids(root, 1001, 1001, tuple(range(FIRST, FIRST + n)))
    u.prepare()
    return u


def counted_calls(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """A list that grows by one at each call of `uids.<name>`, which still does its work."""
    calls: list[int] = []
    real = getattr(uids, name)

    def counted() -> object:
        calls.append(1)
        return real()

    monkeypatch.setattr(uids, name, counted)
    return calls


def test_the_range_leaves_out_the_shared_uid_and_host_accounts() -> None:
    ok, skipped = uids.usable(0, 2, shared=1)
    assert 1 not in ok and 1 not in skipped
    assert 0 in skipped  # root has an account
    assert 2 in ok or 2 in skipped
    assert uids.usable(FIRST, FIRST + 2, shared=1001) == ((FIRST, FIRST + 1, FIRST + 2), ())


def test_a_uid_is_held_by_one_jail_until_given_back(root: Path) -> None:
    u = pool(root)
    held = [u.take() for _ in range(3)]
    assert all(h is not None for h in held)
    assert len({h.uid for h in held if h is not None}) == 3
    assert u.take() is None, "a fourth jail got a uid already held"
    first = held[0]
    assert first is not None
    u.give_back(first)
    again = u.take()
    assert again is not None and again.uid == first.uid
    u.give_back(first)  # a second give-back does nothing (the uid is held again)
    assert u.take() is None


def test_another_server_cannot_take_a_held_uid(root: Path) -> None:
    u = pool(root, 1)
    held = u.take()
    assert held is not None
    # Another process (another server) sharing the temp root finds the uid locked.
    code = (
        "import sys\nfrom pathlib import Path\nfrom appliance.sandbox.uids import Uids\n"
        f"u = Uids(Path(sys.argv[1]), 1001, 1001, ({FIRST},))\nprint(u.take())"
    )
    other = subprocess.run(
        [sys.executable, "-c", code, str(root)], capture_output=True, text=True, check=True
    )
    assert other.stdout.strip() == "None", other
    u.give_back(held)
    other = subprocess.run(
        [sys.executable, "-c", code, str(root)], capture_output=True, text=True, check=True
    )
    assert f"uid={FIRST}" in other.stdout, other


@pytest.mark.host  # setpriv to another uid needs root (tests/tiers.py)
def test_a_uid_a_process_still_runs_as_is_not_taken(root: Path) -> None:
    # A jail of a server killed with -9 outlives its server's locks: its uid stays busy.
    orphan = subprocess.Popen(
        ["setpriv", f"--reuid={FIRST}", f"--regid={FIRST}", "--clear-groups", "sleep", "60"]
    )
    try:
        u = pool(root, 2)
        assert running_as(FIRST) == [orphan.pid]
        held = u.take()
        assert held is not None and held.uid == FIRST + 1
        assert u.take() is None
    finally:
        orphan.kill()
        orphan.wait()


@pytest.mark.host  # setpriv to another uid needs root (tests/tiers.py)
def test_giving_back_kills_what_is_left_of_the_jail(root: Path) -> None:
    u = pool(root, 1)
    held = u.take()
    assert held is not None
    # Left behind and orphaned, as a jail's daemon is: its parent is gone, init reaps it.
    drop = f"setpriv --reuid={FIRST} --regid={FIRST} --clear-groups"
    subprocess.run(["sh", "-c", f"{drop} sleep 60 >/dev/null 2>&1 &"], check=True)
    assert running_as(FIRST), "the leftover did not start"
    u.give_back(held)
    assert uids.processes_of(FIRST) == [], "a process of the uid outlived its give-back"
    assert u.take() is not None


@pytest.mark.host  # setpriv to another uid needs root (tests/tiers.py)
def test_a_uid_given_back_with_its_group_removed_is_not_scanned_yet_never_handed_out_busy(root: Path) -> None:
    """A give-back after the jail's cgroup was removed scans nothing (nothing of the jail can be
    alive: `uids`' docstring); what may still be of the uid (here a process no group of the
    jail held, as a zombie that left its group as it exited is) keeps it from the next take,
    whose scan sees it: a uid is never handed to a jail while a process of it lives."""
    u = pool(root, 1)
    held = u.take()
    assert held is not None and held.uid == FIRST
    stray = subprocess.Popen(
        ["setpriv", f"--reuid={FIRST}", f"--regid={FIRST}", "--clear-groups", "sleep", "60"]
    )
    try:
        assert running_as(FIRST) == [stray.pid]
        u.give_back(held, emptied=True)
        assert held.fd is None
        assert uids.processes_of(FIRST) == [stray.pid], "the give-back scanned and killed"
        assert u.take() is None, "a uid a process still runs as was handed out"
    finally:
        stray.kill()
        stray.wait()
    again = until(u.take, 10, "the uid, once its process is gone")
    assert again is not None and again.uid == FIRST


@pytest.mark.host  # setpriv to another uid needs root (tests/tiers.py)
def test_a_take_scans_after_its_lock_so_a_jail_ended_meanwhile_is_seen(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another holder may take a uid, run a jail and give it back (a zombie of it left: its group
    is gone, so no scan at the give-back) while a take is under way. The take's scan comes after
    its lock, so either that holder finds the uid locked, or the scan sees what it left."""
    mine, other = pool(root, 1), pool(root, 1)
    scans: list[Held | None] = []
    stray: list[subprocess.Popen[bytes]] = []
    real = uids.uids_in_use

    def scan_then_another_jail_runs() -> set[int]:
        found = real()
        if not scans:  # once, between this take's scan and whatever follows it
            monkeypatch.setattr(uids, "uids_in_use", real)
            theirs = other.take()
            scans.append(theirs)
            if theirs is not None:  # only a holder of the uid starts its processes
                drop = ["setpriv", f"--reuid={FIRST}", f"--regid={FIRST}", "--clear-groups"]
                stray.append(subprocess.Popen([*drop, "sleep", "60"]))
                running_as(FIRST)
                other.give_back(theirs, emptied=True)
        return found

    monkeypatch.setattr(uids, "uids_in_use", scan_then_another_jail_runs)
    try:
        held = mine.take()
        assert scans, "the take did not scan"
        assert held is None or uids.processes_of(held.uid) == [], "a uid a process runs as was handed out"
    finally:
        for p in stray:
            p.kill()
            p.wait()


def test_a_squatted_lock_directory_stops_startup(root: Path) -> None:
    base = root / "appliance"
    base.mkdir(mode=0o755, exist_ok=True)
    (base / "uids").mkdir(mode=0o777)
    os.chmod(base / "uids", 0o777)
    with pytest.raises(Exception, match="writable by others"):
        pool(root)


def test_locks_in_two_places_let_two_jails_take_one_uid() -> None:
    """Why the server's locks are the host's, not its temp root's: with a lock directory each,
    two servers both take the one free uid (and the first to give it back kills the other's
    jail as leftovers), where one directory hands the second server nothing."""
    with reachable_tmp_root("appliance-uids-a-") as a, reachable_tmp_root("appliance-uids-b-") as b:
        first, second = pool(a, 1).take(), pool(b, 1).take()
        assert first is not None and second is not None and first.uid == second.uid
        assert pool(a, 1).take() is None  # the same place: the uid is held


async def test_a_servers_uid_locks_are_the_hosts_whatever_its_temp_root(tmp_path: Path) -> None:
    from tests.attacks.common import run
    from tests.support import start_server

    with reachable_tmp_root("appliance-uids-srv-") as tmp_root:
        server = start_server(tmp_path / "srv", SANDBOX_POOL_SIZE="0", SANDBOX_TMP_ROOT=str(tmp_root))
        try:
            ex = await run(server, "import os, time\nprint(os.getuid(), flush=True)", token=None)
            uid = int(ex.stdout)
        finally:
            server.stop()
        assert uid in SANDBOX_UIDS and uid != SANDBOX_UID
        assert (uids.HOST_LOCK_ROOT / "appliance" / uids.LOCKS / str(uid)).is_file()
        assert not (tmp_root / "appliance" / uids.LOCKS).exists()


async def test_a_server_gives_the_uids_it_kept_back_to_the_host_once_idle(tmp_path: Path) -> None:
    """After a burst of runs, the uids a server kept ready or returned go back to the host
    about KEEP_S later, with no jail started meanwhile (its lifecycle's tidier)."""
    from tests.attacks.common import run
    from tests.support import start_server

    first, last = FIRST + 100, FIRST + 115  # a range of this test's alone
    lock_dir = uids.HOST_LOCK_ROOT / "appliance" / uids.LOCKS

    def held_by_the_server() -> list[int]:
        held = []
        for uid in range(first, last + 1):
            try:
                fd = os.open(lock_dir / str(uid), os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                held.append(uid)
            finally:
                os.close(fd)  # and this test's lock with it
        return held

    server = start_server(tmp_path / "srv", SANDBOX_POOL_SIZE="0", SANDBOX_UID_RANGE=f"{first}-{last}")
    try:
        runs = await asyncio.gather(*(run(server, "print(1)", token=None) for _ in range(4)))
        ended = time.monotonic()
        assert [ex.stdout.strip() for ex in runs] == ["1"] * 4
        kept = held_by_the_server()
        # Kept for KEEP_S after their give-back; a machine that stalled this test longer than
        # half of it may have seen them go already.
        assert kept or time.monotonic() - ended > uids.KEEP_S / 2, "the burst kept no uid"
        await until_async(lambda: not held_by_the_server(), 15, "the kept uids given back")
    finally:
        server.stop()


def test_staging_a_uids_accounts_again_leaves_the_files_a_launching_jail_binds(root: Path) -> None:
    """Every server stages the accounts of the uids it uses; a jail that is being launched binds
    them, and firejail's own mount over a file replaced meanwhile fails (ENOENT): the same files
    are left in place, and only a different content or owner is written anew."""
    first, second = RunDirs(root, FIRST, FIRST), RunDirs(root, FIRST, FIRST)
    with open_base(root, os.geteuid()) as base_fd:
        passwd, group = first.stage_accounts(base_fd, FIRST, FIRST)
        before = (passwd.stat().st_ino, group.stat().st_ino)
        assert second.stage_accounts(base_fd, FIRST, FIRST) == (passwd, group)
        assert (passwd.stat().st_ino, group.stat().st_ino) == before
        passwd.write_text("root:x:0:0:root:/root:/bin/sh\n")  # not what the server writes
        second.stage_accounts(base_fd, FIRST, FIRST)
    assert passwd.stat().st_ino != before[0] and group.stat().st_ino == before[1]
    assert f":{FIRST}:{FIRST}::/workspace:" in passwd.read_text()


async def test_a_jail_with_its_own_cgroup_costs_one_scan_of_proc_and_leaves_nothing_of_its_uid(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real jail with a cgroup and a uid of its own: its uid's take scans /proc, its give-back
    does not (the removal of its group killed what it left, a daemon here), and nothing of the
    uid outlives the jail."""
    if os.geteuid() != 0:
        pytest.skip("a uid of its own for a jail is a root server's")
    from appliance.sandbox import cgroups, channel
    from tests.support import jail_factory

    scans = counted_calls(monkeypatch, "_pids")
    tree, missing = cgroups.open_hierarchy("require")
    assert tree is not None, missing
    try:
        with jail_factory() as factory:
            factory.cgroups = tree
            factory.uids = pool(root, 1)
            jail = await factory.launch()
            try:
                assert jail.uid == FIRST and len(scans) == 1
                daemon = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(300)\n    os._exit(0)"
                jail.process.write(channel.run_op(daemon, [], True))
                done = await jail.process.wait_event("done", 60)
                assert done.get("status") in (None, "ok"), done
                assert len(uids.processes_of(FIRST)) >= 2  # the interpreter and its daemon, at least
                scans.clear()
            finally:
                await jail.destroy()
            assert scans == [], "the give-back scanned /proc"
            assert uids.processes_of(FIRST) == [], "a process of the jail's uid outlived it"
            assert jail.held is not None and jail.held.fd is None  # given back
    finally:
        tree.close()


def test_under_load_one_scan_readies_uids_for_several_takes(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Takes close together share scans: a scan hands out one uid and keeps up to STOCK more
    ready (returned ones it saw free, fresh ones locked before it), which later takes get
    without scanning. One scan a take was most of a take's CPU at many jails a second."""
    scans = counted_calls(monkeypatch, "uids_in_use")
    u = pool(root, 2 * (uids.STOCK + 1))
    taken: set[int] = set()
    for _ in range(20):
        held = u.take()
        assert held is not None
        taken.add(held.uid)
        u.give_back(held, emptied=True)
    assert len(scans) <= 20 // (uids.STOCK + 1) + 2, scans
    assert len(taken) <= uids.STOCK + 2, "a fresh uid locked where a ready one was there"
    u.close()


@pytest.mark.host  # setpriv to another uid needs root (tests/tiers.py)
def test_a_returned_uid_a_process_still_runs_as_is_passed_over_by_the_scan_that_readies_others(
    root: Path,
) -> None:
    """A uid given back with its group removed is kept locked, then judged by the next scan
    like any other: with a process of it still there it is never handed out nor kept ready."""
    u = pool(root, 3)
    first = u.take()
    assert first is not None
    stray = subprocess.Popen(
        ["setpriv", f"--reuid={first.uid}", f"--regid={first.uid}", "--clear-groups", "sleep", "60"]
    )
    try:
        assert running_as(first.uid) == [stray.pid]
        u.give_back(first, emptied=True)  # under load: the next take readies a stock
        got = [u.take() for _ in range(3)]
        assert all(h is None or h.uid != first.uid for h in got), got
        assert [h for h in got if h is not None] and got[-1] is None, got
    finally:
        stray.kill()
        stray.wait()
    u.close()


def test_uids_kept_ready_go_back_to_the_host_unused(root: Path) -> None:
    """A stock is the server's while it is busy: another server finds it locked until `tidy`
    (or the server's end) gives it back."""
    u, other = pool(root, 2), pool(root, 2)
    first = u.take()
    assert first is not None
    u.give_back(first, emptied=True)
    again = u.take()  # under load: it readies the other uid too
    assert again is not None
    assert other.take() is None, "another server took a uid kept ready"
    u.tidy()  # not yet: kept for KEEP_S
    assert other.take() is None
    u.tidy(0.0)
    stolen = other.take()
    assert stolen is not None and stolen.uid != again.uid
    u.give_back(again, emptied=True)  # returned: still locked, for u's next scan
    assert other.take() is None, "another server took a uid given back and kept"
    u.close()
    last = other.take()
    assert last is not None and last.uid == again.uid
    for held in (stolen, last):
        other.give_back(held)


def test_a_take_that_fails_gives_back_what_it_held(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A scan that fails (here /proc unreadable) leaves no uid locked by this server for good:
    the returned one it was judging goes back to the host with the error."""
    u = pool(root, 1)
    held = u.take()
    assert held is not None
    u.give_back(held, emptied=True)

    def unreadable() -> set[int]:
        raise OSError("no /proc")

    monkeypatch.setattr(uids, "uids_in_use", unreadable)
    with pytest.raises(OSError, match="no /proc"):
        u.take()
    monkeypatch.undo()
    other = pool(root, 1).take()
    assert other is not None and other.uid == held.uid, "the failed take kept the uid locked"
