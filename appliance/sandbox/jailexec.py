"""Commands started in a live jail from outside it (E2B's `sandbox.commands`), beside its cells.

How a command gets in: `firejail --join=<the jail's firejail>`, started the way the jail
itself was (the launcher prefix of appliance.sandbox.firejail: OOM score, cgroup join, the
jail's minimal accounts in a private mount namespace, the drop to the jail's uid), with the
jail's rlimits set by `prlimit` first. firejail's join enters every namespace of the jail
(user, mount, PID, network, IPC, UTS) and applies what the jail was started with: its seccomp
filters, no_new_privs, no capabilities. What it does not carry over is done here: the
rlimits (`prlimit`), the cgroup (the jail's COMMANDS sub-group, appliance.sandbox.cgroups:
every process of a command counts against the jail's memory, pids and CPU limits and dies
with it), the environment and the working directory (`env -i -C`, inside the jail, so the
command sees nothing of the server's environment).

Why not the alternatives: the in-jail driver is frozen between cells and runs one cell at a
time, so it cannot start or watch commands while idle or busy; nsenter would enter the
namespaces but apply none of the jail's seccomp filters, capabilities or no_new_privs, which
would have to be rebuilt by hand. The join reuses what firejail already verified at launch.

Cells and commands side by side: after a cell the driver kills its leftovers but spares the
COMMANDS group's processes (appliance/inside/driver.py::end_leftovers), and a jail whose
COMMANDS group is not empty is not frozen between cells (`Jail.freeze`): a server started
with a command keeps serving. Nothing in the jail can move a process into that group (root
outside writes cgroup.procs).

Output: each command's stdout and stderr are read into at most HIGH_WATER_BYTES per reader
(`Reader`); past that the pipes are not read and the command blocks in its write, so a
client that never reads costs the server a bounded amount of memory. With no reader at all
output is read and dropped (as E2B's envd does). Stdin writes are bounded
(appliance.sandbox.control). Signals go to the command's process, held by a pidfd
(appliance.sandbox.signals); a SIGKILL ends the whole command: each command has a cgroup of
its own below the COMMANDS group, and every process in it is killed (`Tree`). A command's
end is its launcher's exit, whatever still holds its pipes; closing a command (its sandbox
ending) waits for that a bounded time, then records the end without it.

While a command's launcher lives, the jail is not frozen (`Jail.commands_running`): the
launcher joins the command's cgroup only after it is started, and one that joined a frozen
jail would hold the SIGKILL that ends it until a thaw that never came.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from appliance.core.tasks import TaskScope, cancel_and_wait, within
from appliance.sandbox import proctree, signals
from appliance.sandbox.control import ControlPipe
from appliance.sandbox.firejail import MIB, accounts_argv, drop_argv, launcher_env, oom_join_argv
from appliance.sandbox.spec import JailLimits

READ_CHUNK = 65536
HIGH_WATER_BYTES = 256 * 1024  # a reader's unread output above which the pipes are not read ...
LOW_WATER_BYTES = 64 * 1024  # ... until it is below this again
MAX_STDIN_BYTES = 1 << 20  # stdin written and not yet taken by the command
START_WAIT_S = 10.0  # the longest a killed command's launcher takes to exit ...
GIVE_UP_WAIT_S = 5.0  # ... and after a second kill: then its end is recorded without it
END_DRAIN_BYTES = 1 << 20  # the most read at a command's end from pipes a daemon may hold


@dataclass(frozen=True)
class JoinSpec:
    """What starting a command in one jail takes, fixed when the jail is launched."""

    firejail: str
    uid: int
    gid: int
    as_root: bool  # the server is root: it joins the cgroup, mounts the accounts, drops the uid
    accounts: tuple[Path, Path] | None
    workdir: Path
    env: tuple[tuple[str, str], ...]  # the jail's own environment
    limits: JailLimits
    gpu: bool = False  # no RLIMIT_AS (the jail has none either)


def limits_argv(limits: JailLimits, gpu: bool) -> list[str]:
    """`prlimit` with the jail's rlimits (firejail's join does not carry them over)."""
    argv = [
        "prlimit",
        f"--nproc={limits.max_procs}",
        f"--fsize={limits.file_mb * MIB}",
        f"--nofile={limits.open_files}",
    ]
    if limits.memory_mb is not None and not gpu:
        argv.append(f"--as={limits.memory_mb * MIB}")
    return [*argv, "--"]


def command_argv(  # noqa: PLR0913 (the jail's facts and the command's, all pure data)
    spec: JoinSpec,
    jail_pid: int,
    procs: Sequence[Path],
    argv: Sequence[str],
    env: dict[str, str],
    cwd: str,
) -> list[str]:
    """The whole argv that runs `argv` in the jail whose firejail is `jail_pid` (pure).

    The command's environment is the jail's, then `env`; `env -i` inside the jail makes it
    exactly that. ValueError for a command `env` would misread."""
    if not argv or not argv[0] or "=" in argv[0]:
        raise ValueError("the command must name a program (without '=' in its name)")
    for key in env:
        if not key or "=" in key or "\0" in key:
            raise ValueError(f"not an environment variable name: {key[:64]!r}")
    merged = dict(spec.env)
    merged.update(env)
    inside = ["env", "-i", "-C", cwd, *(f"{k}={v}" for k, v in merged.items()), *argv]
    join = [spec.firejail, "--quiet", f"--join={jail_pid}", *inside]
    prefix: list[str] = limits_argv(spec.limits, spec.gpu)
    if spec.as_root:
        prefix = drop_argv(spec.uid, spec.gid) + prefix
        if spec.accounts is not None:
            prefix = accounts_argv(*spec.accounts, spec.workdir, prefix)
        prefix = oom_join_argv(procs) + prefix
    return prefix + join


class Tree(Protocol):
    """All of one command's processes, wherever they forked to: its own cgroup
    (appliance.sandbox.jail.CommandTree)."""

    def kill(self) -> None:
        """SIGKILL every process of the command, and see that the kill lands."""

    def release(self) -> None:
        """The command has ended: let go of what held its processes (blocking: a thread)."""


@dataclass(frozen=True)
class Data:
    stream: str  # "stdout" | "stderr"
    data: bytes


@dataclass(frozen=True)
class Ended:
    exit_code: int  # the command's status; 128 + N when signal N ended it
    signal: int | None  # the signal that ended it, if one did
    error: str | None = None  # why it could not run at all (the jail gone, a refused start)

    @property
    def status(self) -> str:
        """The words E2B's envd uses for how a process ended."""
        if self.signal is not None:
            return f"signal: {(signal.strsignal(self.signal) or str(self.signal)).lower()}"
        return f"exit status {self.exit_code}"


