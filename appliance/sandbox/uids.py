"""A uid per jail, so that concurrent jails share no per-uid kernel limit.

The kernel counts some limits per uid across the whole host, whatever namespace a process is
in: inotify instances and watches (fs.inotify.max_user_*), descriptors in flight over unix
sockets (RLIMIT_NOFILE of the sender's user), processes (RLIMIT_NPROC), POSIX message queue
bytes (RLIMIT_MSGQUEUE). Were every jail one uid, one run could take them all and another
tenant's run, on this server or another, would get EMFILE or EAGAIN.

So each CPU jail runs as a uid of its own from SANDBOX_UID_RANGE, held exclusively for its
whole life against every server on the host: a lock file per uid in `/run/appliance/uids/`
(HOST_LOCK_ROOT; 0700, made and checked by `trust` like the rest of that tree), taken with
flock. The place is the host's, not SANDBOX_TMP_ROOT's: servers with temp roots of their own
still share the host's uids, and two locks in two places would let two jails take one uid,
then the first to end kill the other's processes as its leftovers (`give_back`). The kernel drops a lock with the last descriptor of it, so a server
killed with -9 frees its uids while its jails live on (firejail is setuid: no parent-death
signal reaches it); hence a uid is taken only when no process of it runs (a scan of /proc at
every take, once the uid is locked: it is what keeps that promise, whoever held the uid before
and however it ended), and given back only once every live process of its jail is gone. Where
the jail had a cgroup of its own and its removal succeeded, that is already so: every process of the jail descends from
the launcher that joined the group as root before dropping to the uid, a process cannot leave a
group that only root may write, and the removal kills what is left and succeeds only once none
is (`cgroups.remove_paths`); so the give-back scans nothing (`give_back(emptied=True)`). What
may still be of the uid then are zombies (they leave the group as they exit, and count against
RLIMIT_NPROC until reaped): the next take's scan sees them and passes the uid over. Without such
a group (none, or its removal failed), the give-back scans, kills what is left and waits.

A uid given back that way stays locked by this server for a while (`KEEP_S`): it is "returned",
and the next scan says whether it is free. Under load (takes closer together than
`BUSY_GAP_S`) one scan makes up to `STOCK` uids ready beyond the one it hands out: the returned
ones it finds free, and fresh ones locked before it. A ready uid has been locked without a break
since a scan saw no process of it, so it is handed out without another scan: what the scan at
its take would promise holds already (only a holder of the lock starts processes of the uid).
A scan costs a read of every process's status, so at many jails a second this is most of a
take's CPU. Uids ready or returned and unused for `KEEP_S` go back to the host (`tidy`, which
the server calls now and then), so an idle server holds none beyond its jails.

SANDBOX_UID is never taken exclusively: it stays the one uid that jails share where a uid each
cannot be had: a range of that uid alone (all jails share it, as before ranges), GPU jails (an
MPS daemon serves one uid at a time), and a server that is not root (it cannot switch uids).

The uids of the range need no account on the host (the server gives each jail a passwd and
group naming its uid, `RunDirs.accounts_for`); one that has an account, or a group of its
number, is left out, so that a jail never acts as a user of the host.
"""

from __future__ import annotations

import contextlib
import fcntl
import grp
import logging
import os
import pwd
import random
import stat
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from appliance.sandbox import signals, trust
from appliance.sandbox.workdir import open_base

log = logging.getLogger("appliance.uids")

LOCKS = "uids"  # under <HOST_LOCK_ROOT>/appliance
HOST_LOCK_ROOT = Path("/run")  # one place for every server of the host, whatever its SANDBOX_TMP_ROOT
# The kernel makes a status file whole at its first read; its Uid: line is in the first
# few hundred bytes, after a name of at most 64 (escaped: 256).
STATUS_BYTES = 4096
GIVE_BACK_WAIT_S = 5.0  # the longest a uid's last processes may take to die before it is set aside
STOCK = 4  # uids one scan makes ready beyond the one it hands out, under load
BUSY_GAP_S = 0.5  # takes closer than this to the last scan are load: the next scan readies a stock
KEEP_S = 2.0  # a uid ready or returned and unused this long goes back to the host (`Uids.tidy`)


@dataclass
class Held:
    """A jail's uid and gid, and the locked file that holds the uid (None: the shared uid, or
    given back: `Uids.give_back` is done once, whoever calls it again)."""

    uid: int
    gid: int
    fd: int | None = None


