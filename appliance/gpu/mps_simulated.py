"""A simulated CUDA MPS control daemon, for tests and machines without a GPU.

It keeps what the real daemon keeps for layer (b): one server per uid, a per-device
pinned-memory limit per server, and clients whose limit is fixed when they connect. Clients
are real processes (in real jails): they connect to the unix socket `<pipe_dir>/sim-client`
(what the test build of libcuda, `tests/stub_libcuda.c`, does in cuDevicePrimaryCtxRetain),
and the daemon learns their host PID and uid from SO_PEERCRED, as the real one does. Line
protocol, one request and one answer a line:

    hello <device uuid>   -> "shm <path>"                (the daemon's shared memory: map it)
    attach <inode>        -> "ok <limit MiB | none>"     (the connection is now the client)
                           | "error"                     (that is not the daemon's memory)
    alloc <bytes>         -> "ok" | "oom"                (CUDA_ERROR_OUT_OF_MEMORY)

As unkind as the real daemon where a jail is concerned (the backend's control file sets it):

- `"mps_shm"`: where the daemon's shared memory lives. `"dev_shm"` (the default, as the real
  daemon) puts it in /dev/shm, which a GPU jail does not see (`--private-dev`): a jailed client
  cannot attach, and its context fails (the stub's CUDA_ERROR_MPS_CONNECTION_FAILED).
  `"pipe_dir"` puts it in the pipe directory GPU jails whitelist: a daemon no real one is
  today, kept so the limiter's own mechanics stay tested.
- `"mps_pid_namespace": "other"`: the daemon runs in another PID namespace (another
  container) and reports its clients under PIDs of its own, which never match a run's.
- compute mode is the backend's (`"compute_mode"`; DEFAULT unless set).

Allocations are refused past the client's limit and past the device's size (what a full
GPU does), and reported to the simulated GPU backend as the client PID's usage, so the
watchdog and the ledger see them. `enforce=False` makes a daemon that accepts limits but
ignores them (the startup probe must notice); a `mps_fault` string in the backend's control
file makes every control command fail, like a daemon that went away. `"free_delay_ms": N` in
that file frees a client's memory N ms after it disconnects (exits or is killed), as a real GPU
frees asynchronously: until then it stays on the device and in the backend's process list.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

from appliance.gpu.backend import GpuBackendError
from appliance.gpu.mps import MpsControl, MpsError
from appliance.gpu.simulated import SimulatedBackend

SOCKET_NAME = "sim-client"
SHM_NAME = "sim-shm"
FOREIGN_PID_OFFSET = 5_000_000  # "PIDs" of another namespace: above any pid_max, never a real one here
SERVER_PID_BASE = 4_000_000  # simulated server "PIDs": above any real pid_max default
MIB = 1024 * 1024


@dataclass
class _Client:
    pid: int
    uid: int
    uuid: str
    limit_mb: int | None
    used_bytes: int = 0


class SimulatedMps(MpsControl):
    """An in-process MPS daemon with a real socket for real clients; thread-safe."""

    name = "simulated"

    def __init__(self, pipe_dir: Path, backend: SimulatedBackend, enforce: bool = True) -> None:
        self.pipe_dir = pipe_dir
        self.backend = backend
        self.enforce = enforce
        self._lock = threading.Lock()
        self._defaults: dict[str, int] = {}  # uuid -> MiB for new servers
        self._limits: dict[int, dict[str, int]] = {}  # server -> uuid -> MiB
        self._servers: dict[int, int] = {}  # uid -> server
        self._clients: dict[int, dict[int, _Client]] = {}  # server -> pid -> client
        self._freeing: list[_Client] = []  # gone, memory not yet freed
        pipe_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(pipe_dir, 0o755)
        path = pipe_dir / SOCKET_NAME
        path.unlink(missing_ok=True)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(str(path))
        os.chmod(path, 0o666)  # like the real control socket: every uid may connect
        self._sock.listen(64)
        # The daemon's "shared memory": one file in /dev/shm (the real daemon's place) and one
        # in the pipe directory; the control file says which a client must attach to.
        self._shm = {
            "dev_shm": Path("/dev/shm") / f"appliance-sim-mps-{os.getpid()}-{id(self):x}",
            "pipe_dir": pipe_dir / SHM_NAME,
        }
        for shm in self._shm.values():
            shm.write_bytes(b"\0" * 64)
            os.chmod(shm, 0o666)
        self._closed = False
        threading.Thread(target=self._accept, name="sim-mps", daemon=True).start()

    # -- MpsControl --------------------------------------------------------------------------
    def needs_dev_shm(self) -> bool:
        return self._shm_place() == "dev_shm"

    def pid_namespace_problem(self) -> str | None:
        if self.backend.control_state().get("mps_pid_namespace") == "other":
            return (
                "the simulated MPS daemon runs in another PID namespace: the client PIDs it reports "
                "are not this server's"
            )
        return None

    def server_for(self, uid: int) -> int:
        self._check_fault()
        with self._lock:
            return self._server(uid)

    def clients(self, server: int) -> set[int]:
        self._check_fault()
        with self._lock:
            return set(self._clients.get(self._known(server), {}))

    def set_limit(self, server: int, uuid: str, memory_mb: int) -> None:
        self._check_fault()
        with self._lock:
            self._limits[self._known(server)][uuid] = memory_mb

    def limit(self, server: int, uuid: str) -> int | None:
        self._check_fault()
        with self._lock:
            return self._limits[self._known(server)].get(uuid)

    def set_default_limit(self, uuid: str, memory_mb: int) -> None:
        self._check_fault()
        with self._lock:
            self._defaults[uuid] = memory_mb

    def terminate_client(self, server: int, client: int) -> None:
        self._check_fault()
        with self._lock:
            gone = self._clients.get(self._known(server), {}).pop(client, None)
        if gone is not None:
            self.backend.set_usage(gone.pid, _index(gone.uuid), 0)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            with contextlib.suppress(OSError):
                self._sock.close()
            with contextlib.suppress(OSError):
                (self.pipe_dir / SOCKET_NAME).unlink()
            for shm in self._shm.values():
                with contextlib.suppress(OSError):
                    shm.unlink()

    # -- test hooks --------------------------------------------------------------------------
    def client_limits(self) -> dict[int, int | None]:
        """Every connected client's fixed limit, by host PID."""
        with self._lock:
            return {c.pid: c.limit_mb for clients in self._clients.values() for c in clients.values()}

    def tamper(self, server: int, uuid: str, memory_mb: int) -> None:
        """What a client able to send privileged commands would do: raise its server's limit."""
        with self._lock:
            self._limits[self._known(server)][uuid] = memory_mb

    # -- internals ---------------------------------------------------------------------------
    def _check_fault(self) -> None:
        fault = self.backend.control_state().get("mps_fault")
        if fault:
            raise MpsError(f"simulated MPS fault: {fault}")

    def _shm_place(self) -> str:
        return "pipe_dir" if self.backend.control_state().get("mps_shm") == "pipe_dir" else "dev_shm"

    def _reported(self, pid: int) -> int:
        """A client's PID as this daemon reports it (its own namespace's, when that differs)."""
        if self.backend.control_state().get("mps_pid_namespace") == "other":
            return pid + FOREIGN_PID_OFFSET
        return pid

    def _server(self, uid: int) -> int:
        server = self._servers.get(uid)
        if server is None:
            server = self._servers[uid] = SERVER_PID_BASE + uid
            self._limits[server] = dict(self._defaults)
            self._clients[server] = {}
        return server

    def _known(self, server: int) -> int:
        if server not in self._limits:
            raise MpsError(f"no MPS server with PID {server}")
        return server

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        pid, uid, _ = struct.unpack(
            "3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        )
        client: _Client | None = None
        server = 0
        reported = self._reported(pid)
        device = ""
        shm: Path | None = None
        try:
            with conn, conn.makefile("rw", encoding="ascii", newline="\n") as stream:
                for line in stream:
                    verb, _, arg = line.strip().partition(" ")
                    if verb == "hello" and client is None and shm is None:
                        device, shm = arg, self._shm[self._shm_place()]
                        stream.write(f"shm {shm}\n")
                    elif verb == "attach" and client is None and shm is not None:
                        try:
                            ok = arg.isdigit() and int(arg) == os.stat(shm).st_ino
                        except OSError:
                            ok = False
                        if not ok:  # the client mapped something else, or nothing
                            stream.write("error\n")
                            stream.flush()
                            return
                        with self._lock:
                            server = self._server(uid)
                            client = _Client(pid, uid, device, self._limits[server].get(device))
                            self._clients[server][reported] = client
                        stream.write(f"ok {client.limit_mb if client.limit_mb is not None else 'none'}\n")
                    elif verb == "alloc" and client is not None and arg.isdigit():
                        stream.write("ok\n" if self._alloc(server, client, int(arg)) else "oom\n")
                    else:
                        stream.write("error\n")
                    stream.flush()
        except (OSError, ValueError):
            pass
        finally:
            if client is not None:
                self._release(server, client, reported)

    def _release(self, server: int, client: _Client, reported: int) -> None:
        """The client is gone: free its memory now, or after free_delay_ms (late frees)."""
        try:
            delay_ms = int(self.backend.control_state().get("free_delay_ms") or 0)
        except (TypeError, ValueError, GpuBackendError):
            delay_ms = 0
        with self._lock:
            self._clients.get(server, {}).pop(reported, None)
            if delay_ms > 0 and client.used_bytes:
                self._freeing.append(client)

        def free() -> None:
            with self._lock:
                if client in self._freeing:
                    self._freeing.remove(client)
            self.backend.set_usage(client.pid, _index(client.uuid), 0)

        if delay_ms > 0 and client.used_bytes:
            timer = threading.Timer(delay_ms / 1000, free)
            timer.daemon = True
            timer.start()
        else:
            free()

    def _alloc(self, server: int, client: _Client, size: int) -> bool:
        total = next((d.total_mb for d in self.backend.devices() if d.uuid == client.uuid), 0) * MIB
        with self._lock:
            if not any(c is client for c in self._clients.get(server, {}).values()):
                return False  # terminated by the daemon
            ceiling = client.limit_mb * MIB if self.enforce and client.limit_mb is not None else total
            live = [c for cs in self._clients.values() for c in cs.values()]
            on_device = sum(c.used_bytes for c in (*live, *self._freeing) if c.uuid == client.uuid)
            if client.used_bytes + size > ceiling or on_device + size > total:
                return False  # over its own limit, or the device is full (a real OOM)
            client.used_bytes += size
            used_mb = -(-client.used_bytes // MIB)
        self.backend.set_usage(client.pid, _index(client.uuid), used_mb)
        return True


def _index(uuid: str) -> int:
    """GPU-SIM-<i> -> i (the simulated backend's naming)."""
    try:
        return int(uuid.rsplit("-", 1)[1])
    except (IndexError, ValueError):
        return -1
