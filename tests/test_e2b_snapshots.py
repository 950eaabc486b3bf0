"""E2B snapshots through the unmodified E2B SDK (sync and async), on session snapshots.

`create_snapshot` keeps a sandbox's default context (its globals that pickle, its files) as a
snapshot of its tenant's while the sandbox runs on; `Sandbox.create(<snapshot id>)` starts new
sandboxes from it, each with a copy; `list_snapshots` and `delete_snapshot` see only the
caller's. One server, with a snapshot store (two snapshots per tenant); the jails: one source sandbox, two started from
its snapshot, one extra context and one per tenant check.
"""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2b import SandboxException
from e2b_code_interpreter import AsyncSandbox, Sandbox

from appliance.api.e2b import shapes
from appliance.api.e2b.registry import SnapshotEntry
from appliance.api.e2b.shapes import BadRequest
from tests.support import Server, start_server
from tests.test_e2b_sdk import ALICE, BOB, point_sdk, tenants_file, until


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("e2b-snaps-store") / "snapshots"


@pytest.fixture(scope="module")
def e2bsrv(tmp_path_factory: pytest.TempPathFactory, store: Path) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("e2b-snaps")
    tokens = tenants_file(tmp)
    srv = start_server(
        tmp,
        SANDBOX_AUTH_TOKENS_FILE=str(tokens),
        SANDBOX_SNAPSHOT_DIR=str(store),
        SANDBOX_POOL_SIZE="2",
        SANDBOX_MAX_SNAPSHOTS="2",
    )
    yield srv
    srv.stop()


