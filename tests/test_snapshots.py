"""Session snapshots on a real server: kept across a kill -9, forked, quotas, tenants, a
squatted store. The malicious-pickle attack is tests/attacks/test_snapshots.py."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import websockets

from tests.support import REPO, Server, reachable_tmp_root, scaled, start_server

ALICE = "alice-" + secrets.token_hex(12)
BOB = "bob-" + secrets.token_hex(12)
TOKENS = f"""
[[tenant]]
name = "alice"
token = "{ALICE}"

[[tenant]]
name = "bob"
token = "{BOB}"
"""
MAX_SNAPSHOTS = 3
MAX_SNAPSHOT_MB = 4
MAX_FILE_MB = 8  # the jail writes its archive as one file: over this, the jail refuses it

FIRST = """
import threading, socket
counter = 41
def bump(n=1):
    global counter
    counter += n
    return counter
class Box:
    def __init__(self, v): self.v = v
    def twice(self): return self.v * 2 + counter
box = Box(5)
open('notes.txt', 'w').write('kept\\n')
import os
os.makedirs('deep/er', exist_ok=True)
open('deep/er/f.bin', 'wb').write(bytes(range(256)))
guard = threading.Lock()
sock = socket.socket()
worker = threading.Thread(target=lambda: None)
handle = open('notes.txt')
gen = (i for i in range(3))
try:
    import numpy
    arr = numpy.arange(1 << 18)
except ImportError:
    arr = bytearray(range(256)) * 8192
