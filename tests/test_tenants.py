"""Several tenants from SANDBOX_AUTH_TOKENS_FILE: parsing and limiter (pure), then a real server."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
import websockets

from appliance.core import tenants
from appliance.core.errors import Busy, SettingsError
from appliance.settings import from_env
from appliance_client.client import AsyncClient
from tests.support import Server, start_server

ALICE = "alice-" + secrets.token_hex(12)
BOB = "bob-" + secrets.token_hex(12)
CAROL = "carol-" + secrets.token_hex(12)

TOKENS_FILE = f"""
[[tenant]]
name = "alice"
token = "{ALICE}"
max_concurrency = 1
max_sessions = 1

[[tenant]]
name = "bob"
token_sha256 = "{hashlib.sha256(BOB.encode()).hexdigest()}"

[[tenant]]
name = "carol"
token = "{CAROL}"
runs_per_minute = 1
burst = 2
"""


# -- pure: parsing --------------------------------------------------------------------------


def test_a_tokens_file_gives_each_tenant_its_quotas_and_hashes_plain_tokens() -> None:
    found, plain = tenants.parse(TOKENS_FILE)
    by_name = {t.name: t for t in found}
    assert plain is True
    assert by_name["alice"].owner == hashlib.sha256(ALICE.encode()).hexdigest()
    assert by_name["alice"].max_concurrency == 1 and by_name["alice"].max_sessions == 1
    assert (
        by_name["bob"].owner == hashlib.sha256(BOB.encode()).hexdigest()
        and by_name["bob"].max_sessions is None
    )
    assert by_name["carol"].runs_per_minute == 1.0 and by_name["carol"].burst == 2
    assert ALICE not in repr(found)  # the owner hash is kept out of repr too


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        ("", "no \\[\\[tenant"),
        ("[[tenant]]\nname='a'\ntoken='x'*20", "not valid TOML"),
        (f"[[tenant]]\nname='a'\ntoken='{ALICE}'\nmax_sesions=1", "unknown keys"),
        (f"[[tenant]]\nname='a'\ntoken='{ALICE}'\ntoken_sha256='{'0' * 64}'", "exactly one"),
        ("[[tenant]]\nname='a'\ntoken='short'", "at least 16"),
        ("[[tenant]]\nname='a'\ntoken_sha256='xyz'", "64 hex"),
        ("[[tenant]]\nname='a b'\ntoken_sha256='" + "0" * 64 + "'", "name must be"),
        (f"[[tenant]]\nname='a'\ntoken='{ALICE}'\nmax_concurrency=0", "at least 1"),
        (f"[[tenant]]\nname='a'\ntoken='{ALICE}'\nruns_per_minute=-1", "above 0"),
        (f"[[tenant]]\nname='a'\ntoken='{ALICE}'\nburst=3", "burst needs runs_per_minute"),
        (f"[[tenant]]\nname='a'\ntoken='{ALICE}'\n[[tenant]]\nname='a'\ntoken='{BOB}'", "unique"),
        (f"[[tenant]]\nname='a'\ntoken='{ALICE}'\n[[tenant]]\nname='b'\ntoken='{ALICE}'", "share a token"),
        ("[other]\nx=1", "unknown top-level"),
        (f"[[tenant]]\nname='a'\ntoken='{ALICE}'\negress_allow_domains='x.com:443'", "must be a list"),
        (
            f"[[tenant]]\nname='a'\ntoken='{ALICE}'\negress_allow_domains=['ok.com:443', '*.com:443']",
            "tenant 'a': egress_allow_domains: '\\*.com:443' a wildcard over a top-level domain",
        ),
    ],
    # The same ids in every process (pytest-xdist compares them): the random token masked.
    ids=lambda value: str(value).replace(ALICE, "ALICE").replace(BOB, "BOB"),
)
def test_a_bad_tokens_file_is_refused_with_a_message_naming_the_problem(text: str, complaint: str) -> None:
    with pytest.raises(SettingsError, match=complaint):
        tenants.parse(text)


def test_a_tenant_may_narrow_egress_by_name() -> None:
    parsed, _ = tenants.parse(
        f"[[tenant]]\nname='a'\ntoken='{ALICE}'\negress_allow_domains=['API.x.com:443']"
    )
    held = tenants.Tenants(parsed)
    assert [str(r) for r in held.egress_rules(tenants.owner_of(ALICE)) or ()] == ["api.x.com:443"]
    assert held.egress_rules(tenants.owner_of(BOB)) is None


def test_no_error_message_repeats_a_token() -> None:
    with pytest.raises(SettingsError) as info:
        tenants.parse(f"[[tenant]]\nname='a'\ntoken='{ALICE}'\nmax_concurrency='x'")
    assert ALICE not in str(info.value)


def test_a_plain_token_file_readable_by_others_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "tokens.toml"
    path.write_text(TOKENS_FILE)
    path.chmod(0o644)
    with pytest.raises(SettingsError, match="chmod 600"):
        tenants.load(path)
    path.chmod(0o600)
    assert len(tenants.load(path)) == 3


def test_the_tokens_file_and_the_single_token_are_exclusive(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="not both"):
        from_env({"SANDBOX_AUTH_TOKEN": "x" * 20, "SANDBOX_AUTH_TOKENS_FILE": str(tmp_path / "t.toml")})


# -- pure: identify and limits ----------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_identify_finds_the_tenant_of_a_token_and_nobody_for_others() -> None:
    reg = tenants.Tenants(tenants.parse(TOKENS_FILE)[0])
    alice, bob = reg.identify(ALICE), reg.identify(BOB)
    assert alice is not None and alice.name == "alice"
    assert bob is not None and bob.name == "bob"
    assert reg.identify(ALICE + "x") is None and reg.identify(None) is None and reg.identify("") is None


def test_identify_compares_against_every_tenant_even_after_a_match(monkeypatch: pytest.MonkeyPatch) -> None:
    reg = tenants.Tenants(tenants.parse(TOKENS_FILE)[0])
    calls: list[int] = []
    real = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append(1)
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting)  # the module tenants.py calls
    for token in (ALICE, CAROL, "nobody-" + "x" * 20):
        calls.clear()
        reg.identify(token)
        assert len(calls) == 3, token


def test_the_token_bucket_allows_a_burst_then_refills_at_its_rate() -> None:
    clock = Clock()
    bucket = tenants.TokenBucket(capacity=2, rate_per_s=0.5, clock=clock)
    assert bucket.take() == 0.0 and bucket.take() == 0.0
    assert bucket.take() == pytest.approx(2.0)
    clock.now += 2.0
    assert bucket.take() == 0.0
    clock.now += 100.0  # never more than the capacity saved up
    assert [bucket.take() for _ in range(3)][:2] == [0.0, 0.0] and bucket.take() > 0


def test_a_request_over_the_concurrency_quota_is_busy_and_the_slot_returns() -> None:
    reg = tenants.Tenants(tenants.parse(TOKENS_FILE)[0])
    owner = tenants.owner_of(ALICE)
    with reg.request(owner):
        with pytest.raises(Busy, match="max_concurrency=1"), reg.request(owner):
            pass
        with reg.request(tenants.owner_of(BOB)):  # another tenant is not held back
            pass
    with reg.request(owner):
        pass


def test_a_request_over_the_rate_is_busy_until_the_bucket_refills() -> None:
    clock = Clock()
    reg = tenants.Tenants(tenants.parse(TOKENS_FILE)[0], clock=clock)
    owner = tenants.owner_of(CAROL)
    for _ in range(2):
        with reg.request(owner):
            pass
    with pytest.raises(Busy, match=r"rate limit.*runs_per_minute=1"), reg.request(owner):
        pass
    clock.now += 60
    with reg.request(owner):
        pass


def test_an_owner_that_is_no_tenant_passes_untouched() -> None:
    reg = tenants.Tenants(tenants.parse(TOKENS_FILE)[0])
    with reg.request("canary"), reg.request("canary"):
        pass


# -- a real server ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tenant_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("tenants")
    path = tmp / "tokens.toml"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(TOKENS_FILE)
    srv = start_server(tmp, SANDBOX_AUTH_TOKENS_FILE=str(path), SANDBOX_MAX_CONCURRENCY="4")
    yield srv
    srv.stop()


def http(server: Server, method: str, path: str, token: str | None, body: object = None) -> tuple[int, str]:
    return server.request(method, path, token, body, timeout=60)


async def test_a_wrong_or_missing_token_gets_401_before_the_upgrade(tenant_server: Server) -> None:
    for token in (None, "nobody-" + "x" * 20, ALICE[:-1]):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        with pytest.raises(websockets.exceptions.InvalidStatus) as info:
            async with websockets.connect(tenant_server.url, additional_headers=headers):
                pass
        assert info.value.response.status_code == 401
        assert http(tenant_server, "POST", "/v1/exec", token, {"code": "print(1)"})[0] == 401
    assert tenant_server.get("/healthz") == (200, '{"status": "ok"}')
    async with AsyncClient(tenant_server.url, token=BOB) as c:
        assert (await c.execute("print(6*7)")).stdout == "42\n"
    assert ALICE not in tenant_server.logs() and BOB not in tenant_server.logs()


async def test_each_tenant_sees_only_its_own_sessions(tenant_server: Server) -> None:
    async with (
        AsyncClient(tenant_server.url, token=ALICE) as alice,
        AsyncClient(tenant_server.url, token=BOB) as bob,
    ):
        opened = await alice.execute("secret = 'alice-only'", session="new")
        assert opened.status == "ok" and opened.session
        stolen = await bob.execute("print(secret)", session=opened.session)
        assert stolen.status == "rejected" and "no such session" in (stolen.message or "")
        mine = await bob.execute("x = 1", session="new")
        assert mine.status == "ok"
        again = await alice.execute("print(secret)", session=opened.session)
        assert again.stdout == "alice-only\n"
        code, _ = http(tenant_server, "DELETE", f"/v1/sessions/{opened.session}", BOB)
        assert code == 404
        assert (await alice.execute("print(secret)", session=opened.session)).status == "ok"
        for client, sid in ((alice, opened.session), (bob, mine.session)):
            assert sid is not None
            await client.close_session(sid)


async def test_a_tenant_over_its_session_quota_gets_busy_naming_the_quota(tenant_server: Server) -> None:
    async with (
        AsyncClient(tenant_server.url, token=ALICE, retry_busy_s=0) as alice,
        AsyncClient(tenant_server.url, token=BOB) as bob,
    ):
        first = await alice.execute("pass", session="new")
        assert first.status == "ok"
        second = await alice.execute("pass", session="new")
        assert second.status == "busy" and "max_sessions=1" in (second.message or "")
        code, body = http(tenant_server, "POST", "/v1/sessions", ALICE, {"code": "pass"})
        assert "max_sessions=1" in body, (code, body)
        others = await bob.execute("pass", session="new")  # the quota is per tenant
        assert others.status == "ok"
        assert first.session is not None
        await alice.close_session(first.session)
        assert others.session is not None
        await bob.close_session(others.session)
        third = await alice.execute("pass", session="new")  # a closed one frees the slot
        assert third.status == "ok"
        assert third.session is not None
        await alice.close_session(third.session)


async def test_a_tenant_over_its_concurrency_quota_gets_busy_while_others_run(tenant_server: Server) -> None:
    async with (
        AsyncClient(tenant_server.url, token=ALICE, retry_busy_s=0) as alice,
        AsyncClient(tenant_server.url, token=BOB) as bob,
    ):
        # The first run holds alice's one slot until it reads a line, which is sent at the end.
        up = asyncio.Event()
        slow = asyncio.create_task(
            alice.execute("print('a', flush=True)\nprint(input())", id="slow", on_stdout=lambda _: up.set())
        )
        await up.wait()
        over = await alice.execute("print('second')")
        assert over.status == "busy" and "max_concurrency=1" in (over.message or "")
        other = await bob.execute("print('bob runs')")
        assert other.stdout == "bob runs\n"
        await alice.stdin("slow", "done\n")
        assert (await slow).stdout == "a\ndone\n"
        assert (await alice.execute("print('after')")).stdout == "after\n"


async def test_a_tenant_over_its_rate_limit_gets_busy_on_websocket_and_rest(tenant_server: Server) -> None:
    async with AsyncClient(tenant_server.url, token=CAROL, retry_busy_s=0) as carol:
        results = [await carol.execute("print(1)") for _ in range(2)]
        assert [r.status for r in results] == ["ok", "ok"]
        over = await carol.execute("print(1)")
        assert over.status == "busy" and "rate limit" in (over.message or "")
    code, body = http(tenant_server, "POST", "/v1/exec", CAROL, {"code": "print(1)"})
    assert "rate limit" in body, (code, body)
    async with AsyncClient(tenant_server.url, token=BOB) as bob:  # others are not limited by it
        assert (await bob.execute("print(2)")).status == "ok"


def test_a_server_with_a_world_readable_plain_token_file_refuses_to_start(tmp_path: Path) -> None:
    path = tmp_path / "tokens.toml"
    path.write_text(TOKENS_FILE)
    path.chmod(0o644)
    with pytest.raises(RuntimeError, match="chmod 600") as info:
        start_server(tmp_path / "srv", SANDBOX_AUTH_TOKENS_FILE=str(path))
    assert ALICE not in str(info.value)


def test_a_refused_frame_costs_a_rate_token_and_an_empty_bucket_is_seen_without_taking() -> None:
    clock = Clock()
    reg = tenants.Tenants(tenants.parse(TOKENS_FILE)[0], clock=clock)
    carol, bob = tenants.owner_of(CAROL), tenants.owner_of(BOB)
    assert reg.over_rate(carol) is None
    reg.charge(carol)  # a refused frame ...
    with reg.request(carol):  # ... and one run use up carol's burst of 2
        pass
    refusal = reg.over_rate(carol)
    assert refusal is not None and "runs_per_minute=1" in refusal
    assert reg.over_rate(carol) == refusal  # looking takes nothing
    reg.charge(carol)  # charging an empty bucket is no error (and takes nothing either)
    with pytest.raises(Busy, match="rate limit"), reg.request(carol):
        pass
    clock.now += 60
    assert reg.over_rate(carol) is None
    reg.charge(bob)  # no rate limit: nothing to charge
    assert reg.over_rate(bob) is None and reg.over_rate("canary") is None
