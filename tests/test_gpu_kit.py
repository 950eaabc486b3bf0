"""The real-GPU acceptance kit end to end, against simulated devices.

`scripts/gpu-kit.sh` (what `make gpu-kit` runs) builds the kit as it would travel to a GPU
machine; the kit's own `gpu-acceptance.sh` then installs firejail (setuid) and the appliance
with the kit's llama-cpp-python from the kit's wheels into a fresh virtualenv, runs one jail as
the sandbox uid, and every check against a real appliance whose GPU is simulated: the
simulated NVML backend, the simulated MPS daemon standing in for device memory (late frees,
thread IDs), the stand-in libcuda (tests/stub_libcuda.c) and nvidia-smi
(tests/stub_nvidia_smi.py); the CUDA 13 runtime and cuBLAS come from PyPI's wheels, reached
through LD_LIBRARY_PATH only. Only the hardware is left unknown: the checks that need it are
listed in HARDWARE_ONLY and must SKIP with their reason, never PASS. The bare-machine
rehearsal (scripts/gpu-rehearsal.sh) runs the same kit with the docs' command in a fresh
Debian root that lacks the sandbox user, libapparmor and a Python under /usr on PATH.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import REPO, scaled

# Needs root, firejail and make: never in the fast tier (tests/tiers.py).
pytestmark = [pytest.mark.slow, pytest.mark.host]

LIMIT_MB = 64
# Checks that cannot run without the hardware, and why (the reason must say so).
HARDWARE_ONLY = {
    "preflight.nvidia_uvm": "hardware-only",
    "jail.device_nodes": "hardware-only",
    # The kit's llama.cpp imports, but nothing here can offload.
    "llama_offload": "hardware-only",
    "mps": "--mps",  # optional: its own test below
}
# Measurements where the appliance promises nothing: INFO, never PASS or FAIL.
INFO_ONLY = {"contention.overrun_race": "informational, no verdict", "inference": "informational, no verdict"}
EVERY_CHECK = (
    "kit.prepare",
    "preflight.driver",
    "preflight.mig",
    "preflight.compute_mode",
    "preflight.nvidia_uvm",
    "server",
    "context",
    "readyz",
    "preload",
    "session",
    "inference",
    "jail.visible_device",
    "jail.device_nodes",
    "watchdog.main_thread",
    "watchdog.thread",
    "watchdog.subprocess",
    "host_memory",
    "reclaim",
    "contention",
    "contention.overrun_race",
    "llama_offload",
    "mps",
)


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    """A folder the sandbox uid can read (the stand-in libcuda and the kit's venv live here)."""
    root = Path(tempfile.mkdtemp(prefix="appliance-gpu-kit-", dir="/tmp"))
    os.chmod(root, 0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def cuda_wheel() -> Path | None:
    """The CUDA build of llama-cpp-python where `make gpu-kit` finds it (`make cuda-wheel`)."""
    if os.environ.get("CUDA_WHEEL"):
        return Path(os.environ["CUDA_WHEEL"])
    found = sorted(REPO.glob("build/cuda-wheel/llama_cpp_python-*.whl"))
    found += sorted(REPO.parent.glob("shared/cuda-wheel/llama_cpp_python-*.whl"))
    return found[0] if found else None


@pytest.fixture(scope="module")
def kit(scratch: Path) -> Path:
    """The kit, built as `make gpu-kit` builds it (downloads cached in ~/.cache/appliance-gpu-kit).
    Without a CUDA build of llama-cpp-python here (`make cuda-wheel` takes most of an hour on two
    cores), it carries the venv's own CPU build instead, which is all a simulated GPU can use;
    test_the_kit_carries_the_cuda_build then SKIPs, saying so."""
    out = scratch / "gpu-kit"
    env = {**os.environ, "PY": sys.executable}
    if cuda_wheel() is None:
        env["GPU_KIT_LLAMA"] = "venv"
    proc = subprocess.run(
        ["scripts/gpu-kit.sh", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=env,
        timeout=scaled(600),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


@pytest.fixture(scope="module")
def libcuda(scratch: Path) -> Path:
    if shutil.which("gcc") is None:
        pytest.fail("gcc is needed to build tests/stub_libcuda.c (apt-get install gcc)")
    path = scratch / "cuda" / "libcuda.so.1"
    path.parent.mkdir()
    os.chmod(path.parent, 0o755)
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-O1", "-o", str(path), str(REPO / "tests" / "stub_libcuda.c")],
        check=True,
    )
    return path


def kit_env(scratch: Path, out: Path, venv: Path | None = None, **more: str) -> dict[str, str]:
    """The kit's environment here: its installed firejail and venv in the scratch folder."""
    return {
        **os.environ,
        "KIT_HOME": str(scratch / "kit-home"),
        "KIT_VENV": str(venv or scratch / "venv"),
        "KIT_OUT": str(out),
        **more,
    }


def run_kit(
    kit: Path, scratch: Path, libcuda: Path, name: str, *args: str, venv: Path | None = None
) -> tuple[int, dict[str, Any], Path]:
    """The kit's gpu-acceptance.sh in simulation; (exit status, JSON report, report folder).
    The CUDA runtime's libraries are on LD_LIBRARY_PATH only, as a driver's often are."""
    out = scratch / f"report-{name}"
    libs = subprocess.run(
        ["scripts/gpu-rehearsal.sh", "--cuda-libs"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.strip()
    env = kit_env(scratch, out, venv, STUB_SMI_STATE=str(scratch / f"smi-{name}.json"), LD_LIBRARY_PATH=libs)
    proc = subprocess.run(
        [
            str(kit / "gpu-acceptance.sh"),
            "--simulate",
            "--libcuda",
            str(libcuda),
            "--nvidia-smi",
            str(REPO / "tests" / "stub_nvidia_smi.py"),
            *args,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=scaled(900),
    )
    report = out / "gpu-acceptance.json"
    assert report.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.returncode, json.loads(report.read_text()), out


def test_the_kit_is_small_and_carries_what_a_bare_gpu_machine_lacks(kit: Path) -> None:
    size = sum(p.stat().st_size for p in kit.rglob("*") if p.is_file())
    archive = kit.with_name(kit.name + ".tar.gz")
    assert size <= LIMIT_MB << 20 and archive.stat().st_size <= LIMIT_MB << 20
    fj = kit / "firejail"
    assert os.access(fj / "usr/bin/firejail", os.X_OK)
    assert (fj / "etc/firejail/firejail.config").is_file()
    assert (fj / "usr/lib/x86_64-linux-gnu/firejail/fseccomp").is_file()
    wheels = sorted(p.name for p in (kit / "wheels").glob("*.whl"))
    for binary in ("pydantic_core", "aiohttp"):  # compiled: one wheel per Python
        for tag in ("cp311", "cp312"):
            assert any(w.startswith(binary + "-") and f"-{tag}-" in w for w in wheels), (binary, tag, wheels)
    for needed in ("appliance-", "nvidia_ml_py-", "pip-", "mcp-"):
        assert any(w.startswith(needed) for w in wheels), needed
    assert not any(w.startswith(("matplotlib-", "torch-", "pandas-")) for w in wheels), wheels
    with zipfile.ZipFile(next((kit / "wheels").glob("appliance-*.whl"))) as whl:
        assert "appliance/gpu/watchdog.py" in whl.namelist()
    assert (kit / "benchmarks" / "gpu_acceptance.py").is_file() and os.access(
        kit / "gpu-acceptance.sh", os.X_OK
    )
    meta = json.loads((kit / "kit.json").read_text())
    assert meta["pythons"] == ["3.11", "3.12"]
    # What a bare machine lacks besides: firejail's libraries and llama.cpp's OpenMP runtime,
    # llama-cpp-python (the CUDA build) with its requirements but numpy (the machine's Python
    # brings it), and a model for the GPU session.
    assert sorted(p.name for p in (kit / "lib").iterdir()) == sorted(
        ["libapparmor.so.1", "libselinux.so.1", "libpcre2-8.so.0", "libgomp.so.1"]
    )
    assert meta["llama"] and meta["llama"] in wheels and meta["llama"].startswith("llama_cpp_python-")
    assert not any(w.startswith("numpy-") for w in wheels), wheels
    assert any(w.startswith("diskcache-") for w in wheels) and any(w.startswith("jinja2-") for w in wheels)
    assert (kit / "models" / "kit-tiny.gguf").stat().st_size > 0


def test_the_kit_carries_the_cuda_build(kit: Path) -> None:
    wheel = cuda_wheel()
    if wheel is None:
        pytest.skip("no CUDA build of llama-cpp-python here: make cuda-wheel (needs nvcc; long)")
    meta = json.loads((kit / "kit.json").read_text())
    assert meta["cuda_llama"] == wheel.name and "archs=90" in meta["cuda_llama_build"][0], meta
    with zipfile.ZipFile(kit / "wheels" / wheel.name) as whl:
        libs = sorted(n.rsplit("/", 1)[1] for n in whl.namelist() if n.startswith("llama_cpp/lib/"))
        assert all(n.startswith(("llama_cpp/", "llama_cpp_python-")) for n in whl.namelist())
    # One copy of each library (a wheel has no links), the CUDA backend among them.
    assert "libggml-cuda.so.0" in libs and not any(n.endswith((".so.0.25.3", "cuda.so")) for n in libs), libs


def test_allocations_that_forget_the_cuda_context_fail_the_reclaim_check(
    kit: Path, scratch: Path, libcuda: Path
) -> None:
    # The kit as it was: the queued run allocated exactly its budget. NVML counts its context
    # too (the simulated GPU charges one, as a real GPU does), so the watchdog stops it.
    rc, report, _ = run_kit(kit, scratch, libcuda, "no-context", "--only", "reclaim", "--context-mb", "0")
    checks = {c["name"]: c for c in report["checks"]}
    # Found by absolute path: the stand-in libcuda (given), the CUDA runtime on LD_LIBRARY_PATH
    # (run_kit's, as a driver's often is). The bare-root rehearsal finds them where it puts them.
    libraries = checks["kit.prepare"]["data"]["libraries"]
    assert libraries["libcuda.so.1"] == str(libcuda), libraries
    assert libraries["libcublas.so.13"].endswith("/nvidia/cu13/lib/libcublas.so.13"), libraries
    assert libraries["libcudart.so.13"], libraries  # this host's toolkit may have one in its cache
    assert checks["kit.prepare"]["data"]["llama_jail"].startswith("ok llama_cpp"), checks["kit.prepare"]
    assert checks["context"]["status"] == "PASS" and "--context-mb" in checks["context"]["detail"]
    assert checks["reclaim"]["status"] == "FAIL" and "gpu_memory_limit" in checks["reclaim"]["detail"], checks
    assert rc == 1 and report["meta"]["counts"]["FAIL"] == 1


def test_the_mps_section_reports_what_a_jail_gets_and_restores_the_compute_mode(
    kit: Path, scratch: Path, libcuda: Path
) -> None:
    rc, report, out = run_kit(kit, scratch, libcuda, "mps", "--only", "mps", "--mps")
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["mps.restored"]["status"] == "PASS", checks["mps.restored"]
    smi = json.loads((scratch / "smi-mps.json").read_text())
    assert smi["compute_mode"] == {"0": "Default"}  # set to EXCLUSIVE_PROCESS, then put back
    assert not (out / "compute-mode.orig").exists()
    # A GPU jail cannot join an MPS daemon (issue 14 defect 6: its /dev/shm is private), and on an
    # EXCLUSIVE_PROCESS GPU under a daemon it would get no CUDA context (error 46): the appliance
    # refuses such a host at startup, naming the device, the mode and the fix.
    host = checks["mps.host"]
    assert host["status"] == "PASS" and "refused the MPS host at startup" in host["detail"], host
    assert "GPU 0 (GPU-SIM-0) is in EXCLUSIVE_PROCESS compute mode" in host["data"]["refused"], host
    assert "nvidia-smi -i 0 -c DEFAULT" in host["data"]["refused"], host
    assert rc == 0


def test_a_disabled_watchdog_fails_the_watchdog_check(kit: Path, scratch: Path, libcuda: Path) -> None:
    # A poll interval of an hour: the watchdog never looks while the over-budget run holds its
    # memory (6 s). The neighbour outlives the hog by 8 s, since a run's end makes the server
    # read NVML anyway (and would stop the hog).
    rc, report, _ = run_kit(
        kit,
        scratch,
        libcuda,
        "nowatchdog",
        "--only",
        "watchdog.main_thread",
        "--server-env",
        "SANDBOX_GPU_POLL_MS=3600000",
        "--overrun-hold-s",
        "6",
        "--neighbour-s",
        "14",
    )
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["watchdog.main_thread"]["status"] == "FAIL", checks["watchdog.main_thread"]
    assert "not gpu_memory_limit" in checks["watchdog.main_thread"]["detail"]
    assert checks["readyz"]["status"] == "SKIP" and "not selected" in checks["readyz"]["detail"]
    assert rc == 1 and report["meta"]["counts"]["FAIL"] == 1


@pytest.mark.parametrize(("reclaim_ms", "expect"), [("10000", "PASS"), ("0", "FAIL")])
def test_the_reclaim_check_fails_exactly_when_the_reclaim_wait_is_off(
    kit: Path, scratch: Path, libcuda: Path, reclaim_ms: str, expect: str
) -> None:
    # Two-second polls: the killed run's grant goes back before the next poll can see its
    # memory as foreign, so the reading the release admits by is one from before the kill.
    # Then only the reclaim wait keeps the queued run out while the simulated GPU still
    # holds the killed run's memory (here it frees 6 s after the process is gone: longer than
    # the queued run can take to get a jail, its context and its allocation on a busy
    # machine); without it the big run is admitted at once and its allocation is CUDA
    # out-of-memory.
    rc, report, _ = run_kit(
        kit,
        scratch,
        libcuda,
        f"reclaim-{reclaim_ms}",
        "--only",
        "reclaim",
        "--server-env",
        "SANDBOX_GPU_POLL_MS=2000",
        "--server-env",
        f"SANDBOX_GPU_RECLAIM_MS={reclaim_ms}",
        "--sim-free-delay-s",
        "6",
    )
    check = {c["name"]: c for c in report["checks"]}["reclaim"]
    assert check["status"] == expect, check
    if expect == "FAIL":
        assert "out-of-memory" in check["detail"], check
        assert rc == 1 and report["meta"]["counts"]["FAIL"] == 1
    else:
        assert check["data"]["big_queued_ms"] > 0 and rc == 0, check


HOLD_CONTEXT = """
import ctypes, os, sys
cu = ctypes.CDLL(os.environ["APPLIANCE_LIBCUDA"])
ctx = ctypes.c_void_p()
cu.cuInit(0)
print(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0), flush=True)
sys.stdin.read()
"""


def hold_contexts(
    libcuda: Path, scratch: Path, count: int, procs: list[subprocess.Popen[bytes]]
) -> list[int]:
    """Start `count` processes, one after another, that each try to make a CUDA context on the
    simulated GPU-SIM-0 and hold it; each one's CUDA result, in order (0: a context). The
    processes are appended to `procs` for the caller to kill."""
    env = {
        "PATH": os.environ["PATH"],
        "APPLIANCE_LIBCUDA": str(libcuda),
        "CUDA_VISIBLE_DEVICES": "GPU-SIM-0",
        "CUDA_MPS_PIPE_DIRECTORY": str(scratch / "no-mps-here"),
    }
    rcs = []
    for _ in range(count):
        proc = subprocess.Popen(
            [sys.executable, "-c", HOLD_CONTEXT], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        procs.append(proc)
        assert proc.stdout is not None
        rcs.append(int(proc.stdout.readline()))
    return rcs


@pytest.mark.parametrize(
    ("mode", "first", "second"),
    [("DEFAULT", 0, 0), ("EXCLUSIVE_PROCESS", 0, 46), ("EXCLUSIVE_THREAD", 0, 46), ("PROHIBITED", 46, 46)],
)
def test_the_simulated_gpu_fails_contexts_as_the_driver_does_in_each_compute_mode(
    scratch: Path, libcuda: Path, mode: str, first: int, second: int
) -> None:
    # What the startup refusal prevents (issue 14): in these modes a second process, or any,
    # gets CUDA error 46 (CUDA_ERROR_DEVICES_UNAVAILABLE) instead of a context.
    from benchmarks.gpu_acceptance import SimulatedGpuMemory

    memory = SimulatedGpuMemory(libcuda, scratch / f"ctl-{mode}.json", 4096, free_delay_s=0)
    memory.modes["0"] = mode
    procs: list[subprocess.Popen[bytes]] = []
    try:
        assert hold_contexts(libcuda, scratch, 2, procs) == [first, second]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        memory.close()


def test_a_venv_the_sandbox_uid_cannot_reach_is_refused_before_anything_is_installed(
    kit: Path, scratch: Path, libcuda: Path
) -> None:
    # As a runner's temp folder can be: the jails run the venv's Python as the sandbox uid, and
    # the server would refuse to start after the install.
    hidden = scratch / "root-only"
    hidden.mkdir(mode=0o700)
    out = scratch / "report-hidden"
    proc = subprocess.run(
        [str(kit / "gpu-acceptance.sh"), "--simulate"],
        env=kit_env(scratch, out, hidden / "venv"),
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )
    assert proc.returncode == 1 and "the sandbox uid cannot reach" in proc.stderr, proc.stderr
    assert f"{scratch}/kit-home/venv" in proc.stderr and not (hidden / "venv").exists()
    # The report is written all the same, naming the stage and the cause.
    check = json.loads((out / "gpu-acceptance.json").read_text())["checks"][0]
    assert check["name"] == "kit.python" and check["status"] == "FAIL" and "cannot reach" in check["detail"]


def test_a_failure_before_any_check_still_writes_both_reports(kit: Path, scratch: Path) -> None:
    out = scratch / "report-nopython"
    proc = subprocess.run(
        [str(kit / "gpu-acceptance.sh"), "--simulate"],
        env=kit_env(scratch, out, PYTHON=str(scratch / "no-such-python")),
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )
    assert proc.returncode == 1, proc.stderr
    report = json.loads((out / "gpu-acceptance.json").read_text())
    assert report["meta"]["counts"]["FAIL"] == 1 and report["meta"]["kit"]["pythons"] == ["3.11", "3.12"]
    assert report["checks"][0]["name"] == "kit.python" and "no-such-python" in report["checks"][0]["detail"]
    assert "| kit.python | FAIL |" in (out / "gpu-acceptance.md").read_text()


def test_mps_is_refused_outside_simulation_the_compute_mode_is_never_changed(
    kit: Path, scratch: Path
) -> None:
    out = scratch / "report-mps-real"
    proc = subprocess.run(
        [str(kit / "gpu-acceptance.sh"), "--mps"],
        env=kit_env(scratch, out),
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )
    assert proc.returncode == 1, proc.stderr
    check = json.loads((out / "gpu-acceptance.json").read_text())["checks"][0]
    assert check["name"] == "kit.root" and "never changes a machine's compute mode" in check["detail"], check


def test_a_firejail_that_is_not_setuid_fails_the_first_jail_run_as_the_sandbox_uid(
    kit: Path, scratch: Path, libcuda: Path
) -> None:
    # As a kit unpacked and installed by a non-root user leaves it. A jail started as root would
    # not notice (root needs no setuid bit); the kit's first jail runs as uid 1001, before any
    # check, and names the binary.
    plain = scratch / "plain-firejail"
    shutil.copy(kit / "firejail" / "usr" / "bin" / "firejail", plain)
    os.chmod(plain, 0o755)
    out = scratch / "report-nosetuid"
    proc = subprocess.run(
        [str(kit / "gpu-acceptance.sh"), "--simulate", "--libcuda", str(libcuda)],
        env=kit_env(scratch, out, FIREJAIL=str(plain)),
        capture_output=True,
        text=True,
        timeout=scaled(600),
    )
    assert proc.returncode == 1, proc.stderr
    check = json.loads((out / "gpu-acceptance.json").read_text())["checks"][0]
    assert check["name"] == "kit.jail" and f"a jail as uid 1001 failed ({plain}" in check["detail"], check
    assert f"({plain} is not setuid root)" in check["detail"], check


def test_every_check_passes_with_the_docs_command_on_a_bare_debian_root_and_only_the_hardware_checks_skip(
    kit: Path, scratch: Path
) -> None:
    # scripts/gpu-rehearsal.sh: a fresh debootstrap root with no sandbox user, no libapparmor,
    # the interpreter a venv under /opt, libcuda only under /usr/local/nvidia on
    # LD_LIBRARY_PATH, the CUDA runtime only in that venv's nvidia wheels; the kit unpacked and
    # run with `tar xzf gpu-kit.tar.gz -C /opt && /opt/gpu-kit/gpu-acceptance.sh`: every check,
    # the one full run of the kit here (the other tests run the check they break, --only).
    from benchmarks.gpu_acceptance import SIM_CONTEXT_JITTER_MB, SIM_CONTEXT_MB

    if shutil.which("debootstrap", path=os.environ["PATH"] + ":/usr/sbin:/sbin") is None:
        pytest.fail(
            "debootstrap is needed for the bare-machine rehearsal (scripts/setup-system.sh installs it)"
        )
    out = scratch / "rehearsal"
    proc = subprocess.run(
        ["scripts/gpu-rehearsal.sh", str(kit.with_name(kit.name + ".tar.gz")), str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "PY": sys.executable},
        timeout=scaled(1200),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "gpu-acceptance.json").read_text())
    checks = {c["name"]: c for c in report["checks"]}
    assert sorted(checks) == sorted(EVERY_CHECK)
    for name, check in checks.items():
        if name in HARDWARE_ONLY:
            assert check["status"] == "SKIP" and HARDWARE_ONLY[name] in check["detail"], check
        elif name in INFO_ONLY:
            assert check["status"] == "INFO" and INFO_ONLY[name] in check["detail"], check
        else:
            assert check["status"] == "PASS", check
    assert report["meta"]["counts"]["FAIL"] == 0 and report["meta"]["counts"]["INFO"] == 2
    assert report["meta"]["mode"] == "simulated"
    # The simulated GPU charges each context, as NVML counts a real one; the kit measured it
    # and sized the allocations of runs meant to stay within their budgets by it.
    # (It varies, as a real context's does: the simulated one costs up to 64 MiB more.)
    context_mb = checks["context"]["data"]["context_mb"]
    assert SIM_CONTEXT_MB <= context_mb <= SIM_CONTEXT_MB + SIM_CONTEXT_JITTER_MB, checks["context"]
    assert (
        checks["reclaim"]["data"]["big_allocated_mb"]
        < checks["reclaim"]["data"]["big_budget_mb"] - SIM_CONTEXT_MB
    )
    for how in ("main_thread", "thread", "subprocess"):
        assert checks[f"watchdog.{how}"]["data"]["kill_latency_s"] is not None
    assert checks["reclaim"]["data"]["big_queued_ms"] > 0  # it did wait behind the killed run
    # host_memory put the cap to the test: more of the mapped file was resident than the cap.
    host = checks["host_memory"]["data"]
    assert host["file_mb"] > host["memory_mb"] and host["RssFile"] > host["memory_mb"], host
    # Runs within their grants never run out of memory, at any N (what admission promises);
    # the overrunner's race is measured apart, with no verdict.
    rows = {row["n"]: row for row in checks["contention"]["data"]["summary"]}
    assert sorted(rows) == [1, 4, 16]
    for row in rows.values():
        assert set(row["outcomes"]) <= {"ok", "rejected"}, row
    race = checks["contention.overrun_race"]["data"]
    assert race["summary"][0]["n"] == 16 and len(race["overrunners"]) == 2, race
    # GPU preload and a GPU session: llama.cpp warm in the jail, one model serving three cells.
    assert checks["preload"]["data"]["preloaded"] is True, checks["preload"]
    session = checks["session"]["data"]
    assert len(session["sessions"]) == 1 and len(set(session["llm_ids"])) == 1, session
    assert checks["inference"]["data"]["tokens_per_s"][0] > 0, checks["inference"]
    md = (out / "gpu-acceptance.md").read_text()
    assert all(f"| {name} | {checks[name]['status']} |" in md for name in EVERY_CHECK)
    assert "INFO 2 (measurements where the appliance promises nothing" in md
    prepared = checks["kit.prepare"]["data"]
    assert prepared["python"] == "/opt/venv/bin/python3.11", prepared
    assert prepared["libraries"]["libcuda.so.1"] == "/usr/local/nvidia/lib64/libcuda.so.1", prepared
    assert prepared["libraries"]["libcublas.so.13"].startswith(
        "/opt/venv/lib/python3.11/site-packages/nvidia/cu13/lib/"
    )
    assert prepared["llama_jail"].startswith("ok llama_cpp"), prepared
    facts = dict(line.split(": ", 1) for line in (out / "rehearsal.txt").read_text().splitlines())
    assert facts["passwd"] == "sandbox:x:1001:1001::/workspace:/usr/sbin/nologin", facts
    assert facts["workspace"] == "1001 755" and facts["firejail"] == "0 -rwsr-xr-x", facts
    assert facts["kit-libs"].split() == ["libapparmor.so.1", "libgomp.so.1"], facts
    assert facts["ld.so.cache-unchanged"] == "yes", facts  # the kit's cache lives in its namespace


def fake_llama_wheel(folder: Path) -> Path:
    """A llama-cpp-python wheel that imports and claims GPU offload (no native code): what
    --wheels carries to the machine, minus the CUDA build."""
    folder.mkdir()
    os.chmod(folder, 0o755)
    wheel = folder / "llama_cpp_python-0.0.1-py3-none-any.whl"
    info = "llama_cpp_python-0.0.1.dist-info"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(
            "llama_cpp/__init__.py",
            "__version__ = '0.0.1'\n"
            "def llama_supports_gpu_offload():\n    return True\n"
            "def llama_print_system_info():\n    return b'CUDA : ARCHS = 900 | CPU : AVX2 = 1 | '\n",
        )
        zf.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: llama_cpp_python\nVersion: 0.0.1\n")
        zf.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        zf.writestr(
            f"{info}/RECORD", f"llama_cpp/__init__.py,,\n{info}/METADATA,,\n{info}/WHEEL,,\n{info}/RECORD,,\n"
        )
    return wheel


@pytest.mark.parametrize("how", ["--wheels", "KIT_WHEELS"])
def test_wheels_install_llama_cpp_for_the_offload_check(
    kit: Path, scratch: Path, libcuda: Path, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The plumbing: the wheel in the folder reaches the appliance's Python, whose startup probe
    # then finds a llama.cpp that can offload; the check goes as far as the model it lacks.
    folder = scratch / f"wheels-{how}"
    fake_llama_wheel(folder)
    extra = ["--wheels", str(folder)] if how == "--wheels" else []
    if how == "KIT_WHEELS":
        monkeypatch.setenv("KIT_WHEELS", str(folder))  # run_kit passes os.environ on
    rc, report, _ = run_kit(
        kit,
        scratch,
        libcuda,
        f"wheels-{how}",
        "--only",
        "llama_offload",
        *extra,
        venv=scratch / "venv-wheels",
    )
    check = {c["name"]: c for c in report["checks"]}["llama_offload"]
    assert check["status"] == "SKIP", check
    assert f"installed from --wheels {folder}" in check["detail"] and "hardware-only" in check["detail"], (
        check
    )
    assert check["data"]["version"] == "0.0.1" and check["data"]["gpu_offload"] is True
    assert rc == 0


def test_without_a_cuda_llama_cpp_the_offload_skip_says_what_is_missing_and_how_to_supply_it(
    kit: Path, scratch: Path, libcuda: Path
) -> None:
    empty = scratch / "wheels-empty"
    empty.mkdir()
    rc, report, _ = run_kit(
        kit, scratch, libcuda, "wheels-empty", "--only", "llama_offload", "--wheels", str(empty)
    )
    check = {c["name"]: c for c in report["checks"]}["llama_offload"]
    assert check["status"] == "SKIP", check
    detail = check["detail"]
    assert "llama-cpp-python does not import in the appliance's Python" in detail, detail
    assert (
        "No module named 'llama_cpp'" in detail
        and f"--wheels {empty} holds no llama_cpp_python-*.whl" in detail
    )
    assert 'CMAKE_ARGS="-DGGML_CUDA=on"' in detail and "--wheels DIR (or KIT_WHEELS=DIR)" in detail
    assert rc == 0


def test_device_minors_come_from_the_drivers_information_files(tmp_path: Path) -> None:
    # nvidia-smi's index follows PCI order; /dev/nvidia<minor> follows the driver's minor.
    from benchmarks.gpu_acceptance import device_minors

    for bus, uuid, minor in (("0000:c1:00.0", "GPU-aaaa", 0), ("0000:41:00.0", "GPU-bbbb", 1)):
        (tmp_path / bus).mkdir()
        (tmp_path / bus / "information").write_text(
            f"Model: \t\t NVIDIA H200\nIRQ:   \t\t 42\nGPU UUID: \t {uuid}\nVideo BIOS: \t 96.00.9f.00.01\n"
            f"Bus Location: \t {bus}\nDevice Minor: \t {minor}\nGPU Excluded:\t No\n"
        )
    (tmp_path / "0000:01:00.0").mkdir()
    (tmp_path / "0000:01:00.0" / "information").write_text("Model: unreadable\n")
    assert device_minors(tmp_path) == {"GPU-aaaa": 0, "GPU-bbbb": 1}


def test_the_simulated_gpu_charges_each_context_and_a_full_device_refuses_one(
    scratch: Path, libcuda: Path
) -> None:
    # As NVML counts a real context: memory of its own before any allocation; and a device
    # without room for one fails the context with CUDA error 2 (out of memory).
    from benchmarks.gpu_acceptance import SimulatedGpuMemory

    control = scratch / "ctl-context.json"
    memory = SimulatedGpuMemory(libcuda, control, 1000, free_delay_s=0, context_mb=400)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        assert hold_contexts(libcuda, scratch, 3, procs) == [0, 0, 2]
        listed = json.loads(control.read_text())["processes"]
        assert sorted(p["used_mb"] for p in listed) == [400, 400], listed
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        memory.close()


def test_the_kit_knows_a_tmpfs_where_it_would_put_the_mapped_file() -> None:
    # A mapped tmpfs file is shared memory, which the watchdog counts: host_memory's file must
    # be on a real filesystem, so the kit asks which one its folder is on.
    from benchmarks.gpu_acceptance import filesystem_of

    assert filesystem_of(Path("/dev/shm")) == "tmpfs"
    assert filesystem_of(Path("/dev/shm/not-there")) == "tmpfs"  # the longest mount point wins over /dev
    assert filesystem_of(Path("/proc/self")) == "proc"
    assert filesystem_of(Path("/")) not in ("", "tmpfs", "proc")
