"""SANDBOX_EGRESS_SECRETS: headers the egress proxy adds for some hosts, so a key never enters
a jail. Real jails, a real server, a fake internet (tests/fakenet.py) that records every
request it gets: the secret is checked where it arrives (the fake server's record), and
looked for where it must not be (the jail's environment, files, and what it was answered).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization

from appliance.core.egresssecrets import load, parse_secrets
from appliance.core.errors import SettingsError
from appliance.sandbox.egressca import EgressCA
from appliance_client.client import AsyncClient, Execution
from tests.fakenet import DOMAIN, FakeNet, fake_internet
from tests.support import REPO, Server, start_server

D = DOMAIN
TOKEN = "egress-secrets-token-" + secrets.token_hex(8)  # tenant "plain": the server's secrets
KEYED = "egress-keyed-token-" + secrets.token_hex(8)  # tenant "keyed": its own Authorization for api:443
TENANT_SECRET = "tk-" + secrets.token_hex(20)
SECRET = "sk-" + secrets.token_hex(20)  # api:443's Authorization
KEY2 = "k2-" + secrets.token_hex(20)  # api:443's X-Api-Key
PYPI_SECRET = "pk-" + secrets.token_hex(20)  # pypi:443's
PLAIN_SECRET = "hk-" + secrets.token_hex(20)  # api:80's: never sent (plain HTTP)
NOCERT_SECRET = "nk-" + secrets.token_hex(20)  # nocert:443's: never sent (its certificate fails)
ALL_SECRETS = (SECRET, KEY2, PYPI_SECRET, PLAIN_SECRET, NOCERT_SECRET, TENANT_SECRET)
ALLOW = f"api.{D}:443,api.{D}:80,other.{D}:443,other.{D}:80,pypi.{D}:443,nocert.{D}:443"

# Runs in the jail: CA_PEM (the fake internet's CA, which the jail is NOT given by the
# appliance), NEEDLES (every secret reversed: the code itself never holds one), MARK, CA_KEY.
PROBE = r"""
import http.client, json, os, ssl, subprocess, sys, urllib.parse, urllib.request
needles = [n[::-1].encode() for n in NEEDLES]
open("/tmp/fake-ca.pem", "w").write(CA_PEM)
out = {}
def leaks(data):
    return [i for i, n in enumerate(needles) if n in data]
answers = b""
def urllib_get(url, ctx=None, headers=None):
    global answers
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=20) as r:
            body = r.read(); answers += bytes(str(r.headers), "latin-1") + body
            return "%d %s" % (r.status, body.decode())
    except urllib.error.HTTPError as e:
        body = e.read(); answers += bytes(str(e.headers), "latin-1") + body
        return "HTTP %d %s" % (e.code, body.decode().strip())
    except OSError as e:
        return "%s: %s" % (type(e).__name__, e)
def issuer(host):
    # Trusting both: which CA the chain the jail was shown leads to.
    ctx = ssl.create_default_context(cafile="/tmp/fake-ca.pem")
    ctx.load_verify_locations(os.environ["SSL_CERT_FILE"])
    proxy = urllib.parse.urlsplit(os.environ["HTTPS_PROXY"])
    conn = http.client.HTTPSConnection(proxy.hostname, proxy.port, context=ctx, timeout=20)
    conn.set_tunnel(host, 443)
    conn.request("GET", "/hello?" + MARK + "-issuer")
    r = conn.getresponse(); r.read()
    cert = conn.sock.getpeercert()
    return dict(x[0] for x in cert["issuer"])["commonName"]
# 1. the trust settings, and no secret in the environment
out["env"] = {k: os.environ.get(k) for k in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "PIP_CERT", "CURL_CA_BUNDLE", "NODE_EXTRA_CA_CERTS")}
out["env_leaks"] = leaks(json.dumps(dict(os.environ)).encode()) + leaks(open("/proc/self/environ", "rb").read())
# 2. the secret host, through each client's default trust (the appliance's bundle)
auth = {"Authorization": "Bearer jail-own", "X-Api-Key": "jail-key"}
out["urllib"] = urllib_get("https://api.%s/hello?%s-urllib" % (D, MARK), headers=auth)
import requests
r = requests.get("https://api.%s/hello?%s-requests" % (D, MARK), headers=auth, timeout=20)
answers += json.dumps(dict(r.headers)).encode() + r.content
out["requests"] = "%d %s" % (r.status_code, r.text)
p = subprocess.run(["curl", "-sS", "-i", "--max-time", "20", "-H", "Authorization: Bearer jail-own",
                    "https://api.%s/hello?%s-curl" % (D, MARK)], capture_output=True)