Item = Data | Ended


class Reader:
    """One reader of a command's output from the moment it subscribed (`JailCommand.reader`)."""

    def __init__(self, command: JailCommand) -> None:
        self._command = command
        self._items: deque[Item] = deque()
        self.waiting = 0  # bytes queued here and not yet taken
        self._wake = asyncio.Event()

    def put(self, item: Item) -> None:
        self._items.append(item)
        if isinstance(item, Data):
            self.waiting += len(item.data)
        self._wake.set()

    async def next(self) -> Item:
        """The next chunk of output, or the command's end (then always that)."""
        while not self._items:
            self._wake.clear()
            await self._wake.wait()
        item = self._items[0]
        if isinstance(item, Ended):
            return item
        self._items.popleft()
        self.waiting -= len(item.data)
        self._command.taken()
        return item

    def close(self) -> None:
        self._command.drop(self)


class JailCommand:
    """A command running in a jail: its output to readers, its stdin, its signals, its end."""

    def __init__(  # noqa: PLR0913 (the spawned process, its descriptors, where it runs)
        self,
        proc: asyncio.subprocess.Process,
        out_fd: int,
        err_fd: int,
        stdin_fd: int | None,
        tasks: TaskScope,
        tree: Tree | None = None,
    ) -> None:
        loop = asyncio.get_running_loop()
        self._proc = proc
        self._tree = tree
        self._loop = loop
        self._fds = {out_fd: "stdout", err_fd: "stderr"}
        self._open = set(self._fds)
        self._readers: list[Reader] = []
        self._paused = False
        self._stdin = ControlPipe(stdin_fd, loop) if stdin_fd is not None else None
        self._pidfd: int | None = None
        self._launcher_fd = signals.child_pidfd(proc.pid)  # signalled without a reap (signals)
        self.ended: Ended | None = None
        self._done = asyncio.Event()
        for fd in self._fds:
            os.set_blocking(fd, False)
            loop.add_reader(fd, self._on_readable, fd)
        self._waiter = tasks.spawn(self._wait(), name="jail-command")

    @classmethod
    async def start(
        cls,
        argv: Sequence[str],
        stdin: bool,
        tasks: TaskScope,
        tree: Tree | None = None,
    ) -> JailCommand:
        """Spawn the rendered argv (`command_argv`) as the server's child; nothing runs in
        the child before exec (vfork, as jails are spawned). `tree`: where the launcher puts
        the command (its cgroup), which a SIGKILL ends whole."""
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        in_r, in_w = (
            os.pipe2(os.O_CLOEXEC) if stdin else (os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC), -1)
        )
        child_ends = (out_w, err_w, in_r)
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=in_r,
                stdout=out_w,
                stderr=err_w,
                env=launcher_env(),
                cwd="/",
                start_new_session=True,
            )
        except BaseException:
            for fd in (*child_ends, out_r, err_r, *([in_w] if in_w >= 0 else [])):
                os.close(fd)
            raise
        for fd in child_ends:
            os.close(fd)
        return cls(proc, out_r, err_r, in_w if in_w >= 0 else None, tasks, tree)

    # -- output ---------------------------------------------------------------------------
    def reader(self) -> Reader:
        """A new reader of the output from now on (and of the end, even one already come)."""
        reader = Reader(self)
        if self.ended is not None:
            reader.put(self.ended)
        else:
            self._readers.append(reader)
        return reader

    def drop(self, reader: Reader) -> None:
        with contextlib.suppress(ValueError):
            self._readers.remove(reader)
        self.taken()

    def taken(self) -> None:
        """A reader took output: read the pipes again once every reader is below the low water."""
        if self._paused and all(r.waiting <= LOW_WATER_BYTES for r in self._readers):
            self._paused = False
            for fd in self._open:
                self._loop.add_reader(fd, self._on_readable, fd)
            self._maybe_end()

    def _on_readable(self, fd: int) -> None:
        if not self._paused and fd in self._open:
            self._read_once(fd)

    def _read_once(self, fd: int) -> bool:
        """Read one chunk from fd to every reader; False when there was nothing to read."""
        try:
            chunk = os.read(fd, READ_CHUNK)
        except BlockingIOError:
            return False
        except OSError:
            chunk = b""
        if not chunk:
            self._close(fd)
            self._maybe_end()
            return False
        item = Data(self._fds[fd], chunk)
        for reader in self._readers:
            reader.put(item)
        if not self._paused and any(r.waiting > HIGH_WATER_BYTES for r in self._readers):
            self._paused = True  # the command's writes now block in the jail
            for open_fd in self._open:
                self._loop.remove_reader(open_fd)
        return True

    def _close(self, fd: int) -> None:
        if fd in self._open:
            self._open.discard(fd)
            with contextlib.suppress(Exception):
                self._loop.remove_reader(fd)
            with contextlib.suppress(OSError):
                os.close(fd)

    # -- the end --------------------------------------------------------------------------
    async def _wait(self) -> None:
        await self._proc.wait()
        self._maybe_end()
        if self._tree is not None:
            await asyncio.to_thread(self._tree.release)

    def _maybe_end(self) -> None:
        """The end goes out once the process has exited and what its pipes held is read. A
        daemon it left may hold them open: what is there now is read (up to END_DRAIN_BYTES,
        and while readers keep up), then they are closed; it writes into nothing after."""
        if self.ended is not None or self._proc.returncode is None or self._paused:
            return  # a paused command ends when its readers catch up (`taken`)
        drained = 0
        for fd in list(self._open):
            while fd in self._open and not self._paused and drained < END_DRAIN_BYTES:
                if not self._read_once(fd):
                    break
                drained += READ_CHUNK
        if self._paused or self.ended is not None:
            return
        self._finish()

    def _finish(self, lost: str | None = None) -> None:
        """Record the end from the launcher's exit status; or, with `lost`, without it (a
        command that did not end after its kill: its end is told, with why)."""
        if self.ended is not None:
            return
        code = self._proc.returncode
        if code is None:
            if lost is None:
                return
            self.ended = Ended(exit_code=-1, signal=None, error=lost)
        else:
            # The join reports a signal's end as 128 + N, as a shell does; a negative code is
            # the launcher itself killed by a signal.
            sig = -code if code < 0 else (code - 128 if 128 < code < 128 + 65 else None)
            self.ended = Ended(exit_code=code if code >= 0 else 128 - code, signal=sig)
        for fd in list(self._open):
            self._close(fd)
        for reader in self._readers:
            reader.put(self.ended)
        self._readers.clear()
        if self._stdin is not None:
            self._stdin.close()
            self._stdin = None
        for held in (self._pidfd, self._launcher_fd):
            if held is not None:
                with contextlib.suppress(OSError):
                    os.close(held)
        self._pidfd = self._launcher_fd = None
        self._done.set()

    async def wait(self) -> Ended:
        await self._done.wait()
        return self.ended or Ended(exit_code=-1, signal=None, error="no end was recorded")

    @property
    def running(self) -> bool:
        return self.ended is None

    # -- stdin and signals ------------------------------------------------------------------
    def write_stdin(self, data: bytes) -> None:
        """Queue bytes for the command's stdin; ValueError when it has none (or closed it),
        OverflowError past MAX_STDIN_BYTES not yet taken."""
        if self._stdin is None or self.ended is not None:
            raise ValueError("the command has no stdin open")
        self._stdin.write(data, MAX_STDIN_BYTES)

    def close_stdin(self) -> None:
        if self._stdin is None:
            raise ValueError("the command has no stdin open")
        self._stdin.close()
        self._stdin = None

    def send_signal(self, sig: signal.Signals) -> None:
        """Signal the command's own process in the jail (the child firejail's join started),
        held by a pidfd. SIGKILL ends the whole command: every process of its tree (its
        cgroup: what it forked, daemons too), and the join process itself, so a command
        whose start was still under way ends too. ProcessLookupError once it has ended."""
        if self.ended is not None:
            raise ProcessLookupError("the command has ended")
        if sig == signal.SIGKILL and self._tree is not None:
            self._tree.kill()
        fd = self._command_pidfd()
        if fd is not None:
            signals.kill_by_pidfd(fd, sig)
        if (sig == signal.SIGKILL or fd is None) and self._launcher_fd is not None:
            with contextlib.suppress(ProcessLookupError):
                signals.kill_by_pidfd(self._launcher_fd, sig)

    def _command_pidfd(self) -> int | None:
        """A pidfd of the command's process: firejail's one child, opened then checked to be
        still its child (so a reused PID is never signalled)."""
        if self._pidfd is not None:
            return self._pidfd
        for pid in proctree.children(self._proc.pid):
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                continue
            if pid in proctree.children(self._proc.pid):
                self._pidfd = fd
                return fd
            os.close(fd)
        return None

    def kill_now(self) -> None:
        """SIGKILL the command and its launcher (the jail ending takes the rest)."""
        with contextlib.suppress(ProcessLookupError, OSError):
            self.send_signal(signal.SIGKILL)

    async def close(self) -> None:
        """Kill it if it runs and wait for its end, a bounded time (the sandbox's end must not
        hang on it: its jail's teardown kills whatever is left); every descriptor closed."""
        for wait_s in (START_WAIT_S, GIVE_UP_WAIT_S):
            if self.ended is not None or self._proc.returncode is not None:
                break  # ended, or exited with output its readers have not taken: dropped
            self.kill_now()
            with contextlib.suppress(TimeoutError):
                await within(self._done.wait(), wait_s)
        self._finish(lost="the command did not end after its kill")
        await cancel_and_wait(self._waiter)
