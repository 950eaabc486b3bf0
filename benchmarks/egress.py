"""The egress proxy's cost, side by side in one run: the same transfers through the proxy
(names mode) and allowed by IP without it (`SANDBOX_OPEN_PORTS`).

    python -m benchmarks.egress [--quick] [--out DIR]

Two servers share one fake internet (tests/fakenet.py: a namespace on this machine only):
one allows `api.fake.test:80,443` by name, the other port 80 and 443 by address. Each rep
runs the same code in a jail of each, alternately, timing inside the jail (so the run's own
overhead is left out):

- a 1 MiB download over plain HTTP and over HTTPS (through the proxy: a forwarded request,
  and a CONNECT tunnel with its SNI check), the median of several;
- 100 small requests in a row (20 with --quick), each on a new connection (the proxy takes one per connection).

Where a C compiler is found, a third side runs the same code in the address server's jails
through the floor relay (below): the same measurement with the cheapest relay that ends the
jail's TCP connection, as any HTTP proxy must. It runs in a namespace of its own placed as
the proxy is (`relay_box`: reached by IP through the host; its way to the fake internet
crosses the host and the shaped veth), plain HTTP straight through it (FLOOR_PORTS[0]),
HTTPS through its CONNECT mode (FLOOR_PORTS[1], as the jail's urllib's proxy): a head read
and answered "200", then the tunnel, with no parsing and no decision.

The proxy's CPU per flow is the names server's CPU time (utime + stime from /proc) over a
run of small requests less the address server's over the same run, divided by the flows.

Then the same rounds over a modelled link: the fake internet's veth shaped at each rate in
LINKS (tc's token bucket, both ways), which both servers' traffic crosses alike. A real
download crosses such a link, where the proxy's own hop stays local: on the unshaped veth
(loopback speed) a 1 MiB download takes about as long as the proxy's fixed cost per flow,
which is the worst case, not the one users see. This kernel has no sch_netem, so no delay
is added: a delay would add the same round trips to both sides (the proxy's connection
upstream takes the place of the direct connection's handshake), leaving the proxy's cost
the same over a longer whole, so a bandwidth-only link is the harder case for the proxy.

The relay alone: the proxy in this process on loopback (no jail, no server), a client
process fetching 1 MiB over plain HTTP, then over HTTPS (a CONNECT tunnel), from the fake
internet directly, through the proxy relaying by splice(2), and through the proxy relaying
by its stream loop, and through the floor relay, batches alternating; what the proxy itself
adds to a download, with less of a busy host's noise. The floor relay
(benchmarks/floor_relay.c, built with `cc -O2` at the start) is a port forward in C with no
logic: processes forked at the start (none per connection), splice(2) both ways, the
client's bytes exactly as direct's (no CONNECT; TLS straight through it); what any relay
that terminates the client's TCP connection, as an HTTP CONNECT proxy must, adds at the
least. Without a C compiler its figures read n/a. Then batches of small GETs through that
proxy: its CPU per flow (this process's CPU time, the proxy's alone, over a batch), steadier
on a loaded host than the jail-side timings. The relay's downloads run again over each
modelled link (no small flows there), so the floor is known where a download crosses a link.

Writes egress.json and egress.md (quick: egress_quick.*) into --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from ipaddress import IPv4Address, IPv4Network
from pathlib import Path
from typing import Any

from appliance.core.egress import Layers, parse_rules
from appliance.sandbox import egresssplice
from appliance.sandbox.egressproxy import EgressProxy, Scope
from appliance.sandbox.egressresolve import Resolver
from appliance.sandbox.network import EgressPolicy, JailLink
from appliance_client.client import AsyncClient
from benchmarks.appliance_server import REPO, BenchError
from tests.fakenet import DOMAIN, FakeNet, fake_internet, sh
from tests.support import Server, start_server

RESULTS = REPO / "benchmarks" / "results"
LINKS = (1000, 100)  # modelled link rates, Mbit/s each way
LINK_BURST = "64kb"  # the bucket: a few full-size segments at once
LINK_LIMIT = "4mb"  # what may queue at the link: more than a download in flight, so nothing drops
TOKEN = "egress-bench-" + secrets.token_hex(12)
MIB = 1 << 20
# The jail-side floor relays' ports in the relay box (`relay_box`): to port 80, and to 443 as a CONNECT proxy.
FLOOR_PORTS = (8081, 8443)

CODE = r"""
import json, ssl, time, urllib.request
open("/tmp/ca.pem", "w").write(CA_PEM)
ctx = ssl.create_default_context(cafile="/tmp/ca.pem")
if not BY_NAME:
    ctx.check_hostname = False  # addressed by IP: the certificate names the host, not the address
