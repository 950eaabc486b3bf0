"""Files in (uploads into the working directory) and out (outputs/ as file frames, persisted)."""

from __future__ import annotations

import asyncio
import base64
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from appliance.core.tenants import owner_of
from appliance.sandbox import outputs
from appliance_client.client import AsyncClient
from tests.support import Server, scaled, start_server, until_async


@pytest.fixture(scope="module")
def filesrv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    outdir = tmp_path_factory.mktemp("persisted")
    srv = start_server(
        tmp_path_factory.mktemp("files"), SANDBOX_OUTPUTS_DIR=str(outdir), SANDBOX_MAX_FILE_OUT_BYTES="100000"
    )
    yield srv, outdir
    srv.stop()


async def test_uploaded_files_are_readable_by_the_code(filesrv: tuple[Server, Path]) -> None:
    server, _ = filesrv
    async with AsyncClient(server.url) as c:
        ex = await c.execute(
            "print(open('data.csv').read(), end='')\nprint(open('sub/dir/b.bin','rb').read())",
            files={"data.csv": "a,b\n1,2\n", "sub/dir/b.bin": b"\x00\x01"},
        )
    assert ex.status == "ok" and ex.stdout == "a,b\n1,2\nb'\\x00\\x01'\n"


async def test_an_outputs_file_comes_back_and_persists_per_run(filesrv: tuple[Server, Path]) -> None:
    server, outdir = filesrv
    code = "import os\nos.makedirs('outputs/plots', exist_ok=True)\nopen('outputs/plots/r.txt','w').write('result')"
    async with AsyncClient(server.url) as c:
        first = await c.execute(code)
        second = await c.execute(code.replace("result", "other"))
    assert first.file_bytes("plots/r.txt") == b"result"
    assert first.files[0]["size"] == 6 and first.files[0]["path"] == "plots/r.txt"
    assert first.run and second.run and first.run != second.run
    tenant = outdir / outputs.tenant_dir(owner_of(None))  # no token: the anonymous tenant
    assert (tenant / first.run / "plots" / "r.txt").read_bytes() == b"result"
    assert (tenant / second.run / "plots" / "r.txt").read_bytes() == b"other"
    for path in (tenant, tenant / first.run, tenant / first.run / "plots"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
    assert stat.S_IMODE((tenant / first.run / "plots" / "r.txt").stat().st_mode) == 0o600


async def test_links_in_outputs_are_never_followed(filesrv: tuple[Server, Path]) -> None:
    server, outdir = filesrv
    code = (
        "import os\nos.symlink('/etc/passwd', 'outputs/passwd')\nos.symlink('/etc', 'outputs/etcdir')\n"
        "try:\n    os.link('/etc/hostname', 'outputs/hard')\nexcept OSError as e:\n    print('hardlink', e.errno)\n"
        "open('outputs/real.txt', 'w').write('ok')"
    )
    async with AsyncClient(server.url) as c:
        ex = await c.execute(code)
    assert [f["path"] for f in ex.files] == ["real.txt"]
    assert (
        ex.run is not None and not (outdir / outputs.tenant_dir(owner_of(None)) / ex.run / "passwd").exists()
    )


async def test_an_output_over_the_size_cap_is_reported_without_data(filesrv: tuple[Server, Path]) -> None:
    server, _ = filesrv
    async with AsyncClient(server.url) as c:
        ex = await c.execute("open('outputs/big.bin', 'wb').write(b'x' * 200000)")
    assert ex.files[0]["path"] == "big.bin" and ex.files[0]["data"] is None and ex.files[0]["size"] == 200000
    assert "SANDBOX_MAX_FILE_OUT_BYTES" in ex.files[0]["message"]


async def test_a_session_returns_only_the_files_each_cell_changed(filesrv: tuple[Server, Path]) -> None:
    server, _ = filesrv
    async with AsyncClient(server.url) as c, c.session() as s:
        one = await s.execute("open('outputs/a.txt','w').write('1')")
        two = await s.execute("open('outputs/b.txt','w').write('2')")
    assert [f["path"] for f in one.files] == ["a.txt"]
    assert [f["path"] for f in two.files] == ["b.txt"]


async def test_an_upload_through_a_planted_symlink_is_refused(filesrv: tuple[Server, Path]) -> None:
    server, _ = filesrv
    async with AsyncClient(server.url) as c, c.session() as s:
        await s.execute("import os\nos.symlink('/tmp', 'escape')")
        ex = await s.execute("print('ran')", files={"escape/x.txt": "payload"})
    assert ex.status == "error" and ex.stdout == ""
    assert ex.error is not None and "escape" in ex.error["evalue"] + " ".join(ex.error["traceback"])


def test_base64_of_a_file_frame_is_valid() -> None:
    assert base64.b64decode(base64.b64encode(b"x")) == b"x"


async def test_persisted_runs_past_their_retention_are_swept(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """SANDBOX_OUTPUTS_RETENTION_S: the server's sweeper removes a persisted run once it is
    older than that, and only that one; a run's directory of a younger run stays."""
    outdir = tmp_path_factory.mktemp("retained")
    server = start_server(
        tmp_path_factory.mktemp("sweeper"), SANDBOX_OUTPUTS_DIR=str(outdir), SANDBOX_OUTPUTS_RETENTION_S="2"
    )
    try:
        async with AsyncClient(server.url) as c:
            ex = await c.execute("open('outputs/r.txt', 'w').write('kept a while')")
        assert ex.status == "ok" and ex.run is not None
        persisted = outdir / outputs.tenant_dir(owner_of(None)) / ex.run
        assert persisted.is_dir()
        deadline = time.monotonic() + scaled(60)
        while persisted.exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert not persisted.exists(), "the sweeper did not remove a run past its retention"
        # The sweep removes it in a thread and logs when the thread is back: wait for the line
        # before stopping the server, which would cancel the sweeper between the two.
        await until_async(
            lambda: "removed persisted outputs past their retention" in server.logs(),
            30,
            "the sweeper's log line",
        )
        assert server.proc.poll() is None
    finally:
        server.stop()


def test_sweep_removes_only_runs_older_than_the_retention(tmp_path: Path) -> None:
    old, young = tmp_path / "t-a" / "old", tmp_path / "t-a" / "young"
    for d in (old, young):
        (d / "sub").mkdir(parents=True)
        (d / "sub" / "f").write_text("x")
    (tmp_path / "t-a" / "link").symlink_to(young)
    os.utime(old, (1000, 1000))
    assert outputs.sweep(tmp_path, 3600, time.time()) == 1
    assert not old.exists() and young.exists() and (tmp_path / "t-a" / "link").is_symlink()
