"""Egress by name: the allowlist rules (`SANDBOX_EGRESS_ALLOW_DOMAINS`, a tenant's
`egress_allow_domains`, a request's `egress.allow`) and the decision they make. Pure.

A rule is `host:port`: an exact name (`api.example.com:443`), a wildcard that matches
names below a domain but not the domain itself (`*.pypi.org:443`), or an IPv4 literal
(`203.0.113.7:443`, exact). Names are compared lower case, without a trailing dot.

Layers narrow: a flow is allowed by name only when every layer given (the server's, the
tenant's, the request's) has a rule for it, so a tenant or a request can never open what
the server does not. Whether the address a name resolves to may be reached at all is the
sandbox's question (its blocklist), asked after this one.

Live approval (`egress.ask`): a flow refused by the request's own layer alone, and only by
it, may be asked about; the client's answer can open what the request left out, never what
the server's or the tenant's lists do not hold. Answers may be remembered for the run or
the session (`Approvals`).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from appliance.core.errors import SettingsError

LABEL = r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?"
NAME_RE = re.compile(rf"^{LABEL}(\.{LABEL})*$")
MAX_NAME = 253
MAX_RULES = 1000  # one layer's rules; a longer list is a mistake, not a policy


@dataclass(frozen=True, slots=True)
class Rule:
    """One allowlist entry."""

    host: str  # the name (for a wildcard: the domain below which names match), or an IPv4 literal
    port: int
    wildcard: bool = False

    def __str__(self) -> str:
        return f"{'*.' if self.wildcard else ''}{self.host}:{self.port}"

    def matches(self, host: str, port: int) -> bool:
        if port != self.port:
            return False
        if self.wildcard:
            return host.endswith("." + self.host)
        return host == self.host


Rules = tuple[Rule, ...]


def normal_host(raw: str) -> str | None:
    """`raw` as rules compare it (lower case, no trailing dot), or None if it is no host name
    or IPv4 literal (IPv6, an empty label, a character outside letters, digits and '-')."""
    host = raw.strip().lower().removesuffix(".")
    if not host or len(host) > MAX_NAME:
        return None
    if is_ipv4(host):
        return str(ipaddress.IPv4Address(host))
    return host if NAME_RE.match(host) else None


_DOTTED = frozenset("0123456789.")


def is_ipv4(host: str) -> bool:
    # Most hosts are names: an IPv4 literal is digits and dots only, so those are refused
    # without building (and failing) an address, which a flow would otherwise do twice.
    if not host or not _DOTTED.issuperset(host):
        return False
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        return False
    return True


def parse_rule(entry: str) -> Rule:
    """One `host:port` entry; ValueError saying what is wrong with it."""
    text = entry.strip()
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError("needs a port, like api.example.com:443 (1-65535)")
    wildcard = host.startswith("*.")
    if wildcard:
        host = host[2:]
    if "*" in host:
        raise ValueError("a wildcard may only be a leading '*.'")
    name = normal_host(host)
    if name is None:
        raise ValueError("is not a host name or an IPv4 address (IPv6 egress is not supported)")
    if wildcard and is_ipv4(name):
        raise ValueError("a wildcard needs a domain name, not an address")
    if wildcard and "." not in name:
        raise ValueError("a wildcard over a top-level domain would match too much")
    return Rule(name, int(port), wildcard)


def parse_rules(entries: Iterable[str], source: str) -> Rules:
    """Every entry parsed; SettingsError naming `source` and the first entry that is wrong."""
    rules: list[Rule] = []
    for entry in entries:
        if not entry.strip():
            continue
        try:
            rule = parse_rule(entry)
        except ValueError as exc:
            raise SettingsError(f"{source}: {entry.strip()!r} {exc}") from None
        if rule not in rules:
            rules.append(rule)
    if len(rules) > MAX_RULES:
        raise SettingsError(f"{source}: more than {MAX_RULES} rules")
    return tuple(rules)


def first_match(rules: Rules, host: str, port: int) -> Rule | None:
    for rule in rules:
        if rule.matches(host, port):
            return rule
    return None


Narrowing = tuple[tuple[str, Rules], ...]  # (who, rules) after the server's: "tenant", "request"


@dataclass(frozen=True, slots=True)
class Layers:
    """The rules a run's flows are held to: the server's, then any narrowing ones."""

    server: Rules
    narrowing: Narrowing = ()
    ask: bool = False  # a flow refused by the request's layer alone is asked about, not refused

    def narrowed(self, who: str, rules: Rules | None) -> Layers:
        return self if rules is None else Layers(self.server, (*self.narrowing, (who, rules)), self.ask)


@dataclass(frozen=True, slots=True)
class Verdict:
    """Whether a name (or literal) may be asked for at all, before any address is looked at."""

    allowed: bool
    rule: str | None  # the server's rule that allowed it
    why: str | None  # why it was refused
    askable: bool = False  # refused by the request's own list alone, and the request asks


def decide_name(layers: Layers, host: str, port: int, ip_allowed: bool = False) -> Verdict:
    """The by-name decision for host:port (host already `normal_host`).

    `ip_allowed`: the host is an IPv4 literal the server's address rules (SANDBOX_OPEN_PORTS,
    SANDBOX_EGRESS_ALLOW_NETS) already allow; narrowing layers still apply to it.
    """
    rule = first_match(layers.server, host, port)
    if rule is None and not ip_allowed:
        return Verdict(False, None, f"{host}:{port} is not in the allowlist")
    for who, rules in layers.narrowing:
        if first_match(rules, host, port) is None:
            askable = layers.ask and who == REQUEST and layers.narrowing[-1][0] == REQUEST
            return Verdict(False, None, f"{host}:{port} is not in the {who}'s allowlist", askable)
    return Verdict(True, str(rule) if rule is not None else "address rules", None)


REQUEST = "request"  # the request's own layer: the last one, and the only one asking may open


def describe(rules: Sequence[Rule]) -> list[str]:
    return [str(r) for r in rules]


ALLOWED = "allowed"
DENIED = "denied"


@dataclass(slots=True)
class Flow:
    """One connection a run asked the proxy for, and what became of it (`done.egress`)."""

    host: str  # as asked for (a name, or an IPv4 literal)
    port: int
    decision: str  # ALLOWED or DENIED
    rule: str | None = None  # the server rule that allowed it ("address rules" for a literal)
    why: str | None = None  # why it was denied
    address: str | None = None  # the checked address it was connected to
    bytes_up: int = 0  # from the jail
    bytes_down: int = 0  # to the jail
    duration_ms: int = 0
    asked: str | None = None  # the egress_request's flow id, when the client was asked
    started: float = 0.0  # monotonic seconds; not reported
    injected: tuple[str, ...] | None = None  # the secret headers the proxy set (names only, never values)

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "host": self.host,
            "port": self.port,
            "decision": self.decision,
            "bytes_up": self.bytes_up,
            "bytes_down": self.bytes_down,
            "duration_ms": self.duration_ms,
        }
        for key in ("rule", "why", "address", "asked"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        if self.injected:
            out["injected"] = list(self.injected)
        return out


# -- live approval (`egress.ask`) -------------------------------------------------------------
RUN = "run"
SESSION = "session"
MAX_PENDING_ASKS = 8  # hosts one run may wait on an answer for at once; past it, refused at once
MAX_ASKS = 64  # egress_request frames one run may send; past it, refused at once
MAX_REMEMBERED = 1024  # answers one run or session remembers; past it, later ones are not kept


@dataclass(frozen=True, slots=True)
class Answer:
    """What became of an ask: allowed (with the rule the ledger names) or refused (why)."""

    allow: bool
    rule: str | None = None
    why: str | None = None


class Approvals:
    """Answers remembered by host and port, for a run or a session (scope `run`/`session`)."""

    def __init__(self, scope: str) -> None:
        self.scope = scope
        self._known: dict[tuple[str, int], bool] = {}

    def remember(self, host: str, port: int, allow: bool) -> None:
        if (host, port) in self._known or len(self._known) < MAX_REMEMBERED:
            self._known[(host, port)] = allow

    def answer(self, host: str, port: int) -> Answer | None:
        allow = self._known.get((host, port))
        if allow is None:
            return None
        if allow:
            return Answer(True, rule=f"approved by the client for the {self.scope}")
        return Answer(False, why=f"the client denied it for the {self.scope}")


def ask_refusal(pending: int, asked: int, answerable: bool) -> str | None:
    """Why a new host cannot be asked about now (the run's bounds, nobody to answer), or None."""
    if not answerable:
        return (
            "no client that can answer follows this run (egress.ask needs a WebSocket client "
            "that answers egress_request frames; REST and MCP callers cannot)"
        )
    if pending >= MAX_PENDING_ASKS:
        return f"{MAX_PENDING_ASKS} hosts already wait for the client's answer"
    if asked >= MAX_ASKS:
        return f"this run has asked the client about {MAX_ASKS} hosts already"
    return None
