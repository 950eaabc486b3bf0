"""The egress proxy's CONNECT tunnel relayed by splice(2) (appliance.sandbox.egresssplice.tunnel):
the real proxy in this process on loopback (no jail: what is under test is the relay), a real
TLS ClientHello naming the CONNECT host, and a far end on loopback that the test drives byte
by byte. Every byte arrives in order both ways and the ledger counts exactly those; each
side's half-close reaches the other while the other way goes on; a reset on either side, the
idle time and the jail's end each end the tunnel; a jail that never reads holds no more than
the pipe and socket buffers; and no descriptor is left behind by any of them.
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import struct
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv4Network
from typing import Any

import pytest

from appliance.core.egress import Flow, Layers, parse_rules
from appliance.sandbox import egresssplice
from appliance.sandbox.egressproxy import EgressProxy, Scope
from appliance.sandbox.egressresolve import Resolver
from appliance.sandbox.network import EgressPolicy, JailLink

pytestmark = pytest.mark.skipif(not egresssplice.available(), reason="no os.splice on this platform")

NAME = "localhost"  # resolved by the host's resolver to 127.0.0.1, which the policy allows here
WAIT_S = 20.0  # a bound on a test's blocking calls, never a synchronisation


def _client_hello(server_name: str) -> bytes:
    tls = ssl.create_default_context().wrap_bio(
        ssl.MemoryBIO(), out := ssl.MemoryBIO(), server_hostname=server_name
    )
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return out.read()


HELLO = _client_hello(NAME)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _read_all(sock: socket.socket) -> bytes:
    out = bytearray()
    while chunk := sock.recv(1 << 16):
        out += chunk
    return bytes(out)


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            break
        out += chunk
    return bytes(out)


def _reset(sock: socket.socket) -> None:
    """Close with an RST (SO_LINGER 0), as a far end or a client that aborts does."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


@dataclass
class Rig:
    proxy: EgressProxy
    link: JailLink
    proxy_port: int
    far: socket.socket  # the far end's listener
    scope: Scope
    finished: list[Flow] = field(default_factory=list)
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    tunnels: list[int] = field(default_factory=list)  # each spliced tunnel's start (a count)

    async def connect(self) -> tuple[socket.socket, socket.socket]:
        """A tunnel through the proxy: (the jail's end, the far end's accepted socket), the
        ClientHello already sent and read by the far end exactly."""
        return await asyncio.to_thread(self._connect)

    def _connect(self) -> tuple[socket.socket, socket.socket]:
        port = self.far.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", self.proxy_port), timeout=WAIT_S)
        client.sendall(f"CONNECT {NAME}:{port} HTTP/1.1\r\nHost: {NAME}:{port}\r\n\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = client.recv(1)
            assert chunk, head
            head += chunk
        assert head.startswith(b"HTTP/1.1 200 "), head
        client.sendall(HELLO)
        far, _ = self.far.accept()
        far.settimeout(WAIT_S)
        assert _read_exactly(far, len(HELLO)) == HELLO  # forwarded exactly, first
        return client, far

    async def flow(self) -> Flow:
        """The next finished flow (the proxy's flow hook: its relay is over, counts final),
        once every connection of the proxy is over (their sockets closed by then: a
        transport's close is queued before its task ends)."""
        async with asyncio.timeout(WAIT_S):
            while not self.finished:
                self.ended.clear()
                await self.ended.wait()
            me = asyncio.current_task()
            await asyncio.gather(
                *(
                    t
                    for t in asyncio.all_tasks()
                    if t is not me and ".serve" in getattr(t.get_coro(), "__qualname__", "")
                )
            )
        return self.finished.pop(0)


@pytest.fixture
async def rig(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Rig]:
    far = socket.create_server(("127.0.0.1", 0))
    far.settimeout(WAIT_S)
    port = far.getsockname()[1]
    policy = EgressPolicy(
        ports=(),
        allow_nets=(IPv4Network("127.0.0.0/8"),),  # the far end is on loopback, allowed on purpose
        dns=(),
        subnet=IPv4Network("10.224.0.0/24"),
        host_addresses=(),
        proxy_port=0,
    )
    layers = Layers(parse_rules([f"{NAME}:{port}"], "test"))
    finished: list[Flow] = []
    ended = asyncio.Event()

    def on_flow(flow: Flow, scope: Scope | None) -> None:
        finished.append(flow)
        ended.set()

    proxy = EgressProxy(policy, layers, Resolver(), 1.5, on_flow=on_flow)
    link = JailLink(0, "test", "test", IPv4Address("127.0.0.1"), IPv4Address("127.0.0.1"))
    await proxy.listen(link)
    scope = Scope(layers, "test")
    proxy.begin(link, scope)
    tunnels: list[int] = []
    real = egresssplice.tunnel

    async def spied(*args: Any) -> None:
        tunnels.append(1)
        await real(*args)

    monkeypatch.setattr(egresssplice, "tunnel", spied)
    rig = Rig(proxy, link, proxy._jails[0].listener.getsockname()[1], far, scope, finished, ended, tunnels)
    try:
        yield rig
    finally:
        await proxy.close()
        far.close()


async def _both(*calls: Callable[[], Any]) -> list[Any]:
    return list(await asyncio.gather(*(asyncio.to_thread(c) for c in calls)))


async def test_a_large_transfer_both_ways_arrives_whole_and_is_counted_exactly(rig: Rig) -> None:
    before = _fds()
    up, down = os.urandom(12 * (1 << 20) + 3), os.urandom(9 * (1 << 20) + 11)
    client, far = await rig.connect()
    with client, far:

        def send(sock: socket.socket, data: bytes) -> None:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)

        _, _, got_far, got_client = await _both(
            lambda: send(client, up),
            lambda: send(far, down),
            lambda: _read_all(far),
            lambda: _read_all(client),
        )
    flow = await rig.flow()
    assert got_far == up and got_client == down
    assert (flow.bytes_up, flow.bytes_down) == (len(HELLO) + len(up), len(down))
    assert rig.scope.ledger()[0] is flow and flow.decision == "allowed"
    assert rig.tunnels == [1]  # relayed by splice, not the stream loop
    assert _fds() == before


