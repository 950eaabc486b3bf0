"""The egress proxy's resolver keeps a named resolver's answers (appliance.sandbox.egressresolve):
for the least TTL of the answer's chain, bounded in names, on a clock the tests turn; the
host resolver's (no TTL) for HOST_CACHE_S; and a kept answer is never a decision: a name
that rebinds to a blocked address is refused as soon as the answer saying so is asked for,
and nothing is ever connected to an address unchecked.

A DNS server of the test's own on loopback answers from a zone the tests change; the host
resolver's answers come from the test (the loop's getaddrinfo, scripted: the host's own
files and resolver are not the test's to change); the proxy runs in the test's loop, its far
ends on 127.0.0.2 (allowed by the policy on purpose) and 127.0.0.3 (loopback: blocked)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv4Network
from typing import Any, cast

import dns.message
import dns.name
import dns.rcode
import dns.rrset
import pytest

from appliance.core.egress import Flow, Layers, parse_rules
from appliance.sandbox import egressresolve
from appliance.sandbox.egressproxy import EgressProxy, Scope
from appliance.sandbox.egressresolve import ResolveError, Resolver
from appliance.sandbox.network import EgressPolicy, JailLink

WAIT_S = 10.0


@dataclass
class FakeDns(asyncio.DatagramProtocol):
    """Answers A questions from `zone` (name: (ttl, addresses)), following `cnames` (name:
    (ttl, target)) once; NXDOMAIN otherwise. `asked` lists every question's name."""

    zone: dict[str, tuple[int, list[str]]] = field(default_factory=dict)
    cnames: dict[str, tuple[int, str]] = field(default_factory=dict)
    asked: list[str] = field(default_factory=list)
    transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)  # not a subclass on 3.11

    def datagram_received(self, data: bytes, addr: tuple[str | int, int]) -> None:
        query = dns.message.from_wire(data)
        reply = dns.message.make_response(query)
        qname = query.question[0].name
        name = qname.to_text().rstrip(".")
        self.asked.append(name)
        if name in self.cnames:
            ttl, target = self.cnames[name]
            reply.answer.append(dns.rrset.from_text(qname, ttl, "IN", "CNAME", target + "."))
            name, qname = target, dns.name.from_text(target)
        if name in self.zone:
            ttl, addresses = self.zone[name]
            reply.answer.append(dns.rrset.from_text_list(qname, ttl, "IN", "A", addresses))
        else:
            reply.set_rcode(dns.rcode.NXDOMAIN)
        assert self.transport is not None
        self.transport.sendto(reply.to_wire(), addr)


@dataclass
class Clock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def fake_dns() -> AsyncIterator[tuple[FakeDns, int]]:
    transport, server = await asyncio.get_running_loop().create_datagram_endpoint(
        FakeDns, local_addr=("127.0.0.1", 0)
    )
    try:
        yield server, transport.get_extra_info("sockname")[1]
    finally:
        transport.close()


def _resolver(port: int, clock: Clock) -> Resolver:
    return Resolver(["127.0.0.1"], port=port, clock=clock)


async def test_an_answer_is_kept_for_its_ttl_and_asked_again_once_expired(
    fake_dns: tuple[FakeDns, int],
) -> None:
    server, port = fake_dns
    clock = Clock()
    resolver = _resolver(port, clock)
    server.zone["a.test"] = (30, ["198.51.100.7"])
    assert await resolver.resolve("a.test") == [IPv4Address("198.51.100.7")]
    server.zone["a.test"] = (30, ["198.51.100.8"])
    clock.now += 29.9
    assert await resolver.resolve("a.test") == [IPv4Address("198.51.100.7")]  # kept
    assert server.asked == ["a.test"]
    clock.now += 0.1  # the TTL is over: asked again, and the new answer is what is used
    assert await resolver.resolve("a.test") == [IPv4Address("198.51.100.8")]
    assert server.asked == ["a.test", "a.test"]


async def test_a_cname_chain_is_kept_for_its_least_ttl(fake_dns: tuple[FakeDns, int]) -> None:
    """A CNAME of 2 s to a name whose A records live 300 s: asked again after 2 s."""
    server, port = fake_dns
    clock = Clock()
    resolver = _resolver(port, clock)
    server.cnames["short.test"] = (2, "long.test")
    server.zone["long.test"] = (300, ["198.51.100.9"])
    assert await resolver.resolve("short.test") == [IPv4Address("198.51.100.9")]
    clock.now += 1.5
    await resolver.resolve("short.test")
    assert server.asked == ["short.test"]
    clock.now += 1.0
    await resolver.resolve("short.test")
    assert server.asked == ["short.test", "short.test"]


async def test_no_answer_outlives_the_cap_or_a_zero_ttl(fake_dns: tuple[FakeDns, int]) -> None:
    server, port = fake_dns
    clock = Clock()
    resolver = _resolver(port, clock)
    server.zone["long.test"] = (86400, ["198.51.100.10"])
    server.zone["zero.test"] = (0, ["198.51.100.11"])
    await resolver.resolve("long.test")
    await resolver.resolve("zero.test")
    await resolver.resolve("zero.test")
    assert server.asked == ["long.test", "zero.test", "zero.test"]
    clock.now += egressresolve.CACHE_MAX_S
    await resolver.resolve("long.test")
    assert server.asked.count("long.test") == 2


