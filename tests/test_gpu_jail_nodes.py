"""What a GPU jail really gets in /dev: real firejail, real jails, stand-in device nodes.

The server runs in a private mount namespace whose /dev is a copy of the host's plus stand-in
GPU nodes made with mknod (the host's /dev is not touched; other tests' jails never see them).
Nodes with no driver behind them cannot be opened, but firejail decides what a jail gets by
name and type, which is what is checked: tests/test_gpu_firejail.py checks the argv, this the
jail that argv makes.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from appliance_client.client import AsyncClient
from tests.support import REPO, scaled, start_server

pytestmark = pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare (util-linux)")

# Copies the host's /dev onto a tmpfs (directories bound, not copied), adds the stand-in nodes,
# then runs the rest of its arguments there.
FAKE_DEV = r"""
set -eu
old="$FAKE_DEV_OLD"
mkdir -p "$old"
mount --rbind /dev "$old"
mount -t tmpfs -o mode=755 fakedev /dev
for entry in "$old"/* "$old"/.[!.]*; do
  [ -e "$entry" ] || [ -L "$entry" ] || continue
  name=$(basename "$entry")
  if [ -d "$entry" ] && [ ! -L "$entry" ]; then
    mkdir "/dev/$name" && mount --rbind "$entry" "/dev/$name"
  else
    cp -a "$entry" "/dev/$name"
  fi
done
for i in 0 1 2 3 4 5 6 7 8 9 10 11; do mknod -m 666 "/dev/nvidia$i" c 195 "$i"; done
mknod -m 666 /dev/nvidiactl c 195 255
mknod -m 666 /dev/nvidia-modeset c 195 254
mknod -m 666 /dev/nvidia-uvm c 236 0
mknod -m 666 /dev/nvidia-uvm-tools c 236 1
mkdir -m 755 /dev/nvidia-caps
mknod -m 400 /dev/nvidia-caps/nvidia-cap1 c 235 1
exec "$@"
"""

LIST = """
import json, os, stat
seen = {}
for name in sorted(os.listdir('/dev')):
    if name.startswith('nvidia') or name in ('dri', 'kfd'):
        st = os.lstat('/dev/' + name)
        seen[name] = 'char' if stat.S_ISCHR(st.st_mode) else 'dir' if stat.S_ISDIR(st.st_mode) else 'other'
print(json.dumps({'grant': os.environ.get('CUDA_VISIBLE_DEVICES'), 'dev': seen}))
"""


def wrap(tmp: Path) -> list[str]:
    script = tmp / "fake-dev.sh"
    script.write_text(FAKE_DEV)
    return [
        "env",
        f"FAKE_DEV_OLD={tmp / 'old-dev'}",
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "sh",
        str(script),
    ]


def test_firejail_passes_nvidia0_to_9_only_so_minor_10_gets_no_node(tmp_path: Path) -> None:
    # The fact behind the device_minor startup check (appliance/gpu/hostcheck.py).
    proc = subprocess.run(
        [*wrap(tmp_path), "firejail", "--quiet", "--noprofile", "--private-dev", "ls", "/dev"],
        capture_output=True,
        text=True,
        timeout=scaled(60),
    )
    assert proc.returncode == 0, proc.stderr
    names = set(proc.stdout.split())
    assert {f"nvidia{i}" for i in range(10)} | {"nvidiactl", "nvidia-uvm"} <= names, names
    assert "nvidia10" not in names and "nvidia11" not in names, names
    assert "nvidia-uvm-tools" not in names and "nvidia-caps" not in names, names


async def test_a_gpu_jail_gets_exactly_its_own_node_and_the_control_nodes(tmp_path: Path) -> None:
    srv = start_server(
        tmp_path / "srv",
        wrap=wrap(tmp_path),
        settings={
            "SANDBOX_GPU": "1",
            "SANDBOX_GPU_BACKEND": "simulated",
            "SANDBOX_GPU_SIMULATE": "2x4096",
            "SANDBOX_GPU_MARGIN_MB": "128",
            "SANDBOX_GPU_DEFAULT_MB": "0",  # a run that names no budget gets a CPU jail
        },
    )
    try:
        async with AsyncClient(srv.url) as c:
            # Two at once, each too large to share a device with the other: one on each GPU.
            runs = await asyncio.gather(
                *(c.execute(LIST + "import time; time.sleep(1)", gpu={"memory_mb": 3000}) for _ in range(2))
            )
            assert [ex.status for ex in runs] == ["ok", "ok"], [ex.frames for ex in runs]
            seen = {out["grant"]: out["dev"] for out in (json.loads(ex.stdout) for ex in runs)}
            cpu = await c.execute(LIST)
    finally:
        srv.stop()
    assert sorted(seen) == ["GPU-SIM-0", "GPU-SIM-1"], seen
    for uuid, dev in seen.items():
        minor = int(uuid.rsplit("-", 1)[1])
        chars = {name for name, kind in dev.items() if kind == "char"}
        assert chars == {"nvidiactl", "nvidia-uvm", f"nvidia{minor}"}, (uuid, dev)
        # Every other GPU node the host has is absent or blacklisted (an empty root-only file).
        assert all(kind != "char" for name, kind in dev.items() if name not in chars), dev
    assert cpu.status == "ok" and not any(k == "char" for k in json.loads(cpu.stdout)["dev"].values()), (
        cpu.stdout
    )


# The stand-in libcuda, as CUDA would: a device is usable only through its own node
# (tests/stub_libcuda.c, `reachable`). CUDA_VISIBLE_DEVICES is the jail's to change.
REACH = """
import ctypes, json, os
counts = {}
for name in (os.environ['CUDA_VISIBLE_DEVICES'], 'OTHER', None):
    if name is None:
        os.environ.pop('CUDA_VISIBLE_DEVICES', None)
    else:
        os.environ['CUDA_VISIBLE_DEVICES'] = name
    cu = ctypes.CDLL(os.environ['APPLIANCE_LIBCUDA'])
    n = ctypes.c_int()
    assert cu.cuInit(0) == 0 and cu.cuDeviceGetCount(ctypes.byref(n)) == 0
    counts[str(name)] = n.value
print(json.dumps(counts))
"""


@pytest.fixture
def libcuda() -> Iterator[Path]:
    folder = Path(tempfile.mkdtemp(prefix="appliance-nodes-", dir="/tmp"))
    os.chmod(folder, 0o755)  # the sandbox uid loads it
    lib = folder / "libcuda.so.1"
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-O1", "-o", str(lib), str(REPO / "tests" / "stub_libcuda.c")], check=True
    )
    yield lib
    shutil.rmtree(folder, ignore_errors=True)


async def test_a_jail_that_names_another_gpu_cannot_reach_it(tmp_path: Path, libcuda: Path) -> None:
    srv = start_server(
        tmp_path / "srv",
        wrap=wrap(tmp_path),
        settings={
            "SANDBOX_GPU": "1",
            "SANDBOX_GPU_BACKEND": "simulated",
            "SANDBOX_GPU_SIMULATE": "2x4096",
            "SANDBOX_GPU_MARGIN_MB": "128",
            "SANDBOX_GPU_LIBCUDA": str(libcuda),
        },
    )
    try:
        async with AsyncClient(srv.url) as c:
            ex = await c.execute(REACH.replace("OTHER", "GPU-SIM-1"), gpu={"memory_mb": 1000})
    finally:
        srv.stop()
    assert ex.status == "ok" and ex.frames[0]["gpu"]["uuid"] == "GPU-SIM-0", ex.frames
    # Its own GPU; not the other one, though it named it; unset, still only its own.
    assert json.loads(ex.stdout) == {"GPU-SIM-0": 1, "GPU-SIM-1": 0, "None": 1}, ex.stdout
