"""Shared test support: start a real appliance server; look at real processes."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from pathlib import Path
from typing import TypeVar

from appliance.runtime import local
from appliance.runtime.local import LocalServer
from appliance.sandbox import instance
from appliance.sandbox.jail import JailFactory
from appliance.sandbox.proctree import descendants
from appliance.wire import parse_worker

REPO = Path(__file__).resolve().parent.parent
# Modules the tests' servers and clients cannot import (first on their PYTHONPATH), each one the
# test venv has only through an extra and an installed appliance lacks: rfc3987_syntax comes with
# the bench extra's Jupyter (jsonschema[format-nongpl]), and jsonschema, which the MCP SDK imports,
# builds its Earley grammar on import: about 1 s of CPU at every server start, for `iri` format
# checks the SDK never makes (it validates without a format checker).
HIDDEN = REPO / "tests" / "hidden"
# A subprocess's PYTHONPATH for this checkout's server and client distribution (client/), whether
# or not they are installed (`make setup` installs both; a worktree's own code comes first).
CHECKOUT_PATH = os.pathsep.join((str(HIDDEN), str(REPO), str(REPO / "client")))
SANDBOX_UID = 1001
# The uids jails run as with the default SANDBOX_UID_RANGE (`appliance.sandbox.uids`).
SANDBOX_UIDS = frozenset(range(SANDBOX_UID, SANDBOX_UID + 64))
# Timeouts scale with the machine: CI boxes are small and noisy.
SCALE = float(os.environ.get("APPLIANCE_TEST_TIMEOUT_SCALE", "1"))


def scaled(seconds: float) -> float:
    return seconds * SCALE


T = TypeVar("T")


def until(cond: Callable[[], T], timeout: float, what: str = "the condition", poll: float = 0.05) -> T:
    """cond()'s first truthy value, polled until `timeout` (scaled) seconds have passed; then
    an AssertionError naming `what`. Tests wait on a condition with this, never a fixed sleep."""
    deadline = time.monotonic() + scaled(timeout)
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not met within {scaled(timeout):.0f} s")
        time.sleep(poll)


async def until_async(
    cond: Callable[[], T | Awaitable[T]], timeout: float, what: str = "the condition", poll: float = 0.05
) -> T:
    """until() for the event loop: cond may be a plain function or a coroutine function."""
    deadline = time.monotonic() + scaled(timeout)
    while True:
        value = cond()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not met within {scaled(timeout):.0f} s")
        await asyncio.sleep(poll)


def metric(server: LocalServer, name: str) -> float:
    """One unlabelled (or fully labelled) sample of the server's /metrics; 0 where absent."""
    status, text = server.get("/metrics")
    assert status == 200, text
    found = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


# One spawner for tests, benchmarks and users: tests add small pools, no preload and
# timeouts scaled to the machine.
Server = LocalServer


def start_server(  # noqa: PLR0913 (the server's launch options, with defaults)
    tmp: Path,
    wrap: list[str] | None = None,
    wait_ready: bool = True,
    host: str = "127.0.0.1",
    port: int = 0,
    wait_started: bool = True,
    settings: Mapping[str, str] | None = None,
    **env: str,
) -> Server:
    """Start `appliance serve` on a free port with SANDBOX_* overrides (`settings`, then `env`);
    wait for /readyz.

    wait_started=False (a fixed `port` only) returns at once, while the server still starts."""
    merged = {"SANDBOX_PRELOAD": "", "SANDBOX_POOL_SIZE": "1", **(settings or {}), **env}
    outer = merged.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    merged["PYTHONPATH"] = os.pathsep.join(p for p in (str(HIDDEN), outer) if p)
    return local.start(
        tmp,
        merged,
        host=host,
        port=port,
        wrap=wrap or (),
        wait_ready=wait_ready,
        wait_started=wait_started,
        timeout_s=scaled(90),
        cwd=REPO,
    )


