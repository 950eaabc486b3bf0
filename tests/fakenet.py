"""A fake internet in a network namespace the tests make: a DNS server and HTTP/HTTPS servers
under several names, for the egress proxy's tests and benchmark. Nothing outside this machine
is ever addressed: every address used is routed into the namespace's veth, and checked.

    host netns: fnv<tag>  198.18.K.1/29, 10.77.K.1/30
        |  veth
    fakenet-<tag>: eth0   198.18.K.2, 198.18.K.3, 10.77.K.2
                   DNS on 53/udp; HTTP on 80 and 8080, HTTPS on 443 (a test CA's certificate
                   for every name), a raw TCP greeter on 2222

Names (`zone`): api / other / x.wild / wild / pypi (public addresses), private (10.77.K.2,
which answers: only the proxy's blocklist stops a run reaching it), mixed (a public address
and the private one), nocert (a public address the HTTPS certificate does not name), all
under fake.test. Every HTTP request is recorded (`seen()`: TLS or not, path, headers), and
`/headers` answers the request's headers as JSON. No name points at a metadata address: nothing may
ever send a packet there from a test.
"""

from __future__ import annotations

import datetime
import json
import secrets
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

DOMAIN = "fake.test"

SERVER = r"""
import json, socket, ssl, sys, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
import dns.message, dns.rrset, dns.rdatatype

zone, cert, key, files, seen = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
seen_lock = threading.Lock()

def dns_server():
    srv = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); srv.bind(("0.0.0.0", 53))
    while True:
        data, peer = srv.recvfrom(4096)
        try:
            q = dns.message.from_wire(data)
        except Exception:
            continue
        r = dns.message.make_response(q)
        question = q.question[0]
        name = question.name.to_text().rstrip(".").lower()
        if question.rdtype == dns.rdatatype.A and name in zone:
            r.answer.append(dns.rrset.from_text_list(question.name, 5, "IN", "A", zone[name]))
        elif name not in zone:
            r.set_rcode(3)
        srv.sendto(r.to_wire(), peer)

class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a): pass
    def _send(self, body, ctype="text/plain"):
        self.send_response(200); self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body))); self.end_headers(); self.wfile.write(body)
    def _record(self):
        tls = isinstance(self.connection, ssl.SSLSocket)
        line = json.dumps({"tls": tls, "path": self.path, "headers": [[k, v] for k, v in self.headers.items()]})
        with seen_lock, open(seen, "a") as f:
            f.write(line + "\n")
    def do_GET(self):
        self._record()
        if self.path.startswith("/headers"):
            return self._send(json.dumps([[k, v] for k, v in self.headers.items()]).encode(), "application/json")
        if self.path.startswith("/bytes/"):
            return self._send(b"x" * int(self.path.split("/")[2]), "application/octet-stream")
        if self.path.startswith("/simple/") or self.path.startswith("/files/"):
            import os
            local = os.path.join(files, self.path.lstrip("/").split("?")[0])
            if os.path.isdir(local): local = os.path.join(local, "index.html")
            if not os.path.isfile(local):
                self.send_response(404); self.send_header("Content-Length", "0"); self.end_headers(); return
            ctype = "text/html" if local.endswith(".html") else "application/octet-stream"
            return self._send(open(local, "rb").read(), ctype)
        here = self.connection.getsockname()
        self._send(("hello %s at %s:%d %s" % (self.headers.get("Host"), here[0], here[1], self.path)).encode())
    def do_POST(self):
        self._record()
        n = int(self.headers.get("Content-Length", "0"))
        self._send(b"got %d" % len(self.rfile.read(n)))

def http(port, tls):
    srv = ThreadingHTTPServer(("0.0.0.0", port), Handler); srv.daemon_threads = True
    if tls:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER); ctx.load_cert_chain(cert, key)
        srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
    srv.serve_forever()

def greeter(port):
    srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", port)); srv.listen(16)
    while True:
        conn, _ = srv.accept(); conn.sendall(b"SSH-2.0-fake\r\n"); conn.close()

for target, args in ((dns_server, ()), (http, (80, False)), (http, (8080, False)), (http, (443, True)), (greeter, (2222,))):
    threading.Thread(target=target, args=args, daemon=True).start()
print("up", flush=True)
threading.Event().wait()
"""


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, check=check, timeout=30)


