"""Layer (b), per-run CUDA MPS memory limits: a real server, real jails, real client processes.

There is no GPU here, so the MPS daemon is the simulated one (appliance/gpu/mps_simulated.py)
and libcuda is a stand-in compiled from tests/stub_libcuda.c; both sit where the real ones
would: the jail's driver loads the library through SANDBOX_GPU_LIBCUDA and connects through
the pipe directory whitelisted into the jail, and the daemon learns each client's host PID
from SO_PEERCRED, across the jail's PID namespace.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from appliance.core.errors import GpuLimitUnavailable
from appliance.gpu.ledger import Grant
from appliance.gpu.mps import (
    MpsError,
    cmd_set_default_limit,
    cmd_set_limit,
    daemon_pid_namespace_problem,
    parse_limit_mb,
    parse_pids,
)
from appliance.gpu.mps_limits import DeviceMps, MpsLimiter, jail_blockers, judge_probe
from appliance.gpu.mps_simulated import SimulatedMps
from appliance.gpu.simulated import SimulatedBackend
from appliance.inside import channel as jail_end
from appliance.sandbox import channel
from appliance_client.client import AsyncClient, Client, Execution
from tests.support import REPO, Server, start_server, until
from tests.test_gpu_server import simulate as simulate_file

MARGIN_MB = 128
# A host where nothing stands in a jailed MPS client's way: EXCLUSIVE_PROCESS compute mode and
# a daemon whose shared memory sits in the pipe directory jails see. No real daemon is the
# latter today (its memory is in /dev/shm): these tests hold the limiter's own mechanics.
REACHABLE = {"compute_mode": {"0": "EXCLUSIVE_PROCESS"}, "mps_shm": "pipe_dir"}


def simulate(control: Path, **state: object) -> None:
    """The simulated host's state, on the REACHABLE host unless the state says otherwise."""
    simulate_file(control, **{**REACHABLE, **state})


ALLOC = textwrap.dedent("""\
    import ctypes, os
    cu = ctypes.CDLL(os.environ["APPLIANCE_LIBCUDA"])
    cu.cuInit(0)
    def alloc(mb):
        ctx, ptr = ctypes.c_void_p(), ctypes.c_uint64()
        cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0)
        return cu.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(mb << 20))
    """)


@pytest.fixture(scope="module")
def cuda_dir() -> Iterator[Path]:
    """The stand-in libcuda, built where the sandbox uid can read it."""
    if shutil.which("gcc") is None:
        pytest.fail("gcc is needed to build tests/stub_libcuda.c (apt-get install gcc)")
    root = Path(tempfile.mkdtemp(prefix="appliance-cuda-", dir="/tmp"))
    os.chmod(root, 0o755)
    subprocess.run(
        [
            "gcc",
            "-shared",
            "-fPIC",
            "-O1",
            "-o",
            str(root / "libcuda.so.1"),
            str(REPO / "tests" / "stub_libcuda.c"),
        ],
        check=True,
    )
    (root / "mps").mkdir()
    yield root
    shutil.rmtree(root, ignore_errors=True)


def mps_env(cuda_dir: Path, pipe: str = "mps", **extra: str) -> dict[str, str]:
    if "SANDBOX_GPU_SIMULATE_FILE" not in extra:  # the REACHABLE host unless the test gives its own
        simulate(cuda_dir / f"{pipe}.json")
        extra["SANDBOX_GPU_SIMULATE_FILE"] = str(cuda_dir / f"{pipe}.json")
    return {
        "SANDBOX_GPU": "1",
        "SANDBOX_GPU_BACKEND": "simulated",
        "SANDBOX_GPU_SIMULATE": "4096",
        "SANDBOX_GPU_SIMULATE_MPS": "on",
        "SANDBOX_GPU_MPS_PIPE_DIR": str(cuda_dir / pipe),
        "SANDBOX_GPU_LIBCUDA": str(cuda_dir / "libcuda.so.1"),
        "SANDBOX_GPU_MARGIN_MB": str(MARGIN_MB),
        "SANDBOX_GPU_DEFAULT_MB": "512",
        "SANDBOX_GPU_POLL_MS": "100",
        "SANDBOX_PRELOAD": "",
        **extra,
    }


