"""The warm-kernel baseline: Jupyter Kernel Gateway on loopback, one kernel, its WebSocket.

A request is a Jupyter `execute_request` on the gateway's `/api/kernels/<id>/channels`
WebSocket; it is complete when both its `execute_reply` (shell) and its `status: idle`
(iopub) have arrived, which is when a Jupyter client knows all output is in.

TCP_NODELAY: the client is an asyncio `websockets` connection (asyncio sets TCP_NODELAY
on every TCP transport); the gateway is started through `benchmarks.kg_nodelay`, which
turns it on for tornado's streams. `nodelay_state()` reads the option back from both
live sockets (the gateway's through pidfd_getfd), and the suite records it.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from websockets.asyncio.client import ClientConnection, connect

from benchmarks.appliance_server import REPO, BenchError

SYS_PIDFD_GETFD = 438  # same number on every Linux architecture (unified syscall table)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class KernelGateway:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path
    nodelay: bool
    kernel_id: str = ""
    ws: ClientConnection | None = None
    session: str = field(default_factory=lambda: uuid.uuid4().hex)

    def _http(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data, method=method)
        with urllib.request.urlopen(req, timeout=30) as resp:  # noqa: S310 (an http:// URL built here)
            raw = resp.read()
        return json.loads(raw) if raw else None

    async def open_kernel(self) -> None:
        """Start one python3 kernel and connect to its channels WebSocket."""
        reply = await asyncio.to_thread(self._http, "POST", "/api/kernels", {"name": "python3"})
        self.kernel_id = str(reply["id"])
        url = f"ws://127.0.0.1:{self.port}/api/kernels/{self.kernel_id}/channels"
        self.ws = await connect(url, compression=None, max_size=None, open_timeout=60)

    async def execute(self, code: str, timeout_s: float = 60.0) -> str:
        """Run code in the kernel; return its stdout. Raises BenchError if the cell failed."""
        if self.ws is None:
            raise BenchError("no kernel connection: open_kernel() first")
        msg_id = uuid.uuid4().hex
        msg = {
            "header": {
                "msg_id": msg_id,
                "username": "bench",
                "session": self.session,
                "msg_type": "execute_request",
                "version": "5.3",
            },
            "parent_header": {},
            "metadata": {},
            "buffers": [],
            "channel": "shell",
            "content": {
                "code": code,
                "silent": False,
                "store_history": False,
                "user_expressions": {},
                "allow_stdin": False,
                "stop_on_error": True,
            },
        }
        await self.ws.send(json.dumps(msg))
        stdout: list[str] = []
        replied = idle = False
        status = "ok"
        async with asyncio.timeout(timeout_s):
            while not (replied and idle):
                reply = json.loads(await self.ws.recv())
                if reply.get("parent_header", {}).get("msg_id") != msg_id:
                    continue
                kind = reply.get("msg_type")
                content = reply.get("content", {})
                if kind == "stream" and content.get("name") == "stdout":
                    stdout.append(content.get("text", ""))
                elif kind == "execute_reply":
                    replied = True
                    status = content.get("status", "ok")
                elif kind == "status" and content.get("execution_state") == "idle":
                    idle = True
        if status != "ok":
            raise BenchError(f"jupyter cell ended {status}")
        return "".join(stdout)

    def nodelay_state(self) -> dict[str, bool]:
        """TCP_NODELAY as set on the live client socket and on the gateway's end of it."""
        if self.ws is None:
            raise BenchError("no kernel connection: open_kernel() first")
        sock = self.ws.transport.get_extra_info("socket")
        client = bool(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        local_port = sock.getsockname()[1]
        return {"client": client, "server": _peer_nodelay(self.proc.pid, self.port, local_port)}

    async def close(self) -> None:
        if self.ws is not None:
            await self.ws.close()
        if self.proc.poll() is None:
            self.proc.terminate()  # the gateway shuts its kernels down on SIGTERM
            try:
                await asyncio.to_thread(self.proc.wait, 20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                await asyncio.to_thread(self.proc.wait)


async def start_gateway(workdir: Path, nodelay: bool = True) -> KernelGateway:
    """Start Kernel Gateway on a free loopback port; Jupyter's files stay under workdir."""
    try:
        import kernel_gateway  # noqa: F401
    except ImportError as exc:
        raise BenchError("jupyter_kernel_gateway is not installed: pip install -e '.[bench]'") from exc
    port = free_port()
    log = workdir / ("kernel_gateway.log" if nodelay else "kernel_gateway_nagle.log")
    env = {
        **os.environ,
        "JUPYTER_RUNTIME_DIR": str(workdir / "runtime"),
        "JUPYTER_DATA_DIR": str(workdir / "data"),
        "JUPYTER_CONFIG_DIR": str(workdir / "config"),
        "IPYTHONDIR": str(workdir / "ipython"),
        "MPLBACKEND": "Agg",
    }
    module = ["-m", "benchmarks.kg_nodelay"] if nodelay else ["-m", "kernel_gateway"]
    cmd = [
        sys.executable,
        *module,
        "--KernelGatewayApp.ip=127.0.0.1",
        f"--KernelGatewayApp.port={port}",
        "--KernelGatewayApp.port_retries=0",
    ]

    def spawn() -> subprocess.Popen[bytes]:  # file and process calls block: off the event loop
        workdir.mkdir(parents=True, exist_ok=True)
        with open(log, "wb") as fh:
            return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=fh)

    proc = await asyncio.to_thread(spawn)
    gateway = KernelGateway(proc, port, log, nodelay)
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None:
            raise BenchError(f"kernel gateway exited {proc.returncode}:\n{log.read_text()[-2000:]}")
        try:
            await asyncio.to_thread(gateway._http, "GET", "/api")
            break
        except OSError:
            if time.monotonic() > deadline:
                await gateway.close()
                raise BenchError(f"kernel gateway did not start:\n{log.read_text()[-2000:]}") from None
            await asyncio.sleep(0.1)
    await gateway.open_kernel()
    return gateway


def _peer_nodelay(pid: int, server_port: int, client_port: int) -> bool:
    """TCP_NODELAY of the gateway's socket for our connection, read through pidfd_getfd."""
    inodes = _tcp_inodes(server_port, client_port)
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = os.pidfd_open(pid)
    try:
        for fd_name in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd_name}")
            except OSError:
                continue
            if not target.startswith("socket:[") or target[8:-1] not in inodes:
                continue
            dup = libc.syscall(SYS_PIDFD_GETFD, pidfd, int(fd_name), 0)
            if dup < 0:
                raise BenchError(f"pidfd_getfd failed: {os.strerror(ctypes.get_errno())}")
            sock = socket.socket(fileno=dup)
            try:
                return bool(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            finally:
                sock.detach()
                os.close(dup)
    finally:
        os.close(pidfd)
    raise BenchError("could not find the gateway's end of the benchmark connection")


def _tcp_inodes(local_port: int, remote_port: int) -> set[str]:
    """Socket inodes of loopback TCP connections local_port -> remote_port (/proc/net/tcp*)."""
    found: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            lport = int(parts[1].rsplit(":", 1)[1], 16)
            rport = int(parts[2].rsplit(":", 1)[1], 16)
            if lport == local_port and rport == remote_port:
                found.add(parts[9])
    return found
