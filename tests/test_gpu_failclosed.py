"""GPU mode fails closed where the host cannot give the watchdog what it needs.

A real server, real jails. The NVML backend runs for real (pynvml and appliance.gpu.nvml) against
the stand-in libnvidia-ml (tests/stub_libnvidia_ml.c) found through LD_LIBRARY_PATH; elsewhere the
simulated backend. Under SANDBOX_GPU_ENFORCE=strict (the default) a gap stops startup, or stops
the run and refuses GPU runs from then on, naming the cause and the fix; under best-effort the
server runs on and says so in /readyz and /metrics.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from appliance.gpu import hostcheck
from appliance.gpu.backend import Device, ProcessUsage
from appliance.runtime.local import ServerStartError
from appliance_client.client import AsyncClient
from tests import nvml_standin
from tests.nvml_standin import Host
from tests.support import Server, scaled, start_server, until_async
from tests.test_gpu_server import host_pid_of, simulate

MARGIN_MB = 128
GPU = {"SANDBOX_GPU": "1", "SANDBOX_GPU_MARGIN_MB": str(MARGIN_MB), "SANDBOX_GPU_POLL_MS": "100"}


@pytest.fixture(scope="module")
def library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("nvml-lib")
    return nvml_standin.build(folder)


def nvml_env(library: Path, host: Host) -> dict[str, str]:
    # The server is no setuid program: the dynamic loader honours LD_LIBRARY_PATH, and pynvml's
    # CDLL("libnvidia-ml.so.1") finds the stand-in there as it would the driver's library.
    return {"LD_LIBRARY_PATH": str(library.parent), "STUB_NVML_STATE": str(host.state)}


def simulated(control: Path) -> dict[str, str]:
    return {
        "SANDBOX_GPU_BACKEND": "simulated",
        "SANDBOX_GPU_SIMULATE": "4096",
        "SANDBOX_GPU_SIMULATE_FILE": str(control),
    }


def readyz(srv: Server) -> tuple[int, dict[str, Any]]:
    status, body = srv.get("/readyz")
    return status, json.loads(body)


def metric_lines(srv: Server, name: str) -> list[str]:
    _, body = srv.get("/metrics")
    return [line for line in body.splitlines() if line.startswith(name + "{")]


# -- the checks themselves (pure) ----------------------------------------------------------------
FINE = hostcheck.HostFacts(children=True, smaps_rollup=True, cgroup_memory=False, nvidia_uvm=True)


def dev(index: int, minor: int) -> Device:
    return Device(index, f"GPU-{index}", "H200", 143771, 0, minor)


@pytest.mark.parametrize(
    ("facts", "reason", "words"),
    [
        (FINE.__class__(False, True, False, True), "proc_children", ("CONFIG_PROC_CHILDREN",)),
        (FINE.__class__(True, False, False, True), "smaps_rollup", ("smaps_rollup", "SANDBOX_CGROUPS")),
        (FINE.__class__(True, True, False, False), "nvidia_uvm", ("nvidia-modprobe -u -c=0",)),
        (
            FINE.__class__(True, True, False, True, devices=(dev(0, 0), dev(1, 10))),
            "device_minor",
            ("/dev/nvidia10", "firejail 0.9.72", "0-9"),
        ),
        (
            FINE.__class__(True, True, False, True, unknown_usage=(ProcessUsage(42, "GPU-0", None),)),
            "per_process_memory",
            ("NVML_VALUE_NOT_AVAILABLE", "processes 42"),
        ),
    ],
)
def test_each_gap_names_its_cause_and_fix(
    facts: hostcheck.HostFacts, reason: str, words: tuple[str, ...]
) -> None:
    found = hostcheck.gaps(facts)
    assert [g.reason for g in found] == [reason]
    text = hostcheck.startup_error(found)
    assert all(w in text for w in words), text
    assert "fix:" in text and "SANDBOX_GPU_ENFORCE=best-effort" in text
    if reason == "device_minor":
        assert found[0].devices == ("GPU-1",)


def test_nothing_is_missing_on_a_complete_host_and_cgroups_stand_in_for_smaps_rollup() -> None:
    assert hostcheck.gaps(FINE) == []
    assert hostcheck.gaps(FINE.__class__(True, False, True, None)) == []  # memory read from the cgroup
    # This machine has what the watchdog reads in /proc (the server tests below rely on it).
    facts = hostcheck.read_facts([], [], cgroup_memory=False, real_devices=False)
    assert facts.children and facts.smaps_rollup and facts.nvidia_uvm is None


# -- NVML, for real, through the stand-in library ------------------------------------------------
@pytest.fixture
def host(tmp_path: Path) -> Host:
    host = Host(tmp_path / "nvml.state")
    host.add_device(4096, minor=0)
    return host


def test_a_host_without_nvidia_uvm_refuses_to_start_naming_the_fix(
    tmp_path: Path, library: Path, host: Host
) -> None:
    if os.path.exists("/dev/nvidia-uvm"):
        pytest.skip("this host has a /dev/nvidia-uvm: the refusal cannot be shown here")
    with pytest.raises(ServerStartError) as err:
        start_server(tmp_path / "srv", settings={**GPU, **nvml_env(library, host)})
    log = str(err.value)
    assert "/dev/nvidia-uvm is missing" in log and "nvidia-modprobe -u -c=0" in log, log
    assert "SANDBOX_GPU_ENFORCE=best-effort" in log


@pytest.fixture
def best_effort(tmp_path: Path, library: Path, host: Host) -> Iterator[tuple[Server, Host]]:
    srv = start_server(
        tmp_path / "srv", settings={**GPU, "SANDBOX_GPU_ENFORCE": "best-effort", **nvml_env(library, host)}
    )
    yield srv, host
    srv.stop()


async def test_best_effort_runs_degraded_says_so_and_the_nvml_watchdog_still_stops_an_overrun(
    best_effort: tuple[Server, Host],
) -> None:
    srv, host = best_effort
    status, body = readyz(srv)
    gpu = body["gpu"]
    assert isinstance(gpu, dict)
    assert status == 200 and gpu["backend"] == "nvml" and gpu["enforce"] == "best-effort"
    assert ("nvidia_uvm" in gpu["degraded"]) is not os.path.exists("/dev/nvidia-uvm"), gpu["degraded"]
    assert [d["uuid"] for d in gpu["devices"]] == [host.devices[0][2]]
    assert 'appliance_gpu_degraded{reason="nvidia_uvm"} 1.0' in metric_lines(srv, "appliance_gpu_degraded")
    # The watchdog reads NVML through pynvml: the jailed process (in firejail's PID namespace) is
    # listed by its host PID, matched to its run and stopped past its budget + margin.
    code = "import subprocess, time\nsubprocess.Popen(['sleep', '77.5'])\ntime.sleep(30)"
    async with AsyncClient(srv.url) as c:
        hog = asyncio.create_task(c.execute(code, gpu={"memory_mb": 1000}))
        pid = await asyncio.to_thread(host_pid_of, srv, "sleep 77.5")
        assert nvml_standin.ns_pid(pid)[1] != pid, "the jail's process has a PID of its own in its namespace"
        host.use(pid, 1000 + MARGIN_MB + 1)
        ex = await asyncio.wait_for(hog, scaled(20))
    assert ex.status == "gpu_memory_limit" and "1129 MiB" in (ex.message or ""), ex.frames


async def test_best_effort_leaves_a_run_nvml_cannot_measure_running_and_says_so_loudly(
    best_effort: tuple[Server, Host],
) -> None:
    srv, host = best_effort
    # The run lives until the watchdog has read it (its line on stdin), not for a fixed time.
    code = "import subprocess\nsubprocess.Popen(['sleep', '77.6'])\nprint('up', flush=True)\ninput()"

    def degraded() -> dict[str, Any]:
        gpu = readyz(srv)[1]["gpu"]
        assert isinstance(gpu, dict)
        found: dict[str, Any] = gpu["degraded"]
        return found

    async with AsyncClient(srv.url) as c:
        run = asyncio.create_task(c.execute(code, id="unmeasured", gpu={"memory_mb": 1000}))
        pid = await asyncio.to_thread(host_pid_of, srv, "sleep 77.6")
        host.use(pid, None)  # usedGpuMemory unavailable: the memory is in the device's total only
        await until_async(lambda: "per_process_memory" in degraded(), 20, "the watchdog read the run")
        await c.stdin("unmeasured", "\n")
        ex = await asyncio.wait_for(run, scaled(20))
    assert ex.status == "ok", ex.frames
    assert "NVML_VALUE_NOT_AVAILABLE" in degraded()["per_process_memory"], degraded()
    assert 'appliance_gpu_degraded{reason="per_process_memory"} 1.0' in metric_lines(
        srv, "appliance_gpu_degraded"
    )


# -- the simulated backend: per-process memory unavailable, device minors -------------------------
async def test_strict_stops_a_run_nvml_cannot_measure_and_refuses_gpu_runs_after(tmp_path: Path) -> None:
    control = tmp_path / "sim.json"
    srv = start_server(tmp_path / "srv", settings={**GPU, **simulated(control)})
    try:
        code = "import subprocess, time\nsubprocess.Popen(['sleep', '77.7'])\ntime.sleep(30)"
        async with AsyncClient(srv.url) as c:
            run = asyncio.create_task(c.execute(code, gpu={"memory_mb": 1000}))
            pid = await asyncio.to_thread(host_pid_of, srv, "sleep 77.7")
            simulate(control, usage_unavailable=True, processes=[{"pid": pid, "gpu": 0, "used_mb": 10}])
            ex = await asyncio.wait_for(run, scaled(20))
            assert ex.status == "internal", ex.frames
            assert "no per-process GPU memory" in (ex.message or "") and "strict" in (ex.message or "")
            status, body = readyz(srv)
            assert status == 503 and any("GPU runs are refused" in p for p in body["problems"]), body
            nxt = await c.execute("print('ran')", gpu={"memory_mb": 100})
        assert nxt.status == "rejected" and "SANDBOX_GPU_ENFORCE=best-effort" in (nxt.message or ""), (
            nxt.frames
        )
        assert nxt.stdout == ""
    finally:
        simulate(control)
        srv.stop()


def test_strict_refuses_a_host_whose_nvml_lists_processes_without_their_memory(tmp_path: Path) -> None:
    control = tmp_path / "sim.json"
    simulate(control, usage_unavailable=True, processes=[{"pid": 999_999, "gpu": 0, "used_mb": 2000}])
    with pytest.raises(ServerStartError) as err:
        start_server(tmp_path / "srv", settings={**GPU, **simulated(control)})
    assert "NVML reports no per-process GPU memory (processes 999999" in str(err.value), str(err.value)


def test_a_gpu_firejail_cannot_give_a_node_stops_startup_or_is_left_out_under_best_effort(
    tmp_path: Path,
) -> None:
    sim = {
        **GPU,
        "SANDBOX_GPU_BACKEND": "simulated",
        "SANDBOX_GPU_SIMULATE": "11x1024",
        "SANDBOX_POOL_SIZE": "0",
    }
    with pytest.raises(ServerStartError) as err:
        start_server(tmp_path / "strict", settings=sim)
    assert "GPU 10 (GPU-SIM-10) is /dev/nvidia10" in str(err.value), str(err.value)
    srv = start_server(tmp_path / "best", settings={**sim, "SANDBOX_GPU_ENFORCE": "best-effort"})
    try:
        status, body = readyz(srv)
        gpu = body["gpu"]
        assert isinstance(gpu, dict)
        assert status == 200 and sorted(d["uuid"] for d in gpu["devices"]) == sorted(
            f"GPU-SIM-{i}" for i in range(10)
        )
        assert "/dev/nvidia10" in gpu["degraded"]["device_minor"]
    finally:
        srv.stop()
