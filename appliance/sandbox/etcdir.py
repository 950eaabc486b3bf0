"""The jails' /etc, prepared once per server start instead of once per jail.

firejail's `--private-etc` copies the listed entries of the host's /etc for every jail it
starts, one `fcopy` process per entry, resolving every link of /etc/ssl and
/etc/alternatives on the way: about 40 % of a bare jail's CPU. Where the server is root it
starts each jail in a mount namespace of its own anyway (`firejail.accounts_argv`); there it
binds this directory, read-only, over /etc before firejail runs, and firejail is told not to
copy.

What it holds is what `--private-etc` gives, made the way `fcopy --follow-link` makes it:
an entry that is a link is copied as what it points to; below it, directories and regular
files are copied with their owner and mode, and each link becomes a link to its fully
resolved target (a dangling one is left out). /etc/passwd and /etc/group are empty files:
the jail's own accounts are bound over them, as before.

firejail itself reads its configuration and /etc/login.defs before it sandboxes (it refuses
to start without the former), so those are copied too, and the jail never sees them: they
are blacklisted (`HIDDEN`), and the configuration copy turns on firejail's
`etc-hide-blacklisted`, which rebuilds the jail's /etc without blacklisted entries.

The directory is made here, by descriptor, in the server's checked instance directory
(`workdir.RunDirs`); one found in its place was made by someone else: startup stops.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterable
from pathlib import Path

from appliance.core.errors import StartupError
from appliance.sandbox import fstree, trust

NAME = "etc"
HOST_ETC = Path("/etc")
ACCOUNTS = frozenset({"passwd", "group"})  # bound over per jail: empty here
FIREJAIL_CONFIG = "firejail/firejail.config"
# What firejail reads under /etc before it sandboxes: copied for it, hidden from the jail.
FIREJAIL_READS = (FIREJAIL_CONFIG, "firejail/firejail.users", "login.defs")
HIDDEN = (Path("/etc/firejail"), Path("/etc/login.defs"))
HIDE_BLACKLISTED = (
    "\n# the appliance: blacklisted entries of the jail's /etc are left out of it\netc-hide-blacklisted yes\n"
)
_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def prepare(instance_fd: int, instance: Path, names: Iterable[str], source: Path = HOST_ETC) -> Path:
    """Make `<instance>/etc` from `source` (the host's /etc) and return its path; StartupError
    when something already holds the name, or the copy fails."""
    path = instance / NAME
    try:
        os.mkdir(NAME, 0o700, dir_fd=instance_fd)
    except FileExistsError as exc:
        raise trust.refusal(path, "exists before the server made it (someone else's, or a link)") from exc
    try:
        fd = os.open(NAME, fstree.DIR_FLAGS, dir_fd=instance_fd)
        with trust.held(fd):
            problem = trust.policy(os.fstat(fd), os.geteuid(), ancestor=False)
            if problem is not None:
                raise trust.refusal(path, problem)
            for name in names:
                if name in ACCOUNTS:
                    _write(fd, name, b"", 0o644)
                else:
                    _copy_entry(source / name, fd, name)
            _firejail_reads(source, fd)
            os.fchmod(fd, 0o755)
    except OSError as exc:
        raise StartupError(f"cannot prepare the jails' /etc in {path}: {exc}") from exc
    return path


def _firejail_reads(source: Path, dir_fd: int) -> None:
    """firejail's configuration (with etc-hide-blacklisted added) and login.defs, those present."""
    os.mkdir("firejail", 0o755, dir_fd=dir_fd)
    for rel in FIREJAIL_READS:
        try:
            data = (source / rel).read_bytes()
        except FileNotFoundError:
            if rel == FIREJAIL_CONFIG:  # firejail would not start without it either
                raise
            continue
        if rel == FIREJAIL_CONFIG:
            data += HIDE_BLACKLISTED.encode()
        _write(dir_fd, rel, data, 0o644)


def _copy_entry(src: Path, dir_fd: int, name: str) -> None:
    """One entry of the list, its top-level link followed (`fcopy --follow-link`); absent ones
    are skipped, as firejail skips them."""
    try:
        st = os.stat(src)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        os.mkdir(name, 0o700, dir_fd=dir_fd)
        sub = os.open(name, fstree.DIR_FLAGS, dir_fd=dir_fd)
        with trust.held(sub):
            _copy_tree(Path(os.path.realpath(src)), sub)
            os.fchmod(sub, stat.S_IMODE(st.st_mode))
    elif stat.S_ISREG(st.st_mode):
        _copy_file(src, dir_fd, name, st)
    else:
        raise OSError(f"{src} is not a regular file or directory")


def _copy_tree(src: Path, dir_fd: int) -> None:
    """The contents of directory src into dir_fd: directories and regular files with their
    owner and mode, links as links to their resolved targets; nothing else."""
    with os.scandir(src) as entries:
        for entry in sorted(entries, key=lambda e: e.name):
            path = Path(entry.path)
            if entry.is_symlink():
                with contextlib.suppress(OSError):  # dangling: fcopy leaves it out too
                    os.symlink(os.path.realpath(path, strict=True), entry.name, dir_fd=dir_fd)
                continue
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                os.mkdir(entry.name, 0o700, dir_fd=dir_fd)
                sub = os.open(entry.name, fstree.DIR_FLAGS, dir_fd=dir_fd)
                with trust.held(sub):
                    _copy_tree(path, sub)
                    os.fchown(sub, st.st_uid, st.st_gid)
                    os.fchmod(sub, stat.S_IMODE(st.st_mode))
            elif stat.S_ISREG(st.st_mode):
                _copy_file(path, dir_fd, entry.name, st)


def _copy_file(src: Path, dir_fd: int, name: str, st: os.stat_result) -> None:
    _write(dir_fd, name, src.read_bytes(), stat.S_IMODE(st.st_mode), (st.st_uid, st.st_gid))


def _write(dir_fd: int, rel: str, data: bytes, mode: int, owner: tuple[int, int] | None = None) -> None:
    fd = os.open(rel, _FILE_FLAGS, 0o600, dir_fd=dir_fd)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
        if owner is not None:
            os.fchown(fd, *owner)
        os.fchmod(fd, mode)