@pytest.fixture(scope="module")
def mps_server(tmp_path_factory: pytest.TempPathFactory, cuda_dir: Path) -> Iterator[tuple[Server, Path]]:
    tmp = tmp_path_factory.mktemp("mps")
    control = tmp / "sim.json"
    simulate(control)
    srv = start_server(tmp / "srv", settings=mps_env(cuda_dir, SANDBOX_GPU_SIMULATE_FILE=str(control)))
    yield srv, control
    srv.stop()


def results(ex: Execution) -> list[Any]:
    assert ex.status == "ok", ex.frames
    return [json.loads(line) for line in ex.stdout.splitlines()]


# -- end to end -------------------------------------------------------------------------------


def test_readiness_reports_mps_limits_proven_by_the_startup_probe(mps_server: tuple[Server, Path]) -> None:
    status, body = mps_server[0].get("/readyz")
    mps = json.loads(body)["gpu"]["mps"]
    assert status == 200, body
    assert mps["enforcing"] is True and mps["daemon"] == "simulated" and mps["resting_mb"] == MARGIN_MB
    assert mps["devices"]["GPU-SIM-0"]["enforcing"] is True
    assert mps["devices"]["GPU-SIM-0"]["note"].startswith("proved")
    assert mps["note"] == "proved on every device by the startup probe"


async def test_a_run_can_allocate_its_budget_and_is_refused_past_it(mps_server: tuple[Server, Path]) -> None:
    code = ALLOC + "print(alloc(900))\nprint(alloc(64))\nprint(alloc(64))"
    async with AsyncClient(mps_server[0].url) as c:
        ex = await c.execute(code, gpu={"memory_mb": 1000})
    assert results(ex) == [0, 0, 2], "900 + 64 fit in 1000 MiB; the next 64 is CUDA_ERROR_OUT_OF_MEMORY"


async def test_concurrent_runs_on_one_gpu_each_get_their_own_limit(mps_server: tuple[Server, Path]) -> None:
    # Both clients are alive at once on the same device (and the same MPS server).
    code = ALLOC + "import time\nprint(alloc({}))\ntime.sleep(1.5)\nprint(alloc(101))"
    async with AsyncClient(mps_server[0].url) as c:
        big, small = await asyncio.gather(
            c.execute(code.format(1900), gpu={"memory_mb": 2000}),
            c.execute(code.format(250), gpu={"memory_mb": 300}),
        )
    assert big.frames[0]["gpu"]["uuid"] == small.frames[0]["gpu"]["uuid"] == "GPU-SIM-0"
    assert results(big) == [0, 2] and results(small) == [0, 2]


async def test_a_child_process_gets_only_the_resting_limit(mps_server: tuple[Server, Path]) -> None:
    child = ALLOC + f"print(alloc({MARGIN_MB + 1}))" + "\nprint(alloc(64))"
    code = (
        ALLOC + "import subprocess, sys\nprint(alloc(800))\n"
        f"subprocess.run([sys.executable, '-c', {child!r}], check=True)"
    )
    async with AsyncClient(mps_server[0].url) as c:
        ex = await c.execute(code, gpu={"memory_mb": 1000})
    assert results(ex) == [0, 2, 0], "the child's own client is limited to SANDBOX_GPU_MARGIN_MB"


async def test_an_mps_fault_refuses_the_run_before_any_code_and_readiness_says_so(
    mps_server: tuple[Server, Path],
) -> None:
    srv, control = mps_server
    async with AsyncClient(srv.url) as c:
        simulate(control, mps_fault="control daemon went away")
        try:
            ex = await c.execute("print('ran')", gpu={"memory_mb": 500})
            status, body = srv.get("/readyz")
        finally:
            simulate(control)
        assert ex.status == "internal" and "MPS" in (ex.message or "") and ex.stdout == ""
        assert not any(f["type"] == "start" for f in ex.frames), "nothing started"
        assert status == 503 and "went away" in body
        again = await c.execute(ALLOC + "print(alloc(400))", gpu={"memory_mb": 500})
    assert results(again) == [0]
    assert srv.get("/readyz")[0] == 200


NEEDLES = {
    "dev_shm": "/dev/shm is private and empty",
    "compute_mode": "not in EXCLUSIVE_PROCESS compute mode",
    "pid_namespace": "another PID namespace",
}


