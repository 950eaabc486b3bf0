"""The egress proxy's connections: a jail's, taken from the listener once it has sent its
first bytes (one that says nothing holds no task), one out of descriptors rests rather than
spins; and the one to a far end (appliance.sandbox.egressproxy._connect): one the
kernel settles within the connect call (a refusal on loopback) costs no wait, one still
going on is waited for within CONNECT_TIMEOUT_S; either failure is the jail's 502 and the
ledger's `failed`, nothing relayed.

The proxy runs in the test's loop on loopback; the far end is 127.0.0.2 (allowed by the
policy's address rules on purpose), addressed by IP literal."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from ipaddress import IPv4Address, IPv4Network
from typing import cast

import pytest

from appliance.core.egress import Flow, Layers
from appliance.sandbox import egressproxy
from appliance.sandbox.egressproxy import EgressProxy, Scope
from appliance.sandbox.egressresolve import Resolver
from appliance.sandbox.network import EgressPolicy, JailLink

FAR = "127.0.0.2"
WAIT_S = 10.0  # a bound on the test's reads, never a synchronisation


@asynccontextmanager
async def _proxy(port: int) -> AsyncIterator[tuple[int, list[Flow], EgressProxy]]:
    """A proxy allowing FAR:port by the address rules: (its port, the finished flows, it)."""
    policy = EgressPolicy(
        ports=(port,),
        allow_nets=(IPv4Network(f"{FAR}/32"),),
        dns=(),
        subnet=IPv4Network("10.226.0.0/24"),
        host_addresses=(),
        proxy_port=0,
    )
    finished: list[Flow] = []
    on_flow: Callable[[Flow, Scope | None], None] = lambda flow, _: finished.append(flow)  # noqa: E731
    proxy = EgressProxy(policy, Layers(()), Resolver(), 5.0, on_flow=on_flow)
    link = JailLink(0, "test", "test", IPv4Address("127.0.0.1"), IPv4Address("127.0.0.1"))
    await proxy.listen(link)
    proxy.begin(link, Scope(Layers(()), "test"))
    try:
        yield proxy._jails[0].listener.getsockname()[1], finished, proxy
    finally:
        await proxy.close()


async def _get(proxy_port: int, port: int) -> bytes:
    async with asyncio.timeout(WAIT_S):
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy_port)
        writer.write(f"GET http://{FAR}:{port}/ HTTP/1.1\r\nHost: {FAR}:{port}\r\n\r\n".encode())
        await writer.drain()
        data = await reader.read()
        writer.close()
        return data


async def test_a_far_end_that_refuses_is_a_502_and_a_failed_flow() -> None:
    # Bound but not listening: the far end answers a SYN with a reset, inside the connect call.
    closed = socket.socket()
    closed.bind((FAR, 0))
    port = closed.getsockname()[1]
    with closed:
        async with _proxy(port) as (proxy_port, finished, _):
            got = await _get(proxy_port, port)
    assert got.startswith(b"HTTP/1.1 502 "), got
    assert f"{FAR}:{port} could not be reached (Connection refused)".encode() in got
    assert [(f.decision, f.bytes_down) for f in finished] == [("failed", 0)]


async def test_a_jail_connection_that_has_sent_nothing_holds_no_task() -> None:
    """A connection is handed to the proxy with its head (TCP_DEFER_ACCEPT), not at its
    handshake: one that has said nothing costs the server no task (nor a wakeup of its loop)
    while another connection is served from start to end; once it speaks it is served too."""
    closed = socket.socket()
    closed.bind((FAR, 0))
    port = closed.getsockname()[1]
    with closed:
        async with _proxy(port) as (proxy_port, finished, proxy):
            async with asyncio.timeout(WAIT_S):
                reader, writer = await asyncio.open_connection("127.0.0.1", proxy_port)
            try:
                # A whole flow on a second connection, made after the silent one was
                # established: the listener was read for it, and its task has ended.
                assert (await _get(proxy_port, port)).startswith(b"HTTP/1.1 502 ")
                assert proxy._jails[0].conns == set()
                writer.write(f"GET http://{FAR}:{port}/ HTTP/1.1\r\nHost: {FAR}:{port}\r\n\r\n".encode())
                async with asyncio.timeout(WAIT_S):
                    got = await reader.read()
                assert got.startswith(b"HTTP/1.1 502 "), got
            finally:
                writer.close()
    assert [f.decision for f in finished] == ["failed", "failed"]


async def test_a_far_end_that_does_not_answer_in_time_is_a_502(monkeypatch: pytest.MonkeyPatch) -> None:
    """A listener whose accept queue is full drops the proxy's SYN: the connect goes on in
    the kernel, and the proxy's wait for it ends at CONNECT_TIMEOUT_S."""
    monkeypatch.setattr(egressproxy, "CONNECT_TIMEOUT_S", 0.3)
    full = socket.socket()
    full.bind((FAR, 0))
    full.listen(0)
    port = full.getsockname()[1]
    first = socket.create_connection((FAR, port))  # fills the queue of one, never accepted
    with full, first:
        async with _proxy(port) as (proxy_port, finished, _):
            got = await _get(proxy_port, port)
    assert got.startswith(b"HTTP/1.1 502 "), got
    assert b"could not be reached (TimeoutError)" in got
    assert [f.decision for f in finished] == ["failed"]


class _OutOfDescriptors:
    """The proxy's listener, whose accept fails with EMFILE while `failing` (as a process out
    of descriptors sees), counting the calls."""

    def __init__(self, real: socket.socket) -> None:
        self.real = real
        self.failing = True
        self.failed = 0
        self.first_failure = asyncio.Event()

    def fileno(self) -> int:
        return self.real.fileno()

    def getsockname(self) -> tuple[str, int]:
        name: tuple[str, int] = self.real.getsockname()
        return name

    def accept(self) -> tuple[socket.socket, tuple[str, int]]:
        if self.failing:
            self.failed += 1
            self.first_failure.set()
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return self.real.accept()

    def close(self) -> None:
        self.real.close()


async def test_a_listener_out_of_descriptors_rests_instead_of_spinning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Out of descriptors, the listener stays readable: the proxy stops watching it for
    ACCEPT_PAUSE_S (one failed accept, not one per turn of the loop), and the connection
    that waited in the backlog is served once it is watched again."""
    monkeypatch.setattr(egressproxy, "ACCEPT_PAUSE_S", 0.2)
    far = await asyncio.start_server(_answer_ok, FAR, 0)
    port = far.sockets[0].getsockname()[1]
    try:
        async with _proxy(port) as (proxy_port, finished, proxy):
            state = proxy._jails[0]
            listener = _OutOfDescriptors(state.listener)
            state.listener = cast(socket.socket, listener)
            got = asyncio.ensure_future(_get(proxy_port, port))
            async with asyncio.timeout(WAIT_S):
                await listener.first_failure.wait()
            for _ in range(20):  # turns of the loop (no time passes): a watched listener would fail each
                await asyncio.sleep(0)
            listener.failing = False  # descriptors again; the listener is watched after its rest
            assert (await got).endswith(b"ok")
            assert listener.failed == 1
            assert [f.decision for f in finished] == ["allowed"]
    finally:
        far.close()


async def _answer_ok(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError, asyncio.IncompleteReadError):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
        await writer.drain()
    writer.close()
