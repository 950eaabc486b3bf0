"""Where the wall time of one download through the egress proxy goes, seen from inside a jail.

    python -m benchmarks.egress_timeline [--size BYTES] [--rate MBIT] [--rounds R] [--n N]

benchmarks.egress's two servers on one fake internet (tests/fakenet.py): one allows
`api.fake.test` by name (its jails reach it only through the proxy), the other ports 80 and
443 by address. In a jail of each, alternately, a client fetches /bytes/SIZE over plain HTTP
and over HTTPS (through the proxy: a forwarded request, and a CONNECT tunnel it makes
itself, as urllib does), stamping each step on CLOCK_MONOTONIC: connected, `200 Connection
established` (through the proxy), TLS done, request sent, first byte, last byte, end of file.
The names server's proxy stamps its own steps on the same clock (a jail shares the host's
clock): its connection's task first runs, the head parsed, the decision (with the name's
resolution), the upstream connect, the request written / the ClientHello checked, the relay
set up, the far end's first and last byte taken, the relay's end, the close. The stamps are
put there by a `sitecustomize` given to that server alone (written into the benchmark's
temporary directory, on its PYTHONPATH): the server's code is unchanged, its steps wrapped.
With --rate, the fake internet's veth is shaped as in benchmarks.egress (tc tbf, both ways).

Prints, per kind: the client's marks since its start, through the proxy and by IP, and what
the proxy added at each; then the proxy's steps (p50 over every flow of every round).
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from appliance.sandbox import egressproxy, egresssplice
from appliance_client.client import AsyncClient
from benchmarks.appliance_server import REPO, BenchError
from benchmarks.egress import TOKEN, _shape, server_pair
from benchmarks.egress_flow import STEPS, TIMED_GET
from tests.fakenet import DOMAIN, fake_internet
from tests.support import Server

MARKS_ENV = "APPLIANCE_BENCH_EGRESS_MARKS"  # where the names server's proxy writes its marks

# Given to the names server alone, on its PYTHONPATH: wraps its proxy's steps (hook below).
SITECUSTOMIZE = f"""
import os, sys
if os.environ.get({MARKS_ENV!r}):
    sys.path.insert(0, {str(REPO)!r})
    from benchmarks.egress_timeline import hook
    hook(os.environ[{MARKS_ENV!r}])
"""

CLIENT = (
    r"""
import json, os, socket, ssl, time, urllib.parse
open("/tmp/ca.pem", "w").write(CA_PEM)
ctx = ssl.create_default_context(cafile="/tmp/ca.pem")
if not BY_NAME:
    ctx.check_hostname = False  # addressed by IP: the certificate names the host, not the address
now = time.monotonic
proxy = urllib.parse.urlsplit(os.environ["HTTPS_PROXY"]) if BY_NAME else None
"""
    + TIMED_GET
    + r"""
def get(tls):
    port = 443 if tls else 80
    address = (proxy.hostname, proxy.port) if proxy else (HOST, port)
    return timed_get(address, HOST, port, ctx if tls else None, proxy is not None, SIZE)
