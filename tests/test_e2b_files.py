"""The unmodified E2B SDK's `sandbox.files` (envd's Filesystem service over Connect, and the
`/files` upload and download) against a real server and real jails.

One server for the module and a sandbox per test that needs a fresh one: each is one jail.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import FileType, InvalidArgumentException, NotFoundException, SandboxException
from e2b.exceptions import FileNotFoundException
from e2b_code_interpreter import AsyncSandbox, Sandbox

from tests.support import Server, scaled, start_server
from tests.test_e2b_sdk import point_sdk, tenants_file, until


@pytest.fixture(scope="module")
def e2bsrv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("e2b-files")
    srv = start_server(tmp, SANDBOX_AUTH_TOKENS_FILE=str(tenants_file(tmp)), SANDBOX_POOL_SIZE="2")
    yield srv
    srv.stop()


@pytest.fixture(autouse=True)
def sdk_env(e2bsrv: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    point_sdk(monkeypatch, e2bsrv)


@pytest.fixture(scope="module")
def shared(e2bsrv: Server) -> Iterator[Sandbox]:
    """One sandbox for the tests that only add files of their own names to it."""
    mp = pytest.MonkeyPatch()
    point_sdk(mp, e2bsrv)
    sb = Sandbox.create()
    yield sb
    sb.kill()
    mp.undo()


def test_stat_make_dir_list_rename_remove(shared: Sandbox) -> None:
    files = shared.files
    assert files.make_dir("/home/user/tree/a/b") is True
    assert files.make_dir("tree/a/b") is False  # already there: relative paths are /home/user's
    assert files.exists("/home/user/tree/a")
    assert not files.exists("/home/user/tree/nothing")
    info = files.get_info("tree/a")
    assert info.type == FileType.DIR
    assert info.path == "/home/user/tree/a"
    assert info.name == "a"
    assert info.owner == "user"

    assert [e.path for e in files.list("/home/user/tree")] == ["/home/user/tree/a"]
    deep = sorted(e.path for e in files.list("/home/user/tree", depth=3))
    assert deep == ["/home/user/tree/a", "/home/user/tree/a/b"]

    moved = files.rename("/home/user/tree/a/b", "/home/user/tree/c")
    assert moved.path == "/home/user/tree/c"
    assert moved.type == FileType.DIR
    assert not files.exists("/home/user/tree/a/b")

    files.remove("/home/user/tree")
    assert not files.exists("/home/user/tree/c")
    with pytest.raises(FileNotFoundException):
        files.get_info("/home/user/tree")
    with pytest.raises(NotFoundException):
        files.list("/home/user/tree")


def test_paths_outside_the_working_directory_are_refused(shared: Sandbox) -> None:
    for path in ("/etc", "/home/user/../../etc/passwd", "/tmp/x", "/workspacex"):
        with pytest.raises(InvalidArgumentException, match="outside the sandbox's working directory"):
            shared.files.get_info(path)
    # /workspace is the same directory, reported under the name the caller used
    shared.files.make_dir("/workspace/both")
    assert shared.files.get_info("/home/user/both").path == "/home/user/both"
    assert shared.files.get_info("/workspace/both").path == "/workspace/both"


def stat_raw(srv: Server, sandbox_id: str, token: str, path: str, port: str = "49983") -> httpx.Response:
    """envd's Stat as plain Connect JSON over HTTP, with the headers the SDK sends."""
    return httpx.post(
        srv.http + "/e2b/filesystem.Filesystem/Stat",
        json={"path": path},
        headers={"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": port, "X-Access-Token": token},
    )


def test_a_wrong_token_or_an_ended_sandbox_reads_as_not_found(e2bsrv: Server) -> None:
    sb = Sandbox.create()
    token = str(sb._envd_access_token)
    try:
        sb.files.make_dir("here")
        ok = stat_raw(e2bsrv, sb.sandbox_id, token, "here")
        assert ok.status_code == 200, ok.text
        assert ok.headers["content-type"] == "application/json"
        assert ok.json()["entry"]["path"] == "/home/user/here"
        assert ok.json()["entry"]["type"] == "FILE_TYPE_DIRECTORY"
        for wrong in (
            stat_raw(e2bsrv, sb.sandbox_id, token[:-1] + "x", "here"),
            stat_raw(e2bsrv, "0" * 20, token, "here"),
        ):
            assert wrong.status_code == 404
            assert wrong.json()["code"] == "not_found"
            assert "was not found" in wrong.json()["message"]
        other_port = stat_raw(e2bsrv, sb.sandbox_id, token, "here", port="49999")
        assert other_port.json()["code"] == "unavailable"
        watcher = sb.files.watch_dir("here")
        assert watcher.get_new_events() == []
    finally:
        sb.kill()
    with pytest.raises(NotFoundException):
        watcher.get_new_events()  # the watch ended with its sandbox
    with pytest.raises(NotFoundException, match="was not found"):
        sb.files.get_info("here")
    assert stat_raw(e2bsrv, sb.sandbox_id, token, "here").json()["code"] == "not_found"