@pytest.mark.parametrize(
    ("host", "blocked"),
    [
        ({}, ["dev_shm", "compute_mode"]),  # a real daemon, a GPU out of the box
        # A daemon in another container (in DEFAULT mode: under EXCLUSIVE_PROCESS startup is refused).
        ({"mps_shm": "pipe_dir", "mps_pid_namespace": "other"}, ["compute_mode", "pid_namespace"]),
    ],
    ids=["real-default-mode", "other-pid-namespace"],
)
def test_mps_that_cannot_hold_a_jailed_run_reads_not_enforcing_with_the_exact_reasons(
    tmp_path: Path, cuda_dir: Path, host: dict[str, object], blocked: list[str]
) -> None:
    # Issue 14, defect 6: the simulated daemon read "enforcing" where the real one could not hold a
    # jailed run (its clients need /dev/shm; compute mode; a daemon's PIDs in another namespace).
    control = tmp_path / "sim.json"
    simulate_file(control, **host)
    pipe = Path(tempfile.mkdtemp(prefix="appliance-mps-", dir="/tmp"))  # apart from libcuda's (readable) dir
    os.chmod(pipe, 0o755)
    srv = start_server(
        tmp_path / "srv",
        settings=mps_env(
            cuda_dir, SANDBOX_GPU_SIMULATE_FILE=str(control), SANDBOX_GPU_MPS_PIPE_DIR=str(pipe)
        ),
    )
    try:
        status, body = srv.get("/readyz")
        mps = json.loads(body)["gpu"]["mps"]
        device = mps["devices"]["GPU-SIM-0"]
        assert status == 200 and mps["enforcing"] is False and device["enforcing"] is False, body
        assert device["blocked"] == blocked and device["note"].startswith("not enforcing: ")
        assert all(NEEDLES[code] in device["note"] for code in blocked), device["note"]
        assert json.loads(body)["gpu"]["watchdog"]["available"] is True, "the watchdog still guards runs"
        metrics = srv.get("/metrics")[1]
        assert 'appliance_gpu_mps_enforcing{device="GPU-SIM-0"} 0.0' in metrics
        for code in blocked:
            assert f'appliance_gpu_mps_blocked{{device="GPU-SIM-0",reason="{code}"}} 1.0' in metrics
        # The device's jails do not join MPS, whose clients they could not be: no pipe directory.
        code = f"import os\nprint(os.path.exists({str(pipe)!r}), 'CUDA_MPS_PIPE_DIRECTORY' in os.environ)"
        with Client(srv.url) as c:
            ex = c.execute(code, gpu={"memory_mb": 500})
        assert ex.status == "ok" and ex.stdout == "False False\n", ex.frames
        assert json.loads(srv.get("/readyz")[1])["gpu"]["mps"]["armed"] == 0
    finally:
        srv.stop()
        shutil.rmtree(pipe, ignore_errors=True)


def test_a_host_set_up_for_mps_as_nvidia_documents_stops_startup_with_the_fix(
    tmp_path: Path, cuda_dir: Path
) -> None:
    # "real-exclusive": EXCLUSIVE_PROCESS and a daemon whose clients need /dev/shm. A jail cannot
    # join it, and the daemon holds the GPU's only context: every GPU run would fail with CUDA
    # error 46 (the kit's MPS section saw it). Issue 14: refuse such a host at startup, like MIG.
    control = tmp_path / "sim.json"
    simulate_file(control, compute_mode={"0": "EXCLUSIVE_PROCESS"})
    pipe = Path(tempfile.mkdtemp(prefix="appliance-mps-", dir="/tmp"))
    os.chmod(pipe, 0o755)
    try:
        with pytest.raises(RuntimeError) as err:
            start_server(
                tmp_path / "srv",
                settings=mps_env(
                    cuda_dir, SANDBOX_GPU_SIMULATE_FILE=str(control), SANDBOX_GPU_MPS_PIPE_DIR=str(pipe)
                ),
            )
    finally:
        shutil.rmtree(pipe, ignore_errors=True)
    text = str(err.value)
    assert "server exited 2" in text, text
    assert "GPU 0 (GPU-SIM-0) is in EXCLUSIVE_PROCESS compute mode with an MPS control daemon" in text
    assert "CUDA error 46" in text and "nvidia-smi -i 0 -c DEFAULT" in text
    assert NEEDLES["dev_shm"] in text, "the reason a jail cannot join MPS is named"


