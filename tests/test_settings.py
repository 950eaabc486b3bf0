"""Settings come from SANDBOX_* variables with the documented defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

from appliance.errors import SettingsError
from appliance.settings import from_env


def test_defaults_are_the_documented_ones() -> None:
    s = from_env({})
    assert s.max_exec_ms == 15000 and s.tmp_root == Path("/tmp") and s.memory_mb == 1024
    assert s.max_procs == 64 and s.max_file_mb == 100 and s.max_output_bytes == 1048576
    assert s.max_message_bytes == 16777216 and s.uid == 1001 and s.auth_token is None
    assert s.open_ports == () and s.gpu is False and s.preload == ("numpy", "pandas", "matplotlib")
    assert s.pool_size == 2 and s.session_idle_s == 600


def test_concurrency_defaults_to_twice_the_cpus() -> None:
    import os

    assert from_env({}).max_concurrency == 2 * (os.cpu_count() or 1)


@pytest.mark.parametrize(
    ("name", "value"),
    [("SANDBOX_MAX_EXEC_MS", "x"), ("SANDBOX_MEMORY_MB", "-1"), ("SANDBOX_MAX_QUEUE", "1.5"),
     ("SANDBOX_GPU", "perhaps"), ("SANDBOX_PRELOAD", "numpy,os;rm"), ("SANDBOX_TMP_ROOT", "tmp")],
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
        "auto", Path("/tmp/nvidia-mps"), "libcuda.so.1", "off")
    assert from_env({"SANDBOX_GPU_LIBCUDA": "/opt/cuda/libcuda.so.1"}).gpu_libcuda == "/opt/cuda/libcuda.so.1"
    for env, name in (({"SANDBOX_GPU_MPS": "sometimes"}, "SANDBOX_GPU_MPS"),
                      ({"SANDBOX_GPU_MPS_PIPE_DIR": "nvidia-mps"}, "SANDBOX_GPU_MPS_PIPE_DIR"),
                      ({"SANDBOX_GPU_LIBCUDA": "lib/libcuda.so.1"}, "SANDBOX_GPU_LIBCUDA"),
                      ({"SANDBOX_GPU": "1", "SANDBOX_GPU_SIMULATE_MPS": "on"}, "SANDBOX_GPU_SIMULATE_MPS")):
        with pytest.raises(SettingsError, match=name):
            from_env(env)
