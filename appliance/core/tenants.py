"""Several tenants (`SANDBOX_AUTH_TOKENS_FILE`): who a bearer token belongs to, and their quotas.

The file is TOML, one `[[tenant]]` table per tenant:

    [[tenant]]
    name = "alice"                 # [A-Za-z0-9_.-], 1-64 characters, unique
    token_sha256 = "9f86d0..."     # hex SHA-256 of the token (preferred), or
    # token = "a-long-random-secret"   (plain; the file must then be chmod 600)
    max_concurrency = 2            # requests in flight at once (running or queued)
    max_sessions = 4               # open sessions
    runs_per_minute = 60           # token bucket: refills this many per minute ...
    burst = 10                     # ... and holds at most this many (default: runs_per_minute)
    max_gpu_mb = 8192              # GPU memory its runs and sessions hold at once (GPU mode)
    egress_allow_domains = ["api.example.com:443"]  # names its runs may reach, within the server's

    [tenant.egress_secrets."api.example.com:443"]  # headers the egress proxy adds for its runs
    Authorization = "Bearer sk-..."                # (appliance.core.egresssecrets; the file: chmod 600)

Every quota is optional (absent: only the server-wide limits apply); unknown keys are
errors, so a misspelt quota cannot silently switch itself off. A tenant is known by the
SHA-256 of its token (`owner_of`), which is also what sessions are bound to. Tokens are
compared in constant time against every tenant, with no early exit, and never logged.

Parsing is pure; `Tenants` holds the per-tenant counters and buckets (asyncio, one thread).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import stat
import time
import tomllib
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appliance.core import backpressure
from appliance.core.egress import Rules, parse_rules
from appliance.core.egresssecrets import Secrets, parse_secrets
from appliance.core.errors import Busy, SettingsError

NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
MIN_TOKEN_CHARS = 16
KEYS = {
    "name",
    "token",
    "token_sha256",
    "max_concurrency",
    "max_sessions",
    "runs_per_minute",
    "burst",
    "max_gpu_mb",
    "egress_allow_domains",
    "egress_secrets",
}


def owner_of(token: str | None) -> str:
    """The owner name of a credential: hex SHA-256 of the token; sessions are bound to it."""
    return hashlib.sha256((token or "").encode()).hexdigest()


@dataclass(frozen=True)
class Tenant:
    """One tenant and its quotas; None means no per-tenant limit."""

    name: str
    owner: str = field(repr=False)  # hex SHA-256 of the token
    max_concurrency: int | None = None
    max_sessions: int | None = None
    runs_per_minute: float | None = None
    burst: int | None = None
    max_gpu_mb: int | None = None
    egress_allow_domains: Rules | None = None  # narrows SANDBOX_EGRESS_ALLOW_DOMAINS for its runs
    egress_secrets: Secrets | None = field(default=None, repr=False)  # headers its runs' requests get


class TokenBucket:
    """`capacity` runs at once, refilled at `rate_per_s`; time comes from `clock` (monotonic seconds)."""

    def __init__(self, capacity: int, rate_per_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = capacity
        self.rate_per_s = rate_per_s
        self._clock = clock
        self._tokens = float(capacity)
        self._at = clock()

    def take(self) -> float:
        """Take one run: 0.0 if allowed, else the seconds until one will be."""
        now = self._clock()
        self._tokens = min(self.capacity, self._tokens + (now - self._at) * self.rate_per_s)
        self._at = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return 0.0
        return (1.0 - self._tokens) / self.rate_per_s

    def wait_s(self) -> float:
        """Seconds until one run will be allowed (0.0: now), taking nothing."""
        tokens = min(self.capacity, self._tokens + (self._clock() - self._at) * self.rate_per_s)
        return 0.0 if tokens >= 1.0 else (1.0 - tokens) / self.rate_per_s


def _positive_int(entry: Mapping[str, Any], key: str, where: str) -> int | None:
    value = entry.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SettingsError(f"{where}: {key} must be a whole number of at least 1, got {value!r}")
    return value


def _rules(entry: Mapping[str, Any], key: str, where: str) -> Rules | None:
    value = entry.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise SettingsError(f'{where}: {key} must be a list of "host:port" strings')
    return parse_rules(value, f"{where}: {key}")


def parse(text: str, source: str = "SANDBOX_AUTH_TOKENS_FILE") -> tuple[tuple[Tenant, ...], bool]:  # noqa: C901, PLR0912 (one check per field of the tenants file, each with its own message)
    """The tenants a file describes, and whether any token in it is plain text. Pure."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"{source}: not valid TOML: {exc}") from None
    extra = set(doc) - {"tenant"}
    if extra:
        raise SettingsError(f"{source}: unknown top-level keys {sorted(extra)}; expected [[tenant]] tables")
    entries = doc.get("tenant")
    if not isinstance(entries, list) or not entries:
        raise SettingsError(f"{source}: no [[tenant]] tables")
    tenants: list[Tenant] = []
    plain = False
    for number, entry in enumerate(entries, 1):
        where = f"{source}: tenant #{number}"
        unknown = set(entry) - KEYS
        if unknown:
            raise SettingsError(f"{where}: unknown keys {sorted(unknown)} (known: {sorted(KEYS)})")
        name = entry.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise SettingsError(f"{where}: name must be 1-64 of [A-Za-z0-9_.-], got {name!r}")
        where = f"{source}: tenant {name!r}"
        token, digest = entry.get("token"), entry.get("token_sha256")
        if (token is None) == (digest is None):
            raise SettingsError(f"{where}: give exactly one of token or token_sha256")
        if token is not None:
            if not isinstance(token, str) or len(token) < MIN_TOKEN_CHARS or any(c.isspace() for c in token):
                raise SettingsError(
                    f"{where}: token must be at least {MIN_TOKEN_CHARS} characters, no whitespace"
                )
            owner, plain = owner_of(token), True
        else:
            if not isinstance(digest, str) or not SHA256_HEX.fullmatch(digest.lower()):
                raise SettingsError(f"{where}: token_sha256 must be 64 hex digits")
            owner = digest.lower()
        rpm = entry.get("runs_per_minute")
        if rpm is not None and (isinstance(rpm, bool) or not isinstance(rpm, int | float) or not rpm > 0):
            raise SettingsError(f"{where}: runs_per_minute must be a number above 0, got {rpm!r}")
        burst = _positive_int(entry, "burst", where)
        if burst is not None and rpm is None:
            raise SettingsError(f"{where}: burst needs runs_per_minute")
        tenants.append(
            Tenant(
                name=name,
                owner=owner,
                max_concurrency=_positive_int(entry, "max_concurrency", where),
                max_sessions=_positive_int(entry, "max_sessions", where),
                runs_per_minute=float(rpm) if rpm is not None else None,
                burst=burst,
                max_gpu_mb=_positive_int(entry, "max_gpu_mb", where),
                egress_allow_domains=_rules(entry, "egress_allow_domains", where),
                egress_secrets=(
                    parse_secrets(entry["egress_secrets"], f"{where}: egress_secrets")
                    if "egress_secrets" in entry
                    else None
                ),
            )
        )
    names = [t.name for t in tenants]
    if len(set(names)) != len(names):
        raise SettingsError(f"{source}: tenant names must be unique")
    if len({t.owner for t in tenants}) != len(tenants):
        raise SettingsError(f"{source}: two tenants share a token")
    return tuple(tenants), plain