async def test_the_kept_answers_are_bounded_oldest_first(
    fake_dns: tuple[FakeDns, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, port = fake_dns
    monkeypatch.setattr(egressresolve, "CACHE_NAMES", 3)
    resolver = _resolver(port, Clock())
    names = [f"n{i}.test" for i in range(5)]
    for name in names:
        server.zone[name] = (30, ["198.51.100.12"])
        await resolver.resolve(name)
    server.asked.clear()
    for name in reversed(names):  # the last three kept, the first two asked again
        await resolver.resolve(name)
    assert sorted(server.asked) == ["n0.test", "n1.test"]
    assert len(resolver._cache) <= 3


async def test_an_unknown_name_is_an_error_and_is_not_kept(fake_dns: tuple[FakeDns, int]) -> None:
    server, port = fake_dns
    resolver = _resolver(port, Clock())
    for _ in range(2):
        with pytest.raises(ResolveError, match="NXDOMAIN"):
            await resolver.resolve("nowhere.test")
    assert server.asked == ["nowhere.test", "nowhere.test"]


@dataclass
class HostLookups:
    """The host resolver as the proxy sees it (the loop's getaddrinfo), answering scripted
    names from `names` (a name: its addresses, or None: the lookup fails); every scripted
    name asked is in `asked`. Addresses and other names go to the real one."""

    names: dict[str, list[str] | None] = field(default_factory=dict)
    asked: list[str] = field(default_factory=list)


@pytest.fixture
async def host_lookups(monkeypatch: pytest.MonkeyPatch) -> HostLookups:
    lookups = HostLookups()
    loop = asyncio.get_running_loop()
    real = loop.getaddrinfo

    async def getaddrinfo(host: Any, port: Any, **kwargs: Any) -> list[Any]:
        if host not in lookups.names:
            return await real(host, port, **kwargs)
        lookups.asked.append(host)
        addresses = lookups.names[host]
        if addresses is None:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, 0)) for a in addresses]

    monkeypatch.setattr(loop, "getaddrinfo", getaddrinfo)
    return lookups


async def test_the_host_resolvers_answer_is_kept_briefly(host_lookups: HostLookups) -> None:
    """No TTL comes with it: kept HOST_CACHE_S, then asked again; a failure is never kept."""
    clock = Clock()
    resolver = Resolver(clock=clock)
    host_lookups.names["h.test"] = ["198.51.100.20"]
    assert await resolver.resolve("h.test") == [IPv4Address("198.51.100.20")]
    host_lookups.names["h.test"] = ["198.51.100.21"]
    clock.now += egressresolve.HOST_CACHE_S - 0.1
    assert await resolver.resolve("h.test") == [IPv4Address("198.51.100.20")]  # kept
    assert host_lookups.asked == ["h.test"]
    clock.now += 0.1
    assert await resolver.resolve("h.test") == [IPv4Address("198.51.100.21")]
    assert host_lookups.asked == ["h.test", "h.test"]

    host_lookups.names["gone.test"] = None
    for _ in range(2):
        with pytest.raises(ResolveError, match="could not be resolved"):
            await resolver.resolve("gone.test")
    assert host_lookups.asked.count("gone.test") == 2


# -- through the proxy -----------------------------------------------------------------------
ALLOWED_FAR = "127.0.0.2"  # allowed by the policy below (allow_nets), on purpose
BLOCKED_FAR = "127.0.0.3"  # loopback: on the blocklist


@dataclass
class Far:
    """A far end on one address: answers one fixed response per connection, counted."""

    address: str
    accepted: int = 0
    server: asyncio.Server | None = None

    async def start(self, port: int) -> int:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.accepted += 1
            with contextlib.suppress(OSError, asyncio.IncompleteReadError):
                await reader.readuntil(b"\r\n\r\n")
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
                await writer.drain()
            writer.close()

        self.server = await asyncio.start_server(serve, self.address, port)
        return int(self.server.sockets[0].getsockname()[1])


@contextlib.asynccontextmanager
async def _far_pair() -> AsyncIterator[tuple[Far, Far, int]]:
    """The two far ends on one port (a rule names one port), closed on the way out."""
    for _ in range(20):
        allowed, blocked = Far(ALLOWED_FAR), Far(BLOCKED_FAR)
        port = await allowed.start(0)
        try:
            await blocked.start(port)
        except OSError:
            assert allowed.server is not None
            allowed.server.close()
            continue
        break
    else:
        raise AssertionError("no port free on both far addresses")
    try:
        yield allowed, blocked, port
    finally:
        for far in (allowed, blocked):
            assert far.server is not None
            far.server.close()


