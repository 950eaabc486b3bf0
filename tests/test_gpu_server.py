"""GPU mode end to end: a real server, real jails, the simulated GPU backend driven from outside.

The simulated backend reads per-PID GPU usage and faults from SANDBOX_GPU_SIMULATE_FILE,
so a test can make a run's real host process "use" GPU memory (see docs/gpu.md).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from appliance.gpu.watchdog import descendants
from appliance_client.client import AsyncClient
from tests.support import Server, cmdline, scaled, start_server, until_async

MARGIN_MB = 128


@pytest.fixture(scope="module")
def gpu_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    tmp = tmp_path_factory.mktemp("gpu")
    control = tmp / "sim.json"
    srv = start_server(
        tmp / "srv",
        SANDBOX_GPU="1",
        SANDBOX_GPU_BACKEND="simulated",
        SANDBOX_GPU_SIMULATE="2x4096",
        SANDBOX_GPU_SIMULATE_FILE=str(control),
        SANDBOX_GPU_MARGIN_MB=str(MARGIN_MB),
        SANDBOX_GPU_DEFAULT_MB="512",
        SANDBOX_GPU_POLL_MS="100",
        SANDBOX_GPU_QUEUE_MS="60000",
        SANDBOX_PRELOAD="",
    )
    yield srv, control
    srv.stop()


def simulate(control: Path, **state: object) -> None:
    tmp = control.with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    tmp.replace(control)


def setter(event: asyncio.Event) -> Callable[[str], None]:
    """An on_stdout callback that sets event (a run says it is up)."""
    return lambda _: event.set()


def host_pid_of(server: Server, marker: str, timeout: float = 10) -> int:
    """The host PID of the server's descendant whose command line contains marker."""
    deadline = time.monotonic() + scaled(timeout)
    while time.monotonic() < deadline:
        for pid in descendants(server.proc.pid):
            if marker in cmdline(pid):
                return pid
        time.sleep(0.05)
    raise AssertionError(f"no process with {marker!r} under the server")


async def test_a_gpu_run_starts_with_its_device_and_sees_only_that_device(
    gpu_server: tuple[Server, Path],
) -> None:
    srv, _ = gpu_server
    code = (
        "import os, resource\nprint(os.environ['CUDA_VISIBLE_DEVICES'])\n"
        "print(resource.getrlimit(resource.RLIMIT_AS)[0] == resource.RLIM_INFINITY)\n"
        "print(sorted(n for n in os.listdir('/dev') if n.startswith('nvidia') or n == 'dri'))\n"
        "try:\n    os.listdir('/sys/module/kvm'); print('modules readable')\n"
        "except OSError:\n    print('modules hidden')\n"
        "print(open(os.path.expanduser('~/.appliance-gpu.json')).read())"
    )
    async with AsyncClient(srv.url) as c:
        ex = await c.execute(code, gpu={"memory_mb": 1000})
    start = ex.frames[0]
    assert ex.status == "ok", ex.frames
    assert start["gpu"]["memory_mb"] == 1000 and start["gpu"]["uuid"] in ("GPU-SIM-0", "GPU-SIM-1")
    lines = ex.stdout.splitlines()
    assert lines[0] == start["gpu"]["uuid"] and lines[1] == "True" and lines[2] == "[]"
    assert lines[3] == "modules hidden"
    assert json.loads(lines[4])["memory_mb"] == 1000


async def test_a_run_without_a_budget_gets_the_default(gpu_server: tuple[Server, Path]) -> None:
    async with AsyncClient(gpu_server[0].url) as c:
        ex = await c.execute("print(1)")
    assert ex.status == "ok" and ex.frames[0]["gpu"]["memory_mb"] == 512


async def test_bad_budgets_are_rejected_and_nothing_runs(gpu_server: tuple[Server, Path]) -> None:
    async with AsyncClient(gpu_server[0].url) as c:
        for budget in (-1, 0, 1.5, "512", True, None):
            # Wrong types on purpose: the server's validation is what is tested.
            ex = await c.execute("print('ran')", gpu={"memory_mb": budget})  # type: ignore[dict-item]
            assert ex.status == "rejected" and ex.stdout == "" and "memory_mb" in (ex.message or "")
        # + margin exceeds every device: rejected, not put in line (queued, it would end `busy`
        # after SANDBOX_GPU_QUEUE_MS).
        ex = await c.execute("print('ran')", gpu={"memory_mb": 4096})
        assert ex.status == "rejected" and "can never fit" in (ex.message or "")


