"""`make run` keeps the caller's SANDBOX_* settings through sudo (whose env_reset drops them).

The Makefile's real recipe runs, with a stand-in sudo that resets the environment as
sudo's env_reset does and a stand-in `appliance` that records what it was started with.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.support import REPO

# Needs root, firejail or a real server: never in the fast tier (tests/tiers.py).
pytestmark = pytest.mark.host

ODD = "a b 'c' \"d\" $HOME `x` ;e"


def fakes(tmp_path: Path) -> tuple[Path, Path, Path]:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    dump = tmp_path / "started.json"
    appliance = venv / "bin" / "appliance"
    appliance.write_text(
        "#!/usr/bin/python3\nimport json, os, sys\n"
        f"json.dump({{'argv': sys.argv[1:], 'env': dict(os.environ)}}, open({str(dump)!r}, 'w'))\n"
    )
    sudo = tmp_path / "sudo"
    sudo.write_text(
        "#!/bin/sh\n# env_reset: the command gets PATH and nothing else of the caller\n"
        'exec /usr/bin/env -i PATH=/usr/bin:/bin "$@"\n'
    )
    for f in (appliance, sudo):
        f.chmod(0o755)
    return venv, sudo, dump


@pytest.mark.parametrize("where", ["environment", "command line"])
def test_make_run_passes_every_sandbox_setting_through_sudo(tmp_path: Path, where: str) -> None:
    venv, sudo, dump = fakes(tmp_path)
    settings = {"SANDBOX_GPU": "1", "SANDBOX_MEMORY_MB": "2048", "SANDBOX_MODELS_DIR": ODD}
    env = {k: v for k, v in os.environ.items() if not k.startswith("SANDBOX_")}
    env["NOT_A_SETTING"] = "x"
    args = [
        "make",
        "-s",
        "-o",
        "setup",
        "-o",
        "system",
        "-o",
        "venv",
        "run",
        f"VENV={venv}",
        f"SUDO={sudo}",
        "HOST=10.0.0.9",
        "PORT=9123",
    ]
    if where == "environment":
        env.update(settings)
    else:  # make itself expands `$` in command-line values, as for any make variable
        settings["SANDBOX_MODELS_DIR"] = ODD.replace("$", "")
        args += [f"{k}={v}" for k, v in settings.items()]
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    started = json.loads(dump.read_text())
    assert started["argv"] == ["serve", "--host", "10.0.0.9", "--port", "9123"]
    got = {k: v for k, v in started["env"].items() if k.startswith("SANDBOX_")}
    assert got == {**settings, "SANDBOX_PYTHON": f"{venv}/bin/python"}
    assert "NOT_A_SETTING" not in started["env"]


def test_as_root_without_sudo_the_settings_are_passed_directly(tmp_path: Path) -> None:
    venv, _, dump = fakes(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SANDBOX_")}
    env.update({"SANDBOX_GPU": "1", "SANDBOX_PYTHON": "/opt/py/bin/python", "SUDO": ""})
    proc = subprocess.run(
        [str(REPO / "scripts" / "serve.sh"), str(venv), "--port", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    got = {k: v for k, v in json.loads(dump.read_text())["env"].items() if k.startswith("SANDBOX_")}
    assert got == {"SANDBOX_GPU": "1", "SANDBOX_PYTHON": "/opt/py/bin/python"}


def cuda_fakes(tmp_path: Path, offload_after_build: bool = True) -> tuple[Path, Path, Path]:
    """A python that records pip calls and answers the offload probe, and an nvcc."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls"
    state = tmp_path / "built"
    py = bin_dir / "python"
    py.write_text(
        "#!/bin/sh\n"
        f'echo "CMAKE_ARGS=$CMAKE_ARGS $*" >> {log}\n'
        f'case "$*" in *"-m pip install"*) {"touch " + str(state) if offload_after_build else ":"};;\n'
        "  *llama_supports_gpu_offload*) [ -e " + str(state) + " ] && exit 0 || exit 1;;\n"
        "  *importlib.metadata*) echo 0.3.36;;\nesac\n"
    )
    nvcc = bin_dir / "nvcc"
    nvcc.write_text("#!/bin/sh\nexit 0\n")
    for f in (py, nvcc):
        f.chmod(0o755)
    return py, bin_dir, log


