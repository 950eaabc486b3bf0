"""The egress proxy's pure parts: allowlist rules and layers, the address blocklist, the
ClientHello's server name, and the settings that hold them."""

from __future__ import annotations

import json
import ssl
from ipaddress import IPv4Address, IPv4Network
from pathlib import Path

import h11
import pytest
from hypothesis import given
from hypothesis import strategies as st

from appliance.core.egress import Flow, Layers, Rule, decide_name, parse_rule, parse_rules
from appliance.core.errors import SettingsError, StartupError
from appliance.sandbox import tlshello
from appliance.sandbox.egressproxy import HOP_HEADERS, request_head
from appliance.sandbox.network import (
    BLOCKED_V4,
    EgressPolicy,
    address_refusal,
    host_ruleset,
    jail_ruleset,
    link_for,
)
from appliance.settings import from_env


def test_rules_parse_exact_wildcard_and_literal() -> None:
    rules = parse_rules(["API.Example.com.:443", "*.pypi.org:443", "203.0.113.7:8443", ""], "X")
    assert rules == (
        Rule("api.example.com", 443),
        Rule("pypi.org", 443, wildcard=True),
        Rule("203.0.113.7", 8443),
    )
    assert [str(r) for r in rules] == ["api.example.com:443", "*.pypi.org:443", "203.0.113.7:8443"]


@pytest.mark.parametrize(
    ("entry", "why"),
    [
        ("api.example.com", "needs a port"),
        ("api.example.com:0", "needs a port"),
        ("api.example.com:70000", "needs a port"),
        ("a*.example.com:443", "leading '*.'"),
        ("*.*.example.com:443", "leading '*.'"),
        ("*.com:443", "top-level domain"),
        ("*.10.0.0.1:443", "needs a domain name"),
        ("[::1]:443", "IPv6"),
        ("exa mple.com:443", "not a host name"),
        ("-bad.example.com:443", "not a host name"),
    ],
)
def test_a_malformed_rule_stops_startup_naming_the_entry(entry: str, why: str) -> None:
    with pytest.raises(SettingsError) as caught:
        from_env({"SANDBOX_EGRESS_ALLOW_DOMAINS": f"ok.example.com:443, {entry}"})
    assert caught.value.message.startswith(f"SANDBOX_EGRESS_ALLOW_DOMAINS: {entry!r}"), caught.value.message
    assert why in caught.value.message


def test_a_wildcard_matches_below_its_domain_only() -> None:
    rule = parse_rule("*.pypi.org:443")
    assert rule.matches("files.pypi.org", 443) and rule.matches("a.b.pypi.org", 443)
    assert not rule.matches("pypi.org", 443)
    assert not rule.matches("evilpypi.org", 443)
    assert not rule.matches("files.pypi.org", 80)
    assert not rule.matches("files.pypi.org.evil.com", 443)


def test_layers_only_narrow() -> None:
    server = parse_rules(["a.example.com:443", "*.example.org:443"], "s")
    layers = Layers(server).narrowed("tenant", parse_rules(["a.example.com:443", "x.example.net:443"], "t"))
    assert decide_name(layers, "a.example.com", 443).allowed
    # The tenant lists it, the server does not: still refused.
    refused = decide_name(layers, "x.example.net", 443)
    assert not refused.allowed and refused.why == "x.example.net:443 is not in the allowlist"
    # The server allows it, the tenant does not.
    narrowed = decide_name(layers, "b.example.org", 443)
    assert not narrowed.allowed and narrowed.why == "b.example.org:443 is not in the tenant's allowlist"
    assert decide_name(Layers(server), "b.example.org", 443).rule == "*.example.org:443"


def _policy(allow_nets: tuple[IPv4Network, ...] = (), proxy_port: int | None = 3128) -> EgressPolicy:
    return EgressPolicy(
        ports=(8080,),
        allow_nets=allow_nets,
        dns=(),
        subnet=IPv4Network("10.216.0.0/16"),
        host_addresses=(IPv4Address("192.0.2.10"),),
        proxy_port=proxy_port,
    )


