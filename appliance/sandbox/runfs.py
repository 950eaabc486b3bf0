"""A run's writable space as filesystems the kernel sizes: its directory and its /tmp.

The disk quota (`SANDBOX_MAX_DISK_MB`) was a poller's: the server measured what a run kept
and stopped it when over. A file unlinked while open, its descriptor sent over a socketpair
(SCM_RIGHTS) and closed, is held by no process and named nowhere: no walk and no search of
descriptor tables sees it, and a session could keep a hundred GiB of host disk so. Here
the kernel holds the line instead, whatever holds an inode:

  * the run directory (/workspace) is a tmpfs of its own, mounted by the server on the
    directory before the jail starts (`mount_run`): size and inode count fixed, owned by the
    sandbox uid, mode 0700, nosuid, nodev;
  * the jail's private /tmp (firejail's tmpfs, in the jail's mount namespace) is given the
    same size and inode count once the jail is ready and before any code runs (`resize`,
    fspick(2) + fsconfig(2) on a descriptor of it: no process enters that namespace).

A write past either gets ENOSPC. The sizes are the quota plus a little (`Sizes`), so the
server's own check, the second line, still sees a run over the quota and ends it
`output_limit`; the kernel only stops it growing further. tmpfs pages are memory: each is
charged to the memory cgroup of the process that wrote it, so what a run writes counts
against its `SANDBOX_MEMORY_MB` as well.

`unmount` detaches a run's tmpfs when its jail ends (lazily: the jail's own mount
namespaces may hold copies until its last process is gone); `unmount_under` does it for
every mount below a directory, for the leftovers of a server killed with -9.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from appliance.sandbox import syscalls

MIB = 1024 * 1024
SLACK_BYTES = MIB  # past the quota, so the server's check still sees a run over it
SLACK_INODES = 64
MS_NOSUID = 0x2
MS_NODEV = 0x4
MNT_DETACH = 0x2
UMOUNT_NOFOLLOW = 0x8
FSPICK_CLOEXEC = 0x1
FSPICK_EMPTY_PATH = 0x8
FSCONFIG_SET_STRING = 1
FSCONFIG_CMD_RECONFIGURE = 7
SOURCE = b"appliance-run"  # the device name a run's tmpfs shows in mountinfo
_NUMBERS = {"x86_64": {"fsconfig": 431, "fspick": 433}, "aarch64": {"fsconfig": 431, "fspick": 433}}
_ESCAPE = re.compile(r"\\([0-7]{3})")


@dataclass(frozen=True)
class Sizes:
    """What one of a run's tmpfs may hold: bytes and inodes (files and directories)."""

    bytes: int
    inodes: int

    @classmethod
    def of(cls, max_disk_mb: int, max_entries: int) -> Sizes:
        """The quota and its entry cap, plus the slack the server's check needs to see a run
        go over them (a filesystem exactly the quota's size can never be over it)."""
        return cls(bytes=max_disk_mb * MIB + SLACK_BYTES, inodes=max_entries + SLACK_INODES)

    def options(self, uid: int | None = None, gid: int | None = None) -> str:
        """The tmpfs mount options: size and inodes; with uid, its root 0700 owned by uid:gid."""
        opts = f"size={self.bytes},nr_inodes={self.inodes}"
        if uid is not None:
            opts += f",mode=0700,uid={uid},gid={gid if gid is not None else uid}"
        return opts


def for_server(max_disk_mb: int, max_entries: int) -> Sizes | None:
    """The sizes of each run's tmpfs, or None where this server cannot mount them (it is not
    root: its jails are then started without any mounting prefix either)."""
    return Sizes.of(max_disk_mb, max_entries) if os.geteuid() == 0 else None


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def mount_run(path: Path, sizes: Sizes, uid: int, gid: int) -> None:
    """Mount a fresh tmpfs of `sizes` on the directory `path` (made by the server, in a
    directory only root may write), its root 0700 and owned by uid:gid. OSError on failure."""
    data = sizes.options(uid, gid).encode()
    ctypes.set_errno(0)
    if _libc().mount(SOURCE, os.fsencode(path), b"tmpfs", MS_NOSUID | MS_NODEV, data) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount tmpfs on {path}: {os.strerror(err)}")


def unmount(path: Path) -> bool:
    """Detach the mount on `path` (never following a link there); True if one was detached,
    False if none was mounted there. OSError otherwise."""
    ctypes.set_errno(0)
    if _libc().umount2(os.fsencode(path), MNT_DETACH | UMOUNT_NOFOLLOW) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOENT):  # not a mount point, or gone
        return False
    raise OSError(err, f"unmount {path}: {os.strerror(err)}")


def mounts_under(root: Path, mountinfo: str | None = None) -> list[Path]:
    """Mount points strictly below `root` in this mount namespace, deepest first (so each is
    detached before what it sits on)."""
    if mountinfo is None:
        with open("/proc/self/mountinfo") as fh:
            mountinfo = fh.read()
    base = os.path.realpath(root).rstrip("/") + "/"
    found: list[str] = []
    for line in mountinfo.splitlines():
        fields = line.split(" ")
        if len(fields) < 5:
            continue
        point = _ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), fields[4])
        if point.startswith(base):
            found.append(point)
    found.sort(key=lambda p: (p.count("/"), p), reverse=True)
    return [Path(p) for p in dict.fromkeys(found)]


def unmount_under(root: Path) -> list[Path]:
    """Detach every mount below `root` (a dead server's run directories); the ones detached.
    What cannot be detached is left: the tree's removal then stops at it, and says so."""
    done: list[Path] = []
    for point in mounts_under(root):
        try:
            if unmount(point):
                done.append(point)
        except OSError:
            continue
    return done


def resize(tmp_fd: int, sizes: Sizes) -> None:
    """Give the tmpfs whose root `tmp_fd` is open on (a jail's private /tmp, in the jail's
    mount namespace) these sizes, from the server's namespace: fspick(2) the superblock by
    the descriptor, set size and nr_inodes, reconfigure. OSError on failure."""
    numbers = _NUMBERS.get(os.uname().machine)
    if numbers is None:
        raise OSError(errno.ENOSYS, f"fspick/fsconfig numbers unknown on {os.uname().machine}")
    empty = ctypes.create_string_buffer(b"")
    fs = syscalls.syscall(
        numbers["fspick"], tmp_fd, ctypes.addressof(empty), FSPICK_CLOEXEC | FSPICK_EMPTY_PATH
    )
    if fs < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"fspick the jail's /tmp: {os.strerror(err)}")
    try:
        config: Callable[..., int] = functools.partial(syscalls.syscall, numbers["fsconfig"], fs)
        for key, value in (("size", sizes.bytes), ("nr_inodes", sizes.inodes)):
            k, v = ctypes.create_string_buffer(key.encode()), ctypes.create_string_buffer(str(value).encode())
            if config(FSCONFIG_SET_STRING, ctypes.addressof(k), ctypes.addressof(v), 0) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"fsconfig {key}={value} on the jail's /tmp: {os.strerror(err)}")
        if config(FSCONFIG_CMD_RECONFIGURE, 0, 0, 0) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"resize the jail's /tmp: {os.strerror(err)}")
    finally:
        os.close(fs)