# PROXIES None: the jail's own (its environment's), as urlopen takes them.
handlers = [urllib.request.HTTPSHandler(context=ctx)]
opener = urllib.request.build_opener(*handlers, *([urllib.request.ProxyHandler(PROXIES)] if PROXIES is not None else []))
def get(url):
    with opener.open(url, timeout=30) as r:
        return len(r.read())
def timed(url, n):
    out = []
    for _ in range(n):
        t0 = time.perf_counter(); size = get(url); out.append((time.perf_counter() - t0) * 1000)
        assert size == int(url.rsplit("/", 1)[1]), size
    return out
http_mib = timed(HTTP + "/bytes/%d" % MIB, N_BIG)
https_mib = timed(HTTPS + "/bytes/%d" % MIB, N_BIG)
t0 = time.perf_counter()
for _ in range(N_SMALL):
    get(HTTP + "/bytes/100")
small = (time.perf_counter() - t0) * 1000
print(json.dumps({"http_mib": http_mib, "https_mib": https_mib, "small_total": small}))
"""


# The relay benchmark's client: N GETs of /bytes/SIZE, direct or through the proxy; over
# TLS (CA set) a CONNECT tunnel to NAME:port through the proxy, or TLS to the address direct.
# Through the floor relay (its port as `floor`) it sends direct's bytes to the relay's port.
RELAY_CLIENT = r"""
import json, socket, ssl, sys, time
host, port, proxy, n, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
floor = int(sys.argv[6])
ctx = ssl.create_default_context(cafile=CA) if CA else None
def get():
    s = socket.create_connection(("127.0.0.1", proxy or floor) if proxy or floor else (host, port))
    if ctx is not None:
        if proxy:
            s.sendall(("CONNECT %s:%d HTTP/1.1\r\nHost: %s:%d\r\n\r\n" % (NAME, port, NAME, port)).encode())
            head = b""
            while not head.endswith(b"\r\n\r\n"):
                head += s.recv(1)
            assert head.startswith(b"HTTP/1.1 200"), head
        s = ctx.wrap_socket(s, server_hostname=NAME)
    target = "http://%s/bytes/%d" % (NAME, size) if proxy and ctx is None else "/bytes/%d" % size
    s.sendall(("GET %s HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n" % (target, NAME)).encode())
    f = s.makefile("rb")
    while f.readline() not in (b"\r\n", b""):
        pass
    got = 0
    while got < size:
        chunk = f.read1(262144)
        if not chunk:
            break
        got += len(chunk)
    s.close()
    assert got == size, got
out = []
for _ in range(n):
    t0 = time.perf_counter(); get(); out.append((time.perf_counter() - t0) * 1000)
