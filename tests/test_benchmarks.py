"""The benchmark suite: `python -m benchmarks --quick` runs end to end against real servers,
real jails and a real Jupyter Kernel Gateway, and writes sane outputs; so do the uid and
egress benchmarks. Fails on errors, never on the figures themselves (the targets are
PASS/MISS lines in the report). The other benchmarks and probes are in
tests/test_benchmark_probes.py, a module of its own so that pytest-xdist runs it beside this
one. The suite goes first and short tests after it: pytest-xdist hands a worker its next
module once two tests of the current one are left, and that module would wait behind it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import report
from tests.support import REPO, scaled

# Needs root, firejail or a real server: never in the fast tier (tests/tiers.py). These tests
# prove each benchmark runs end to end and writes sane outputs, never its figures (what
# they compare is warm against a cold spawn, orders of magnitude apart), so they share the
# host with the other workers' tests: taking it alone (tests/exclusive.py) stopped the
# whole suite for minutes. The report's pure parts are unit tests beside them
# (tests/test_benchmark_units.py).
pytestmark = pytest.mark.host

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


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
    for side in ("proxy", "direct", "floor"):  # the floor: by IP through floor_relay.c in a namespace
        assert s[side]["n_big"] == 6 and s[side]["n_runs"] == 2
        assert (
            s[side]["http_mib_p50_ms"] > 0
            and s[side]["https_mib_p50_ms"] > 0
            and s[side]["small_100_p50_ms"] > 0
        )
    assert all(r > 0 for r in s["ratios"].values()) and all(r > 0 for r in s["floor_ratios"].values())
    assert "| floor relay, by IP | floor / by IP |" in (tmp_path / "egress_quick.md").read_text()
    assert s["relay"]["small_cpu_ms_per_flow"] > 0 and s["relay"]["small_flows"] == 2 * 2 * 60
    # The relay alone over HTTPS too (a CONNECT tunnel: spliced, and by the stream loop).
    assert all(s["relay"]["https"][mode] > 0 for mode in ("direct", "splice", "stream"))
    # The floor relay (benchmarks/floor_relay.c: gcc is part of the suite's setup) beside them.
    assert s["relay"]["floor"] > 0 and s["relay"]["https"]["floor"] > 0
    assert "| floor relay (C, splice) |" in (tmp_path / "egress_quick.md").read_text()
    assert "n/a (no cc)" not in (tmp_path / "egress_quick.md").read_text()
    # And again over the modelled link (the quick run's one rate).
    (shaped,) = s["links"]
    assert shaped["relay"]["floor"] > 0 and shaped["relay"]["https"]["splice"] > 0
    assert shaped["relay"]["small_cpu_ms_per_flow"] is None
    assert f"| {shaped['rate_mbit']} Mbit/s | HTTPS |" in (tmp_path / "egress_quick.md").read_text()
    cpu = s["relay"]["mib_cpu_ms_per_flow"]
    assert all(cpu[scheme][mode] > 0 for scheme in ("http", "https") for mode in ("splice", "stream"))
    assert "The same over HTTPS" in (tmp_path / "egress_quick.md").read_text()
    (link,) = s["links"]  # the same rounds over the shaped link (quick: its last rate only)
    assert link["rate_mbit"] == 100 and link["qdisc"].startswith("tbf rate 100mbit")
    for side in ("proxy", "direct", "floor"):
        assert link[side]["n_big"] == 6 and link[side]["n_runs"] == 2
    # Every download of the three sides crossed the shaper: 3 sides x 2 runs x (3 + 3) MiB at least.
    assert link["shaper"]["bytes"] >= 3 * 2 * 6 * (1 << 20), link["shaper"]
    assert "(the floor relay x" in (tmp_path / "egress_quick.md").read_text()
    assert all(r > 0 for r in link["ratios"].values())
    assert "Over a modelled link" in (tmp_path / "egress_quick.md").read_text()
    assert "through the proxy" in (tmp_path / "egress_quick.md").read_text()
    assert "CPU per small flow" in (tmp_path / "egress_quick.md").read_text()
