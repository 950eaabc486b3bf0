"""The egress proxy's fixed cost per flow, piece by piece: where a small flow's time goes.

    python -m benchmarks.egress_flow [--flows N] [--rounds R] [--size BYTES] [--rate MBIT]

The proxy in this process on loopback (no jail, no server; as benchmarks.egress's relay
rows), with the server's flow hook (the /metrics counters and a JSONL log line), a client
process making 100-byte GETs (--size: larger) from the fake internet (tests/fakenet.py), one connection
each: over plain HTTP (a forwarded request), over HTTPS (a CONNECT tunnel, its ClientHello
checked), and direct to the address without the proxy. Client and proxy stamp each step
with CLOCK_MONOTONIC (one clock for both processes), so a flow's timeline reads across them:

  client: connect, request sent (HTTP) / CONNECT answered, TLS done (HTTPS), first byte, end;
  proxy:  its task started (the accept and the task's first turn), the head read and
          parsed, the decision (with the name's resolution), the upstream connect, the
          request written (HTTP), the ClientHello read and checked (HTTPS), the relay set up
          and its first byte, the relay done, the flow's bookkeeping, the close.

Timeline rounds are instrumented (a wrapper per step, about a microsecond each); the CPU
per flow comes from rounds without the wrappers: this process's CPU time over a batch (the
proxy's alone; the client is another process) divided by its flows. Rounds alternate the
three ways; p50s are over all rounds' flows. With --rate the fake internet's veth is shaped
as in benchmarks.egress (tc tbf, both ways); the client's marks are then set side by side
with the direct flows', and the relay's first and last part taken are marked too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import functools
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from ipaddress import IPv4Address, IPv4Network
from pathlib import Path
from typing import Any

from appliance.core.egress import Layers, parse_rules
from appliance.runtime.egresslog import EgressAudit
from appliance.runtime.metrics import Metrics
from appliance.sandbox import egresssplice
from appliance.sandbox.egressproxy import EgressProxy, Scope
from appliance.sandbox.egressresolve import Resolver
from appliance.sandbox.network import EgressPolicy, JailLink
from benchmarks.appliance_server import BenchError
from benchmarks.egress import _shape
from tests.fakenet import DOMAIN, FakeNet, fake_internet

# One timed HTTP/1.1 download of /bytes/SIZE, its marks since its start, in a client process
# (which defines `now`): direct, through the proxy as an absolute-form GET, or over TLS, through
# a CONNECT tunnel where proxied. The flow benchmark runs it on the host; egress_timeline runs
# it in a jail.
TIMED_GET = r"""
def timed_get(address, name, port, ctx, proxied, size):
    t = {"start": now()}
    s = socket.create_connection(address)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as http.client does
    t["connected"] = now()
    if ctx is not None:
        if proxied:
            s.sendall(("CONNECT %s:%d HTTP/1.1\r\nHost: %s:%d\r\n\r\n" % (name, port, name, port)).encode())
            head = b""
            while not head.endswith(b"\r\n\r\n"):
                head += s.recv(1)  # never past the head: what follows is the tunnel's
            assert head.startswith(b"HTTP/1.1 200"), head
            t["established"] = now()
        s = ctx.wrap_socket(s, server_hostname=name)
        t["tls"] = now()
    target = ("http://%s" % name if proxied and ctx is None else "") + "/bytes/%d" % size
    s.sendall(("GET %s HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n" % (target, name)).encode())
    t["sent"] = now()
    parts = [s.recv(262144)]
    t["first"] = t["last"] = now()
    while True:
        more = s.recv(262144)
        if not more:
            break
        t["last"] = now()
        parts.append(more)
    t["end"] = now()
    s.close()
    data = b"".join(parts)
    assert data.startswith(b"HTTP/1.1 200") and data.endswith(b"x" * min(size, 100)), data[-200:]
    return t
"""

CLIENT = (
    r"""
import json, socket, ssl, sys, time
host, port, proxy, n, tls, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1", int(sys.argv[6])
ctx = ssl.create_default_context(cafile=CA) if tls else None
now = time.monotonic
"""
    + TIMED_GET
    + r"""