print(json.dumps(out))
"""


FLOOR_SOURCE = Path(__file__).with_name("floor_relay.c")


def build_floor_relay(folder: Path) -> Path | None:
    """benchmarks/floor_relay.c built into folder (`cc -O2`), or None where there is no C compiler."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    binary = folder / "floor_relay"
    done = subprocess.run(
        [cc, "-O2", "-o", str(binary), str(FLOOR_SOURCE)], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise BenchError(f"cc could not build {FLOOR_SOURCE.name}: {done.stderr.strip()}")
    return binary


@contextmanager
def floor_relay(  # noqa: PLR0913 (where it listens, in which namespace, and as what)
    binary: Path,
    host: str,
    port: int,
    *,
    listen: tuple[str, int] = ("127.0.0.1", 0),
    netns: str | None = None,
    connect: bool = False,
) -> Iterator[int]:
    """The floor relay in front of host:port, listening on `listen` (by default an ephemeral
    loopback port), in the network namespace `netns` if one is named; with `connect`, as a
    CONNECT proxy (each connection's head answered first). Yields the port it got. After, it
    and its workers (a process group of their own) are killed, and waited for until none is
    left."""
    inside = ["ip", "netns", "exec", netns] if netns else []  # ip execs the relay: one process group
    mode = ["--connect"] if connect else []
    proc = subprocess.Popen(
        [*inside, str(binary), *mode, str(listen[1]), host, str(port), listen[0]],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        line = proc.stdout.readline().strip() if proc.stdout else ""
        if not line.isdigit():
            raise BenchError(f"the floor relay did not start (in front of {host}:{port})")
        yield int(line)
    finally:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        deadline = time.monotonic() + 5
        while True:
            try:
                os.killpg(proc.pid, 0)  # a connection process left, or not yet reaped
            except ProcessLookupError:
                break
            if time.monotonic() > deadline:
                raise BenchError(f"the floor relay's processes outlived it (group {proc.pid})")
            time.sleep(0.01)


async def relay(net: FakeNet, reps: int, n: int, n_small: int) -> dict[str, Any]:
    """Direct, splice, stream and the floor relay, alternating batches, over plain HTTP and then
    over HTTPS (a CONNECT tunnel: after its ClientHello, splice relays both ways; the floor
    relay passes TLS straight through); p50 of each in ms (the floor's None without a C
    compiler). Then batches of small GETs through the proxy: its CPU per flow is this
    process's CPU time over a batch (nothing else runs in it then) divided by the flows, with
    no jail or server around it."""
    name, net_dns, public, ca = f"api.{DOMAIN}", net.dns, net.public, str(net.ca)
    policy = EgressPolicy(
        ports=(80,),
        allow_nets=(),
        dns=(IPv4Address(net_dns),),
        subnet=IPv4Network("10.223.0.0/24"),
        host_addresses=(),
        proxy_port=0,  # an ephemeral port on loopback
    )
    layers = Layers(parse_rules([f"{name}:80", f"{name}:443"], "benchmark"))
    proxy = EgressProxy(policy, layers, Resolver([net_dns]), 60.0)
    link = JailLink(0, "bench", "bench", IPv4Address("127.0.0.1"), IPv4Address("127.0.0.1"))
    await proxy.listen(link)
    port = proxy._jails[0].listener.getsockname()[1]

    async def client(  # noqa: PLR0913 (the floor relay's port beside the proxy's)
        code: str, far_port: int, via: int, count: int, size: int, floor: int = 0
    ) -> tuple[list[float], float]:
        """The client's timings, and this process's CPU meanwhile (the proxy's then) in ms
        per flow, from the client's start (its spawning left out) to its end."""
        argv = [sys.executable, "-c", code, public, *map(str, (far_port, via, count, size, floor))]
        proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE)
        before = time.process_time()
        out, _ = await proc.communicate()
        cpu_ms = (time.process_time() - before) * 1000 / count
        if proc.returncode != 0:
            raise BenchError(f"the relay client failed ({far_port}, via {via}, floor {floor})")
        return list(json.loads(out)), cpu_ms

    codes = {
        "http": f"NAME = {name!r}\nCA = None\n" + RELAY_CLIENT,
        "https": f"NAME = {name!r}\nCA = {ca!r}\n" + RELAY_CLIENT,
    }
    floor_dir = tempfile.TemporaryDirectory(prefix="floor-relay-")
    relays = ExitStack()
    try:
        binary = build_floor_relay(Path(floor_dir.name))
        # One floor relay per far port, for all the batches: {far port: the relay's port}.
        floors = (
            {far: relays.enter_context(floor_relay(binary, public, far)) for far in (80, 443)}
            if binary
            else {}
        )
        got: dict[str, dict[str, list[float]]] = {
            scheme: {mode: [] for mode in ("direct", "splice", "stream", *(("floor",) if floors else ()))}
            for scheme in ("http", "https")
        }
        cpu: dict[str, dict[str, list[float]]] = {scheme: {"splice": [], "stream": []} for scheme in got}
        for scheme, far_port in (("http", 80), ("https", 443)):
            for rep in range(reps):
                modes = got[scheme]
                for mode in list(modes) if rep % 2 == 0 else list(reversed(modes)):
                    egresssplice.ENABLED = mode == "splice"
                    proxy.begin(link, Scope(layers, "benchmark"))
                    via = port if mode in ("splice", "stream") else 0
                    floor = floors[far_port] if mode == "floor" else 0
                    times, used = await client(codes[scheme], far_port, via, n, MIB, floor)
                    modes[mode] += times
                    if mode in cpu[scheme]:
                        cpu[scheme][mode].append(used)
        egresssplice.ENABLED = True
        cpu_ms: list[float] = []
        for _ in range(reps if n_small else 0):
            proxy.begin(link, Scope(layers, "benchmark"))
            cpu_ms.append((await client(codes["http"], 80, port, n_small, 100))[1])
    finally:
        egresssplice.ENABLED = True
        relays.close()
        floor_dir.cleanup()
        await proxy.close()
    p50s: dict[str, dict[str, float | None]] = {
        scheme: {mode: _p50(v) for mode, v in modes.items()} for scheme, modes in got.items()
    }
    for p50 in p50s.values():
        p50.setdefault("floor", None)  # no C compiler: no floor, and no figure in its place
    return p50s["http"] | {
        "https": p50s["https"],
        "mib_cpu_ms_per_flow": {
            scheme: {mode: _p50(v) for mode, v in c.items()} for scheme, c in cpu.items()
        },
        "n": len(got["http"]["direct"]),
        "small_cpu_ms_per_flow": round(_p50(cpu_ms), 3) if cpu_ms else None,
        "small_flows": n_small * reps,
    }


def _commit() -> str:
    out = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=False
    )
    return out.stdout.strip() or "unknown"


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _run(server: Server, code: str) -> tuple[dict[str, Any], float]:
    before = _cpu_s(server.proc.pid)
    async with AsyncClient(server.url, token=TOKEN) as c:
        ex = await c.execute(code, timeout_ms=300000)
    if ex.status != "ok":
        raise BenchError(f"the benchmark run ended {ex.status}: {ex.error} {ex.stderr[-2000:]}")
    return json.loads(ex.stdout.splitlines()[-1]), _cpu_s(server.proc.pid) - before


