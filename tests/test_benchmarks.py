"""The benchmark suite: `python -m benchmarks --quick` runs end to end against real servers,
real jails and a real Jupyter Kernel Gateway, and writes sane outputs. Fails on errors,
never on the figures themselves (the targets are PASS/MISS lines in the report)."""

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

from benchmarks import report
from benchmarks.hotpath import CPUACCT
from tests.support import REPO, scaled

# Needs root, firejail or a real server: never in the fast tier (tests/tiers.py). These tests
# prove each benchmark runs end to end and writes sane outputs, never its figures (what
# they compare is warm against a cold spawn, orders of magnitude apart), so they share the
# host with the other workers' tests: taking it alone (tests/exclusive.py) stopped the
# whole suite for minutes. The report's pure parts are unit tests beside them
# (tests/test_benchmark_units.py).
pytestmark = pytest.mark.host

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_appliance_bench_hands_its_arguments_to_the_suite() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "appliance", "bench", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "--quick" in proc.stdout and "python -m benchmarks" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(int(scaled(900)))
def test_quick_benchmark_runs_end_to_end_and_writes_sane_outputs(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--no-progress", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=scaled(840),
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    for name in ("bench_quick.json", "bench_quick.md", "bench_quick.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert (tmp_path / "bench_quick.png").read_bytes()[:8] == PNG_MAGIC

    results = json.loads((tmp_path / "bench_quick.json").read_text())
    latency = results["latency"]
    assert set(latency) == {"print", "pandas", "matplotlib", "session"}
    assert set(latency["print"]) == {report.WARM, report.COLD, report.NAIVE, report.JUPYTER}
    assert set(latency["pandas"]) == {report.WARM, report.COLD, report.NAIVE, report.JUPYTER}
    assert set(latency["matplotlib"]) == {report.WARM, report.COLD}
    assert set(latency["session"]) == {report.SESSION, report.JUPYTER}
    for scenario, by_target in latency.items():
        for target, s in by_target.items():
            assert s["n"] >= 3, (scenario, target)
            assert 0 < s["p50_ms"] <= s["p90_ms"] <= s["p99_ms"], (scenario, target, s)
    # A warm jail skips the spawn and the imports a cold one pays for: even on a busy machine
    # it is faster, and a cell that imports pandas is slower in a brand-new process.
    for scenario in ("print", "pandas", "matplotlib"):
        assert latency[scenario][report.WARM]["p50_ms"] < latency[scenario][report.COLD]["p50_ms"], scenario
    assert latency["pandas"][report.WARM]["p50_ms"] < latency["pandas"][report.NAIVE]["p50_ms"]

    assert results["jupyter_nodelay"]["client"] is True
    assert results["jupyter_nodelay"]["server"] is True
    tp = results["throughput"]
    assert tp["spawn_capacity"]["spawns_per_s"] > 0
    assert [lvl["clients"] for lvl in tp["levels"]] == [1, 2, 4, 8, 16]
    assert all(lvl["runs_per_s"] >= 0 and lvl["p50_ms"] > 0 for lvl in tp["levels"])
    assert any(lvl["runs_per_s"] > 0 for lvl in tp["levels"])
    memory = results["memory"]
    assert memory["pss_mb_proc"] and all(v > 1 for v in memory["pss_mb_proc"])
    assert memory["pss_mb_per_warm_jail"] > 1

    ev = results["eval"]
    assert ev["default"]["programs"] == ev["no_preload"]["programs"] > 0
    assert ev["ratio"] == pytest.approx(
        ev["default"]["runs_per_s"] / ev["no_preload"]["runs_per_s"], rel=0.01
    )
    flags = results["flags"]
    assert set(flags) == {
        "all flags",
        "without --private-etc",
        "without --deterministic-shutdown",
        "without --seccomp",
    }
    assert all(c["wall_ms"] > 0 and c["cpu_ms"] >= 0 for c in flags.values())

    verdicts = {t["verdict"] for t in results["targets"]}
    assert verdicts <= {"PASS", "MISS"} and len(results["targets"]) == 7
    table = (tmp_path / "bench_quick.md").read_text()
    assert "| appliance, warm pool |" in table and "## Targets (issues 4 and 18)" in table
    assert "## Import-light eval load (issue 18)" in table
    assert "targets (issues 4 and 18):" in proc.stdout


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
    expected = ["frame read", "parse>", "execute>", "pool take>", "op write>", "disk check>", "held files>"]
    positions = [marks.index(m) for m in expected]
    assert positions == sorted(positions), marks
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
    args = ["--runs", "2", "--throughput", "2", "--rounds", "2", "--window", "1", "--json", str(out)]
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


def test_the_uid_benchmark_measures_spawn_shared_and_own_side_by_side(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.uids", "--quick", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=scaled(300),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((tmp_path / "uids_quick.json").read_text())
    s = doc["summary"]
    assert s["shared"]["n"] == s["own"]["n"] == 3 and s["cap"]["n"] == 6
    assert s["take"]["n"] == s["give_back"]["n"] == 10
    assert all(s[k]["p50_ms"] > 0 for k in ("shared", "own", "take", "give_back", "cap"))
    assert doc["spawn_ratio_p50"] > 0
    assert "a uid of its own" in (tmp_path / "uids_quick.md").read_text()


def test_the_egress_benchmark_measures_the_proxy_and_by_ip_side_by_side(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.egress", "--quick", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=scaled(300),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((tmp_path / "egress_quick.json").read_text())
    s = doc["summary"]
    for side in ("proxy", "direct"):
        assert s[side]["n_big"] == 6 and s[side]["n_runs"] == 2
        assert (
            s[side]["http_mib_p50_ms"] > 0
            and s[side]["https_mib_p50_ms"] > 0
            and s[side]["small_100_p50_ms"] > 0
        )
    assert all(r > 0 for r in s["ratios"].values())
    assert s["relay"]["small_cpu_ms_per_flow"] > 0 and s["relay"]["small_flows"] == 2 * 2 * 60
    (link,) = s["links"]  # the same rounds over the shaped link (quick: its last rate only)
    assert link["rate_mbit"] == 100 and link["qdisc"].startswith("tbf rate 100mbit")
    for side in ("proxy", "direct"):
        assert link[side]["n_big"] == 6 and link[side]["n_runs"] == 2
    # Every download of both sides crossed the shaper: 2 sides x 2 runs x (3 + 3) MiB at least.
    assert link["shaper"]["bytes"] >= 2 * 2 * 6 * (1 << 20), link["shaper"]
    assert all(r > 0 for r in link["ratios"].values())
    assert "Over a modelled link" in (tmp_path / "egress_quick.md").read_text()
    assert "through the proxy" in (tmp_path / "egress_quick.md").read_text()
    assert "CPU per small flow" in (tmp_path / "egress_quick.md").read_text()