address = ("127.0.0.1", proxy) if proxy else (host, port)
print(json.dumps([timed_get(address, NAME, port, ctx, bool(proxy), size) for _ in range(n)]))
"""
)

# The proxy's steps timed in the timeline rounds: (the method, the mark at its end).
STEPS = {
    "_head": "head",
    "_decide": "decided",
    "_open": "connected",
    "_send_request": "request_sent",
    "_first": "hello_checked",
    "_splice_tunnel": "relayed",
    "_splice_down": "relayed",
    "_close": "closed",  # an older proxy's (asyncio streams), for an A/B
    "_close_bare": "closed",
}


class Marks:
    """Each flow's marks (CLOCK_MONOTONIC): a dict per connection's task (a context variable
    set as its task starts, so a mark finds its own flow's)."""

    def __init__(self) -> None:
        self.flows: list[dict[str, float]] = []
        self.current: contextvars.ContextVar[dict[str, float] | None] = contextvars.ContextVar(
            "marks", default=None
        )

    def begin(self) -> None:
        flow = {"task": time.monotonic()}
        self.flows.append(flow)
        self.current.set(flow)

    def mark(self, name: str) -> None:
        flow = self.current.get()
        if flow is not None:
            flow.setdefault(name, time.monotonic())

    def take(self) -> list[dict[str, float]]:
        out = sorted(self.flows, key=lambda m: m["task"])
        self.flows = []
        return out


def instrument(proxy: EgressProxy, marks: Marks) -> Callable[[], None]:  # noqa: C901 (one wrapper per step)
    """Wrap the proxy's steps (and the relays' first byte) to mark the flow; the undo."""
    undo: list[Callable[[], None]] = []

    def wrap_method(name: str, end: str) -> None:
        inner = getattr(proxy, name)

        @functools.wraps(inner)
        async def timed(*args: Any, **kwargs: Any) -> Any:
            try:
                return await inner(*args, **kwargs)
            finally:
                marks.mark(end)

        setattr(proxy, name, timed)
        undo.append(lambda: delattr(proxy, name))

    serve = proxy._serve

    async def serve_marked(*args: Any) -> None:
        marks.begin()
        await serve(*args)

    proxy._serve = serve_marked  # type: ignore[method-assign,assignment]
    undo.append(lambda: delattr(proxy, "_serve"))
    for name, end in STEPS.items():
        if hasattr(proxy, name):
            wrap_method(name, end)

    relay, tunnel = egresssplice.relay, egresssplice.tunnel

    def first_byte(count: Callable[[int], None]) -> Callable[[int], None]:
        flow = marks.current.get() or {}

        def counted(n: int) -> None:
            flow.setdefault("first_byte", time.monotonic())
            flow["last_byte"] = time.monotonic()
            flow["parts"] = flow.get("parts", 0) + 1
            count(n)

        return counted

    async def relay_marked(src: int, dst: int, idle_s: float, count: Callable[[int], None]) -> None:
        marks.mark("relay_start")
        await relay(src, dst, idle_s, first_byte(count))

    async def tunnel_marked(
        a: int, b: int, idle_s: float, up: Callable[[int], None], down: Callable[[int], None]
    ) -> None:
        marks.mark("relay_start")
        await tunnel(a, b, idle_s, up, first_byte(down))

    egresssplice.relay, egresssplice.tunnel = relay_marked, tunnel_marked  # type: ignore[assignment]

    def restore() -> None:
        egresssplice.relay, egresssplice.tunnel = relay, tunnel
        for step in reversed(undo):
            step()

    return restore


# What each interval of a flow's timeline is: (from, to, what).
HTTP_SPANS = [
    ("start", "connected", "client: connect(2) to the proxy"),
    ("connected", "task", "proxy: accept, the connection's task first runs"),
    ("task", "head", "proxy: the request head read and parsed (h11)"),
    ("head", "decided", "proxy: the decision, with the name's resolution"),
    ("decided", "connected_up", "proxy: the upstream connect"),
    ("connected_up", "request_sent", "proxy: the request head written upstream"),
    ("request_sent", "relay_start", "proxy: from the request to the relay's start"),
    ("relay_start", "first_byte", "the far end's answer (to the relay's first byte)"),
    ("first_byte", "first", "client: its first byte, after the relay's"),
    ("first_byte", "last_byte", "proxy: the answer's bytes taken from the far end, first to last"),
    ("last_byte", "last", "client: its last byte, after the relay took it"),
    ("last_byte", "relayed", "proxy: the relay's end (the far end's close)"),
    ("relayed", "end", "client: the end of file seen (the proxy's half-close)"),
    ("end", "closed", "proxy: the flow's bookkeeping, the close, after the client's end"),
]
HTTPS_SPANS = [
    ("start", "connected", "client: connect(2) to the proxy"),
    ("connected", "task", "proxy: accept, the connection's task first runs"),
    ("task", "head", "proxy: the CONNECT head read and parsed (h11)"),
    ("head", "decided", "proxy: the decision, with the name's resolution"),
    ("decided", "connected_up", "proxy: the upstream connect"),
    ("connected_up", "established", "client: `200 Connection established` seen"),
    ("established", "hello_checked", "proxy: the ClientHello read and its SNI checked"),
    ("hello_checked", "relay_start", "proxy: the tunnel's relay set up"),
    ("relay_start", "tls", "the rest of the TLS handshake, through the relay"),
    ("tls", "sent", "client: the request sent"),
    ("sent", "first", "the far end's answer (client: its first byte)"),
    ("first", "last", "client: first byte to last"),
    ("last_byte", "last", "client: its last byte, after the relay took it"),
    ("last", "end", "client: the end of file seen"),
    ("end", "relayed", "proxy: the tunnel's end (both ways closed), after the client's"),
    ("relayed", "closed", "proxy: the flow's bookkeeping, the close"),
]
# The client's own marks, since its start: the same for both ways, side by side.
CLIENT_MARKS = [
    ("connected", "connected"),
    ("established", "`200 Connection established` (proxy only)"),
    ("tls", "TLS handshake done"),
    ("sent", "request sent"),
    ("first", "first byte of the answer"),
    ("last", "last byte of the answer"),
    ("end", "end of file"),
]


async def _client(  # noqa: PLR0913 (a client run's parts)
    code: str,
    net: FakeNet,
    far_port: int,
    via: int,
    n: int,
    tls: bool,
    cpu: list[resource.struct_rusage] | None = None,
    size: int = 100,
) -> list[dict[str, float]]:
    """The client's flows' marks; `cpu` is given this process's times at the client's start
    (its spawning left out) and end."""
    argv = [
        sys.executable,
        "-c",
        code,
        net.public,
        str(far_port),
        str(via),
        str(n),
        "1" if tls else "0",
        str(size),
    ]
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE)
    if cpu is not None:
        cpu.append(resource.getrusage(resource.RUSAGE_SELF))
    out, _ = await proc.communicate()
    if cpu is not None:
        cpu.append(resource.getrusage(resource.RUSAGE_SELF))
    if proc.returncode != 0:
        raise BenchError(f"the flow client failed ({far_port}, via {via})")
    return list(json.loads(out))