def _code(  # noqa: PLR0913 (the jail code's parameters)
    ca: str,
    by_name: bool,
    hosts: tuple[str, str],
    n_big: int,
    n_small: int,
    proxies: dict[str, str] | None = None,
) -> str:
    """The jail's code, fetching from http://hosts[0] and https://hosts[1] (host or host:port),
    through `proxies` where given (urllib's scheme -> proxy URL), else the jail's own."""
    head = (
        f"CA_PEM = {json.dumps(ca)}\nBY_NAME = {by_name}\nHTTP = 'http://{hosts[0]}'\n"
        f"HTTPS = 'https://{hosts[1]}'\nMIB = {MIB}\nN_BIG = {n_big}\nN_SMALL = {n_small}\n"
        f"PROXIES = {proxies!r}\n"
    )
    return head + CODE


def _p50(xs: list[float]) -> float:
    return round(statistics.median(xs), 3) if xs else 0.0


def _shape(net: FakeNet, rate_mbit: int | None) -> str:
    """The fake internet's veth at rate_mbit each way (tc tbf on both ends), or unshaped
    (None); the qdisc's spec, as tc was given it."""
    spec = ["tbf", "rate", f"{rate_mbit}mbit", "burst", LINK_BURST, "limit", LINK_LIMIT]
    for prefix, dev in ((["ip", "netns", "exec", net.ns], "eth0"), ([], net.host_if)):
        argv = [*prefix, "tc", "qdisc"]
        if rate_mbit is None:
            subprocess.run([*argv, "del", "dev", dev, "root"], capture_output=True, check=False)
            continue
        done = subprocess.run([*argv, "replace", "dev", dev, "root", *spec], capture_output=True, text=True)
        if done.returncode != 0:
            raise BenchError(f"tc could not shape {dev}: {done.stderr.strip()}")
    return " ".join(spec)


