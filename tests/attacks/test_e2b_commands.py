"""E2B's commands and port proxy under abuse, against a real server and real jails: daemons
that try to outlive their sandbox, a cell's leftover hiding behind a running command, an
output flood to a client that never reads, another tenant's sandbox through the proxy, and
a way to the host through it."""

from __future__ import annotations

import json
import os
import secrets
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from e2b_code_interpreter import Sandbox

from tests.attacks.common import AWS_SECRET, attack
from tests.support import Server, start_server
from tests.test_e2b_sdk import ALICE, BOB, point_sdk, tenants_file, until

Observe = Callable[[str], None]
STALL_MS = 1000
FLOOD_BYTES = 64 * 1024 * 1024


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("e2b-commands-attacks")
    srv = start_server(
        tmp,
        SANDBOX_AUTH_TOKENS_FILE=str(tenants_file(tmp)),
        SANDBOX_POOL_SIZE="1",
        SANDBOX_CLIENT_STALL_MS=str(STALL_MS),
        AWS_SECRET_ACCESS_KEY=AWS_SECRET,
    )
    yield srv
    srv.stop()


@pytest.fixture(autouse=True)
def sdk_env(target: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    point_sdk(monkeypatch, target)


@pytest.fixture(scope="module")
def shared(target: Server) -> Iterator[Sandbox]:
    mp = pytest.MonkeyPatch()
    point_sdk(mp, target)
    sb = Sandbox.create()
    yield sb
    sb.kill()
    mp.undo()


def marked(marker: str) -> list[int]:
    """Host PIDs of processes whose command line holds `marker` (the test runs as root)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
        except OSError:
            continue
        if marker.encode() in cmdline:
            found.append(int(name))
    return found


def peak_rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def serve_in(sb: Sandbox, port: int) -> None:
    sb.commands.run(f"python -m http.server {port} --bind 127.0.0.1", background=True)


def by_headers(srv: Server, sandbox_id: str, token: str, port: int) -> httpx.Response:
    return httpx.get(
        srv.http + "/e2b/",
        headers={"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": str(port), "X-Access-Token": token},
        timeout=10,
    )


def by_host(srv: Server, sandbox_id: str, token: str, port: int) -> httpx.Response:
    return httpx.get(
        srv.http + "/",
        headers={"Host": f"{port}-{sandbox_id}.e2b.app", "E2B-Traffic-Access-Token": token},
        timeout=10,
    )


@attack(
    "a command forks a daemon (setsid, double fork) and the sandbox is killed",
    "every process of the sandbox ends with it; the daemon does not survive",
)
def test_a_daemon_dies_with_its_sandbox(target: Server, observe: Observe) -> None:
    sb = Sandbox.create()
    marker = f"9999.{secrets.randbelow(10**9)}"
    sb.commands.run(f"setsid sh -c 'sleep {marker}' </dev/null >/dev/null 2>&1 & exit 0")
    sb.commands.run(
        f"python -c \"import os; os.fork() or (os.setsid(), os.fork() or os.execvp('sleep', ['sleep', '{marker}1']))\""
    )
    assert until(lambda: len(marked(marker)) >= 2), "the daemons did not start"
    # The command that started them has ended; they run on, in the sandbox's jail.
    survivors_before = len(marked(marker))
    sb.kill()
    assert until(lambda: not marked(marker)), f"daemons outlived their sandbox: {marked(marker)}"
    observe(f"{survivors_before} daemons running before the kill, none after")


@attack(
    "a cell leaves a process behind while a command runs (so the jail is not frozen between cells)",
    "the cell's leftover is killed at its end, as in any session; the command's processes run on",
)
def test_a_cells_leftover_is_killed_even_beside_a_running_command(shared: Sandbox, observe: Observe) -> None:
    keep = f"8888.{secrets.randbelow(10**9)}"
    leftover = f"7777.{secrets.randbelow(10**9)}"
    shared.commands.run(f"sleep {keep}", background=True)
    assert until(lambda: bool(marked(keep)))
    shared.run_code(f"import subprocess; subprocess.Popen(['sleep', '{leftover}'], start_new_session=True)")
    assert until(lambda: not marked(leftover)), "a cell's leftover survived its cell"
    assert marked(keep), "the command's own process was killed with the cell's leftovers"
    observe("the cell's leftover was killed at the cell's end; the command's process lives")


@attack(
    "a command floods stdout to a Start stream whose client never reads",
    "the server's memory stays bounded (the command blocks, then the stalled stream is cut)",
)
def test_an_output_flood_to_a_client_that_never_reads(
    target: Server, shared: Sandbox, observe: Observe
) -> None:
    before = peak_rss_kb(target.proc.pid)
    tag = f"sleep 0.{secrets.randbelow(10**6)}1"

    def flooding() -> bool:
        return any(tag in " ".join(p.args) for p in shared.commands.list())

    payload = json.dumps(
        {
            "process": {
                "cmd": "/bin/bash",
                "args": ["-c", f"head -c {FLOOD_BYTES} /dev/zero; {tag}"],
            }
        }
    ).encode()
    body = b"\x00" + len(payload).to_bytes(4, "big") + payload
    head = (
        "POST /e2b/process.Process/Start HTTP/1.1\r\n"
        f"Host: 127.0.0.1:{target.port}\r\n"
        "Content-Type: application/connect+json\r\n"
        "Connect-Protocol-Version: 1\r\n"
        f"E2b-Sandbox-Id: {shared.sandbox_id}\r\n"
        "E2b-Sandbox-Port: 49983\r\n"
        f"X-Access-Token: {shared._envd_access_token}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", target.port))
    try:
        sock.sendall(head + body)  # and never read a byte of the reply
        assert until(flooding, 10), "the flood did not start"
        # Cut after the stall limit, the stream lets go; the command's output is then read and
        # dropped, and it ends.
        assert until(lambda: not flooding(), 60), "the flooding command never ended"
    finally:
        sock.close()
    grown_mb = (peak_rss_kb(target.proc.pid) - before) / 1024
    assert grown_mb < FLOOD_BYTES / (1024 * 1024) / 2, f"the server's peak memory grew {grown_mb:.0f} MiB"
    assert shared.commands.run("echo still-here").stdout == "still-here\n"
    observe(
        f"{FLOOD_BYTES >> 20} MiB written to a client that never read; server peak grew {grown_mb:.1f} MiB"
    )


@attack(
    "the port proxy asked for another tenant's sandbox (its id with our token, our id with its token)",
    "404, the same as a sandbox that does not exist; nothing reaches its server",
)
def test_the_port_proxy_refuses_another_tenants_sandbox(
    target: Server, shared: Sandbox, observe: Observe
) -> None:
    serve_in(shared, 8301)
    token = str(shared.traffic_access_token)
    assert until(lambda: by_host(target, shared.sandbox_id, token, 8301).status_code == 200)
    mp = pytest.MonkeyPatch()
    point_sdk(mp, target, BOB)
    try:
        theirs = Sandbox.create()
        try:
            their_token = str(theirs.traffic_access_token)
            answers = [
                by_host(target, shared.sandbox_id, their_token, 8301).status_code,
                by_headers(target, shared.sandbox_id, their_token, 8301).status_code,
                by_host(target, theirs.sandbox_id, token, 8301).status_code,
                by_headers(target, shared.sandbox_id, "", 8301).status_code,
                by_host(target, "0" * 20, token, 8301).status_code,
            ]
        finally:
            theirs.kill()
    finally:
        mp.undo()
    assert answers == [404] * len(answers)
    observe(f"answers: {answers}")


@attack(
    "through the port proxy, reach the host: the appliance's own port, the host's loopback",
    "only the jail's own loopback is reached: the host's ports are not there (502)",
)
def test_the_port_proxy_reaches_nothing_of_the_host(
    target: Server, shared: Sandbox, observe: Observe
) -> None:
    serve_in(shared, 8302)
    token = str(shared.traffic_access_token)
    assert until(lambda: by_host(target, shared.sandbox_id, token, 8302).status_code == 200)
    # The appliance listens on the host's 127.0.0.1:PORT; the proxy's socket is in the jail.
    host_port = by_headers(target, shared.sandbox_id, token, target.port)
    also = by_host(target, shared.sandbox_id, token, target.port)
    assert host_port.status_code == 502, host_port.text
    assert also.status_code == 502, also.text
    # From inside, a command cannot reach the host's port either.
    probe = shared.commands.run(
        f"python -c \"import socket; s=socket.socket(); s.settimeout(3); print(s.connect_ex(('127.0.0.1', {target.port})))\""
    )
    assert probe.stdout.strip() != "0"
    # And nothing of the server's environment is in a command's.
    env = shared.commands.run("env").stdout
    assert AWS_SECRET not in env and ALICE not in env
    observe(f"host port via proxy: {host_port.status_code}; connect from inside: {probe.stdout.strip()}")