def cmdline(pid: int) -> str:
    """Process pid's command line, its arguments joined by spaces ("" once it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def processes_of_uid(uid: int | frozenset[int] = SANDBOX_UIDS) -> list[tuple[int, str]]:
    """(pid, command line) of every live process whose real uid is uid (or one of them: by
    default, any uid a jail may run as)."""
    uids = frozenset((uid,)) if isinstance(uid, int) else uid
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as fh:
                status = fh.read()
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                cmd = fh.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("Uid:"):
                if int(line.split()[1]) in uids and "State:\tZ" not in status:
                    found.append((int(entry), cmd))
                break
    return found


def frames_of(raw: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in raw.splitlines() if line.strip()]


def jail_processes(
    server: Server, uid: int | frozenset[int] = SANDBOX_UIDS, settle_s: float = 5.0
) -> list[tuple[int, str]]:
    """Processes of uid (by default: of every uid a jail may run as) under this server, plus any
    orphaned to the host's init.

    A run's processes are SIGKILLed as its `done` is sent; the kernel may still be
    tearing them down for a moment, so this waits up to settle_s for them to be gone.
    """
    deadline = time.monotonic() + scaled(settle_s)
    while True:
        left = _jail_processes_now(server, uid)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def run_descendants(root: int) -> list[int]:
    """The live processes below a server that belong to runs: its frame parser left out."""
    found = []
    for pid in descendants(root):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # gone meanwhile
        if parse_worker.MODULE.encode() not in cmd:
            found.append(pid)
    return found


def _jail_processes_now(server: Server, uid: int | frozenset[int]) -> list[tuple[int, str]]:
    mine = set(run_descendants(server.proc.pid))
    left = []
    for pid, cmd in processes_of_uid(uid):
        try:
            with open(f"/proc/{pid}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if pid in mine or ppid == 1:
            left.append((pid, cmd))
    return left


@contextlib.contextmanager
def reachable_tmp_root(prefix: str) -> Iterator[Path]:
    """A SANDBOX_TMP_ROOT the sandbox uid can reach (pytest's own tmp dirs are 0700), removed after."""
    root = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    os.chmod(root, 0o755)
    try:
        yield root
    finally:
        from appliance.sandbox import runfs

        runfs.unmount_under(root)  # run tmpfs a killed server (chaos tests) left mounted
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def jail_factory(
    env: Mapping[str, str] | None = None, cls: type[JailFactory] = JailFactory
) -> Iterator[JailFactory]:
    """A real JailFactory outside any server (no preload, this interpreter in the jails), its
    run directories removed after."""
    import sys

    from appliance.sandbox.cell import disk_entries
    from appliance.sandbox.host import inspect
    from appliance.sandbox.runfs import for_server
    from appliance.sandbox.workdir import RunDirs, stage_runtime
    from appliance.settings import from_env

    settings = from_env(
        {"SANDBOX_PRELOAD": "", "SANDBOX_POOL_SIZE": "0", "SANDBOX_PYTHON": sys.executable, **(env or {})}
    )
    host = inspect(settings.firejail, settings.uid, settings.python)
    dirs = RunDirs(
        settings.tmp_root,
        host.uid,
        host.gid,
        for_server(settings.max_disk_mb, disk_entries(settings.max_disk_mb)),
    )
    dirs.prepare()
    try:
        yield cls(settings, host, stage_runtime(settings.tmp_root, settings.python), dirs)
    finally:
        dirs.remove_instance()


def run_root(tmp_root: Path, pid: int) -> Path:
    """Where server `pid` (alive, in this PID namespace) keeps its run directories under the
    SANDBOX_TMP_ROOT `tmp_root`: its instance directory (`appliance.sandbox.instance`)."""
    return tmp_root / "appliance" / instance.name(pid)


def descriptors_on(*paths: Path) -> list[str]:
    """What this process's descriptors are open on, of paths or below one of them (removed
    since or not): a leak check for descriptors a jail or a group keeps."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{name}").removesuffix(" (deleted)")
            if any(target == str(p) or target.startswith(f"{p}/") for p in paths):
                found.append(target)
    return found