def load(path: Path) -> tuple[Tenant, ...]:
    """Read and check the tokens file; a file holding plain tokens must not be readable by others."""
    try:
        st = path.stat()
        text = path.read_text()
    except OSError as exc:
        raise SettingsError(f"SANDBOX_AUTH_TOKENS_FILE: cannot read {path}: {exc.strerror}") from None
    tenants, plain = parse(text)
    if any(t.egress_secrets for t in tenants) and st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SettingsError(
            f"SANDBOX_AUTH_TOKENS_FILE: {path} holds egress_secrets and is readable by group or others (chmod 600 it)"
        )
    if plain and st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SettingsError(
            f"SANDBOX_AUTH_TOKENS_FILE: {path} holds plain tokens and is readable by "
            f"group or others (chmod 600 it, or store token_sha256 instead)"
        )
    return tenants


@dataclass
class _State:
    tenant: Tenant
    bucket: TokenBucket | None
    in_flight: int = 0
    gpu_mb: int = 0  # GPU budget its runs and sessions hold now


class Tenants:
    """Identifies tenants by token and holds their live counters and rate buckets."""

    def __init__(self, tenants: tuple[Tenant, ...], clock: Callable[[], float] = time.monotonic) -> None:
        self._states: dict[str, _State] = {}
        for t in tenants:
            bucket = None
            if t.runs_per_minute is not None:
                capacity = t.burst if t.burst is not None else max(1, int(t.runs_per_minute))
                bucket = TokenBucket(capacity, t.runs_per_minute / 60.0, clock)
            self._states[t.owner] = _State(t, bucket)
        self._owners = tuple(bytes.fromhex(o) for o in self._states)

    def __len__(self) -> int:
        return len(self._states)

    def identify(self, token: str | None) -> Tenant | None:
        """The tenant holding this token, or None. Every tenant is compared, match or not."""
        presented = hashlib.sha256((token or "").encode()).digest()
        found: bytes | None = None
        for owner in self._owners:
            same = hmac.compare_digest(presented, owner)
            found = owner if same else found
        if token is None or found is None:
            return None
        return self._states[found.hex()].tenant

    def egress_rules(self, owner: str) -> Rules | None:
        """The owner's tenant's egress allowlist, or None when it has none of its own."""
        state = self._states.get(owner)
        return state.tenant.egress_allow_domains if state is not None else None

    def egress_secrets(self, owner: str) -> Secrets | None:
        """The headers the egress proxy adds for the owner's tenant's runs, or None."""
        state = self._states.get(owner)
        return state.tenant.egress_secrets if state is not None else None

    def session_limits(self) -> dict[str, int]:
        """owner -> max_sessions, for the tenants that have one."""
        return {
            o: s.tenant.max_sessions for o, s in self._states.items() if s.tenant.max_sessions is not None
        }

    def charge(self, owner: str) -> None:
        """A frame of this owner's was refused: it costs one rate token, like a run (nothing
        when the bucket is empty already), so malformed frames cannot be sent for free."""
        state = self._states.get(owner)
        if state is not None and state.bucket is not None:
            state.bucket.take()

    def over_rate(self, owner: str) -> str | None:
        """Why the owner's tenant may send no costly frame now (its bucket is empty), or None."""
        state = self._states.get(owner)
        if state is None or state.bucket is None:
            return None
        wait_s = state.bucket.wait_s()
        return _over_rate(state.tenant, wait_s) if wait_s > 0 else None

    @contextmanager
    def request(self, owner: str) -> Iterator[None]:
        """Hold one in-flight request of the owner's tenant; raise Busy naming the quota if over it.

        Owners that are not tenants (the canary) pass untouched.
        """
        state = self._states.get(owner)
        if state is None:
            yield
            return
        t = state.tenant
        if t.max_concurrency is not None and state.in_flight >= t.max_concurrency:
            raise Busy(
                f"tenant {t.name!r} is at its concurrency quota "
                f"(max_concurrency={t.max_concurrency} requests in flight); try again when one ends"
            )
        if state.bucket is not None:
            wait_s = state.bucket.take()
            if wait_s > 0:
                raise Busy(_over_rate(t, wait_s), retry_after_ms=backpressure.clamp_ms(wait_s * 1000))
        state.in_flight += 1
        try:
            yield
        finally:
            state.in_flight -= 1

    def hold_gpu(self, owner: str, mb: int) -> Callable[[], None]:
        """Hold mb of the owner's GPU quota until the returned release is called (once is enough).

        Raises Busy naming the quota when the tenant's runs and sessions would hold more
        than max_gpu_mb. A session holds its budget for its whole life, a run for its own.
        """
        state = self._states.get(owner)
        if state is None or mb <= 0 or state.tenant.max_gpu_mb is None:
            return _nothing
        quota = state.tenant.max_gpu_mb
        if state.gpu_mb + mb > quota:
            raise Busy(
                f"tenant {state.tenant.name!r} is at its GPU quota (max_gpu_mb={quota}: "
                f"{state.gpu_mb} MiB held by its runs and sessions, {mb} MiB asked); "
                f"try again when one ends"
            )
        state.gpu_mb += mb
        held = [mb]

        def release() -> None:
            if held:
                state.gpu_mb -= held.pop()

        return release


def _nothing() -> None:
    return None


def _over_rate(tenant: Tenant, wait_s: float) -> str:
    return (
        f"tenant {tenant.name!r} is over its rate limit (runs_per_minute="
        f"{tenant.runs_per_minute:g}); retry in {wait_s:.1f} s"
    )