answers += p.stdout + p.stderr
out["curl"] = "rc=%d %s" % (p.returncode, [l for l in p.stdout.decode().split("\r\n") if l.startswith("HTTP/")])
p = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                    "--no-cache-dir", "--index-url", "https://pypi.%s/simple/" % D, "-d", "/tmp/dl", "tinypkg"],
                   capture_output=True)
answers += p.stdout + p.stderr
out["pip"] = "rc=%d %s" % (p.returncode, sorted(os.listdir("/tmp/dl")) if os.path.isdir("/tmp/dl") else p.stderr[-600:].decode())
out["issuer_secret_host"] = issuer("api." + D)
# node has no proxy support of its own here: a CONNECT by hand, then its default TLS trust
# (its own CAs plus NODE_EXTRA_CA_CERTS)
NODE = r'''
const http = require("http"), tls = require("tls");
const proxy = new URL(process.env.HTTPS_PROXY), [host, path] = process.argv.slice(1);
http.request({host: proxy.hostname, port: proxy.port, method: "CONNECT", path: host + ":443"}).on("connect", (res, socket) => {
  const t = tls.connect({socket, servername: host}, () => t.write("GET " + path + " HTTP/1.1\r\nHost: " + host + "\r\nConnection: close\r\n\r\n"));
  let got = ""; t.on("data", d => got += d); t.on("end", () => console.log(got.split("\r\n")[0]));
  t.on("error", e => console.log("error " + e.code));
}).end();
'''
p = subprocess.run(["node", "-e", NODE, "api." + D, "/hello?%s-node" % MARK], capture_output=True, timeout=60)
answers += p.stdout + p.stderr
out["node"] = "rc=%d %s" % (p.returncode, (p.stdout + p.stderr).decode().strip()[-300:])
# 3. a host without secrets: tunnelled untouched, the real certificate chain
fake = ssl.create_default_context(cafile="/tmp/fake-ca.pem")
out["other_echo"] = urllib_get("https://other.%s/headers?%s-other" % (D, MARK), ctx=fake, headers=auth)
out["other_bundle_only"] = urllib_get("https://other.%s/hello?%s-bundle" % (D, MARK))
out["issuer_other"] = issuer("other." + D)
# 4. plain HTTP to a host given secrets; a host whose certificate does not verify
out["plain"] = urllib_get("http://api.%s/hello?%s-plain" % (D, MARK))
out["plain_other"] = urllib_get("http://other.%s/hello?%s-plainother" % (D, MARK))
out["nocert"] = urllib_get("https://nocert.%s/hello?%s-nocert" % (D, MARK))
# 5. the CA's key and the secrets file, from inside
def try_read(path):
    try:
        open(path, "rb").read(1); return "read"
    except OSError as e:
        return type(e).__name__
out["ca_key"] = try_read(CA_KEY)
out["secrets_file"] = try_read(SECRETS_FILE)
# 6. every file the jail can read (but the host's system trees), and every answer it got
found, scanned = [], 0
for top in os.listdir("/"):
    if top in ("proc", "sys", "dev", "usr", "lib", "lib64", "bin", "sbin", "boot"):
        continue
    for root, dirs, files in os.walk("/" + top, onerror=lambda e: None):
        for name in files:
            path = os.path.join(root, name)
            try:
                if os.path.islink(path) or os.path.getsize(path) > 16 << 20:
                    continue
                with open(path, "rb") as f:
                    data = f.read()
            except OSError:
                continue
            scanned += 1
            if leaks(data):
                found.append(path)
