"""Egress by name: jailed code trying to get past the egress proxy (domain fronting, a name
that resolves to a private address, a Host header that lies, a tunnel that is not TLS, the
proxy from the host or from another jail), and live approval abused (a decision for another
run's flow, an approval of a host the server does not list, a run flooding its client with
asks). A fake internet (tests/fakenet.py) serves every name; each
attack is paired with a control in the same run that shows the way it tries does answer.
"""

from __future__ import annotations

import json
import secrets
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import websockets

from appliance_client.client import AsyncClient, EgressRequestEvent
from tests.attacks.common import TOKEN, attack
from tests.attacks.conftest import hostile_server
from tests.fakenet import DOMAIN, FakeNet, fake_internet
from tests.support import Server

D = DOMAIN
SECRET = "sk-attack-" + secrets.token_hex(16)  # what the proxy adds for x.wild.fake.test:443
ASK_MS = 3000  # how long an unanswered egress ask waits here (the bound under test)

# Jailed helpers: the proxy from the environment, spoken to by hand.
HELPERS = r"""
import json, os, socket, ssl, urllib.parse
PROXY = urllib.parse.urlsplit(os.environ["HTTP_PROXY"])
open("/tmp/ca.pem", "w").write(CA_PEM)
ctx = ssl.create_default_context(cafile="/tmp/ca.pem")
def proxy_conn():
    return socket.create_connection((PROXY.hostname, PROXY.port), timeout=15)
def read_all(s):
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except OSError as e:
        out += ("[%s]" % type(e).__name__).encode()
    return out.decode(errors="replace")
def connect(target):
    s = proxy_conn()
    s.sendall(("CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n" % (target, target)).encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = s.recv(1)
        if not chunk:
            break
        head += chunk
    return s, head.decode(errors="replace")
def tls_get(target, sni, host):
    s, head = connect(target)
    if " 200 " not in head:
        return "refused: " + head.split("\r\n")[0]
    try:
        t = ctx.wrap_socket(s, server_hostname=sni)
        t.sendall(("GET /hello HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n" % host).encode())
        return read_all(t).split("\r\n\r\n")[-1]
    except OSError as e:
        return "%s: %s" % (type(e).__name__, e)
def raw(data):
    s = proxy_conn(); s.sendall(data)
    return read_all(s)
"""


@dataclass
class Target:
    net: FakeNet
    server: Server


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory, tmp_root: Path) -> Iterator[Target]:
    base = tmp_path_factory.mktemp("egress-attacks")
    with fake_internet(base / "net") as net:
        secrets_file = base / "secrets.toml"
        secrets_file.write_text(f'["x.wild.{D}:443"]\nAuthorization = "Bearer {SECRET}"\n')
        secrets_file.chmod(0o600)
        srv = hostile_server(
            base / "server",
            tmp_root,
            SANDBOX_EGRESS_ALLOW_DOMAINS=f"api.{D}:443,api.{D}:80,private.{D}:80,mixed.{D}:80,*.wild.{D}:443",
            SANDBOX_EGRESS_SECRETS=str(secrets_file),
            SANDBOX_EGRESS_UPSTREAM_CA=str(net.ca),
            SANDBOX_EGRESS_DNS=net.dns,
            SANDBOX_EGRESS_SUBNET=f"10.218.{net.k}.0/24",
            SANDBOX_MAX_EXEC_MS="30000",
            SANDBOX_EGRESS_IDLE_MS="1000",
            SANDBOX_EGRESS_ASK_MS=str(ASK_MS),
        )
        try:
            yield Target(net, srv)
        finally:
            srv.stop()


async def run(t: Target, body: str) -> dict[str, str]:
    code = f"CA_PEM = {json.dumps(t.net.ca.read_text())}\n" + HELPERS + body
    async with AsyncClient(t.server.url, token=TOKEN) as c:
        ex = await c.execute(code, timeout_ms=30000)
    assert ex.status == "ok", (ex.status, ex.error, ex.stderr, ex.stdout)
    return dict(json.loads(ex.stdout.splitlines()[-1]))


