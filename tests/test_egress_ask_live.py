"""Live egress approval (`"egress": {"ask": true}`) with real jails, the real proxy and a fake
internet (tests/fakenet.py): a host the request's list leaves out waits for the client's
answer, given by the Python client's callback (sync and async) or by hand on a raw WebSocket.
What a hostile client or run tries against it is in tests/attacks/test_egress.py.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import websockets

from appliance_client.client import AsyncClient, Client, EgressAnswer, EgressRequestEvent
from tests.fakenet import DOMAIN, FakeNet, fake_internet
from tests.support import Server, start_server, until_async

D = DOMAIN
TOKEN = "egress-ask-token-" + secrets.token_hex(8)
ASK_MS = 4000  # how long an unanswered ask waits here (a bound under test, not a sleep)
API = f"api.{D}:80"  # what the requests below list; other.fake.test is asked about

# Runs in the jail: GET each URL through the proxy (urllib reads HTTP_PROXY), in threads.
FETCH = r"""
import json, sys, threading, urllib.request
def get(url):
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return "%d %s" % (r.status, r.read().decode())
    except urllib.error.HTTPError as e:
        return "HTTP %d %s" % (e.code, e.read().decode().strip())
    except OSError as e:
        return "%s: %s" % (type(e).__name__, e)
out = {}
def one(url):
    out[url] = get(url)
threads = [threading.Thread(target=one, args=(u,)) for u in URLS]
for t in threads: t.start()
for t in threads: t.join()
print(json.dumps(out))
"""


def fetch(*urls: str) -> str:
    return f"URLS = {json.dumps(list(urls))}\n" + FETCH


def results(stdout: str) -> dict[str, str]:
    return dict(json.loads(stdout.strip().splitlines()[-1]))


@dataclass
class Setup:
    net: FakeNet
    server: Server


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    base = tmp_path_factory.mktemp("egress-ask")
    with fake_internet(base / "net") as net:
        srv = start_server(
            base / "server",
            SANDBOX_EGRESS_SUBNET=f"10.219.{net.k}.0/24",
            settings={
                "SANDBOX_AUTH_TOKEN": TOKEN,
                "SANDBOX_EGRESS_ALLOW_DOMAINS": f"api.{D}:80,other.{D}:80,*.wild.{D}:443",
                "SANDBOX_EGRESS_DNS": net.dns,
                "SANDBOX_EGRESS_ASK_MS": str(ASK_MS),
                "SANDBOX_MAX_EXEC_MS": "30000",
            },
        )
        try:
            yield Setup(net, srv)
        finally:
            srv.stop()


class Raw:
    """A WebSocket spoken to by hand: frames by type, a decision of our own when we choose."""

    def __init__(self, ws: websockets.ClientConnection) -> None:
        self.ws = ws
        self.frames: list[dict[str, Any]] = []

    async def send(self, frame: dict[str, Any]) -> None:
        await self.ws.send(json.dumps(frame))

    async def until(self, done: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        while True:
            frame: dict[str, Any] = json.loads(await self.ws.recv())
            self.frames.append(frame)
            if done(frame):
                return frame


def raw(setup: Setup) -> Any:
    return websockets.connect(setup.server.url, additional_headers={"Authorization": f"Bearer {TOKEN}"})


def denied(setup: Setup) -> int:
    """The server's count of refused proxy flows (/metrics)."""
    _, text = setup.server.get("/metrics", token=TOKEN)
    for line in text.splitlines():
        if line.startswith('appliance_egress_flows_total{decision="denied"}'):
            return int(float(line.split()[-1]))
    return 0


def is_done(rid: str) -> Callable[[dict[str, Any]], bool]:
    return lambda f: f["type"] == "done" and f["id"] == rid


async def test_an_approved_host_is_reached_and_the_ledger_says_who_approved(setup: Setup) -> None:
    asked: list[EgressRequestEvent] = []

    async def approve(request: EgressRequestEvent) -> bool:  # the async client, an async callback
        asked.append(request)
        return True

    async with AsyncClient(setup.server.url, token=TOKEN) as c:
        ex = await c.execute(
            fetch(f"http://api.{D}/hello", f"http://other.{D}/hello"),
            timeout_ms=30000,
            egress_allow=[API],
            egress_ask=approve,
        )
    assert ex.status == "ok", (ex.status, ex.stderr)
    got = results(ex.stdout)
    assert got[f"http://other.{D}/hello"] == f"200 hello other.{D} at {setup.net.public2}:80 /hello", got
    assert got[f"http://api.{D}/hello"].startswith("200 hello api"), got  # listed: never asked
    assert [(r.host, r.port, r.timeout_ms) for r in asked] == [(f"other.{D}", 80, ASK_MS)]
    flows = {f["host"]: f for f in ex.frames[-1]["egress"]}
    other = flows[f"other.{D}"]
    assert other["decision"] == "allowed" and other["rule"] == "approved by the client for the run"
    assert other["asked"] == asked[0].flow and "asked" not in flows[f"api.{D}"]