def _shaped_bytes(net: FakeNet) -> dict[str, int]:
    """What the fake internet's shaper has sent toward the host so far, and dropped."""
    done = subprocess.run(
        ["ip", "netns", "exec", net.ns, "tc", "-s", "-j", "qdisc", "show", "dev", "eth0", "root"],
        capture_output=True,
        text=True,
        check=False,
    )
    for qdisc in json.loads(done.stdout or "[]"):
        if qdisc.get("kind") == "tbf":
            return {"bytes": int(qdisc.get("bytes", 0)), "drops": int(qdisc.get("drops", 0))}
    return {"bytes": 0, "drops": 0}


Sides = dict[str, tuple[Server, str]]


@contextmanager
def server_pair(base: Path, net: FakeNet, **names_settings: str) -> Iterator[tuple[Server, Server]]:
    """The two servers every egress benchmark compares: (names, address). `names` lets its jails
    out only through the proxy, to the fake internet's api host by name (its settings plus
    `names_settings`); `address` opens ports 80 and 443 by IP, no proxy (and FLOOR_PORTS, the
    jail-side floor relays'). Both stopped after."""
    common = {"SANDBOX_AUTH_TOKEN": TOKEN, "SANDBOX_MAX_EXEC_MS": "300000", "SANDBOX_POOL_SIZE": "1"}
    names = start_server(
        base / "names",
        settings={
            **common,
            "SANDBOX_EGRESS_ALLOW_DOMAINS": f"api.{DOMAIN}:80,api.{DOMAIN}:443",
            "SANDBOX_EGRESS_DNS": net.dns,
            "SANDBOX_EGRESS_SUBNET": f"10.219.{net.k}.0/24",
            **names_settings,
        },
    )
    try:
        address = start_server(
            base / "address",
            settings={
                **common,
                "SANDBOX_OPEN_PORTS": ",".join(map(str, (80, 443, *FLOOR_PORTS))),
                "SANDBOX_EGRESS_SUBNET": f"10.220.{net.k}.0/24",
            },
        )
        try:
            yield names, address
        finally:
            address.stop()
    finally:
        names.stop()


@contextmanager
def relay_box(workdir: Path, net: FakeNet) -> Iterator[FakeNet]:
    """A second namespace for the jail-side floor relay, placed as the proxy is: between the
    host and the fake internet, its way there through the host and the fake internet's veth
    (shaped or not alike). The jails reach it by IP through the host, as they reach the fake
    internet; the fake internet answers it through the host."""
    with fake_internet(workdir) as box:
        sh("ip", "-n", box.ns, "route", "add", "default", "via", f"198.18.{box.k}.1")
        sh("ip", "-n", net.ns, "route", "add", f"198.18.{box.k}.0/29", "via", f"198.18.{net.k}.1")
        try:
            yield box
        finally:
            sh("ip", "-n", net.ns, "route", "del", f"198.18.{box.k}.0/29", check=False)


async def _rounds(sides: Sides, reps: int) -> dict[str, dict[str, list[float]]]:
    """`reps` runs of each side's code, alternating which goes first."""
    got: dict[str, dict[str, list[float]]] = {
        k: {"http_mib": [], "https_mib": [], "small_total": [], "cpu_s": []} for k in sides
    }
    for rep in range(reps):
        order = list(sides) if rep % 2 == 0 else list(reversed(sides))
        for side in order:
            server, code = sides[side]
            result, cpu = await _run(server, code)
            got[side]["http_mib"] += result["http_mib"]
            got[side]["https_mib"] += result["https_mib"]
            got[side]["small_total"].append(result["small_total"])
            got[side]["cpu_s"].append(cpu)
    return got


def _ratios(side: dict[str, Any], direct: dict[str, Any]) -> dict[str, float]:
    """A side's p50s over by IP's."""
    return {
        what: round(side[f"{what}_p50_ms"] / direct[f"{what}_p50_ms"], 3)
        for what in ("http_mib", "https_mib", "small_100")
    }


