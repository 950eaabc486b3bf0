"""Snapshots are untrusted data: a pickle planted in one runs only inside the restoring jail.

A snapshot's archive is bytes to the server: it copies them, with size checks, and never
parses them. Here the kept archive is swapped, as root, for one whose globals.pkl runs a
command as it is unpickled. Were the server to unpickle it, the command would run on the host
as the server's uid and leave a marker in the host's /tmp: the test fails if that marker
appears. Inside the jail the command runs as the jail's uid, and its marker is in the
restored session's own workspace (the jail's /tmp is private: the host's stays untouched).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import secrets
import shutil
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.attacks.common import TOKEN, attack
from tests.attacks.conftest import hostile_server
from tests.support import Server, scaled


class Planted:
    """What the hand-crafted pickle holds: unpickling it calls os.system(command)."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (self.command,))


def planted_archive(command: str) -> bytes:
    """A snapshot archive in the jail's format (state.json, then globals.pkl) whose globals
    run `command` when they are unpickled."""
    state = json.dumps({"format": 1, "globals": ["evil"], "skipped": [], "paths": []}).encode()
    payload = pickle.dumps({"evil": Planted(command)})
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in (("state.json", state), ("globals.pkl", payload)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


@pytest.fixture(scope="module")
def store() -> Iterator[Path]:
    base = Path(tempfile.mkdtemp(prefix="appliance-attack-snapstore-", dir="/tmp"))
    yield base / "snapshots"
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory, tmp_root: Path, store: Path) -> Iterator[Server]:
    srv = hostile_server(
        tmp_path_factory.mktemp("attack-snapshots"), tmp_root, SANDBOX_SNAPSHOT_DIR=str(store)
    )
    yield srv
    srv.stop()


def call(server: Server, method: str, path: str, body: object = None) -> tuple[int, Any]:
    status, text = server.request(method, path, TOKEN, body, timeout=scaled(60))
    return status, (json.loads(text) if text else None)


@attack(
    "a hand-crafted pickle in a snapshot (its __reduce__ runs `id`)",
    "it runs only in the restoring jail, as the jail's uid; the server never unpickles it",
)
def test_a_planted_pickle_runs_only_inside_the_jail(
    target: Server, store: Path, observe: Callable[[str], None]
) -> None:
    status, opened = call(target, "POST", "/v1/sessions", {"code": "x = 1"})
    assert status == 201, opened
    status, taken = call(target, "POST", f"/v1/sessions/{opened['session']}/snapshot", {})
    assert status == 201, taken
    snap = taken["snapshot"]
    (archive,) = store.glob(f"t-*/{snap}/archive.tar")
    host_marker = Path(tempfile.gettempdir()) / f"appliance-planted-{secrets.token_hex(8)}"
    # In the jail: `id` into the workspace, and a touch of a /tmp path (the jail's private /tmp).
    # On the host, the same touch would leave host_marker: the proof that the server unpickled.
    archive.write_bytes(planted_archive(f"id > planted.txt; touch {host_marker}"))
    try:
        status, restored = call(
            target,
            "POST",
            "/v1/sessions",
            {
                "code": "import os\nprint(open('planted.txt').read().strip(), os.getuid(), evil)",
                "from_snapshot": snap,
            },
        )
        assert not host_marker.exists(), "the planted pickle ran on the host: the server unpickled it"
        assert status == 201, restored
        done = restored["frames"][-1]
        assert done["status"] == "ok", done
        out = "".join(f["text"] for f in restored["frames"] if f["type"] == "stream")
        observe(out.strip())
        id_line, uid, rc = out.strip().rsplit(" ", 2)
        # It ran, in the jail, as the jail's own unprivileged uid (not root, not the server's).
        assert id_line.startswith(f"uid={uid}(") and int(uid) not in (0, os.geteuid()) and rc == "0"
        assert not host_marker.exists()
    finally:
        host_marker.unlink(missing_ok=True)


@attack(
    "a snapshot archive whose members climb out of the workspace (../, absolute paths, links)",
    "the restore is refused inside the jail; nothing is written outside its workspace",
)
def test_a_planted_archive_cannot_write_outside_the_workspace(
    target: Server, store: Path, observe: Callable[[str], None]
) -> None:
    status, opened = call(target, "POST", "/v1/sessions", {"code": "x = 1"})
    status, taken = call(target, "POST", f"/v1/sessions/{opened['session']}/snapshot", {})
    assert status == 201, taken
    snap = taken["snapshot"]
    (archive,) = store.glob(f"t-*/{snap}/archive.tar")
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("workspace/../../escaped.txt")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"out"))
        link = tarfile.TarInfo("workspace/etc")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc"
        tar.addfile(link)
    archive.write_bytes(out.getvalue())
    status, restored = call(
        target, "POST", "/v1/sessions", {"code": "print('restored')", "from_snapshot": snap}
    )
    observe(json.dumps(restored)[:300])
    assert status in (400, 500, 422) or restored["frames"][-1]["status"] != "ok", restored
    message = restored["message"] if "message" in restored else restored["frames"][-1]["message"]
    assert "could not be restored" in message and "refused path" in message
    # And the server is unharmed: a plain run still works.
    assert call(target, "POST", "/v1/sessions", {"code": "print(1)"})[0] == 201
