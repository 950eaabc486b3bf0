"""Cross-site requests: a web page on another origin makes a visitor's browser call the
appliance (WebSocket to /exec, a "simple" POST to /v1 that needs no CORS preflight). With
no token, the seed's default, that ran code. Only origins in SANDBOX_ALLOWED_ORIGINS pass;
clients that send no Origin (websocat, the SDK) are unaffected; and a token-less server on
a non-loopback address says so."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import websockets

from appliance_client.client import AsyncClient
from tests.attacks.common import attack
from tests.attacks.conftest import hostile_server
from tests.support import Server, frames_of, scaled

Observe = Callable[[str], None]
ALLOWED = "https://app.example.com"
EVIL = "https://evil.example"
MARK = "print('ran-' + 'cross-site')"


@pytest.fixture(scope="module")
def open_server(tmp_path_factory: pytest.TempPathFactory, tmp_root: Path) -> Iterator[Server]:
    """No token (the seed's default), on loopback, one browser origin allowed."""
    srv = hostile_server(
        tmp_path_factory.mktemp("cross-site-server"),
        tmp_root,
        SANDBOX_AUTH_TOKEN="",
        SANDBOX_ALLOWED_ORIGINS=ALLOWED,
    )
    yield srv
    srv.stop()


def post(server: Server, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, str]:
    req = urllib.request.Request(server.http + path, data=body, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=scaled(60)) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


async def handshake_status(server: Server, origin: str) -> int:
    try:
        async with websockets.connect(server.url, origin=websockets.Origin(origin)) as ws:
            await ws.send(json.dumps({"code": MARK}))
            await ws.recv()
            return 101
    except websockets.exceptions.InvalidStatus as exc:
        return exc.response.status_code


@attack(
    "a page on another origin opens a WebSocket to /exec of a server without a token",
    "the handshake is refused with 403 for any Origin not in SANDBOX_ALLOWED_ORIGINS (also `null`); "
    "the allowed origin and clients sending no Origin still run code",
)
async def test_a_cross_origin_websocket_is_refused_before_the_upgrade(
    open_server: Server, observe: Observe
) -> None:
    refused = {
        origin: await handshake_status(open_server, origin)
        for origin in (EVIL, "null", "http://app.example.com", ALLOWED + ".evil.example")
    }
    assert set(refused.values()) == {403}, refused
    async with websockets.connect(open_server.url, origin=websockets.Origin(ALLOWED)) as ws:
        await ws.send(json.dumps({"id": "allowed", "code": MARK}))
        allowed = [json.loads(await ws.recv()) for _ in range(3)]
    assert allowed[1].get("text") == "ran-cross-site\n" and allowed[2]["status"] == "ok", allowed
    async with AsyncClient(open_server.url) as client:  # no Origin: the SDK, websocat
        assert (await client.execute(MARK)).stdout == "ran-cross-site\n"
    observe(f"handshake status by Origin: {refused}; {ALLOWED} and no Origin ran code")


@attack(
    "a page posts a CORS-simple request (text/plain, form) to /v1/exec and /v1/sessions",
    "415 unless the body is Content-Type: application/json, and 403 for an Origin not allowed; "
    "nothing runs, no session opens; the allowed origin still can",
)
async def test_a_cross_site_simple_post_runs_nothing(open_server: Server, observe: Observe) -> None:
    body = json.dumps({"code": MARK}).encode()
    seen: dict[str, int] = {}
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        for path in ("/v1/exec", "/v1/sessions"):
            status, text = post(open_server, path, body, {"Content-Type": kind})
            assert "ran-cross-site" not in text and "session" not in json.loads(text), text
            seen[f"{path} {kind.split(';')[0]}"] = status
    status, text = post(open_server, "/v1/exec", body, {"Content-Type": "application/json", "Origin": EVIL})
    seen["/v1/exec json from another origin"] = status
    assert "ran-cross-site" not in text
    assert set(v for k, v in seen.items() if "origin" not in k) == {415}, seen
    assert seen["/v1/exec json from another origin"] == 403, seen
    status, text = post(
        open_server, "/v1/exec", body, {"Content-Type": "application/json; charset=utf-8", "Origin": ALLOWED}
    )
    frames = frames_of(text)
    assert status == 200 and frames[-1]["status"] == "ok" and "ran-cross-site" in text, text
    observe(f"statuses: {seen}; the allowed origin's application/json POST ran")


@attack(
    "a server without a token bound to 0.0.0.0 (the seed's `make run`)",
    "it still starts, but logs UNAUTHENTICATED AND EXPOSED and /readyz carries a `warning` (and stays "
    "ready); on loopback there is no warning",
)
async def test_a_server_without_a_token_on_a_public_address_says_so(
    tmp_path: Path, tmp_root: Path, open_server: Server, observe: Observe
) -> None:
    exposed = hostile_server(tmp_path / "exposed", tmp_root, host="0.0.0.0", SANDBOX_AUTH_TOKEN="")
    try:
        status, text = exposed.get("/readyz")
        log = exposed.logs()
    finally:
        exposed.stop()
    body = json.loads(text)
    assert status == 200 and body["status"] == "ready", body
    assert "0.0.0.0" in body.get("warning", "") and "anyone who can reach" in body["warning"], body
    assert "UNAUTHENTICATED AND EXPOSED" in log
    quiet = json.loads(open_server.get("/readyz")[1])
    assert "warning" not in quiet, quiet
    observe(f"/readyz warning: {body['warning']!r}; the log says UNAUTHENTICATED AND EXPOSED")


@attack(
    "a DNS-rebinding page (evil name resolving to the server) posts JSON from its own origin",
    "without a token the server's own origin counts only for a Host that no DNS answer can forge "
    "(an IP literal, localhost): Origin http://rebind.example:PORT with that Host gets 403 and nothing "
    "runs, while the server's own /docs page (same origin, 127.0.0.1 or localhost) may run code",
)
def test_own_origin_passes_but_a_rebound_name_does_not(open_server: Server, observe: Observe) -> None:
    port = open_server.port
    body = json.dumps({"code": MARK}).encode()
    seen: dict[str, int] = {}
    for host in (f"127.0.0.1:{port}", f"localhost:{port}"):
        status, text = post(
            open_server,
            "/v1/exec",
            body,
            {"Content-Type": "application/json", "Host": host, "Origin": f"http://{host}"},
        )
        seen[host] = status
        assert status == 200 and frames_of(text)[-1]["status"] == "ok" and "ran-cross-site" in text, text
    rebound = f"rebind.example:{port}"
    status, text = post(
        open_server,
        "/v1/exec",
        body,
        {"Content-Type": "application/json", "Host": rebound, "Origin": f"http://{rebound}"},
    )
    seen[rebound] = status
    # Refused by its Host (421) before its Origin is looked at: the name is not this server's.
    assert status == 421 and "ran-cross-site" not in text, text
    # A same-origin page on another port of the same address is another origin.
    other = f"http://127.0.0.1:{port + 1}"
    status, text = post(open_server, "/v1/exec", body, {"Content-Type": "application/json", "Origin": other})
    seen[other] = status
    assert status == 403, text
    observe(f"status by Host/Origin: {seen}")


@attack(
    "a page on an origin the operator listed preflights a JSON POST with Authorization (a browser MCP client)",
    "the listed origin gets a CORS grant (204 with Access-Control-Allow-Origin: itself, the MCP headers "
    "allowed) and its answers carry Access-Control-Allow-Origin; any other origin's preflight gets 403 "
    "and no grant",
)
def test_cors_is_granted_to_listed_origins_only(open_server: Server, observe: Observe) -> None:
    def preflight(origin: str) -> tuple[int, dict[str, str]]:
        req = urllib.request.Request(
            open_server.http + "/mcp",
            method="OPTIONS",
            headers={
                "Origin": origin,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization,content-type,mcp-session-id",
            },
        )
        try:
            with urllib.request.urlopen(req, timeout=scaled(60)) as resp:
                return resp.status, dict(resp.headers)
        except urllib.error.HTTPError as exc:
            return exc.code, dict(exc.headers)

    status, headers = preflight(ALLOWED)
    assert status == 204 and headers.get("Access-Control-Allow-Origin") == ALLOWED, (status, headers)
    allowed_headers = headers["Access-Control-Allow-Headers"].lower()
    assert {"authorization", "content-type", "mcp-session-id"} <= {
        h.strip() for h in allowed_headers.split(",")
    }
    for origin in (EVIL, "null", ALLOWED + ".evil.example"):
        status, headers = preflight(origin)
        assert status == 403 and "Access-Control-Allow-Origin" not in headers, (origin, status, headers)
    req = urllib.request.Request(
        open_server.http + "/v1/exec",
        data=json.dumps({"code": MARK}).encode(),
        method="POST",
        headers={"Content-Type": "application/json", "Origin": ALLOWED},
    )
    with urllib.request.urlopen(req, timeout=scaled(60)) as resp:
        grant = resp.headers.get("Access-Control-Allow-Origin")
        text = resp.read().decode()
    assert grant == ALLOWED and "ran-cross-site" in text
    req = urllib.request.Request(open_server.http + "/healthz")
    with urllib.request.urlopen(req, timeout=scaled(60)) as resp:
        assert "Access-Control-Allow-Origin" not in resp.headers  # no Origin, no grant
    observe(f"preflight from {ALLOWED}: 204 with a grant; from {EVIL}, null, a suffix: 403, no grant")


@attack(
    "DNS rebinding: a page on evil.example, resolved to a token-less loopback server, reads "
    "/v1/models, /metrics and /readyz (its requests carry Host: evil.example)",
    "421 for every route whose Host is not an IP literal, localhost or in SANDBOX_ALLOWED_HOSTS",
)
def test_a_rebound_host_name_reads_nothing(open_server: Server, observe: Observe) -> None:
    port = open_server.port
    seen = {}
    for path in ("/v1/models", "/metrics", "/readyz", "/healthz"):
        status, _ = open_server.request("GET", path, headers={"Host": f"evil.example:{port}"})
        seen[path] = status
    assert all(v == 421 for v in seen.values()), seen
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "127.0.0.1"):
        status, _ = open_server.request("GET", "/readyz", headers={"Host": host})
        assert status == 200, (host, status)
    observe(f"Host evil.example: {seen}; 127.0.0.1 and localhost: 200")


def test_listed_host_names_pass(tmp_path_factory: pytest.TempPathFactory, tmp_root: Path) -> None:
    srv = hostile_server(
        tmp_path_factory.mktemp("hosts"), tmp_root, SANDBOX_ALLOWED_HOSTS="appliance.internal"
    )
    try:
        assert srv.request("GET", "/healthz", headers={"Host": f"appliance.internal:{srv.port}"})[0] == 200
        assert srv.request("GET", "/healthz", headers={"Host": "evil.example"})[0] == 421
    finally:
        srv.stop()
