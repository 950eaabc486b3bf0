"""The jail's network: none at all, or an egress allowlist (`SANDBOX_OPEN_PORTS`).

Without open ports every jail gets firejail's `--net=none` (a namespace holding only
loopback) and nothing here runs. With open ports each jail gets its own network
namespace, made by the appliance before firejail starts inside it:

    host netns                                  jail netns  sbx-<tag>-<jail id>
    sx<tag><index> 10.216.x.1/30  <-- veth -->  eth0 10.216.x.2/30, default via .1

Two filters, rendered from one frozen `EgressPolicy` by pure functions:
  * inside the jail's namespace (`jail_ruleset`): only TCP to an open port of an
    allowed address leaves; everything else is refused at once (TCP reset / ICMP
    admin-prohibited). Jailed code holds no capability over that namespace (it sits
    in a child user namespace with every capability dropped), so it cannot change it.
  * in the host's namespace (`host_ruleset`): the same decision again on the forward
    path, a drop of anything a jail sends to the host itself, and the masquerade.
    The second copy keeps the policy if either ruleset is flushed by someone else.

Private, loopback, link-local, CGNAT, multicast and reserved IPv4 ranges, the host's
own addresses and the jail links are refused unless a network is allowed on purpose
(`SANDBOX_EGRESS_ALLOW_NETS`; the host and the links never can be). IPv6 never leaves.
DNS: only when 53 is listed, and then only to the resolvers in `SANDBOX_EGRESS_DNS`.

Names mode (`SANDBOX_EGRESS_ALLOW_DOMAINS`): the jail's filter lets out only TCP to the
egress proxy on its own link's host end (appliance.sandbox.egressproxy), and DNS as above;
the proxy applies the address rules to IP literals itself (`address_refusal`).

The I/O part (`EgressNetwork`) installs the host table at startup (atomically, and
idempotently: a stale table of a crashed run is replaced), makes and removes one
namespace per jail, and removes everything at shutdown. Any failure stops startup
(StartupError) or refuses the jail (JailFailure): it never falls back to an open network.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import json
import logging
import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Network
from pathlib import Path
from typing import TYPE_CHECKING

from appliance.core.egress import Layers
from appliance.core.errors import JailFailure, StartupError
from appliance.settings import Settings

if TYPE_CHECKING:
    from appliance.sandbox.egressintercept import Interception
    from appliance.sandbox.egressproxy import EgressProxy, OnFlow

log = logging.getLogger("appliance.network")

# Never reachable unless allowed on purpose: "this network", RFC 1918, CGNAT, loopback,
# link-local (cloud metadata lives at 169.254.169.254), IETF protocol assignments,
# multicast, reserved and broadcast; and the metadata services outside those ranges:
# Azure's WireServer (168.63.129.16) and Alibaba Cloud's (100.100.100.200, also in CGNAT).
BLOCKED_V4 = tuple(
    ipaddress.IPv4Network(n)
    for n in (
        "0.0.0.0/8",
        "10.0.0.0/8",
        "100.64.0.0/10",
        "127.0.0.0/8",
        "169.254.0.0/16",
        "172.16.0.0/12",
        "192.0.0.0/24",
        "192.168.0.0/16",
        "224.0.0.0/4",
        "240.0.0.0/4",
        "168.63.129.16/32",
        "100.100.100.200/32",
    )
)
# The same ranges as (network, mask) integers: the proxy checks every address it connects to,
# and an `in` over IPv4Network objects costs a microsecond or more each.
Spans = tuple[tuple[int, int], ...]


def spans(nets: Sequence[IPv4Network]) -> Spans:
    return tuple((int(n.network_address), int(n.netmask)) for n in nets)


def within(address: IPv4Address, ranges: Spans) -> bool:
    value = int(address)
    return any(value & mask == net for net, mask in ranges)


BLOCKED_SPANS = spans(BLOCKED_V4)
DNS_PORT = 53
NETNS_DIR = Path("/run/netns")
JAIL_IF = "eth0"
MAX_LINKS = 0x10000  # the index is four hex digits of the host interface name
TOOLS = ("ip", "nft", "nsenter", "setpriv")
COMMAND_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class EgressPolicy:
    """What jails may reach. Built once at startup; every ruleset is rendered from it."""

    ports: tuple[int, ...]  # TCP ports open outward (53 means DNS, see dns)
    allow_nets: tuple[IPv4Network, ...]  # carved out of BLOCKED_V4 on purpose
    dns: tuple[IPv4Address, ...]  # the only resolvers; only when 53 is in ports
    subnet: IPv4Network  # jail links are /30s carved from it
    host_addresses: tuple[IPv4Address, ...]  # the host's own addresses, never reachable
    # Names mode (SANDBOX_EGRESS_ALLOW_DOMAINS): the proxy's port on each link's host end, and
    # then the proxy is a jail's only way out (its address rules apply to IP literals there).
    proxy_port: int | None = None

    @property
    def tag(self) -> str:
        """Eight hex digits naming this server's links, namespaces and table (subnets never overlap)."""
        return f"{int(self.subnet.network_address):08x}"

    @property
    def table(self) -> str:
        return f"appliance_{self.tag}"

    @property
    def if_prefix(self) -> str:
        return f"sx{self.tag}"

    @property
    def netns_prefix(self) -> str:
        return f"sbx-{self.tag}-"

    @property
    def max_links(self) -> int:
        return min(MAX_LINKS, self.subnet.num_addresses // 4)

    @property
    def tcp_ports(self) -> tuple[int, ...]:
        """Ports open to any allowed address; 53 only ever goes to the resolvers."""
        return tuple(p for p in self.ports if p != DNS_PORT)

    @property
    def never(self) -> tuple[IPv4Network, ...]:
        """Addresses no allowance can open: the host itself and the jail links."""
        return (*(IPv4Network(a) for a in self.host_addresses), self.subnet)

    @functools.cached_property
    def refusal_spans(self) -> tuple[Spans, Spans]:
        """`never` and `allow_nets` as integer spans, made once (the policy never changes)."""
        return spans(self.never), spans(self.allow_nets)


@dataclass(frozen=True)
class JailLink:
    """One jail's namespace and veth pair."""

    index: int
    netns: str
    host_if: str
    gateway: IPv4Address  # host end
    address: IPv4Address  # jail end (eth0)

    @property
    def netns_path(self) -> Path:
        return NETNS_DIR / self.netns


def policy_of(settings: Settings, host_addresses: Sequence[IPv4Address]) -> EgressPolicy:
    """The policy the settings describe, given the host's own addresses."""
    return EgressPolicy(
        ports=tuple(sorted(set(settings.open_ports))),
        allow_nets=tuple(IPv4Network(n) for n in settings.egress_allow_nets),
        dns=tuple(IPv4Address(a) for a in settings.egress_dns),
        subnet=IPv4Network(settings.egress_subnet),
        host_addresses=tuple(sorted(set(host_addresses))),
        proxy_port=settings.egress_proxy_port if settings.egress_allow_domains else None,
    )


def link_for(policy: EgressPolicy, index: int, jail_id: str) -> JailLink:
    """The link with this index: the index-th /30 of the subnet (.1 host end, .2 jail end)."""
    if not 0 <= index < policy.max_links:
        raise ValueError(f"link index {index} outside 0..{policy.max_links - 1}")
    base = policy.subnet.network_address + 4 * index
    return JailLink(
        index=index,
        netns=f"{policy.netns_prefix}{jail_id}",
        host_if=f"{policy.if_prefix}{index:04x}",
        gateway=base + 1,
        address=base + 2,
    )


def _set(items: Sequence[object]) -> str:
    return "{ " + ", ".join(str(i) for i in items) + " }"


def address_refusal(policy: EgressPolicy, address: IPv4Address) -> str | None:
    """Why no allowance may reach this address (the same ranges the rulesets refuse), or None.

    The proxy asks this of every address it is asked for or a name resolves to."""
    never, allowed = policy.refusal_spans
    if within(address, never):
        return "the host itself or a jail link"
    if within(address, allowed):
        return None
    if within(address, BLOCKED_SPANS):
        return "a private, loopback, link-local, metadata or reserved address"
    return None


def proxy_env(policy: EgressPolicy, link: JailLink) -> tuple[tuple[str, str], ...]:
    """The proxy settings every HTTP client in the jail reads (names mode), or none."""
    if policy.proxy_port is None:
        return ()
    url = f"http://{link.gateway}:{policy.proxy_port}"
    local = "localhost,127.0.0.1,::1"
    return tuple(
        (name, value)
        for key, value in (("http_proxy", url), ("https_proxy", url), ("no_proxy", local))
        for name in (key, key.upper())
    )


def _decisions(policy: EgressPolicy, accept: str, refuse: str) -> list[str]:
    """The egress decision, first match wins; shared by both rulesets. In names mode nothing
    but DNS to the named resolvers (when 53 is listed) leaves directly: the rest goes
    through the proxy, which applies the address rules itself."""
    rules = [f"ip daddr {_set(policy.never)} {refuse}"]
    if policy.dns and DNS_PORT in policy.ports:
        rules += [
            f"ip daddr {_set(policy.dns)} udp dport {DNS_PORT} {accept}",
            f"ip daddr {_set(policy.dns)} tcp dport {DNS_PORT} {accept}",
        ]
    if policy.proxy_port is not None:
        return [*rules, refuse]
    if policy.tcp_ports and policy.allow_nets:
        rules.append(f"ip daddr {_set(policy.allow_nets)} tcp dport {_set(policy.tcp_ports)} {accept}")
    rules.append(f"ip daddr {_set(BLOCKED_V4)} {refuse}")
    if policy.tcp_ports:
        rules.append(f"meta nfproto ipv4 tcp dport {_set(policy.tcp_ports)} {accept}")
    rules.append(refuse)
    return rules


def jail_ruleset(policy: EgressPolicy, link: JailLink | None = None) -> str:
    """The nftables ruleset loaded inside each jail's namespace (`nft -f -`); in names mode
    the jail's own proxy listener (its link's host end) is the one host address it reaches."""
    proxy = []
    if policy.proxy_port is not None and link is not None:
        proxy = [f"    ip daddr {link.gateway} tcp dport {policy.proxy_port} accept"]
    lines = [
        "table inet jail {",
        "  chain refuse {",
        "    meta l4proto tcp reject with tcp reset",
        "    reject with icmpx type admin-prohibited",
        "  }",
        "  chain input {",
        "    type filter hook input priority 0; policy drop;",
        '    iifname "lo" accept',
        "    ct state established,related accept",
        "  }",
        "  chain forward {",
        "    type filter hook forward priority 0; policy drop;",
        "  }",
        "  chain output {",
        "    type filter hook output priority 0; policy drop;",
        '    oifname "lo" accept',
        "    ct state established,related accept",
        "    meta nfproto ipv6 jump refuse",
        *proxy,
        *(f"    {rule}" for rule in _decisions(policy, "accept", "jump refuse")),
        "  }",
        "}",
    ]
    return "\n".join(lines) + "\n"


def host_ruleset(policy: EgressPolicy) -> str:
    """The host's table for this server, replacing any stale copy atomically (`nft -f -`)."""
    jails = f'"{policy.if_prefix}*"'
    proxy: list[str] = []
    if policy.proxy_port is not None:
        # The proxy's listeners: from a jail's own link only; refused from anywhere else,
        # the host's own processes included (the proxy also checks which jail it is).
        tcp = f"ip daddr {policy.subnet} tcp dport {policy.proxy_port}"
        proxy = [
            f"    iifname {jails} {tcp} accept",
            f"    {tcp} reject with tcp reset",
        ]
    lines = [
        # Declaring then deleting makes the load idempotent: one transaction, no gap.
        f"table inet {policy.table} {{}}",
        f"delete table inet {policy.table}",
        f"table inet {policy.table} {{",
        "  chain input {",
        "    type filter hook input priority -10; policy accept;",
        *proxy,
        f"    iifname {jails} drop",
        "  }",
        "  chain forward {",
        "    type filter hook forward priority -10; policy accept;",
        f"    iifname {jails} jump egress",
        f"    oifname {jails} ct state established,related accept",
        f"    oifname {jails} drop",
        "  }",
        "  chain egress {",
        "    ct state established,related accept",
        "    meta nfproto ipv6 drop",
        *(f"    {rule}" for rule in _decisions(policy, "accept", "drop")),
        "  }",
        "  chain postrouting {",
        "    type nat hook postrouting priority srcnat; policy accept;",
        f"    ip saddr {policy.subnet} oifname != {jails} masquerade",
        "  }",
        "}",
    ]
    return "\n".join(lines) + "\n"


def link_commands(link: JailLink) -> list[list[str]]:
    """The `ip` commands that make a jail's namespace and veth pair, in order."""
    ns = link.netns
    return [
        ["ip", "netns", "add", ns],
        ["ip", "link", "add", link.host_if, "type", "veth", "peer", "name", JAIL_IF, "netns", ns],
        ["ip", "addr", "add", f"{link.gateway}/30", "dev", link.host_if],
        ["ip", "link", "set", link.host_if, "up"],
        ["ip", "-n", ns, "link", "set", "lo", "up"],
        ["ip", "-n", ns, "addr", "add", f"{link.address}/30", "dev", JAIL_IF],
        ["ip", "-n", ns, "link", "set", JAIL_IF, "up"],
        ["ip", "-n", ns, "route", "add", "default", "via", str(link.gateway)],
    ]


def enter_argv(link: JailLink, uid: int, gid: int) -> list[str]:
    """The prefix that starts firejail inside the jail's namespace as the sandbox uid.

    Firejail's own `--net`/`--netns` are root-only under Debian's `restricted-network`,
    so the server (root) enters the namespace itself, then drops to the sandbox uid with
    no groups and no capabilities before the setuid firejail starts: the same identity a
    jail without network gets.
    """
    return [
        "nsenter",
        f"--net={link.netns_path}",
        "--",
        "setpriv",
        f"--reuid={uid}",
        f"--regid={gid}",
        "--clear-groups",
        "--inh-caps=-all",
        "--",
    ]


def expected_interfaces(egress: bool) -> tuple[str, ...]:
    """The interfaces a jail must see: loopback only, or loopback and its link."""
    return ("eth0", "lo") if egress else ("lo",)


# -- I/O -----------------------------------------------------------------------------------


def _run(argv: Sequence[str], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    # S603: ip/nft argv built in this module, fixed PATH
    return subprocess.run(  # noqa: S603
        list(argv),
        input=stdin,
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
        check=False,
        env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
    )


def host_addresses() -> tuple[IPv4Address, ...]:
    """Every IPv4 address of the host's namespace (`ip -j addr`)."""
    out = _run(["ip", "-j", "-4", "addr", "show"])
    if out.returncode != 0:
        raise StartupError(f"egress: cannot list the host's addresses: {out.stderr.strip()}")
    found = {
        IPv4Address(a["local"])
        for link in json.loads(out.stdout or "[]")
        for a in link.get("addr_info", [])
        if a.get("family") == "inet"
    }
    return tuple(sorted(found))


def check_prerequisites() -> None:
    """Fail closed before anything is made: root, the tools, a place for named namespaces.

    Called before the host is inspected, so `/run/netns` exists when the jail's view of
    /run is decided (and is hidden from jails like the rest of /run).
    """
    if os.geteuid() != 0:
        raise StartupError(
            "SANDBOX_OPEN_PORTS needs the server to run as root (it makes network "
            "namespaces and nftables rules; the container needs CAP_NET_ADMIN)"
        )
    missing = [t for t in TOOLS if shutil.which(t, path="/usr/sbin:/usr/bin:/sbin:/bin") is None]
    if missing:
        raise StartupError(
            f"SANDBOX_OPEN_PORTS needs {', '.join(missing)}: apt-get install iproute2 nftables util-linux"
        )
    NETNS_DIR.mkdir(mode=0o755, parents=True, exist_ok=True)


class EgressNetwork:
    """Installs and removes one server's egress filter and its jails' namespaces, and in
    names mode the proxy's listener on each jail's link (appliance.sandbox.egressproxy)."""

    def __init__(
        self, settings: Settings, on_flow: OnFlow | None = None, interception: Interception | None = None
    ) -> None:
        self.settings = settings
        self.policy: EgressPolicy | None = None
        self.proxy: EgressProxy | None = None
        self._on_flow = on_flow
        self.interception = interception  # names mode: the hosts given secrets, the appliance's CA
        self._free: set[int] = set()
        self._next = 0
        self._lock = asyncio.Lock()

    async def start(self) -> EgressPolicy:
        """Install the host side; raise StartupError if it cannot be installed exactly."""
        policy = await asyncio.to_thread(self._start)
        if policy.proxy_port is not None:
            from appliance.sandbox.egressproxy import EgressProxy
            from appliance.sandbox.egressresolve import Resolver

            s = self.settings
            self.proxy = EgressProxy(
                policy,
                Layers(s.egress_allow_domains),
                Resolver([str(a) for a in policy.dns]),
                s.egress_idle_ms / 1000,
                self._on_flow,
                self.interception,
            )
            if self.interception is not None:  # the bundle jails trust, read-only in each
                await asyncio.to_thread(self.interception.ca.stage, s.tmp_root / "appliance")
        return policy

    def _start(self) -> EgressPolicy:
        check_prerequisites()
        policy = policy_of(self.settings, host_addresses())
        self._purge(policy)  # a crashed run's namespaces and links, before the overlap check
        self._check_subnet_free(policy)
        forward = Path("/proc/sys/net/ipv4/ip_forward")
        try:
            forward.write_text("1\n")
            enabled = forward.read_text().strip() == "1"
        except OSError as exc:
            raise StartupError(
                f"egress: cannot enable net.ipv4.ip_forward ({exc.strerror}); "
                "run with CAP_NET_ADMIN and a writable /proc/sys/net"
            ) from exc
        if not enabled:
            raise StartupError("egress: net.ipv4.ip_forward did not stay on")
        out = _run(["nft", "-f", "-"], host_ruleset(policy))
        if out.returncode != 0:
            raise StartupError(f"egress: the host filter could not be installed: {out.stderr.strip()[-400:]}")
        check = _run(["nft", "list", "table", "inet", policy.table])
        if check.returncode != 0 or "masquerade" not in check.stdout:
            raise StartupError("egress: the host filter is not in place after loading it")
        self.policy = policy
        log.info(
            "egress filter installed",
            extra={
                "ports": list(policy.ports),
                "allow_nets": [str(n) for n in policy.allow_nets],
                "dns": [str(a) for a in policy.dns],
                "subnet": str(policy.subnet),
                "table": policy.table,
            },
        )
        return policy

    def _check_subnet_free(self, policy: EgressPolicy) -> None:
        out = _run(["ip", "-j", "-4", "route", "show", "table", "all"])
        if out.returncode != 0:
            raise StartupError(f"egress: cannot list routes: {out.stderr.strip()}")
        for route in json.loads(out.stdout or "[]"):
            dst = route.get("dst", "")
            if not dst or dst == "default" or route.get("type") in ("broadcast", "local"):
                continue
            with contextlib.suppress(ValueError):
                if IPv4Network(dst, strict=False).overlaps(policy.subnet):
                    raise StartupError(
                        f"SANDBOX_EGRESS_SUBNET {policy.subnet} overlaps the host's route to {dst} "
                        f"(dev {route.get('dev')}); choose a free subnet"
                    )
        for address in policy.host_addresses:
            if address in policy.subnet:
                raise StartupError(f"SANDBOX_EGRESS_SUBNET {policy.subnet} holds the host address {address}")

    async def attach(self, jail_id: str) -> JailLink:
        """Make a jail's namespace, link and filter; JailFailure (and nothing left) if any step fails."""
        if self.policy is None:
            raise RuntimeError("EgressNetwork.attach before start()")
        async with self._lock:
            index = min(self._free) if self._free else self._next
            if index >= self.policy.max_links:
                raise JailFailure("no free jail network link (SANDBOX_EGRESS_SUBNET is full)")
            self._free.discard(index)
            self._next = max(self._next, index + 1)
        link = link_for(self.policy, index, jail_id)
        try:
            await asyncio.to_thread(self._make, link, jail_ruleset(self.policy, link))
            if self.proxy is not None:
                try:
                    await self.proxy.listen(link)
                except OSError as exc:
                    log.error("egress proxy cannot listen", extra={"link": link.host_if, "error": str(exc)})
                    raise JailFailure(
                        "the jail's egress proxy could not listen; the run was refused"
                    ) from exc
        except BaseException:
            await self.release(link)
            raise
        return link

    @staticmethod
    def _make(link: JailLink, ruleset: str) -> None:
        for argv in link_commands(link):
            out = _run(argv)
            if out.returncode != 0:
                log.error("jail network setup failed", extra={"command": argv, "error": out.stderr.strip()})
                raise JailFailure("the jail's network could not be set up; the run was refused")
        out = _run(["ip", "netns", "exec", link.netns, "nft", "-f", "-"], ruleset)
        if out.returncode != 0:
            log.error("jail filter failed", extra={"netns": link.netns, "error": out.stderr.strip()})
            raise JailFailure("the jail's network filter could not be installed; the run was refused")

    async def release(self, link: JailLink) -> None:
        """Remove a jail's namespace and link (its processes are already gone); free the index."""
        if self.proxy is not None:
            await self.proxy.unlisten(link)
        await asyncio.to_thread(self._remove, link.netns, link.host_if)
        async with self._lock:
            self._free.add(link.index)

    @staticmethod
    def _remove(netns: str, host_if: str) -> None:
        # Deleting the namespace destroys its veth end, and with it the host end; the
        # explicit delete covers a namespace still pinned by a straggler.
        _run(["ip", "netns", "delete", netns])
        _run(["ip", "link", "delete", host_if])

    def _purge(self, policy: EgressPolicy) -> None:
        names = os.listdir(NETNS_DIR) if NETNS_DIR.is_dir() else []
        stale = [n for n in names if n.startswith(policy.netns_prefix)]
        out = _run(["ip", "-j", "link", "show"])
        links = [x.get("ifname", "") for x in json.loads(out.stdout or "[]")] if out.returncode == 0 else []
        for netns in stale:
            _run(["ip", "netns", "delete", netns])
        for name in links:
            if name.startswith(policy.if_prefix):
                _run(["ip", "link", "delete", name])
        if stale:
            log.info("purged stale jail namespaces", extra={"netns": stale})

    async def close(self) -> None:
        """Remove every namespace and link of this server, and its host table."""
        policy = self.policy
        if policy is None:
            return
        if self.proxy is not None:
            await self.proxy.close()
        if self.interception is not None:
            self.interception.ca.unstage()
        await asyncio.to_thread(self._purge, policy)
        await asyncio.to_thread(_run, ["nft", "delete", "table", "inet", policy.table])
        self.policy = None