async def test_a_jailed_client_cannot_attach_to_a_daemon_whose_memory_is_in_dev_shm(
    mps_server: tuple[Server, Path],
) -> None:
    # The simulated daemon is as unkind as the real one: its client must map the daemon's
    # shared memory, and a GPU jail's /dev/shm is empty. Moved there after the startup checks,
    # the next run's CUDA context fails to connect, and the run is refused before any code.
    srv, control = mps_server
    simulate(control, mps_shm="dev_shm")
    try:
        async with AsyncClient(srv.url) as c:
            ex = await c.execute("print('ran')", gpu={"memory_mb": 500})
    finally:
        simulate(control)
    assert ex.status == "internal" and ex.stdout == "", ex.frames
    assert not any(f["type"] == "start" for f in ex.frames), "nothing started"
    assert "cuDevicePrimaryCtxRetain returned CUDA error 805" in (ex.message or ""), (
        ex.message
    )  # MPS_CONNECTION_FAILED


def test_a_daemon_that_ignores_limits_is_reported_as_not_enforcing(tmp_path: Path, cuda_dir: Path) -> None:
    srv = start_server(
        tmp_path / "srv",
        settings=mps_env(cuda_dir, pipe="mps-ignore", SANDBOX_GPU_SIMULATE_MPS="ignore-limits"),
    )
    try:
        status, body = srv.get("/readyz")
        mps = json.loads(body)["gpu"]["mps"]
        assert status == 200 and mps["enforcing"] is False
        assert "was not refused" in mps["devices"]["GPU-SIM-0"]["note"]
        assert mps["note"].startswith("GPU-SIM-0: ") and "was not refused" in mps["note"]
        assert json.loads(body)["gpu"]["watchdog"]["available"] is True, "the watchdog still guards runs"
        code = (
            ALLOC
            + "print(alloc(64))\ncu.simClientLimitMB.restype = ctypes.c_longlong\nprint(cu.simClientLimitMB())"
        )
        with Client(srv.url) as c:
            ex = c.execute(code, gpu={"memory_mb": 500})
        assert results(ex) == [0, 4096], "an unproven device leaves runs unlimited, not at the resting limit"
    finally:
        srv.stop()


@pytest.mark.parametrize(
    ("env", "reason"),
    [
        ({"SANDBOX_GPU_SIMULATE_MPS": "ignore-limits"}, "the daemon does not enforce the limit"),
        ({"SANDBOX_GPU_SIMULATE_MPS": "off"}, "no CUDA MPS control daemon"),
        ({"SANDBOX_GPU_LIBCUDA": "libcuda-missing.so.1"}, "could not create its CUDA context"),
    ],
)
def test_required_mps_limits_that_cannot_be_proven_stop_startup(
    tmp_path: Path, cuda_dir: Path, env: dict[str, str], reason: str
) -> None:
    with pytest.raises(RuntimeError) as err:
        start_server(
            tmp_path / "srv", settings=mps_env(cuda_dir, pipe="mps-require", SANDBOX_GPU_MPS="require", **env)
        )
    assert "server exited 2" in str(err.value) and "SANDBOX_GPU_MPS=require" in str(err.value)
    assert reason in str(err.value)


# -- the limiter on its own: a neighbour's client inside another run's window -------------------


class _Process:
    """A stand-in for a jail's process whose 'CUDA context' is a real client process."""

    def __init__(self, env: dict[str, str], intruder: bool) -> None:
        self.env, self.intruder = env, intruder
        self.asked = False
        self.procs: list[subprocess.Popen[bytes]] = []
        self.root = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        self.pid = self.root.pid

    def client(self) -> subprocess.Popen[bytes]:
        code = ALLOC + "import time\nassert alloc(1) == 0\nprint('up', flush=True)\ntime.sleep(60)"
        proc = subprocess.Popen([sys.executable, "-c", code], env=self.env, stdout=subprocess.PIPE)
        assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
        self.procs.append(proc)
        return proc

    def write(self, data: bytes, limit: int | None = None) -> None:
        op = jail_end.parse_op(data)  # what the driver would read
        assert op is not None and op["op"] == "cuda_context"
        self.asked = True

    async def wait_event(self, kind: str, timeout: float) -> channel.Event:
        assert self.asked and kind == "cuda_context"
        # The jail's own client must be in the jail's process tree: re-root the tree on it.
        own = await asyncio.to_thread(self.client)
        self.pid = own.pid
        if self.intruder:
            await asyncio.to_thread(self.client)  # not in the tree: someone else's process
        return {"ev": "cuda_context", "ok": True}

    def close(self) -> None:
        for proc in [self.root, *self.procs]:
            proc.kill()
            proc.wait()


