"""SANDBOX_OPEN_PORTS: real jails reaching (or not) test hosts in a network namespace the test makes.

Topology (all made here, removed afterwards; nothing outside this machine is ever addressed):

    host netns: atv<tag>  198.18.K.1/29, 10.77.K.1/30   (+ route 169.254.169.254/32)
        |  veth
    aptest-<tag>: eth0    198.18.K.2/29, 198.18.K.3/29, 10.77.K.2/30, 169.254.169.254/32
                  a TCP server on ports A and B, a UDP echo on 53 (every address)

A is open (SANDBOX_OPEN_PORTS), B is not. Every refusal is paired with a control that
shows the target does answer from the host, so a missing filter makes the test fail.
"""

from __future__ import annotations

import json
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from appliance_client.client import AsyncClient
from tests.support import Server, scaled, start_server

TOKEN = "egress-test-token-" + secrets.token_hex(8)

REMOTE_SERVER = r"""
import socket, sys, threading
def tcp(port):
    srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", port)); srv.listen(64)
    while True:
        conn, _ = srv.accept()
        conn.sendall(("hello %s:%d\n" % (conn.getsockname()[0], port)).encode()); conn.close()
def udp(port):
    srv = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); srv.bind(("0.0.0.0", port))
    while True:
        data, peer = srv.recvfrom(512); srv.sendto(b"echo " + data, peer)
for p in sys.argv[1:]:
    threading.Thread(target=tcp, args=(int(p),), daemon=True).start()
threading.Thread(target=udp, args=(53,), daemon=True).start()
print("up", flush=True)
threading.Event().wait()
"""

# Runs in the jail: TARGETS is spliced in by the test (test data, not user input).
PROBE = r"""
import json, socket
def tcp(host, port):
    s = socket.socket(); s.settimeout(3)
    try:
        s.connect((host, port))
    except OSError as exc:
        s.close(); return type(exc).__name__
    try:
        s.settimeout(1); return s.recv(100).decode().strip() or "connected"
    except OSError:
        return "connected"  # connected, silent peer
    finally:
        s.close()
def udp(host, port):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(3)
    try:
        s.connect((host, port)); s.send(b"q"); return s.recv(100).decode()
    except OSError as exc:
        return type(exc).__name__
    finally:
        s.close()
out = {}
for proto, host, port in TARGETS:
    out["%s:%s:%d" % (proto, host, port)] = (tcp if proto == "tcp" else udp)(host, port)
print(json.dumps(out))
"""

# Cloud metadata services, each given to the fake remote so that only the blocklist stops a
# run: AWS/GCP/Azure IMDS, Azure WireServer, Alibaba Cloud.
METADATA = ("169.254.169.254", "168.63.129.16", "100.100.100.200")


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, check=check, timeout=30)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        return int(s.getsockname()[1])


@dataclass
class Remote:
    ns: str
    k: int
    port_open: int  # A: listed in SANDBOX_OPEN_PORTS
    port_closed: int  # B: not listed
    host_listener: socket.socket  # the host itself listening on 0.0.0.0:A

    @property
    def public(self) -> str:
        return f"198.18.{self.k}.2"

    @property
    def public2(self) -> str:
        return f"198.18.{self.k}.3"

    @property
    def private(self) -> str:
        return f"10.77.{self.k}.2"

    @property
    def private_net(self) -> str:
        return f"10.77.{self.k}.0/30"

    @property
    def host_side(self) -> str:
        return f"198.18.{self.k}.1"


def _routed_via(address: str, dev: str) -> bool:
    out = sh("ip", "-j", "route", "get", address, check=False)
    return out.returncode == 0 and json.loads(out.stdout)[0].get("dev") == dev


@pytest.fixture(scope="module")
def remote() -> Iterator[Remote]:
    tag = secrets.token_hex(3)
    ns, hv = f"aptest-{tag}", f"atv{tag}"
    used = sh("ip", "-4", "route", "show", "table", "all").stdout
    k = next(i for i in range(11, 250) if f"198.18.{i}." not in used and f"10.77.{i}." not in used)
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("0.0.0.0", 0))
    listener.listen(16)
    port_open = int(listener.getsockname()[1])
    port_closed = free_port()
    proc: subprocess.Popen[str] | None = None
    try:
        for argv in (
            ["ip", "netns", "add", ns],
            ["ip", "link", "add", hv, "type", "veth", "peer", "name", "eth0", "netns", ns],
            ["ip", "addr", "add", f"198.18.{k}.1/29", "dev", hv],
            ["ip", "addr", "add", f"10.77.{k}.1/30", "dev", hv],
            ["ip", "link", "set", hv, "up"],
            *(["ip", "route", "add", f"{m}/32", "dev", hv, "src", f"198.18.{k}.1"] for m in METADATA),
            ["ip", "-n", ns, "link", "set", "lo", "up"],
            ["ip", "-n", ns, "addr", "add", f"198.18.{k}.2/29", "dev", "eth0"],
            ["ip", "-n", ns, "addr", "add", f"198.18.{k}.3/29", "dev", "eth0"],
            ["ip", "-n", ns, "addr", "add", f"10.77.{k}.2/30", "dev", "eth0"],
            *(["ip", "-n", ns, "addr", "add", f"{m}/32", "dev", "eth0"] for m in METADATA),
            ["ip", "-n", ns, "link", "set", "eth0", "up"],
        ):
            sh(*argv)
        # Never let a probe leave the machine: every test address must route into our veth.
        for address in (f"198.18.{k}.2", f"198.18.{k}.3", f"10.77.{k}.2", *METADATA):
            assert _routed_via(address, hv), f"{address} does not route via {hv}"
        proc = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                ns,
                sys.executable,
                "-c",
                REMOTE_SERVER,
                str(port_open),
                str(port_closed),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
        yield Remote(ns=ns, k=k, port_open=port_open, port_closed=port_closed, host_listener=listener)
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        listener.close()
        for m in METADATA:
            sh("ip", "route", "del", f"{m}/32", "dev", hv, check=False)
        sh("ip", "link", "del", hv, check=False)
        sh("ip", "netns", "del", ns, check=False)


