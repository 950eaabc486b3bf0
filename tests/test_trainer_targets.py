"""The trainer benchmark's arithmetic (benchmarks.trainer): what it calls lost and run twice,
and its targets reported met or missed, never raised."""

from __future__ import annotations

from benchmarks.trainer import Level, sliced_summary, targets


def level(clients: int, seconds: float, answered_ok: int, counted_ok: int, **kw: object) -> dict[str, object]:
    lv = Level(clients, "/run_code", programs=answered_ok, seconds=seconds)
    lv.latencies_ms = [100.0] * answered_ok
    lv.counted_ok = counted_ok
    for name, value in kw.items():
        setattr(lv, name, value)
    return lv.summary(spawns_per_s=10.0)


def test_a_run_counted_by_the_server_but_not_answered_is_a_run_twice() -> None:
    summary = level(16, 10.0, 100, 101)
    assert summary["ran_twice"] == 1 and summary["runs_per_s"] == 10.0
    assert summary["share_of_spawn_capacity"] == 1.0


def test_targets_are_met_or_missed_by_the_figures() -> None:
    met = targets([level(64, 10.0, 95, 95), level(256, 1.0, 300, 300)])
    assert [v for _, _, v in met] == ["MET", "MET", "MET"]
    slow = dict(latencies_ms=[100.0] * 299 + [9000.0, 9000.0, 9000.0, 9000.0])
    missed = targets([level(64, 10.0, 50, 50), level(256, 10.0, 300, 300, lost=2, **slow)])
    assert [v for _, _, v in missed] == ["MISSED", "MISSED", "MISSED"]


def test_a_levels_share_is_the_median_of_its_slices_each_over_the_windows_around_it() -> None:
    """Capacity moves between windows: each slice is divided by the mean of the two windows
    around it (strict: the higher), not by one window taken before every level."""
    parts = []
    for runs_per_s in (9.0, 10.0, 11.0):
        part = Level(64, "/run_code", programs=int(runs_per_s * 10), seconds=11.0)
        part.latencies_ms = [100.0] * part.programs
        part.counted_ok = part.programs
        # answers 1/runs_per_s apart after a second of ramp-up: the sustained rate is runs_per_s
        part.done_at = [1.0 + i / runs_per_s for i in range(part.programs)]
        parts.append(part)
    summary = sliced_summary(parts, [10.0, 12.0, 10.0, 12.0])
    assert summary["programs"] == 300 and summary["seconds"] == 33.0 and summary["runs_per_s"] == 9.09
    assert [r["share"] for r in summary["slices"]] == [0.818, 0.909, 1.0]
    assert summary["share_of_spawn_capacity"] == 0.909
    assert summary["share_strict"] == 0.833
    assert summary["lost"] == 0 and summary["ran_twice"] == 0
    # The ramp-up is left out of a slice's rate, as `spawn_capacity` leaves it out of its own.
    assert [r["sustained_runs_per_s"] for r in summary["slices"]] == [9.0, 10.0, 11.0]
