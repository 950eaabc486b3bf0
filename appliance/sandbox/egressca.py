"""The appliance's own CA, for the egress proxy's TLS interception of the hosts that get
secrets (appliance.core.egresssecrets): it mints a short-lived certificate per host, and
jails trust it through a bundle staged read-only into them (the system's CAs plus this one).

The CA is made at startup, in memory, per server (a new key each start, never written
anywhere), or read from `SANDBOX_EGRESS_CA` (a PEM file holding the CA's certificate and
its unencrypted key: a regular file of the server's own, mode 0600). Its key never leaves
the server process: leaf keys and certificates reach OpenSSL through a memfd, not a file.

Upstreams are verified against the system's trust store, or `SANDBOX_EGRESS_UPSTREAM_CA`.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import secrets
import shutil
import ssl
import stat
import tempfile
import time
from collections import OrderedDict
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from appliance.core.errors import StartupError
from appliance.core.ownfiles import read_private

CA_DAYS = 365  # a made CA lives as long as its server process; this only bounds a leaked copy
LEAF_S = 3600  # a leaf certificate's life
LEAF_RENEW_S = 600  # a cached leaf with less than this left is minted again
MAX_LEAVES = 512
BUNDLE = "bundle.pem"
CA_FILE = "ca.pem"  # the appliance's CA alone (node's NODE_EXTRA_CA_CERTS)
ALPN = ["http/1.1"]  # the interception speaks HTTP/1.1 only, both ways


def _load_ca(path: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    source = "SANDBOX_EGRESS_CA"
    data = read_private(path, source, StartupError)
    try:
        cert = x509.load_pem_x509_certificate(data)
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise StartupError(
            f"{source}: {path} must hold a PEM certificate and its unencrypted private key ({exc})"
        ) from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise StartupError(f"{source}: the CA key must be an EC key (P-256 or P-384)")
    if key.public_key().public_numbers() != cert.public_key().public_numbers():  # type: ignore[union-attr]
        raise StartupError(f"{source}: the key is not the certificate's")
    try:
        basic = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    except x509.ExtensionNotFound:
        basic = None
    if basic is None or not basic.ca:
        raise StartupError(f"{source}: the certificate is not a CA (BasicConstraints CA:TRUE)")
    now = datetime.datetime.now(datetime.UTC)
    if not cert.not_valid_before_utc <= now < cert.not_valid_after_utc - datetime.timedelta(seconds=LEAF_S):
        raise StartupError(f"{source}: the CA certificate is not valid now (or expires within the hour)")
    return cert, key


def _make_ca() -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "appliance"),
            x509.NameAttribute(NameOID.COMMON_NAME, f"appliance egress CA {secrets.token_hex(6)}"),
        ]
    )
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def _system_cas() -> bytes:
    """The system's trust store as PEM (what jails trusted before), or nothing."""
    paths = ssl.get_default_verify_paths()
    for candidate in (paths.openssl_cafile, paths.cafile, "/etc/ssl/certs/ca-certificates.crt"):
        if candidate and os.path.isfile(candidate):
            with contextlib.suppress(OSError):
                return Path(candidate).read_bytes()
    return b""


def _memfd_context(pem: bytes) -> ssl.SSLContext:
    """A server context whose certificate chain and key are `pem`, loaded through a memfd so
    the key is never in a file any other process could open."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_alpn_protocols(ALPN)
    fd = os.memfd_create("appliance-leaf", os.MFD_CLOEXEC)
    try:
        os.write(fd, pem)
        ctx.load_cert_chain(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)
    return ctx


def _purge_stale(parent: Path) -> None:
    """Bundles left by servers that are gone (a crash skips `unstage`): a directory of this
    uid's, named for a process that no longer runs. Others' are left alone."""
    for path in parent.glob("egress-ca-*-*"):
        pid = path.name.split("-")[2]
        try:
            st = path.lstat()
        except OSError:
            continue
        if not pid.isdigit() or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            continue
        if not Path(f"/proc/{pid}").exists():
            shutil.rmtree(path, ignore_errors=True)


class EgressCA:
    """The CA, the leaf contexts it has minted (per host, cached), the jails' bundle, and the
    context upstreams are verified with."""

    def __init__(self, ca_path: Path | None, upstream_ca: Path | None) -> None:
        self.cert, self._key = _load_ca(ca_path) if ca_path is not None else _make_ca()
        self._leaf_key = ec.generate_private_key(ec.SECP256R1())
        self._leaf_key_pem = self._leaf_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        self._leaves: OrderedDict[str, tuple[float, ssl.SSLContext]] = OrderedDict()
        self.bundle_dir: Path | None = None
        try:
            self.upstream = ssl.create_default_context(cafile=str(upstream_ca) if upstream_ca else None)
        except (OSError, ssl.SSLError) as exc:
            raise StartupError(f"SANDBOX_EGRESS_UPSTREAM_CA: cannot load {upstream_ca}: {exc}") from None
        self.upstream.minimum_version = ssl.TLSVersion.TLSv1_2
        self.upstream.set_alpn_protocols(ALPN)

    @property
    def ca_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    @property
    def bundle(self) -> Path | None:
        return self.bundle_dir / BUNDLE if self.bundle_dir is not None else None

    @property
    def ca_file(self) -> Path | None:
        return self.bundle_dir / CA_FILE if self.bundle_dir is not None else None

    def stage(self, parent: Path) -> Path:
        """Write the jails' bundle (system CAs + this CA) and the CA alone into a fresh
        directory under `parent` (readable by all: it holds certificates, no key)."""
        parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        _purge_stale(parent)
        directory = Path(tempfile.mkdtemp(prefix=f"egress-ca-{os.getpid()}-", dir=parent))
        directory.chmod(0o755)
        system = _system_cas()
        for name, data in (
            (BUNDLE, system.rstrip(b"\n") + b"\n" + self.ca_pem if system else self.ca_pem),
            (CA_FILE, self.ca_pem),
        ):
            path = directory / name
            path.write_bytes(data)
            path.chmod(0o644)
        self.bundle_dir = directory
        return directory

    def unstage(self) -> None:
        if self.bundle_dir is not None:
            shutil.rmtree(self.bundle_dir, ignore_errors=True)
            self.bundle_dir = None

    def context_for(self, host: str) -> ssl.SSLContext:
        """The server context that presents `host`'s leaf (minted now, or cached while it has
        more than LEAF_RENEW_S to live)."""
        now = time.time()
        cached = self._leaves.get(host)
        if cached is not None and cached[0] - now > LEAF_RENEW_S:
            self._leaves.move_to_end(host)
            return cached[1]
        ctx = _memfd_context(self._mint(host) + self.ca_pem + self._leaf_key_pem)
        self._leaves[host] = (now + LEAF_S, ctx)
        while len(self._leaves) > MAX_LEAVES:
            self._leaves.popitem(last=False)
        return ctx

    def _mint(self, host: str) -> bytes:
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)]))
            .issuer_name(self.cert.subject)
            .public_key(self._leaf_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(seconds=LEAF_S))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(host)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(True, False, False, False, False, False, False, False, False), critical=True
            )
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()), critical=False
            )
            .sign(self._key, hashes.SHA256())
        )
        return cert.public_bytes(serialization.Encoding.PEM)