print(json.dumps({"http": [get(False) for _ in range(N)], "https": [get(True) for _ in range(N)]}))
"""
)

# The client's marks, since its start.
CLIENT_MARKS = [
    ("connected", "connected (to the proxy / to the far end)"),
    ("established", "`200 Connection established`"),
    ("tls", "TLS handshake done"),
    ("sent", "request sent"),
    ("first", "first byte of the answer"),
    ("last", "last byte of the answer"),
    ("end", "end of file"),
]
# The proxy's steps, and the hand-overs between it and the client: (from, to, what).
SPANS = [
    ("connected", "p_task", "client connected -> proxy: the connection's task first runs"),
    ("p_task", "p_head", "proxy: the head read and parsed"),
    ("p_head", "p_decided", "proxy: the decision, with the name's resolution"),
    ("p_decided", "p_connected", "proxy: the upstream connect"),
    ("p_connected", "established", "proxy connected -> client: `200` seen"),
    ("p_connected", "p_request_sent", "proxy: the request written upstream"),
    ("established", "p_hello_checked", "client: `200` seen -> proxy: the ClientHello read and checked"),
    ("p_hello_checked", "p_relay_start", "proxy: the hello sent on, the relay set up"),
    ("p_relay_start", "tls", "proxy: the relay set up -> client: TLS done"),
    ("p_request_sent", "p_first_byte", "proxy: the request written -> the far end's first byte taken"),
    ("p_first_byte", "first", "proxy: the first byte taken -> client: its first byte"),
    ("p_first_byte", "p_last_byte", "proxy: the far end's bytes taken, first to last"),
    ("p_last_byte", "last", "proxy: the last byte taken -> client: its last byte"),
    ("p_last_byte", "p_relayed", "proxy: the last byte taken -> the relay's end"),
    ("last", "end", "client: the last byte -> end of file"),
]


Current = contextvars.ContextVar[dict[str, float] | None]


def hook(out: str) -> None:
    """In the names server: wrap its proxy's steps to stamp each flow (CLOCK_MONOTONIC), one
    JSON line per flow into `out` once its connection is served."""
    current: Current = contextvars.ContextVar("marks", default=None)
    _wrap_steps(current, out)
    _wrap_relays(current)


def _mark(current: Current, name: str) -> None:
    flow = current.get()
    if flow is not None:
        flow.setdefault(name, time.monotonic())


def _write(out: str, flow: dict[str, float]) -> None:
    with open(out, "a") as fh:
        fh.write(json.dumps(flow) + "\n")


def _wrap_steps(current: Current, out: str) -> None:
    cls: Any = egressproxy.EgressProxy
    serve = cls._serve

    async def serve_marked(self: Any, *args: Any) -> None:
        flow = {"task": time.monotonic()}
        current.set(flow)
        try:
            await serve(self, *args)
        finally:
            flow["closed"] = time.monotonic()
            _write(out, flow)

    cls._serve = serve_marked

    def wrap(inner: Any, end: str) -> Any:
        @functools.wraps(inner)
        async def timed(*args: Any, **kwargs: Any) -> Any:
            try:
                return await inner(*args, **kwargs)
            finally:
                _mark(current, end)

        return timed

    for name, end in STEPS.items():
        if hasattr(cls, name):
            setattr(cls, name, wrap(getattr(cls, name), end))


def _wrap_relays(current: Current) -> None:
    relay, tunnel = egresssplice.relay, egresssplice.tunnel

    def down(count: Callable[[int], None], after: str | None) -> Callable[[int], None]:
        """The far end's parts taken: the first (in a tunnel, the first after `after`: the
        answer, not the handshake) and the last."""
        flow = current.get() or {}

        def counted(n: int) -> None:
            at = time.monotonic()
            if after is None or after in flow:
                flow.setdefault("first_byte", at)
                flow["last_byte"] = at
                flow["parts"] = flow.get("parts", 0) + 1
            count(n)

        return counted

    async def relay_marked(src: int, dst: int, idle_s: float, count: Callable[[int], None]) -> None:
        _mark(current, "relay_start")
        await relay(src, dst, idle_s, down(count, None))

    async def tunnel_marked(
        a: int, b: int, idle_s: float, up: Callable[[int], None], count: Callable[[int], None]
    ) -> None:
        _mark(current, "relay_start")
        flow = current.get() or {}
        parts_up = [0]

        def up_counted(n: int) -> None:
            # After the hello (sent on before the relay), the client's parts up are its
            # Finished, then its request: the answer is what comes down after the second.
            parts_up[0] += 1
            if parts_up[0] == 2:
                flow.setdefault("request_up", time.monotonic())
            up(n)

        await tunnel(a, b, idle_s, up_counted, down(count, "request_up"))

    egresssplice.relay, egresssplice.tunnel = relay_marked, tunnel_marked  # type: ignore[assignment]


async def _run(server: Server, code: str) -> dict[str, list[dict[str, float]]]:
    async with AsyncClient(server.url, token=TOKEN) as c:
        ex = await c.execute(code, timeout_ms=300000)
    if ex.status != "ok":
        raise BenchError(f"the timeline run ended {ex.status}: {ex.error} {ex.stderr[-2000:]}")
    return dict(json.loads(ex.stdout.splitlines()[-1]))


def _p50(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 1) if xs else None


async def measure(size: int, rate: int | None, rounds: int, n: int, base: Path) -> dict[str, Any]:
    marks = base / "marks.jsonl"
    hook_dir = base / "hook"
    hook_dir.mkdir()
    (hook_dir / "sitecustomize.py").write_text(SITECUSTOMIZE)
    got: dict[str, dict[str, list[dict[str, float]]]] = {
        side: {"http": [], "https": []} for side in ("proxy", "direct")
    }
    with fake_internet(base / "net") as net:
        with server_pair(base, net, PYTHONPATH=str(hook_dir), **{MARKS_ENV: str(marks)}) as (names, address):
            ca = net.ca.read_text()

            def code(by_name: bool, host: str) -> str:
                head = f"CA_PEM = {json.dumps(ca)}\nBY_NAME = {by_name}\nHOST = {host!r}\nSIZE = {size}\nN = {n}\n"
                return head + CLIENT

            sides = {
                "proxy": (names, code(True, f"api.{DOMAIN}")),
                "direct": (address, code(False, net.public)),
            }
            if rate is not None:
                _shape(net, rate)
            try:
                await _run(names, sides["proxy"][1])  # warm: the name's answer kept, imports done
                marks.write_text("")
                for r in range(rounds):
                    for side in ("proxy", "direct") if r % 2 == 0 else ("direct", "proxy"):
                        server, source = sides[side]
                        result = await _run(server, source)
                        if side == "proxy":
                            proxied = sorted(
                                (json.loads(line) for line in marks.read_text().splitlines() if line),
                                key=lambda m: m["task"],
                            )
                            marks.write_text("")
                            flows = result["http"] + result["https"]
                            if len(proxied) != len(flows):
                                raise BenchError(f"{len(flows)} client flows, {len(proxied)} proxy flows")
                            for c, p in zip(flows, proxied, strict=True):
                                c.update({"p_" + k: v for k, v in p.items()})
                        for kind in ("http", "https"):
                            got[side][kind] += result[kind]
            finally:
                if rate is not None:
                    _shape(net, None)
    return {"flows": got, "size": size, "rate_mbit": rate, "load": os.getloadavg()}


def render(doc: dict[str, Any]) -> str:
    link = f"{doc['rate_mbit']} Mbit/s (tbf)" if doc["rate_mbit"] else "unshaped veth"
    lines: list[str] = []
    for kind in ("http", "https"):
        proxied, direct = doc["flows"]["proxy"][kind], doc["flows"]["direct"][kind]
        lines += [
            f"{kind.upper()}: {doc['size']} bytes, {link}, n={len(proxied)} a side; p50 in us since "
            "the client's start",
            "",
            "| the client's mark | through the proxy | by IP | added |",
            "| --- | --- | --- | --- |",
        ]
        for mark, what in CLIENT_MARKS:
            p = _p50([(f[mark] - f["start"]) * 1e6 for f in proxied if mark in f])
            d = _p50([(f[mark] - f["start"]) * 1e6 for f in direct if mark in f])
            if p is not None:
                added = "" if d is None else round(p - d, 1)
                lines.append(f"| {what} | {p} | {'' if d is None else d} | {added} |")
        lines += ["", "| step (through the proxy) | p50, us |", "| --- | --- |"]
        for a, b, what in SPANS:
            span = _p50([(f[b] - f[a]) * 1e6 for f in proxied if a in f and b in f])
            if span is not None:
                lines.append(f"| {what} | {span} |")
        parts = _p50([f["p_parts"] for f in proxied if "p_parts" in f])
        lines += ["", f"The far end's answer came to the proxy in {parts} parts (p50).", ""]
    lines.append("load average at the end: " + " ".join(f"{x:.2f}" for x in doc["load"]))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.egress_timeline")
    parser.add_argument("--size", type=int, default=1 << 20, help="the answer's bytes (default 1 MiB)")
    parser.add_argument("--rate", type=int, help="the fake internet's link shaped to this, Mbit/s")
    parser.add_argument("--rounds", type=int, default=4, help="runs of each side, alternating")
    parser.add_argument("--n", type=int, default=10, help="downloads of each kind a run")
    parser.add_argument("--json", type=Path, help="also write the raw marks here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="egress-timeline-") as tmp:
        base = Path(tmp)
        base.chmod(0o755)
        doc = asyncio.run(measure(args.size, args.rate, args.rounds, args.n, base))
    if args.json is not None:
        args.json.write_text(json.dumps(doc))
    sys.stdout.write(render(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