async def test_runs_that_do_not_fit_wait_in_line_and_report_their_queue_time(
    gpu_server: tuple[Server, Path],
) -> None:
    big = 4096 - MARGIN_MB
    srv = gpu_server[0]
    async with AsyncClient(srv.url) as c:
        # Two holders fill both devices; each waits for a line, sent once the third is in line.
        up = [asyncio.Event(), asyncio.Event()]
        holders = [
            asyncio.create_task(
                c.execute(
                    "print('up', flush=True)\ninput()",
                    id=f"holder{i}",
                    gpu={"memory_mb": big},
                    on_stdout=setter(up[i]),
                )
            )
            for i in range(2)
        ]
        await asyncio.gather(*(e.wait() for e in up))
        waiter = asyncio.create_task(c.execute("print('late')", gpu={"memory_mb": 1000}))
        await until_async(lambda: json.loads(srv.get("/readyz")[1])["gpu"]["queued"] == 1, 20, "in line")
        assert not waiter.done()
        for i in range(2):
            await c.stdin(f"holder{i}", "\n")
        done = await asyncio.gather(*holders)
        late = await asyncio.wait_for(waiter, scaled(20))
    assert [h.status for h in done] == ["ok", "ok"]
    assert late.status == "ok" and late.frames[0]["queued_ms"] > 0


async def test_the_watchdog_stops_an_over_budget_run_while_its_neighbour_keeps_running(
    gpu_server: tuple[Server, Path],
) -> None:
    srv, control = gpu_server
    hog_code = (
        "import subprocess, time\nsubprocess.Popen(['sleep', '77.5'])\nprint('up', flush=True)\n"
        "time.sleep(30)"
    )
    async with AsyncClient(srv.url) as c:
        hog = asyncio.create_task(c.execute(hog_code, gpu={"memory_mb": 1000}))
        neighbour = asyncio.create_task(
            c.execute("import time; time.sleep(4); print('neighbour done')", gpu={"memory_mb": 1000})
        )
        pid = await asyncio.to_thread(host_pid_of, srv, "sleep 77.5")
        simulate(control, processes=[{"pid": pid, "gpu": 0, "used_mb": 1000 + MARGIN_MB + 1}])
        try:
            hog_ex = await asyncio.wait_for(hog, scaled(15))
            assert hog_ex.status == "gpu_memory_limit" and "1129 MiB" in (hog_ex.message or "")
            neighbour_ex = await asyncio.wait_for(neighbour, scaled(15))
        finally:
            simulate(control)
    assert neighbour_ex.status == "ok" and neighbour_ex.stdout == "neighbour done\n"
    assert not Path(f"/proc/{pid}").exists(), "the over-budget run's processes are gone"


@pytest.mark.parametrize("kind", ["nvml", "plain"])
async def test_an_nvml_fault_mid_run_stops_the_run_cleanly_and_readiness_reflects_it(
    gpu_server: tuple[Server, Path], kind: str
) -> None:
    # "plain": the backend raises a bare Exception (as pynvml's NVMLLibraryMismatchError is).
    srv, control = gpu_server
    async with AsyncClient(srv.url) as c:
        up = asyncio.Event()
        run = asyncio.create_task(
            c.execute("import time; print('up', flush=True); time.sleep(30)", on_stdout=lambda _: up.set())
        )
        await up.wait()
        simulate(control, fault="GPU has fallen off the bus", fault_kind=kind)
        try:
            ex = await asyncio.wait_for(run, scaled(15))
            status, body = srv.get("/readyz")
            assert status == 503 and "fallen off the bus" in body
            assert json.loads(body)["gpu"]["watchdog"]["available"] is False
            refused = await c.execute("print(1)")
            assert refused.status == "rejected" and "paused" in (refused.message or "")
        finally:
            simulate(control)
        assert ex.status == "internal" and "could not be measured" in (ex.message or "")
        assert "fallen off the bus" in (ex.message or "")
        deadline = time.monotonic() + scaled(10)
        while srv.get("/readyz")[0] != 200 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert srv.get("/readyz")[0] == 200
        after = await c.execute("print('again')")
    assert after.status == "ok" and after.stdout == "again\n"


async def test_readyz_reports_each_enforcement_layer(gpu_server: tuple[Server, Path]) -> None:
    status, body = gpu_server[0].get("/readyz")
    gpu = json.loads(body)["gpu"]
    assert status == 200 and gpu["backend"] == "simulated"
    assert set(gpu) >= {"watchdog", "mps", "shaping", "devices"}
    assert gpu["watchdog"]["available"] is True and gpu["mps"]["available"] is False
    assert [d["total_mb"] for d in gpu["devices"]] == [4096, 4096]


async def test_a_gpu_request_is_rejected_when_gpu_mode_is_off(server: Server) -> None:
    async with AsyncClient(server.url) as c:
        ex = await c.execute("print('ran')", gpu={"memory_mb": 100})
    assert ex.status == "rejected" and "SANDBOX_GPU" in (ex.message or "") and ex.stdout == ""


