"""The self-check judge refuses any jail that is less than configured."""

from __future__ import annotations

from typing import Any

from appliance.sandbox.checks import Expected, problems

EXPECTED = Expected(uid=1001, host_pid_ns="pid:[1]", host_net_ns="net:[2]")
GOOD: dict[str, Any] = {
    "uid": 1001,
    "euid": 1001,
    "gid": 1001,
    "no_new_privs": 1,
    "seccomp": 2,
    "cap_eff": "0000000000000000",
    "pid_ns": "pid:[9]",
    "net_ns": "net:[8]",
    "interfaces": ["lo"],
    "cwd": "/workspace",
    "home": "/workspace",
}


def test_a_properly_jailed_report_has_no_problems() -> None:
    assert problems(GOOD, EXPECTED) == []


def test_an_unjailed_report_is_refused_for_every_missing_layer() -> None:
    unjailed = {
        **GOOD,
        "no_new_privs": 0,
        "seccomp": 0,
        "pid_ns": "pid:[1]",
        "net_ns": "net:[2]",
        "interfaces": ["eth0", "lo"],
    }
    found = " | ".join(problems(unjailed, EXPECTED))
    for fragment in ("NoNewPrivs", "Seccomp", "PID namespace", "network namespace", "interfaces"):
        assert fragment in found


def test_root_or_another_uid_is_refused() -> None:
    assert any("root" in p for p in problems({**GOOD, "uid": 0, "euid": 0}, EXPECTED))
    assert problems({**GOOD, "uid": 1000, "euid": 1000}, EXPECTED)


def test_capabilities_or_a_wrong_home_are_refused() -> None:
    assert problems({**GOOD, "cap_eff": "00000000a80425fb"}, EXPECTED)
    assert problems({**GOOD, "home": "/root"}, EXPECTED)


def test_garbage_is_refused() -> None:
    assert problems(None, EXPECTED) == ["no self-check report"]


def test_a_jail_whose_etc_lists_more_than_it_may_is_refused() -> None:
    limited = Expected(
        uid=1001, host_pid_ns="pid:[1]", host_net_ns="net:[2]", etc=frozenset({"hosts", "ssl"})
    )
    assert problems({**GOOD, "etc": ["ssl"]}, limited) == []  # an entry the host lacks is no risk
    for etc in (["hosts", "shadow", "ssl"], ["firejail", "hosts"], None):
        found = problems({**GOOD, "etc": etc}, limited)
        assert len(found) == 1 and found[0].startswith(f"/etc lists {etc!r}"), found
