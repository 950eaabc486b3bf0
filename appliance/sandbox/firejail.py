"""Render a JailSpec to the firejail command line, one section per isolation concern (as
nsjail renders its config). Pure: no I/O, testable without spawning."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from appliance.sandbox import etcdir
from appliance.sandbox.spec import ETC_FILES, WORKSPACE, JailSpec

MIB = 1024 * 1024
# Denied on top of firejail's default seccomp list.
EXTRA_DENIED_SYSCALLS = ("io_uring_setup", "io_uring_enter", "io_uring_register")


def render_argv(spec: JailSpec, events_fd: int, firejail: str = "firejail") -> list[str]:
    """The argv that starts the in-jail driver under firejail: one section per isolation
    concern, each a pure function of the spec, in this fixed order.

    `events_fd` is the descriptor number the driver writes its events to (inherited as is).
    """
    return [
        firejail,
        "--quiet",
        "--noprofile",
        *privileges_argv(),
        *seccomp_argv(),
        *namespaces_argv(spec),
        *mounts_argv(spec),
        *devices_argv(spec),
        *readable_argv(spec),
        *resources_argv(spec),
        *lifecycle_argv(events_fd),
        *env_argv(spec),
        *command_argv(spec, events_fd),
    ]


def privileges_argv() -> list[str]:
    """A user namespace holding only the caller's uid, no capabilities, no setuid gains."""
    return ["--noroot", "--caps.drop=all", "--nonewprivs"]


def seccomp_argv() -> list[str]:
    """firejail's default seccomp blacklist plus io_uring (a large kernel surface no Python
    code needs), native architecture only."""
    return [f"--seccomp={','.join(EXTRA_DENIED_SYSCALLS)}", "--seccomp.block-secondary"]


def namespaces_argv(spec: JailSpec) -> list[str]:
    """No new namespaces from inside; an IPC namespace of its own (System V shared memory,
    semaphores and message queues are neither shared with other runs nor left on the host:
    they go with its last process). Network: a fresh namespace with only a loopback
    interface; or, in egress mode, the filtered namespace appliance.sandbox.network made
    (firejail is started inside it and must not make another), with the configured
    resolvers as the jail's resolv.conf."""
    argv = ["--restrict-namespaces", "--ipc-namespace"]
    if spec.netns is None:
        argv.append("--net=none")
    return argv + [f"--dns={server}" for server in spec.dns]


def mounts_argv(spec: JailSpec) -> list[str]:
    """The run directory as /workspace (= HOME, cwd); private /tmp, /dev, /etc; everything
    at the top level that is not needed blacklisted. The private /etc is firejail's copy of
    ETC_FILES, or the server's prepared one (`spec.etc`, already bound over /etc by the
    launcher: `bind_table`), less what firejail itself reads there."""
    etc = [f"--private-etc={','.join(ETC_FILES)}"] if spec.etc is None else etc_hidden_argv()
    return [
        f"--private={spec.workdir}",
        f"--private-cwd={WORKSPACE}",
        "--private-tmp",
        "--private-dev",
        *etc,
        *(f"--blacklist={path}" for path in spec.hidden),
    ]


def etc_hidden_argv() -> list[str]:
    """A prepared /etc holds firejail's own configuration and login.defs (firejail reads them
    before it sandboxes): blacklisted, and left out of the jail's /etc by the configuration's
    etc-hide-blacklisted."""
    return [f"--blacklist={path}" for path in etcdir.HIDDEN]


def devices_argv(spec: JailSpec) -> list[str]:
    """--private-dev brings every /dev/nvidia[0-9]*, nvidiactl, nvidia-uvm and dri node of
    the host along; CPU jails drop them all (--no3d). A GPU jail keeps them, blacklists every
    one it was not given, may read /sys/module/nvidia* (drivers >= 550 need it; firejail
    blacklists /sys/module whole), and reaches the MPS daemon's pipe dir (its sockets and
    lock file)."""
    if not spec.gpu:
        return ["--no3d"]
    return [
        "--noblacklist=/sys/module",
        *(f"--blacklist={path}" for path in spec.gpu_hidden),
        *(f"--whitelist={path}" for path in spec.gpu_shared),
    ]


def readable_argv(spec: JailSpec) -> list[str]:
    """The Python environment and the runtime: whitelisted, read-only; the server's own
    editable installs' hooks in it blacklisted (`spec.hooks_hidden`)."""
    argv = [arg for path in spec.readable for arg in (f"--whitelist={path}", f"--read-only={path}")]
    return argv + [f"--blacklist={path}" for path in spec.hooks_hidden]


