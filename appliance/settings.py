"""Settings, read once from `SANDBOX_*` environment variables into a frozen object.

Every field has a default and a unit in its name. An invalid value stops startup
with a message naming the variable.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from appliance.errors import SettingsError

DEFAULT_PRELOAD = ("numpy", "pandas", "matplotlib")


@dataclass(frozen=True)
class Settings:
    """Everything the appliance is configured with."""

    max_exec_ms: int = 15000
    tmp_root: Path = Path("/tmp")
    memory_mb: int = 1024
    max_procs: int = 64
    max_file_mb: int = 100
    max_open_files: int = 1024
    max_disk_mb: int = 1024
    max_output_bytes: int = 1048576
    max_message_bytes: int = 16777216
    max_upload_bytes: int = 8388608
    max_file_out_bytes: int = 8388608
    max_concurrency: int = 4
    max_queue: int = 100
    uid: int = 1001
    auth_token: str | None = field(default=None, repr=False)
    open_ports: tuple[int, ...] = ()
    gpu: bool = False
    preload: tuple[str, ...] = DEFAULT_PRELOAD
    pool_size: int = 2
    pool_max: int = 8
    session_idle_s: int = 600
    max_sessions: int = 32
    outputs_dir: Path | None = None
    python: Path = Path(sys.executable)
    shutdown_grace_s: float = 10.0
    jail_threads: int = 1
    firejail: str = "firejail"


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


def _modules(env: Mapping[str, str], name: str, default: tuple[str, ...]) -> tuple[str, ...]:
    raw = env.get(name)
    if raw is None:
        return default
    names = tuple(p.strip() for p in raw.split(",") if p.strip())
    for mod in names:
        if not all(part.isidentifier() for part in mod.split(".")):
            raise SettingsError(f"{name}: {mod!r} is not a module name")
    return names


def _dir(env: Mapping[str, str], name: str, default: Path | None) -> Path | None:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    path = Path(raw)
    if not path.is_absolute():
        raise SettingsError(f"{name}: must be an absolute path, got {raw!r}")
    return path


def from_env(env: Mapping[str, str] | None = None) -> Settings:
    """Build settings from the environment (or the given mapping); raise SettingsError if invalid."""
    env = os.environ if env is None else env
    cpus = os.cpu_count() or 1
    tmp_root = _dir(env, "SANDBOX_TMP_ROOT", Path("/tmp"))
    assert tmp_root is not None
    python_raw = env.get("SANDBOX_PYTHON", "").strip()
    python = Path(python_raw) if python_raw else Path(sys.executable)
    if not python.is_absolute():
        raise SettingsError(f"SANDBOX_PYTHON: must be an absolute path, got {python_raw!r}")
    token = env.get("SANDBOX_AUTH_TOKEN") or None
    if token is not None and (len(token) < 8 or any(c.isspace() for c in token)):
        raise SettingsError("SANDBOX_AUTH_TOKEN: must be at least 8 characters with no whitespace")
    pool_size = _int(env, "SANDBOX_POOL_SIZE", 2)
    settings = Settings(
        max_exec_ms=_int(env, "SANDBOX_MAX_EXEC_MS", 15000, minimum=1),
        tmp_root=tmp_root,
        memory_mb=_int(env, "SANDBOX_MEMORY_MB", 1024, minimum=64),
        max_procs=_int(env, "SANDBOX_MAX_PROCS", 64, minimum=4),
        max_file_mb=_int(env, "SANDBOX_MAX_FILE_MB", 100, minimum=1),
        max_open_files=_int(env, "SANDBOX_MAX_OPEN_FILES", 1024, minimum=64),
        max_disk_mb=_int(env, "SANDBOX_MAX_DISK_MB", 1024, minimum=1),
        max_output_bytes=_int(env, "SANDBOX_MAX_OUTPUT_BYTES", 1048576, minimum=1024),
        max_message_bytes=_int(env, "SANDBOX_MAX_MESSAGE_BYTES", 16777216, minimum=1024),
        max_upload_bytes=_int(env, "SANDBOX_MAX_UPLOAD_BYTES", 8388608, minimum=0),
        max_file_out_bytes=_int(env, "SANDBOX_MAX_FILE_OUT_BYTES", 8388608, minimum=0),
        max_concurrency=_int(env, "SANDBOX_MAX_CONCURRENCY", 2 * cpus, minimum=1),
        max_queue=_int(env, "SANDBOX_MAX_QUEUE", 100),
        uid=_int(env, "SANDBOX_UID", 1001, minimum=1),
        auth_token=token,
        open_ports=_ports(env, "SANDBOX_OPEN_PORTS"),
        gpu=_bool(env, "SANDBOX_GPU"),
        preload=_modules(env, "SANDBOX_PRELOAD", DEFAULT_PRELOAD),
        pool_size=pool_size,
        pool_max=_int(env, "SANDBOX_POOL_MAX", max(8, pool_size)),
        session_idle_s=_int(env, "SANDBOX_SESSION_IDLE_S", 600, minimum=1),
        max_sessions=_int(env, "SANDBOX_MAX_SESSIONS", 32),
        outputs_dir=_dir(env, "SANDBOX_OUTPUTS_DIR", None),
        python=python,
        shutdown_grace_s=_int(env, "SANDBOX_SHUTDOWN_GRACE_MS", 10000) / 1000,
        jail_threads=_int(env, "SANDBOX_JAIL_THREADS", 1, minimum=1),
        firejail=env.get("SANDBOX_FIREJAIL", "").strip() or "firejail",
    )
    if settings.pool_max < settings.pool_size:
        raise SettingsError("SANDBOX_POOL_MAX: must be at least SANDBOX_POOL_SIZE")
    if settings.open_ports:
        # Fail closed: the egress filter is not built yet, so no port can be opened safely.
        raise SettingsError(
            "SANDBOX_OPEN_PORTS: outbound ports are not supported by this build; "
            "unset it to run with no network"
        )
    if settings.gpu:
        raise SettingsError("SANDBOX_GPU: GPU mode is not supported by this build; unset it")
    return settings
