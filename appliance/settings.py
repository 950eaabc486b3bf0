"""Settings, read once from `SANDBOX_*` environment variables into a frozen object.

Every field has a default and a unit in its name. An invalid value stops startup
with a message naming the variable.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import overload

from appliance.core.egress import Rules, parse_rules
from appliance.core.errors import SettingsError

DEFAULT_PRELOAD = ("numpy", "pandas", "matplotlib")
# GPU mode also warms the model tools (llama.cpp, whisper.cpp) in pooled jails.
GPU_PRELOAD = ("llama_cpp", "pywhispercpp.model", "appliance.tools")
GPU_BACKENDS = ("nvml", "simulated")
GPU_MPS_MODES = ("auto", "require", "off")
GPU_SIMULATE_MPS = ("off", "on", "ignore-limits")
# What GPU mode does where the host cannot give the watchdog what it needs (appliance.gpu.hostcheck):
# strict refuses (startup error, or a run stopped); best-effort runs on, degraded, said in /readyz and /metrics.
GPU_ENFORCE = ("strict", "best-effort")
CGROUP_MODES = ("auto", "require", "off")
DEFAULT_UIDS = 64  # SANDBOX_UID_RANGE's least size when unset
MAX_UIDS = 65536  # the most uids SANDBOX_UID_RANGE may span (one lock file each)
MPS_PIPE_DIR = Path("/tmp/nvidia-mps")  # noqa: S108 (CUDA's own default CUDA_MPS_PIPE_DIRECTORY)


@dataclass(frozen=True)
class Settings:
    """Everything the appliance is configured with."""

    max_exec_ms: int = 15000
    # Where <tmp_root>/appliance/ is made (SANDBOX_TMP_ROOT): root-only by default, so no local
    # user can make it first (appliance.sandbox.trust checks the chain whatever is set).
    tmp_root: Path = Path("/run")
    memory_mb: int = 1024
    max_procs: int = 64
    max_file_mb: int = 100
    max_open_files: int = 1024
    max_disk_mb: int = 1024
    max_output_bytes: int = 1048576
    max_message_bytes: int = 16777216
    max_upload_bytes: int = 8388608
    max_file_out_bytes: int = 8388608
    max_outputs_bytes: int = 67108864  # all outputs/ files of one run together (SANDBOX_MAX_OUTPUTS_BYTES)
    max_output_files: int = (
        1000  # outputs/ files (and their directories) one run returns (SANDBOX_MAX_OUTPUT_FILES)
    )
    max_stdin_bytes: int = 1048576  # stdin a run may have waiting for it to read (SANDBOX_MAX_STDIN_BYTES)
    client_stall_ms: int = 10000  # a client that takes no frame this long is dropped
    # A run's frames are kept for `attach` (appliance/api/runlog.py) until this long after its
    # `done` (SANDBOX_REATTACH_S; 0: only while it runs), each run's within max_output_bytes,
    # and a tenant's finished runs within a count and a byte total (oldest evicted first).
    reattach_s: int = 60
    reattach_runs: int = 100  # SANDBOX_REATTACH_RUNS
    reattach_bytes: int = 16777216  # SANDBOX_REATTACH_BYTES
    # Bytes of WebSocket messages held unfinished or not yet taken (appliance/api/framebudget.py):
    # server-wide (0: 4 x max_message_bytes) and per tenant (0: half of it with a tokens file,
    # else all of it); a message must be finished within frame_deadline_ms of its first header.
    frame_buffer_bytes: int = 0
    tenant_frame_buffer_bytes: int = 0
    frame_deadline_ms: int = 30000
    max_concurrency: int = 4
    # Runs waiting for a slot (SANDBOX_MAX_QUEUE). Past it a request is refused `busy`, and a
    # closed-loop client whose answer just came takes the freed place before any refused one
    # retries, so a load of more clients than slots + queue starves some of them for minutes:
    # sized for a typical trainer (256 concurrent clients) to wait in this FIFO line instead.
    # A waiting request holds its parsed body (each within max_message_bytes; the line's sum
    # within max_queue_bytes).
    max_queue: int = 256
    # Bytes of request (code and files) the waiting runs hold together (SANDBOX_MAX_QUEUE_BYTES;
    # 0: 4 x max_message_bytes); past it a request that would wait is refused `busy` too.
    max_queue_bytes: int = 0
    uid: int = 1001
    # Uids jails take one each, exclusively (SANDBOX_UID_RANGE, appliance.sandbox.uids); (0, 0):
    # unset, `load` fills in SANDBOX_UID .. SANDBOX_UID + `default_uid_count` - 1.
    uid_range: tuple[int, int] = (0, 0)
    auth_token: str | None = field(default=None, repr=False)
    # Browser origins allowed to call the API (SANDBOX_ALLOWED_ORIGINS); empty: none.
    allowed_origins: tuple[str, ...] = ()
    # Host names requests may carry besides IP literals and localhost (SANDBOX_ALLOWED_HOSTS);
    # empty: only those on a loopback-only server, any on one bound to a network address.
    allowed_hosts: tuple[str, ...] = ()
    # The only token /metrics accepts, when set (SANDBOX_METRICS_TOKEN).
    metrics_token: str | None = field(default=None, repr=False)
    max_upload_files: int = 1000  # file entries one request may carry (SANDBOX_MAX_UPLOAD_FILES)
    open_ports: tuple[int, ...] = ()
    egress_allow_nets: tuple[
        str, ...
    ] = ()  # private IPv4 networks runs may reach (SANDBOX_EGRESS_ALLOW_NETS)
    egress_dns: tuple[str, ...] = ()  # resolvers reachable when 53 is open (SANDBOX_EGRESS_DNS)
    egress_subnet: str = "10.216.0.0/16"  # jail links are /30s carved from it (SANDBOX_EGRESS_SUBNET)
    # Names runs may reach through the egress proxy (SANDBOX_EGRESS_ALLOW_DOMAINS); when set,
    # the proxy is a jail's only way out (appliance.sandbox.egressproxy).
    egress_allow_domains: Rules = ()
    egress_proxy_port: int = 3128  # where the proxy listens on each jail's link (SANDBOX_EGRESS_PROXY_PORT)
    egress_idle_ms: int = 60000  # a proxied flow with no byte either way this long is closed
    egress_log: Path | None = None  # a JSON line per flow, appended here (SANDBOX_EGRESS_LOG)
    # Headers the proxy adds for some hosts (appliance.core.egresssecrets), the CA it stands in
    # for them with (made per start when unset), and the CAs their real certificates must chain to.
    egress_secrets: Path | None = None  # SANDBOX_EGRESS_SECRETS
    egress_ca: Path | None = None  # SANDBOX_EGRESS_CA
    egress_upstream_ca: Path | None = None  # SANDBOX_EGRESS_UPSTREAM_CA (unset: the system's)
    # How long a connection asked about (`"egress": {"ask": true}`) waits for the client's answer.
    egress_ask_ms: int = 30000
    auth_tokens_file: Path | None = None  # several tenants (SANDBOX_AUTH_TOKENS_FILE); see tenants.py
    gpu: bool = False
    preload: tuple[str, ...] = DEFAULT_PRELOAD
    # Warm-jail kinds, name -> modules (SANDBOX_PRELOAD_PROFILES); by default from `preload`.
    preload_profiles: tuple[tuple[str, tuple[str, ...]], ...] = (("bare", ()), ("full", DEFAULT_PRELOAD))
    pool_size: int = 2
    pool_max: int = 8
    session_idle_s: int = 600
    max_sessions: int = 32
    outputs_dir: Path | None = None
    outputs_retention_s: int = (
        604800  # persisted runs older than this are removed; 0: kept (SANDBOX_OUTPUTS_RETENTION_S)
    )
    # Session snapshots (appliance.sandbox.snapshots): where they are kept (None: snapshots are
    # off), the most one may weigh, and how many one tenant may keep.
    snapshot_dir: Path | None = None
    max_snapshot_mb: int = 1024
    max_snapshots: int = 16
    python: Path = Path(sys.executable)
    shutdown_grace_s: float = 10.0
    jail_threads: int = 1
    firejail: str = "firejail"
    models_dir: Path | None = None  # read-only models for appliance.tools (SANDBOX_MODELS_DIR)
    wheelhouse: Path | None = None  # wheels `%pip install` may use, read-only (SANDBOX_WHEELHOUSE)
    gpu_default_mb: int = 1024  # budget of a run that names none; 0: such runs get no GPU
    gpu_margin_mb: int = 256  # per-device headroom at admission; slack before a kill
    gpu_backend: str = "nvml"  # nvml (real) or simulated (tests, no GPU)
    gpu_simulate_mb: tuple[int, ...] = (16384,)  # simulated device totals (SANDBOX_GPU_SIMULATE)
    gpu_simulate_file: Path | None = None  # simulated per-PID usage / faults (SANDBOX_GPU_SIMULATE_FILE)
    gpu_queue_ms: int = 120000  # longest wait for GPU memory before `busy`
    gpu_poll_ms: int = 250  # watchdog polling interval
    gpu_reclaim_ms: int = 10000  # longest hold of a finished run's grant until NVML shows it freed
    gpu_mps: str = "auto"  # MPS limits: auto (where proven), require, off
    gpu_mps_pipe_dir: Path = MPS_PIPE_DIR  # the MPS daemon's CUDA_MPS_PIPE_DIRECTORY
    gpu_libcuda: str = "libcuda.so.1"  # the CUDA driver library jails load (SANDBOX_GPU_LIBCUDA)
    gpu_simulate_mps: str = "off"  # simulated backend: an MPS daemon (on, ignore-limits)
    gpu_enforce: str = "strict"  # strict (fail closed) or best-effort (SANDBOX_GPU_ENFORCE)
    cgroups: str = "auto"  # per-run cgroups: auto (where writable), require, off
    cpus: float = 1.0  # CPU quota per run, in CPUs (SANDBOX_CPUS)

    def queue_bytes(self) -> int:
        """Bytes of request the waiting runs may hold together (SANDBOX_MAX_QUEUE_BYTES, unset
        (0): as many as 4 messages of the largest size, as the frame budget holds)."""
        return self.max_queue_bytes or 4 * self.max_message_bytes

    def frame_budget(self) -> tuple[int, int]:
        """(server-wide, per-tenant) bytes of WebSocket messages the server may hold unfinished or
        not yet taken, with SANDBOX_FRAME_BUFFER_BYTES / SANDBOX_TENANT_FRAME_BUFFER_BYTES unset (0)
        filled in: the server 4 messages of the largest size; a tenant half of that when there
        are tenants (SANDBOX_AUTH_TOKENS_FILE), so that no one tenant holds it all."""
        total = self.frame_buffer_bytes or 4 * self.max_message_bytes
        default_tenant = total // 2 if self.auth_tokens_file is not None else total
        return total, min(total, self.tenant_frame_buffer_bytes or default_tenant)


def _int(env: Mapping[str, str], name: str, default: int, minimum: int = 0) -> int:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise SettingsError(f"{name}: expected an integer, got {raw!r}") from None
    if value < minimum:
        raise SettingsError(f"{name}: must be at least {minimum}, got {value}")
    return value


def _bool(env: Mapping[str, str], name: str) -> bool:
    raw = env.get(name, "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise SettingsError(f"{name}: expected 0/1, true/false, yes/no or on/off, got {raw!r}")


def _uid_range(env: Mapping[str, str], name: str) -> tuple[int, int] | None:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    first, sep, last = raw.partition("-")
    try:
        lo, hi = int(first), int(last) if sep else int(first)
    except ValueError:
        raise SettingsError(f"{name}: expected FIRST-LAST (e.g. 1001-1064), got {raw!r}") from None
    if not 1 <= lo <= hi < 2**32 - 1:
        raise SettingsError(f"{name}: expected 1 <= FIRST <= LAST < 4294967295, got {raw!r}")
    if hi - lo >= MAX_UIDS:
        raise SettingsError(f"{name}: at most {MAX_UIDS} uids, got {hi - lo + 1}")
    return lo, hi


def default_uid_count(settings: Settings) -> int:
    """How many uids SANDBOX_UID_RANGE spans when unset: SANDBOX_UID (shared: GPU jails, a server
    that is not root) and one for every jail the server may hold at once (each profile's pool
    at its most, runs in flight, sessions, the canary), at least DEFAULT_UIDS."""
    jails = (
        len(settings.preload_profiles) * settings.pool_max
        + settings.max_concurrency
        + settings.max_sessions
        + 1
    )
    return min(MAX_UIDS, max(DEFAULT_UIDS, jails + 1))


def _with_uid_range(settings: Settings) -> Settings:
    """settings with SANDBOX_UID_RANGE filled in where unset: SANDBOX_UID onwards."""
    if settings.uid_range != Settings.uid_range:
        return settings
    last = settings.uid + default_uid_count(settings) - 1
    return dataclasses.replace(settings, uid_range=(settings.uid, last))


def _ports(env: Mapping[str, str], name: str) -> tuple[int, ...]:
    raw = env.get(name, "").strip()
    if not raw:
        return ()
    ports: list[int] = []
    for part in raw.split(","):
        part = part.strip()
        if not part.isdigit() or not 0 < int(part) < 65536:
            raise SettingsError(f"{name}: {part!r} is not a TCP port (1-65535)")
        ports.append(int(part))
    return tuple(sorted(set(ports)))


def _ipv4(env: Mapping[str, str], name: str, networks: bool) -> tuple[str, ...]:
    """Comma-separated IPv4 networks (or single addresses); IPv6 egress is not supported."""
    found: list[str] = []
    for part in (p.strip() for p in env.get(name, "").split(",")):
        if not part:
            continue
        try:
            net = ipaddress.ip_network(part, strict=True) if networks else ipaddress.ip_address(part)
        except ValueError:
            kind = "an IPv4 network like 10.1.2.0/24" if networks else "an IPv4 address"
            raise SettingsError(f"{name}: {part!r} is not {kind}") from None
        if net.version != 4:
            raise SettingsError(f"{name}: {part!r} is IPv6; only IPv4 egress is supported")
        found.append(str(net))
    return tuple(found)


ORIGIN_RE = re.compile(r"^(https?)://([a-z0-9.-]+|\[[0-9a-f:.]+\])(?::(\d{1,5}))?$")
DEFAULT_PORTS = {"http": 80, "https": 443}


def _origins(env: Mapping[str, str], name: str) -> tuple[str, ...]:
    """Comma-separated exact origins, each written the way a browser sends it in `Origin`
    (lower case, no path, no default port), so that what is listed can match at all."""
    found: list[str] = []
    for part in (p.strip() for p in env.get(name, "").split(",")):
        if not part:
            continue
        if part == "*" or "*" in part:
            raise SettingsError(
                f"{name}: {part!r}: wildcards are not allowed; list exact origins "
                "like https://app.example.com"
            )
        match = ORIGIN_RE.match(part)
        if match is None:
            raise SettingsError(
                f"{name}: {part!r} is not an origin like https://app.example.com[:port] "
                "(lower case, scheme http or https, no path or trailing slash)"
            )
        scheme, host, port = match.groups()
        if port is not None:
            number = int(port)
            canonical = f"{scheme}://{host}" + ("" if number == DEFAULT_PORTS[scheme] else f":{number}")
            if not 0 < number < 65536:
                raise SettingsError(f"{name}: {part!r}: port must be 1-65535")
            if canonical != part:  # a browser never sends a default port or a leading zero
                raise SettingsError(f"{name}: {part!r} would never match; browsers send it as {canonical}")
        if part not in found:
            found.append(part)
    return tuple(found)


HOST_RE = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*$")


def _hosts(env: Mapping[str, str], name: str) -> tuple[str, ...]:
    """Comma-separated host names as `Host` carries them, without a port (lower case)."""
    found: list[str] = []
    for part in (p.strip().lower().rstrip(".") for p in env.get(name, "").split(",")):
        if not part:
            continue
        if not HOST_RE.match(part):
            raise SettingsError(
                f"{name}: {part!r} is not a host name like appliance.example.com (no port, no wildcard)"
            )
        if part not in found:
            found.append(part)
    return tuple(found)


def _token(env: Mapping[str, str], name: str) -> str | None:
    token = env.get(name) or None
    if token is not None and (len(token) < 8 or any(c.isspace() for c in token)):
        raise SettingsError(f"{name}: must be at least 8 characters with no whitespace")
    return token


def _modules(env: Mapping[str, str], name: str, default: tuple[str, ...]) -> tuple[str, ...]:
    raw = env.get(name)
    if raw is None:
        return default
    names = tuple(p.strip() for p in raw.split(",") if p.strip())
    for mod in names:
        if not all(part.isidentifier() for part in mod.split(".")):
            raise SettingsError(f"{name}: {mod!r} is not a module name")
    return names


PROFILE_NAME_RE = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")


def default_profiles(preload: tuple[str, ...], gpu: bool) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """`bare` (nothing), `full` (SANDBOX_PRELOAD) and, in GPU mode, `science`: the full list
    without the model libraries, which only code using the tools needs."""
    profiles: list[tuple[str, tuple[str, ...]]] = [("bare", ())]
    science = tuple(m for m in preload if m not in GPU_PRELOAD)
    if gpu and science and science != preload:
        profiles.append(("science", science))
    if preload:
        profiles.append(("full", preload))
    return tuple(profiles)


def _profiles(
    env: Mapping[str, str], name: str, default: tuple[tuple[str, tuple[str, ...]], ...]
) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """`bare=;science=numpy,pandas,matplotlib`: profiles separated by `;`, modules by `,`."""
    raw = env.get(name, "").strip()
    if not raw:
        return default
    found: list[tuple[str, tuple[str, ...]]] = []
    for part in (p.strip() for p in raw.split(";")):
        if not part:
            continue
        label, sep, mods = part.partition("=")
        label = label.strip()
        if not sep or not PROFILE_NAME_RE.match(label):
            raise SettingsError(f"{name}: {part!r} is not NAME=MODULE,MODULE (NAME in a-z, 0-9, _ and -)")
        if any(label == f[0] for f in found):
            raise SettingsError(f"{name}: profile {label!r} is named twice")
        found.append((label, _modules({name: mods}, name, ())))
    if not found:
        raise SettingsError(f"{name}: names no profile")
    return tuple(found)


@overload
def _dir(env: Mapping[str, str], name: str, default: Path) -> Path: ...
@overload
def _dir(env: Mapping[str, str], name: str, default: None) -> Path | None: ...
def _dir(env: Mapping[str, str], name: str, default: Path | None) -> Path | None:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    path = Path(raw)
    if not path.is_absolute():
        raise SettingsError(f"{name}: must be an absolute path, got {raw!r}")
    return path


def _cpus(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise SettingsError(f"{name}: expected a number of CPUs, got {raw!r}") from None
    if not 0.01 <= value <= 1024:
        raise SettingsError(f"{name}: must be between 0.01 and 1024, got {raw!r}")
    return value


def _choice(env: Mapping[str, str], name: str, choices: tuple[str, ...]) -> str:
    raw = env.get(name, "").strip().lower()
    if not raw:
        return choices[0]
    if raw not in choices:
        raise SettingsError(f"{name}: expected one of {', '.join(choices)}, got {raw!r}")
    return raw


SIMULATE_RE = re.compile(r"^\s*(?:(\d+)\s*x\s*)?(\d+)\s*$")


def parse_simulated_devices(spec: str) -> tuple[int, ...]:
    """SANDBOX_GPU_SIMULATE: '2x16384' or '16384,8192' -> device totals in MiB; ValueError if malformed."""
    totals: list[int] = []
    for part in spec.split(","):
        match = SIMULATE_RE.match(part)
        if not match:
            raise ValueError(f"{part.strip()!r} is not COUNTxMIB or MIB")
        count = int(match.group(1) or 1)
        total = int(match.group(2))
        if count < 1 or total < 1:
            raise ValueError(f"{part.strip()!r}: count and MiB must be positive")
        totals += [total] * count
    if not totals:
        raise ValueError("no devices")
    return tuple(totals)


def _simulate(env: Mapping[str, str], name: str) -> tuple[int, ...]:
    raw = env.get(name, "").strip()
    if not raw:
        return ()
    try:
        return parse_simulated_devices(raw)
    except ValueError as exc:
        raise SettingsError(f"{name}: {exc} (expected e.g. '2x16384' or '16384,8192')") from None


def _libcuda(env: Mapping[str, str], name: str) -> str:
    raw = env.get(name, "").strip()
    if not raw:
        return ""
    if "/" in raw and not raw.startswith("/"):
        raise SettingsError(f"{name}: must be an absolute path or a library name, got {raw!r}")
    return raw


def from_env(env: Mapping[str, str] | None = None) -> Settings:
    """Build settings from the environment (or the given mapping); raise SettingsError if invalid.

    Every default is the field's default in `Settings` (D below), stated once; the few that
    depend on the host or on other settings are computed here and say so."""
    env = os.environ if env is None else env
    D = Settings()
    cpus = os.cpu_count() or 1
    tmp_root = _dir(env, "SANDBOX_TMP_ROOT", D.tmp_root)
    python_raw = env.get("SANDBOX_PYTHON", "").strip()
    python = Path(python_raw) if python_raw else Path(sys.executable)
    if not python.is_absolute():
        raise SettingsError(f"SANDBOX_PYTHON: must be an absolute path, got {python_raw!r}")
    token = _token(env, "SANDBOX_AUTH_TOKEN")
    pool_size = _int(env, "SANDBOX_POOL_SIZE", D.pool_size)
    gpu = _bool(env, "SANDBOX_GPU")
    preload = _modules(env, "SANDBOX_PRELOAD", DEFAULT_PRELOAD + GPU_PRELOAD if gpu else DEFAULT_PRELOAD)
    settings = Settings(
        max_exec_ms=_int(env, "SANDBOX_MAX_EXEC_MS", D.max_exec_ms, minimum=1),
        tmp_root=tmp_root,
        memory_mb=_int(env, "SANDBOX_MEMORY_MB", D.memory_mb, minimum=64),
        max_procs=_int(env, "SANDBOX_MAX_PROCS", D.max_procs, minimum=4),
        max_file_mb=_int(env, "SANDBOX_MAX_FILE_MB", D.max_file_mb, minimum=1),
        max_open_files=_int(env, "SANDBOX_MAX_OPEN_FILES", D.max_open_files, minimum=64),
        max_disk_mb=_int(env, "SANDBOX_MAX_DISK_MB", D.max_disk_mb, minimum=1),
        max_output_bytes=_int(env, "SANDBOX_MAX_OUTPUT_BYTES", D.max_output_bytes, minimum=1024),
        max_message_bytes=_int(env, "SANDBOX_MAX_MESSAGE_BYTES", D.max_message_bytes, minimum=1024),
        max_upload_bytes=_int(env, "SANDBOX_MAX_UPLOAD_BYTES", D.max_upload_bytes, minimum=0),
        max_file_out_bytes=_int(env, "SANDBOX_MAX_FILE_OUT_BYTES", D.max_file_out_bytes, minimum=0),
        max_outputs_bytes=_int(env, "SANDBOX_MAX_OUTPUTS_BYTES", D.max_outputs_bytes, minimum=0),
        max_output_files=_int(env, "SANDBOX_MAX_OUTPUT_FILES", D.max_output_files, minimum=1),
        max_stdin_bytes=_int(env, "SANDBOX_MAX_STDIN_BYTES", D.max_stdin_bytes, minimum=1024),
        client_stall_ms=_int(env, "SANDBOX_CLIENT_STALL_MS", D.client_stall_ms, minimum=100),
        reattach_s=_int(env, "SANDBOX_REATTACH_S", D.reattach_s),
        reattach_runs=_int(env, "SANDBOX_REATTACH_RUNS", D.reattach_runs),
        reattach_bytes=_int(env, "SANDBOX_REATTACH_BYTES", D.reattach_bytes),
        frame_buffer_bytes=_int(env, "SANDBOX_FRAME_BUFFER_BYTES", D.frame_buffer_bytes),
        tenant_frame_buffer_bytes=_int(env, "SANDBOX_TENANT_FRAME_BUFFER_BYTES", D.tenant_frame_buffer_bytes),
        frame_deadline_ms=_int(env, "SANDBOX_FRAME_DEADLINE_MS", D.frame_deadline_ms, minimum=100),
        max_concurrency=_int(env, "SANDBOX_MAX_CONCURRENCY", 2 * cpus, minimum=1),
        max_queue=_int(env, "SANDBOX_MAX_QUEUE", D.max_queue),
        max_queue_bytes=_int(env, "SANDBOX_MAX_QUEUE_BYTES", D.max_queue_bytes),
        uid=_int(env, "SANDBOX_UID", D.uid, minimum=1),
        uid_range=_uid_range(env, "SANDBOX_UID_RANGE") or D.uid_range,
        auth_token=token,
        allowed_origins=_origins(env, "SANDBOX_ALLOWED_ORIGINS"),
        allowed_hosts=_hosts(env, "SANDBOX_ALLOWED_HOSTS"),
        metrics_token=_token(env, "SANDBOX_METRICS_TOKEN"),
        max_upload_files=_int(env, "SANDBOX_MAX_UPLOAD_FILES", D.max_upload_files),
        open_ports=_ports(env, "SANDBOX_OPEN_PORTS"),
        egress_allow_nets=_ipv4(env, "SANDBOX_EGRESS_ALLOW_NETS", networks=True),
        egress_dns=_ipv4(env, "SANDBOX_EGRESS_DNS", networks=False),
        egress_subnet=(_ipv4(env, "SANDBOX_EGRESS_SUBNET", networks=True) or (D.egress_subnet,))[0],
        egress_allow_domains=parse_rules(
            env.get("SANDBOX_EGRESS_ALLOW_DOMAINS", "").split(","), "SANDBOX_EGRESS_ALLOW_DOMAINS"
        ),
        egress_proxy_port=_int(env, "SANDBOX_EGRESS_PROXY_PORT", D.egress_proxy_port, minimum=1),
        egress_idle_ms=_int(env, "SANDBOX_EGRESS_IDLE_MS", D.egress_idle_ms, minimum=100),
        egress_log=_dir(env, "SANDBOX_EGRESS_LOG", None),
        egress_secrets=_dir(env, "SANDBOX_EGRESS_SECRETS", None),
        egress_ca=_dir(env, "SANDBOX_EGRESS_CA", None),
        egress_upstream_ca=_dir(env, "SANDBOX_EGRESS_UPSTREAM_CA", None),
        egress_ask_ms=_int(env, "SANDBOX_EGRESS_ASK_MS", D.egress_ask_ms, minimum=100),
        auth_tokens_file=_dir(env, "SANDBOX_AUTH_TOKENS_FILE", None),
        gpu=gpu,
        preload=preload,
        preload_profiles=_profiles(env, "SANDBOX_PRELOAD_PROFILES", default_profiles(preload, gpu)),
        pool_size=pool_size,
        pool_max=_int(env, "SANDBOX_POOL_MAX", max(8, pool_size)),
        session_idle_s=_int(env, "SANDBOX_SESSION_IDLE_S", D.session_idle_s, minimum=1),
        max_sessions=_int(env, "SANDBOX_MAX_SESSIONS", D.max_sessions),
        outputs_dir=_dir(env, "SANDBOX_OUTPUTS_DIR", None),
        outputs_retention_s=_int(env, "SANDBOX_OUTPUTS_RETENTION_S", D.outputs_retention_s),
        snapshot_dir=_dir(env, "SANDBOX_SNAPSHOT_DIR", None),
        max_snapshot_mb=_int(env, "SANDBOX_MAX_SNAPSHOT_MB", D.max_snapshot_mb, minimum=1),
        max_snapshots=_int(env, "SANDBOX_MAX_SNAPSHOTS", D.max_snapshots, minimum=1),
        python=python,
        shutdown_grace_s=_int(env, "SANDBOX_SHUTDOWN_GRACE_MS", int(D.shutdown_grace_s * 1000)) / 1000,
        jail_threads=_int(env, "SANDBOX_JAIL_THREADS", D.jail_threads, minimum=1),
        firejail=env.get("SANDBOX_FIREJAIL", "").strip() or "firejail",
        models_dir=_dir(env, "SANDBOX_MODELS_DIR", None),
        wheelhouse=_dir(env, "SANDBOX_WHEELHOUSE", None),
        gpu_default_mb=_int(env, "SANDBOX_GPU_DEFAULT_MB", D.gpu_default_mb),
        gpu_margin_mb=_int(env, "SANDBOX_GPU_MARGIN_MB", D.gpu_margin_mb),
        gpu_backend=_choice(env, "SANDBOX_GPU_BACKEND", GPU_BACKENDS),
        gpu_simulate_mb=_simulate(env, "SANDBOX_GPU_SIMULATE") or D.gpu_simulate_mb,
        gpu_simulate_file=_dir(env, "SANDBOX_GPU_SIMULATE_FILE", None),
        gpu_queue_ms=_int(env, "SANDBOX_GPU_QUEUE_MS", D.gpu_queue_ms, minimum=1),
        gpu_poll_ms=_int(env, "SANDBOX_GPU_POLL_MS", D.gpu_poll_ms, minimum=10),
        gpu_reclaim_ms=_int(env, "SANDBOX_GPU_RECLAIM_MS", D.gpu_reclaim_ms),
        gpu_mps=_choice(env, "SANDBOX_GPU_MPS", GPU_MPS_MODES),
        gpu_mps_pipe_dir=_dir(env, "SANDBOX_GPU_MPS_PIPE_DIR", None) or MPS_PIPE_DIR,
        gpu_libcuda=_libcuda(env, "SANDBOX_GPU_LIBCUDA") or D.gpu_libcuda,
        gpu_simulate_mps=_choice(env, "SANDBOX_GPU_SIMULATE_MPS", GPU_SIMULATE_MPS),
        gpu_enforce=_choice(env, "SANDBOX_GPU_ENFORCE", GPU_ENFORCE),
        cgroups=_choice(env, "SANDBOX_CGROUPS", CGROUP_MODES),
        cpus=_cpus(env, "SANDBOX_CPUS", D.cpus),
    )
    settings = _with_uid_range(settings)
    if settings.pool_max < settings.pool_size:
        raise SettingsError("SANDBOX_POOL_MAX: must be at least SANDBOX_POOL_SIZE")
    if settings.auth_token is not None and settings.auth_tokens_file is not None:
        raise SettingsError("SANDBOX_AUTH_TOKENS_FILE: set either it or SANDBOX_AUTH_TOKEN, not both")
    if settings.metrics_token is not None and settings.metrics_token == settings.auth_token:
        raise SettingsError(
            "SANDBOX_METRICS_TOKEN: must differ from SANDBOX_AUTH_TOKEN (a scraper's token "
            "must not be able to run code)"
        )
    _check_egress(settings)
    if settings.gpu_simulate_mps != "off" and settings.gpu_backend != "simulated":
        raise SettingsError("SANDBOX_GPU_SIMULATE_MPS: needs SANDBOX_GPU_BACKEND=simulated")
    if settings.gpu_backend == "simulated" and not settings.gpu:
        raise SettingsError("SANDBOX_GPU_BACKEND: 'simulated' needs SANDBOX_GPU=1")
    return settings


def _check_egress(settings: Settings) -> None:
    """The egress settings together: what one needs of another."""
    if 53 in settings.open_ports and not settings.egress_dns:
        # Fail closed: DNS goes only to resolvers named on purpose, never to whatever answers.
        raise SettingsError("SANDBOX_OPEN_PORTS: 53 is listed but SANDBOX_EGRESS_DNS names no resolver")
    if settings.egress_dns and 53 not in settings.open_ports and not settings.egress_allow_domains:
        # With names allowed, it is the proxy's resolver; else only jails would use it.
        raise SettingsError(
            "SANDBOX_EGRESS_DNS: set, but SANDBOX_OPEN_PORTS does not list 53 "
            "and SANDBOX_EGRESS_ALLOW_DOMAINS is empty"
        )
    for name, value in (
        ("SANDBOX_EGRESS_SECRETS", settings.egress_secrets),
        ("SANDBOX_EGRESS_CA", settings.egress_ca),
        ("SANDBOX_EGRESS_UPSTREAM_CA", settings.egress_upstream_ca),
    ):
        if value is not None and not settings.egress_allow_domains:
            raise SettingsError(f"{name}: set, but SANDBOX_EGRESS_ALLOW_DOMAINS is empty (no egress proxy)")
    if settings.egress_proxy_port > 65535:
        raise SettingsError("SANDBOX_EGRESS_PROXY_PORT: must be a TCP port (1-65535)")
    if ipaddress.ip_network(settings.egress_subnet).prefixlen > 28:
        raise SettingsError("SANDBOX_EGRESS_SUBNET: too small; use a /28 or larger (one /30 per jail)")