async def _first_ends(rig: Rig, jail_first: bool, first: bytes, then: bytes) -> bytes:
    """One tunnel: one side sends `first` and ends its side; the other reads to that end, then
    sends `then` and ends its own, which the first reads whole. Returns `then`."""
    client, far = await rig.connect()
    with client, far:
        ender, other = (client, far) if jail_first else (far, client)
        ender.sendall(first)
        ender.shutdown(socket.SHUT_WR)
        assert await asyncio.to_thread(_read_all, other) == first
        await asyncio.to_thread(other.sendall, then)
        other.shutdown(socket.SHUT_WR)
        assert await asyncio.to_thread(_read_all, ender) == then
    return then


async def test_each_half_close_reaches_the_other_side_while_the_other_way_goes_on(rig: Rig) -> None:
    before = _fds()
    # The jail ends its side first; the far end reads to that end, then answers at length.
    answer = await _first_ends(rig, jail_first=True, first=b"ping", then=os.urandom(3 << 20))
    flow = await rig.flow()
    assert (flow.bytes_up, flow.bytes_down) == (len(HELLO) + 4, len(answer))
    # The far end ends its side first; the jail reads to that end, then goes on sending.
    more = await _first_ends(rig, jail_first=False, first=b"bye", then=os.urandom(2 << 20))
    flow = await rig.flow()
    assert (flow.bytes_up, flow.bytes_down) == (len(HELLO) + len(more), 3)
    assert rig.tunnels == [1, 1]
    assert _fds() == before


def _ended(sock: socket.socket) -> str:
    """How the socket's stream ended for its reader: 'eof' or the error's name."""
    try:
        _read_all(sock)
    except OSError as exc:
        return type(exc).__name__
    return "eof"


async def test_a_reset_on_either_side_ends_the_tunnel_and_leaks_nothing(rig: Rig) -> None:
    before = _fds()
    # The far end resets mid-answer: the jail's side is ended too (not left open).
    client, far = await rig.connect()
    with client:
        await asyncio.to_thread(far.sendall, b"x" * 100000)
        _reset(far)
        assert await asyncio.to_thread(_ended, client) in ("eof", "ConnectionResetError")
    flow = await rig.flow()
    assert 0 < flow.bytes_down <= 100000
    # The jail resets mid-upload: the far end's side is ended too.
    client, far = await rig.connect()
    with far:
        await asyncio.to_thread(client.sendall, b"y" * 100000)
        _reset(client)
        assert await asyncio.to_thread(_ended, far) in ("eof", "ConnectionResetError")
    flow = await rig.flow()
    assert len(HELLO) < flow.bytes_up <= len(HELLO) + 100000
    assert rig.tunnels == [1, 1]
    assert _fds() == before


async def test_the_jails_end_closes_an_open_tunnel(rig: Rig) -> None:
    """What the jail's release does (EgressProxy.unlisten): every tunnel of it closed at once,
    mid-relay, both ways."""
    before = _fds()
    client, far = await rig.connect()
    with client, far:
        client.sendall(b"a")
        assert await asyncio.to_thread(_read_exactly, far, 1) == b"a"
        await rig.proxy.unlisten(rig.link)
        assert await asyncio.to_thread(_ended, client) in ("eof", "ConnectionResetError")
        assert await asyncio.to_thread(_ended, far) in ("eof", "ConnectionResetError")
    flow = await rig.flow()
    assert flow.bytes_up == len(HELLO) + 1
    assert rig.tunnels == [1]
    # Only the listener went with it: what stays is what there was before it.
    assert _fds() == before - 1


async def test_a_jail_that_never_reads_holds_only_bounded_buffers_and_is_dropped(rig: Rig) -> None:
    """The far end sends as fast as it can; the jail reads nothing. The relay fills the pipe
    and the socket buffers, then stops; after the idle time (1.5 s here: the bound under
    test) the tunnel is dropped."""
    before = _fds()
    client, far = await rig.connect()
    stop = threading.Event()

    def flood() -> int:
        sent = 0
        far.settimeout(0.2)
        block = b"z" * 65536
        while not stop.is_set():
            try:
                sent += far.send(block)
            except TimeoutError:
                continue
            except OSError:
                break
        return sent

    with client, far:
        sender = asyncio.ensure_future(asyncio.to_thread(flood))
        flow = await rig.flow()
        stop.set()
        await sender
    assert 0 < flow.bytes_down < 64 << 20, flow.bytes_down
    assert rig.tunnels == [1]
    assert _fds() == before
