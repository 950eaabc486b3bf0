"""The CUDA MPS control daemon behind one small seam: `MpsControl`, with plain data in and out.

Enforcement layer (b) sets *daemon-side* pinned device memory limits: the value lives in the
MPS control daemon (root), never in the client's environment (`CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`
is read by the untrusted process and could be changed by it). The daemon fixes a client's
limit when the client connects (`set_device_pinned_mem_limit <server> <dev> <N>M` applies to
clients created afterwards; existing ones keep theirs), which is what `appliance.gpu.mps_limits`
builds per-run limits on.

Two implementations: `DaemonControl` (the real one: commands piped to `nvidia-cuda-mps-control`)
and `appliance.gpu.mps_simulated.SimulatedMps` (tests, machines without a GPU). Rendering the
commands and parsing the replies are pure functions here, tested without a daemon.
"""

from __future__ import annotations

import abc
import os
import re
import shutil
import subprocess
from pathlib import Path

from appliance.gpu.backend import GpuBackendError

CONTROL_BINARY = "nvidia-cuda-mps-control"
COMMAND_TIMEOUT_S = 10.0
_PID_RE = re.compile(r"^\d+$")
_LIMIT_RE = re.compile(r"^(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?$", re.IGNORECASE)
_UNIT_MB = {"": 1 / (1024 * 1024), "K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}


class MpsError(GpuBackendError):
    """The MPS control daemon refused a command or could not be reached."""


class MpsControl(abc.ABC):
    """What the per-run limiter needs from an MPS control daemon. Blocking calls (use a thread)."""

    name: str = "abstract"
    pipe_dir: Path

    def needs_dev_shm(self) -> bool:
        """Whether clients must map the daemon's shared memory in /dev/shm (the real daemon's do;
        a GPU jail's /dev/shm is private and empty, see mps_limits.jail_blockers)."""
        return True

    def pid_namespace_problem(self) -> str | None:
        """Why the PIDs the daemon reports are not this server's (another PID namespace); None if they are."""
        return None

    @abc.abstractmethod
    def server_for(self, uid: int) -> int:
        """The PID of the MPS server that serves `uid`'s clients, started if there is none."""

    @abc.abstractmethod
    def clients(self, server: int) -> set[int]:
        """Host PIDs of the clients connected to that server."""

    @abc.abstractmethod
    def set_limit(self, server: int, uuid: str, memory_mb: int) -> None:
        """The pinned device memory limit of every client of `server` that connects from now on."""

    @abc.abstractmethod
    def limit(self, server: int, uuid: str) -> int | None:
        """That limit now, in MiB (None: no limit)."""

    @abc.abstractmethod
    def set_default_limit(self, uuid: str, memory_mb: int) -> None:
        """The limit servers started later begin with (a restarted server must not be unlimited)."""

    @abc.abstractmethod
    def terminate_client(self, server: int, client: int) -> None:
        """End a client's GPU work on that server."""

    def close(self) -> None:  # noqa: B027 (optional hook: the real daemon is not ours to stop)
        """Release what the control holds; idempotent."""


# -- the commands and their replies (pure) ------------------------------------------------------


def cmd_set_limit(server: int, uuid: str, memory_mb: int) -> str:
    """The control command limiting each new client of `server` on device `uuid`."""
    _check_uuid(uuid)
    return f"set_device_pinned_mem_limit {int(server)} {uuid} {int(memory_mb)}M"


def cmd_get_limit(server: int, uuid: str) -> str:
    _check_uuid(uuid)
    return f"get_device_pinned_mem_limit {int(server)} {uuid}"


def cmd_set_default_limit(uuid: str, memory_mb: int) -> str:
    _check_uuid(uuid)
    return f"set_default_device_pinned_mem_limit {uuid} {int(memory_mb)}M"


def parse_pids(reply: str) -> set[int]:
    """A reply listing PIDs one per line (get_server_list, get_client_list); MpsError otherwise."""
    pids = set()
    for line in reply.split():
        if not _PID_RE.match(line):
            raise MpsError(f"unexpected MPS reply {reply.strip()[:200]!r}")
        pids.add(int(line))
    return pids


def parse_limit_mb(reply: str) -> int | None:
    """'900M', '4G', '4096 MB' -> MiB; 'none'/'0'/'disabled' -> None; MpsError otherwise."""
    text = reply.strip()
    if text.lower() in ("none", "disabled", "unlimited", "no limit", "0", "0m", "0g"):
        return None
    match = _LIMIT_RE.match(text)
    if not match:
        raise MpsError(f"unexpected MPS limit reply {text[:200]!r}")
    value = float(match.group(1)) * _UNIT_MB[match.group(2).upper()]
    return int(value) or None


def _check_uuid(uuid: str) -> None:
    # The value goes into a line-based command: never let a newline or a space through.
    if not re.fullmatch(r"[A-Za-z0-9-]+", uuid):
        raise MpsError(f"not a device UUID: {uuid!r}")


# -- the real daemon ----------------------------------------------------------------------------


class DaemonControl(MpsControl):
    """`nvidia-cuda-mps-control` as a command-line client, one process per command.

    Runs as root (the server's own user): privileged commands (limits, terminate) need it.
    """

    name = "nvidia-cuda-mps-control"

    def __init__(self, pipe_dir: Path, binary: str | None = None, proc: Path = Path("/proc")) -> None:
        found = binary or shutil.which(CONTROL_BINARY)
        self.proc = proc
        if not found:
            raise MpsError(f"{CONTROL_BINARY} was not found on PATH")
        self.binary = found
        self.pipe_dir = pipe_dir

    def _run(self, command: str) -> str:
        env = {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir)}
        try:
            # S603: the control binary from settings; commands are ours
            done = subprocess.run(  # noqa: S603
                [self.binary],
                input=command + "\n",
                capture_output=True,
                text=True,
                env=env,
                timeout=COMMAND_TIMEOUT_S,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise MpsError(f"{command.split()[0]}: {exc}") from exc
        if done.returncode != 0:
            raise MpsError(
                f"{command.split()[0]} failed ({done.returncode}): "
                f"{(done.stdout + done.stderr).strip()[:300]}"
            )
        return done.stdout

    def _set(self, command: str) -> None:
        reply = self._run(command).strip()
        if reply:  # setters answer nothing on success
            raise MpsError(f"{command.split()[0]} refused: {reply[:300]}")

    def pid_namespace_problem(self) -> str | None:
        """The daemon's process must be visible here and in our PID namespace: the PIDs of its
        servers and clients are then ours. A daemon in another container reports its own."""
        return daemon_pid_namespace_problem(self.proc)

    def server_for(self, uid: int) -> int:
        for pid in sorted(parse_pids(self._run("get_server_list"))):
            if _uid_of(pid) == uid:
                return pid
        self._run(f"start_server -uid {int(uid)}")
        for pid in sorted(parse_pids(self._run("get_server_list"))):
            if _uid_of(pid) == uid:
                return pid
        raise MpsError(f"the MPS daemon started no server for uid {uid}")

    def clients(self, server: int) -> set[int]:
        return parse_pids(self._run(f"get_client_list {int(server)}"))

    def set_limit(self, server: int, uuid: str, memory_mb: int) -> None:
        self._set(cmd_set_limit(server, uuid, memory_mb))

    def limit(self, server: int, uuid: str) -> int | None:
        return parse_limit_mb(self._run(cmd_get_limit(server, uuid)))

    def set_default_limit(self, uuid: str, memory_mb: int) -> None:
        self._set(cmd_set_default_limit(uuid, memory_mb))

    def terminate_client(self, server: int, client: int) -> None:
        self._run(f"terminate_client {int(server)} {int(client)}")


def _uid_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("Uid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def daemon_pid_namespace_problem(proc: Path = Path("/proc")) -> str | None:
    """Why the MPS control daemon's PIDs are not in this process's PID namespace; None if they are."""
    try:
        ours = os.readlink(proc / "self" / "ns" / "pid")
        entries = os.listdir(proc)
    except OSError as exc:
        return f"this server's PID namespace could not be read ({exc})"
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            comm = (proc / entry / "comm").read_text().strip()
            if comm != CONTROL_BINARY[:15]:  # comm is cut to 15 characters
                continue
            theirs = os.readlink(proc / entry / "ns" / "pid")
        except OSError:
            continue
        if theirs != ours:
            return (
                f"the MPS control daemon (PID {entry}) runs in another PID namespace ({theirs}, ours "
                f"{ours}): the client PIDs it reports are not this server's"
            )
        return None
    return (
        "no MPS control daemon process is visible in this PID namespace (a daemon in another "
        "container or on the host): the client PIDs it reports are not this server's"
    )


def control_socket_present(pipe_dir: Path) -> bool:
    """Whether an MPS control daemon listens in pipe_dir (its `control` socket exists)."""
    try:
        return os.path.exists(pipe_dir / "control")
    except OSError:
        return False