out["files_scanned"] = scanned
out["file_leaks"] = found
out["answer_leaks"] = leaks(answers)
print(json.dumps(out))
"""


@dataclass
class Setup:
    net: FakeNet
    server: Server
    log: Path
    ca_key: Path
    secrets_file: Path


def _tiny_wheel(files: Path) -> str:
    from tests.test_egress_proxy import _tiny_wheel as make

    return make(files)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    base = tmp_path_factory.mktemp("egress-secrets")
    with fake_internet(base / "net") as net:
        _tiny_wheel(net.files)
        log = base / "egress.jsonl"
        secrets_file = base / "secrets.toml"
        secrets_file.write_text(
            f'["api.{D}:443"]\nAuthorization = "Bearer {SECRET}"\nX-Api-Key = "{KEY2}"\n\n'
            f'["pypi.{D}:443"]\nAuthorization = "Bearer {PYPI_SECRET}"\n\n'
            f'["api.{D}:80"]\nAuthorization = "Bearer {PLAIN_SECRET}"\n\n'
            f'["nocert.{D}:443"]\nAuthorization = "Bearer {NOCERT_SECRET}"\n'
        )
        secrets_file.chmod(0o600)
        ca = EgressCA(None, None)  # a CA of the test's own, given by path (the other way is made per start)
        ca_key = base / "ca.pem"
        ca_key.write_bytes(b"")
        ca_key.chmod(0o600)
        ca_key.write_bytes(
            ca.ca_pem
            + ca._key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        tokens = base / "tokens.toml"
        tokens.write_text(
            f'[[tenant]]\nname = "plain"\ntoken = "{TOKEN}"\n\n'
            f'[[tenant]]\nname = "keyed"\ntoken = "{KEYED}"\n'
            f'[tenant.egress_secrets."api.{D}:443"]\nAuthorization = "Bearer {TENANT_SECRET}"\n'
        )
        tokens.chmod(0o600)
        srv = start_server(
            base / "server",
            SANDBOX_EGRESS_SUBNET=f"10.221.{net.k}.0/24",
            settings={
                "SANDBOX_AUTH_TOKENS_FILE": str(tokens),
                "SANDBOX_EGRESS_ALLOW_DOMAINS": ALLOW,
                "SANDBOX_EGRESS_DNS": net.dns,
                "SANDBOX_EGRESS_LOG": str(log),
                "SANDBOX_EGRESS_SECRETS": str(secrets_file),
                "SANDBOX_EGRESS_CA": str(ca_key),
                "SANDBOX_EGRESS_UPSTREAM_CA": str(net.ca),
                "SANDBOX_MAX_EXEC_MS": "120000",
            },
        )
        try:
            yield Setup(net, srv, log, ca_key, secrets_file)
        finally:
            srv.stop()


def _seen(net: FakeNet, mark: str) -> dict[str, list[dict[str, Any]]]:
    """The requests the fake internet got for this run, by the query's suffix."""
    out: dict[str, list[dict[str, Any]]] = {}
    for r in net.seen():
        path = r["path"]
        if mark in path:
            out.setdefault(path.split(mark, 1)[1].lstrip("-") or "plainhello", []).append(r)
    return out


def _values(request: dict[str, Any], name: str) -> list[str]:
    return [v for k, v in request["headers"] if k.lower() == name.lower()]


@pytest.fixture(scope="module")
def probed(setup: Setup) -> tuple[dict[str, Any], Execution, str]:
    """One jail run that tries everything below (one jail for the whole file)."""
    return asyncio.run(_probe(setup))


async def _probe(setup: Setup) -> tuple[dict[str, Any], Execution, str]:
    mark = "m" + secrets.token_hex(6)
    head = (
        f"CA_PEM = {json.dumps(setup.net.ca.read_text())}\nD = {D!r}\nMARK = {mark!r}\n"
        f"NEEDLES = {json.dumps([s[::-1] for s in ALL_SECRETS])}\n"
        f"CA_KEY = {str(setup.ca_key)!r}\nSECRETS_FILE = {str(setup.secrets_file)!r}\n"
    )
    async with AsyncClient(setup.server.url, token=TOKEN) as c:
        ex = await c.execute(head + PROBE, timeout_ms=120000)
    assert ex.status == "ok", (ex.status, ex.error, ex.stderr[-3000:], ex.stdout[-3000:])
    return dict(json.loads(ex.stdout.splitlines()[-1])), ex, mark


def test_the_secret_arrives_over_https_with_every_client(
    setup: Setup, probed: tuple[dict[str, Any], Execution, str]
) -> None:
    got, _, mark = probed
    for client in ("urllib", "requests"):
        assert str(got[client]).startswith(f"200 hello api.{D} at"), got
    assert got["curl"] == "rc=0 ['HTTP/1.1 200 Connection established', 'HTTP/1.1 200 OK']", got
    assert got["pip"] == "rc=0 ['tinypkg-0.1-py3-none-any.whl']", got
    seen = _seen(setup.net, mark)
    assert got["node"] == "rc=0 HTTP/1.1 200 OK", got
    for client in ("urllib", "requests", "curl", "node"):
        (request,) = seen[client]
        assert request["tls"], request
        # the jail's own header of the same name is replaced, not merged: exactly one, the secret's
        assert _values(request, "Authorization") == [f"Bearer {SECRET}"], request
        assert _values(request, "Host") == [f"api.{D}"], request
        assert _values(request, "X-Api-Key") == [KEY2], request
    pip = [r for r in setup.net.seen() if r["path"].startswith(("/simple/tinypkg", "/files/tinypkg"))]
    assert pip and all(_values(r, "Authorization") == [f"Bearer {PYPI_SECRET}"] for r in pip), pip