@attack(
    "domain fronting: a tunnel to an allowed name whose TLS names another host",
    "refused before a byte goes on",
)
async def test_sni_must_be_the_connect_host(target: Target, observe: Callable[[str], None]) -> None:
    got = await run(
        target,
        f"print(json.dumps({{'control': tls_get('api.{D}:443', 'api.{D}', 'api.{D}'),"
        f" 'fronted': tls_get('api.{D}:443', 'other.{D}', 'other.{D}')}}))",
    )
    observe(json.dumps(got))
    assert got["control"] == f"hello api.{D} at {target.net.public}:443 /hello", got
    assert "hello" not in got["fronted"] and "Error" in got["fronted"], got


@attack("a name allowed by the list that resolves to a private address", "refused by the proxy's own check")
async def test_a_name_resolving_to_a_private_address_is_refused(
    target: Target, observe: Callable[[str], None]
) -> None:
    with socket.create_connection((target.net.private, 80), timeout=5) as s:  # control: it answers
        s.sendall(b"GET /hello HTTP/1.0\r\n\r\n")
        assert b"200" in s.recv(100)
    got = await run(
        target,
        "import urllib.request\n"
        "def get(url):\n"
        "    try:\n"
        "        return urllib.request.urlopen(url, timeout=15).read().decode()\n"
        "    except urllib.error.HTTPError as e:\n"
        "        return 'HTTP %d %s' % (e.code, e.read().decode().strip())\n"
        f"print(json.dumps({{'control': get('http://api.{D}/hello'), 'private': get('http://private.{D}/hello'),"
        f" 'mixed': get('http://mixed.{D}/hello')}}))",
    )
    observe(json.dumps(got))
    assert got["control"].startswith(f"hello api.{D}"), got
    assert got["private"].startswith("HTTP 403") and f"resolves to {target.net.private}" in got["private"], (
        got
    )
    assert got["mixed"].startswith("HTTP 403") and f"resolves to {target.net.private}" in got["mixed"], got


@attack(
    "a plain request to an allowed name carrying another Host, and a second request pipelined after it",
    "the Host is the URI's; one request per connection",
)
async def test_plain_http_host_and_pipelining(target: Target, observe: Callable[[str], None]) -> None:
    got = await run(
        target,
        f"one = 'GET http://api.{D}/hello HTTP/1.1\\r\\nHost: other.{D}\\r\\n\\r\\n'\n"
        f"two = 'GET http://other.{D}/second HTTP/1.1\\r\\nHost: other.{D}\\r\\n\\r\\n'\n"
        "print(json.dumps({'answer': raw((one + two).encode())}))",
    )
    observe(json.dumps(got))
    answer = got["answer"]
    assert f"hello api.{D} at {target.net.public}:80 /hello" in answer, got
    assert (
        answer.count("HTTP/1.1 200") == 1 and "/second" not in answer and f"hello other.{D}" not in answer
    ), got


@attack("a CONNECT tunnel to an allowed name that carries plain HTTP (no TLS, no SNI to check)", "refused")
async def test_a_tunnel_to_a_name_must_carry_tls(target: Target, observe: Callable[[str], None]) -> None:
    got = await run(
        target,
        f"s, head = connect('api.{D}:80')\n"
        f"s.sendall(b'GET /hello HTTP/1.1\\r\\nHost: other.{D}\\r\\nConnection: close\\r\\n\\r\\n')\n"
        "print(json.dumps({'head': head.split('\\r\\n')[0], 'answer': read_all(s)}))",
    )
    observe(json.dumps(got))
    assert "200" in got["head"], got  # the name and port are allowed ...
    assert "hello" not in got["answer"], got  # ... but nothing that is not TLS goes through