@dataclass
class FakeNet:
    ns: str
    k: int
    ca: Path  # the test CA's certificate (PEM): what a client must trust for 443
    files: Path  # served under /simple/ and /files/
    requests: Path  # one JSON line per request the servers got (not served)

    def seen(self) -> list[dict[str, Any]]:
        """Every request the servers got so far: {"tls", "path", "headers": [[name, value]]}."""
        if not self.requests.exists():
            return []
        return [json.loads(line) for line in self.requests.read_text().splitlines() if line]

    @property
    def host_if(self) -> str:
        """The host's end of the namespace's veth."""
        return "fnv" + self.ns.removeprefix("fakenet-")

    @property
    def public(self) -> str:
        return f"198.18.{self.k}.2"

    @property
    def public2(self) -> str:
        return f"198.18.{self.k}.3"

    @property
    def private(self) -> str:
        return f"10.77.{self.k}.2"

    @property
    def dns(self) -> str:
        return self.public

    def zone(self) -> dict[str, list[str]]:
        d = DOMAIN
        return {
            f"api.{d}": [self.public],
            f"other.{d}": [self.public2],
            f"x.wild.{d}": [self.public],
            f"wild.{d}": [self.public],
            f"pypi.{d}": [self.public],
            f"private.{d}": [self.private],
            f"mixed.{d}": [self.public, self.private],
            f"nocert.{d}": [self.public],
        }


def _certificates(names: list[str], out: Path) -> tuple[Path, Path, Path]:
    """A CA and a certificate for every name signed by it: (ca.pem, cert.pem, key.pem)."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "appliance test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in names]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    paths = out / "ca.pem", out / "cert.pem", out / "key.pem"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    for p in paths:
        p.chmod(0o644)
    return paths


def _routed_via(address: str, dev: str) -> bool:
    out = sh("ip", "-j", "route", "get", address, check=False)
    return out.returncode == 0 and json.loads(out.stdout)[0].get("dev") == dev


@contextmanager
def fake_internet(workdir: Path) -> Iterator[FakeNet]:
    """Make the namespace, its servers and its routes; remove them all after."""
    tag = secrets.token_hex(3)
    ns, hv = f"fakenet-{tag}", f"fnv{tag}"
    used = sh("ip", "-4", "route", "show", "table", "all").stdout
    k = next(
        i
        for i in range(11 + secrets.randbelow(100), 250)
        if f"198.18.{i}." not in used and f"10.77.{i}." not in used
    )
    workdir.mkdir(parents=True, exist_ok=True)
    workdir.chmod(0o755)
    files = workdir / "files"
    files.mkdir(exist_ok=True)
    net = FakeNet(ns=ns, k=k, ca=workdir / "ca.pem", files=files, requests=workdir / "requests.jsonl")
    _, cert, key = _certificates([n for n in net.zone() if not n.startswith("nocert.")], workdir)
    proc: subprocess.Popen[str] | None = None
    try:
        for argv in (
            ["ip", "netns", "add", ns],
            ["ip", "link", "add", hv, "type", "veth", "peer", "name", "eth0", "netns", ns],
            ["ip", "addr", "add", f"198.18.{k}.1/29", "dev", hv],
            ["ip", "addr", "add", f"10.77.{k}.1/30", "dev", hv],
            ["ip", "link", "set", hv, "up"],
            ["ip", "-n", ns, "link", "set", "lo", "up"],
            ["ip", "-n", ns, "addr", "add", f"198.18.{k}.2/29", "dev", "eth0"],
            ["ip", "-n", ns, "addr", "add", f"198.18.{k}.3/29", "dev", "eth0"],
            ["ip", "-n", ns, "addr", "add", f"10.77.{k}.2/30", "dev", "eth0"],
            ["ip", "-n", ns, "link", "set", "eth0", "up"],
        ):
            sh(*argv)
        for address in (net.public, net.public2, net.private):
            assert _routed_via(address, hv), f"{address} does not route via {hv}"
        proc = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                ns,
                sys.executable,
                "-c",
                SERVER,
                json.dumps(net.zone()),
                str(cert),
                str(key),
                str(files),
                str(net.requests),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None and proc.stdout.readline().strip() == "up", proc.stderr
        yield net
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        sh("ip", "link", "del", hv, check=False)
        sh("ip", "netns", "del", ns, check=False)