class _Jail:
    def __init__(self, process: _Process) -> None:
        self.process = process


@pytest.fixture
def limiter(cuda_dir: Path) -> Iterator[tuple[MpsLimiter, SimulatedMps, dict[str, str], list[int]]]:
    backend = SimulatedBackend((4096,), mps=True)
    daemon = SimulatedMps(cuda_dir / "mps-unit", backend)
    evicted: list[int] = []
    lim = MpsLimiter(daemon, os.getuid(), MARGIN_MB, str(cuda_dir / "libcuda.so.1"), evicted.append)
    lim.devices["GPU-SIM-0"] = DeviceMps(enforcing=True, note="test")
    env = {
        "PATH": os.environ["PATH"],
        "APPLIANCE_LIBCUDA": str(cuda_dir / "libcuda.so.1"),
        "CUDA_MPS_PIPE_DIRECTORY": str(cuda_dir / "mps-unit"),
        "CUDA_VISIBLE_DEVICES": "GPU-SIM-0",
    }
    yield lim, daemon, env, evicted
    daemon.close()


GRANT = Grant(ticket=1, index=0, uuid="GPU-SIM-0", minor=0, memory_mb=700, queued_ms=0)


async def test_a_client_that_connects_inside_another_runs_window_is_terminated(
    limiter: tuple[MpsLimiter, SimulatedMps, dict[str, str], list[int]],
) -> None:
    lim, daemon, env, evicted = limiter
    process = _Process(env, intruder=True)
    try:
        await lim.arm(_Jail(process), GRANT)  # type: ignore[arg-type]
        own, intruder = (p.pid for p in process.procs)
        assert evicted == [intruder] and lim.intruders == 1
        assert daemon.client_limits() == {own: 700}, "the run keeps its limit; the intruder is gone"
        server = daemon.server_for(os.getuid())
        assert daemon.limit(server, "GPU-SIM-0") == MARGIN_MB, "the window closed at the resting limit"
    finally:
        process.close()


async def test_a_run_whose_client_existed_before_arming_is_refused(
    limiter: tuple[MpsLimiter, SimulatedMps, dict[str, str], list[int]],
) -> None:
    lim, daemon, env, _ = limiter
    await lim.set_resting("GPU-SIM-0")
    process = _Process(env, intruder=False)
    early = process.client()  # connected at the resting limit, before the window
    process.pid = early.pid

    async def no_new_client(kind: str, timeout: float) -> channel.Event:
        return {"ev": "cuda_context", "ok": True}

    process.wait_event = no_new_client  # type: ignore[method-assign]
    try:
        with pytest.raises(GpuLimitUnavailable, match="did not appear"):
            await lim.arm(_Jail(process), GRANT)  # type: ignore[arg-type]
        assert daemon.client_limits() == {early.pid: MARGIN_MB}
    finally:
        process.close()


async def test_a_device_the_probe_did_not_prove_is_not_armed(
    limiter: tuple[MpsLimiter, SimulatedMps, dict[str, str], list[int]],
) -> None:
    lim, _daemon, env, _ = limiter
    lim.devices["GPU-SIM-0"] = DeviceMps(enforcing=False, note="not proved")
    process = _Process(env, intruder=False)
    try:
        await lim.arm(_Jail(process), GRANT)  # type: ignore[arg-type]
        assert process.procs == [] and lim.armed == 0
    finally:
        process.close()


# -- pure: commands, replies, the probe's verdict ---------------------------------------------


def test_control_commands_are_rendered_with_device_uuids_and_mib() -> None:
    assert cmd_set_limit(1234, "GPU-0a1b", 900) == "set_device_pinned_mem_limit 1234 GPU-0a1b 900M"
    assert cmd_set_default_limit("GPU-0a1b", 256) == "set_default_device_pinned_mem_limit GPU-0a1b 256M"
    for bad in ("GPU-0 1", "GPU-0\nquit", ""):
        with pytest.raises(MpsError):
            cmd_set_limit(1, bad, 1)


