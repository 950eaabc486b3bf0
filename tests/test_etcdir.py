"""The jails' /etc prepared once by a root server (`appliance.sandbox.etcdir`) is the /etc that
firejail's --private-etc copies for each jail: the same entries, owners, modes, link targets and
contents, nothing more (no /etc/shadow, nothing of firejail's own), read-only; and a prepared
/etc found where the server would make one stops it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from appliance.core.errors import StartupError
from appliance.sandbox import channel
from appliance.sandbox.jail import Jail, JailFactory
from appliance.sandbox.spec import ETC_FILES
from appliance.sandbox.workdir import RunDirs
from tests.support import jail_factory, reachable_tmp_root

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="a prepared /etc is mounted by a root server only")

# What the jail reports of its /etc: every entry (links not followed), and its mount options.
MANIFEST = """
import hashlib, json, os
entries = {}
for root, dirs, files in os.walk('/etc'):
    for name in sorted(dirs + files):
        path = os.path.join(root, name)
        st = os.lstat(path)
        rec = [oct(st.st_mode), st.st_uid, st.st_gid]
        if os.path.islink(path):
            rec.append(os.readlink(path))
        elif os.path.isfile(path):
            try:
                rec.append(hashlib.sha256(open(path, 'rb').read()).hexdigest())
            except OSError as exc:
                rec.append(exc.strerror)
        entries[path] = rec
mounts = {}
for line in open('/proc/self/mountinfo'):
    fields = line.split()
    if fields[4] == '/etc' or fields[4].startswith('/etc/'):
        mounts[fields[4]] = fields[5].split(',')  # the last mount on a path is the one seen
writes = {}
for path in ('/etc/planted', '/etc/ssl/planted', '/etc/hosts'):
    try:
        open(path, 'a').close()
        writes[path] = 'written'
    except OSError as exc:
        writes[path] = exc.strerror
json.dump({'entries': entries, 'mounts': mounts, 'writes': writes}, open('/workspace/etc.json', 'w'))
"""


async def _report(factory: JailFactory) -> dict[str, Any]:
    jail: Jail = await factory.launch()
    try:
        jail.process.write(channel.run_op(MANIFEST, [], True))
        done = await jail.process.wait_event("done", 60)
        assert done.get("status") in (None, "ok"), done
        report: dict[str, Any] = json.loads((jail.workdir / "etc.json").read_text())
        return report
    finally:
        await jail.destroy()


async def test_the_prepared_etc_is_what_private_etc_gives_and_read_only() -> None:
    with jail_factory() as factory:
        assert factory.dirs.etc is not None, "a root server prepares the jails' /etc"
        prepared = await _report(factory)
        factory.dirs.etc = None  # the same factory, firejail copying /etc per jail as before
        copied = await _report(factory)
    entries = prepared["entries"]
    assert entries == copied["entries"]  # every path, owner, mode, link target and content
    top = {path.split("/")[2] for path in entries}
    assert top == {name for name in ETC_FILES if os.path.lexists(f"/etc/{name}")}, top
    assert (
        "/etc/shadow" not in entries and "/etc/firejail" not in entries and "/etc/login.defs" not in entries
    )
    certs = [p for p in entries if p.startswith("/etc/ssl/certs/")]
    assert len(certs) > 10 and "/etc/ssl/certs/ca-certificates.crt" in entries  # the system CA store
    assert all(entries[p][3].startswith("/") for p in certs if entries[p][0].startswith("0o12"))
    # Every entry of the prepared /etc is a read-only mount (the copy's were writable mounts of
    # root's files); passwd and group are firejail's filtered accounts in both.
    for name in ETC_FILES:
        if f"/etc/{name}" in prepared["mounts"] and name not in ("passwd", "group"):
            assert "ro" in prepared["mounts"][f"/etc/{name}"], (name, prepared["mounts"])
    assert "ro" in prepared["mounts"]["/etc/ssl"], prepared["mounts"]
    assert set(prepared["writes"].values()) <= {"Permission denied", "Read-only file system"}, prepared
    assert set(copied["writes"].values()) <= {"Permission denied", "Read-only file system"}, copied


def test_a_prepared_etc_found_where_the_server_makes_it_stops_startup(tmp_path: Path) -> None:
    with reachable_tmp_root("appliance-etc-") as root:
        decoy = tmp_path / "decoy"
        decoy.mkdir()
        first = RunDirs(root, 1001, 1001)
        first.prepare(etc_files=None)  # makes the instance directory, no /etc in it
        (first.instance / "etc").symlink_to(decoy)
        again = RunDirs(root, 1001, 1001)
        with pytest.raises(StartupError, match=r"/etc exists before the server made it"):
            again.prepare()
        assert again.etc is None and not list(decoy.iterdir()), "written through the planted link"
        (first.instance / "etc").unlink()
        (first.instance / "etc").mkdir(mode=0o755)
        with pytest.raises(StartupError, match=r"/etc exists before the server made it"):
            RunDirs(root, 1001, 1001).prepare()
        fresh = RunDirs(root, 1001, 1001)
        (first.instance / "etc").rmdir()
        fresh.prepare()
        assert fresh.etc == fresh.instance / "etc"
        st = fresh.etc.stat()
        assert (st.st_uid, st.st_mode & 0o7777) == (0, 0o755)
        assert sorted(os.listdir(fresh.etc)) == sorted(
            {n for n in ETC_FILES if os.path.lexists(f"/etc/{n}")} | {"firejail", "login.defs"}
        )
        assert (fresh.etc / "passwd").read_bytes() == b"" and (fresh.etc / "group").read_bytes() == b""
        config = (fresh.etc / "firejail" / "firejail.config").read_text()
        assert config.startswith(Path("/etc/firejail/firejail.config").read_text())
        assert config.rstrip().endswith("etc-hide-blacklisted yes")
        fresh.remove_instance()
