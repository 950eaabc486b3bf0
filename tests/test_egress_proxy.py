"""SANDBOX_EGRESS_ALLOW_DOMAINS: real jails reaching hosts by name through the egress proxy,
in a fake internet the test makes (tests/fakenet.py: a DNS server, HTTP and HTTPS under
several names). Every refusal is paired with a control that shows the target answers.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import socket
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from appliance_client.client import AsyncClient, Execution
from tests.fakenet import DOMAIN, FakeNet, fake_internet, sh
from tests.support import Server, start_server

TOKEN = "egress-proxy-token-" + secrets.token_hex(8)  # tenant "open": the server's list
NARROW = "egress-narrow-token-" + secrets.token_hex(8)  # tenant "narrow": api.fake.test:80 only
ALLOW = (
    f"api.{DOMAIN}:443,api.{DOMAIN}:80,*.wild.{DOMAIN}:443,pypi.{DOMAIN}:443,"
    f"private.{DOMAIN}:80,mixed.{DOMAIN}:80"
)

# Runs in the jail: CA_PEM, CHECKS spliced in by the test (test data). Each check is a client
# nobody here wrote, used the way its docs say, with the proxy from the environment only.
PROBE = r"""
import json, os, socket, ssl, subprocess, sys, urllib.request
open("/tmp/ca.pem", "w").write(CA_PEM)
ctx = ssl.create_default_context(cafile="/tmp/ca.pem")
def urllib_get(url):
    try:
        with urllib.request.urlopen(url, context=ctx, timeout=20) as r:
            return "%d %s" % (r.status, r.read().decode())
    except urllib.error.HTTPError as e:
        return "HTTP %d %s" % (e.code, e.read().decode().strip())
    except OSError as e:
        return "%s: %s" % (type(e).__name__, e)
def curl(url):
    p = subprocess.run(["curl", "-sS", "--max-time", "20", "--cacert", "/tmp/ca.pem", url],
                       capture_output=True, text=True)
    return "rc=%d %s%s" % (p.returncode, p.stdout, p.stderr.strip())
def tcp(host, port):
    s = socket.socket(); s.settimeout(3)
    try:
        s.connect((host, port)); return "connected"
    except OSError as e:
        return type(e).__name__
    finally:
        s.close()
def udp(host, port):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(3)
    try:
        s.connect((host, port)); s.send(b"q"); return s.recv(100).decode()
    except OSError as e:
        return type(e).__name__
    finally:
        s.close()
def raw():
    try:
        socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP); return "opened"
    except OSError as e:
        return type(e).__name__
def requests_get(url):
    import requests
    try:
        r = requests.get(url, verify="/tmp/ca.pem", timeout=20)
        return "%d %s" % (r.status_code, r.text)
    except requests.RequestException as e:
        return "%s: %s" % (type(e).__name__, e)
def httpx_get(url):
    import httpx
    try:
        r = httpx.get(url, verify=ctx, timeout=20)
        return "%d %s" % (r.status_code, r.text)
    except httpx.HTTPError as e:
        return "%s: %s" % (type(e).__name__, e)
def pip_download(index, name):
    p = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                        "--no-cache-dir", "--cert", "/tmp/ca.pem", "--index-url", index, "-d", "/tmp/dl", name],
                       capture_output=True, text=True)
    return "rc=%d %s" % (p.returncode, sorted(os.listdir("/tmp/dl")) if os.path.isdir("/tmp/dl") else p.stderr[-600:])
def curl_post(url, size):
    open("/tmp/body", "wb").write(b"y" * size)
    p = subprocess.run(["curl", "-sS", "--max-time", "20", "-H", "Expect: 100-continue",
                        "--data-binary", "@/tmp/body", url], capture_output=True, text=True)
    return "rc=%d %s%s" % (p.returncode, p.stdout, p.stderr.strip())
def env():
    return {k: os.environ.get(k) for k in ("HTTP_PROXY", "https_proxy", "NO_PROXY")}
out = {}
for name, fn, args in CHECKS:
    out[name] = globals()[fn](*args)
