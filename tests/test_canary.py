"""The readiness canary's judgement is pure: any sign of a weaker jail keeps /readyz red."""

from __future__ import annotations

import json

from appliance.runtime.canary import ALLOWED_JAIL_ENV, CANARY_CODE, judge, params_file

GOOD = {
    "uid": 1001,
    "env": ["HOME", "PATH"],
    "shadow": "denied",
    "loopback": "refused",
    "reached": [],
    "NoNewPrivs": "1",
    "Seccomp": "2",
}


def test_a_confined_report_passes() -> None:
    assert judge("ok", json.dumps(GOOD), {1001}) == []


def test_each_weakness_is_named() -> None:
    cases: dict[str, tuple[dict[str, object], str]] = {
        "uid": ({"uid": 0}, "uid 0"),
        "shadow": ({"shadow": "readable"}, "/etc/shadow"),
        "loopback": ({"loopback": "connected"}, "loopback"),
        "reached": ({"reached": ["169.254.169.254:80"]}, "metadata"),
        "seccomp": ({"Seccomp": "0"}, "seccomp"),
        "env": ({"env": ["HOME", "AWS_SECRET_ACCESS_KEY"]}, "AWS_SECRET_ACCESS_KEY"),
    }
    for change, fragment in cases.values():
        found = judge("ok", json.dumps({**GOOD, **change}), {1001})
        assert found and fragment in found[0], (change, found)


def test_a_failed_or_garbled_run_is_not_ready() -> None:
    assert judge("internal", "", {1001}) == ["canary run ended internal"]
    assert judge("ok", "not json", {1001}) == ["canary printed no report"]


def test_the_probe_gets_the_servers_port_and_host_addresses_as_data_not_source() -> None:
    params = params_file(4321, ["192.0.2.7"])
    assert json.loads(params.data) == {"port": 4321, "hosts": ["192.0.2.7"]}
    assert "4321" not in CANARY_CODE and "192.0.2.7" not in CANARY_CODE
    compile(CANARY_CODE, "<canary>", "exec")
    assert "AWS_SECRET_ACCESS_KEY" not in ALLOWED_JAIL_ENV