def resources_argv(spec: JailSpec) -> list[str]:
    """Limits per process (the user namespace makes RLIMIT_NPROC count this jail only), and
    the jail's priority. GPU jails get no RLIMIT_AS (CUDA reserves huge virtual ranges): the
    GPU watchdog caps their resident memory instead."""
    argv = []
    if spec.limits.memory_mb is not None and not spec.gpu:
        argv.append(f"--rlimit-as={spec.limits.memory_mb * MIB}")
    if spec.nice:
        argv.append(f"--nice={spec.nice}")
    return [
        *argv,
        f"--rlimit-nproc={spec.limits.max_procs}",
        f"--rlimit-fsize={spec.limits.file_mb * MIB}",
        f"--rlimit-nofile={spec.limits.open_files}",
    ]


def lifecycle_argv(events_fd: int) -> list[str]:
    """The driver's event pipe survives firejail's fd cleanup; every process left when the
    driver exits is killed. --deterministic-shutdown costs wall time (no CPU) when a driver
    exits by itself (benchmarks: "flag costs"); it stays, because it is what closes the
    event pipe then (the sandbox's init holds a copy): without it a driver that called
    os._exit beside a live child is not seen to exit until the run's time limit. Jails the
    server ends are SIGKILLed and pay nothing."""
    return [f"--keep-fd={events_fd}", "--deterministic-exit-code", "--deterministic-shutdown"]


def env_argv(spec: JailSpec) -> list[str]:
    """firejail starts from our clean env; these are the only additions."""
    return [f"--env={key}={value}" for key, value in spec.env]


def command_argv(spec: JailSpec, events_fd: int) -> list[str]:
    """The driver: isolated mode (no user site, no PYTHON* vars), unbuffered. (No "--"
    before it: firejail 0.9.72 then runs the command through the user's login shell.)"""
    return [str(spec.python), "-I", "-u", str(spec.driver), str(events_fd)]


def launcher_env() -> dict[str, str]:
    """The environment firejail itself is started with.

    `container=docker` makes firejail sandbox normally inside containers and PID
    namespaces instead of silently running the program unjailed; every jail is
    verified afterwards by the driver's self-check anyway.
    """
    return {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "container": "docker", "LANG": "C.UTF-8"}


def accounts_argv(passwd: Path, group: Path, home: Path, then: list[str]) -> list[str]:
    """The prefix (run as root) that gives a command joining a jail (`jailexec`) the minimal
    /etc/passwd and /etc/group and the run directory as /workspace, as the jail's launch does
    (`binds_argv`): firejail checks them again as it joins.

    firejail copies the host's /etc/passwd into the jail (less the other human users):
    every system account of the host would be listed. The command is started in a private
    mount namespace of its own where those two files are bind mounts of `passwd` and `group`,
    then runs `then`: the prefix that drops to the jail's uid (`drop_argv`) before the setuid
    firejail runs. /workspace, the home `passwd` names, is a bind mount of `home` (the run
    directory, owned by the jail's uid): firejail refuses a home its user does not own.
    """
    # `env -u PWD`: the shell exports PWD, which the jail must not inherit (the canary checks).
    binds = f'mount --bind "$1" /etc/passwd && mount --bind "$2" /etc/group && mount --bind "$3" {WORKSPACE}'
    script = f'{binds} && shift 3 && exec env -u PWD "$@"'
    files = [str(passwd), str(group), str(home)]
    return ["unshare", "--mount", "--propagation=private", "--", "sh", "-c", script, "sh", *files, *then]


def bind_table(passwd: Path, group: Path, home: Path, etc: Path | None = None) -> str:
    """A jail's binds as fstab lines, for the launcher's one mount(8) (`binds_argv`), in order:
    the server's prepared /etc (`etcdir`), read-only, over /etc; the jail's minimal `passwd` and
    `group` over its own; `home`, the run directory, as /workspace.

    firejail copies the host's /etc/passwd into the jail (less the other human users): every
    system account of the host would be listed; the jail's lists only root and its own user.
    /workspace is the home that `passwd` names: firejail refuses a home its user does not own,
    and a jail of SANDBOX_UID_RANGE has a uid of its own that owns nothing else on the host. With
    `etc` the render has no --private-etc (`mounts_argv`)."""
    binds = [(etc, Path("/etc"), "bind,ro")] if etc is not None else []
    binds += [
        (passwd, Path("/etc/passwd"), "bind"),
        (group, Path("/etc/group"), "bind"),
        (home, WORKSPACE, "bind"),
    ]
    return "".join(f"{_fstab_field(src)} {_fstab_field(dst)} none {opts} 0 0\n" for src, dst, opts in binds)