def usable(first: int, last: int, shared: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(uids jails may hold exclusively, uids left out because the host has an account or a
    group of that number) of the range first..last; the shared uid is in neither."""
    taken = {p.pw_uid for p in pwd.getpwall()} | {g.gr_gid for g in grp.getgrall()}
    ok: list[int] = []
    skipped: list[int] = []
    for uid in range(first, last + 1):
        if uid == shared:
            continue
        (skipped if uid in taken else ok).append(uid)
    return tuple(ok), tuple(skipped)


def uids_in_use() -> set[int]:
    """Every uid (real, effective, saved or filesystem) a process of this PID namespace has,
    zombies included (they still count against RLIMIT_NPROC)."""
    found: set[int] = set()
    for pid in _pids():
        uids = _uids_of(pid)
        if uids is not None:
            found.update(uids)
    return found


def processes_of(uid: int) -> list[int]:
    """Every process of this PID namespace that has uid as any of its uids."""
    return [pid for pid in _pids() if uid in (_uids_of(pid) or ())]


def _pids() -> list[int]:
    return [int(e) for e in os.listdir("/proc") if e.isdigit()]


def _uids_of(pid: int) -> tuple[int, ...] | None:
    # A raw descriptor and one read: every process's status is read twice a jail (its uid's
    # take and give-back), and a buffered file object cost a third of each scan.
    try:
        fd = os.open(f"/proc/{pid}/status", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None  # gone meanwhile
    try:
        text = os.read(fd, STATUS_BYTES)
    except OSError:
        return None  # gone meanwhile (ESRCH)
    finally:
        os.close(fd)
    start = text.find(b"\nUid:")
    if start < 0:
        return None
    line = text[start + 5 : text.find(b"\n", start + 1)]
    try:
        return tuple(int(part) for part in line.split())
    except ValueError:
        return None


@dataclass
class Uids:
    """The uids one server's jails run as (see the module's docstring)."""

    tmp_root: Path
    shared_uid: int
    shared_gid: int
    candidates: tuple[int, ...]  # those held exclusively; empty: every jail shares shared_uid
    _cursor: int = field(default_factory=lambda: random.randrange(1 << 30))  # noqa: S311 (spread, not secrecy)
    _aside: list[Held] = field(default_factory=list)  # given back with processes left: still held
    _aside_lock: threading.Lock = field(default_factory=threading.Lock)  # take/give_back run in threads
    # Still locked, with the time they were put there: given back with their group removed
    # (free unless a zombie is left: the next scan says), and seen free by a scan since.
    _returned: list[tuple[Held, float]] = field(default_factory=list)
    _ready: list[tuple[Held, float]] = field(default_factory=list)
    _stock_lock: threading.Lock = field(default_factory=threading.Lock)
    _last_scan: float = float("-inf")

    @property
    def exclusive(self) -> bool:
        return bool(self.candidates)

    def shared(self) -> Held:
        return Held(self.shared_uid, self.shared_gid)

    def all(self) -> set[int]:
        """Every uid a jail of this server may run as."""
        return {self.shared_uid, *self.candidates}

    def prepare(self) -> None:
        """Make (or check) the lock directory now, so that a squatted one stops startup."""
        if self.exclusive:
            with self._lock_dir():
                pass

    def take(self) -> Held | None:
        """Lock a uid of the range that no process runs as; None when every one is held or
        busy. Blocking I/O (a scan of /proc, a few opens): call it in a thread."""
        self._retry_aside()
        self.tidy()
        with self._stock_lock:
            if self._ready:
                return self._ready.pop()[0]
            returned = [held for held, _ in self._returned]
            self._returned = []
            want = 1 + STOCK if time.monotonic() - self._last_scan < BUSY_GAP_S else 1
        return self._scan_for(returned, want)

    def _scan_for(self, locked: list[Held], want: int) -> Held | None:
        """Lock fresh uids until `want` are locked with those given (returned), scan once, hand
        out one found free and keep the rest ready; again with fresh ones while none is free.
        Whatever it holds when it fails (no lock directory, /proc unreadable) goes back."""
        try:
            return self._scan(locked, want)
        except BaseException:
            for held in locked:
                if held.fd is not None:
                    os.close(held.fd)
            raise

    def _scan(self, locked: list[Held], want: int) -> Held | None:
        busy: set[int] = set()  # from the last scan: busy then (a hint, never a proof of free)
        n = len(self.candidates)
        start, self._cursor = self._cursor, self._cursor + 1
        tried = 0
        with self._lock_dir() as dir_fd:
            while True:
                while len(locked) < want and tried < n:
                    uid = self.candidates[(start + tried) % n]
                    tried += 1
                    if uid in busy:
                        continue
                    fd = _lock(dir_fd, uid, os.geteuid())  # fails on a uid this server holds too
                    if fd is not None:
                        locked.append(Held(uid, uid, fd))
                if not locked:
                    return None
                # The scan comes after the lock: from the lock on, no holder can start a
                # process of uid, so what the scan does not see is not there. (Before the lock,
                # a holder could take uid, run a jail and give it back, zombies left, unseen.)
                self._last_scan = time.monotonic()
                busy = uids_in_use()
                free: list[Held] = []
                while locked:  # emptied as it goes: what a failure leaves in it is still held
                    held = locked.pop(0)
                    if held.uid in busy and held.fd is not None:
                        os.close(held.fd)
                    else:
                        free.append(held)
                if free:
                    now = time.monotonic()
                    with self._stock_lock:
                        self._ready.extend((held, now) for held in free[1:])
                    return free[0]

    def give_back(self, held: Held, emptied: bool = False) -> None:
        """Free a jail's uid once no live process of it is left. emptied: the caller has just
        removed the jail's own cgroup, which held every process the jail had: none is left,
        and nothing is scanned (see the module's docstring). Otherwise any still there (the
        jail is destroyed: they are its own, since the uid was held) are killed and waited for;
        a uid whose processes will not die is kept locked, set aside, and tried again later."""
        fd, held.fd = held.fd, None
        if fd is None:
            return
        if emptied:  # kept locked for the next scan to say it is free (the module's docstring)
            with self._stock_lock:
                self._returned.append((Held(held.uid, held.gid, fd), time.monotonic()))
            return
        if not _gone(held.uid, GIVE_BACK_WAIT_S):
            log.error("a jail's uid still has processes: kept until they are gone", extra={"uid": held.uid})
            with self._aside_lock:
                self._aside.append(Held(held.uid, held.gid, fd))
            return
        os.close(fd)  # unlocks

    def tidy(self, keep_s: float | None = None) -> None:
        """Give back to the host the uids ready or returned and unused for keep_s (KEEP_S)."""
        keep = KEEP_S if keep_s is None else keep_s
        now = time.monotonic()
        with self._stock_lock:
            old = [held for held, since in self._ready + self._returned if now - since >= keep]
            self._ready = [(held, since) for held, since in self._ready if now - since < keep]
            self._returned = [(held, since) for held, since in self._returned if now - since < keep]
        for held in old:
            if held.fd is not None:
                os.close(held.fd)

    def close(self) -> None:
        """The server ends: uids set aside stay locked only as long as this process lives;
        those ready or returned go back now."""
        self.tidy(0.0)
        with self._aside_lock:
            aside, self._aside = self._aside, []
        for held in aside:
            if held.fd is not None:
                os.close(held.fd)

    def _retry_aside(self) -> None:
        with self._aside_lock:
            aside, self._aside = self._aside, []
        for held in aside:
            if processes_of(held.uid):
                with self._aside_lock:
                    self._aside.append(held)
            elif held.fd is not None:
                os.close(held.fd)

    @contextlib.contextmanager
    def _lock_dir(self) -> Iterator[int]:
        server_uid = os.geteuid()
        with open_base(self.tmp_root, server_uid) as base_fd:
            fd = trust.ensure_dir(base_fd, self.tmp_root / "appliance", LOCKS, 0o700, server_uid)
        with trust.held(fd):
            yield fd


def _lock(dir_fd: int, uid: int, server_uid: int) -> int | None:
    """The uid's lock file, opened and flocked; None when another holds it (or the file is not
    the server's own: the directory is 0700 root, so only root could have made it otherwise)."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK
    try:
        fd = os.open(str(uid), flags, 0o600, dir_fd=dir_fd)
    except OSError as exc:
        log.error("cannot open a uid's lock file", extra={"uid": uid, "error": str(exc)})
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != server_uid:
            log.error("a uid's lock file is not the server's own: uid left out", extra={"uid": uid})
            os.close(fd)
            return None
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _gone(uid: int, wait_s: float) -> bool:
    """Kill every process of uid and wait up to wait_s for them to be gone; whether they are."""
    deadline = time.monotonic() + wait_s
    pause = 0.001
    while True:
        left = processes_of(uid)
        if not left:
            return True
        if time.monotonic() > deadline:
            return False
        for pid in left:
            with contextlib.suppress(OSError, ValueError):
                signals.kill(pid)
        time.sleep(pause)  # a killed process's teardown is the kernel's: nothing to wait on
        pause = min(pause * 2, 0.05)
