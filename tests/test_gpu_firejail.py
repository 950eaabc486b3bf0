"""GPU mode's jail, rendered without spawning: exactly the allocated device nodes, no RLIMIT_AS."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.core.errors import SettingsError
from appliance.sandbox.devices import GpuDevice, gpu_device, hidden_modules
from appliance.sandbox.firejail import render_argv
from appliance.sandbox.spec import JailLimits, JailSpec
from appliance.settings import from_env
from tests.support import REPO

HOST_DEV = (
    "null",
    "zero",
    "nvidia0",
    "nvidia1",
    "nvidia2",
    "nvidia3",
    "nvidiactl",
    "nvidia-uvm",
    "nvidia-uvm-tools",
    "nvidia-modeset",
    "nvidia-caps",
    "dri",
    "kfd",
    "tty",
)


def spec(gpu: GpuDevice | None) -> JailSpec:
    env = (("HOME", "/workspace"),) + ((("CUDA_VISIBLE_DEVICES", gpu.uuid),) if gpu else ())
    return JailSpec(
        workdir=Path("/tmp/run"),
        uid=1001,
        gid=1001,
        python=Path("/venv/bin/python"),
        driver=Path("/rt/driver.py"),
        limits=JailLimits(memory_mb=1024, max_procs=64, file_mb=100, open_files=1024),
        readable=(Path("/venv"),),
        root_entries=("usr", "root"),
        run_entries=(),
        env=env,
        devices=gpu.nodes if gpu else (),
        gpu=gpu is not None,
        gpu_hidden=gpu.hidden if gpu else (),
    )


def fake_dev(tmp_path: Path) -> Path:
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in HOST_DEV:
        (dev / name).touch()
    return dev


def test_gpu_jail_keeps_only_the_allocated_node_and_the_control_nodes(tmp_path: Path) -> None:
    gpu = gpu_device(index=2, uuid="GPU-abc", minor=2, dev_dir=fake_dev(tmp_path))
    argv = render_argv(spec(gpu), 5)
    hidden_dev = sorted(a.split("=", 1)[1] for a in argv if a.startswith("--blacklist=/dev/"))
    assert hidden_dev == [
        "/dev/dri",
        "/dev/kfd",
        "/dev/nvidia-caps",
        "/dev/nvidia-modeset",
        "/dev/nvidia-uvm-tools",
        "/dev/nvidia0",
        "/dev/nvidia1",
        "/dev/nvidia3",
    ]
    assert gpu.nodes == (Path("/dev/nvidiactl"), Path("/dev/nvidia-uvm"), Path("/dev/nvidia2"))
    visible = {n for n in HOST_DEV if f"--blacklist=/dev/{n}" not in argv and n.startswith("nvidia")}
    assert visible == {"nvidia2", "nvidiactl", "nvidia-uvm"}
    assert "--private-dev" in argv and "--no3d" not in argv  # --no3d would drop the allowed nodes too
    assert "--env=CUDA_VISIBLE_DEVICES=GPU-abc" in argv


def test_gpu_jail_has_no_address_space_limit_and_reads_only_nvidia_modules(tmp_path: Path) -> None:
    argv = render_argv(spec(gpu_device(0, "GPU-abc", 0, dev_dir=fake_dev(tmp_path))), 5)
    assert not any(a.startswith("--rlimit-as") for a in argv)
    assert "--noblacklist=/sys/module" in argv
    patterns = [a.split("=", 1)[1] for a in argv if a.startswith("--blacklist=/sys/module/")]
    assert patterns == [str(p) for p in hidden_modules()]
    assert len(argv) < 128, "firejail 0.9.72 refuses more than 127 arguments"


@pytest.mark.parametrize(
    ("name", "hidden"),
    [
        ("nvidia", False),
        ("nvidia_uvm", False),
        ("nvidia_drm", False),
        ("nvidia_modeset", False),
        ("kvm", True),
        ("nf_conntrack", True),
        ("nvproxy", True),
        ("nvme", True),
        ("n", True),
        ("nvidi", True),
        ("8250", True),
        ("Zz", True),
        ("nvidib", True),
    ],
)
def test_module_patterns_hide_every_name_but_nvidia_ones(name: str, hidden: bool) -> None:
    import fnmatch

    matched = any(fnmatch.fnmatchcase(f"/sys/module/{name}", str(p)) for p in hidden_modules())
    assert matched is hidden


def test_cpu_jail_hides_every_gpu_node_and_keeps_its_address_space_limit() -> None:
    argv = render_argv(spec(None), 5)
    assert "--no3d" in argv and "--noblacklist=/sys/module" not in argv
    assert f"--rlimit-as={1024 * 1024 * 1024}" in argv
    assert not any("CUDA_VISIBLE_DEVICES" in a for a in argv)


def test_gpu_settings_are_validated_with_the_variable_named() -> None:
    s = from_env(
        {
            "SANDBOX_GPU": "1",
            "SANDBOX_GPU_BACKEND": "simulated",
            "SANDBOX_GPU_SIMULATE": "2x8192",
            "SANDBOX_GPU_DEFAULT_MB": "512",
            "SANDBOX_GPU_MARGIN_MB": "64",
        }
    )
    assert (s.gpu, s.gpu_simulate_mb, s.gpu_default_mb, s.gpu_margin_mb) == (True, (8192, 8192), 512, 64)
    assert "llama_cpp" in s.preload and "appliance.tools" in s.preload
    assert "llama_cpp" not in from_env({}).preload
    for env, name in [
        ({"SANDBOX_GPU_BACKEND": "simulated"}, "SANDBOX_GPU_BACKEND"),
        ({"SANDBOX_GPU": "1", "SANDBOX_GPU_BACKEND": "cuda"}, "SANDBOX_GPU_BACKEND"),
        ({"SANDBOX_GPU": "1", "SANDBOX_GPU_SIMULATE": "lots"}, "SANDBOX_GPU_SIMULATE"),
        ({"SANDBOX_GPU": "1", "SANDBOX_GPU_DEFAULT_MB": "-1"}, "SANDBOX_GPU_DEFAULT_MB"),
        ({"SANDBOX_MODELS_DIR": "models"}, "SANDBOX_MODELS_DIR"),
    ]:
        with pytest.raises(SettingsError, match=name):
            from_env(env)


@pytest.mark.host  # starts a server
def test_gpu_mode_without_a_driver_stops_startup_with_a_clear_message(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SANDBOX_")}
    env.update({"SANDBOX_GPU": "1", "SANDBOX_PYTHON": sys.executable, "SANDBOX_TMP_ROOT": str(tmp_path)})
    proc = subprocess.run(
        [sys.executable, "-m", "appliance", "serve", "--port", "0"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "libnvidia-ml.so.1" in proc.stderr and "unset SANDBOX_GPU" in proc.stderr


def test_gpu_off_never_imports_nvml() -> None:
    code = (
        "import sys\nfrom appliance.settings import from_env\nfrom appliance.runtime.lifecycle import build_service\n"
        "import appliance.api.server\nApp = build_service(from_env({}))\n"
        "assert type(App.lifecycle.provisioner).__name__ == 'PlainProvisioner'\nassert 'pynvml' not in sys.modules, 'pynvml imported'\n"
        "loaded = {m for m in sys.modules if m.startswith('appliance.gpu')}\n"
        "assert not loaded, loaded\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_an_mps_jail_shares_only_the_daemons_pipe_directory_and_writes_to_it(tmp_path: Path) -> None:
    import dataclasses

    from appliance.sandbox.jail import gpu_env
    from appliance.settings import Settings

    gpu = gpu_device(0, "GPU-abc", 0, dev_dir=fake_dev(tmp_path), mps_pipe_dir=Path("/tmp/nvidia-mps"))
    argv = render_argv(dataclasses.replace(spec(gpu), gpu_shared=(Path("/tmp/nvidia-mps"),)), 5)
    assert "--whitelist=/tmp/nvidia-mps" in argv and "--read-only=/tmp/nvidia-mps" not in argv
    env = dict(gpu_env(Settings(gpu=True), gpu))
    assert env == {
        "CUDA_VISIBLE_DEVICES": "GPU-abc",
        "APPLIANCE_LIBCUDA": "libcuda.so.1",
        "CUDA_MPS_PIPE_DIRECTORY": "/tmp/nvidia-mps",
    }
    assert "CUDA_MPS_PIPE_DIRECTORY" not in dict(
        gpu_env(Settings(gpu=True), spec_gpu := gpu_device(0, "GPU-abc", 0, dev_dir=tmp_path / "dev"))
    ), spec_gpu
    cpu_argv = render_argv(spec(None), 5)
    assert not any("nvidia-mps" in a for a in cpu_argv)
