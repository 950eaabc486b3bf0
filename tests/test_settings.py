"""Settings come from SANDBOX_* variables with the documented defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

from appliance.core.errors import SettingsError
from appliance.settings import from_env


def test_defaults_are_the_documented_ones() -> None:
    s = from_env({})
    assert s.max_exec_ms == 15000 and s.tmp_root == Path("/run") and s.memory_mb == 1024
    assert s.max_procs == 64 and s.max_file_mb == 100 and s.max_output_bytes == 1048576
    assert s.max_message_bytes == 16777216 and s.uid == 1001 and s.auth_token is None
    assert s.open_ports == () and s.gpu is False and s.preload == ("numpy", "pandas", "matplotlib")
    assert s.pool_size == 2 and s.session_idle_s == 600
    assert s.max_queue == 256  # a 256-client trainer waits in line, never refused (docs/protocol.md)
    assert s.queue_bytes() == 4 * s.max_message_bytes  # the line's bytes: 4 of the largest messages
    assert from_env({"SANDBOX_MAX_QUEUE_BYTES": "4096"}).queue_bytes() == 4096


def test_concurrency_defaults_to_twice_the_cpus() -> None:
    import os

    assert from_env({}).max_concurrency == 2 * (os.cpu_count() or 1)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("SANDBOX_MAX_EXEC_MS", "x"),
        ("SANDBOX_MEMORY_MB", "-1"),
        ("SANDBOX_MAX_QUEUE", "1.5"),
        ("SANDBOX_GPU", "perhaps"),
        ("SANDBOX_PRELOAD", "numpy,os;rm"),
        ("SANDBOX_TMP_ROOT", "tmp"),
    ],
)
def test_an_invalid_value_names_its_variable(name: str, value: str) -> None:
    with pytest.raises(SettingsError, match=name):
        from_env({name: value})


def test_the_auth_token_is_never_in_the_repr() -> None:
    s = from_env({"SANDBOX_AUTH_TOKEN": "supersecret-token"})
    assert "supersecret" not in repr(s)


def test_mps_settings_default_to_joining_a_proven_daemon_and_reject_nonsense() -> None:
    s = from_env({})
    assert (s.gpu_mps, s.gpu_mps_pipe_dir, s.gpu_libcuda, s.gpu_simulate_mps) == (
        "auto",
        Path("/tmp/nvidia-mps"),
        "libcuda.so.1",
        "off",
    )
    assert from_env({"SANDBOX_GPU_LIBCUDA": "/opt/cuda/libcuda.so.1"}).gpu_libcuda == "/opt/cuda/libcuda.so.1"
    for env, name in (
        ({"SANDBOX_GPU_MPS": "sometimes"}, "SANDBOX_GPU_MPS"),
        ({"SANDBOX_GPU_MPS_PIPE_DIR": "nvidia-mps"}, "SANDBOX_GPU_MPS_PIPE_DIR"),
        ({"SANDBOX_GPU_LIBCUDA": "lib/libcuda.so.1"}, "SANDBOX_GPU_LIBCUDA"),
        ({"SANDBOX_GPU": "1", "SANDBOX_GPU_SIMULATE_MPS": "on"}, "SANDBOX_GPU_SIMULATE_MPS"),
    ):
        with pytest.raises(SettingsError, match=name):
            from_env(env)


def test_allowed_origins_are_exact_browser_origins_and_none_by_default() -> None:
    assert from_env({}).allowed_origins == ()
    s = from_env(
        {"SANDBOX_ALLOWED_ORIGINS": " https://app.example.com, http://localhost:3000,,http://[::1]:8080"}
    )
    assert s.allowed_origins == ("https://app.example.com", "http://localhost:3000", "http://[::1]:8080")
    # Each refused form names the variable: a wildcard, a path, upper case, another scheme,
    # and ports a browser never sends (so the entry could never match).
    for bad in (
        "*",
        "https://*.example.com",
        "https://app.example.com/",
        "HTTPS://app.example.com",
        "ftp://app.example.com",
        "app.example.com",
        "https://app.example.com:443",
        "http://app.example.com:80",
        "http://app.example.com:0080",
        "http://app.example.com:70000",
        "null",
    ):
        with pytest.raises(SettingsError, match="SANDBOX_ALLOWED_ORIGINS"):
            from_env({"SANDBOX_ALLOWED_ORIGINS": bad})


def test_the_metrics_token_is_checked_hidden_and_separate_from_the_auth_token() -> None:
    assert from_env({}).metrics_token is None
    s = from_env({"SANDBOX_METRICS_TOKEN": "scrape-secret-1"})
    assert s.metrics_token == "scrape-secret-1" and "scrape-secret" not in repr(s)
    for env in (
        {"SANDBOX_METRICS_TOKEN": "short"},
        {"SANDBOX_METRICS_TOKEN": "has white space"},
        {"SANDBOX_METRICS_TOKEN": "same-token-1", "SANDBOX_AUTH_TOKEN": "same-token-1"},
    ):
        with pytest.raises(SettingsError, match="SANDBOX_METRICS_TOKEN"):
            from_env(env)


def test_upload_files_are_bounded_by_count() -> None:
    assert from_env({}).max_upload_files == 1000
    assert from_env({"SANDBOX_MAX_UPLOAD_FILES": "0"}).max_upload_files == 0
    for bad in ("-1", "many"):
        with pytest.raises(SettingsError, match="SANDBOX_MAX_UPLOAD_FILES"):
            from_env({"SANDBOX_MAX_UPLOAD_FILES": bad})


def test_the_outputs_budget_defaults_to_64_mib_and_rejects_nonsense() -> None:
    assert from_env({}).max_outputs_bytes == 64 * 1024 * 1024
    assert from_env({"SANDBOX_MAX_OUTPUTS_BYTES": "1000"}).max_outputs_bytes == 1000
    for bad in ("-1", "64MiB", "1e6"):
        with pytest.raises(SettingsError, match="SANDBOX_MAX_OUTPUTS_BYTES"):
            from_env({"SANDBOX_MAX_OUTPUTS_BYTES": bad})


def test_the_gpu_reclaim_bound_defaults_to_ten_seconds_and_rejects_nonsense() -> None:
    assert from_env({}).gpu_reclaim_ms == 10000
    assert from_env({"SANDBOX_GPU_RECLAIM_MS": "0"}).gpu_reclaim_ms == 0
    for bad in ("-1", "5s", "1.5"):
        with pytest.raises(SettingsError, match="SANDBOX_GPU_RECLAIM_MS"):
            from_env({"SANDBOX_GPU_RECLAIM_MS": bad})


def test_cgroups_mode_and_cpus_default_and_reject_nonsense() -> None:
    s = from_env({})
    assert s.cgroups == "auto" and s.cpus == 1.0
    assert from_env({"SANDBOX_CGROUPS": "require", "SANDBOX_CPUS": "0.5"}).cpus == 0.5
    assert from_env({"SANDBOX_CGROUPS": "OFF"}).cgroups == "off"
    for name, bad in (
        ("SANDBOX_CGROUPS", "maybe"),
        ("SANDBOX_CPUS", "x"),
        ("SANDBOX_CPUS", "0"),
        ("SANDBOX_CPUS", "2000"),
    ):
        with pytest.raises(SettingsError, match=name):
            from_env({name: bad})


def test_the_uid_range_defaults_to_the_sandbox_uid_onwards_sized_for_every_jail() -> None:
    assert from_env({}).uid_range == (1001, 1064)  # 2 x 8 pooled + 4 runs + 32 sessions + canary < 64
    assert from_env({"SANDBOX_UID": "2000"}).uid_range == (2000, 2063)
    bigger = from_env({"SANDBOX_MAX_SESSIONS": "100"})
    assert bigger.uid_range == (1001, 1001 + 2 * 8 + bigger.max_concurrency + 100 + 1)
    assert from_env({"SANDBOX_UID_RANGE": "1001"}).uid_range == (1001, 1001)
    assert from_env({"SANDBOX_UID_RANGE": " 200000-200063 "}).uid_range == (200000, 200063)
    for bad in ("1064-1001", "0-10", "a-b", "1-2-3", "1-70000"):
        with pytest.raises(SettingsError, match="SANDBOX_UID_RANGE"):
            from_env({"SANDBOX_UID_RANGE": bad})
