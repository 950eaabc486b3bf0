"""Secrets the egress proxy adds to requests for some hosts (`SANDBOX_EGRESS_SECRETS`, a
tenant's `egress_secrets` in the tokens file), so that a key never has to enter a jail. Pure.

Both are TOML tables of `"host:port"` → header name → value:

    ["api.example.com:443"]
    Authorization = "Bearer sk-..."

The host is an exact name (no wildcard, no address: a secret goes to exactly the host it
was configured for). Header names are HTTP tokens; framing and hop-by-hop headers (Host,
Content-Length, Connection, ...) cannot be set. Values are visible ASCII, no line breaks.
An error names the entry and the header, never the value.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from appliance.core.egress import Rule, is_ipv4, parse_rule
from appliance.core.errors import SettingsError
from appliance.core.ownfiles import read_private

TOKEN_RE = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,64}$")
VALUE_RE = re.compile(r"^[\x21-\x7e]([\x20-\x7e]*[\x21-\x7e])?$")
MAX_HOSTS = 256
MAX_HEADERS = 16
MAX_VALUE = 8192
# Headers that frame the message or belong to one hop: a secret must not change either.
FORBIDDEN = frozenset(
    {
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "proxy-connection",
        "keep-alive",
        "te",
        "trailer",
        "upgrade",
        "expect",
        "proxy-authorization",
        "proxy-authenticate",
    }
)


@dataclass(frozen=True, slots=True)
class SecretHeaders:
    """The headers one host gets; the values are never shown (repr, logs, errors)."""

    headers: tuple[tuple[str, str], ...]  # (name as configured, value)

    @property
    def names(self) -> tuple[str, ...]:
        """Lower case: what the ledger reports, and what a jail's own header of the same name loses to."""
        return tuple(name.lower() for name, _ in self.headers)

    def __repr__(self) -> str:
        return f"SecretHeaders(names={list(self.names)})"

    def merged(self, over: SecretHeaders) -> SecretHeaders:
        """These headers with `over`'s added; a name both have is `over`'s."""
        taken = set(over.names)
        return SecretHeaders(tuple(h for h in self.headers if h[0].lower() not in taken) + over.headers)


Secrets = Mapping[tuple[str, int], SecretHeaders]


def parse_secrets(doc: object, source: str) -> dict[tuple[str, int], SecretHeaders]:
    """A parsed TOML table of secrets; SettingsError naming `source` and the bad entry."""
    if not isinstance(doc, Mapping):
        raise SettingsError(f'{source}: must be a table of "host:port" = {{ Header = "value" }}')
    if len(doc) > MAX_HOSTS:
        raise SettingsError(f"{source}: more than {MAX_HOSTS} hosts")
    out: dict[tuple[str, int], SecretHeaders] = {}
    for key, headers in doc.items():
        where = f"{source}: {str(key)[:300]!r}"
        try:
            rule: Rule = parse_rule(str(key))
        except ValueError as exc:
            raise SettingsError(f"{where} {exc}") from None
        if rule.wildcard or is_ipv4(rule.host):
            raise SettingsError(f"{where} must be an exact host name (a secret goes to one host only)")
        if (rule.host, rule.port) in out:
            raise SettingsError(f"{where} is given twice")
        out[(rule.host, rule.port)] = _headers(headers, where)
    return out


def _headers(headers: object, where: str) -> SecretHeaders:
    if not isinstance(headers, Mapping) or not headers:
        raise SettingsError(
            f'{where} must be a table of header names and values, like Authorization = "Bearer ..."'
        )
    if len(headers) > MAX_HEADERS:
        raise SettingsError(f"{where} has more than {MAX_HEADERS} headers")
    seen: set[str] = set()
    pairs: list[tuple[str, str]] = []
    for name, value in headers.items():
        if not isinstance(name, str) or not TOKEN_RE.match(name):
            raise SettingsError(f"{where}: {str(name)[:80]!r} is not an HTTP header name")
        if name.lower() in FORBIDDEN:
            raise SettingsError(
                f"{where}: {name} frames the request or belongs to one hop; it cannot be a secret"
            )
        if name.lower() in seen:
            raise SettingsError(f"{where}: {name} is given twice")
        if not isinstance(value, str) or len(value) > MAX_VALUE or not VALUE_RE.match(value):
            # The value is the secret: say what is wrong with it, never what it is.
            raise SettingsError(
                f"{where}: the value of {name} must be a string of visible ASCII "
                f"(spaces inside, no line breaks), at most {MAX_VALUE} characters"
            )
        seen.add(name.lower())
        pairs.append((name, value))
    return SecretHeaders(tuple(pairs))


def load(path: Path, source: str = "SANDBOX_EGRESS_SECRETS") -> dict[tuple[str, int], SecretHeaders]:
    """Read and check the secrets file: a regular file of the server's own (not a link), which
    no one else may read or write (chmod 600)."""
    data = read_private(path, source)
    try:
        doc = tomllib.loads(data.decode())
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        # The parser's message may quote the line (a secret): say only where.
        where = re.search(r"line \d+", str(exc))
        raise SettingsError(f"{source}: not valid TOML" + (f" ({where.group()})" if where else "")) from None
    return parse_secrets(doc, source)