def _summary(got: dict[str, dict[str, list[float]]], flows_per_run: int) -> dict[str, Any]:
    summary: dict[str, Any] = {
        side: {
            "http_mib_p50_ms": _p50(v["http_mib"]),
            "https_mib_p50_ms": _p50(v["https_mib"]),
            "small_100_p50_ms": _p50(v["small_total"]),
            "server_cpu_s_per_run": _p50(v["cpu_s"]),
            "n_big": len(v["http_mib"]),
            "n_runs": len(v["small_total"]),
        }
        for side, v in got.items()
    }
    p, d = summary["proxy"], summary["direct"]
    summary["ratios"] = _ratios(p, d)
    if "floor" in summary:  # the jail-side floor relay, by the same measure
        summary["floor_ratios"] = _ratios(summary["floor"], d)
    summary["proxy_cpu_ms_per_flow"] = round(
        (p["server_cpu_s_per_run"] - d["server_cpu_s_per_run"]) * 1000 / flows_per_run, 3
    )
    return summary


async def measure(
    reps: int, n_big: int, n_small: int, base: Path, rates: tuple[int, ...] = LINKS
) -> dict[str, Any]:
    flows_per_run = 2 * n_big + n_small
    links: list[dict[str, Any]] = []
    with (
        fake_internet(base / "net") as net,
        server_pair(base, net) as (names, address),
        ExitStack() as floors,
    ):
        ca = net.ca.read_text()
        sides: Sides = {
            "proxy": (names, _code(ca, True, (f"api.{DOMAIN}",) * 2, n_big, n_small)),
            "direct": (address, _code(ca, False, (net.public,) * 2, n_big, n_small)),
        }
        binary = build_floor_relay(base)
        if binary is not None:
            # Plain HTTP straight through one (the request as by IP); HTTPS through the other as
            # through a CONNECT proxy (urllib's CONNECT, then TLS by IP).
            box = floors.enter_context(relay_box(base / "box", net))
            for port, far in zip(FLOOR_PORTS, (80, 443), strict=True):
                floors.enter_context(
                    floor_relay(
                        binary, net.public, far, listen=(box.public, port), netns=box.ns, connect=far == 443
                    )
                )
            hosts = (f"{box.public}:{FLOOR_PORTS[0]}", net.public)
            proxies = {"https": f"http://{box.public}:{FLOOR_PORTS[1]}"}
            sides["floor"] = (address, _code(ca, False, hosts, n_big, n_small, proxies))
        got = await _rounds(sides, reps)
        try:
            for rate in rates:
                qdisc = _shape(net, rate)
                shaped = await _rounds(sides, reps)
                # Proof the runs crossed the shaper: what it sent (and dropped) meanwhile.
                through = _shaped_bytes(net)
                # The relay alone over the same link: the floor relay's cost where a
                # download crosses one (no small flows: their CPU is the unshaped run's).
                relayed_here = await relay(net, reps, n_big, 0)
                _shape(net, None)
                links.append(
                    {"rate_mbit": rate, "qdisc": qdisc, "shaper": through, "raw": shaped}
                    | _summary(shaped, flows_per_run)
                    | {"relay": relayed_here}
                )
        finally:
            _shape(net, None)
        floors.close()
        relayed = await relay(net, reps * 2, n_big, n_small * 3)
    summary = _summary(got, flows_per_run)
    summary["relay"] = relayed
    summary["links"] = [{k: v for k, v in link.items() if k != "raw"} for link in links]
    raw_links = {str(link["rate_mbit"]): link["raw"] for link in links}
    return {
        "summary": summary,
        "raw": got,
        "raw_links": raw_links,
        "flows_per_run": flows_per_run,
        "n_small": n_small,
    }


def _sides_table(s: dict[str, Any], n_small: int, rate: str | None = None) -> list[str]:
    """The jail-side figures of one link (rate None: the unshaped veth, no link column): the
    proxy, by IP, and the floor relay where it ran, with their ratios over by IP."""
    p, d, r = s["proxy"], s["direct"], s["ratios"]
    f, fr = s.get("floor"), s.get("floor_ratios")
    rows = [
        (f"1 MiB over HTTP (n={p['n_big']})", "http_mib_p50_ms", "http_mib"),
        (f"1 MiB over HTTPS (n={p['n_big']})", "https_mib_p50_ms", "https_mib"),
        (f"{n_small} small requests, one connection each (n={p['n_runs']})", "small_100_p50_ms", "small_100"),
    ]
    link = ("| link ", "| --- ") if rate is not None else ("", "")
    lines = [
        f"{link[0]}| what | through the proxy | by IP, no proxy | proxy / by IP | floor relay, by IP | floor / by IP |",
        f"{link[1]}| --- | --- | --- | --- | --- | --- |",
    ]
    for what, ms, ratio in rows:
        floor = f"{f[ms]} | x{fr[ratio]}" if f is not None and fr is not None else "n/a (no cc) | n/a"
        cell = f"| {rate} " if rate is not None else ""
        lines.append(f"{cell}| {what} | {p[ms]} | {d[ms]} | x{r[ratio]} | {floor} |")
    return lines


