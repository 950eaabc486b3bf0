"""Shared test support: start a real appliance server; look at real processes."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from appliance.jail import proctree

REPO = Path(__file__).resolve().parent.parent
SANDBOX_UID = 1001
# Timeouts scale with the machine: CI boxes are small and noisy.
SCALE = float(os.environ.get("APPLIANCE_TEST_TIMEOUT_SCALE", "1"))


def scaled(seconds: float) -> float:
    return seconds * SCALE


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path
    env: dict[str, str]

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/exec"

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def get(self, path: str, token: str | None = None) -> tuple[int, str]:
        return self.request("GET", path, token)

    def request(self, method: str, path: str, token: str | None = None, body: object = None,
                timeout: float = 10) -> tuple[int, str]:
        """(status, body text) of a plain HTTP call, errors included."""
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.http + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def logs(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self, sig: int = 15, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_server(tmp: Path, wrap: list[str] | None = None, wait_ready: bool = True,
                 host: str = "127.0.0.1", port: int = 0, wait_started: bool = True, **env: str) -> Server:
    """Start `appliance serve` on a free port with SANDBOX_* overrides; wait for /readyz.

    wait_started=False (a fixed `port` only) returns at once, while the server still starts."""
    tmp.mkdir(parents=True, exist_ok=True)
    ready = tmp / "port"
    ready.unlink(missing_ok=True)  # a reused directory must not hand us an old port
    log = tmp / "server.log"
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SANDBOX_")}
    full_env.update({"SANDBOX_PRELOAD": "", "SANDBOX_POOL_SIZE": "1", "SANDBOX_PYTHON": sys.executable})
    full_env.update(env)
    cmd = [sys.executable, "-m", "appliance", "serve", "--host", host, "--port", str(port),
           "--ready-file", str(ready)]
    with open(log, "wb") as log_fh:
        proc = subprocess.Popen((wrap or []) + cmd, env=full_env, stdout=subprocess.DEVNULL,
                                stderr=log_fh, cwd=REPO)
    if not wait_started:
        assert port, "wait_started=False needs a fixed port"
        return Server(proc, port, log, full_env)
    deadline = time.monotonic() + scaled(90)
    while not ready.exists() or not ready.read_text().strip():
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}:\n{log.read_text()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"server did not start:\n{log.read_text()}")
        time.sleep(0.05)
    server = Server(proc, int(ready.read_text()), log, full_env)
    if wait_ready:
        while True:
            try:
                status, body = server.get("/readyz")
            except OSError as exc:  # never leave a half-started server behind
                server.stop()
                raise RuntimeError(f"server unreachable ({exc}):\n{log.read_text()}") from exc
            if status == 200:
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                server.stop()
                raise RuntimeError(f"server never became ready ({body}):\n{log.read_text()}")
            time.sleep(0.1)
    return server


def processes_of_uid(uid: int = SANDBOX_UID) -> list[tuple[int, str]]:
    """(pid, command line) of every live process whose real uid is uid."""
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
                if int(line.split()[1]) == uid and "State:\tZ" not in status:
                    found.append((int(entry), cmd))
                break
    return found


def frames_of(raw: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in raw.splitlines() if line.strip()]


def descendants(pid: int) -> list[int]:
    """Every live descendant of pid."""
    return proctree.tree(pid)[1:]


def jail_processes(server: Server, uid: int = SANDBOX_UID, settle_s: float = 5.0) -> list[tuple[int, str]]:
    """Processes of uid under this server, plus any of uid orphaned to the host's init.

    A run's processes are SIGKILLed before its `done` is sent; the kernel may still be
    tearing them down for a moment, so this waits up to settle_s for them to be gone.
    """
    deadline = time.monotonic() + scaled(settle_s)
    while True:
        left = _jail_processes_now(server, uid)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def _jail_processes_now(server: Server, uid: int) -> list[tuple[int, str]]:
    mine = set(descendants(server.proc.pid))
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
        shutil.rmtree(root, ignore_errors=True)
