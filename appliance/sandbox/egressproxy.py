"""The egress proxy: a jail's only way out when names are allowed (`SANDBOX_EGRESS_ALLOW_DOMAINS`).

An HTTP/1.1 forward proxy in the server's event loop. It listens on each jail's link only
(the host end of its veth, `SANDBOX_EGRESS_PROXY_PORT`), and takes connections only from
that jail's address: the listener a connection came in on says which jail, and so which
run, it belongs to. Jails get `HTTP_PROXY`/`HTTPS_PROXY` pointing here and no other route
(appliance.sandbox.network renders the filters).

For each connection, one flow:
  * `CONNECT host:port` (TLS) or one plain `GET http://host/...` (absolute URI);
  * the name is decided by the run's layers (appliance.core.egress); an IPv4 literal by
    the address rules as before (SANDBOX_OPEN_PORTS, SANDBOX_EGRESS_ALLOW_NETS);
  * with live approval (`egress.ask`), a host refused by the request's own list alone waits
    for the client's answer (appliance.core.egressask) before anything else is done for it;
  * the proxy resolves the name itself, checks every address against the blocklist, and
    connects to the checked address (no second lookup: no rebinding);
  * in a tunnel to a name, the ClientHello's server name must be that name (no domain
    fronting), read with a bounded parser (appliance.sandbox.tlshello) before a byte goes on;
    the hello then goes on exactly, and the rest of the tunnel is relayed both ways in the
    kernel (appliance.sandbox.egresssplice.tunnel);
  * a plain request goes on alone, its Host set from its URI and `Connection: close`,
    so a connection carries exactly one request to exactly the host decided on; its
    answer is relayed in the kernel (appliance.sandbox.egresssplice);
  * a host:port given secrets (SANDBOX_EGRESS_SECRETS, a tenant's egress_secrets) is
    intercepted: the real host's certificate verified first, the jail answered with the
    appliance CA's, its one request given the secret headers (appliance.sandbox.egressintercept);
    plain HTTP to it is refused.

The request head is parsed by h11 (a maintained HTTP/1.1 parser, bounded by
`MAX_HEAD_BYTES`); the proxy is written here rather than taken whole from a proxy library
because each step above (which run a connection is, resolve-once, check-then-connect, the
SNI peek, the per-run ledger) sits between the parsing and the connecting that such
libraries do in one piece. Bounds: the head's size and time, connections per jail at once,
a flow with no byte either way for `SANDBOX_EGRESS_IDLE_MS`, and a peer that never reads
(its writes wait at most that long too).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import os
import select
import socket
import ssl
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from ipaddress import IPv4Address
from typing import Protocol

import h11

from appliance.core.egress import (
    ALLOWED,
    DENIED,
    Flow,
    Layers,
    Verdict,
    decide_name,
    is_ipv4,
    normal_host,
)
from appliance.core.egressask import EgressAsks
from appliance.core.egresssecrets import SecretHeaders, Secrets
from appliance.sandbox import egresssplice, tlshello
from appliance.sandbox.egressintercept import Interception, TlsStream, with_secrets
from appliance.sandbox.egressresolve import ResolveError, Resolver
from appliance.sandbox.network import EgressPolicy, JailLink, address_refusal

log = logging.getLogger("appliance.egress")

FAILED = "failed"  # allowed, but the far end could not be reached
MAX_HEAD_BYTES = 16384
HEAD_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 10.0
HELLO_TIMEOUT_S = 10.0
CLOSE_GRACE_S = 5.0  # what is still buffered for a peer at the end has this long to go
ACCEPT_PAUSE_S = 1.0  # out of descriptors: the listener rests this long before accepting again
# A jail's connection is handed to the proxy once its first bytes (the request head) have
# come, not at its handshake (TCP_DEFER_ACCEPT): the server's loop is not woken while the
# jail's client is still in its connect call, where on a busy host it took the client's CPU
# before the client had even sent its head. A connection that says nothing waits in the
# listener's backlog (MAX_CONNECTIONS) and is handed over after about this long anyway,
# then bound by HEAD_TIMEOUT_S like any other.
DEFER_ACCEPT_S = 1
MAX_CONNECTIONS = 64  # one jail's connections through the proxy at once
MAX_FLOWS = 256  # flows one run's ledger lists; past it they are counted only
MAX_DENIALS_TOLD = 32  # denials one run is told of as they happen; past it, in `done` only
# The relay's buffers: a read takes what the socket has, up to this; a stream holds at most
# twice this before it stops reading, and a writer this much before its reader waits. Small
# buffers meant a wakeup of the server's loop per 64 KiB, which a busy host pays for each.
CHUNK = 262144
HOP_HEADERS = {
    b"connection",
    b"proxy-connection",
    b"keep-alive",
    b"proxy-authorization",
    b"proxy-authenticate",
    b"te",
    b"trailer",
    b"upgrade",
    b"host",
    b"expect",
}

OnDenied = Callable[[Flow], Awaitable[None]]
OnFlow = Callable[[Flow, "Scope | None"], None]


class _Source(Protocol):
    """What the relay reads from: an asyncio stream, or an intercepted TLS one."""

    async def read(self, n: int = -1) -> bytes: ...


class _Sink(Protocol):
    def write(self, data: bytes) -> None: ...

    async def drain(self) -> None: ...

    def can_write_eof(self) -> bool: ...

    def write_eof(self) -> None: ...


def _closing(sock: socket.socket, _: object) -> None:
    sock.close()


class _Bare:
    """One side of a flow as its bare non-blocking socket: the jail's connection, taken from
    the listener itself, and a forwarded request's far end. No transport, protocol or
    streams are made (and then paused, for splice) per flow: the relay splices from the
    sockets themselves. Writes go out at once as a transport's do; what the socket does not
    take waits for `drain`."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._loop = asyncio.get_running_loop()
        self._held = bytearray()

    @property
    def pending(self) -> int:
        """Bytes written that the socket has not taken yet."""
        return len(self._held)

    def write(self, data: bytes) -> None:
        if not self._held:
            with contextlib.suppress(BlockingIOError, InterruptedError):
                data = data[self.sock.send(data) :]
        self._held += data

    async def drain(self) -> None:
        if self._held:
            data = bytes(self._held)
            self._held.clear()
            await self._loop.sock_sendall(self.sock, data)

    async def read(self, n: int = -1) -> bytes:
        return await self._loop.sock_recv(self.sock, n if n > 0 else CHUNK)

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.sock.shutdown(socket.SHUT_WR)