async def _get(proxy_port: int, name: str, port: int) -> bytes:
    async with asyncio.timeout(WAIT_S):
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy_port)
        writer.write(f"GET http://{name}:{port}/ HTTP/1.1\r\nHost: {name}:{port}\r\n\r\n".encode())
        await writer.drain()
        data = await reader.read()
        writer.close()
        return data


@contextlib.asynccontextmanager
async def _proxy(rules: list[str], resolver: Resolver, finished: list[Flow]) -> AsyncIterator[int]:
    """A proxy for one jail on loopback that lets out only ALLOWED_FAR's net, under `rules`,
    asking `resolver`; yields its port, each finished flow appended to `finished`."""
    policy = EgressPolicy(
        ports=(),
        allow_nets=(IPv4Network(f"{ALLOWED_FAR}/32"),),
        dns=(),
        subnet=IPv4Network("10.225.0.0/24"),
        host_addresses=(),
        proxy_port=0,
    )
    layers = Layers(parse_rules(rules, "test"))
    proxy = EgressProxy(policy, layers, resolver, 5.0, on_flow=lambda f, _: finished.append(f))
    link = JailLink(0, "test", "test", IPv4Address("127.0.0.1"), IPv4Address("127.0.0.1"))
    await proxy.listen(link)
    try:
        proxy.begin(link, Scope(layers, "test"))
        yield proxy._jails[0].listener.getsockname()[1]
    finally:
        await proxy.close()


async def test_a_rebinding_name_cannot_get_past_the_check_with_answers_kept(
    fake_dns: tuple[FakeDns, int],
) -> None:
    """A name answers an allowed address, then rebinds to a blocked one. While the first
    answer is kept, flows go to the address that was checked; once it expires the new
    answer is asked for, checked, and refused: nothing ever reaches the blocked address.
    A kept answer naming a blocked address is refused at every use, not once."""
    server, dns_port = fake_dns
    clock = Clock()
    finished: list[Flow] = []
    async with (
        _far_pair() as (allowed, blocked, port),
        _proxy(
            [f"rebind.test:{port}", f"private.test:{port}"], _resolver(dns_port, clock), finished
        ) as proxy_port,
    ):
        server.zone["rebind.test"] = (30, [ALLOWED_FAR])
        assert (await _get(proxy_port, "rebind.test", port)).endswith(b"ok")
        server.zone["rebind.test"] = (30, [BLOCKED_FAR])  # the rebinding
        assert (await _get(proxy_port, "rebind.test", port)).endswith(b"ok")  # the kept, checked answer
        assert [f.address for f in finished] == [ALLOWED_FAR, ALLOWED_FAR]
        assert server.asked == ["rebind.test"]
        clock.now += 30
        refused = await _get(proxy_port, "rebind.test", port)
        assert refused.startswith(b"HTTP/1.1 403 ")
        assert f"resolves to {BLOCKED_FAR}".encode() in refused
        assert server.asked == ["rebind.test", "rebind.test"]
        assert finished[-1].decision == "denied" and finished[-1].address is None

        server.zone["private.test"] = (30, [BLOCKED_FAR])
        for _ in range(2):
            refused = await _get(proxy_port, "private.test", port)
            assert refused.startswith(b"HTTP/1.1 403 ")
        assert server.asked.count("private.test") == 1  # the second was the kept answer, checked again
        assert allowed.accepted == 2
        assert blocked.accepted == 0


async def test_a_rebinding_name_cannot_get_past_the_host_resolvers_kept_answer(
    host_lookups: HostLookups,
) -> None:
    """With no resolver named, the host's answer is kept HOST_CACHE_S: while it is, flows go
    to the address that was checked; once it expires the rebinding is asked for, checked and
    refused, and nothing ever reaches the blocked address."""
    clock = Clock()
    finished: list[Flow] = []
    async with (
        _far_pair() as (allowed, blocked, port),
        _proxy([f"rebind.test:{port}"], Resolver(clock=clock), finished) as proxy_port,
    ):
        host_lookups.names["rebind.test"] = [ALLOWED_FAR]
        assert (await _get(proxy_port, "rebind.test", port)).endswith(b"ok")
        host_lookups.names["rebind.test"] = [BLOCKED_FAR]  # the rebinding
        assert (await _get(proxy_port, "rebind.test", port)).endswith(b"ok")  # the kept, checked answer
        assert [f.address for f in finished] == [ALLOWED_FAR, ALLOWED_FAR]
        assert host_lookups.asked == ["rebind.test"]
        clock.now += egressresolve.HOST_CACHE_S
        for _ in range(2):  # the new answer, refused; kept, and refused again at its next use
            refused = await _get(proxy_port, "rebind.test", port)
            assert refused.startswith(b"HTTP/1.1 403 ")
            assert f"resolves to {BLOCKED_FAR}".encode() in refused
        assert host_lookups.asked == ["rebind.test", "rebind.test"]
        assert [f.decision for f in finished[-2:]] == ["denied", "denied"]
        assert allowed.accepted == 2
        assert blocked.accepted == 0
