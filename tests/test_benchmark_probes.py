"""The benchmarks beside the suite (GPU MPS contention, inference, cgroups) and the probes
(phases, hot path): each runs end to end against real servers and writes sane outputs.
Fails on errors, never on the figures themselves. tests/test_benchmarks.py runs the suite
itself (and the uid and egress benchmarks)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.hotpath import CPUACCT
from tests.support import REPO, scaled

# Needs root, firejail or a real server: never in the fast tier (tests/tiers.py); not
# exclusive, as tests/test_benchmarks.py says why.
pytestmark = pytest.mark.host

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.timeout(int(scaled(300)))
def test_mps_contention_benchmark_contains_a_runaway_by_kill_without_mps_and_by_refusal_with_it(
    tmp_path: Path,
) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_mps_contention", "--quick", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=scaled(240),
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    results = json.loads((tmp_path / "gpu_mps_contention_simulated_quick.json").read_text())
    runaway = {
        config: [r["outcome"] for r in runs if r["kind"] == "llama-runaway"]
        for config, runs in results["runs"].items()
    }
    assert runaway == {"watchdog only": ["gpu_memory_limit"], "watchdog + MPS": ["budget_refused"]}
    assert (tmp_path / "gpu_mps_contention_simulated_quick.png").read_bytes()[:8] == PNG_MAGIC
    assert any(
        line.startswith("GPU run time p50") and line.endswith("x") for line in proc.stdout.splitlines()
    ), "the side-by-side ratio is printed"


@pytest.mark.slow
def test_the_inference_benchmark_runs_end_to_end_and_reports_its_ratios(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.inference", "--quick", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=scaled(600),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((tmp_path / "inference_quick.json").read_text())
    s = doc["summary"]
    assert (
        s["session_speedup"] > 0 and s["tokens_per_s"]["jail_p50"] > 0 and s["tokens_per_s"]["host_p50"] > 0
    )
    assert s["whisper_rtf"]["jail_p50"] > 0 and s["whisper_rtf"]["host_p50"] > 0
    assert s["tokens_per_run"] == 16, "every generation ran its full count (EOS held off)"
    assert len(doc["jail"]["session"]) == doc["reps"] and len(doc["host"]["llm"]) == doc["reps"]
    md = (tmp_path / "inference_quick.md").read_text()
    assert "session speed-up" in md and "jail overhead, tokens/s" in md
    assert (tmp_path / "inference_quick.png").read_bytes().startswith(PNG_MAGIC)


def test_the_cgroup_benchmark_measures_spawn_with_and_without_side_by_side(tmp_path: Path) -> None:
    from appliance.sandbox import cgroups

    if cgroups.detect()[0] is None:
        pytest.skip("no writable cgroup hierarchy here")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.cgroups", "--quick", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=scaled(300),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((tmp_path / "cgroups_quick.json").read_text())
    s = doc["summary"]
    assert s["spawn_with"]["n"] == s["spawn_without"]["n"] == 2
    assert s["warm_with"]["n"] == s["warm_without"]["n"] == 3
    assert all(
        s[k]["p50_ms"] > 0
        for k in ("spawn_with", "spawn_without", "group_life", "handout", "cell", "warm_with", "warm_without")
    )
    assert isinstance(doc["within_target"], bool) and doc["target_ms"] == 5.0
    assert "with cgroup" in (tmp_path / "cgroups_quick.md").read_text()


def test_the_phase_probe_marks_a_real_servers_run_path(tmp_path: Path) -> None:
    out, scratch = tmp_path / "phases.md", tmp_path / "scratch"
    scratch.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.phases", "--runs", "4", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=scaled(300),
        env={**os.environ, "TMPDIR": str(scratch)},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert not list(scratch.iterdir()), "the probe left its work directory behind"
    report = out.read_text()
    rows = [line for line in report.splitlines() if line.startswith("| ") and "`" in line]
    marks = [row.split("`")[1] for row in rows if row.split("|")[1].strip().isdigit()]
    # The marks of one warm one-shot run, in the order the server passes them.
    # A print(2+2)'s memfds are bounded by its group's shmem: no search for held files.
    expected = ["frame read", "parse>", "execute>", "pool take>", "op write>", "disk check>", "memfd bound>"]
    positions = [marks.index(m) for m in expected]
    assert positions == sorted(positions), marks
    assert "held files>" not in marks, marks
    assert "**frame read** | **`done` sent**" in report and "Round trip seen by the client" in report


def tables(report: str) -> list[list[list[str]]]:
    """The markdown tables of a report, each a list of rows of cells (header and rule first)."""
    found: list[list[list[str]]] = []
    previous = ""
    for line in report.splitlines():
        if line.startswith("| "):
            if not previous.startswith("| "):
                found.append([])
            found[-1].append(line.split("|")[1:-1])
        previous = line
    return found


def test_the_hot_path_probe_measures_the_appliance_beside_the_floor(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.hotpath", "--runs", "3", "--floor"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=scaled(300),
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = tables(proc.stdout)[0]
    data = {cells[0].strip(): cells[1:] for cells in rows[2:]}  # past the header and its rule
    assert list(data) == [REPO.name, "floor"], proc.stdout
    ratios = tables(proc.stdout)[1]  # the floor's to the appliance's, each inside its interval
    assert [cells[0].strip() for cells in ratios[2:]] == ["floor"], proc.stdout
    for cell in ratios[2][1:]:
        ratio, low, high = (float(x) for x in cell.replace("[", "").replace("]", "").replace(",", "").split())
        assert low <= ratio <= high, proc.stdout
    for name, cells in data.items():
        runs, wall_p50 = int(cells[0]), float(cells[1])
        server_cpu_p50 = float(cells[3].split("/")[0])
        # Every run answered (hotpath raises on a wrong answer); each took time and CPU.
        assert runs == 3 and wall_p50 > 0 and server_cpu_p50 > 0, (name, cells)


def test_the_hot_path_probe_measures_one_shot_throughput_and_writes_its_samples(tmp_path: Path) -> None:
    out = tmp_path / "samples.json"
    # Windows of 2 s: on a loaded machine a fresh jail's spawn alone can take most of a second.
    args = ["--runs", "2", "--throughput", "2", "--rounds", "2", "--window", "2", "--json", str(out)]
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.hotpath", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=scaled(300),
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    throughput = tables(proc.stdout)[-1]
    assert "runs/s at 2 clients" in throughput[0][2], proc.stdout
    name, windows, rate, ratio = (cell.strip() for cell in throughput[2])
    assert (name, windows, ratio) == (REPO.name, "2", "1.000 [1.000, 1.000]"), proc.stdout
    assert float(rate.split("/")[0]) > 0, proc.stdout  # runs finished inside the windows
    samples = json.loads(out.read_text())[REPO.name]
    assert len(samples["wall_ms"]) == 2 and len(samples["runs_per_s"]) == 2, samples


def test_a_terminated_probe_stops_its_servers_and_removes_its_groups(tmp_path: Path) -> None:
    # `timeout` and a cancelled CI job send SIGTERM: the probe must not leave its servers
    # (and their pools of jails) running, nor its cgroups behind.
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.hotpath", "--runs", "100000"],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    group = CPUACCT / f"appliance-hotpath-{proc.pid}-{REPO.name}"
    try:
        deadline = time.monotonic() + scaled(120)
        members: list[str] = []
        while len(members) < 3:  # the server and jails of its pool: it is probing
            assert proc.poll() is None and time.monotonic() < deadline, "the probe did not start"
            time.sleep(0.2)
            with contextlib.suppress(OSError):
                members = (group / "cgroup.procs").read_text().split()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(scaled(60)) == 128 + signal.SIGTERM, proc.stderr.read() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not group.exists(), "the probe's cgroup was left behind"
    deadline = time.monotonic() + scaled(10)
    while (left := [pid for pid in members if Path(f"/proc/{pid}").exists()]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, "the probe's server or its jails were left running"