def test_the_jail_never_holds_a_secret(setup: Setup, probed: tuple[dict[str, Any], Execution, str]) -> None:
    got, _, _ = probed
    bundle = str(got["env"]["SSL_CERT_FILE"])
    assert bundle.endswith("/bundle.pem"), got["env"]
    assert {got["env"][k] for k in ("REQUESTS_CA_BUNDLE", "PIP_CERT", "CURL_CA_BUNDLE")} == {bundle}, got
    assert str(got["env"]["NODE_EXTRA_CA_CERTS"]).endswith("/ca.pem"), got
    assert got["env_leaks"] == [], got
    assert got["files_scanned"] > 100, got  # the scan did read the jail's files (the bundle among them)
    assert got["file_leaks"] == [], got
    assert got["answer_leaks"] == [], got
    # the CA's key and the secrets file are the server's alone
    assert got["ca_key"] in ("PermissionError", "FileNotFoundError"), got
    assert got["secrets_file"] in ("PermissionError", "FileNotFoundError"), got


def test_a_host_without_secrets_is_tunnelled_untouched(
    setup: Setup, probed: tuple[dict[str, Any], Execution, str]
) -> None:
    got, _, mark = probed
    status, _, body = str(got["other_echo"]).partition(" ")
    assert status == "200", got
    echoed = json.loads(body)
    assert [v for k, v in echoed if k.lower() == "authorization"] == ["Bearer jail-own"], echoed
    # the jail sees the real server's certificate: the appliance's bundle alone does not verify it
    assert "CERTIFICATE_VERIFY_FAILED" in str(got["other_bundle_only"]), got
    assert got["issuer_other"] == "appliance test CA", got
    assert str(got["issuer_secret_host"]).startswith("appliance egress CA"), got
    assert "bundle" not in _seen(setup.net, mark), "a tunnel the jail could not verify sent a request"


def test_no_secret_over_plain_http_or_to_an_unverified_host(
    setup: Setup, probed: tuple[dict[str, Any], Execution, str]
) -> None:
    got, _, mark = probed
    assert str(got["plain"]).startswith("HTTP 403 appliance egress proxy:"), got
    assert "TLS only" in str(got["plain"]), got
    assert str(got["plain_other"]).startswith(f"200 hello other.{D}"), got  # the control
    assert "502" in str(got["nocert"]), got
    seen = _seen(setup.net, mark)
    assert "plain" not in seen and "nocert" not in seen, seen
    assert "plainother" in seen, seen
    for r in setup.net.seen():
        assert not any(s in json.dumps(r) for s in (PLAIN_SECRET, NOCERT_SECRET)), r


def test_the_ledger_and_log_name_the_injection_never_the_value(
    setup: Setup, probed: tuple[dict[str, Any], Execution, str]
) -> None:
    _, ex, _ = probed
    flows = ex.frames[-1]["egress"]
    injected = [f for f in flows if f.get("injected")]
    assert injected, flows
    api = [f for f in injected if f["host"] == f"api.{D}"]
    assert api and all(f["injected"] == ["authorization", "x-api-key"] for f in api), api
    assert not any(f.get("injected") for f in flows if f["host"] == f"other.{D}"), flows
    failed = [f for f in flows if f["host"] == f"nocert.{D}"]
    assert failed and failed[0]["decision"] == "failed", failed
    assert "certificate" in failed[0]["why"] and "not sent" in failed[0]["why"], failed
    text = setup.log.read_text()
    assert '"injected":["authorization","x-api-key"]' in text
    for s in ALL_SECRETS:
        assert s not in text and s not in json.dumps(flows)
        assert s not in setup.server.log.read_text()


