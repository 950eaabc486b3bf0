"""Per-jail caps on the counts a jail's user namespace charges to root (appliance.sandbox.nslimits)."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

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


@pytest.fixture
def user_namespace() -> Iterator[int]:
    """A process in a user namespace of its own (made by root, as firejail makes a jail's)."""
    if os.geteuid() != 0:
        pytest.skip("only root makes a namespace owned by root and may join it")
    proc = subprocess.Popen(["unshare", "--user", "sleep", "300"])
    try:
        while os.stat(f"/proc/{proc.pid}/ns/user").st_ino == os.stat("/proc/self/ns/user").st_ino:
            time.sleep(0.005)  # until unshare has made the namespace
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def _limits_in(pid: int | None) -> dict[str, int]:
    """The caps of `pid`'s user namespace (read from inside it), or of this process's (None)."""
    if pid is None:
        return {name: int(Path("/proc/sys/user", name).read_text()) for name in nslimits.JAIL_CAPS}
    script = 'for n in "$@"; do printf "%s=%s\\n" "$n" "$(cat /proc/sys/user/$n)"; done'
    argv = ["nsenter", f"--user=/proc/{pid}/ns/user", "--preserve-credentials", "sh", "-c", script, "sh"]
    out = subprocess.run([*argv, *nslimits.JAIL_CAPS], capture_output=True, text=True, check=True).stdout
    return {name: int(value) for name, value in (line.split("=") for line in out.splitlines())}


@pytest.mark.host
@pytest.mark.parametrize("helper", ["perl", "python"])
async def test_the_helper_caps_the_jails_namespace_and_not_the_servers(
    helper: str, user_namespace: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    if helper == "perl" and not nslimits.writer_argv(0)[0].endswith("perl"):
        pytest.fail("perl is installed on every Debian (perl-base), and this machine's setns is known")
    if helper == "python":
        monkeypatch.setattr(nslimits, "_perl", lambda: "")
    host = _limits_in(None)
    assert await nslimits.cap_jail(user_namespace) is None
    assert _limits_in(user_namespace) == nslimits.JAIL_CAPS
    assert _limits_in(None) == host