@pytest.fixture(autouse=True)
def sdk_env(e2bsrv: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    point_sdk(monkeypatch, e2bsrv, ALICE)


def kept_snapshots(store: Path) -> list[Path]:
    """The snapshots the store holds now, of every tenant (`.new-*` ones being written aside)."""
    return [p for tenant in store.glob("t-*") for p in tenant.iterdir() if not p.name.startswith(".")]


def listed(**query: str) -> list[str]:
    return [s.snapshot_id for s in Sandbox.list_snapshots(**query).next_items()]


def test_a_snapshot_starts_sandboxes_that_each_get_its_state(store: Path) -> None:  # noqa: PLR0915 (one story)
    src = Sandbox.create(timeout=600)
    started: list[Sandbox] = []
    try:
        src.run_code("kept = 41")
        src.files.write("/home/user/notes.txt", "from the snapshot")

        # Refused, nothing taken, while more than the default context would be lost.
        ctx = src.create_code_context()
        with pytest.raises(SandboxException, match="default context only"):
            src.create_snapshot()
        src.remove_code_context(ctx)
        cmd = src.commands.run("sleep 60", background=True)
        with pytest.raises(SandboxException, match="commands are running"):
            src.create_snapshot()
        assert cmd.kill() is True
        assert until(lambda: cmd.pid not in {p.pid for p in src.commands.list()})
        assert kept_snapshots(store) == []

        snap = src.create_snapshot()
        assert snap.names == []
        assert src.run_code("kept + 1").text == "42"  # the source runs on
        assert [p.name for p in kept_snapshots(store)] == [snap.snapshot_id]  # one store entry

        one = Sandbox.create(snap.snapshot_id, timeout=600)
        started.append(one)
        two = Sandbox.create(snap.snapshot_id, timeout=600)
        started.append(two)
        for sb in (one, two):
            assert sb.sandbox_id != src.sandbox_id
            assert sb.run_code("kept").text == "41"
            assert sb.files.read("/home/user/notes.txt") == "from the snapshot"
            assert sb.get_info().template_id == snap.snapshot_id
        one.run_code("kept = 1")
        one.files.write("/home/user/notes.txt", "changed in one")
        assert two.run_code("kept").text == "41"
        assert two.files.read("/home/user/notes.txt") == "from the snapshot"
        assert src.run_code("kept").text == "41"

        # Named, and listed page by page, filtered by the sandbox it was taken of.
        named = src.create_snapshot(name="after-notes")
        assert named.names == ["after-notes"]
        with pytest.raises(SandboxException, match="SANDBOX_MAX_SNAPSHOTS"):  # 2 kept: the quota
            src.create_snapshot()
        assert listed() == [snap.snapshot_id, named.snapshot_id]
        assert listed(sandbox_id=src.sandbox_id) == [snap.snapshot_id, named.snapshot_id]
        assert listed(sandbox_id=one.sandbox_id) == []
        assert listed(name="after-notes") == [named.snapshot_id]
        pages = Sandbox.list_snapshots(limit=1)
        assert [s.snapshot_id for s in pages.next_items()] == [snap.snapshot_id]
        assert pages.has_next
        assert [s.snapshot_id for s in pages.next_items()] == [named.snapshot_id]
        assert not pages.has_next
        assert [s.snapshot_id for s in src.list_snapshots().next_items()] == [
            snap.snapshot_id,
            named.snapshot_id,
        ]

        # Deleted: gone from the list and the store; a sandbox can no longer start from it.
        assert Sandbox.delete_snapshot(named.snapshot_id) is True
        assert Sandbox.delete_snapshot(named.snapshot_id) is False
        assert listed() == [snap.snapshot_id]
        with pytest.raises(SandboxException, match="not on this server"):
            Sandbox.create(named.snapshot_id)
        with pytest.raises(SandboxException, match="not on this server"):
            Sandbox.create("after-notes")
        assert Sandbox.delete_snapshot(snap.snapshot_id) is True
        assert kept_snapshots(store) == []
        assert listed() == []
        with pytest.raises(SandboxException, match="not on this server"):
            Sandbox.create(snap.snapshot_id)
        assert one.run_code("kept").text == "1"  # sandboxes started from it live on
    finally:
        for sb in [src, *started]:
            sb.kill()


def test_another_tenant_cannot_list_use_or_delete_a_snapshot(e2bsrv: Server, store: Path) -> None:
    src = Sandbox.create(timeout=600)
    try:
        src.run_code("secret = 'alice'")
        snap = src.create_snapshot(name="alices")
    finally:
        src.kill()
    try:
        assert [s.snapshot_id for s in Sandbox.list_snapshots(api_key=BOB).next_items()] == []
        assert Sandbox.list_snapshots(sandbox_id=src.sandbox_id, api_key=BOB).next_items() == []
        for ref in (snap.snapshot_id, "alices"):
            with pytest.raises(SandboxException, match="not on this server") as caught:
                Sandbox.create(ref, api_key=BOB)
            assert "code-interpreter-v1" in str(caught.value)  # read as any unknown template
            assert Sandbox.delete_snapshot(ref, api_key=BOB) is False
        assert listed() == [snap.snapshot_id]  # still alice's, and whole
        assert len(kept_snapshots(store)) == 1
        with pytest.raises(SandboxException, match="server's own"):
            Sandbox.delete_snapshot("base")
    finally:
        # Deleted through the native API: the E2B list forgets it too.
        req = urllib.request.Request(
            f"{e2bsrv.http}/v1/snapshots/{snap.snapshot_id}",
            method="DELETE",
            headers={"Authorization": f"Bearer {ALICE}"},
        )
        with urllib.request.urlopen(req) as answer:
            assert answer.status in (200, 204)
    assert kept_snapshots(store) == []
    assert listed() == []
    assert Sandbox.delete_snapshot(snap.snapshot_id) is False


def test_the_async_sdk_snapshots_and_starts_from_it(store: Path) -> None:
    async def story() -> None:
        src = await AsyncSandbox.create(timeout=600)
        try:
            await src.run_code("kept = [1, 2]")
            snap = await src.create_snapshot()
            assert [s.snapshot_id for s in await AsyncSandbox.list_snapshots().next_items()] == [
                snap.snapshot_id
            ]
        finally:
            await src.kill()  # a snapshot outlives its sandbox
        new = await AsyncSandbox.create(snap.snapshot_id, timeout=600)
        try:
            assert (await new.run_code("sum(kept)")).text == "3"
        finally:
            await new.kill()
        assert await AsyncSandbox.delete_snapshot(snap.snapshot_id) is True

    asyncio.run(story())
    assert kept_snapshots(store) == []


def test_snapshot_listing_pages_and_names_are_checked() -> None:
    entries = [SnapshotEntry(f"id{i}", "t", f"sb{i % 2}", "n" if i == 3 else "", float(i)) for i in range(5)]
    page, token = shapes.snapshot_listing(entries, None, None, 2, None)
    assert [e.id for e in page] == ["id0", "id1"]
    page, token = shapes.snapshot_listing(entries, None, None, 2, token)
    assert [e.id for e in page] == ["id2", "id3"]
    page, token = shapes.snapshot_listing(entries, None, None, 2, token)
    assert ([e.id for e in page], token) == (["id4"], None)
    assert [e.id for e in shapes.snapshot_listing(entries, "sb1", None, 10, None)[0]] == ["id1", "id3"]
    assert [e.id for e in shapes.snapshot_listing(entries, None, "n", 10, None)[0]] == ["id3"]
    assert [e.id for e in shapes.snapshot_listing(entries, None, "id2", 10, None)[0]] == ["id2"]
    with pytest.raises(BadRequest):
        shapes.snapshot_listing(entries, None, None, 2, "garbage/x")
    for bad in ("", "a b", "base", "x" * 129, 7, "é"):
        with pytest.raises(BadRequest):
            shapes.snapshot_name(bad)
    assert shapes.snapshot_name(None) == ""
    assert shapes.snapshot_name("team/snap:v1") == "team/snap:v1"