def host_connect(host: str, port: int) -> str:
    """The control: what the host itself gets from host:port (proves the target answers)."""
    with socket.create_connection((host, port), timeout=3) as s:
        s.settimeout(1)
        try:
            return s.recv(100).decode().strip() or "connected"
        except TimeoutError:
            return "connected"


def egress_server(tmp: Path, remote: Remote, subnet_octet: int, **env: str) -> tuple[Server, int]:
    """A server on 0.0.0.0:P (token-protected) whose own port P is open too: the jail must still not reach it."""
    port = free_port()
    srv = start_server(
        tmp,
        host="0.0.0.0",
        port=port,
        SANDBOX_AUTH_TOKEN=TOKEN,
        SANDBOX_EGRESS_SUBNET=f"10.216.{subnet_octet}.0/24",
        settings={"SANDBOX_OPEN_PORTS": f"{remote.port_open},{port}", **env},
    )
    return srv, port


async def probe(server: Server, targets: list[tuple[str, str, int]]) -> dict[str, str]:
    code = PROBE.replace("TARGETS", json.dumps(targets))
    async with AsyncClient(server.url, token=TOKEN) as c:
        ex = await c.execute(code, timeout_ms=60000)
    assert ex.status == "ok", (ex.status, ex.stderr, ex.stdout)
    return dict(json.loads(ex.stdout))


def reached(answer: str) -> bool:
    return answer.startswith(("hello", "echo", "connected"))


@pytest.fixture(scope="module")
def open_server(tmp_path_factory: pytest.TempPathFactory, remote: Remote) -> Iterator[tuple[Server, int]]:
    srv, port = egress_server(tmp_path_factory.mktemp("egress"), remote, remote.k)
    yield srv, port
    srv.stop()


async def test_a_jailed_run_reaches_an_open_port_on_a_test_host(
    open_server: tuple[Server, int], remote: Remote
) -> None:
    srv, _ = open_server
    got = await probe(srv, [("tcp", remote.public, remote.port_open)])
    assert got[f"tcp:{remote.public}:{remote.port_open}"] == f"hello {remote.public}:{remote.port_open}"


async def test_a_port_not_listed_is_refused_though_the_host_answers_on_it(
    open_server: tuple[Server, int], remote: Remote
) -> None:
    srv, _ = open_server
    assert host_connect(remote.public, remote.port_closed).startswith("hello")
    got = await probe(srv, [("tcp", remote.public, remote.port_closed)])
    assert got[f"tcp:{remote.public}:{remote.port_closed}"] == "ConnectionRefusedError"


async def test_private_and_metadata_addresses_are_refused_on_an_open_port(
    open_server: tuple[Server, int], remote: Remote
) -> None:
    srv, _ = open_server
    for target in (remote.private, *METADATA):
        assert host_connect(target, remote.port_open).startswith("hello"), target
    got = await probe(
        srv,
        [
            ("tcp", remote.private, remote.port_open),
            *(("tcp", m, remote.port_open) for m in METADATA),
            ("tcp", "169.254.169.254", 80),
        ],
    )
    assert not any(reached(v) for v in got.values()), got


async def test_the_host_and_the_appliances_own_port_are_unreachable_though_open(
    open_server: tuple[Server, int], remote: Remote
) -> None:
    srv, port = open_server
    # Controls: the host answers on the open port A and serves the appliance on P.
    assert host_connect(remote.host_side, remote.port_open) == "connected"
    status, _ = srv.get("/healthz")
    assert status == 200
    host_addrs = json.loads(sh("ip", "-j", "-4", "addr", "show").stdout)
    addresses = sorted({a["local"] for link in host_addrs for a in link["addr_info"]} - {"127.0.0.1"})
    targets = [("tcp", a, p) for a in addresses for p in (remote.port_open, port)]
    got = await probe(srv, [*targets, ("tcp", "127.0.0.1", port)])
    assert not any(reached(v) for v in got.values()), got
    assert srv.get("/readyz")[0] == 200  # the canary proves the same before every /readyz


