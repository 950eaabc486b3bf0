"""SandboxFusion's `fetch_files` after a time limit, on a server that is not root.

Such a server runs as the sandbox uid itself (`setpriv` drops a root test to it), cannot
mount, and so gives each run a plain directory, which its jail's end removed with the files a
time-limited program wrote: the run's directory is now held until the files are read
(`Jail.hold_workspace`), and removed then, on every path (a client that goes included).
"""

from __future__ import annotations

import base64
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.support import SANDBOX_UID, Server, reachable_tmp_root, run_root, scaled, start_server, until

# A program that ignores the interrupt its time limit sends first: its interpreter, and with
# it its session and jail, end with the limit.
HANG = (
    "import time\n"
    "def _hang():\n"
    "    while True:\n"
    "        try:\n"
    "            time.sleep(0.05)\n"
    "        except KeyboardInterrupt:\n"
    "            pass\n"
)

# The test drops a root server to the sandbox uid (a suite run as that uid has no other).
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="setpriv to the sandbox uid needs root")


@pytest.fixture(scope="module")
def unprivileged() -> Iterator[tuple[Server, Path]]:
    """A server running as the sandbox uid (not root), and its instance directory."""
    with reachable_tmp_root("fusion-unprivileged-") as root:
        home, tmp_root = root / "server", root / "tmp"
        for path in (home, tmp_root):  # its ready file, and its SANDBOX_TMP_ROOT: its own
            path.mkdir(mode=0o755)
            os.chown(path, SANDBOX_UID, SANDBOX_UID)
        server = start_server(
            home,
            wrap=["setpriv", f"--reuid={SANDBOX_UID}", f"--regid={SANDBOX_UID}", "--clear-groups"],
            SANDBOX_TMP_ROOT=str(tmp_root),
            HOME=str(home),
        )
        try:
            assert "the server is not root" in server.logs()  # plain run directories, no tmpfs
            yield server, run_root(tmp_root, server.proc.pid)
        finally:
            server.stop()


def holding(instance: Path, name: str) -> list[Path]:
    """The run directories of the server that hold `name`."""
    return [d for d in instance.iterdir() if d.is_dir() and (d / name).exists()]


def post(server: Server, path: str, body: dict[str, Any]) -> dict[str, Any]:
    answer: dict[str, Any] = requests.post(server.http + path, json=body, timeout=scaled(60)).json()
    return answer


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_run_code_files_come_back_after_a_time_limit(unprivileged: tuple[Server, Path]) -> None:
    server, instance = unprivileged
    code = HANG + (
        "import os\n"
        # Where the run directories are, held ones included: not in a jail's view (jails of a
        # server that is not root all run as its uid).
        f"print(os.path.exists({str(instance)!r}), flush=True)\n"
        "open('answer.txt', 'w').write('written before the hang')\n"
        "os.symlink('/etc/passwd', 'link.txt')\n"
        "os.mkfifo('pipe')\n"
        "_hang()\n"
    )
    body = post(
        server,
        "/run_code",
        {
            "code": code,
            "language": "python",
            "run_timeout": 1,
            "fetch_files": ["answer.txt", "link.txt", "pipe"],
        },
    )
    assert body["status"] == "Failed", body
    assert body["run_result"]["status"] == "TimeLimitExceeded", body
    assert body["files"] == {"answer.txt": b64(b"written before the hang")}, body
    assert body["run_result"]["stdout"] == "False\n", body
    # The held directory was walked as a root server's tmpfs is: a link and a FIFO are refused.
    assert "'link.txt' not fetched" in body["message"], body
    assert "'pipe' not fetched" in body["message"], body
    # Released before the answer: the directory is gone with the request.
    assert holding(instance, "answer.txt") == []


def test_run_jupyter_files_come_back_after_a_cell_time_limit(unprivileged: tuple[Server, Path]) -> None:
    server, instance = unprivileged
    cells = [HANG, "open('cell.txt', 'w').write('cell answer')\n_hang()", "print('never')"]
    body = post(
        server,
        "/run_jupyter",
        {"cells": cells, "kernel": "python3", "cell_timeout": 1, "fetch_files": ["cell.txt"]},
    )
    assert body["status"] == "Failed", body
    assert body["driver"]["status"] == "TimeLimitExceeded", body
    assert body["files"] == {"cell.txt": b64(b"cell answer")}, body
    assert holding(instance, "cell.txt") == []


def test_a_held_directory_goes_when_the_client_does(unprivileged: tuple[Server, Path]) -> None:
    # The run is cut off by its client's going, its jail ended while its directory is held:
    # the release removes it all the same.
    server, instance = unprivileged
    code = HANG + "open('gone.txt', 'w').write('x')\n_hang()\n"
    body = json.dumps(
        {"code": code, "language": "python", "run_timeout": 600, "fetch_files": ["gone.txt"]}
    ).encode()
    head = (
        f"POST /run_code HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=scaled(30)) as conn:
        conn.sendall(head + body)
        until(lambda: holding(instance, "gone.txt"), 60, "the run wrote its file")
    until(lambda: not holding(instance, "gone.txt"), 60, "the held directory removed after the client went")
    assert server.proc.poll() is None
