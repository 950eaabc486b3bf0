"""The server name (SNI) of a TLS ClientHello, read from a tunnel's first bytes. Pure.

Only what the egress proxy needs to refuse domain fronting: the handshake records are
joined (a ClientHello may span records), the one message is walked field by field with
every length checked against what is there, and nothing past `MAX_HELLO_BYTES` is read.
No other TLS message is understood; anything else is "not a ClientHello".
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_HELLO_BYTES = 32768  # records holding the ClientHello; real ones are well under 2 KiB
RECORD_HEADER = 5
HANDSHAKE = 0x16
CLIENT_HELLO = 0x01
SERVER_NAME = 0x0000
HOST_NAME = 0x00


@dataclass(frozen=True, slots=True)
class Hello:
    """What the first bytes of a tunnel say: `more` (read on), or a verdict."""

    more: bool = False
    sni: str | None = None  # the host_name, lower case, when there is one
    problem: str | None = None  # why it is no ClientHello we accept


MORE = Hello(more=True)


def _bad(why: str) -> Hello:
    return Hello(problem=why)


def _handshake_bytes(buf: bytes) -> tuple[bytes, bool] | Hello:
    """The handshake layer's bytes across the records in buf, and whether a record is cut."""
    out = bytearray()
    at = 0
    while at < len(buf):
        if len(buf) - at < RECORD_HEADER:
            return bytes(out), True
        kind, major, length = buf[at], buf[at + 1], int.from_bytes(buf[at + 3 : at + 5], "big")
        if kind != HANDSHAKE or major != 3:
            return _bad("the tunnel's first bytes are not a TLS handshake")
        if length == 0 or length > 16384 + 2048:
            return _bad("a TLS record of impossible length")
        if len(buf) - at - RECORD_HEADER < length:
            out += buf[at + RECORD_HEADER :]
            return bytes(out), True
        out += buf[at + RECORD_HEADER : at + RECORD_HEADER + length]
        at += RECORD_HEADER + length
    return bytes(out), False


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.at = data, 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.at + n > len(self.data):
            raise ValueError("a length runs past the ClientHello")
        chunk = self.data[self.at : self.at + n]
        self.at += n
        return chunk

    def num(self, n: int) -> int:
        return int.from_bytes(self.take(n), "big")

    def vec(self, n: int) -> bytes:
        return self.take(self.num(n))


def parse(buf: bytes) -> Hello:
    """The ClientHello at the start of buf: MORE while it is incomplete (and under the bound)."""
    if buf and buf[0] != HANDSHAKE:
        return _bad("the tunnel's first bytes are not a TLS handshake")
    got = _handshake_bytes(buf[:MAX_HELLO_BYTES])
    if isinstance(got, Hello):
        return got
    data, cut = got
    if len(data) < 4:
        return MORE if len(buf) < MAX_HELLO_BYTES else _bad("the ClientHello is too long")
    if data[0] != CLIENT_HELLO:
        return _bad("the first handshake message is not a ClientHello")
    length = int.from_bytes(data[1:4], "big")
    if length + 4 > MAX_HELLO_BYTES:
        return _bad("the ClientHello is too long")
    if len(data) < length + 4:
        if not cut and len(buf) >= MAX_HELLO_BYTES:
            return _bad("the ClientHello is too long")
        return MORE
    try:
        return Hello(sni=_server_name(data[4 : 4 + length]))
    except ValueError as exc:
        return _bad(str(exc))


def _server_name(body: bytes) -> str | None:
    r = _Reader(body)
    r.take(2 + 32)  # legacy version, random
    r.vec(1)  # session id
    r.vec(2)  # cipher suites
    r.vec(1)  # compression methods
    if r.at == len(body):
        return None  # no extensions at all
    ext = _Reader(r.vec(2))
    while ext.at < len(ext.data):
        kind = ext.num(2)
        data = ext.vec(2)
        if kind != SERVER_NAME:
            continue
        names = _Reader(_Reader(data).vec(2))
        while names.at < len(names.data):
            name_type = names.num(1)
            name = names.vec(2)
            if name_type == HOST_NAME:
                try:
                    return name.decode("ascii").lower()
                except UnicodeDecodeError:
                    raise ValueError("the server name is not ASCII") from None
        return None
    return None