def render(doc: dict[str, Any]) -> str:
    s = doc["summary"]
    p, d = s["proxy"], s["direct"]
    return "\n".join(
        [
            f"# egress proxy vs allowed by IP ({doc['cpus']} CPUs, commit {doc['commit']}; "
            f"load average {doc['load']})",
            "",
            f"`{doc.get('command', 'python -m benchmarks.egress')}`: timed inside the jail, the sides' runs "
            "alternating; p50 in ms. The floor relay side is the address server's jails fetching by IP "
            "through benchmarks/floor_relay.c (HTTPS through its CONNECT mode), run in a namespace of "
            "its own placed as the proxy is, between the host and the fake internet: the cheapest relay "
            "that ends the jail's TCP connection, as any HTTP proxy must. On a shared "
            "machine the load average moves these ratios more than the proxy does: compare runs only at "
            "like load.",
            "",
            *_sides_table(s, doc["n_small"]),
            "",
            f"The server's CPU per run: {p['server_cpu_s_per_run']} s with the proxy, "
            f"{d['server_cpu_s_per_run']} s without; the proxy's CPU per flow: "
            f"{s['proxy_cpu_ms_per_flow']} ms ({doc['flows_per_run']} flows a run).",
            "",
            f"The relay alone (the proxy on loopback in the benchmark's process, no jail; 1 MiB over "
            f"plain HTTP from the fake internet, n={s['relay']['n']} each, p50 in ms):",
            "",
            *_relay_table(s["relay"]),
            *_render_relay_https(s["relay"]),
            "",
            f"The proxy's CPU per small flow there (100-byte GETs, one connection each, "
            f"{s['relay'].get('small_flows', '?')} flows in batches): "
            f"{s['relay'].get('small_cpu_ms_per_flow', '?')} ms, p50 of the batches.",
            "",
            *_render_links(doc),
        ]
    )


def _render_relay_https(relay: dict[str, Any]) -> list[str]:
    https = relay.get("https")
    if not https:
        return []
    return [
        "",
        f"The same over HTTPS (a CONNECT tunnel through the proxy, its ClientHello checked; "
        f"n={relay['n']} each, p50 in ms):",
        "",
        *_relay_table(https),
    ]


def _floor_cells(p50: dict[str, Any]) -> tuple[str, str]:
    """The floor relay's p50 and its ratio over direct, or what stands in their place where no C
    compiler built it."""
    floor, direct = p50.get("floor"), p50["direct"]
    return (str(floor), f"x{floor / direct:.3f}") if floor is not None else ("n/a (no cc)", "n/a")


def _relay_table(p50: dict[str, Any]) -> list[str]:
    """One scheme's relay figures: direct, the proxy both ways, the floor relay, and each over direct."""
    direct, floor_cells = p50["direct"], _floor_cells(p50)
    return [
        "| direct | proxy, splice(2) | proxy, stream loop | floor relay (C, splice) "
        "| splice / direct | stream / direct | floor / direct |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        f"| {direct} | {p50['splice']} | {p50['stream']} | {floor_cells[0]} | "
        f"x{p50['splice'] / direct:.3f} | x{p50['stream'] / direct:.3f} | {floor_cells[1]} |",
    ]