@pytest.mark.parametrize(
    ("opt_in", "with_nvcc", "rc", "built", "says"),
    [
        ("0", True, 0, False, "make cuda-build"),  # never a long build unasked
        ("1", False, 1, False, "needs nvcc"),
        ("1", True, 0, True, "offloads to the GPU"),
    ],
)
def test_the_cuda_build_is_opt_in_and_passes_cmake_args(  # noqa: PLR0913 (pytest fixtures and parametrize values)
    tmp_path: Path, opt_in: str, with_nvcc: bool, rc: int, built: bool, says: str
) -> None:
    py, bin_dir, log = cuda_fakes(tmp_path)
    if not with_nvcc:
        (bin_dir / "nvcc").unlink()
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "APPLIANCE_CUDA_BUILD": opt_in, "CUDA_ARCHS": "90"}
    proc = subprocess.run(
        [str(REPO / "scripts" / "cuda-build.sh"), str(py)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == rc and says in proc.stderr, proc.stderr
    calls = log.read_text() if log.exists() else ""
    pip = [c for c in calls.splitlines() if "-m pip install" in c]
    if built:
        assert pip == [
            "CMAKE_ARGS=-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -m pip install -q --force-reinstall "
            "--no-cache-dir --no-deps --no-binary llama-cpp-python llama-cpp-python==0.3.36"
        ]
    else:
        assert pip == []


def test_a_cuda_build_that_still_cannot_offload_fails(tmp_path: Path) -> None:
    py, bin_dir, _ = cuda_fakes(tmp_path, offload_after_build=False)
    proc = subprocess.run(
        [str(REPO / "scripts" / "cuda-build.sh"), str(py)],
        capture_output=True,
        text=True,
        env={"PATH": f"{bin_dir}:/usr/bin:/bin", "APPLIANCE_CUDA_BUILD": "1"},
        timeout=60,
    )
    assert proc.returncode == 1 and "still false" in proc.stderr


def installed_venv(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(venv, fake bin dir, command log) of `cuda_fakes`, its .installed stamp newer than
    pyproject.toml: `make venv` has nothing left to install there."""
    py, bin_dir, log = cuda_fakes(tmp_path)
    venv = py.parent.parent
    stamp = venv / ".installed"
    stamp.touch()
    newer = (REPO / "pyproject.toml").stat().st_mtime + 3600
    os.utime(stamp, (newer, newer))
    return venv, bin_dir, log


@pytest.mark.parametrize(
    ("target", "opt_in"),
    [("cuda-build", None), ("venv", "1")],  # `make cuda-build`, and `APPLIANCE_CUDA_BUILD=1 make venv`
)
def test_the_cuda_build_rebuilds_a_venv_that_is_already_installed(
    tmp_path: Path, target: str, opt_in: str | None
) -> None:
    # The hint and docs/gpu.md send users here with a venv already installed: its .installed
    # stamp is newer than pyproject.toml, so nothing that hangs off the stamp runs again.
    venv, bin_dir, log = installed_venv(tmp_path)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "CUDA_ARCHS": "90", "HOME": str(tmp_path)}
    if opt_in is not None:
        env["APPLIANCE_CUDA_BUILD"] = opt_in
    proc = subprocess.run(
        ["make", "-s", target, f"VENV={venv}"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and "offloads to the GPU" in proc.stderr, proc.stdout + proc.stderr
    pip = [c for c in log.read_text().splitlines() if "-m pip install" in c]
    assert pip == [
        "CMAKE_ARGS=-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -m pip install -q --force-reinstall "
        "--no-cache-dir --no-deps --no-binary llama-cpp-python llama-cpp-python==0.3.36"
    ]


def test_make_venv_on_an_installed_venv_starts_no_cuda_build_unasked(tmp_path: Path) -> None:
    venv, bin_dir, log = installed_venv(tmp_path)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path)}
    proc = subprocess.run(
        ["make", "-s", "venv", f"VENV={venv}"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert not log.exists() or "-m pip install" not in log.read_text()
