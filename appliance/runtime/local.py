"""Start a real appliance (`python -m appliance serve`) as a subprocess and reach it over HTTP.

The one way the test suite, the benchmarks and users' own integration tests start a
server: a separate process on a loopback port, real firejail jails, the settings given
as SANDBOX_* variables (none inherited from the caller's environment, so a developer's
shell cannot change what a test measures).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path


class ServerStartError(RuntimeError):
    """The server exited, never wrote its port, or never became ready; the log tail says why."""


@dataclass
class LocalServer:
    """A running appliance subprocess and where to reach it."""

    proc: subprocess.Popen[bytes]
    port: int
    log: Path
    env: dict[str, str]

    @property
    def url(self) -> str:
        """The WebSocket endpoint."""
        return f"ws://127.0.0.1:{self.port}/exec"

    @property
    def http(self) -> str:
        """The HTTP base address."""
        return f"http://127.0.0.1:{self.port}"

    def get(self, path: str, token: str | None = None) -> tuple[int, str]:
        """(status, body text) of a GET; HTTP errors included, not raised."""
        return self.request("GET", path, token)

    def request(  # noqa: PLR0913 (an HTTP request's parts, keyword options with defaults)
        self,
        method: str,
        path: str,
        token: str | None = None,
        body: object = None,
        timeout: float = 10,
        headers: Mapping[str, str] | None = None,
    ) -> tuple[int, str]:
        """(status, body text) of a plain HTTP call; a JSON body is sent as application/json."""
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.http + path, data=data, method=method)  # noqa: S310 (http:// by construction)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        for name, value in (headers or {}).items():
            req.add_header(name, value)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 (as above)
                return int(resp.status), resp.read().decode()
        except urllib.error.HTTPError as exc:
            return int(exc.code), exc.read().decode()

    def logs(self) -> str:
        """The server's whole stderr log so far."""
        return self.log.read_text(errors="replace")

    def stop(self, sig: int = 15, timeout: float = 30) -> int:
        """Signal the server (SIGTERM: a graceful drain), KILL it if it hangs; its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start(  # noqa: C901, PLR0913 (the server's launch options, keyword-only with defaults)
    workdir: Path,
    env: Mapping[str, str],
    *,
    name: str = "server",
    host: str = "127.0.0.1",
    port: int = 0,
    wrap: Sequence[str] = (),
    wait_ready: bool = True,
    wait_started: bool = True,
    timeout_s: float = 90,
    cwd: Path | None = None,
) -> LocalServer:
    """Start `appliance serve` with exactly these SANDBOX_* settings; wait for /readyz.

    The caller's own SANDBOX_* variables are dropped; SANDBOX_PYTHON defaults to this
    interpreter. `wrap` prefixes the command (e.g. `unshare ...`). wait_started=False
    (a fixed `port` only) returns at once, while the server still starts; wait_ready=False
    returns once it listens. Raises ServerStartError with the log's tail otherwise.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    ready = workdir / f"{name}.port"
    ready.unlink(missing_ok=True)  # a reused directory must not hand us an old port
    log = workdir / f"{name}.log"
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SANDBOX_")}
    full_env["SANDBOX_PYTHON"] = sys.executable
    full_env.update(env)
    cmd = [
        *wrap,
        sys.executable,
        "-m",
        "appliance",
        "serve",
        "--host",
        host,
        "--port",
        str(port),
        "--ready-file",
        str(ready),
    ]
    with open(log, "wb") as log_fh:
        # S603: our interpreter and `appliance serve`
        proc = subprocess.Popen(cmd, env=full_env, stdout=subprocess.DEVNULL, stderr=log_fh, cwd=cwd)  # noqa: S603
    if not wait_started:
        if not port:
            proc.kill()
            proc.wait()
            raise ValueError("wait_started=False needs a fixed port")
        return LocalServer(proc, port, log, full_env)
    try:
        deadline = time.monotonic() + timeout_s
        while not ready.exists() or not ready.read_text().strip():
            if proc.poll() is not None:
                raise ServerStartError(f"{name}: server exited {proc.returncode}:\n{_tail(log)}")
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                raise ServerStartError(f"{name}: server did not start:\n{_tail(log)}")
            time.sleep(0.05)
        server = LocalServer(proc, int(ready.read_text()), log, full_env)
        while wait_ready:
            try:
                status, body = server.get("/readyz")
            except OSError as exc:
                raise ServerStartError(f"{name}: server unreachable ({exc}):\n{_tail(log)}") from exc
            if status == 200:
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise ServerStartError(f"{name}: server never became ready ({body[:500]}):\n{_tail(log)}")
            time.sleep(0.1)
    except BaseException:
        # Failed, or interrupted while it starts (Ctrl-C, a SIGTERM the caller turned into an
        # exception): never leave a half-started server behind.
        LocalServer(proc, port, log, full_env).stop()
        raise
    return server


def _tail(log: Path, chars: int = 4000) -> str:
    return log.read_text(errors="replace")[-chars:]