@attack(
    "IPv6 and malformed targets, a 20 KiB request head, a CONNECT with no port",
    "each refused with a reason; the proxy keeps serving",
)
async def test_malformed_requests_are_refused(target: Target, observe: Callable[[str], None]) -> None:
    got = await run(
        target,
        "big = 'GET http://api."
        + D
        + "/ HTTP/1.1\\r\\nHost: x\\r\\nX-Big: ' + 'a' * 20000 + '\\r\\n\\r\\n'\n"
        "print(json.dumps({'v6': connect('[::1]:443')[1].split('\\r\\n')[0],"
        " 'noport': connect('api." + D + "')[1].split('\\r\\n')[0],"
        " 'big': raw(big.encode()).split('\\r\\n')[0],"
        " 'after': tls_get('api." + D + ":443', 'api." + D + "', 'api." + D + "')}))",
    )
    observe(json.dumps(got))
    assert " 403 " in got["v6"] and " 400 " in got["noport"] and " 400 " in got["big"], got
    assert got["after"].startswith(f"hello api.{D}"), got


@attack(
    "the egress proxy from outside its jail: from the host itself",
    "refused (the proxy listens on jail links only)",
)
async def test_the_proxy_is_not_reachable_from_the_host(
    target: Target, observe: Callable[[str], None]
) -> None:
    async with AsyncClient(target.server.url, token=TOKEN) as c:
        session = await c.execute(
            "import os; print(os.environ['HTTP_PROXY'])", session="new", timeout_ms=30000
        )
        try:
            live = session.stdout.strip().removeprefix("http://").split(":")
            try:  # the session's jail, and so its listener, is alive meanwhile
                socket.create_connection((live[0], int(live[1])), timeout=3).close()
                refused = "connected"
            except OSError as exc:
                refused = type(exc).__name__
        finally:
            if session.session:
                await c.close_session(session.session)
    observe(f"{live}: {refused}")
    assert live[0].startswith("10.218."), live
    assert refused == "ConnectionRefusedError", refused


@attack(
    "a download of 200 MB through the proxy that the jail never reads",
    "the proxy drops it after SANDBOX_EGRESS_IDLE_MS; it holds no more than socket buffers",
)
async def test_a_client_that_never_reads_is_dropped(target: Target, observe: Callable[[str], None]) -> None:
    # The wait is the bound under test (1 s here), not a synchronisation: the jail then reads
    # what is left and must find the flow cut short.
    got = await run(
        target,
        "import time\n"
        "s = proxy_conn()\n"
        f"s.sendall(b'GET http://api.{D}/bytes/200000000 HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n')\n"
        "time.sleep(4)\n"
        "print(json.dumps({'read': len(read_all(s))}))",
    )
    async with AsyncClient(target.server.url, token=TOKEN) as c:
        after = await c.execute(
            f"CA_PEM = {json.dumps(target.net.ca.read_text())}\n"
            + HELPERS
            + f"print(tls_get('api.{D}:443', 'api.{D}', 'api.{D}'))",
            timeout_ms=30000,
        )
    observe(f"{got['read']} of 200000000 bytes read after the stall; next run: {after.stdout.strip()[:60]}")
    assert 0 < int(got["read"]) < 50_000_000, got
    assert after.stdout.startswith(f"hello api.{D}"), after.stdout


@attack(
    "300 refused connections through the proxy in one run",
    "32 told as they happen, 256 in done.egress, the rest counted; the proxy keeps serving",
)
async def test_a_flood_of_refusals_is_bounded(target: Target, observe: Callable[[str], None]) -> None:
    code = (
        f"CA_PEM = {json.dumps(target.net.ca.read_text())}\n"
        + HELPERS
        + f"heads = [connect('other.{D}:443')[1].split(' ')[1] for _ in range(300)]\n"
        + f"print(json.dumps({{'refused': heads.count('403'), 'after': tls_get('api.{D}:443', 'api.{D}', 'api.{D}')}}))"
    )
    async with AsyncClient(target.server.url, token=TOKEN) as c:
        ex = await c.execute(code, timeout_ms=30000)
    assert ex.status == "ok", (ex.status, ex.error, ex.stdout)
    got = json.loads(ex.stdout.splitlines()[-1])
    told = [f for f in ex.frames if f["type"] == "egress"]
    done = ex.frames[-1]
    observe(
        f"{got['refused']} refused; {len(told)} egress frames; done.egress {len(done['egress'])}, omitted {done.get('egress_omitted')}"
    )
    assert got["refused"] == 300 and got["after"].startswith(f"hello api.{D}"), got
    assert len(told) == 32 and len(done["egress"]) == 256 and done["egress_omitted"] == 301 - 256, done.get(
        "egress_omitted"
    )


