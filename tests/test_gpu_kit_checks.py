"""Each acceptance-kit check can FAIL: run against simulated devices made to break what it checks.

benchmarks/gpu_acceptance.py straight from the checkout (tests/test_gpu_kit.py runs the packaged
kit; the checks are the same file), one real appliance per run, real jails, the stand-in libcuda
and nvidia-smi. A check that passes whatever the appliance does proves nothing, so every
test here breaks one thing and asserts that the check names it: NVML listing processes without
their memory (`context`, `contention.overrun_race`), a host-memory cap that never reads
(`host_memory`), a server whose devices are not the host's (`readyz`, `contention`), a host
the appliance refuses (`preflight.*`, `server`), a jail's node that is not its GPU's
(`jail.device_nodes`, over stand-in nodes in a private /dev).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import REPO, scaled

# Runs the acceptance kit's checks against real servers: never in the fast tier (tests/tiers.py).
pytestmark = [pytest.mark.slow, pytest.mark.host]


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="appliance-kit-checks-", dir="/tmp"))
    os.chmod(root, 0o755)  # the sandbox uid loads the stand-in libcuda from here
    yield root
    shutil.rmtree(root, ignore_errors=True)


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


def run_checks(
    scratch: Path,
    libcuda: Path,
    name: str,
    *args: str,
    smi: dict[str, Any] | None = None,
    wrap: list[str] | None = None,
) -> dict[str, dict[str, Any]]:
    """The kit's checks in simulation; name -> the check's result (status, detail, data).

    smi: the stand-in nvidia-smi's state (driver version, MIG, compute modes); wrap: a command
    the kit runs under (a private /dev with stand-in nodes)."""
    out = scratch / f"report-{name}"
    if smi is not None:
        (scratch / f"smi-{name}.json").write_text(json.dumps(smi))
    proc = subprocess.run(
        [
            *(wrap or []),
            sys.executable,
            "-m",
            "benchmarks.gpu_acceptance",
            "--simulate",
            "--out",
            str(out),
            "--libcuda",
            str(libcuda),
            "--nvidia-smi",
            str(REPO / "tests" / "stub_nvidia_smi.py"),
            "--tmp",
            str(scratch),
            "--driver-info",
            str(scratch / "no-driver-info"),
            *args,
        ],
        cwd=REPO,
        env={**os.environ, "STUB_SMI_STATE": str(scratch / f"smi-{name}.json")},
        capture_output=True,
        text=True,
        timeout=scaled(600),
    )
    report = out / "gpu-acceptance.json"
    assert report.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    checks = {c["name"]: c for c in json.loads(report.read_text())["checks"]}
    for check in checks.values():
        print(f"[{check['status']}] {check['name']}: {check['detail']}")
    assert proc.returncode == (1 if any(c["status"] == "FAIL" for c in checks.values()) else 0)
    return checks


def test_context_and_the_overrun_race_fail_where_nvml_lists_the_runs_processes_without_their_memory(
    scratch: Path, libcuda: Path
) -> None:
    # best-effort, so runs are not stopped for it: the context probe ends ok, the device's used
    # memory grew by the context and the allocation, and only the per-process reading, the
    # watchdog's, is missing; the overrunners of the contention mix are then never stopped.
    checks = run_checks(
        scratch,
        libcuda,
        "unavailable",
        "--only",
        "contention.overrun_race",
        "--sim-usage-unavailable",
        "--server-env",
        "SANDBOX_GPU_ENFORCE=best-effort",
        "--context-mb",
        "400",
    )
    context = checks["context"]
    assert context["status"] == "FAIL", context
    assert "without their memory" in context["detail"] and context["data"]["unavailable_pids"], context
    assert context["data"]["device_delta_mb"] >= 400, context  # the device saw it all the same
    race = checks["contention.overrun_race"]
    assert race["status"] == "FAIL" and "were not stopped by the watchdog" in race["detail"], race


@pytest.mark.parametrize(("poll_ms", "expect"), [("100", "PASS"), ("3600000", "FAIL")])
def test_host_memory_fails_when_the_cap_never_reads(
    scratch: Path, libcuda: Path, poll_ms: str, expect: str
) -> None:
    # Without per-run cgroups the cap is the watchdog's reading alone; a poll an hour apart never
    # reads it (what a reading that is always 0 does too). The mapped file passes either way: the
    # run owning more than the cap is what tells them apart.
    checks = run_checks(
        scratch,
        libcuda,
        f"host-memory-{poll_ms}",
        "--only",
        "host_memory",
        "--context-mb",
        "400",
        "--server-env",
        "SANDBOX_CGROUPS=off",
        "--server-env",
        f"SANDBOX_GPU_POLL_MS={poll_ms}",
    )
    check = checks["host_memory"]
    assert check["status"] == expect, check
    if expect == "FAIL":
        assert check["data"]["status"] == "ok" and check["data"]["owned_status"] == "ok", check
        assert "the host-memory cap did not hold" in check["detail"], check
    else:
        assert check["data"]["owned_status"] == "memory_limit", check


def driver_info(folder: Path, uuid: str) -> Path:
    (folder / "0000:c1:00.0").mkdir(parents=True)
    (folder / "0000:c1:00.0" / "information").write_text(
        f"Model: \t\t NVIDIA H200\nGPU UUID: \t {uuid}\nDevice Minor: \t 0\n"
    )
    return folder


def test_context_measures_what_the_watchdog_reads_and_readyz_agrees_with_the_driver(
    scratch: Path, libcuda: Path
) -> None:
    from benchmarks.gpu_acceptance import SIM_CONTEXT_JITTER_MB, SIM_CONTEXT_MB

    info = driver_info(scratch / "driver-same", "GPU-SIM-0")
    checks = run_checks(scratch, libcuda, "context", "--only", "readyz", "--driver-info", str(info))
    context = checks["context"]
    assert context["status"] == "PASS", context
    assert SIM_CONTEXT_MB <= context["data"]["context_mb"] <= SIM_CONTEXT_MB + SIM_CONTEXT_JITTER_MB, context
    assert context["data"]["context_mb"] == context["data"]["per_process_mb"] - 64
    readyz = checks["readyz"]
    assert readyz["status"] == "PASS" and f"as nvidia-smi and {info}" in readyz["detail"], readyz


@pytest.mark.parametrize(
    ("case", "args", "words"),
    [
        ("other-total", ("--server-env", "SANDBOX_GPU_SIMULATE=8192"), "differ from nvidia-smi's"),
        (
            "other-uuid",
            ("--driver-info", "DRIVER:GPU-12345678-aaaa-bbbb-cccc-1234567890ab"),
            "differ from the driver's",
        ),
    ],
)
def test_readyz_fails_where_sources_the_server_does_not_read_disagree(
    scratch: Path, libcuda: Path, case: str, args: tuple[str, ...], words: str
) -> None:
    resolved = [
        str(driver_info(scratch / f"driver-{case}", a.split(":", 1)[1])) if a.startswith("DRIVER:") else a
        for a in args
    ]
    check = run_checks(
        scratch, libcuda, f"readyz-{case}", "--only", "readyz", "--context-mb", "400", *resolved
    )["readyz"]
    assert check["status"] == "FAIL" and words in check["detail"], check


def test_preflight_fails_on_a_host_the_appliance_refuses(scratch: Path, libcuda: Path) -> None:
    # A host with all three: each check names its own cause and fix.
    smi = {"driver": "535.54.03", "mig": {"0": "Enabled"}, "compute_mode": {"0": "Exclusive_Process"}}
    checks = run_checks(scratch, libcuda, "preflight", "--only", "preflight", "--context-mb", "400", smi=smi)
    for check, words in (
        ("preflight.driver", "older than 550"),
        ("preflight.mig", "nvidia-smi -i N -mig 0"),
        ("preflight.compute_mode", "nvidia-smi -i 0 -c DEFAULT"),
    ):
        assert checks[check]["status"] == "FAIL" and words in checks[check]["detail"], checks[check]


def test_server_fails_when_the_appliance_does_not_start_and_every_later_check_says_so(
    scratch: Path, libcuda: Path
) -> None:
    checks = run_checks(
        scratch, libcuda, "no-server", "--only", "readyz", "--server-env", "SANDBOX_GPU_SIMULATE=lots"
    )
    assert checks["server"]["status"] == "FAIL" and "SANDBOX_GPU_SIMULATE" in checks["server"]["detail"], (
        checks
    )
    assert checks["readyz"]["status"] == "FAIL" and "did not start" in checks["readyz"]["detail"], checks


def test_contention_fails_when_the_server_admits_more_than_the_device_has(
    scratch: Path, libcuda: Path
) -> None:
    # The server believes its GPU twice as large as the host's: admission backs grants with
    # memory the device does not have, and runs within their grants run out of it.
    checks = run_checks(
        scratch,
        libcuda,
        "oversubscribed",
        "--only",
        "contention",
        "--context-mb",
        "400",
        "--server-env",
        "SANDBOX_GPU_SIMULATE=32768",
    )
    contention = checks["contention"]
    assert contention["status"] == "FAIL" and "oom" in contention["detail"], contention


@pytest.mark.parametrize(("minor", "expect"), [(0, "PASS"), (1, "FAIL")])
def test_device_nodes_runs_over_stand_in_nodes_and_fails_on_a_node_that_is_not_the_gpus(
    scratch: Path, libcuda: Path, tmp_path: Path, minor: int, expect: str
) -> None:
    # A private /dev with stand-in nodes (nvidia0-11, nvidiactl, nvidia-uvm, ...): the check that
    # only hardware could run. The driver's information files say which node is the GPU's; with
    # them naming minor 1 the jail's nvidia0 is the wrong node.
    from tests.test_gpu_jail_nodes import wrap

    info = scratch / f"driver-minor-{minor}" / "0000:c1:00.0"
    info.mkdir(parents=True)
    (info / "information").write_text(f"GPU UUID: \t GPU-SIM-0\nDevice Minor: \t {minor}\n")
    checks = run_checks(
        scratch,
        libcuda,
        f"nodes-{minor}",
        "--only",
        "jail.device_nodes",
        "--context-mb",
        "400",
        "--driver-info",
        str(info.parent),
        wrap=wrap(tmp_path),
    )
    nodes = checks["jail.device_nodes"]
    assert nodes["status"] == expect, nodes
    assert {n for n, kind in nodes["data"]["jail"].items() if kind == "char"} == {
        "nvidiactl",
        "nvidia-uvm",
        "nvidia0",
    }


def test_context_and_the_watchdog_fail_where_nvml_names_pids_of_another_namespace(
    scratch: Path, libcuda: Path
) -> None:
    # A driver that does not translate PIDs into the caller's namespace (older ones, for a server
    # in a container): the memory is listed, under IDs that are no process of the server's. The
    # device's total grows all the same; only matching the IDs to the run shows the watchdog blind.
    checks = run_checks(
        scratch,
        libcuda,
        "other-namespace",
        "--only",
        "watchdog.main_thread",
        "--context-mb",
        "400",
        "--sim-pid-offset",
        str(1 << 22),
        "--overrun-hold-s",  # the blind watchdog never stops the hog: its hold is the wait
        "5",
    )
    context = checks["context"]
    assert context["status"] == "FAIL" and "no process of the server's" in context["detail"], context
    assert context["data"]["unmatched_pids"], context
    watchdog = checks["watchdog.main_thread"]
    assert watchdog["status"] == "FAIL" and "not gpu_memory_limit" in watchdog["detail"], watchdog