def test_a_mig_enabled_gpu_stops_startup_with_the_fix(tmp_path: Path) -> None:
    control = tmp_path / "sim.json"
    simulate(control, mig=[1])
    with pytest.raises(RuntimeError) as err:
        start_server(
            tmp_path / "srv",
            SANDBOX_GPU="1",
            SANDBOX_GPU_BACKEND="simulated",
            SANDBOX_GPU_SIMULATE="2x4096",
            SANDBOX_GPU_SIMULATE_FILE=str(control),
            SANDBOX_PRELOAD="",
        )
    text = str(err.value)
    assert "server exited 2" in text and "MIG mode is enabled on GPU 1 (GPU-SIM-1)" in text
    assert "nvidia-smi -i <index> -mig 0" in text and "not supported yet" in text


@pytest.mark.parametrize(
    ("mode", "why"),
    [
        ("PROHIBITED", "no process may create a context on it"),
        ("EXCLUSIVE_PROCESS", "one process at a time may hold a context on it"),  # no MPS daemon
        ("EXCLUSIVE_THREAD", "does not run on"),
    ],
)
def test_a_gpu_in_a_compute_mode_no_run_can_use_stops_startup_with_the_fix(
    tmp_path: Path, mode: str, why: str
) -> None:
    # Issue 14: in these modes every jailed run (or every second one) fails with CUDA error 46.
    control = tmp_path / "sim.json"
    simulate(control, compute_mode={"1": mode})
    with pytest.raises(RuntimeError) as err:
        start_server(
            tmp_path / "srv",
            SANDBOX_GPU="1",
            SANDBOX_GPU_BACKEND="simulated",
            SANDBOX_GPU_SIMULATE="2x4096",
            SANDBOX_GPU_SIMULATE_FILE=str(control),
            SANDBOX_PRELOAD="",
        )
    text = str(err.value)
    assert "server exited 2" in text and f"GPU 1 (GPU-SIM-1) is in {mode} compute mode" in text, text
    assert why in text and "nvidia-smi -i 1 -c DEFAULT" in text and "GPU 0" not in text


async def test_a_queued_run_never_starts_while_the_previous_run_s_memory_still_shows_in_nvml(
    tmp_path: Path,
) -> None:
    # NVML frees late: the simulator keeps listing the finished run's process until told otherwise.
    control = tmp_path / "sim.json"
    srv = start_server(
        tmp_path / "srv",
        SANDBOX_GPU="1",
        SANDBOX_GPU_BACKEND="simulated",
        SANDBOX_GPU_SIMULATE="4096",
        SANDBOX_GPU_SIMULATE_FILE=str(control),
        SANDBOX_GPU_MARGIN_MB=str(MARGIN_MB),
        SANDBOX_GPU_POLL_MS="100",
        SANDBOX_GPU_RECLAIM_MS="600000",
        SANDBOX_GPU_QUEUE_MS="600000",
        SANDBOX_PRELOAD="",
    )
    try:
        async with AsyncClient(srv.url) as c:
            first = asyncio.create_task(
                c.execute(
                    "import subprocess\nsubprocess.Popen(['sleep', '77.7'])\ninput()",
                    id="first",
                    gpu={"memory_mb": 3000},
                )
            )
            pid = await asyncio.to_thread(host_pid_of, srv, "sleep 77.7")

            def gpu() -> dict[str, Any]:
                found: dict[str, Any] = json.loads(srv.get("/readyz")[1])["gpu"]
                return found

            polls = gpu()["watchdog"]["polls"]
            simulate(control, processes=[{"pid": pid, "gpu": 0, "used_mb": 2900}])
            # Two polls later, one has read the file whole: the memory is the first run's.
            await until_async(lambda: gpu()["watchdog"]["polls"] >= polls + 2, 20, "two polls")
            second = asyncio.create_task(c.execute("print('second')", gpu={"memory_mb": 3000}))
            await until_async(lambda: gpu()["queued"] == 1, 20, "the second run in line")
            await c.stdin("first", "\n")
            assert (await asyncio.wait_for(first, scaled(20))).status == "ok"
            # The first run's grant is released but held back while NVML lists its process; the
            # queue waits on it (SANDBOX_GPU_RECLAIM_MS is ten minutes here).
            await until_async(lambda: gpu()["devices"][0]["reclaiming"] == 1, 20, "the grant reclaiming")
            polls = gpu()["watchdog"]["polls"]
            await until_async(lambda: gpu()["watchdog"]["polls"] >= polls + 2, 20, "two readings more")
            now = gpu()
            assert not second.done(), "the second run started while NVML still listed the first run's memory"
            assert now["queued"] == 1 and now["devices"][0]["reclaiming"] == 1, now
            simulate(control)  # NVML now shows the memory freed
            ex = await asyncio.wait_for(second, scaled(20))
        assert ex.status == "ok" and ex.stdout == "second\n"
        assert json.loads(srv.get("/readyz")[1])["gpu"]["devices"][0]["reclaiming"] == 0
        metrics = srv.get("/metrics")[1]
        assert "appliance_gpu_reclaim_wait_seconds_count 1.0" in metrics
        assert "appliance_gpu_reclaim_timeouts 0.0" in metrics
    finally:
        srv.stop()