def test_control_replies_are_parsed_strictly() -> None:
    assert parse_pids("123\n456\n") == {123, 456} and parse_pids("") == set()
    with pytest.raises(MpsError):
        parse_pids("Cannot find MPS control daemon process")
    assert parse_limit_mb("900M") == 900 and parse_limit_mb("4G") == 4096 and parse_limit_mb("512 MB") == 512
    assert parse_limit_mb("none") is None and parse_limit_mb("0") is None
    with pytest.raises(MpsError):
        parse_limit_mb("N/A: server not found")


@pytest.mark.parametrize(
    ("result", "after", "enforcing", "phrase"),
    [
        ({"small": 0, "big": 2}, MARGIN_MB, True, "proved"),
        ({"small": 2, "big": 2}, MARGIN_MB, False, "preloaded module"),
        ({"small": 0, "big": 0}, MARGIN_MB, False, "does not enforce"),
        ({"small": 0, "big": 2, "tamper": "accepted"}, 4096, False, "jailed code could change it"),
    ],
)
def test_the_probe_is_judged_on_every_property(
    result: dict[str, Any], after: int, enforcing: bool, phrase: str
) -> None:
    ok, note = judge_probe(result, after, MARGIN_MB)
    assert ok is enforcing and phrase in note


def test_a_host_daemon_is_joined_only_when_its_pipe_directory_is_usable(
    tmp_path: Path, cuda_dir: Path
) -> None:
    import socket

    from appliance.gpu.lease import open_mps
    from appliance.settings import Settings

    backend = SimulatedBackend((4096,), mps=True)  # "an MPS control daemon runs on this host"
    hidden = tmp_path / "pipe"  # pytest's tmp dirs are 0700: the sandbox uid cannot reach them
    hidden.mkdir()
    reachable = cuda_dir / "host-pipe"
    reachable.mkdir()
    cases = [
        (Settings(gpu=True, gpu_mps="off"), "SANDBOX_GPU_MPS=off"),
        (Settings(gpu=True, gpu_mps_pipe_dir=hidden), "not reachable by the sandbox uid"),
        (Settings(gpu=True, gpu_mps_pipe_dir=reachable), "holds no control socket"),
    ]
    for settings, why in cases:
        control, note = open_mps(settings, backend)
        assert control is None and why in note, note
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(reachable / "control"))
        env_path = os.environ["PATH"]
        os.environ["PATH"] = str(cuda_dir)  # no nvidia-cuda-mps-control here
        try:
            control, note = open_mps(Settings(gpu=True, gpu_mps_pipe_dir=reachable), backend)
        finally:
            os.environ["PATH"] = env_path
    assert control is None and "nvidia-cuda-mps-control was not found" in note
    assert (
        open_mps(Settings(gpu=True), SimulatedBackend((4096,)))[1]
        == "no CUDA MPS control daemon on this host"
    )


FAKE_CONTROL = """#!/bin/bash
# Stands in for nvidia-cuda-mps-control (no GPU here): one command on stdin, state in the pipe dir.
read -r cmd
dir=$CUDA_MPS_PIPE_DIRECTORY
echo "$cmd" >> "$dir/commands"
case "$cmd" in
  get_server_list) cat "$dir/servers" 2>/dev/null ;;
  "start_server -uid "*) mv "$dir/pending" "$dir/servers" ;;
  "get_client_list "*) cat "$dir/clients" ;;
  "get_device_pinned_mem_limit "*) echo 256M ;;
  set_*) [ -e "$dir/refuse" ] && echo "Invalid value" ;;
  quit) exit 3 ;;
esac
exit 0
"""


