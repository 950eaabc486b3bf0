"""The egress policy rendered to rules, argv and checks: pure, no namespace is made.

The rulesets are also given to `nft --check` (a dry run: parsed and validated by the
kernel's nftables, nothing installed), so a syntax slip fails here, not at startup.
"""

from __future__ import annotations

import subprocess
from ipaddress import IPv4Address, IPv4Network
from pathlib import Path

import pytest

from appliance.core.errors import SettingsError
from appliance.sandbox import checks, network
from appliance.sandbox.firejail import render_argv
from appliance.sandbox.spec import JailLimits, JailSpec
from appliance.settings import Settings, from_env

POLICY = network.EgressPolicy(
    ports=(53, 443, 8080),
    allow_nets=(IPv4Network("10.1.2.0/24"),),
    dns=(IPv4Address("198.18.0.53"),),
    subnet=IPv4Network("10.216.0.0/16"),
    host_addresses=(IPv4Address("127.0.0.1"), IPv4Address("192.0.2.2")),
)


def output_chain(ruleset: str) -> list[str]:
    lines = ruleset.splitlines()
    start = lines.index("  chain output {")
    end = lines.index("  }", start)
    return [line.strip() for line in lines[start + 1 : end]]


def nft_check(ruleset: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["nft", "--check", "-f", "-"], input=ruleset, capture_output=True, text=True, timeout=20
    )


def test_settings_parse_ports_networks_resolvers_and_subnet() -> None:
    s = from_env(
        {
            "SANDBOX_OPEN_PORTS": "443, 53,443",
            "SANDBOX_EGRESS_ALLOW_NETS": "10.1.2.0/24",
            "SANDBOX_EGRESS_DNS": "198.18.0.53",
            "SANDBOX_EGRESS_SUBNET": "10.99.0.0/20",
        }
    )
    assert s.open_ports == (53, 443) and s.egress_allow_nets == ("10.1.2.0/24",)
    assert s.egress_dns == ("198.18.0.53",) and s.egress_subnet == "10.99.0.0/20"
    policy = network.policy_of(s, [IPv4Address("192.0.2.2")])
    assert policy.tcp_ports == (443,) and policy.tag == "0a630000"


@pytest.mark.parametrize(
    ("env", "complaint"),
    [
        ({"SANDBOX_OPEN_PORTS": "53"}, "SANDBOX_EGRESS_DNS names no resolver"),
        ({"SANDBOX_EGRESS_DNS": "198.18.0.53"}, "does not list 53"),
        (
            {"SANDBOX_OPEN_PORTS": "80", "SANDBOX_EGRESS_ALLOW_NETS": "10.1.2.3/24"},
            "SANDBOX_EGRESS_ALLOW_NETS",
        ),
        ({"SANDBOX_OPEN_PORTS": "80", "SANDBOX_EGRESS_ALLOW_NETS": "fc00::/7"}, "IPv6"),
        ({"SANDBOX_OPEN_PORTS": "53", "SANDBOX_EGRESS_DNS": "resolver"}, "SANDBOX_EGRESS_DNS"),
        ({"SANDBOX_OPEN_PORTS": "80", "SANDBOX_EGRESS_SUBNET": "10.9.9.0/30"}, "too small"),
        ({"SANDBOX_OPEN_PORTS": "80,70000"}, "SANDBOX_OPEN_PORTS"),
    ],
)
def test_bad_egress_settings_stop_startup_naming_the_variable(env: dict[str, str], complaint: str) -> None:
    with pytest.raises(SettingsError, match=complaint):
        from_env(env)


def test_the_host_and_the_links_are_refused_before_any_allowance() -> None:
    rules = output_chain(network.jail_ruleset(POLICY))
    never = next(i for i, r in enumerate(rules) if "192.0.2.2/32" in r)
    allow = next(i for i, r in enumerate(rules) if "10.1.2.0/24" in r)
    blocked = next(i for i, r in enumerate(rules) if "169.254.0.0/16" in r)
    open_ports = next(i for i, r in enumerate(rules) if r.startswith("meta nfproto ipv4 tcp dport"))
    assert "10.216.0.0/16" in rules[never] and rules[never].endswith("jump refuse")
    assert never < allow < blocked < open_ports
    assert rules[-1] == "jump refuse"  # default: refuse


def test_port_53_goes_only_to_the_resolvers_and_never_as_a_general_port() -> None:
    rules = output_chain(network.jail_ruleset(POLICY))
    dns = [r for r in rules if "dport 53" in r]
    assert dns == [
        "ip daddr { 198.18.0.53 } udp dport 53 accept",
        "ip daddr { 198.18.0.53 } tcp dport 53 accept",
    ]
    assert "meta nfproto ipv4 tcp dport { 443, 8080 } accept" in rules


def test_every_private_loopback_link_local_and_metadata_range_is_blocked() -> None:
    blocked = {str(n) for n in network.BLOCKED_V4}
    for net in (
        "10.0.0.0/8",
        "172.16.0.0/12",
        "192.168.0.0/16",
        "127.0.0.0/8",
        "169.254.0.0/16",
        "100.64.0.0/10",
        "0.0.0.0/8",
        "224.0.0.0/4",
    ):
        assert net in blocked
    for metadata in (
        "169.254.169.254",
        "168.63.129.16",
        "100.100.100.200",
    ):  # IMDS, Azure WireServer, Alibaba
        assert any(IPv4Address(metadata) in n for n in network.BLOCKED_V4), metadata
    assert "meta nfproto ipv6 jump refuse" in output_chain(network.jail_ruleset(POLICY))