async def test_ipv6_and_dns_are_closed_when_53_is_not_listed(
    open_server: tuple[Server, int], remote: Remote
) -> None:
    srv, _ = open_server
    got = await probe(srv, [("udp", remote.public, 53)])
    assert not reached(got[f"udp:{remote.public}:53"]), got
    code = (
        "import socket, os\nprint(sorted(n for _, n in socket.if_nameindex()))\n"
        "print(os.path.exists('/etc/resolv.conf'))\n"
        "s = socket.socket(socket.AF_INET6); s.settimeout(2)\n"
        "try:\n    s.connect(('fe80::1%eth0', 80)); print('v6 connected')\n"
        "except OSError as e:\n    print('v6', type(e).__name__)\n"
    )
    async with AsyncClient(srv.url, token=TOKEN) as c:
        ex = await c.execute(code)
    lines = ex.stdout.splitlines()
    assert lines[0] == "['eth0', 'lo']" and lines[1] == "False" and lines[2] != "v6 connected", ex.stdout


async def test_jailed_code_cannot_flush_its_filter(open_server: tuple[Server, int], remote: Remote) -> None:
    srv, _ = open_server
    flush = (
        "import subprocess\n"
        "for argv in (['/usr/sbin/nft', 'flush', 'ruleset'], ['/usr/sbin/iptables', '-F']):\n"
        "    try:\n"
        "        subprocess.run(argv, capture_output=True)\n"
        "    except OSError:\n"
        "        pass\n"
    )
    code = flush + PROBE.replace("TARGETS", json.dumps([("tcp", remote.public, remote.port_closed)]))
    async with AsyncClient(srv.url, token=TOKEN) as c:
        ex = await c.execute(code)
    got = json.loads(ex.stdout.splitlines()[-1])
    assert got[f"tcp:{remote.public}:{remote.port_closed}"] == "ConnectionRefusedError", ex.stdout


async def test_an_allowed_private_network_and_a_named_resolver_open_exactly_that(
    tmp_path: Path, remote: Remote
) -> None:
    srv, _ = egress_server(
        tmp_path,
        remote,
        (remote.k + 101) % 250 + 1,
        SANDBOX_OPEN_PORTS=f"{remote.port_open},53",
        SANDBOX_EGRESS_ALLOW_NETS=remote.private_net,
        SANDBOX_EGRESS_DNS=remote.public,
    )
    try:
        got = await probe(
            srv,
            [
                ("tcp", remote.private, remote.port_open),  # allowed network, open port
                ("tcp", remote.private, remote.port_closed),  # allowed network, closed port
                ("udp", remote.public, 53),  # the named resolver
                ("udp", remote.public2, 53),  # any other DNS server
                ("tcp", "169.254.169.254", remote.port_open),  # still not allowed
            ],
        )
        assert got[f"tcp:{remote.private}:{remote.port_open}"].startswith("hello"), got
        assert not reached(got[f"tcp:{remote.private}:{remote.port_closed}"]), got
        assert got[f"udp:{remote.public}:53"] == "echo q", got
        assert not reached(got[f"udp:{remote.public2}:53"]), got
        assert not reached(got[f"tcp:169.254.169.254:{remote.port_open}"]), got
        async with AsyncClient(srv.url, token=TOKEN) as c:
            ex = await c.execute("print(open('/etc/resolv.conf').read())")
        assert f"nameserver {remote.public}" in ex.stdout
    finally:
        srv.stop()


def test_shutdown_removes_every_namespace_link_and_table(tmp_path: Path, remote: Remote) -> None:
    srv, _ = egress_server(tmp_path, remote, (remote.k + 51) % 250 + 1)
    table = next(
        line.split()[-1]
        for line in sh("nft", "list", "tables").stdout.splitlines()
        if "appliance_0ad8" in line and f"{(remote.k + 51) % 250 + 1:02x}00" in line
    )
    prefix = f"sbx-{table.removeprefix('appliance_')}-"
    assert any(n.startswith(prefix) for n in sh("ip", "netns", "list").stdout.split())
    assert srv.stop() == 0
    deadline = time.monotonic() + scaled(10)
    while any(n.startswith(prefix) for n in sh("ip", "netns", "list").stdout.split()):
        assert time.monotonic() < deadline, "jail namespaces left after shutdown"
        time.sleep(0.1)
    assert table not in sh("nft", "list", "tables").stdout
    assert f"sx{table.removeprefix('appliance_')}" not in sh("ip", "-br", "link").stdout


def test_startup_refuses_a_subnet_that_overlaps_a_host_route(tmp_path: Path, remote: Remote) -> None:
    with pytest.raises(RuntimeError, match="overlaps"):
        start_server(
            tmp_path,
            SANDBOX_OPEN_PORTS=str(remote.port_open),
            SANDBOX_EGRESS_SUBNET=f"198.18.{remote.k}.0/24",
        )