def test_the_daemon_client_speaks_nvidia_cuda_mps_control_line_by_line(tmp_path: Path) -> None:
    from appliance.gpu.mps import DaemonControl

    tool = tmp_path / "nvidia-cuda-mps-control"
    tool.write_text(FAKE_CONTROL)
    tool.chmod(0o755)
    pipe = tmp_path / "pipe"
    pipe.mkdir()
    server = subprocess.Popen(["setpriv", "--reuid=1001", "--regid=1001", "--clear-groups", "sleep", "30"])
    try:
        # The stand-in server is the uid's once setpriv has switched to it (before its exec).
        until(
            lambda: "\nUid:\t1001\t" in Path(f"/proc/{server.pid}/status").read_text(), 10, "setpriv to 1001"
        )
        (pipe / "pending").write_text(f"{server.pid}\n")
        (pipe / "clients").write_text("4242\n4343\n")
        daemon = DaemonControl(pipe, binary=str(tool))
        assert daemon.server_for(1001) == server.pid, "no server for the uid yet: one is started"
        assert daemon.clients(server.pid) == {4242, 4343}
        daemon.set_limit(server.pid, "GPU-abc", 700)
        daemon.set_default_limit("GPU-abc", 256)
        assert daemon.limit(server.pid, "GPU-abc") == 256
        (pipe / "refuse").touch()
        with pytest.raises(MpsError, match="refused: Invalid value"):
            daemon.set_limit(server.pid, "GPU-abc", 700)
        with pytest.raises(MpsError, match=r"failed \(3\)"):
            daemon._run("quit")
    finally:
        server.kill()
        server.wait()
    assert (pipe / "commands").read_text().splitlines() == [
        "get_server_list",
        "start_server -uid 1001",
        "get_server_list",
        f"get_client_list {server.pid}",
        f"set_device_pinned_mem_limit {server.pid} GPU-abc 700M",
        "set_default_device_pinned_mem_limit GPU-abc 256M",
        f"get_device_pinned_mem_limit {server.pid} GPU-abc",
        f"set_device_pinned_mem_limit {server.pid} GPU-abc 700M",
        "quit",
    ]


def test_what_stands_in_a_jailed_clients_way_is_listed_with_every_reason() -> None:
    assert [c for c, _ in jail_blockers(needs_dev_shm=True, exclusive=False, pid_problem="elsewhere")] == [
        "dev_shm",
        "compute_mode",
        "pid_namespace",
    ]
    assert jail_blockers(needs_dev_shm=False, exclusive=True, pid_problem=None) == []
    assert jail_blockers(needs_dev_shm=False, exclusive=True, pid_problem="elsewhere") == [
        ("pid_namespace", "elsewhere")
    ]


def test_a_real_daemon_is_checked_for_being_in_this_pid_namespace(tmp_path: Path) -> None:
    # This host runs no MPS daemon: nothing visible, so its PIDs could not be ours.
    problem = daemon_pid_namespace_problem()
    assert problem is not None and "no MPS control daemon process is visible" in problem
    # A /proc with the daemon's entry: the same namespace link as ours, then another one.
    proc = tmp_path / "proc"
    (proc / "self" / "ns").mkdir(parents=True)
    (proc / "self" / "ns" / "pid").symlink_to("pid:[4026531836]")
    (proc / "77" / "ns").mkdir(parents=True)
    (proc / "77" / "comm").write_text("nvidia-cuda-mps\n")
    (proc / "77" / "ns" / "pid").symlink_to("pid:[4026531836]")
    assert daemon_pid_namespace_problem(proc) is None
    (proc / "77" / "ns" / "pid").unlink()
    (proc / "77" / "ns" / "pid").symlink_to("pid:[4026532999]")
    problem = daemon_pid_namespace_problem(proc)
    assert problem is not None and "PID 77" in problem and "another PID namespace" in problem


@pytest.mark.parametrize(
    ("mode", "daemon", "joins", "refused"),
    [
        ("DEFAULT", False, False, False),
        ("DEFAULT", True, False, False),
        ("EXCLUSIVE_PROCESS", True, True, False),  # jails are MPS clients: what MPS needs
        ("EXCLUSIVE_PROCESS", True, False, True),  # the daemon holds the only context: error 46
        ("EXCLUSIVE_PROCESS", False, False, True),  # one context per device: refused, not clamped
        ("PROHIBITED", False, False, True),
        ("PROHIBITED", True, True, True),
        ("EXCLUSIVE_THREAD", False, False, True),
        ("UNKNOWN(7)", False, False, True),
    ],
)
def test_every_compute_mode_is_decided_run_or_refuse_with_the_fix(
    mode: str, daemon: bool, joins: bool, refused: bool
) -> None:
    from appliance.gpu.backend import Device
    from appliance.gpu.lease import compute_mode_problem

    dev = Device(index=3, uuid="GPU-abc", name="x", total_mb=1, used_mb=0, minor=3)
    problem = compute_mode_problem(dev, mode, daemon, joins, "its /dev/shm is private")
    if not refused:
        assert problem is None
    else:
        assert problem is not None and f"GPU 3 (GPU-abc) is in {mode} compute mode" in problem
        assert "nvidia-smi -i 3 -c DEFAULT" in problem
        if mode == "EXCLUSIVE_PROCESS" and daemon:
            assert "its /dev/shm is private" in problem and "CUDA error 46" in problem