print(json.dumps(out))
"""


@dataclass
class Setup:
    net: FakeNet
    server: Server
    log: Path


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    base = tmp_path_factory.mktemp("egress-proxy")
    with fake_internet(base / "net") as net:
        log = base / "egress.jsonl"
        tokens = base / "tokens.toml"
        tokens.write_text(
            f'[[tenant]]\nname = "open"\ntoken = "{TOKEN}"\n\n'
            f'[[tenant]]\nname = "narrow"\ntoken = "{NARROW}"\n'
            f'egress_allow_domains = ["api.{DOMAIN}:80", "other.{DOMAIN}:80"]\n'
        )
        tokens.chmod(0o600)
        srv = start_server(
            base / "server",
            SANDBOX_AUTH_TOKENS_FILE=str(tokens),
            SANDBOX_EGRESS_SUBNET=f"10.217.{net.k}.0/24",
            settings={
                "SANDBOX_EGRESS_ALLOW_DOMAINS": ALLOW,
                "SANDBOX_EGRESS_DNS": net.dns,
                "SANDBOX_OPEN_PORTS": "8080",  # address rules: any public address on 8080
                "SANDBOX_EGRESS_LOG": str(log),
                "SANDBOX_MAX_EXEC_MS": "60000",
            },
        )
        try:
            yield Setup(net, srv, log)
        finally:
            srv.stop()


async def probed(
    setup: Setup, checks: list[tuple[str, str, list[object]]], token: str = TOKEN, **options: Any
) -> tuple[dict[str, object], Execution]:
    code = f"CA_PEM = {json.dumps(setup.net.ca.read_text())}\n" + PROBE.replace("CHECKS", json.dumps(checks))
    async with AsyncClient(setup.server.url, token=token) as c:
        ex = await c.execute(code, timeout_ms=60000, **options)
    assert ex.status == "ok", (ex.status, ex.error, ex.stderr, ex.stdout)
    return dict(json.loads(ex.stdout.splitlines()[-1])), ex


async def probe(setup: Setup, checks: list[tuple[str, str, list[object]]]) -> dict[str, object]:
    return (await probed(setup, checks))[0]


def host_get(host: str, port: int, path: str = "/hello") -> str:
    """The control: what the host itself gets from host:port over plain HTTP."""
    with socket.create_connection((host, port), timeout=5) as s:
        s.sendall(f"GET {path} HTTP/1.0\r\nHost: control\r\nConnection: close\r\n\r\n".encode())
        chunks = []
        while chunk := s.recv(4096):
            chunks.append(chunk)
        return b"".join(chunks).decode(errors="replace")


async def test_allowed_names_are_reached_with_urllib_and_curl(setup: Setup) -> None:
    d = DOMAIN
    got = await probe(
        setup,
        [
            ("urllib_https", "urllib_get", [f"https://api.{d}/hello"]),
            ("urllib_http", "urllib_get", [f"http://api.{d}/hello?q=1"]),
            ("curl_https", "curl", [f"https://api.{d}/hello"]),
            ("curl_wild", "curl", [f"https://x.wild.{d}/hello"]),
            ("requests", "requests_get", [f"https://api.{d}/hello"]),
            ("httpx", "httpx_get", [f"https://api.{d}/hello"]),
            ("post", "curl_post", [f"http://api.{d}/upload", 300000]),
            ("env", "env", []),
        ],
    )
    assert got["urllib_https"] == f"200 hello api.{d} at {setup.net.public}:443 /hello", got
    assert got["urllib_http"] == f"200 hello api.{d} at {setup.net.public}:80 /hello?q=1", got
    assert got["curl_https"] == f"rc=0 hello api.{d} at {setup.net.public}:443 /hello", got
    assert got["curl_wild"] == f"rc=0 hello x.wild.{d} at {setup.net.public}:443 /hello", got
    assert got["post"] == "rc=0 got 300000", got  # a body, after curl's Expect: 100-continue
    assert got["requests"] == got["httpx"] == f"200 hello api.{d} at {setup.net.public}:443 /hello", got
    env = got["env"]
    assert isinstance(env, dict) and env["HTTP_PROXY"] == env["https_proxy"], env
    assert str(env["HTTP_PROXY"]).startswith("http://10.217.") and env["NO_PROXY"], env


async def test_names_not_listed_are_refused_with_the_reason(setup: Setup) -> None:
    d = DOMAIN
    assert "hello" in host_get(setup.net.public2, 80)  # other.fake.test answers
    got = await probe(
        setup,
        [
            ("other", "urllib_get", [f"http://other.{d}/hello"]),
            ("other_tls", "curl", [f"https://other.{d}/hello"]),
            ("apex_of_wildcard", "curl", [f"https://wild.{d}/hello"]),
            ("wrong_port", "urllib_get", [f"http://api.{d}:8080/hello"]),
            ("unknown", "urllib_get", [f"http://nowhere.{d}/hello"]),
        ],
    )
    assert got["other"] == f"HTTP 403 appliance egress proxy: other.{d}:80 is not in the allowlist", got
    assert "rc=56" in str(got["other_tls"]) and "403" in str(got["other_tls"]), got
    assert "403" in str(got["apex_of_wildcard"]), got
    assert got["wrong_port"] == f"HTTP 403 appliance egress proxy: api.{d}:8080 is not in the allowlist", got
    assert str(got["unknown"]).startswith("HTTP 403"), got


async def test_ip_literals_follow_the_address_rules_through_the_proxy(setup: Setup) -> None:
    net = setup.net
    assert "hello" in host_get(net.public2, 80)
    got = await probe(
        setup,
        [
            ("open_port", "urllib_get", [f"http://{net.public2}:8080/hello"]),
            ("closed_port", "urllib_get", [f"http://{net.public2}/hello"]),
            ("private", "urllib_get", [f"http://{net.private}:8080/hello"]),
        ],
    )
    assert got["open_port"] == f"200 hello {net.public2}:8080 at {net.public2}:8080 /hello", got
    assert str(got["closed_port"]).startswith("HTTP 403"), got
    assert "private, loopback" in str(got["private"]), got


async def test_the_proxy_is_the_only_way_out(setup: Setup) -> None:
    net = setup.net
    assert "hello" in host_get(net.public, 80)  # port 80 answers from the host
    got = await probe(
        setup,
        [
            ("direct_https", "tcp", [net.public, 443]),
            ("direct_http", "tcp", [net.public, 80]),
            ("direct_open_port", "tcp", [net.public2, 8080]),
            ("dns", "udp", [net.dns, 53]),
            ("raw", "raw", []),
        ],
    )
    direct = {got["direct_https"], got["direct_http"], got["direct_open_port"]}
    assert direct == {"ConnectionRefusedError"}, got
    assert got["dns"] == "PermissionError", got  # refused at once, in the jail's own filter
    assert got["raw"] == "PermissionError", got


async def test_flows_are_counted_and_logged(setup: Setup) -> None:
    d = DOMAIN
    await probe(
        setup,
        [("ok", "urllib_get", [f"http://api.{d}/bytes/1000"]), ("no", "urllib_get", [f"http://other.{d}/"])],
    )
    status, text = setup.server.get("/metrics", token=TOKEN)
    assert status == 200
    assert 'appliance_egress_flows_total{decision="allowed"}' in text
    assert 'appliance_egress_flows_total{decision="denied"}' in text
    lines = [json.loads(line) for line in setup.log.read_text().splitlines()]
    assert any(
        r["host"] == f"api.{d}" and r["decision"] == "allowed" and r["bytes_down"] > 1000 for r in lines
    ), lines
    assert any(
        r["host"] == f"other.{d}" and r["decision"] == "denied" and "allowlist" in r["why"] for r in lines
    )
    assert os.stat(setup.log).st_mode & 0o077 == 0


async def test_done_lists_every_flow_and_each_denial_is_streamed(setup: Setup) -> None:
    d = DOMAIN
    got, ex = await probed(
        setup,
        [
            ("ok", "urllib_get", [f"http://api.{d}/bytes/20000"]),
            ("tls", "urllib_get", [f"https://x.wild.{d}/hello"]),
            ("no", "urllib_get", [f"http://other.{d}/hello"]),
        ],
    )
    assert str(got["ok"]).startswith("200 ") and str(got["no"]).startswith("HTTP 403"), got
    told = [f for f in ex.frames if f["type"] == "egress"]
    assert [{k: v for k, v in f.items() if k != "seq"} for f in told] == [
        {
            "type": "egress",
            "id": ex.id,
            "host": f"other.{d}",
            "port": 80,
            "decision": "denied",
            "why": f"other.{d}:80 is not in the allowlist",
        }
    ]
    done = ex.frames[-1]
    assert done["type"] == "done" and ex.frames.index(told[0]) < len(ex.frames) - 1
    flows = done["egress"]
    assert [(f["host"], f["port"], f["decision"]) for f in flows] == [
        (f"api.{d}", 80, "allowed"),
        (f"x.wild.{d}", 443, "allowed"),
        (f"other.{d}", 80, "denied"),
    ], flows
    plain, tls, denied = flows
    assert plain["rule"] == f"api.{d}:80" and plain["address"] == setup.net.public
    assert plain["bytes_down"] > 20000 and plain["bytes_up"] > 0 and plain["duration_ms"] >= 1
    assert tls["rule"] == f"*.wild.{d}:443" and tls["bytes_up"] > 200 and tls["bytes_down"] > 200
    assert denied["why"] == f"other.{d}:80 is not in the allowlist" and "rule" not in denied
    assert "egress_omitted" not in done


async def test_a_tenant_and_a_request_can_only_narrow(setup: Setup) -> None:
    d = DOMAIN
    checks: list[tuple[str, str, list[object]]] = [
        ("api80", "urllib_get", [f"http://api.{d}/hello"]),
        ("api443", "urllib_get", [f"https://api.{d}/hello"]),
        ("other80", "urllib_get", [f"http://other.{d}/hello"]),
    ]
    tenant, ex = await probed(setup, checks, token=NARROW)
    assert str(tenant["api80"]).startswith("200 hello"), tenant
    assert "403 Forbidden" in str(tenant["api443"]), tenant  # a refused tunnel: the reason is told
    why = {(f["host"], f["port"]): f["why"] for f in ex.frames if f["type"] == "egress"}
    assert why[(f"api.{d}", 443)] == f"api.{d}:443 is not in the tenant's allowlist", why
    # The tenant lists other.fake.test:80, the server does not: refused.
    assert str(tenant["other80"]) == f"HTTP 403 appliance egress proxy: other.{d}:80 is not in the allowlist"
    request, _ = await probed(setup, checks, egress_allow=[f"api.{d}:443", f"other.{d}:80"])
    assert str(request["api443"]).startswith("200 hello"), request
    assert "not in the request's allowlist" in str(request["api80"]), request
    assert "is not in the allowlist" in str(request["other80"]), request


async def test_a_malformed_request_rule_is_rejected_naming_it(setup: Setup) -> None:
    async with AsyncClient(setup.server.url, token=TOKEN) as c:
        ex = await c.execute("print(1)", egress_allow=[f"api.{DOMAIN}:443", "*.com:443"])
    assert ex.status == "rejected" and "egress.allow[1] '*.com:443'" in str(ex.message), ex.message
    assert "top-level domain" in str(ex.message)


def _tiny_wheel(files: Path) -> str:
    """A wheel of one empty module, and a PEP 503 simple index for it, in the fake internet."""
    name = "tinypkg-0.1-py3-none-any.whl"
    meta = "tinypkg-0.1.dist-info"
    members = {
        "tinypkg.py": b"",
        f"{meta}/METADATA": b"Metadata-Version: 2.1\nName: tinypkg\nVersion: 0.1\n",
        f"{meta}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{path},,\n" for path in members) + f"{meta}/RECORD,,\n"
    (files / "files").mkdir(exist_ok=True)
    with zipfile.ZipFile(files / "files" / name, "w") as whl:
        for path, data in members.items():
            whl.writestr(path, data)
        whl.writestr(f"{meta}/RECORD", record)
    digest = hashlib.sha256((files / "files" / name).read_bytes()).hexdigest()
    index = files / "simple" / "tinypkg"
    index.mkdir(parents=True, exist_ok=True)
    (index / "index.html").write_text(f'<a href="/files/{name}#sha256={digest}">{name}</a>\n')
    for made in (files / "files" / name, index / "index.html"):
        made.chmod(0o644)
    return name


async def test_pip_downloads_from_an_allowed_index_name(setup: Setup) -> None:
    name = _tiny_wheel(setup.net.files)
    got = await probe(setup, [("pip", "pip_download", [f"https://pypi.{DOMAIN}/simple/", "tinypkg"])])
    assert got["pip"] == f"rc=0 {[name]}", got


def test_the_fake_internet_is_only_local(setup: Setup) -> None:
    for address in (setup.net.public, setup.net.public2, setup.net.private):
        route = json.loads(sh("ip", "-j", "route", "get", address).stdout)[0]
        assert route["dev"].startswith("fnv"), route