def _port(proxy: EgressProxy) -> int:
    """The proxy's port (its listener; an older proxy's asyncio server, for an A/B)."""
    state: Any = proxy._jails[0]
    listener = state.listener if hasattr(state, "listener") else state.server.sockets[0]
    return int(listener.getsockname()[1])


def _p50(xs: list[float]) -> float:
    return round(statistics.median(xs), 1) if xs else 0.0


async def measure(  # noqa: PLR0913 (the probe's knobs)
    flows: int,
    rounds: int,
    base: Path,
    cpu_only: bool = False,
    kinds: tuple[str, ...] = ("http", "https"),
    size: int = 100,
    rate: int | None = None,
) -> dict[str, Any]:
    with fake_internet(base / "net") as net:
        qdisc = _shape(net, rate) if rate is not None else "unshaped"
        name = f"api.{DOMAIN}"
        policy = EgressPolicy(
            ports=(80,),
            allow_nets=(),
            dns=(IPv4Address(net.dns),),
            subnet=IPv4Network("10.223.0.0/24"),
            host_addresses=(),
            proxy_port=0,
        )
        layers = Layers(parse_rules([f"{name}:80", f"{name}:443"], "benchmark"))
        log = base / "egress.jsonl"
        log.touch(mode=0o600)
        audit = EgressAudit(Metrics(), log)
        proxy = EgressProxy(policy, layers, Resolver([net.dns]), 60.0, on_flow=audit)
        link = JailLink(0, "bench", "bench", IPv4Address("127.0.0.1"), IPv4Address("127.0.0.1"))
        await proxy.listen(link)
        port = _port(proxy)
        code = f"NAME = {name!r}\nCA = {str(net.ca)!r}\n" + CLIENT
        marks = Marks()
        timeline: dict[str, list[dict[str, float]]] = {
            "http": [],
            "https": [],
            "direct_http": [],
            "direct_https": [],
        }
        cpu: dict[str, list[float]] = {"http": [], "https": []}
        sys_share: dict[str, list[float]] = {"http": [], "https": []}
        try:
            proxy.begin(link, Scope(layers, "benchmark"))
            await _client(code, net, 80, port, 5, False)  # warm: the name's answer cached, imports done
            for r in range(rounds):
                ways = [w for w in [("http", 80, False), ("https", 443, True)] if w[0] in kinds]
                for kind, far_port, tls in ways if r % 2 == 0 else list(reversed(ways)):
                    # The CPU per flow, uninstrumented.
                    proxy.begin(link, Scope(layers, "benchmark"))
                    times: list[resource.struct_rusage] = []
                    await _client(code, net, far_port, port, flows, tls, times, size)
                    user, system = (
                        times[1].ru_utime - times[0].ru_utime,
                        times[1].ru_stime - times[0].ru_stime,
                    )
                    cpu[kind].append((user + system) * 1000 / flows)
                    sys_share[kind].append(system / max(1e-9, user + system))
                    if cpu_only:
                        continue
                    # The timeline, instrumented, and the same direct.
                    proxy.begin(link, Scope(layers, "benchmark"))
                    restore = instrument(proxy, marks)
                    try:
                        client = await _client(code, net, far_port, port, flows, tls, size=size)
                    finally:
                        restore()
                    server = marks.take()
                    if len(server) != len(client):
                        raise BenchError(f"{len(client)} client flows, {len(server)} proxy flows")
                    for c, s in zip(client, server, strict=True):
                        s["connected_up"] = s.pop("connected")
                        timeline[kind].append(c | s)
                    timeline["direct_" + kind] += await _client(code, net, far_port, 0, flows, tls, size=size)
        finally:
            await proxy.close()
            audit.close()
            if rate is not None:
                _shape(net, None)
    return {
        "timeline": timeline,
        "cpu_ms_per_flow": cpu,
        "sys_share": sys_share,
        "load": os.getloadavg(),
        "size": size,
        "link": qdisc,
    }


