"""appliance.sandbox.trust and the staged trees it guards: ownership checked by descriptor."""

from __future__ import annotations

import importlib.util
import marshal
import os
import stat
import struct
import sys
from pathlib import Path

import pytest

from appliance.core.errors import StartupError
from appliance.sandbox import trust
from appliance.sandbox.workdir import driver_of, open_base, reusable, stage_runtime
from tests.support import reachable_tmp_root


def _st(mode: int, uid: int) -> os.stat_result:
    return os.stat_result((mode, 0, 0, 1, uid, 0, 0, 0, 0, 0))


def test_the_policy() -> None:
    assert trust.policy(_st(stat.S_IFDIR | 0o755, 0), 0, ancestor=False) is None
    assert trust.policy(_st(stat.S_IFDIR | 0o1777, 0), 0, ancestor=True) is None  # /tmp
    assert trust.policy(_st(stat.S_IFDIR | 0o1777, 0), 0, ancestor=False) is not None
    assert trust.policy(_st(stat.S_IFDIR | 0o1777, 5), 0, ancestor=True) is not None
    assert trust.policy(_st(stat.S_IFDIR | 0o775, 0), 0, ancestor=True) is not None
    assert trust.policy(_st(stat.S_IFDIR | 0o755, 65534), 0, ancestor=True) is not None
    assert (
        trust.policy(_st(stat.S_IFDIR | 0o755, 0), 1001, ancestor=True) is None
    )  # root's, for a uid-1001 server
    assert trust.policy(_st(stat.S_IFDIR | 0o755, 0), 1001, ancestor=False) is not None
    assert trust.policy(_st(stat.S_IFREG | 0o644, 0), 0, ancestor=True) is not None


@pytest.mark.host  # chown to another user needs root
def test_a_root_under_another_users_directory_is_refused() -> None:
    with reachable_tmp_root("trust-anc-") as root:
        os.chown(root, 65534, 65534)
        with pytest.raises(StartupError, match=f"{root} is owned by uid 65534"):
            trust.open_root(root / "inner", os.geteuid())


def test_a_link_on_the_way_is_refused() -> None:
    with reachable_tmp_root("trust-link-") as root:
        (root / "real").mkdir(mode=0o755)
        (root / "link").symlink_to(root / "real")
        with pytest.raises(StartupError, match="is a symbolic link"):
            trust.open_root(root / "link", os.geteuid())
        (root / "real" / "appliance").mkdir(mode=0o755)
        (root / "real" / "accounts").symlink_to(root / "real")
        with trust.held(trust.open_root(root / "real", os.geteuid())) as fd:
            with pytest.raises(StartupError, match="is a symbolic link"):
                trust.ensure_dir(fd, root / "real", "accounts", 0o755, os.geteuid())
        assert stat.S_IMODE((root / "real").stat().st_mode) == 0o755


def test_a_staged_runtime_with_a_foreign_file_is_staged_again() -> None:
    with reachable_tmp_root("trust-rt-") as root:
        runtime = stage_runtime(root, Path(sys.executable))
        assert reusable(root, runtime.name, "ready")
        driver = runtime / "appliance" / "inside" / "driver.py"
        os.chown(driver, 65534, 65534)
        again = stage_runtime(root, Path(sys.executable))
        assert (
            again == runtime and os.stat(again / "appliance" / "inside" / "driver.py").st_uid == os.geteuid()
        )
        os.chmod(again / "appliance" / "inside" / "driver.py", 0o666)
        assert not reusable(root, runtime.name, "ready") and not runtime.exists()


def test_a_staged_runtime_holds_the_current_bytecode_of_every_module() -> None:
    """A jail cannot write bytecode into its read-only runtime: without it each jail's start
    would compile every module of the runtime it imports."""
    with reachable_tmp_root("trust-pyc-") as root:
        runtime = stage_runtime(root, Path(sys.executable))
        sources = sorted((runtime / "appliance").rglob("*.py"))
        assert len(sources) > 5
        for source in sources:
            header = Path(importlib.util.cache_from_source(str(source))).read_bytes()[:16]
            st = source.stat()
            assert header[:4] == importlib.util.MAGIC_NUMBER, source
            assert struct.unpack("<III", header[4:]) == (0, int(st.st_mtime) & 0xFFFFFFFF, st.st_size), source
        # The driver runs as a script: from its own bytecode, whose frames name its source.
        driver = driver_of(runtime)
        assert driver == runtime / "appliance" / "inside" / "driver.pyc"
        code = marshal.loads(driver.read_bytes()[16:])  # noqa: S302 (the bytecode this test staged)
        assert code.co_filename == str(runtime / "appliance" / "inside" / "driver.py")


def test_open_base_makes_a_checked_0755_directory() -> None:
    with reachable_tmp_root("trust-base-") as root:
        with open_base(root, os.geteuid()) as fd:
            st = os.fstat(fd)
        assert stat.S_IMODE(st.st_mode) == 0o755 and st.st_uid == os.geteuid()
        os.chmod(root / "appliance", 0o777)
        with pytest.raises(StartupError, match="is writable by others"), open_base(root, os.geteuid()):
            pass