def _fstab_field(path: Path) -> str:
    """A path as one fstab field: whitespace and backslashes octal-escaped, as libmount reads
    them back."""
    return "".join(f"\\{ord(c):03o}" if c in " \t\n\\" else c for c in str(path))


def binds_argv(table: Path, then: list[str]) -> list[str]:
    """The prefix (run as root) that starts a jail in a private mount namespace of its own with
    the binds of `table` (`bind_table`, written by the server where only root can), all made by
    one mount(8) (each mount(8) process costs more CPU than its bind), then runs `then`: the prefix
    that drops to the jail's uid (`drop_argv`, or the egress namespace's `enter_argv`) before the
    setuid firejail runs. A bind that fails runs nothing."""
    # `unset PWD`: the shell exports PWD, which the jail must not inherit (the canary checks);
    # the shell's own unset spares a process.
    script = 'mount --all --fstab "$1" && shift && unset PWD && exec "$@"'
    return ["unshare", "--mount", "--propagation=private", "--", "sh", "-c", script, "sh", str(table), *then]


def drop_argv(uid: int, gid: int) -> list[str]:
    """Become the sandbox uid with no groups and no capabilities, then exec what follows."""
    return ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--inh-caps=-all", "--"]


JOIN_FAILED = 126  # the launcher's exit status when it could not join the jail's cgroup
# Each cgroup.procs named in turn: writing "0" moves the writer, the shell itself, whose
# process then becomes what it execs. A write that fails ends it before anything else runs.
_JOIN = (
    'n=$1; shift; while [ "$n" -gt 0 ]; do '
    f'printf 0 > "$1" || exit {JOIN_FAILED}; n=$((n - 1)); shift; done; exec "$@"'
)


# A global OOM must pick a jail, never the server: jails start at the highest badness, and
# since root writes it (CAP_SYS_RESOURCE), that is also their floor (oom_score_adj_min), so
# jailed code cannot lower it; the server lowers its own (`lower_own_oom_score`).
JAIL_OOM_SCORE_ADJ = 1000
SERVER_OOM_SCORE_ADJ = -900
_OOM_WRITE = f"printf {JAIL_OOM_SCORE_ADJ} > /proc/self/oom_score_adj || exit 126; "
_OOM = _OOM_WRITE + 'exec "$@"'


def oom_argv() -> list[str]:
    """The prefix (run as root, first) that makes the launcher and all it starts the OOM
    killer's first choice, then execs what follows; a failed write runs nothing."""
    return ["sh", "-c", _OOM, "sh"]


def lower_own_oom_score() -> str | None:
    """Make this process (the server) the OOM killer's last choice; why not, or None."""
    try:
        with open("/proc/self/oom_score_adj", "w") as fh:
            fh.write(str(SERVER_OOM_SCORE_ADJ))
    except OSError as exc:
        return str(exc)
    return None


def join_argv(procs: Sequence[Path]) -> list[str]:
    """The prefix (run as root, first of all) that moves the launching process into the jail's
    cgroup, one cgroup.procs per controller, then execs what follows: firejail and everything it
    forks are counted from their first instruction, and a failed join (exit JOIN_FAILED) runs
    nothing.

    A shell does it, not code in the server's forked child: a child that must run Python before
    its exec makes the server fork() itself instead of vfork(), and after each such fork every
    page the server writes takes a copy-on-write fault (250-650 per warm run here).
    """
    return ["sh", "-c", _JOIN, "sh", str(len(procs)), *(str(p) for p in procs)]


def oom_join_argv(procs: Sequence[Path]) -> list[str]:
    """`oom_argv` then `join_argv` in one shell: the OOM score written first, then each
    cgroup.procs, then the exec of what follows; a failed write runs nothing (exit
    JOIN_FAILED). Root starts every jail (and every command joining one) with both: one
    shell's exec (about 0.8 ms of CPU) less per jail than the two prefixes chained."""
    return ["sh", "-c", _OOM_WRITE + _JOIN, "sh", str(len(procs)), *(str(p) for p in procs)]