def _spans(flows: list[dict[str, float]], spans: list[tuple[str, str, str]]) -> list[tuple[str, float]]:
    return [(what, _p50([(f[b] - f[a]) * 1e6 for f in flows if a in f and b in f])) for a, b, what in spans]


def _since_start(flows: list[dict[str, float]], mark: str) -> float | None:
    got = [(f[mark] - f["start"]) * 1e6 for f in flows if mark in f]
    return _p50(got) if got else None


def render(doc: dict[str, Any]) -> str:
    t, cpu = doc["timeline"], doc["cpu_ms_per_flow"]
    size, link = doc.get("size", 100), doc.get("link", "unshaped")
    lines: list[str] = []
    for kind, spans in (("http", HTTP_SPANS), ("https", HTTPS_SPANS)):
        if not cpu[kind]:
            continue
        flows, direct = t[kind], t["direct_" + kind]
        total = _p50([(f["end"] - f["start"]) * 1e6 for f in flows])
        total_direct = _p50([(f["end"] - f["start"]) * 1e6 for f in direct])
        parts = _p50([f["parts"] for f in flows if "parts" in f])
        lines += [
            f"{kind.upper()}: a {size}-byte GET, one connection, link {link}, through the proxy "
            f"(n={len(flows)}): p50 {total} us, direct {total_direct} us "
            f"(added {round(total - total_direct, 1)} us); the proxy's CPU per flow "
            f"{round(statistics.median(cpu[kind]) * 1000, 1)} us (p50 of {len(cpu[kind])} batches; "
            f"{statistics.median(doc['sys_share'][kind]):.0%} of it in the kernel); "
            f"parts relayed down per flow {parts}",
            "",
            "| the client's mark, since its start | through the proxy, us | direct, us | added, us |",
            "| --- | --- | --- | --- |",
        ]
        for mark, what in CLIENT_MARKS:
            p, d = _since_start(flows, mark), _since_start(direct, mark)
            if p is None:
                continue
            added = "" if d is None else round(p - d, 1)
            lines.append(f"| {what} | {p} | {'' if d is None else d} | {added} |")
        lines += [
            "",
            "| step | p50, us |",
            "| --- | --- |",
            *(f"| {what} | {us} |" for what, us in _spans(flows, spans)),
            "",
        ]
    lines.append("load average at the end: " + " ".join(f"{x:.2f}" for x in doc["load"]))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.egress_flow")
    parser.add_argument("--flows", type=int, default=200, help="flows per batch")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--json", type=Path, help="also write the raw timelines here")
    parser.add_argument("--size", type=int, default=100, help="the answer's bytes (default 100)")
    parser.add_argument("--rate", type=int, help="the fake internet's link shaped to this, Mbit/s")
    parser.add_argument("--only", choices=("http", "https"), help="one kind of flow alone")
    parser.add_argument(
        "--cpu-only", action="store_true", help="no timelines: the CPU rounds alone (to profile)"
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="egress-flow-") as tmp:
        base = Path(tmp)
        base.chmod(0o755)
        doc = asyncio.run(
            measure(
                args.flows,
                args.rounds,
                base,
                args.cpu_only,
                (args.only,) if args.only else ("http", "https"),
                args.size,
                args.rate,
            )
        )
    if args.json is not None:
        args.json.write_text(json.dumps(doc))
    sys.stdout.write(render(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
