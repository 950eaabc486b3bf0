"""Facts about the host that jails depend on, checked once at startup (fail closed)."""

from __future__ import annotations

import os
import pwd
import re
import shutil
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path

from appliance.core.errors import StartupError
from appliance.sandbox.spec import WORKSPACE


@dataclass(frozen=True)
class HostFacts:
    firejail: str  # absolute path of the setuid firejail binary
    firejail_version: str
    run_as_uid: int | None  # uid to switch to before starting firejail; None: we already are it
    uid: int
    gid: int
    pid_ns: str
    net_ns: str
    root_entries: tuple[str, ...]
    run_entries: tuple[str, ...]


def inspect(firejail: str, uid: int, python: Path) -> HostFacts:
    """Check that jails can be made exactly as configured, or raise StartupError saying why."""
    path = shutil.which(firejail)
    if path is None:
        raise StartupError(f"firejail not found ({firejail!r}); install it: apt-get install firejail")
    st = os.stat(path)
    if st.st_uid != 0 or not st.st_mode & stat.S_ISUID:
        raise StartupError(f"{path} is not setuid root; firejail cannot make namespaces without it")
    version = firejail_version(path)
    me = os.geteuid()
    if me == 0:
        run_as: int | None = uid
    elif me == uid:
        run_as = None
    else:
        raise StartupError(
            f"the server runs as uid {me}: it must run as root (to start jails as SANDBOX_UID={uid}) "
            f"or as SANDBOX_UID itself"
        )
    try:
        entry = pwd.getpwuid(uid)
    except KeyError:
        raise StartupError(
            f"SANDBOX_UID={uid} has no passwd entry; create it: "
            f"useradd -u {uid} -U -d {WORKSPACE} -M -s /usr/sbin/nologin sandbox"
        ) from None
    if Path(entry.pw_dir) != WORKSPACE:
        raise StartupError(f"user {entry.pw_name} (uid {uid}) must have home {WORKSPACE}, not {entry.pw_dir}")
    try:
        ws = os.stat(WORKSPACE)
    except FileNotFoundError:
        raise StartupError(f"{WORKSPACE} does not exist; create it owned by uid {uid}") from None
    if ws.st_uid != uid:
        raise StartupError(f"{WORKSPACE} must be owned by uid {uid} (firejail requires it)")
    if not os.access(python, os.X_OK):
        raise StartupError(f"SANDBOX_PYTHON: {python} is not executable")
    return HostFacts(
        firejail=path,
        firejail_version=version,
        run_as_uid=run_as,
        uid=uid,
        gid=entry.pw_gid,
        pid_ns=os.readlink("/proc/self/ns/pid"),
        net_ns=os.readlink("/proc/self/ns/net"),
        root_entries=tuple(sorted(os.listdir("/"))),
        run_entries=tuple(sorted(os.listdir("/run"))) if os.path.isdir("/run") else (),
    )


def firejail_version(path: str) -> str:
    try:
        # S603: the configured firejail, a fixed flag
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout  # noqa: S603
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise StartupError(f"{path} --version failed: {exc}") from exc
    match = re.search(r"firejail version (\S+)", out)
    if not match:
        raise StartupError(f"{path} does not look like firejail")
    return match.group(1)


def readable_ancestors_problem(path: Path, uid: int) -> str | None:
    """Why `path` cannot be reached by uid through 'other' permissions, or None."""
    for parent in [*reversed(path.parents), path]:
        try:
            st = os.stat(parent)
        except OSError as exc:
            return f"{parent}: {exc.strerror}"
        if st.st_uid != uid and not st.st_mode & stat.S_IXOTH:
            return f"{parent} is not searchable by uid {uid} (mode {stat.filemode(st.st_mode)})"
    return None


def import_problem(python: Path, modules: tuple[str, ...], timeout_s: float = 120.0) -> str | None:
    """Why the jails' Python cannot import these modules (one process, as a warm jail does), or None.

    Isolated mode and `/` as the working directory: the answer is about the installed
    environment, not about whatever lies where the server was started.
    """
    if not modules:
        return None
    code = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\n"
    try:
        # S603: the configured python, our code; module names from settings
        proc = subprocess.run(  # noqa: S603
            [str(python), "-I", "-c", code, *modules],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            cwd="/",
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{python} could not be run: {exc}"
    if proc.returncode == 0:
        return None
    lines = [ln for ln in (proc.stderr or "").strip().splitlines() if ln.strip()]
    return lines[-1] if lines else f"{python} exited {proc.returncode} while importing {', '.join(modules)}"
