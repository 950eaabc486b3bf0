"""The egress proxy's TLS interception, for the hosts that get secrets only: the jail's side
of the tunnel is answered with the appliance CA's certificate for the host
(appliance.sandbox.egressca), its one request read, its secret headers set, and sent on
over a verified TLS connection to the real host.

`TlsStream` speaks TLS over the jail's side of the flow with memory BIOs: the ClientHello the
proxy has already read (for its SNI check) is fed in first, so nothing is read twice.
"""

from __future__ import annotations

import contextlib
import ssl
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import h11

from appliance.core import egresssecrets, tenants
from appliance.core.egresssecrets import SecretHeaders, Secrets
from appliance.core.errors import SettingsError
from appliance.sandbox.egressca import EgressCA

if TYPE_CHECKING:
    from appliance.settings import Settings

CHUNK = 262144
TRUST_ENV = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "PIP_CERT", "CURL_CA_BUNDLE", "NODE_EXTRA_CA_CERTS")


class Side(Protocol):
    """What TLS is spoken over: the jail's side of a flow (read, write, drain)."""

    async def read(self, n: int = -1) -> bytes: ...

    def write(self, data: bytes) -> None: ...

    async def drain(self) -> None: ...


class TlsStream:
    """The server side of TLS over the jail's side of a flow: read, write, drain, like the
    sides the proxy's relay takes."""

    def __init__(self, ctx: ssl.SSLContext, reader: Side, writer: Side, first: bytes) -> None:
        self._in = ssl.MemoryBIO()
        self._out = ssl.MemoryBIO()
        self._tls = ctx.wrap_bio(self._in, self._out, server_side=True)
        self._in.write(first)
        self._reader = reader
        self._writer = writer

    def _flush(self) -> None:
        data = self._out.read()
        if data:
            self._writer.write(data)

    async def _fill(self) -> None:
        data = await self._reader.read(CHUNK)
        if data:
            self._in.write(data)
        else:
            self._in.write_eof()

    async def handshake(self) -> None:
        """ssl.SSLError when the jail's client does not complete it (it does not trust the CA)."""
        while True:
            try:
                self._tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                self._flush()
                await self._writer.drain()
                await self._fill()
        self._flush()

    async def read(self, n: int = -1) -> bytes:
        size = CHUNK if n < 0 else n
        while True:
            try:
                data = self._tls.read(size)
            except ssl.SSLWantReadError:
                self._flush()
                await self._fill()
                continue
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return b""
            self._flush()  # a read may produce a reply (a key update)
            return data

    def write(self, data: bytes) -> None:
        if data:
            self._tls.write(data)
            self._flush()

    async def drain(self) -> None:
        await self._writer.drain()

    def can_write_eof(self) -> bool:
        return False

    def write_eof(self) -> None:
        return None

    def close_notify(self) -> None:
        """Say the end in TLS (close_notify) before the connection closes; best effort."""
        with contextlib.suppress(ssl.SSLError):
            self._tls.unwrap()
        self._flush()


def with_secrets(request: h11.Request, secret: SecretHeaders, host: str) -> h11.Request:
    """The request with the secret headers set: a header of the same name the jail sent is
    dropped, not merged, so the jail can neither read nor steer the value that goes out.
    (Its Host is set again from the flow by the proxy.)"""
    taken = {*secret.names, "host"}
    headers = [(b"host", host.encode())]
    headers += [(k, v) for k, v in request.headers if k.decode("latin-1").lower() not in taken]
    headers += [(name.encode("ascii"), value.encode("ascii")) for name, value in secret.headers]
    return h11.Request(method=request.method, target=request.target, headers=headers, http_version="1.1")


class Interception:
    """The hosts that get secrets and the CA that stands in for them."""

    def __init__(self, ca: EgressCA, secrets: Secrets) -> None:
        self.ca = ca
        self.secrets = secrets

    def secret_for(self, host: str, port: int, tenant: Secrets | None = None) -> SecretHeaders | None:
        """The headers a flow to host:port gets: the server's, with its tenant's over them."""
        mine = self.secrets.get((host, port))
        theirs = tenant.get((host, port)) if tenant is not None else None
        if mine is None or theirs is None:
            return mine or theirs
        return mine.merged(theirs)


def load_interception(settings: Settings) -> Interception | None:
    """The server's secrets and the CA (SANDBOX_EGRESS_SECRETS, SANDBOX_EGRESS_CA,
    SANDBOX_EGRESS_UPSTREAM_CA), checked at startup; None when neither the server nor any
    tenant (SANDBOX_AUTH_TOKENS_FILE's egress_secrets) gives a host secrets."""
    by_tenant = settings.auth_tokens_file is not None and any(
        t.egress_secrets for t in tenants.load(settings.auth_tokens_file)
    )
    if settings.egress_secrets is None and not by_tenant:
        return None
    if not settings.egress_allow_domains:  # nothing would carry them: refused, not ignored
        raise SettingsError(
            "SANDBOX_AUTH_TOKENS_FILE: a tenant's egress_secrets needs SANDBOX_EGRESS_ALLOW_DOMAINS (the egress proxy)"
        )
    server = egresssecrets.load(settings.egress_secrets) if settings.egress_secrets is not None else {}
    return Interception(EgressCA(settings.egress_ca, settings.egress_upstream_ca), server)


def trust_env(bundle: Path, ca: Path) -> tuple[tuple[str, str], ...]:
    """What points a jail's TLS clients at the bundle (the system's CAs and the appliance's):
    OpenSSL and Python's ssl, requests, pip, curl; node adds the appliance's CA to its own."""
    return tuple((name, str(ca if name == "NODE_EXTRA_CA_CERTS" else bundle)) for name in TRUST_ENV)