def test_without_allowances_no_rule_opens_a_private_network() -> None:
    bare = network.EgressPolicy(
        ports=(443,), allow_nets=(), dns=(), subnet=IPv4Network("10.216.0.0/16"), host_addresses=()
    )
    rules = output_chain(network.jail_ruleset(bare))
    accepts = [r for r in rules if r.endswith("accept")]
    assert accepts == [
        'oifname "lo" accept',
        "ct state established,related accept",
        "meta nfproto ipv4 tcp dport { 443 } accept",
    ]


@pytest.mark.host  # nft --check needs CAP_NET_ADMIN
def test_both_rulesets_are_valid_nftables() -> None:
    for ruleset in (network.jail_ruleset(POLICY), network.host_ruleset(POLICY)):
        result = nft_check(ruleset)
        assert result.returncode == 0, result.stderr


def test_the_host_table_replaces_a_stale_copy_in_one_transaction_and_masquerades_only_jails() -> None:
    text = network.host_ruleset(POLICY)
    lines = text.splitlines()
    assert lines[:3] == [
        "table inet appliance_0ad80000 {}",
        "delete table inet appliance_0ad80000",
        "table inet appliance_0ad80000 {",
    ]
    assert 'iifname "sx0ad80000*" drop' in text  # nothing from a jail reaches the host itself
    assert 'ip saddr 10.216.0.0/16 oifname != "sx0ad80000*" masquerade' in text


def test_links_are_consecutive_slash_30s_with_short_interface_names() -> None:
    first, second = network.link_for(POLICY, 0, "aa"), network.link_for(POLICY, 1, "bb")
    assert (str(first.gateway), str(first.address)) == ("10.216.0.1", "10.216.0.2")
    assert (str(second.gateway), str(second.address)) == ("10.216.0.5", "10.216.0.6")
    assert second.host_if == "sx0ad800000001" and len(second.host_if) <= 15
    assert second.netns == "sbx-0ad80000-bb" and second.netns_path == Path("/run/netns/sbx-0ad80000-bb")
    last = network.link_for(POLICY, POLICY.max_links - 1, "cc")
    assert last.address in POLICY.subnet and last.gateway in POLICY.subnet
    with pytest.raises(ValueError, match="outside"):
        network.link_for(POLICY, POLICY.max_links, "dd")


def test_link_commands_make_the_namespace_before_anything_inside_it() -> None:
    link = network.link_for(POLICY, 2, "ee")
    cmds = network.link_commands(link)
    assert cmds[0] == ["ip", "netns", "add", "sbx-0ad80000-ee"]
    assert ["ip", "-n", link.netns, "route", "add", "default", "via", "10.216.0.9"] == cmds[-1]


def _spec(netns: str | None, dns: tuple[str, ...] = ()) -> JailSpec:
    return JailSpec(
        workdir=Path("/tmp/w"),
        uid=1001,
        gid=1001,
        python=Path("/usr/bin/python3"),
        driver=Path("/rt/driver.py"),
        limits=JailLimits(memory_mb=512, max_procs=64, file_mb=10, open_files=256),
        readable=(),
        root_entries=(),
        run_entries=(),
        env=(),
        netns=netns,
        dns=dns,
    )


def test_firejail_makes_no_network_namespace_of_its_own_in_egress_mode() -> None:
    plain = render_argv(_spec(None), 5)
    egress = render_argv(_spec("sbx-x-y", ("198.18.0.53",)), 5)
    assert "--net=none" in plain and not any(a.startswith("--dns") for a in plain)
    assert not any(a.startswith(("--net", "--netns")) for a in egress)
    assert "--dns=198.18.0.53" in egress


def test_the_jail_is_entered_as_the_sandbox_uid_with_no_groups_or_capabilities() -> None:
    link = network.link_for(POLICY, 0, "ff")
    argv = network.enter_argv(link, 1001, 1002)
    assert argv == [
        "nsenter",
        "--net=/run/netns/sbx-0ad80000-ff",
        "--",
        "setpriv",
        "--reuid=1001",
        "--regid=1002",
        "--clear-groups",
        "--inh-caps=-all",
        "--",
    ]


def test_the_self_check_accepts_the_link_only_in_egress_mode() -> None:
    report = {
        "uid": 1001,
        "euid": 1001,
        "no_new_privs": 1,
        "seccomp": 2,
        "cap_eff": "0000000000000000",
        "pid_ns": "pid:[2]",
        "net_ns": "net:[2]",
        "interfaces": ["eth0", "lo"],
        "cwd": "/workspace",
        "home": "/workspace",
    }
    plain = checks.Expected(uid=1001, host_pid_ns="pid:[1]", host_net_ns="net:[1]")
    egress = checks.Expected(
        uid=1001, host_pid_ns="pid:[1]", host_net_ns="net:[1]", interfaces=network.expected_interfaces(True)
    )
    assert checks.problems(report, egress) == []
    assert any("eth0" in p for p in checks.problems(report, plain))
    assert any(
        "wlan0" in p for p in checks.problems({**report, "interfaces": ["eth0", "lo", "wlan0"]}, egress)
    )


def test_the_default_settings_open_nothing() -> None:
    assert Settings().open_ports == () and from_env({}).open_ports == ()