@pytest.mark.parametrize(
    "address",
    [
        "169.254.169.254",
        "168.63.129.16",
        "100.100.100.200",
        "127.0.0.1",
        "10.1.2.3",
        "192.168.1.1",
        "0.0.0.0",
    ],
)
def test_private_loopback_and_metadata_addresses_are_refused(address: str) -> None:
    assert address_refusal(_policy(), IPv4Address(address)) is not None


def test_the_refusal_is_exactly_the_ranges_at_every_edge() -> None:
    """The proxy checks addresses on integer spans: at each range's first and last address and
    one either side, the answer is what membership in the networks themselves gives."""
    policy = _policy(allow_nets=(IPv4Network("10.9.0.0/16"),))
    nets = (*policy.never, *policy.allow_nets, *BLOCKED_V4)
    edges = {int(n.network_address) + d for n in nets for d in (-1, 0)} | {
        int(n.broadcast_address) + d for n in nets for d in (0, 1)
    }
    for value in sorted(e for e in edges if 0 <= e < 2**32):
        address = IPv4Address(value)
        if any(address in n for n in policy.never):
            expected: str | None = "the host itself or a jail link"
        elif any(address in n for n in policy.allow_nets):
            expected = None
        elif any(address in n for n in BLOCKED_V4):
            expected = "a private, loopback, link-local, metadata or reserved address"
        else:
            expected = None
        assert address_refusal(policy, address) == expected, address


def test_the_host_and_the_links_are_refused_even_when_allowed_on_purpose() -> None:
    policy = _policy(allow_nets=(IPv4Network("10.0.0.0/8"), IPv4Network("192.0.2.0/24")))
    assert address_refusal(policy, IPv4Address("10.1.2.3")) is None
    assert address_refusal(policy, IPv4Address("10.216.0.1")) == "the host itself or a jail link"
    assert address_refusal(policy, IPv4Address("192.0.2.10")) == "the host itself or a jail link"
    assert address_refusal(policy, IPv4Address("198.51.100.1")) is None


def test_names_mode_rulesets_open_the_jails_proxy_and_nothing_else() -> None:
    policy = _policy()
    link = link_for(policy, 3, "abc")
    jail = jail_ruleset(policy, link)
    assert f"ip daddr {link.gateway} tcp dport 3128 accept" in jail
    assert "tcp dport { 8080 } accept" not in jail  # address rules apply in the proxy, not here
    host = host_ruleset(policy)
    assert 'iifname "sx0ad80000*" ip daddr 10.216.0.0/16 tcp dport 3128 accept' in host
    assert "ip daddr 10.216.0.0/16 tcp dport 3128 reject with tcp reset" in host
    open_ports = jail_ruleset(_policy(proxy_port=None), link)
    assert "tcp dport { 8080 } accept" in open_ports and "3128" not in open_ports


def _client_hello(server_name: str | None) -> bytes:
    ctx = ssl.create_default_context()
    if server_name is None:
        ctx.check_hostname = False
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ctx.wrap_bio(incoming, outgoing, server_hostname=server_name)
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def test_the_server_name_is_read_from_a_real_client_hello() -> None:
    hello = _client_hello("API.example.com")
    assert tlshello.parse(hello) == tlshello.Hello(sni="api.example.com")
    assert tlshello.parse(_client_hello(None)) == tlshello.Hello(sni=None)
    for cut in (1, 5, 40, len(hello) - 1):
        assert tlshello.parse(hello[:cut]).more
    # Split over two records, as a client may.
    body = hello[5:]
    split = b"\x16\x03\x01" + (100).to_bytes(2, "big") + body[:100]
    split += b"\x16\x03\x01" + (len(body) - 100).to_bytes(2, "big") + body[100:]
    assert tlshello.parse(split).sni == "api.example.com"


