"""A run's tmpfs (appliance.sandbox.runfs): sizes and options (pure), mountinfo parsing, and a real
mount, resize and unmount where this process may mount (root)."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from appliance.sandbox import runfs
from appliance.sandbox.runfs import MIB, Sizes

# Needs root, firejail or a real server: never in the fast tier (tests/tiers.py).
pytestmark = pytest.mark.host


def test_sizes_leave_room_past_the_quota_for_the_servers_check() -> None:
    s = Sizes.of(50, 12800)
    assert s.bytes == 50 * MIB + runfs.SLACK_BYTES and s.inodes == 12800 + runfs.SLACK_INODES
    assert s.options() == f"size={s.bytes},nr_inodes={s.inodes}"
    assert s.options(1001, 1002).endswith(",mode=0700,uid=1001,gid=1002")


def test_mounts_under_lists_only_strictly_below_deepest_first() -> None:
    info = "\n".join(
        f"{i} 1 0:{i} / {point} rw - tmpfs t rw"
        for i, point in enumerate(
            ["/", "/r/srv", "/r/srv/a", "/r/srv/a/b", "/r/srvx/c", r"/r/srv/with\040space", "/r/srv/a"]
        )
    )
    found = runfs.mounts_under(Path("/r/srv"), info)
    assert found == [Path("/r/srv/a/b"), Path("/r/srv/with space"), Path("/r/srv/a")]


@pytest.fixture
def mount_point(tmp_path: Path) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("mounting needs root (the server's run tmpfs is a root server's)")
    point = tmp_path / "run"
    point.mkdir(mode=0o700)
    yield point
    runfs.unmount_under(tmp_path)


def _fill(step: Callable[[], int], times: int) -> tuple[int, int | None]:
    """Call step up to `times` times, summing what it returns; (sum, errno of the first OSError)."""
    total = 0
    for _ in range(times):
        try:
            total += step()
        except OSError as exc:
            return total, exc.errno
    return total, None


def test_a_run_tmpfs_refuses_writes_past_its_size_and_unmounts(mount_point: Path) -> None:
    runfs.mount_run(mount_point, Sizes(bytes=2 * MIB, inodes=16), 1001, 1001)
    st = os.stat(mount_point)
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (1001, 1001, 0o700)
    fd = os.open(mount_point / "big", os.O_CREAT | os.O_WRONLY, 0o600)
    os.unlink(mount_point / "big")  # no name: the filesystem still counts it, and refuses more
    try:
        written, error = _fill(lambda: os.write(fd, b"x" * MIB), 4)
    finally:
        os.close(fd)
    assert error == errno.ENOSPC and written <= 2 * MIB

    def touch() -> int:
        (mount_point / f"e{os.urandom(4).hex()}").touch()
        return 1

    made, error = _fill(touch, 32)
    assert error == errno.ENOSPC and made < 16
    assert runfs.mounts_under(mount_point.parent) == [mount_point]
    assert runfs.unmount(mount_point) is True
    assert runfs.unmount(mount_point) is False  # nothing mounted there any more
    assert runfs.mounts_under(mount_point.parent) == []


def test_resize_sizes_a_tmpfs_by_a_descriptor(mount_point: Path) -> None:
    runfs.mount_run(mount_point, Sizes(bytes=64 * MIB, inodes=1000), 0, 0)
    fd = os.open(mount_point, os.O_RDONLY | os.O_DIRECTORY)
    try:
        runfs.resize(fd, Sizes(bytes=4 * MIB, inodes=100))
        st = os.statvfs(fd)
        assert st.f_blocks * st.f_frsize == 4 * MIB and st.f_files == 100
    finally:
        os.close(fd)
