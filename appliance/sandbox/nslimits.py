"""Per-jail caps on the kernel counts that a jail's user namespace charges to its owner.

Some kernel counts are kept per user namespace and charged up the chain of namespaces, at
each level to the uid that owns the namespace below: inotify instances and watches, fanotify
groups and marks. firejail is setuid and makes each jail's user namespace as root, so every
jail on the host charges root's count in the host's namespace, whatever uid it runs as (a
uid per jail, `uids`, does not separate these): one run that takes all 128 inotify instances
(fs.inotify.max_user_instances) would leave none to any other jail, nor to root's own
programs on the host.

So each jail is capped in its own namespace (`/proc/sys/user/max_*` there, written from
inside it by a short-lived helper before any code runs, `cap_jail`), and the host's limits
are raised at startup to hold every jail of SANDBOX_UID_RANGE at its cap besides the host's
own share (`raise_host`). `plan_host` is pure; the rest is thin I/O.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import platform
import shutil
import sys
from pathlib import Path

from appliance.core.tasks import within
from appliance.sandbox import signals

log = logging.getLogger("appliance.nslimits")

# What one jail may hold, and what the host keeps for itself besides all jails at their cap
# (the kernel's defaults for the instance and group counts).
JAIL_CAPS = {
    "max_inotify_instances": 16,
    "max_inotify_watches": 8192,
    "max_fanotify_groups": 4,
    "max_fanotify_marks": 8192,
}
HOST_SHARE = {
    "max_inotify_instances": 128,
    "max_inotify_watches": 65536,
    "max_fanotify_groups": 128,
    "max_fanotify_marks": 65536,
}
# The same limits of the host's namespace as the jail's /proc/sys/user/max_* are there. These
# are written with root's uid alone; /proc/sys/user/* would also need CAP_SYS_RESOURCE.
HOST_SYSCTL = {
    "max_inotify_instances": Path("/proc/sys/fs/inotify/max_user_instances"),
    "max_inotify_watches": Path("/proc/sys/fs/inotify/max_user_watches"),
    "max_fanotify_groups": Path("/proc/sys/fs/fanotify/max_user_groups"),
    "max_fanotify_marks": Path("/proc/sys/fs/fanotify/max_user_marks"),
}
WRITE_TIMEOUT_S = 10.0

# The helper runs as root with the jail's user-namespace descriptor: it joins that namespace
# (which gives it every capability there, so the namespace's own limits become writable), then
# writes them. One process, no exec after setns: an exec there would drop those capabilities.
#
# Perl is the helper where it is installed (Debian's perl-base is essential): it starts in about
# a sixth of a Python's CPU, and this runs once per jail. It has no setns of its own, so it
# makes the system call by number; and it checks that it is in the jail's namespace before it
# writes anything (a wrong number must never write the server's own limits).
SETNS_SYSCALL = {"x86_64": 308, "aarch64": 268}
_PERL_WRITER = r"""
my ($nr, $fd, @caps) = @ARGV;
open(my $ns, "<&=", $fd) or die "the namespace descriptor: $!\n";
syscall($nr + 0, $fd + 0, 0x10000000) == 0 or die "setns: $!\n";  # CLONE_NEWUSER
(stat $ns)[1] == (stat "/proc/self/ns/user")[1] or die "setns: not in the jail's user namespace\n";
for (@caps) {
    my ($name, $value) = split /=/;
    open(my $fh, ">", "/proc/sys/user/$name") or die "$name: $!\n";
    print $fh $value;
    close($fh) or die "$name: $!\n";
}
"""
# Elsewhere the server's own Python, through ctypes.
_PYTHON_WRITER = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
if libc.setns(int(sys.argv[1]), 0x10000000) != 0:  # CLONE_NEWUSER
    err = ctypes.get_errno()
    raise SystemExit("setns: " + os.strerror(err))
for item in sys.argv[2:]:
    name, value = item.split("=")
    with open("/proc/sys/user/" + name, "w") as fh:
        fh.write(value)
"""


def plan_host(found: dict[str, int], jails: int) -> dict[str, int]:
    """The host limits to raise (name -> new value): those below every jail at its cap plus
    the host's share."""
    wanted = {name: cap * jails + HOST_SHARE[name] for name, cap in JAIL_CAPS.items()}
    return {name: value for name, value in wanted.items() if name in found and found[name] < value}


def raise_host(jails: int, sysctl: dict[str, Path] = HOST_SYSCTL) -> list[str]:
    """Raise the host's limits for `jails` jails at their cap (`plan_host`); what could not be
    raised (read-only /proc/sys, as in most containers), as warnings to log."""
    found: dict[str, int] = {}
    problems: list[str] = []
    for name in JAIL_CAPS:
        try:
            found[name] = int(sysctl[name].read_text())
        except (OSError, ValueError) as exc:
            problems.append(f"{sysctl[name]}: {exc}")
    for name, value in plan_host(found, jails).items():
        try:
            sysctl[name].write_text(str(value))
        except OSError as exc:
            problems.append(
                f"{sysctl[name]} is {found[name]}, below {value} ({jails} jails at {JAIL_CAPS[name]} "
                f"each and the host's share): {exc.strerror}; jails may exhaust it together"
            )
        else:
            log.info(
                "raised a host limit for the jails", extra={"sysctl": name, "from": found[name], "to": value}
            )
    return problems


async def cap_jail(pid: int) -> str | None:
    """Cap the jail whose sandbox init is `pid` in its own user namespace (JAIL_CAPS); why
    not, or None. A jail that shares the server's namespace is refused, never written."""
    try:
        fd = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:  # no ptrace access to the jail (a container's root lacks CAP_SYS_PTRACE)
        return f"its user namespace cannot be opened: {exc.strerror}"
    try:
        if os.fstat(fd).st_ino == os.stat("/proc/self/ns/user").st_ino:
            return "it has no user namespace of its own"
        proc = await asyncio.create_subprocess_exec(
            *writer_argv(fd),
            pass_fds=(fd,),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            env={"PATH": "/usr/bin:/bin"},
        )
        try:
            _, err = await within(proc.communicate(), WRITE_TIMEOUT_S)
        except BaseException:
            if proc.returncode is None:
                signals.kill_child(proc)
                await proc.wait()
            raise
        if proc.returncode != 0:
            lines = err.decode(errors="replace").strip().splitlines()
            return lines[-1] if lines else f"the helper exited {proc.returncode}"
        return None
    finally:
        os.close(fd)


def writer_argv(fd: int, perl: str | None = None) -> list[str]:
    """The helper that caps the namespace open as `fd` at JAIL_CAPS: perl where it is
    installed and setns's number is known for this machine, else the server's Python."""
    perl = perl if perl is not None else _perl()
    caps = [f"{name}={value}" for name, value in JAIL_CAPS.items()]
    nr = SETNS_SYSCALL.get(platform.machine())
    if perl and nr is not None:
        return [perl, "-e", _PERL_WRITER, "--", str(nr), str(fd), *caps]
    return [sys.executable, "-I", "-S", "-c", _PYTHON_WRITER, str(fd), *caps]


@functools.cache
def _perl() -> str:
    """perl's path, or "" where there is none."""
    return shutil.which("perl", path="/usr/bin:/bin") or ""
