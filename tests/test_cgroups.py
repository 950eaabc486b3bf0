"""Per-run cgroups: rendering of limits (pure) and, where v1 is writable here, real groups."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest

from appliance.errors import SettingsError
from appliance.jail import cgroups
from appliance.jail.cgroups import Limits, Write, render_v1, render_v2
from appliance.settings import from_env

L = Limits(memory_mb=1024, cpus=1.5, max_procs=64)


def test_v2_rendering_turns_swap_off_and_quotas_cpu() -> None:
    w = {x.file: x.value for x in render_v2(L)}
    assert w["memory.max"] == str(1024 << 20) and w["memory.swap.max"] == "0"
    assert w["cpu.max"] == "150000 100000" and w["pids.max"] == "64" and w["memory.oom.group"] == "1"


def test_v1_memsw_order_follows_direction() -> None:
    files = [x.file for x in render_v1(L, memsw=True, lowering=True)]
    assert files.index("memory.limit_in_bytes") < files.index("memory.memsw.limit_in_bytes")
    files = [x.file for x in render_v1(L, memsw=True, lowering=False)]
    assert files.index("memory.memsw.limit_in_bytes") < files.index("memory.limit_in_bytes")
    assert Write("cpu", "cpu.cfs_quota_us", "150000") in render_v1(L, memsw=False, lowering=True)


def test_settings_validate_cgroups_and_cpus() -> None:
    s = from_env({})
    assert s.cgroups == "auto" and s.cpus == 1.0
    assert from_env({"SANDBOX_CGROUPS": "require", "SANDBOX_CPUS": "0.5"}).cpus == 0.5
    for env in ({"SANDBOX_CGROUPS": "maybe"}, {"SANDBOX_CPUS": "x"}, {"SANDBOX_CPUS": "0"}):
        with pytest.raises(SettingsError):
            from_env(env)


def _tree() -> cgroups.Hierarchy:
    tree, missing = cgroups.detect()
    if tree is None:
        pytest.skip("no writable cgroup hierarchy: " + "; ".join(missing))
    return tree


def test_real_group_oom_kills_a_process_over_the_memory_limit() -> None:
    tree = _tree()
    g = tree.group(f"t-{uuid.uuid4().hex[:8]}", Limits(memory_mb=64, cpus=1.0, max_procs=16))
    try:
        g.open_join()
        p = subprocess.run([sys.executable, "-c", "b = bytearray(200 << 20)"],
                           preexec_fn=g.preexec, capture_output=True)
        g.close_join()
        assert p.returncode == -9
        u = g.usage()
        assert u.oom_kills >= 1 or tree.version == 1  # older v1 kernels lack oom_kill in oom_control
        assert u.max_rss_mb <= 64 and u.cpu_ms >= 0
    finally:
        g.remove()
    assert not any(p.exists() for p in g.paths.values())


def test_real_group_pids_limit_stops_a_fork_bomb_and_purge_removes_leftovers() -> None:
    tree = _tree()
    g = tree.group(f"t-{uuid.uuid4().hex[:8]}", Limits(memory_mb=256, cpus=1.0, max_procs=8))
    g.open_join()
    code = ("import os, time\ntry:\n  for _ in range(50):\n    if os.fork() == 0:\n      time.sleep(30)\n"
            "      os._exit(0)\nexcept OSError:\n  print('refused', flush=True)")
    p = subprocess.Popen([sys.executable, "-c", code], preexec_fn=g.preexec, stdout=subprocess.PIPE)
    g.close_join()
    out = p.stdout.readline() if p.stdout else b""
    assert b"refused" in out and len(g.pids()) <= 8
    assert tree.purge() >= 1  # as after kill -9 of the server: leftovers go, processes included
    assert not any(x.exists() for x in g.paths.values())
    p.wait()
    assert os.path.exists(str(tree.dirs[next(iter(tree.dirs))]))