def test_a_denied_host_is_refused_saying_so_with_a_sync_callback(setup: Setup) -> None:
    asked: list[str] = []

    def deny(request: EgressRequestEvent) -> bool:  # the sync client, a plain function
        asked.append(request.host)
        return False

    with Client(setup.server.url, token=TOKEN) as c:
        ex = c.execute(
            fetch(f"http://other.{D}/hello"), timeout_ms=30000, egress_allow=[API], egress_ask=deny
        )
    assert ex.status == "ok", (ex.status, ex.stderr)
    why = f"other.{D}:80 is not in the request's allowlist; the client denied it for the run"
    assert results(ex.stdout)[f"http://other.{D}/hello"] == f"HTTP 403 appliance egress proxy: {why}"
    assert asked == [f"other.{D}"]
    told = [f for f in ex.frames if f["type"] == "egress"]
    assert [f["why"] for f in told] == [why]


def _stdout(frames: Sequence[Mapping[str, Any]]) -> str:
    return "".join(f["text"] for f in frames if f["type"] == "stream" and f["name"] == "stdout")


async def test_a_client_gone_mid_ask_refuses_at_once_and_an_attach_can_answer_later(setup: Setup) -> None:
    """The first client drops on its first egress_request: that ask is refused at once (not at
    SANDBOX_EGRESS_ASK_MS); asks made while nobody follows are refused at once; a client that
    attaches to the run answers the asks after it."""
    code = (
        "import json, time, urllib.request\n"
        "def get(url):\n"
        "    try:\n"
        "        with urllib.request.urlopen(url, timeout=30) as r: return '%d %s' % (r.status, r.read().decode())\n"
        "    except urllib.error.HTTPError as e: return 'HTTP %d %s' % (e.code, e.read().decode().strip())\n"
        f"first = get('http://other.{D}/first')\n"
        "tries = 0\n"
        "while True:\n"  # until an attached client answers (each try without one is refused at once)
        "    tries += 1\n"
        f"    later = get('http://other.{D}/later')\n"
        "    if later.startswith('200') or tries > 400: break\n"
        "    time.sleep(0.05)\n"
        "print(json.dumps({'first': first, 'later': later}))\n"
    )
    before = denied(setup)
    async with raw(setup) as ws:
        r = Raw(ws)
        await r.send({"id": "g1", "code": code, "timeout_ms": 30000, "egress": {"ask": True}})
        start = await r.until(lambda f: f["type"] == "start")
        await r.until(lambda f: f["type"] == "egress_request")
        ws.transport.abort()  # gone without a word
    run = start["run"]
    # The server has seen the drop (the first ask is refused) before anyone attaches.
    await until_async(lambda: denied(setup) > before, 30, "the dropped client's ask refused")
    asked: list[str] = []

    def approve(request: EgressRequestEvent) -> EgressAnswer:
        asked.append(request.flow)
        return EgressAnswer(True)

    async with AsyncClient(setup.server.url, token=TOKEN) as c:
        frames = [frame async for frame in c.attach(run, after=-1, egress_ask=approve)]
    done = frames[-1]
    assert done["type"] == "done" and done["status"] == "ok", done
    got = results(_stdout(frames))
    assert got["first"].endswith("the client that could answer went away"), got
    assert got["later"] == f"200 hello other.{D} at {setup.net.public2}:80 /later", got
    whys = [f.get("why", "") for f in done["egress"]]
    assert not any("no answer within" in w for w in whys), whys
    assert done["egress"][-1]["rule"] == "approved by the client for the run" and asked


async def test_a_session_answer_holds_for_the_next_cell(setup: Setup) -> None:
    calls: list[str] = []

    async def once_for_the_session(request: EgressRequestEvent) -> EgressAnswer:
        calls.append(request.host)
        return EgressAnswer(True, scope="session")

    async with AsyncClient(setup.server.url, token=TOKEN) as c:
        session = c.session()
        try:
            first = await session.execute(
                fetch(f"http://other.{D}/one"),
                timeout_ms=30000,
                egress_allow=[API],
                egress_ask=once_for_the_session,
            )
            second = await session.execute(
                fetch(f"http://other.{D}/two"),
                timeout_ms=30000,
                egress_allow=[API],
                egress_ask=once_for_the_session,
            )
        finally:
            await session.close()
    assert results(first.stdout)[f"http://other.{D}/one"].startswith("200 hello other"), first.stdout
    assert results(second.stdout)[f"http://other.{D}/two"].startswith("200 hello other"), second.stdout
    assert calls == [f"other.{D}"]  # asked once: the second cell was not asked
    assert not [f for f in second.frames if f["type"] == "egress_request"]
    assert second.frames[-1]["egress"][0]["rule"] == "approved by the client for the session"


async def test_rest_cannot_answer_so_an_ask_is_refused_at_once_saying_why(setup: Setup) -> None:
    body = {
        "code": fetch(f"http://other.{D}/hello"),
        "timeout_ms": 30000,
        "egress": {"allow": [API], "ask": True},
    }
    status, text = await asyncio.to_thread(setup.server.request, "POST", "/v1/exec", TOKEN, body, 60)
    assert status == 200, text
    frames = [json.loads(line) for line in text.splitlines()]
    done = frames[-1]
    assert done["status"] == "ok" and not [f for f in frames if f["type"] == "egress_request"], done
    got = results(_stdout(frames))[f"http://other.{D}/hello"]
    assert got.startswith("HTTP 403") and "REST and MCP callers cannot" in got, got
    assert "REST and MCP callers cannot" in done["egress"][0]["why"]