def test_a_malformed_secrets_file_stops_startup_naming_the_entry(tmp_path: Path) -> None:
    bad = tmp_path / "secrets.toml"
    bad.write_text(f'["api.{D}:443"]\nAuthorization = "Bearer ok"\n\n["*.{D}:443"]\nX-Key = "{SECRET}"\n')
    bad.chmod(0o600)
    env = {
        **os.environ,
        "SANDBOX_EGRESS_ALLOW_DOMAINS": f"api.{D}:443",
        "SANDBOX_EGRESS_SECRETS": str(bad),
        "SANDBOX_TMP_ROOT": str(tmp_path / "root"),
    }
    out = subprocess.run(
        [sys.executable, "-m", "appliance", "serve", "--host", "127.0.0.1", "--port", "0"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 2, out
    assert f"SANDBOX_EGRESS_SECRETS: '*.{D}:443' must be an exact host name" in out.stderr, out.stderr
    assert SECRET not in out.stderr + out.stdout


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"api.example.com": {"A": "b"}}, "'api.example.com' needs a port"),
        ({"10.0.0.1:443": {"A": "b"}}, "must be an exact host name"),
        ({"api.example.com:443": {}}, "must be a table of header names"),
        ({"api.example.com:443": {"Bad Name": "b"}}, "is not an HTTP header name"),
        ({"api.example.com:443": {"Host": "b"}}, "Host frames the request"),
        ({"api.example.com:443": {"Content-Length": "1"}}, "Content-Length frames"),
        ({"api.example.com:443": {"A": "x\r\nEvil: y"}}, "the value of A must be"),
        ({"api.example.com:443": {"A": 7}}, "the value of A must be"),
        ({"api.example.com:443": {"A": "b", "a": "c"}}, "a is given twice"),
    ],
)
def test_secrets_are_checked_entry_by_entry(doc: dict[str, Any], message: str) -> None:
    with pytest.raises(SettingsError) as caught:
        parse_secrets(doc, "SANDBOX_EGRESS_SECRETS")
    assert message in caught.value.message
    assert "Evil" not in caught.value.message


def test_the_secrets_file_must_be_the_servers_alone(tmp_path: Path) -> None:
    path = tmp_path / "s.toml"
    path.write_text('["api.example.com:443"]\nAuthorization = "Bearer x"\n')
    path.chmod(0o644)
    with pytest.raises(SettingsError, match="chmod 600"):
        load(path)
    path.chmod(0o600)
    assert list(load(path)) == [("api.example.com", 443)]
    assert "Bearer" not in repr(load(path))
    link = tmp_path / "link.toml"
    link.symlink_to(path)
    with pytest.raises(SettingsError, match="cannot open"):
        load(link)
    path.write_text('["api.example.com:443"]\nAuthorization = "Bearer x\n')
    with pytest.raises(SettingsError) as caught:
        load(path)
    assert "Bearer" not in caught.value.message and "line 2" in caught.value.message


def test_the_secret_settings_need_names_mode() -> None:
    from appliance import settings

    for name in ("SANDBOX_EGRESS_SECRETS", "SANDBOX_EGRESS_CA", "SANDBOX_EGRESS_UPSTREAM_CA"):
        with pytest.raises(SettingsError, match=f"{name}: set, but SANDBOX_EGRESS_ALLOW_DOMAINS is empty"):
            settings.from_env({name: "/etc/appliance/x"})