class Scope:
    """One run's use of the proxy: the layers its flows are held to, and its ledger."""

    def __init__(
        self,
        layers: Layers,
        request_id: str,
        on_denied: OnDenied | None = None,
        secrets: Secrets | None = None,
        asks: EgressAsks | None = None,
    ) -> None:
        self.layers = layers
        self.request_id = request_id
        self.on_denied = on_denied
        self.secrets = secrets  # the tenant's secret headers, over the server's (names only in logs)
        self.asks = asks  # live approval: who is asked about a host only the request leaves out
        self.flows: list[Flow] = []
        self.omitted = 0
        self.told = 0
        self.closed = False
        self._telling = 0
        self._quiet = asyncio.Event()
        self._quiet.set()

    def record(self, flow: Flow) -> None:
        if len(self.flows) < MAX_FLOWS:
            self.flows.append(flow)
        else:
            self.omitted += 1

    async def tell(self, flow: Flow) -> None:
        """Tell the run of a denial as it happens (the first MAX_DENIALS_TOLD, while it runs)."""
        if self.closed or self.on_denied is None or self.told >= MAX_DENIALS_TOLD:
            return
        self.told += 1
        self._telling += 1
        self._quiet.clear()
        try:
            await self.on_denied(flow)
        except Exception:  # the run's caller is gone: the ledger still has it
            log.debug("a denial could not be told", exc_info=True)
        finally:
            self._telling -= 1
            if self._telling == 0:
                self._quiet.set()

    async def close(self) -> None:
        """No more telling; wait for what is being told (each is bounded by its caller)."""
        self.closed = True
        await self._quiet.wait()

    def ledger(self) -> list[Flow]:
        """The flows so far; those still open are given their duration until now."""
        now = time.monotonic()
        for flow in self.flows:
            if flow.started and not flow.duration_ms:
                flow.duration_ms = int((now - flow.started) * 1000)
        return list(self.flows)


@dataclass
class _Jail:
    link: JailLink
    listener: socket.socket
    conns: set[asyncio.Task[None]] = field(default_factory=set)
    scope: Scope | None = None
    paused: asyncio.TimerHandle | None = None  # accepting again after running out of descriptors


class _Refused(Exception):
    """A flow is refused before any byte went on: the reply status and why."""

    def __init__(self, status: int, why: str) -> None:
        super().__init__(why)
        self.status = status
        self.why = why


