"""How the egress proxy turns a name into IPv4 addresses: the host's resolver, or the
resolvers in `SANDBOX_EGRESS_DNS` asked directly (dnspython). Only A records: egress is
IPv4 only. The addresses are checked and connected to by the proxy itself, never looked
up a second time, so a name cannot answer one address to the check and another to the
connection.

A named resolver's answer is kept for the least TTL of its chain (the CNAMEs and the A
records: what the resolver itself would keep it for), at most CACHE_MAX_S, for at most
CACHE_NAMES names (the oldest answer goes first). What is kept is the answer, never a
decision: the proxy checks every address of it against its policy's blocklist at each
use, so a name that rebinds to a private address is refused as soon as the answer that
says so is asked for. The host's resolver (getaddrinfo) gives no TTL, so its answers are
kept for HOST_CACHE_S only: long enough that a run's burst of flows to one host (a pip
install, a loop of requests) costs one lookup, through the loop's executor, not one each;
short enough that a name whose address changes is followed within seconds. A failed lookup
is never kept, by either resolver.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable, Sequence
from ipaddress import IPv4Address

import dns.asyncresolver
import dns.exception
import dns.nameserver
import dns.resolver

RESOLVE_TIMEOUT_S = 5.0
MAX_ADDRESSES = 16  # a longer answer is cut: every kept address is checked
CACHE_NAMES = 1024  # answers kept, each for its TTL and at most CACHE_MAX_S
CACHE_MAX_S = 60.0
HOST_CACHE_S = 2.0  # the host resolver's answers, which carry no TTL


class ResolveError(Exception):
    """The name has no usable answer (why in the message)."""


class Resolver:
    def __init__(
        self,
        servers: Sequence[str] = (),
        timeout_s: float = RESOLVE_TIMEOUT_S,
        *,
        port: int = 53,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.timeout_s = timeout_s
        self._clock = clock  # what the kept answers' TTLs are counted on
        self._dns: dns.asyncresolver.Resolver | None = None
        if servers:
            resolver = dns.asyncresolver.Resolver(configure=False)
            resolver.nameservers = [dns.nameserver.Do53Nameserver(s, port) for s in servers]
            resolver.lifetime = timeout_s
            resolver.timeout = timeout_s / 2
            self._dns = resolver
        self._cache: dict[str, tuple[float, list[IPv4Address]]] = {}

    async def resolve(self, name: str) -> list[IPv4Address]:
        """The name's IPv4 addresses, in the answer's order (at most MAX_ADDRESSES)."""
        now = self._clock()
        kept = self._cache.get(name)
        if kept is not None:
            if kept[0] > now:
                return kept[1][:MAX_ADDRESSES]
            del self._cache[name]
        found = await (self._ask_dns(name, now) if self._dns is not None else self._ask_host(name, now))
        if not found:
            raise ResolveError(f"{name} has no IPv4 address")
        return found[:MAX_ADDRESSES]

    def _keep(self, name: str, until: float, found: list[IPv4Address]) -> None:
        """An answer kept until `until`: only ever what was asked (each use checks every
        address of it again), the oldest of CACHE_NAMES dropped first."""
        if len(self._cache) >= CACHE_NAMES:
            self._cache.pop(next(iter(self._cache)))
        self._cache[name] = (until, found)

    async def _ask_dns(self, name: str, now: float) -> list[IPv4Address]:
        """The named resolvers' answer, kept for its chain's least TTL (at most CACHE_MAX_S)."""
        if self._dns is None:
            return []
        try:
            answer = await self._dns.resolve(name, "A", search=False)
        except dns.resolver.NXDOMAIN:
            raise ResolveError(f"{name} does not exist (NXDOMAIN)") from None
        except dns.resolver.NoAnswer:
            raise ResolveError(f"{name} has no IPv4 address") from None
        except dns.exception.Timeout:
            raise ResolveError(f"no answer for {name} in time") from None
        except dns.exception.DNSException as exc:
            raise ResolveError(f"{name} could not be resolved ({type(exc).__name__})") from None
        found = [IPv4Address(r.address) for r in answer]
        # The chain's least TTL: a CNAME of a short TTL to a name whose A records live
        # long is asked again when the CNAME expires, not when the A records do.
        ttl = min(float(answer.chaining_result.minimum_ttl), CACHE_MAX_S)
        if ttl > 0 and found:
            self._keep(name, now + ttl, found)
        return found

    async def _ask_host(self, name: str, now: float) -> list[IPv4Address]:
        """The host resolver's answer (getaddrinfo, in the loop's executor), kept for
        HOST_CACHE_S."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.timeout_s):
                infos = await loop.getaddrinfo(name, None, family=socket.AF_INET, type=socket.SOCK_STREAM)
        except TimeoutError:
            raise ResolveError(f"no answer for {name} in time") from None
        except OSError as exc:
            raise ResolveError(f"{name} could not be resolved ({exc.strerror or exc})") from None
        found: list[IPv4Address] = []
        for info in infos:
            address = IPv4Address(info[4][0])
            if address not in found:
                found.append(address)
        if found:
            self._keep(name, now + HOST_CACHE_S, found)
        return found