@attack(
    "a jail steering a secret the proxy adds (SANDBOX_EGRESS_SECRETS): its own headers of that "
    "name (twice, another case), another Host or an absolute URI to another host inside the "
    "intercepted tunnel, and plain HTTP to the secret's host:port",
    "the far end gets the secret once, alone, at its own host; the rest is refused and sends nothing",
)
async def test_a_jail_cannot_read_or_steer_a_secret(target: Target, observe: Callable[[str], None]) -> None:
    mark = "m" + secrets.token_hex(6)
    body = (
        f"MARK = {mark!r}\n"
        "def secret_tunnel(request):\n"
        f"    s, head = connect('x.wild.{D}:443')\n"
        "    if ' 200 ' not in head:\n"
        "        return 'refused: ' + head.split('\\r\\n')[0]\n"
        "    try:\n"
        f"        t = ssl.create_default_context().wrap_socket(s, server_hostname='x.wild.{D}')\n"
        "        t.sendall(request.encode())\n"
        "        return read_all(t).split('\\r\\n')[0]\n"
        "    except OSError as e:\n"
        "        return '%s: %s' % (type(e).__name__, e)\n"
        "got = {\n"
        "  'steer': secret_tunnel('GET /hello?%s-steer HTTP/1.1\\r\\nHost: api.fake.test\\r\\n'\n"
        "      'Authorization: Bearer jail-one\\r\\nauthorization: Bearer jail-two\\r\\nConnection: close\\r\\n\\r\\n' % MARK),\n"
        "  'absolute': secret_tunnel('GET https://api.fake.test/hello?%s-absolute HTTP/1.1\\r\\n'\n"
        "      'Host: api.fake.test\\r\\nConnection: close\\r\\n\\r\\n' % MARK),\n"
        f"  'plain': raw(('GET http://x.wild.{D}:443/hello?%s-plain HTTP/1.1\\r\\nHost: x.wild.{D}\\r\\n\\r\\n' % MARK).encode()).split('\\r\\n')[0],\n"
        "  'env': ','.join(k for k, v in os.environ.items() if 'sk-attack' in v),\n"
        "}\n"
        "print(json.dumps(got))\n"
    )
    got = await run(target, body)
    seen = {r["path"].split(mark, 1)[1]: r for r in target.net.seen() if mark in r["path"]}
    steer = seen.get("-steer", {"headers": []})
    auth = [v for k, v in steer["headers"] if k.lower() == "authorization"]
    host = [v for k, v in steer["headers"] if k.lower() == "host"]
    observe(f"jail: {json.dumps(got)}; the far end got Host {host} and {len(auth)} Authorization header(s)")
    assert got["steer"] == "HTTP/1.1 200 OK", got  # the control: the tunnel carries a request
    assert auth == [f"Bearer {SECRET}"] and host == [f"x.wild.{D}"], steer
    assert got["absolute"].startswith("HTTP/1.1 400"), got
    assert got["plain"].startswith("HTTP/1.1 403"), got
    assert set(seen) == {"-steer"}, seen
    assert got["env"] == "", got


