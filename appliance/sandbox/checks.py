"""Judge a jail's self-check report against what this host's jails must be. Pure."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Expected:
    uid: int
    host_pid_ns: str
    host_net_ns: str
    interfaces: tuple[str, ...] = ("lo",)  # egress mode adds the jail's link (network.expected_interfaces)
    etc: frozenset[str] | None = None  # the most a jail's /etc may list (None: not checked)


def problems(report: Any, expected: Expected) -> list[str]:  # noqa: C901 (one comparison per fact of the jail's self-check report)
    """Every way the report falls short; empty when the jail is exactly as configured."""
    if not isinstance(report, dict):
        return ["no self-check report"]
    found: list[str] = []
    if report.get("uid") != expected.uid or report.get("euid") != expected.uid:
        found.append(f"runs as uid {report.get('uid')}/{report.get('euid')}, not {expected.uid}")
    if report.get("uid") == 0 or report.get("euid") == 0:
        found.append("runs as root")
    if report.get("no_new_privs") != 1:
        found.append(f"NoNewPrivs is {report.get('no_new_privs')}, not 1")
    if report.get("seccomp") != 2:
        found.append(f"Seccomp is {report.get('seccomp')}, not 2 (filter)")
    if report.get("cap_eff") not in ("0000000000000000",):
        found.append(f"effective capabilities {report.get('cap_eff')!r} are not empty")
    if not report.get("pid_ns") or report.get("pid_ns") == expected.host_pid_ns:
        found.append("shares the server's PID namespace")
    if not report.get("net_ns") or report.get("net_ns") == expected.host_net_ns:
        found.append("shares the server's network namespace")
    interfaces = report.get("interfaces")
    if not isinstance(interfaces, list) or any(name not in expected.interfaces for name in interfaces):
        found.append(f"network interfaces {interfaces!r} besides {list(expected.interfaces)!r}")
    if report.get("cwd") != "/workspace" or report.get("home") != "/workspace":
        found.append(f"cwd/HOME are {report.get('cwd')!r}/{report.get('home')!r}, not /workspace")
    etc = report.get("etc")
    if expected.etc is not None and (not isinstance(etc, list) or not expected.etc.issuperset(etc)):
        found.append(f"/etc lists {etc!r}, more than {sorted(expected.etc)!r}")
    return found
