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

ODD = "a b 'c' \"d\" $HOME `x` ;e"


def fakes(tmp_path: Path) -> tuple[Path, Path, Path]:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    dump = tmp_path / "started.json"
    appliance = venv / "bin" / "appliance"
    appliance.write_text("#!/usr/bin/python3\nimport json, os, sys\n"
                         f"json.dump({{'argv': sys.argv[1:], 'env': dict(os.environ)}}, open({str(dump)!r}, 'w'))\n")
    sudo = tmp_path / "sudo"
    sudo.write_text('#!/bin/sh\n# env_reset: the command gets PATH and nothing else of the caller\n'
                    'exec /usr/bin/env -i PATH=/usr/bin:/bin "$@"\n')
    for f in (appliance, sudo):
        f.chmod(0o755)
    return venv, sudo, dump


@pytest.mark.parametrize("where", ["environment", "command line"])
def test_make_run_passes_every_sandbox_setting_through_sudo(tmp_path: Path, where: str) -> None:
    venv, sudo, dump = fakes(tmp_path)
    settings = {"SANDBOX_GPU": "1", "SANDBOX_MEMORY_MB": "2048", "SANDBOX_MODELS_DIR": ODD}
    env = {k: v for k, v in os.environ.items() if not k.startswith("SANDBOX_")}
    env["NOT_A_SETTING"] = "x"
    args = ["make", "-s", "-o", "setup", "-o", "system", "-o", "venv", "run", f"VENV={venv}", f"SUDO={sudo}",
            "PORT=9123"]
    if where == "environment":
        env.update(settings)
    else:  # make itself expands `$` in command-line values, as for any make variable
        settings["SANDBOX_MODELS_DIR"] = ODD.replace("$", "")
        args += [f"{k}={v}" for k, v in settings.items()]
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    started = json.loads(dump.read_text())
    assert started["argv"] == ["serve", "--host", "0.0.0.0", "--port", "9123"]
    got = {k: v for k, v in started["env"].items() if k.startswith("SANDBOX_")}
    assert got == {**settings, "SANDBOX_PYTHON": f"{venv}/bin/python"}
    assert "NOT_A_SETTING" not in started["env"]


def test_as_root_without_sudo_the_settings_are_passed_directly(tmp_path: Path) -> None:
    venv, _, dump = fakes(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SANDBOX_")}
    env.update({"SANDBOX_GPU": "1", "SANDBOX_PYTHON": "/opt/py/bin/python", "SUDO": ""})
    proc = subprocess.run([str(REPO / "scripts" / "serve.sh"), str(venv), "--port", "1"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    got = {k: v for k, v in json.loads(dump.read_text())["env"].items() if k.startswith("SANDBOX_")}
    assert got == {"SANDBOX_GPU": "1", "SANDBOX_PYTHON": "/opt/py/bin/python"}