@attack(
    "a jail connecting to another jail's egress proxy listener (two sessions at once)",
    "refused: each jail reaches only its own listener, which takes only its own jail's address",
)
async def test_a_jail_cannot_use_another_jails_proxy(target: Target, observe: Callable[[str], None]) -> None:
    probe = (
        "import json, os, socket, sys\n"
        "def try_proxy(address):\n"
        "    host, port = address.removeprefix('http://').split(':')\n"
        "    try:\n"
        "        s = socket.create_connection((host, int(port)), timeout=5)\n"
        f"        s.sendall(b'GET http://api.{D}/hello HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n')\n"
        "        s.settimeout(5)\n"
        "        return 'answered: ' + s.recv(200).decode(errors='replace').split('\\r\\n')[0]\n"
        "    except OSError as e:\n"
        "        return type(e).__name__\n"
        "print(json.dumps({'addr': os.environ['HTTP_PROXY'], 'own': try_proxy(os.environ['HTTP_PROXY']),"
        " 'other': try_proxy(OTHER)}))\n"
    )
    async with AsyncClient(target.server.url, token=TOKEN) as c:
        first, second = c.session(), c.session()
        try:
            a = await first.execute("import os; print(os.environ['HTTP_PROXY'])", timeout_ms=30000)
            theirs = a.stdout.strip()  # the first session's jail (and listener) lives on meanwhile
            b = await second.execute(f"OTHER = {theirs!r}\n" + probe, timeout_ms=30000)
            mine = json.loads(b.stdout.strip().splitlines()[-1])
        finally:
            await first.close()
            await second.close()
    observe(f"{theirs}: {mine}")
    assert theirs.startswith("http://10.218.") and mine["addr"] != theirs, (theirs, mine)
    assert mine["own"] == "answered: HTTP/1.1 200 OK", mine  # control: its own proxy serves it
    # Refused by its own filter, or (were that open) closed unread by the other listener.
    assert mine["other"] in ("ConnectionRefusedError", "ConnectionResetError", "answered: "), mine


async def _raw_frames(t: Target) -> Any:
    return websockets.connect(t.server.url, additional_headers={"Authorization": f"Bearer {TOKEN}"})


async def _until(
    ws: Any, frames: list[dict[str, Any]], done: Callable[[dict[str, Any]], bool]
) -> dict[str, Any]:
    while True:
        frame: dict[str, Any] = json.loads(await ws.recv())
        frames.append(frame)
        if done(frame):
            return frame


def _stdout(frames: list[dict[str, Any]]) -> str:
    return "".join(f["text"] for f in frames if f["type"] == "stream" and f["name"] == "stdout")


GET = (
    "import json, urllib.request\n"
    "def get(url):\n"
    "    try:\n"
    "        with urllib.request.urlopen(url, timeout=30) as r: return '%d %s' % (r.status, r.read().decode())\n"
    "    except urllib.error.HTTPError as e: return 'HTTP %d %s' % (e.code, e.read().decode().strip())\n"
)


@attack(
    "egress_decision frames for a flow that does not exist, and for another run's flow from a "
    "connection of the same tenant that does not follow that run",
    "each rejected with a done naming the flow; the run's ask is untouched and its own client decides it",
)
async def test_a_decision_for_an_unknown_or_another_runs_flow_is_rejected(
    target: Target, observe: Callable[[str], None]
) -> None:
    owner_frames: list[dict[str, Any]] = []
    other_frames: list[dict[str, Any]] = []
    async with await _raw_frames(target) as owner, await _raw_frames(target) as other:
        await other.send(json.dumps({"type": "egress_decision", "id": "d0", "flow": "f-nope", "allow": True}))
        unknown = await _until(other, other_frames, lambda f: f["type"] == "done")
        code = GET + f"print(json.dumps({{'got': get('http://api.{D}/hello')}}))\n"
        egress = {"allow": [f"api.{D}:443"], "ask": True}
        await owner.send(json.dumps({"id": "o1", "code": code, "timeout_ms": 30000, "egress": egress}))
        request = await _until(owner, owner_frames, lambda f: f["type"] == "egress_request")
        await other.send(
            json.dumps({"type": "egress_decision", "id": "d1", "flow": request["flow"], "allow": False})
        )
        stolen = await _until(other, other_frames, lambda f: f["type"] == "done")
        await owner.send(json.dumps({"type": "egress_decision", "flow": request["flow"], "allow": True}))
        done = await _until(owner, owner_frames, lambda f: f["type"] == "done" and f["id"] == "o1")
    got = json.loads(_stdout(owner_frames).strip().splitlines()[-1])["got"]
    observe(f"unknown: {unknown['message']}; another run's: {stolen['message']}; the owner's: {got[:40]}")
    assert unknown["id"] == "d0" and unknown["status"] == "rejected" and "'f-nope'" in unknown["message"]
    assert stolen["id"] == "d1" and stolen["status"] == "rejected" and request["flow"] in stolen["message"]
    assert done["status"] == "ok" and got.startswith(f"200 hello api.{D}"), got  # still the owner's to allow
    assert (request["host"], request["port"]) == (f"api.{D}", 80)


