"""A jail's run directory held past the jail's end (`Jail.hold_workspace`), on a real jail: kept,
with its files and its uid, until the last hold is released, then removed (its tmpfs
detached) as the jail's end would have. SandboxFusion's fetch after a time limit stands on
it (tests/test_fusion_unprivileged.py drives it through a server that is not root)."""

from __future__ import annotations

import os

import pytest

from appliance.sandbox import channel, runfs, workfiles
from appliance.sandbox.uids import Uids
from tests.support import jail_factory, reachable_tmp_root

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="a uid of its own for a jail is a root server's")

UID = 3_900_500  # a uid of its own for the jail, far from any account (tests/test_uids.py's too)


async def test_a_held_run_directory_outlives_its_jail_until_released() -> None:
    with jail_factory() as factory, reachable_tmp_root("appliance-hold-") as locks:
        factory.uids = Uids(locks, 1001, 1001, (UID,))
        factory.uids.prepare()
        jail = await factory.launch()
        try:
            kept, early = jail.hold_workspace(), jail.hold_workspace()
            assert kept is not None and early is not None
            jail.process.write(channel.run_op("open('/workspace/kept.txt', 'w').write('kept')", [], True))
            done = await jail.process.wait_event("done", 60)
            assert done.get("status") in (None, "ok"), done
            await early.release()  # before the end: nothing is removed
            assert (jail.workdir / "kept.txt").exists()
            await jail.destroy()
            assert jail.ended and kept.jail_ended and not jail.alive
            # Held: the directory, its file and its uid stay after the jail's end.
            assert (jail.workdir / "kept.txt").read_text() == "kept"
            fd, _ = workfiles.open_file(kept.workspace, ("kept.txt",), "kept.txt")
            try:
                assert os.read(fd, 100) == b"kept"
            finally:
                os.close(fd)
            assert jail.held is not None and jail.held.uid == UID and jail.held.fd is not None
            await kept.release()
            assert not jail.workdir.exists()
            assert jail.workdir not in runfs.mounts_under(jail.workdir.parent)
            assert jail.held.fd is None  # the uid given back with the directory
            await kept.release()  # idempotent
        finally:
            await jail.destroy()