REASONS = {400: "Bad Request", 403: "Forbidden", 405: "Method Not Allowed", 502: "Bad Gateway", 503: "Busy"}


def _reply(status: int, why: str) -> bytes:
    body = f"appliance egress proxy: {why}\n".encode("ascii", "replace")
    head = (
        f"HTTP/1.1 {status} {REASONS.get(status, 'Error')}\r\n"
        "Content-Type: text/plain; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


def request_head(method: bytes, target: bytes, headers: list[tuple[bytes, bytes]]) -> bytes:
    """An HTTP/1.1 request head of parts already checked by h11's parser (and the host
    decided on), byte for byte what h11's writer makes of them."""
    lines = [method, b" ", target, b" HTTP/1.1\r\n"]
    for name, value in headers:
        lines += (name, b": ", value, b"\r\n")
    lines.append(b"\r\n")
    return b"".join(lines)


async def _connect(sock: socket.socket, target: tuple[str, int]) -> None:
    """Connect the non-blocking `sock`; OSError when refused or unreachable, TimeoutError
    after CONNECT_TIMEOUT_S. A far end the kernel reaches at once (a local network: the
    handshake is done within the connect call itself) costs no turn of the loop."""
    err = sock.connect_ex(target)
    if err in (errno.EINPROGRESS, errno.EINTR):  # going on in the kernel
        poll = select.poll()
        poll.register(sock, select.POLLOUT)
        if not poll.poll(0):
            loop = asyncio.get_running_loop()
            done: asyncio.Future[None] = loop.create_future()
            loop.add_writer(sock.fileno(), _settle, done)
            try:
                async with asyncio.timeout(CONNECT_TIMEOUT_S):
                    await done
            finally:
                loop.remove_writer(sock.fileno())
        err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    if err:
        raise OSError(err, os.strerror(err))


def _settle(done: asyncio.Future[None]) -> None:
    if not done.done():
        done.set_result(None)


async def _asked(scope: Scope, flow: Flow, verdict: Verdict) -> Verdict:
    """Live approval: a host only the request's list leaves out waits for the client's answer
    (appliance.core.egressask); anything else keeps its verdict. An approval opens only the
    name; the addresses it resolves to are checked as for any other flow."""
    if verdict.allowed or not verdict.askable or scope.asks is None:
        return verdict
    answer, flow.asked = await scope.asks.ask(flow.host, flow.port)
    if answer.allow:
        return Verdict(True, answer.rule, None)
    return Verdict(False, None, f"{verdict.why}; {answer.why}")


class EgressProxy:
    """The proxy of one server: a listener per jail link, the flows of each jail's run."""

    def __init__(  # noqa: PLR0913 (the server's parts of the proxy)
        self,
        policy: EgressPolicy,
        layers: Layers,
        resolver: Resolver,
        idle_s: float,
        on_flow: OnFlow | None = None,
        interception: Interception | None = None,
    ) -> None:
        self.policy = policy
        self.layers = layers  # the server's own (a run's scope may narrow them)
        self.resolver = resolver
        self.idle_s = idle_s
        self.on_flow = on_flow
        self.interception = interception  # the hosts that get secrets, and the CA for them
        self._jails: dict[int, _Jail] = {}

    # -- jails ------------------------------------------------------------------------------
    async def listen(self, link: JailLink) -> None:
        """Listen on the jail's link; OSError if the address cannot be bound."""
        port = self.policy.proxy_port
        if port is None:
            raise RuntimeError("EgressProxy.listen without a proxy port")
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT, DEFER_ACCEPT_S)
            listener.bind((str(link.gateway), port))
            listener.listen(MAX_CONNECTIONS)
            listener.setblocking(False)
        except BaseException:
            listener.close()
            raise
        state = _Jail(link, listener)
        asyncio.get_running_loop().add_reader(listener.fileno(), self._accept, state)
        self._jails[link.index] = state

    def _accept(self, state: _Jail) -> None:
        """The listener is readable: each connection waiting, a task of its own. Only the
        jail's own address is served (anyone else's connection is closed at once)."""
        loop = asyncio.get_running_loop()
        for _ in range(MAX_CONNECTIONS):  # a burst at most, then the loop's other work
            try:
                sock, peer = state.listener.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as exc:
                # Out of descriptors or memory: the connections wait in the backlog meanwhile,
                # rather than the loop spinning on a listener that stays readable.
                log.warning("the egress proxy cannot accept", extra={"error": exc.strerror})
                loop.remove_reader(state.listener.fileno())
                state.paused = loop.call_later(ACCEPT_PAUSE_S, self._resume, state)
                return
            if peer[0] != str(state.link.address):
                sock.close()  # another jail's (or anyone else's) connection to this jail's listener
                continue
            try:
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as asyncio's transports do
            except OSError:
                sock.close()
                continue
            jail = _Bare(sock)

            async def serve(jail: _Bare = jail) -> None:
                await self._serve(state, jail)

            task = loop.create_task(serve())
            state.conns.add(task)
            # A task cancelled before its first step never runs its own close.
            task.add_done_callback(functools.partial(_closing, sock))

    def _resume(self, state: _Jail) -> None:
        state.paused = None
        if self._jails.get(state.link.index) is state:
            asyncio.get_running_loop().add_reader(state.listener.fileno(), self._accept, state)

    async def unlisten(self, link: JailLink) -> None:
        """Stop listening for the jail and end its connections."""
        state = self._jails.pop(link.index, None)
        if state is None or state.link != link:
            return
        if state.paused is not None:
            state.paused.cancel()
        else:
            asyncio.get_running_loop().remove_reader(state.listener.fileno())
        state.listener.close()
        for task in list(state.conns):
            task.cancel()
        for task in list(state.conns):
            with contextlib.suppress(BaseException):
                await task

    def begin(self, link: JailLink, scope: Scope) -> None:
        """From now on the jail's flows are the run's (held to its layers, in its ledger)."""
        state = self._jails.get(link.index)
        if state is not None:
            state.scope = scope

    def end(self, link: JailLink) -> Scope | None:
        """The run is over: its scope, and no run for the jail until the next `begin`."""
        state = self._jails.get(link.index)
        if state is None:
            return None
        scope, state.scope = state.scope, None
        return scope

    async def close(self) -> None:
        for state in list(self._jails.values()):
            await self.unlisten(state.link)

    # -- one connection ---------------------------------------------------------------------
    async def _serve(self, state: _Jail, jail: _Bare) -> None:
        task = asyncio.current_task()
        try:
            if len(state.conns) > MAX_CONNECTIONS:
                jail.write(_reply(503, f"more than {MAX_CONNECTIONS} connections at once"))
                return
            await self._handle(state, jail)
        except (OSError, TimeoutError, asyncio.IncompleteReadError, h11.ProtocolError):
            pass
        finally:
            if task is not None:
                state.conns.discard(task)
            await self._close_bare(jail)

    async def _head(self, reader: _Source) -> tuple[h11.Connection, h11.Request] | None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        taken = 0
        async with asyncio.timeout(HEAD_TIMEOUT_S):
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    if taken > MAX_HEAD_BYTES:  # h11's own bound looks only at what is unparsed
                        raise h11.RemoteProtocolError("the request head is too long")
                    data = await reader.read(min(4096, MAX_HEAD_BYTES + 1 - taken))
                    taken += len(data)
                    conn.receive_data(data)
                    if not data and conn.their_state is h11.IDLE:
                        return None
                    continue
                if isinstance(event, h11.Request):
                    return conn, event
                return None

    async def _handle(self, state: _Jail, jail: _Bare) -> None:
        try:
            got = await self._head(jail)
        except h11.RemoteProtocolError:
            jail.write(_reply(400, "not an HTTP/1.1 proxy request (or a head over 16 KiB)"))
            return
        if got is None:
            return
        conn, request = got
        target = request.target.decode("ascii", "replace")
        if request.method == b"CONNECT":
            host, sep, port_text = target.rpartition(":")
            if not sep or not port_text.isdigit() or not 0 < int(port_text) < 65536:
                jail.write(_reply(400, "CONNECT needs host:port"))
                return
            await self._tunnel(state, conn, jail, host, int(port_text))
            return
        try:
            url = urllib.parse.urlsplit(target)
            port = url.port or 80
        except ValueError:
            jail.write(_reply(400, "the request's URI is not valid"))
            return
        if url.scheme != "http" or not url.hostname or url.username or url.password:
            jail.write(_reply(400, "a proxied request needs an absolute http:// URI (use CONNECT for TLS)"))
            return
        await self._forward(state, conn, request, jail, url, port)

    async def _decide(self, state: _Jail, host_raw: str, port: int) -> tuple[Flow, IPv4Address | None]:
        """The flow's decision and, when allowed, the checked address to connect to."""
        host = normal_host(host_raw) if ":" not in host_raw and "[" not in host_raw else None
        flow = Flow(host=host or host_raw[:253], port=port, decision=DENIED, started=time.monotonic())
        scope = state.scope
        if host is None:
            flow.why = "not a host name or IPv4 address (IPv6 egress is not supported)"
        elif scope is None:
            flow.why = "no run is active in this jail"
        elif is_ipv4(host):
            address = IPv4Address(host)
            refusal = address_refusal(self.policy, address)
            by_address = refusal is None and port in self.policy.tcp_ports
            verdict = decide_name(scope.layers, host, port, ip_allowed=by_address)
            verdict = await _asked(scope, flow, verdict) if refusal is None else verdict
            if refusal is not None:
                flow.why = f"{address} is {refusal}"
            elif not verdict.allowed:
                flow.why = verdict.why
            else:
                flow.decision, flow.rule, flow.address = ALLOWED, verdict.rule, str(address)
                return flow, address
        else:
            verdict = await _asked(scope, flow, decide_name(scope.layers, host, port))
            if not verdict.allowed:
                flow.why = verdict.why
            else:
                try:
                    addresses = await self.resolver.resolve(host)
                except ResolveError as exc:
                    flow.why = str(exc)
                    return flow, None
                for address in addresses:
                    refusal = address_refusal(self.policy, address)
                    if refusal is not None:
                        flow.why = f"{host} resolves to {address}, {refusal}"
                        return flow, None
                flow.decision, flow.rule, flow.address = ALLOWED, verdict.rule, str(addresses[0])
                return flow, addresses[0]
        return flow, None

    async def _record(self, state: _Jail, flow: Flow) -> None:
        """A flow is decided: into the run's ledger; a denial is told to the run at once."""
        scope = state.scope
        if scope is not None:
            scope.record(flow)
            if flow.decision == DENIED:
                await scope.tell(flow)

    def _finish(self, state: _Jail, flow: Flow) -> None:
        flow.duration_ms = max(1, int((time.monotonic() - flow.started) * 1000)) if flow.started else 0
        if self.on_flow is not None:
            try:
                self.on_flow(flow, state.scope)
            except Exception:
                log.exception("egress flow hook failed")

    async def _open(self, flow: Flow, address: IPv4Address) -> socket.socket:
        """A connected non-blocking socket to the checked address (no name, no lookup)."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as asyncio's transports do
            await _connect(sock, (str(address), flow.port))
        except (OSError, TimeoutError) as exc:
            sock.close()
            flow.decision = FAILED
            flow.why = f"{address}:{flow.port} could not be reached ({getattr(exc, 'strerror', None) or type(exc).__name__})"
            raise _Refused(502, flow.why) from None
        except BaseException:
            sock.close()
            raise
        return sock

    @staticmethod
    async def _streams(sock: socket.socket) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        try:
            up_reader, up_writer = await asyncio.open_connection(sock=sock, limit=CHUNK)
        except BaseException:
            sock.close()
            raise
        up_writer.transport.set_write_buffer_limits(high=CHUNK)
        return up_reader, up_writer

    async def _tunnel(
        self, state: _Jail, conn: h11.Connection, jail: _Bare, host_raw: str, port: int
    ) -> None:
        flow, address = await self._decide(state, host_raw, port)
        try:
            sock = await self._reach(state, flow, address, jail)
            if sock is not None:
                await self._carry(state, flow, conn, jail, sock)
        finally:
            self._finish(state, flow)

    async def _carry(
        self,
        state: _Jail,
        flow: Flow,
        conn: h11.Connection,
        jail: _Bare,
        sock: socket.socket,
    ) -> None:
        """An allowed tunnel, its far end connected: the jail answered, its ClientHello
        checked, then the rest relayed (intercepted where the host is given secrets)."""
        # A tunnel given secrets is TLS the proxy speaks itself (streams); any other keeps
        # the bare socket, spliced from once its ClientHello has gone on.
        secret = self._secret(state, flow)
        up: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            if secret is not None:
                up = await self._streams(sock)
                if not await self._secure(state, flow, up[1], jail):
                    return
            jail.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            first = await self._first(flow, conn, jail)
            await self._record(state, flow)
            if first is None:
                return
            if up is not None:
                if secret is not None:
                    await self._intercept(flow, secret, jail, up[0], up[1], first)
                return
            if await self._splice_tunnel(flow, jail, sock, first):
                return
            far = _Bare(sock)
            if first:
                far.write(first)
                flow.bytes_up += len(first)
                async with asyncio.timeout(self.idle_s):
                    await far.drain()
            await self._pipe(flow, jail, far)
        finally:
            if up is not None:
                await self._close(up[1])
            else:
                sock.close()

    async def _first(self, flow: Flow, conn: h11.Connection, jail: _Bare) -> bytes | None:
        """What the jail sent first in its tunnel: to a name, a ClientHello naming the
        CONNECT host (None, the flow denied, otherwise)."""
        first = bytes(conn.trailing_data[0])
        if is_ipv4(flow.host):
            return first
        return await self._hello(flow, jail, first)

    async def _splice_tunnel(self, flow: Flow, jail: _Bare, up_sock: socket.socket, first: bytes) -> bool:
        """The rest of a checked tunnel relayed both ways in the kernel
        (appliance.sandbox.egresssplice.tunnel): first what was read of it (the ClientHello,
        and whatever came with it), then the sockets themselves, once what the jail was
        answered has gone. False, nothing done, where there is no splice."""
        if not egresssplice.available():
            return False
        async with asyncio.timeout(self.idle_s):
            await jail.drain()
            if first:
                await asyncio.get_running_loop().sock_sendall(up_sock, first)
        flow.bytes_up += len(first)

        def up(n: int) -> None:
            flow.bytes_up += n

        def down(n: int) -> None:
            flow.bytes_down += n

        await egresssplice.tunnel(jail.sock.fileno(), up_sock.fileno(), self.idle_s, up, down)
        return True

    async def _reach(
        self, state: _Jail, flow: Flow, address: IPv4Address | None, jail: _Bare
    ) -> socket.socket | None:
        """The far end of a decided flow; None, the refusal recorded and answered to the jail,
        when it is denied or cannot be reached."""
        if address is None:
            await self._record(state, flow)
            jail.write(_reply(403, flow.why or "denied"))
            return None
        try:
            return await self._open(flow, address)
        except _Refused as refused:
            await self._record(state, flow)
            jail.write(_reply(refused.status, refused.why))
            return None

    async def _close(self, writer: asyncio.StreamWriter) -> None:
        """Close after what is buffered has gone, within a short grace; else drop it (a peer
        that does not read holds nothing past that)."""
        try:
            writer.close()
            if not writer.transport.get_write_buffer_size() and writer.get_extra_info("sslcontext") is None:
                return  # nothing left to send: the socket is closed by the loop's next turn
            async with asyncio.timeout(min(self.idle_s, CLOSE_GRACE_S)):
                await writer.wait_closed()
        except (OSError, TimeoutError):
            pass
        finally:
            writer.transport.abort()

    async def _close_bare(self, side: _Bare) -> None:
        """Close once what is held for the peer has gone, within a short grace; else drop it
        (a peer that does not read holds nothing past that)."""
        try:
            if side.pending:
                async with asyncio.timeout(min(self.idle_s, CLOSE_GRACE_S)):
                    await side.drain()
        except (OSError, TimeoutError):
            pass
        finally:
            side.sock.close()

    async def _hello(self, flow: Flow, jail: _Bare, buf: bytes) -> bytes | None:
        """The tunnel's ClientHello, once its server name is the CONNECT host; None (and the
        flow denied) otherwise."""
        hello = tlshello.parse(buf)
        try:
            async with asyncio.timeout(HELLO_TIMEOUT_S):
                while hello.more and len(buf) < tlshello.MAX_HELLO_BYTES:
                    data = await jail.read(tlshello.MAX_HELLO_BYTES - len(buf))
                    if not data:
                        break
                    buf += data
                    hello = tlshello.parse(buf)
        except TimeoutError:
            pass
        why: str | None = None
        if hello.more:
            why = "the tunnel sent no complete TLS ClientHello"
        elif hello.problem is not None:
            why = f"{hello.problem}; a tunnel to a name must carry TLS"
        elif hello.sni is None:
            why = "the TLS ClientHello names no server (SNI)"
        elif hello.sni.removesuffix(".") != flow.host:
            why = f"the TLS server name {hello.sni[:253]!r} is not the CONNECT host {flow.host}"
        if why is None:
            return buf
        flow.decision, flow.why, flow.rule = DENIED, why, None
        return None

    async def _forward(  # noqa: PLR0913 (one connection's parts)
        self,
        state: _Jail,
        conn: h11.Connection,
        request: h11.Request,
        jail: _Bare,
        url: urllib.parse.SplitResult,
        port: int,
    ) -> None:
        host_raw = url.hostname or ""
        flow, address = await self._decide(state, host_raw, port)
        if address is not None and self._secret(state, flow) is not None:
            # A secret never crosses the network in clear: refused, not sent without it.
            flow.decision, flow.rule, flow.address, address = DENIED, None, None, None
            flow.why = (
                f"{flow.host}:{port} is given secrets by the appliance, sent over TLS only (use https://)"
            )
        try:
            sock = await self._reach(state, flow, address, jail)
            if sock is None:
                return
            await self._record(state, flow)
            # The answer is spliced from the socket itself: nothing may read it first.
            far = _Bare(sock)
            with sock:
                await self._send_request(flow, conn, request, jail, jail, far, url, port)
                if not await self._splice_down(flow, sock, jail):
                    await self._pump(flow, far, jail, down=True, last=[time.monotonic()])
        finally:
            self._finish(state, flow)

    async def _splice_down(self, flow: Flow, up_sock: socket.socket, jail: _Bare) -> bool:
        """The far end's answer relayed to the jail in the kernel (appliance.sandbox.egresssplice),
        once what the jail was answered has gone, then the jail's side half-closed; False,
        nothing moved, where there is no splice."""
        if not egresssplice.available():
            return False
        if jail.pending:
            async with asyncio.timeout(self.idle_s):
                await jail.drain()

        def count(n: int) -> None:
            flow.bytes_down += n

        await egresssplice.relay(up_sock.fileno(), jail.sock.fileno(), self.idle_s, count)
        with contextlib.suppress(OSError):
            jail.write_eof()
        return True

    async def _send_request(  # noqa: PLR0913 (one request's parts)
        self,
        flow: Flow,
        conn: h11.Connection,
        request: h11.Request,
        reader: _Source,
        client: _Sink,
        up: _Sink,
        url: urllib.parse.SplitResult,
        port: int,
        default_port: int = 80,
    ) -> None:
        """The request alone, in origin form, to the decided host: Host from the URI (never
        the client's own), `Connection: close`, its body re-framed by h11."""
        if conn.they_are_waiting_for_100_continue:
            # The client waits for this before its body; the far end never sees the Expect.
            client.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        authority = flow.host if port == default_port else f"{flow.host}:{port}"
        path = (url.path or "/") + (f"?{url.query}" if url.query else "")
        headers = [(b"host", authority.encode())]
        headers += [(k, v) for k, v in request.headers if k.lower() not in HOP_HEADERS]
        headers.append((b"connection", b"close"))
        event = conn.next_event()  # the head is parsed: no body is EndOfMessage at once
        if isinstance(event, h11.EndOfMessage):
            # Written as h11 writes it, from parts h11 has checked (the method, the target's
            # path and query, the headers) and the decided host: an h11 writer would only
            # check them again, at a cost per flow (tests/test_egress_proxy.py compares).
            head = request_head(request.method, path.encode(), headers)
            up.write(head)
            flow.bytes_up += len(head)
            async with asyncio.timeout(self.idle_s):
                await up.drain()
            return
        out = h11.Connection(h11.CLIENT)
        data = out.send(h11.Request(method=request.method, target=path.encode(), headers=headers))
        up.write(data or b"")
        flow.bytes_up += len(data or b"")
        async with asyncio.timeout(self.idle_s):
            while True:
                if event is h11.NEED_DATA:
                    chunk = await reader.read(CHUNK)
                    if not chunk:
                        raise asyncio.IncompleteReadError(b"", None)
                    conn.receive_data(chunk)
                    event = conn.next_event()
                    continue
                if isinstance(event, h11.Data):
                    data = out.send(h11.Data(data=event.data))
                elif isinstance(event, h11.EndOfMessage):
                    data = out.send(h11.EndOfMessage())
                else:
                    return
                up.write(data or b"")
                flow.bytes_up += len(data or b"")
                await up.drain()
                if isinstance(event, h11.EndOfMessage):
                    return
                event = conn.next_event()

    async def _pipe(self, flow: Flow, jail: _Bare, far: _Bare) -> None:
        last = [time.monotonic()]
        with contextlib.suppress(ExceptionGroup):
            async with asyncio.TaskGroup() as group:
                group.create_task(self._pump(flow, jail, far, down=False, last=last))
                group.create_task(self._pump(flow, far, jail, down=True, last=last))

    async def _pump(
        self,
        flow: Flow,
        src: _Source,
        dst: _Sink,
        *,
        down: bool,
        last: list[float],
    ) -> None:
        """Copy src to dst until src ends (then half-close dst), or until neither way has moved
        a byte for the idle time; a dst that does not read within it ends the flow."""
        idle = self.idle_s
        while True:
            try:
                async with asyncio.timeout(idle):
                    data = await src.read(CHUNK)
            except TimeoutError:
                if time.monotonic() - last[0] >= idle:
                    raise
                continue
            if not data:
                with contextlib.suppress(OSError, RuntimeError):
                    if dst.can_write_eof():
                        dst.write_eof()
                return
            dst.write(data)
            if down:
                flow.bytes_down += len(data)
            else:
                flow.bytes_up += len(data)
            last[0] = time.monotonic()
            async with asyncio.timeout(idle):
                await dst.drain()

    # -- secrets (the hosts given them only) --------------------------------------------------
    def _secret(self, state: _Jail, flow: Flow) -> SecretHeaders | None:
        """The headers an allowed flow's requests get, when its host:port is given secrets."""
        if self.interception is None or flow.decision != ALLOWED:
            return None
        tenant = state.scope.secrets if state.scope is not None else None
        return self.interception.secret_for(flow.host, flow.port, tenant)

    async def _secure(self, state: _Jail, flow: Flow, up_writer: asyncio.StreamWriter, jail: _Bare) -> bool:
        """TLS to the real host, its certificate verified (system trust store or
        SANDBOX_EGRESS_UPSTREAM_CA), before the jail is answered; False (the flow failed, the
        jail told why) when it does not verify: a secret goes only to the host it names."""
        if self.interception is None:
            return False
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                await up_writer.start_tls(self.interception.ca.upstream, server_hostname=flow.host)
        except (OSError, TimeoutError) as exc:  # ssl.SSLError is an OSError
            detail = (
                getattr(exc, "verify_message", None) or getattr(exc, "reason", None) or type(exc).__name__
            )
            flow.decision = FAILED
            flow.why = f"TLS to {flow.host}:{flow.port} failed ({detail}); its secrets were not sent"
            await self._record(state, flow)
            jail.write(_reply(502, flow.why))
            return False
        return True

    async def _intercept(  # noqa: PLR0913 (one connection's parts)
        self,
        flow: Flow,
        secret: SecretHeaders,
        jail: _Bare,
        up_reader: asyncio.StreamReader,
        up_writer: asyncio.StreamWriter,
        hello: bytes,
    ) -> None:
        """The jail's TLS answered with the appliance CA's certificate for the host; its one
        request sent on with the secret headers (the jail's own of those names dropped), the
        reply relayed back. A client that does not trust the CA ends the flow, nothing sent."""
        if self.interception is None:
            return
        tls = TlsStream(self.interception.ca.context_for(flow.host), jail, jail, hello)
        try:
            async with asyncio.timeout(HEAD_TIMEOUT_S):
                await tls.handshake()
        except (ssl.SSLError, TimeoutError):
            flow.why = "the jail's client did not complete TLS with the appliance's CA"
            return
        try:
            got = await self._head(tls)
        except h11.RemoteProtocolError:
            tls.write(_reply(400, "not an HTTP/1.1 request (or a head over 16 KiB)"))
            return
        if got is None:
            return
        conn, request = got
        url = urllib.parse.urlsplit(request.target.decode("ascii", "replace"))
        try:
            same = not url.netloc or (
                url.scheme == "https" and url.hostname == flow.host and (url.port or 443) == flow.port
            )
        except ValueError:
            same = False
        if request.method == b"CONNECT" or not same:
            tls.write(_reply(400, f"a request in this tunnel is for {flow.host}:{flow.port} only"))
            return
        flow.injected = secret.names
        authority = flow.host if flow.port == 443 else f"{flow.host}:{flow.port}"
        request = with_secrets(request, secret, authority)
        await self._send_request(flow, conn, request, tls, tls, up_writer, url, flow.port, default_port=443)
        await self._pump(flow, up_reader, tls, down=True, last=[time.monotonic()])
        tls.close_notify()
        async with asyncio.timeout(CLOSE_GRACE_S):
            await jail.drain()