def test_a_configured_ca_must_be_the_servers_own_ca(tmp_path: Path) -> None:
    from appliance.core.errors import StartupError

    made = EgressCA(None, None)
    key = made._key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    path = tmp_path / "ca.pem"
    path.write_bytes(made.ca_pem + key)
    path.chmod(0o640)
    with pytest.raises(StartupError, match="chmod 600"):
        EgressCA(path, None)
    path.chmod(0o600)
    assert EgressCA(path, None).cert == made.cert  # the configured CA is used, not a new one
    other = EgressCA(None, None)
    path.write_bytes(
        made.ca_pem
        + other._key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    with pytest.raises(StartupError, match="not the certificate's"):
        EgressCA(path, None)
    assert EgressCA(None, None).cert != EgressCA(None, None).cert  # a new CA per start


def test_a_tenants_secret_goes_with_its_runs_only(
    setup: Setup, probed: tuple[dict[str, Any], Execution, str]
) -> None:
    """The keyed tenant's Authorization replaces the server's for its runs (the server's
    X-Api-Key stays); the other tenant's run (the probe) got the server's."""
    mark = "t" + secrets.token_hex(6)
    code = (
        "import urllib.request\n"
        f"r = urllib.request.urlopen('https://api.{D}/hello?{mark}', timeout=20)\n"
        "print(r.status, r.read().decode())\n"
    )

    async def go() -> Execution:
        async with AsyncClient(setup.server.url, token=KEYED) as c:
            return await c.execute(code, timeout_ms=60000)

    ex = asyncio.run(go())
    assert ex.status == "ok" and ex.stdout.startswith(f"200 hello api.{D}"), (ex.status, ex.stdout, ex.stderr)
    (request,) = [r for r in setup.net.seen() if mark in r["path"]]
    assert _values(request, "Authorization") == [f"Bearer {TENANT_SECRET}"], request
    assert _values(request, "X-Api-Key") == [KEY2], request
    _, _, probe_mark = probed
    (other,) = _seen(setup.net, probe_mark)["urllib"]
    assert _values(other, "Authorization") == [f"Bearer {SECRET}"], other
    assert TENANT_SECRET not in ex.stdout + ex.stderr


def test_tenant_secrets_are_checked_and_kept_private(tmp_path: Path) -> None:
    from appliance.core import tenants

    path = tmp_path / "tokens.toml"
    head = '[[tenant]]\nname = "a"\ntoken_sha256 = "' + "0" * 64 + '"\n'
    path.write_text(head + '[tenant.egress_secrets."*.example.com:443"]\nAuthorization = "Bearer x"\n')
    path.chmod(0o600)
    with pytest.raises(
        SettingsError, match=re.escape("tenant 'a': egress_secrets: '*.example.com:443' must be an exact")
    ):
        tenants.load(path)
    path.write_text(head + '[tenant.egress_secrets."api.example.com:443"]\nAuthorization = "Bearer x"\n')
    path.chmod(0o644)  # hashed tokens may be world-readable; secrets may not
    with pytest.raises(SettingsError, match=r"holds egress_secrets.*chmod 600"):
        tenants.load(path)
    path.chmod(0o600)
    (tenant,) = tenants.load(path)
    assert tenant.egress_secrets is not None and "Bearer" not in repr(tenant)


def test_secret_headers_replace_the_jails_and_a_tenants_replace_the_servers() -> None:
    import h11

    from appliance.core.egresssecrets import SecretHeaders
    from appliance.sandbox.egressintercept import Interception, with_secrets

    server = SecretHeaders((("Authorization", "Bearer s"), ("X-Key", "k")))
    tenant = SecretHeaders((("authorization", "Bearer t"),))
    ix = Interception(EgressCA(None, None), {("api.example.com", 443): server})
    assert ix.secret_for("api.example.com", 443) == server
    assert ix.secret_for("api.example.com", 80) is None and ix.secret_for("other.example.com", 443) is None
    both = ix.secret_for("api.example.com", 443, {("api.example.com", 443): tenant})
    assert both is not None and both.headers == (("X-Key", "k"), ("authorization", "Bearer t"))
    only = ix.secret_for("t.example.com", 443, {("t.example.com", 443): tenant})
    assert only == tenant
    jail = h11.Request(
        method="GET",
        target="/x",
        headers=[
            ("Host", "evil.example.com"),
            ("AUTHORIZATION", "Bearer jail"),
            ("x-key", "j"),
            ("Accept", "*/*"),
        ],
    )
    out = with_secrets(jail, server, "api.example.com")
    assert list(out.headers) == [
        (b"host", b"api.example.com"),
        (b"accept", b"*/*"),
        (b"authorization", b"Bearer s"),
        (b"x-key", b"k"),
    ]
    assert "Bearer s" not in repr(server)


def test_a_gone_servers_bundle_is_purged_a_running_ones_kept(tmp_path: Path) -> None:
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    stale = tmp_path / f"egress-ca-{gone.stdout.strip()}-abc"
    alive = tmp_path / f"egress-ca-{os.getppid()}-def"
    for d in (stale, alive):
        d.mkdir()
        (d / "bundle.pem").write_text("x")
    ca = EgressCA(None, None)
    made = ca.stage(tmp_path)
    assert not stale.exists() and alive.exists() and made.name.startswith(f"egress-ca-{os.getpid()}-")
    assert (made / "bundle.pem").read_bytes().endswith(ca.ca_pem) and (
        made / "ca.pem"
    ).read_bytes() == ca.ca_pem
    assert (made / "bundle.pem").stat().st_mode & 0o777 == 0o644 and made.stat().st_mode & 0o777 == 0o755
    ca.unstage()
    assert not made.exists()
