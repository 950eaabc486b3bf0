"""The transports' pure guards: which origins pass, which bound addresses count as exposed."""

from __future__ import annotations

from appliance.api.transport import exposed_without_token, origin_allowed

ALLOWED = ("https://app.example.com", "http://localhost:3000")


def test_no_origin_passes_and_only_listed_origins_do() -> None:
    assert origin_allowed([], ())  # websocat, curl, the SDK: no Origin header at all
    assert origin_allowed(["https://app.example.com"], ALLOWED)
    for origin in (
        "https://evil.example",
        "null",
        "https://app.example.com.evil.example",
        "http://app.example.com",
        "https://APP.example.com",
        "http://localhost:3001",
        "",
    ):
        assert not origin_allowed([origin], ALLOWED), origin
    assert not origin_allowed(["https://app.example.com"], ())  # none allowed by default
    # Two Origin headers: each must be allowed.
    assert not origin_allowed(["https://app.example.com", "https://evil.example"], ALLOWED)


def test_only_loopback_addresses_are_not_exposed() -> None:
    assert exposed_without_token(["127.0.0.1", "::1", "127.0.0.2", "localhost"]) == []
    assert exposed_without_token(["0.0.0.0", "::", "10.1.2.3", "127.0.0.1", "fe80::1%eth0"]) == [
        "0.0.0.0",
        "::",
        "10.1.2.3",
        "fe80::1%eth0",
    ]