@attack(
    "a client approving a host the server's allowlist does not hold",
    "never asked about: refused as unlisted; asking opens only what the request's own list left out",
)
async def test_approval_cannot_open_what_the_server_does_not_list(
    target: Target, observe: Callable[[str], None]
) -> None:
    asked: list[str] = []

    def approve_everything(request: EgressRequestEvent) -> bool:
        asked.append(f"{request.host}:{request.port}")
        return True

    code = GET + (
        f"print(json.dumps({{'listed': get('http://api.{D}/hello'), 'unlisted': get('http://other.{D}/hello')}}))\n"
    )
    async with AsyncClient(target.server.url, token=TOKEN) as c:
        ex = await c.execute(
            code, timeout_ms=30000, egress_allow=[f"api.{D}:443"], egress_ask=approve_everything
        )
    got = json.loads(ex.stdout.strip().splitlines()[-1])
    observe(f"asked {asked}; {got}")
    assert got["listed"].startswith(f"200 hello api.{D}"), got  # control: asked about and approved
    assert got["unlisted"] == f"HTTP 403 appliance egress proxy: other.{D}:80 is not in the allowlist", got
    assert asked == [f"api.{D}:80"], asked


@attack(
    "a run opening connections to 24 unlisted hosts at once while its client never answers",
    "8 egress_requests at most, the rest refused at once; the 8 refused after SANDBOX_EGRESS_ASK_MS",
)
async def test_a_flood_of_asks_is_bounded(target: Target, observe: Callable[[str], None]) -> None:
    hosts = [f"h{i}.wild.{D}" for i in range(24)]
    code = (
        "import json, socket, os, urllib.parse\n"
        "p = urllib.parse.urlsplit(os.environ['HTTP_PROXY'])\n"
        "socks = {}\n"
        f"for h in {hosts!r}:\n"  # all open at once, then each answer read
        "    s = socks[h] = socket.create_connection((p.hostname, p.port), timeout=30)\n"
        "    s.sendall(('CONNECT %s:443 HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n' % h).encode())\n"
        "print(json.dumps({h: s.recv(4096).decode(errors='replace').split('\\r\\n')[0] for h, s in socks.items()}))\n"
    )
    frames: list[dict[str, Any]] = []
    async with await _raw_frames(target) as ws:
        await ws.send(json.dumps({"id": "t1", "code": code, "timeout_ms": 30000, "egress": {"ask": True}}))
        done = await _until(ws, frames, lambda f: f["type"] == "done")
    requests = [f for f in frames if f["type"] == "egress_request"]
    assert _stdout(frames).strip(), [f for f in frames if f["type"] in ("error", "done", "stream")]
    heads = json.loads(_stdout(frames).strip().splitlines()[-1])
    whys = [f["why"] for f in done["egress"]]
    bound = sum("8 hosts already wait for the client's answer" in w for w in whys)
    timed_out = sum(f"no answer within SANDBOX_EGRESS_ASK_MS ({ASK_MS} ms)" in w for w in whys)
    observe(f"{len(requests)} egress_requests; {bound} refused at the bound, {timed_out} timed out")
    assert done["status"] == "ok", done
    assert len(requests) == 8 and len({f["flow"] for f in requests}) == 8, requests
    assert all(" 403 " in head for head in heads.values()) and len(heads) == 24, heads
    assert bound == 16 and timed_out == 8, whys