"""


@pytest.fixture(scope="module")
def tmp_root() -> Iterator[Path]:
    with reachable_tmp_root("appliance-snapshots-") as root:
        yield root


@pytest.fixture(scope="module")
def store() -> Iterator[Path]:
    base = Path(tempfile.mkdtemp(prefix="appliance-snapstore-", dir="/tmp"))
    yield base / "snapshots"
    shutil.rmtree(base, ignore_errors=True)


def settings(tmp_root: Path, store: Path, tokens: Path) -> dict[str, str]:
    return {
        "SANDBOX_TMP_ROOT": str(tmp_root),
        "SANDBOX_SNAPSHOT_DIR": str(store),
        "SANDBOX_AUTH_TOKENS_FILE": str(tokens),
        "SANDBOX_MAX_SNAPSHOTS": str(MAX_SNAPSHOTS),
        "SANDBOX_MAX_SNAPSHOT_MB": str(MAX_SNAPSHOT_MB),
        "SANDBOX_MAX_DISK_MB": "64",
        "SANDBOX_MAX_FILE_MB": str(MAX_FILE_MB),
    }


def call(server: Server, method: str, path: str, token: str, body: object = None) -> tuple[int, Any]:
    status, text = server.request(method, path, token, body, timeout=scaled(60))
    return status, (json.loads(text) if text else None)


def open_session(server: Server, token: str, code: str, **extra: object) -> tuple[str, list[dict[str, Any]]]:
    status, body = call(server, "POST", "/v1/sessions", token, {"code": code, **extra})
    assert status == 201, body
    return body["session"], body["frames"]


def run(server: Server, token: str, session: str, code: str) -> list[dict[str, Any]]:
    status, text = server.request(
        "POST", "/v1/exec", token, {"code": code, "session": session}, timeout=scaled(60)
    )
    assert status == 200, text
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def stdout(frames: list[dict[str, Any]]) -> str:
    assert frames[-1]["type"] == "done" and frames[-1]["status"] == "ok", frames[-1]
    return "".join(f["text"] for f in frames if f["type"] == "stream" and f["name"] == "stdout")


@pytest.fixture(scope="module")
def kept(tmp_path_factory: pytest.TempPathFactory, tmp_root: Path, store: Path) -> dict[str, Any]:
    """A first server takes a snapshot of a session, and is killed with SIGKILL."""
    tokens = tmp_path_factory.mktemp("snap-tokens") / "tokens.toml"
    tokens.write_text(TOKENS)
    tokens.chmod(0o600)
    first = start_server(
        tmp_path_factory.mktemp("snap-first"),
        settings=settings(tmp_root, store, tokens),
        SANDBOX_POOL_SIZE="0",
    )
    try:
        session, frames = open_session(first, ALICE, FIRST)
        assert frames[-1]["status"] == "ok", frames
        status, taken = call(first, "POST", f"/v1/sessions/{session}/snapshot", ALICE, {})
        assert status == 201, taken
        # The session goes on after its snapshot, as it was.
        assert stdout(run(first, ALICE, session, "print(bump())")) == "42\n"
    finally:
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait()
    return {"taken": taken, "tokens": tokens}


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, tmp_root: Path, store: Path, kept: dict[str, Any]
) -> Iterator[Server]:
    """A new server on the same SANDBOX_SNAPSHOT_DIR, started after the first one died."""
    srv = start_server(
        tmp_path_factory.mktemp("snap-second"), settings=settings(tmp_root, store, kept["tokens"])
    )
    yield srv
    srv.stop()


def test_a_snapshot_names_what_did_not_pickle(kept: dict[str, Any]) -> None:
    taken = kept["taken"]
    assert set(taken) >= {"snapshot", "bytes", "skipped"} and taken["bytes"] > 256
    skipped = {entry.split(":", 1)[0]: entry for entry in taken["skipped"]}
    for name in ("guard", "sock", "worker", "handle", "gen"):
        assert name in skipped, f"{name} is not named in skipped: {taken['skipped']}"
    assert "lock" in skipped["guard"] and "socket" in skipped["sock"] and "open file" in skipped["handle"]
    # arr: a large buffer pickles out of band (protocol 5): it is kept, not skipped.
    assert not {"counter", "bump", "Box", "box", "threading", "arr"} & set(skipped)


def test_a_snapshot_outlives_its_server_killed_and_restores_on_a_new_one(
    server: Server, kept: dict[str, Any]
) -> None:
    snap = kept["taken"]["snapshot"]
    status, info = call(server, "GET", f"/v1/snapshots/{snap}", ALICE)
    assert status == 200 and info["snapshot"] == snap and info["skipped"] == kept["taken"]["skipped"]
    code = (
        "print(counter, bump(), box.twice(), open('notes.txt').read().strip(), "
        "open('deep/er/f.bin','rb').read() == bytes(range(256)), threading.__name__)"
    )
    session, frames = open_session(server, ALICE, code, from_snapshot=snap)
    # The globals as they were at the snapshot (not the 42 the session reached after it),
    # functions and classes of cells with them, modules imported again by name.
    assert stdout(frames) == "41 42 52 kept True threading\n"
    # A function restored sees the session's globals, not a copy: a later cell's assignment.
    assert stdout(run(server, ALICE, session, "counter = 100\nprint(bump(), box.twice())")) == "101 111\n"


async def test_two_forks_of_one_snapshot_diverge(server: Server, kept: dict[str, Any]) -> None:
    snap = kept["taken"]["snapshot"]
    left, _ = open_session(
        server, ALICE, "bump(1000)\nopen('notes.txt','w').write('left')", from_snapshot=snap
    )
    # The other over the WebSocket: "session": "new" with from_snapshot.
    async with websockets.connect(server.url, additional_headers={"Authorization": f"Bearer {ALICE}"}) as ws:
        await ws.send(json.dumps({"code": "bump(7)", "session": "new", "from_snapshot": snap}))
        frames: list[dict[str, Any]] = []
        while not frames or frames[-1]["type"] != "done":
            frames.append(json.loads(await ws.recv()))
    assert frames[-1]["status"] == "ok", frames[-1]
    right = frames[-1]["session"]
    assert right != left
    probe = "print(counter, open('notes.txt').read().strip())"
    assert stdout(run(server, ALICE, left, probe)) == "1041 left\n"
    assert stdout(run(server, ALICE, right, probe)) == "48 kept\n"


def test_another_tenant_sees_a_snapshot_as_unknown(server: Server, kept: dict[str, Any]) -> None:
    snap = kept["taken"]["snapshot"]
    unknown = secrets.token_hex(16)
    for method in ("GET", "DELETE"):
        theirs = call(server, method, f"/v1/snapshots/{snap}", BOB)
        none = call(server, method, f"/v1/snapshots/{unknown}", BOB)
        assert theirs[0] == none[0] == 404
        assert theirs[1]["error"].replace(snap, unknown) == none[1]["error"]
    status, refused = call(
        server, "POST", "/v1/sessions", BOB, {"code": "print(counter)", "from_snapshot": snap}
    )
    status_none, refused_none = call(
        server, "POST", "/v1/sessions", BOB, {"code": "print(counter)", "from_snapshot": unknown}
    )
    assert status == status_none == 400
    assert refused["status"] == "rejected" and "no such snapshot" in refused["message"]
    assert refused["message"].replace(snap, unknown) == refused_none["message"]
    # And it is still Alice's, whole.
    assert call(server, "GET", f"/v1/snapshots/{snap}", ALICE)[0] == 200


def test_a_session_of_another_tenant_cannot_be_snapshotted(server: Server) -> None:
    session, _ = open_session(server, ALICE, "x = 1")
    status, body = call(server, "POST", f"/v1/sessions/{session}/snapshot", BOB, {})
    assert status == 404 and "no such session" in body["error"]


def test_snapshots_are_bounded_in_size_and_count(server: Server) -> None:
    session, _ = open_session(server, BOB, f"import os\nblob = os.urandom({MAX_SNAPSHOT_MB + 1} << 20)")
    status, body = call(server, "POST", f"/v1/sessions/{session}/snapshot", BOB, {})
    assert status == 400 and "SANDBOX_MAX_SNAPSHOT_MB" in body["error"], body
    run(server, BOB, session, f"blob = os.urandom({MAX_FILE_MB + 1} << 20)")
    status, body = call(server, "POST", f"/v1/sessions/{session}/snapshot", BOB, {})
    assert status == 400 and "SANDBOX_MAX_FILE_MB" in body["error"], body
    # Nothing was kept, and the session goes on.
    assert stdout(run(server, BOB, session, "del blob\nprint('still here')")) == "still here\n"
    taken = []
    for _ in range(MAX_SNAPSHOTS):
        status, body = call(server, "POST", f"/v1/sessions/{session}/snapshot", BOB, {})
        assert status == 201, body
        taken.append(body["snapshot"])
    status, body = call(server, "POST", f"/v1/sessions/{session}/snapshot", BOB, {})
    assert status == 400 and "SANDBOX_MAX_SNAPSHOTS" in body["error"], body
    assert call(server, "DELETE", f"/v1/snapshots/{taken[0]}", BOB)[0] == 204
    assert call(server, "GET", f"/v1/snapshots/{taken[0]}", BOB)[0] == 404
    status, body = call(server, "POST", f"/v1/sessions/{session}/snapshot", BOB, {})
    assert status == 201, body


@pytest.mark.parametrize("squat", ["other-owner", "symlink", "open-mode"])
def test_a_squatted_snapshot_dir_is_refused_at_startup(tmp_path: Path, squat: str) -> None:
    base = Path(tempfile.mkdtemp(prefix="appliance-squat-", dir="/tmp"))
    try:
        target = base / "snapshots"
        if squat == "other-owner":
            target.mkdir(mode=0o700)
            os.chown(target, 1001, 1001)
        elif squat == "symlink":
            (base / "elsewhere").mkdir(mode=0o700)
            target.symlink_to(base / "elsewhere")
        else:
            target.mkdir()
            target.chmod(0o777)
        env = {**os.environ, "SANDBOX_SNAPSHOT_DIR": str(target), "SANDBOX_POOL_SIZE": "0"}
        proc = subprocess.run(
            [sys.executable, "-m", "appliance", "serve", "--port", "0"],
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=scaled(60),
            check=False,
        )
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert "SANDBOX_SNAPSHOT_DIR" in proc.stderr and str(target) in proc.stderr, proc.stderr[-2000:]
    finally:
        shutil.rmtree(base, ignore_errors=True)
