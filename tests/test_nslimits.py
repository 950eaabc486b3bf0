"""Per-jail caps on the counts a jail's user namespace charges to root (appliance.sandbox.nslimits)."""

from __future__ import annotations

from pathlib import Path

from appliance.sandbox import nslimits


def test_the_host_is_raised_only_below_every_jail_at_its_cap_and_its_own_share() -> None:
    found = {"max_inotify_instances": 128, "max_inotify_watches": 10**7, "max_fanotify_groups": 128}
    plan = nslimits.plan_host(found, jails=64)
    assert plan == {"max_inotify_instances": 64 * 16 + 128, "max_fanotify_groups": 64 * 4 + 128}


def test_raising_writes_the_limits_and_says_what_it_could_not(tmp_path: Path) -> None:
    files = {name: tmp_path / name for name in nslimits.JAIL_CAPS}
    for path in files.values():
        path.write_text("1\n")
    files["max_fanotify_marks"].unlink()  # e.g. a kernel without fanotify
    problems = nslimits.raise_host(2, files)
    assert files["max_inotify_instances"].read_text() == str(2 * 16 + 128)
    assert len(problems) == 1 and "max_fanotify_marks" in problems[0], problems
