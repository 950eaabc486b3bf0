"""The E2B dialect under abuse, against a real server: huge and deeply nested bodies, another
tenant's sandbox, a wrong access token, and a client that never reads its NDJSON stream."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import httpx
import pytest
from e2b import NotFoundException, SandboxException
from e2b_code_interpreter import Sandbox

from tests.support import Server, scaled, start_server
from tests.test_e2b_sdk import ALICE, BOB, point_sdk, tenants_file, until

STALL_MS = 1000


@pytest.fixture(scope="module")
def e2bsrv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("e2b-attacks")
    srv = start_server(
        tmp,
        SANDBOX_AUTH_TOKENS_FILE=str(tenants_file(tmp)),
        SANDBOX_POOL_SIZE="2",
        SANDBOX_CLIENT_STALL_MS=str(STALL_MS),
        SANDBOX_MAX_MESSAGE_BYTES=str(1024 * 1024),
    )
    yield srv
    srv.stop()


@pytest.fixture(autouse=True)
def sdk_env(e2bsrv: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    point_sdk(monkeypatch, e2bsrv)


@pytest.fixture
def sandbox() -> Iterator[Sandbox]:
    sb = Sandbox.create()
    yield sb
    sb.kill()


def sandbox_headers(sb: Sandbox, token: str | None = None) -> dict[str, str]:
    return {
        "E2b-Sandbox-Id": sb.sandbox_id,
        "E2b-Sandbox-Port": "49999",
        "X-Access-Token": token if token is not None else str(sb._envd_access_token),
    }


def test_a_huge_body_is_refused_and_the_server_stays_up(e2bsrv: Server, sandbox: Sandbox) -> None:
    big = json.dumps({"templateID": "base", "metadata": {"k": "v" * (2 * 1024 * 1024)}})
    resp = httpx.post(
        e2bsrv.http + "/e2b/v2/sandboxes",
        content=big,
        headers={"X-API-Key": ALICE, "Content-Type": "application/json"},
        timeout=scaled(30),
    )
    assert resp.status_code == 413
    resp = httpx.post(
        e2bsrv.http + "/e2b/execute",
        content=json.dumps({"code": "#" * (2 * 1024 * 1024)}),
        headers=sandbox_headers(sandbox),
        timeout=scaled(30),
    )
    assert resp.status_code == 413
    assert sandbox.run_code("1 + 1").text == "2"


def test_deeply_nested_bodies_are_refused(e2bsrv: Server, sandbox: Sandbox) -> None:
    nested = '{"templateID": "base", "metadata": ' + "[" * 100_000 + "]" * 100_000 + "}"
    resp = httpx.post(
        e2bsrv.http + "/e2b/v2/sandboxes", content=nested, headers={"X-API-Key": ALICE}, timeout=scaled(30)
    )
    assert resp.status_code == 400
    assert "nested" in resp.json()["message"]
    resp = httpx.post(
        e2bsrv.http + "/e2b/execute",
        content='{"code": "1", "env_vars": ' + "{" * 5000 + "}" * 5000 + "}",
        headers=sandbox_headers(sandbox),
        timeout=scaled(30),
    )
    assert resp.status_code == 400
    assert sandbox.run_code("2 + 2").text == "4"


def test_badly_typed_fields_are_refused_not_crashed(e2bsrv: Server, sandbox: Sandbox) -> None:
    for body in (
        [1, 2],
        {"templateID": 5},
        {"templateID": "base", "timeout": "soon"},
        {"templateID": "base", "envVars": {"A=B": "x"}},
        {"templateID": "base", "metadata": {"k": 1}},
    ):
        resp = httpx.post(
            e2bsrv.http + "/e2b/v2/sandboxes", json=body, headers={"X-API-Key": ALICE}, timeout=scaled(30)
        )
        assert resp.status_code == 400, body
    resp = httpx.post(
        e2bsrv.http + "/e2b/execute", json={"code": 1}, headers=sandbox_headers(sandbox), timeout=scaled(30)
    )
    assert resp.status_code == 400


def test_another_tenants_sandbox_is_not_found_not_leaked(e2bsrv: Server, sandbox: Sandbox) -> None:
    never = "0" * 20
    for sandbox_id in (sandbox.sandbox_id, never):
        with pytest.raises(NotFoundException):
            Sandbox.get_info(sandbox_id, api_key=BOB)
        with pytest.raises(NotFoundException):
            Sandbox.connect(sandbox_id, api_key=BOB)
        with pytest.raises(NotFoundException):
            Sandbox.set_timeout(sandbox_id, 5, api_key=BOB)
        assert Sandbox.kill(sandbox_id, api_key=BOB) is False
    assert sandbox.sandbox_id not in [s.sandbox_id for s in Sandbox.list(api_key=BOB).next_items()]
    # The API's answers to a stranger are the same for a live id and one that never was.
    answers = []
    for sandbox_id in (sandbox.sandbox_id, never):
        resp = httpx.get(f"{e2bsrv.http}/e2b/sandboxes/{sandbox_id}", headers={"X-API-Key": BOB})
        answers.append((resp.status_code, resp.json()["message"].replace(sandbox_id, "ID")))
    assert answers[0] == answers[1]
    assert sandbox.is_running()  # and it is untouched


def test_sandbox_traffic_needs_the_sandboxs_own_token(e2bsrv: Server, sandbox: Sandbox) -> None:
    other = Sandbox.create(api_key=BOB)
    try:
        answers = []
        for token in ("", "wrong", str(other._envd_access_token)):
            resp = httpx.post(
                e2bsrv.http + "/e2b/execute",
                json={"code": "open('/etc/hostname').read()"},
                headers=sandbox_headers(sandbox, token),
            )
            answers.append((resp.status_code, resp.text))
        assert {status for status, _ in answers} == {404}
        assert len({text for _, text in answers}) == 1  # no answer tells a wrong token from a missing id
        with pytest.raises(NotFoundException):
            Sandbox.connect(sandbox.sandbox_id, api_key=BOB).run_code("1")
    finally:
        other.kill()


def test_a_client_that_never_reads_costs_only_its_cell(e2bsrv: Server, sandbox: Sandbox) -> None:
    sandbox.run_code("kept = 'still here'")
    body = json.dumps({"code": "while True:\n    print('x' * 65536, flush=True)"}).encode()
    head = (
        f"POST /e2b/execute HTTP/1.1\r\nHost: 127.0.0.1:{e2bsrv.port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        + "".join(f"{k}: {v}\r\n" for k, v in sandbox_headers(sandbox).items())
        + "\r\n"
    ).encode()
    sock = socket.create_connection(("127.0.0.1", e2bsrv.port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        sock.sendall(head + body)
        # Never read. Meanwhile the server serves others, and once the stalled write is given
        # up on, the cell is interrupted: the sandbox answers again with its state, or, where
        # its interpreter did not survive the interrupt (stuck writing), it has ended. Either
        # way the stalled cell holds nothing for long.
        with Sandbox.create(api_key=BOB) as other:
            assert other.run_code("3 * 3").text == "9"

        def settled() -> bool:
            try:
                return bool(sandbox.run_code("kept").text == "'still here'")
            except NotFoundException:
                return True  # the sandbox ended with its interpreter
            except SandboxException as exc:
                return "has ended" in str(exc)

        assert until(settled, within_s=60)
        assert httpx.get(f"{e2bsrv.http}/healthz").status_code == 200
    finally:
        sock.close()