def test_what_is_not_a_client_hello_is_refused() -> None:
    assert tlshello.parse(b"GET / HTTP/1.1\r\n").problem is not None
    assert tlshello.parse(b"\x16\x03\x01\x00\x05\x02\x00\x00\x01\x00").problem is not None  # ServerHello
    hello = bytearray(_client_hello("a.example.com"))
    hello[5 + 4 + 2 + 32] = 0xFF  # a session id length past the end
    assert tlshello.parse(bytes(hello)).problem is not None
    endless = b"\x16\x03\x01\x40\x00" + b"\x01\xff\xff\xff" + b"\x00" * 16380
    assert tlshello.parse(endless).problem == "the ClientHello is too long"


@given(st.binary(max_size=600))
def test_the_hello_parser_never_raises(data: bytes) -> None:
    got = tlshello.parse(b"\x16\x03\x01" + data)
    assert got.more or got.problem is not None or got.sni is None or isinstance(got.sni, str)


def test_dns_for_the_proxy_needs_no_open_port_53() -> None:
    s = from_env({"SANDBOX_EGRESS_ALLOW_DOMAINS": "a.example.com:443", "SANDBOX_EGRESS_DNS": "192.0.2.53"})
    assert s.egress_dns == ("192.0.2.53",) and s.egress_allow_domains == (Rule("a.example.com", 443),)
    with pytest.raises(SettingsError, match="SANDBOX_EGRESS_DNS"):
        from_env({"SANDBOX_EGRESS_DNS": "192.0.2.53"})


def test_the_audit_log_must_be_the_servers_own_and_private(tmp_path: Path) -> None:
    from appliance.runtime.egresslog import EgressAudit
    from appliance.runtime.metrics import Metrics

    shared = tmp_path / "shared.jsonl"
    shared.write_text("")
    shared.chmod(0o644)
    with pytest.raises(StartupError, match="readable by it alone"):
        EgressAudit(Metrics(), shared)
    link = tmp_path / "link.jsonl"
    link.symlink_to(tmp_path / "elsewhere.jsonl")
    with pytest.raises(StartupError, match="cannot open"):
        EgressAudit(Metrics(), link)
    audit = EgressAudit(Metrics(), tmp_path / "new.jsonl")
    audit(Flow("a.example.com", 443, "denied", why="not listed"), None)
    audit.close()
    line = json.loads((tmp_path / "new.jsonl").read_text())
    assert line["host"] == "a.example.com" and line["request"] is None and line["why"] == "not listed"
    assert (tmp_path / "new.jsonl").stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize(
    "head",
    [
        b"GET http://api.example.com/ HTTP/1.1\r\nHost: api.example.com\r\n\r\n",
        b"GET http://api.example.com:8080/a/b?q=1&r=%20x HTTP/1.1\r\nUser-Agent: curl/8.0\r\n"
        b"Host: h\r\nAccept: */*\r\nX-Empty:\r\nX-Tab: a\tb\r\nProxy-Connection: keep-alive\r\n\r\n",
        b"DELETE http://api.example.com/item/7 HTTP/1.1\r\nHost: h\r\nContent-Length: 0\r\nCookie: a=b; c=d\r\n\r\n",
        b"HEAD http://api.example.com/x HTTP/1.0\r\nACCEPT-encoding: identity\r\n\r\n",
    ],
)
def test_a_bodyless_request_head_is_written_as_h11_writes_it(head: bytes) -> None:
    """The proxy writes a request with no body itself, from what h11's parser took: the bytes
    must be those h11's writer makes of the same parts."""
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(head)
    request = conn.next_event()
    assert isinstance(request, h11.Request)
    assert isinstance(conn.next_event(), h11.EndOfMessage)
    headers = [(b"host", b"api.example.com")]
    headers += [(k, v) for k, v in request.headers if k.lower() not in HOP_HEADERS]
    headers.append((b"connection", b"close"))
    target = b"/path?q=1"
    expected = h11.Connection(h11.CLIENT).send(
        h11.Request(method=request.method, target=target, headers=headers)
    )
    assert request_head(request.method, target, headers) == expected