def _render_link_relays(links: list[dict[str, Any]]) -> list[str]:
    """The relay section's downloads again over each link (1 MiB, p50 in ms)."""
    rows = []
    for link in links:
        relayed = link.get("relay")
        if not relayed:
            continue
        for scheme, p50 in (("HTTP", relayed), ("HTTPS", relayed["https"])):
            direct, floor_cells = p50["direct"], " | ".join(_floor_cells(p50))
            rows.append(
                f"| {link['rate_mbit']} Mbit/s | {scheme} | {direct} | {p50['splice']} | {floor_cells} "
                f"| x{p50['splice'] / direct:.3f} |"
            )
    if not rows:
        return []
    n = links[0]["relay"]["n"]
    return [
        f"The relay alone over the same links (as in the relay section above: 1 MiB, n={n} each, p50 in ms):",
        "",
        "| link | scheme | direct | proxy, splice(2) | floor relay (C, splice) | floor / direct | splice / direct |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        *rows,
        "",
    ]


GOAL = 1.10  # the aim: a 1 MiB download through the proxy at most 10% slower than by IP


def _verdict(name: str, side: dict[str, Any]) -> str:
    """Whether one link met the goal, and what the floor relay read there by the same measure."""
    ratio = side["ratios"]["http_mib"]
    said = f"{name} x{ratio}: {'met' if ratio <= GOAL else 'not met'}"
    floor = (side.get("floor_ratios") or {}).get("http_mib")
    return said if floor is None else f"{said} (the floor relay x{floor})"


def _render_links(doc: dict[str, Any]) -> list[str]:
    s = doc["summary"]
    links = s.get("links") or []
    if not links:
        return []
    lines = [
        f"## Over a modelled link ({links[0]['qdisc'].split()[0]} on the fake internet's veth, both ways)",
        "",
        "The same runs, the same two servers, right after the ones above: the link both sides' "
        "traffic crosses shaped to a rate (tc "
        f"`{links[0]['qdisc']}` with each rate); no delay is added (this kernel has no "
        "sch_netem). A delay would add the same round trips to both sides, the proxy's "
        "connection upstream taking the place of the direct connection's handshake, so a "
        "bandwidth-only link is the harder case for the proxy. p50 in ms.",
        "",
    ]
    for i, link in enumerate(links):
        table = _sides_table(link, doc["n_small"], f"{link['rate_mbit']} Mbit/s")
        lines += table if i == 0 else table[2:]
    lines += [
        "",
        "Proxy CPU per flow (the names server's less the address server's): "
        + "; ".join(f"{link['rate_mbit']} Mbit/s {link['proxy_cpu_ms_per_flow']} ms" for link in links)
        + ". What the shaper passed toward the host meanwhile (both sides' runs): "
        + "; ".join(
            f"{link['rate_mbit']} Mbit/s {link['shaper']['bytes'] / MIB:.1f} MiB, "
            f"{link['shaper']['drops']} packets dropped"
            for link in links
        )
        + ".",
        "",
        *_render_link_relays(links),
    ]
    lines.append(
        f"The goal, a 1 MiB download through the proxy within {GOAL - 1:.0%} of the same by IP "
        "(plain HTTP, p50): "
        + "; ".join(
            _verdict(name, each)
            for name, each in [("the unshaped veth", s)]
            + [(f"{link['rate_mbit']} Mbit/s", link) for link in links]
        )
        + "."
    )
    lines.append("")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.egress")
    parser.add_argument("--quick", action="store_true", help="a few reps, one link rate (a smoke test)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    reps, n_big, n_small = (2, 3, 20) if args.quick else (6, 10, 100)
    load_start = " ".join(f"{x:.2f}" for x in os.getloadavg())
    with tempfile.TemporaryDirectory(prefix="egress-bench-") as tmp:
        base = Path(tmp)
        base.chmod(0o755)
        doc = asyncio.run(measure(reps, n_big, n_small, base, LINKS[-1:] if args.quick else LINKS))
    doc.update(
        commit=_commit(),
        cpus=os.cpu_count(),
        load=f"{load_start} at the start, {' '.join(f'{x:.2f}' for x in os.getloadavg())} at the end",
        python=platform.python_version(),
        quick=args.quick,
        command="python -m benchmarks.egress" + (" --quick" if args.quick else ""),
    )
    name = "egress_quick" if args.quick else "egress"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(doc, indent=1) + "\n")
    (args.out / f"{name}.md").write_text(render(doc))
    sys.stdout.write(render(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
