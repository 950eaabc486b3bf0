"""The trainer benchmark's arithmetic (benchmarks.trainer): what it calls lost and run twice,
and its targets reported met or missed, never raised."""

from __future__ import annotations

from benchmarks.trainer import Level, targets


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