def test_async_sandbox_files(e2bsrv: Server) -> None:
    async def scenario() -> None:
        sb = await AsyncSandbox.create()
        try:
            assert await sb.files.make_dir("adir/inner") is True
            assert await sb.files.exists("adir/inner")
            listed = await sb.files.list("adir")
            assert [(e.name, e.type) for e in listed] == [("inner", FileType.DIR)]
            await sb.files.remove("adir")
            assert not await sb.files.exists("adir")
            info = await sb.files.write("/home/user/async.txt", "from async")
            assert info.path == "/home/user/async.txt"
            assert await sb.files.read("async.txt") == "from async"
            packed = b"compressible " * 10_000
            await sb.files.write("packed.bin", packed, gzip=True)  # octet-stream, Content-Encoding: gzip
            assert bytes(await sb.files.read("packed.bin", format="bytes", gzip=True)) == packed
            await sb.files.write_files([{"path": "m/1.txt", "data": "1"}, {"path": "m/2.txt", "data": b"2"}])
            assert sorted(e.name for e in await sb.files.list("m")) == ["1.txt", "2.txt"]
        finally:
            await sb.kill()

    asyncio.run(scenario())


def test_write_and_read_text_bytes_and_many_files(shared: Sandbox) -> None:
    files = shared.files
    info = files.write("/home/user/notes/hello.txt", "héllo\n")
    assert (info.name, info.path, info.type) == ("hello.txt", "/home/user/notes/hello.txt", FileType.FILE)
    assert files.read("notes/hello.txt") == "héllo\n"
    blob = bytes(range(256)) * 1000
    files.write("notes/blob.bin", blob)
    assert files.read("/workspace/notes/blob.bin", format="bytes") == bytearray(blob)
    files.write("notes/hello.txt", "replaced")  # overwrite
    assert files.read("notes/hello.txt") == "replaced"
    assert files.get_info("notes/blob.bin").size == len(blob)
    with files.read("notes/blob.bin", format="stream") as stream:
        assert b"".join(stream) == blob
    written = files.write_files(
        [{"path": "many/a.txt", "data": "A"}, {"path": "/home/user/many/sub/b.txt", "data": b"B"}]
    )
    assert sorted(w.path for w in written) == ["/home/user/many/a.txt", "/home/user/many/sub/b.txt"]
    assert files.read("many/sub/b.txt") == "B"
    streamed = b"x" * (3 * 65536 + 7)  # a file object goes as application/octet-stream
    files.write("notes/streamed.bin", io.BytesIO(streamed))
    assert bytes(files.read("notes/streamed.bin", format="bytes")) == streamed
    with pytest.raises(FileNotFoundException):
        files.read("notes/missing.txt")
    with pytest.raises(InvalidArgumentException):
        files.read("notes")  # a directory


def test_run_code_and_files_see_the_same_directory(shared: Sandbox) -> None:
    shared.run_code(
        "import os\nos.makedirs('fromcode', exist_ok=True)\nopen('fromcode/out.txt', 'w').write('by run_code')"
    )
    assert shared.files.read("/home/user/fromcode/out.txt") == "by run_code"
    shared.files.write("/home/user/fromfiles.txt", "by files")
    assert shared.run_code("open('/workspace/fromfiles.txt').read()").text == "'by files'"
    assert shared.run_code("import os; os.stat('fromfiles.txt').st_uid == os.getuid()").text == "True"


def test_watch_dir_sees_what_run_code_writes(shared: Sandbox) -> None:
    shared.files.make_dir("watched/deep")
    handle = shared.files.watch_dir("/home/user/watched", recursive=True)
    try:
        shared.run_code(
            "open('watched/made.txt', 'w').write('x')\nopen('watched/deep/inner.txt', 'w').write('y')"
        )
        seen: set[tuple[str, str]] = set()

        def both_seen() -> bool:
            seen.update((e.name, e.type.name) for e in handle.get_new_events())
            return {("made.txt", "CREATE"), ("deep/inner.txt", "CREATE")} <= seen

        assert until(both_seen), seen
    finally:
        handle.stop()


def test_async_watch_dir_streams_events(e2bsrv: Server) -> None:
    async def scenario() -> None:
        sb = await AsyncSandbox.create()
        try:
            got: asyncio.Queue[tuple[str, str]] = asyncio.Queue()
            handle = await sb.files.watch_dir("/home/user", lambda e: got.put_nowait((e.name, e.type.name)))
            await sb.files.write("/home/user/via-files.txt", "z")
            await sb.run_code("open('via-code.txt', 'w').write('w')")
            seen: set[tuple[str, str]] = set()
            # an upload lands as a new name renamed over the target: CREATE, its temporary name unseen
            while not {("via-files.txt", "CREATE"), ("via-code.txt", "CREATE")} <= seen:
                seen.add(await asyncio.wait_for(got.get(), scaled(30)))
            await handle.stop()
            assert not [name for name, _ in seen if name.startswith(".appliance")]
        finally:
            await sb.kill()

    asyncio.run(scenario())


def inotify_instances(pid: int) -> int:
    """The server's inotify descriptors now (one it closes while they are counted is not one)."""
    count = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(FileNotFoundError):
            count += os.readlink(fd) == "anon_inode:inotify"
    return count


def test_a_sandbox_holds_a_bounded_number_of_watches(e2bsrv: Server, shared: Sandbox) -> None:
    before = inotify_instances(e2bsrv.proc.pid)
    shared.files.make_dir("capped")
    handles = [shared.files.watch_dir("capped") for _ in range(8)]
    try:
        # all of a sandbox's watches share one inotify instance (root's instances are the host's)
        assert inotify_instances(e2bsrv.proc.pid) == before + 1
        with pytest.raises(SandboxException, match="at most 8"):
            shared.files.watch_dir("capped")
    finally:
        for handle in handles:
            handle.stop()
    assert inotify_instances(e2bsrv.proc.pid) == before  # given back with the last watch
    shared.files.watch_dir("capped").stop()  # stopped ones are given back
