"""The MCP server, driven by the official SDK's own client: over stdio (`appliance mcp`, a
real subprocess) and over Streamable HTTP at /mcp, both against a real server and real jails."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import weakref
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
from mcp import ClientSession, StdioServerParameters, types
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import McpError
from pydantic import AnyUrl

from appliance import __version__
from appliance.api import mcp_tools
from appliance_client.cli import exec_url
from appliance_client.client import AsyncClient, Execution
from tests.models import write_tiny_llama, write_tiny_whisper
from tests.support import CHECKOUT_PATH, REPO, Server, scaled, start_server, until_async

TOKEN = "mcp-test-token-0123456789abcdef"
FIGURE = "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nNone"
# What each test session's `initialize` answered (the SDK keeps only the capabilities).
INITIALIZED: weakref.WeakKeyDictionary[ClientSession, types.InitializeResult] = weakref.WeakKeyDictionary()
WRITE_TWO = (
    "import os\nos.makedirs('outputs/sub dir', exist_ok=True)\n"
    "open('outputs/a.txt', 'w').write('alpha')\n"
    "open('outputs/sub dir/b.bin', 'wb').write(bytes(range(256)))"
)


@pytest.fixture(scope="module")
def authed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    base = tmp_path_factory.mktemp("mcp")
    srv = start_server(
        base,
        SANDBOX_PRELOAD="matplotlib",
        SANDBOX_AUTH_TOKEN=TOKEN,
        SANDBOX_SNAPSHOT_DIR=str(base / "snapshots"),
    )
    yield srv
    srv.stop()


@asynccontextmanager
async def over_stdio(
    server: Server | int, token: str | None = TOKEN, *extra: str
) -> AsyncIterator[ClientSession]:
    """`appliance mcp` as a desktop app starts it, for a server (or a port nothing may be on yet)."""
    port = server if isinstance(server, int) else server.port
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": CHECKOUT_PATH}
    if token:
        env["SANDBOX_AUTH_TOKEN"] = token
    params = StdioServerParameters(
        command=sys.executable,
        cwd=str(REPO),
        env=env,
        args=["-m", "appliance", "mcp", "--url", f"ws://127.0.0.1:{port}", *extra],
    )
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        INITIALIZED[session] = await session.initialize()
        yield session


@asynccontextmanager
async def over_http(server: Server, token: str = TOKEN) -> AsyncIterator[ClientSession]:
    headers = {"Authorization": f"Bearer {token}"}
    async with (
        httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(60, read=300)) as http,
        streamable_http_client(server.http + "/mcp", http_client=http) as (read, write, _),
        ClientSession(read, write) as session,
    ):
        INITIALIZED[session] = await session.initialize()
        yield session


TRANSPORTS = {"stdio": over_stdio, "http": over_http}


def text_of(result: types.CallToolResult) -> str:
    first = result.content[0]
    assert isinstance(first, types.TextContent)
    return first.text


@pytest.fixture(params=sorted(TRANSPORTS))
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


class TestBothTransports:
    async def test_the_tools_are_run_python_close_session_list_models_and_snapshots(
        self, authed: Server, transport: str
    ) -> None:
        async with TRANSPORTS[transport](authed) as mcp:
            listed = await mcp.list_tools()
            assert [t.name for t in listed.tools] == [
                "run_python",
                "close_session",
                "list_models",
                "snapshot_session",
                "restore_snapshot",
            ]
            assert listed.tools[0].inputSchema["required"] == ["code"]

    async def test_a_snapshot_of_the_session_restores_into_a_new_one(
        self, authed: Server, transport: str
    ) -> None:
        async with TRANSPORTS[transport](authed) as mcp:
            none = await mcp.call_tool("snapshot_session", {})
            assert none.isError and "no open session" in text_of(none)
            await mcp.call_tool(
                "run_python",
                {"code": "import threading\nx = 41\nlock = threading.Lock()", "keep_state": True},
            )
            taken = await mcp.call_tool("snapshot_session", {})
            assert not taken.isError, text_of(taken)
            info = json.loads(text_of(taken))
            assert info["skipped"] and info["skipped"][0].startswith("lock: ")
            await mcp.call_tool("run_python", {"code": "x = 0", "keep_state": True})
            restored = await mcp.call_tool("restore_snapshot", {"snapshot": info["snapshot"]})
            assert not restored.isError, text_of(restored)
            after = await mcp.call_tool("run_python", {"code": "x + 1", "keep_state": True})
            assert "--- result ---\n42" in text_of(after)
            unknown = await mcp.call_tool("restore_snapshot", {"snapshot": "0" * 32})
            assert unknown.isError and "no such snapshot" in text_of(unknown)
            await mcp.call_tool("close_session", {})

    async def test_a_figure_comes_back_as_image_content(self, authed: Server, transport: str) -> None:
        async with TRANSPORTS[transport](authed) as mcp:
            result = await mcp.call_tool("run_python", {"code": FIGURE})
            assert not result.isError, text_of(result)
            images = [c for c in result.content if isinstance(c, types.ImageContent)]
            assert len(images) == 1 and images[0].mimeType == "image/png"
            assert base64.b64decode(images[0].data).startswith(b"\x89PNG")
            assert "image #1 attached" in text_of(result)

    async def test_a_session_keeps_state_and_one_shot_calls_do_not(
        self, authed: Server, transport: str
    ) -> None:
        async with TRANSPORTS[transport](authed) as mcp:
            first = await mcp.call_tool("run_python", {"code": "x = 41", "keep_state": True})
            assert not first.isError, text_of(first)
            second = await mcp.call_tool("run_python", {"code": "x + 1", "keep_state": True})
            assert "--- result ---\n42" in text_of(second)
            alone = await mcp.call_tool("run_python", {"code": "x"})
            assert alone.isError and "NameError" in text_of(alone)
            closed = await mcp.call_tool("close_session", {})
            assert text_of(closed) == "session closed"
            after = await mcp.call_tool("run_python", {"code": "x", "keep_state": True})
            assert after.isError and "NameError" in text_of(after)

    async def test_files_go_in_and_outputs_come_back_as_embedded_resources(
        self, authed: Server, transport: str
    ) -> None:
        code = (
            "import os\nos.makedirs('outputs', exist_ok=True)\n"
            "open('outputs/upper.txt', 'w').write(open('in.txt').read().upper())"
        )
        async with TRANSPORTS[transport](authed) as mcp:
            result = await mcp.call_tool(
                "run_python", {"code": code, "files": [{"path": "in.txt", "content": "hello"}]}
            )
            assert not result.isError, text_of(result)
            resources = [c for c in result.content if isinstance(c, types.EmbeddedResource)]
            assert len(resources) == 1
            blob = resources[0].resource
            assert isinstance(blob, types.BlobResourceContents)
            assert str(blob.uri).endswith("/outputs/upper.txt") and blob.mimeType == "text/plain"
            assert base64.b64decode(blob.blob) == b"HELLO"
            assert "outputs/upper.txt (5 bytes)" in text_of(result)

    async def test_server_info_names_the_appliance_and_its_version(
        self, authed: Server, transport: str
    ) -> None:
        async with TRANSPORTS[transport](authed) as mcp:
            info = INITIALIZED[mcp]
        assert info.serverInfo.name == "appliance" and info.serverInfo.version == __version__, info.serverInfo
        assert info.capabilities.resources is not None and info.capabilities.tools is not None

    async def test_output_files_are_listed_and_read_as_resources(
        self, authed: Server, transport: str
    ) -> None:
        async with TRANSPORTS[transport](authed) as mcp:
            assert (await mcp.list_resources()).resources == []
            result = await mcp.call_tool("run_python", {"code": WRITE_TWO})
            assert not result.isError, text_of(result)
            embedded = {
                str(c.resource.uri): c.resource
                for c in result.content
                if isinstance(c, types.EmbeddedResource)
            }
            listed = {str(r.uri): r for r in (await mcp.list_resources()).resources}
            assert set(listed) == set(embedded) and len(listed) == 2, (listed, embedded)
            by_name = {r.name: r for r in listed.values()}
            assert set(by_name) == {"a.txt", "sub dir/b.bin"}
            assert by_name["a.txt"].mimeType == "text/plain" and by_name["a.txt"].size == 5
            read = await mcp.read_resource(by_name["sub dir/b.bin"].uri)
            (content,) = read.contents
            assert isinstance(content, types.BlobResourceContents)
            assert base64.b64decode(content.blob) == bytes(range(256))
            text = (await mcp.read_resource(by_name["a.txt"].uri)).contents[0]
            assert isinstance(text, types.BlobResourceContents) and base64.b64decode(text.blob) == b"alpha"
            with pytest.raises(McpError) as unknown:
                await mcp.read_resource(AnyUrl("appliance://runs/0123456789abcdef/outputs/a.txt"))
            assert unknown.value.error.code == -32002 and "this MCP session" in unknown.value.error.message
        # Another MCP session (same caller) sees none of them.
        async with TRANSPORTS[transport](authed) as other:
            assert (await other.list_resources()).resources == []
            with pytest.raises(McpError):
                await other.read_resource(by_name["a.txt"].uri)

    async def test_bad_arguments_are_an_error_result_naming_the_problem(
        self, authed: Server, transport: str
    ) -> None:
        async with TRANSPORTS[transport](authed) as mcp:
            result = await mcp.call_tool("run_python", {"code": 5})
            assert result.isError and "'code' is required and must be a string" in text_of(result)


@pytest.fixture(scope="module")
def with_models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("mcp-models")
    os.chmod(root, 0o755)
    write_tiny_llama(root / "tiny-llama.gguf")
    write_tiny_whisper(root / "tiny-whisper.bin")
    srv = start_server(
        tmp_path_factory.mktemp("mcp-models-srv"), SANDBOX_AUTH_TOKEN=TOKEN, SANDBOX_MODELS_DIR=str(root)
    )
    yield srv
    srv.stop()


class TestListModels:
    async def test_list_models_gives_the_catalogue_of_get_v1_models(
        self, with_models: Server, transport: str
    ) -> None:
        async with TRANSPORTS[transport](with_models) as mcp, AsyncClient(with_models.url, TOKEN) as client:
            result = await mcp.call_tool("list_models", {})
            assert not result.isError, text_of(result)
            listed = json.loads(text_of(result))["models"]
            assert listed == await client.models()  # one catalogue, whichever way it is asked
        assert [(m["name"], m["kind"]) for m in listed] == [
            ("tiny-llama.gguf", "llm"),
            ("tiny-whisper.bin", "whisper"),
        ]
        assert listed[0]["architecture"] == "llama" and listed[0]["error"] is None

    async def test_without_a_models_directory_list_models_says_so(
        self, authed: Server, transport: str
    ) -> None:
        async with TRANSPORTS[transport](authed) as mcp:
            result = await mcp.call_tool("list_models", {})
        assert not result.isError and "SANDBOX_MODELS_DIR" in text_of(result)


class TestHttpAuth:
    @pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}])
    def test_mcp_without_the_token_is_401(self, authed: Server, headers: dict[str, str]) -> None:
        body = {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "initialize",
            "params": {
                "protocolVersion": "2025-06-18",
                "capabilities": {},
                "clientInfo": {"name": "t", "version": "0"},
            },
        }
        reply = httpx.post(
            authed.http + "/mcp",
            json=body,
            headers={**headers, "Accept": "application/json, text/event-stream"},
        )
        assert reply.status_code == 401 and reply.headers["WWW-Authenticate"] == "Bearer"

    async def test_the_sdk_client_with_a_wrong_token_cannot_connect(self, authed: Server) -> None:
        # PT011: the SDK surfaces it inside a task group (an exception group); the repr is checked below.
        with pytest.raises(BaseException) as caught:  # noqa: PT011
            async with over_http(authed, token="wrong-token"):
                pass
        assert "401" in repr(caught.value) or "Unauthorized" in repr(caught.value)


class TestSessionLifetime:
    async def test_a_keep_state_session_ends_with_its_mcp_session(
        self, authed: Server, transport: str
    ) -> None:
        async with TRANSPORTS[transport](authed) as mcp:
            opened = await mcp.call_tool("run_python", {"code": "y = 1", "keep_state": True})
            session = re.search(r"session ([0-9a-f]{16,})", text_of(opened))
            assert session, text_of(opened)
            async with AsyncClient(authed.url, TOKEN) as client:
                alive = await client.execute("y", session=session.group(1))
                assert alive.text == "1"
        # The MCP session ended (HTTP: the client's DELETE; stdio: the process exited), and
        # its appliance session with it, not at the idle timeout. The close follows the end
        # (the SDK answers the DELETE first), so it is waited for, well within the idle timeout.
        tries: list[Execution] = []
        async with AsyncClient(authed.url, TOKEN) as client:

            async def ended() -> bool:
                tries.append(await client.execute("y", session=session.group(1)))
                return tries[-1].status == "rejected"

            closed: bool = await until_async(ended, 10, "the appliance session closed with the MCP session")
        assert closed and "no such session" in (tries[-1].message or ""), tries[-1].frames


class TestStdioCli:
    def test_a_wrong_token_ends_the_stdio_server_with_a_message(self, authed: Server) -> None:
        env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": CHECKOUT_PATH, "SANDBOX_AUTH_TOKEN": "wrong"}
        proc = subprocess.run(
            [sys.executable, "-m", "appliance", "mcp", "--url", f"ws://127.0.0.1:{authed.port}"],
            cwd=REPO,
            env=env,
            input=b"",
            capture_output=True,
            timeout=scaled(60),
        )
        assert proc.returncode == 1 and proc.stdout == b""
        assert b"refused the connection (HTTP 401)" in proc.stderr and b"check the token" in proc.stderr

    def test_a_bare_host_and_port_means_its_exec_endpoint(self) -> None:
        assert exec_url("ws://127.0.0.1:9100") == "ws://127.0.0.1:9100/exec"
        assert exec_url("wss://h/exec") == "wss://h/exec"


ALICE = "alice-mcp-0123456789abcdef"
BOB = "bob-mcp-0123456789abcdef"


@pytest.fixture(scope="module")
def two_tenants(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    base = tmp_path_factory.mktemp("mcp-tenants")
    path = base / "tokens.toml"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(
            f'[[tenant]]\nname = "alice"\ntoken = "{ALICE}"\n\n[[tenant]]\nname = "bob"\ntoken = "{BOB}"\n'
        )
    srv = start_server(base, SANDBOX_AUTH_TOKENS_FILE=str(path))
    yield srv
    srv.stop()


class TestResourcesAcrossTenants:
    async def test_another_tenant_can_neither_list_nor_read_a_runs_files(self, two_tenants: Server) -> None:
        async with over_http(two_tenants, ALICE) as alice:
            result = await alice.call_tool("run_python", {"code": WRITE_TWO})
            assert not result.isError, text_of(result)
            uris = [r.uri for r in (await alice.list_resources()).resources]
            assert len(uris) == 2
            async with over_http(two_tenants, BOB) as bob:
                assert (await bob.list_resources()).resources == []
                for uri in uris:
                    with pytest.raises(McpError) as refused:
                        await bob.read_resource(uri)
                    assert refused.value.error.code == -32002
            assert (await alice.read_resource(uris[0])).contents  # still hers


def resource(uri: str, size: int) -> mcp_tools.OutputResource:
    return mcp_tools.OutputResource(
        uri=uri, path=uri.rsplit("/", 1)[1], run="r", mime="text/plain", data=b"x" * size
    )


class TestResourceBounds:
    """Pure: what the sessions of one server keep of their runs' files is bounded per session
    and for all sessions together, so many MCP sessions cannot add up to the server's memory."""

    def test_all_sessions_together_keep_at_most_the_servers_budget_oldest_dropped_first(self) -> None:
        budget = mcp_tools.ResourceBudget(limit=100)
        first, second = mcp_tools.ResourceStore(budget), mcp_tools.ResourceStore(budget)
        first.add(resource("appliance://runs/r/outputs/a", 40))
        second.add(resource("appliance://runs/r/outputs/b", 40))
        first.add(resource("appliance://runs/r/outputs/c", 40))  # 120 > 100: the oldest (a) goes
        assert list(first.items) == ["appliance://runs/r/outputs/c"] and first.size == 40
        assert list(second.items) == ["appliance://runs/r/outputs/b"]
        assert budget.size == 80 == first.size + second.size
        second.clear()  # its MCP session ended
        assert budget.size == 40 and not second.items
        first.add(resource("appliance://runs/r/outputs/c", 10))  # the same URI again replaces it
        assert budget.size == 10 == first.size
        first.add(resource("appliance://runs/r/outputs/huge", 101))  # bigger than the budget: not kept
        assert "appliance://runs/r/outputs/huge" not in first.items and budget.size == 10

    def test_one_session_keeps_at_most_its_own_count_of_files(self) -> None:
        store = mcp_tools.ResourceStore(mcp_tools.ResourceBudget())
        for i in range(mcp_tools.RESOURCE_FILES + 5):
            store.add(resource(f"appliance://runs/r/outputs/f{i}", 1))
        assert len(store.items) == mcp_tools.RESOURCE_FILES and store.budget.size == mcp_tools.RESOURCE_FILES
        assert next(iter(store.items)).endswith("/f5")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class CuttableProxy:
    """A TCP proxy to a local port whose open connections the test can cut at once."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.port = 0
        self.accepted = 0
        self._writers: list[asyncio.StreamWriter] = []
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> CuttableProxy:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.cut()
        if self._server is not None:
            self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        self._writers += [writer, up_writer]

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError, OSError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))

    async def cut(self) -> int:
        """Abort every open connection (no close handshake: as a network drop); how many."""
        writers, self._writers = self._writers, []
        for writer in writers:
            writer.transport.abort()
        return len(writers) // 2


class TestTheStdioBridgeOutlivesTheAppliance:
    """A desktop app starts `appliance mcp` once; the appliance may start later, stop and come
    back. The SDK's own client drives a real bridge process against a real server that is
    started, stopped and started again on the same port."""

    async def test_it_starts_before_the_appliance_and_works_once_it_is_up(self, tmp_path: Path) -> None:
        port = free_port()
        async with over_stdio(port, TOKEN, "--reconnect-s", "0") as mcp:
            assert INITIALIZED[mcp].serverInfo.name == "appliance"
            assert "run_python" in {t.name for t in (await mcp.list_tools()).tools}
            down = await mcp.call_tool("run_python", {"code": "2 + 2"})
            assert (
                down.isError
                and f"appliance unreachable at ws://127.0.0.1:{port}/exec, retrying" in text_of(down)
            ), text_of(down)
            server = start_server(tmp_path / "first", port=port, SANDBOX_AUTH_TOKEN=TOKEN)
            try:
                up = await mcp.call_tool("run_python", {"code": "2 + 2"})
                assert not up.isError and "--- result ---\n4" in text_of(up), text_of(up)
                kept = await mcp.call_tool("run_python", {"code": "x = 41", "keep_state": True})
                assert not kept.isError, text_of(kept)
                resumed = await mcp.call_tool("run_python", {"code": "x + 1", "keep_state": True})
                assert "--- result ---\n42" in text_of(resumed), text_of(resumed)
            finally:
                server.stop()
            gone = await mcp.call_tool("run_python", {"code": "x + 1", "keep_state": True})
            assert gone.isError and "unreachable" in text_of(gone), text_of(gone)
            again = start_server(tmp_path / "second", port=port, SANDBOX_AUTH_TOKEN=TOKEN)
            try:
                # A one-shot call works again on the same bridge, without restarting it ...
                plain = await mcp.call_tool("run_python", {"code": "6 * 7"})
                assert not plain.isError and "--- result ---\n42" in text_of(plain), text_of(plain)
                # ... and the session the restarted appliance no longer has is said to be lost,
                lost = await mcp.call_tool("run_python", {"code": "x + 1", "keep_state": True})
                assert lost.isError and "status: not run" in text_of(lost), text_of(lost)
                assert "session" in text_of(lost) and "keep_state=true again" in text_of(lost), text_of(lost)
                # after which keep_state opens a new one.
                fresh = await mcp.call_tool("run_python", {"code": "x = 5\nx", "keep_state": True})
                assert not fresh.isError and "--- result ---\n5" in text_of(fresh), text_of(fresh)
            finally:
                again.stop()

    async def test_a_dropped_connection_resumes_the_session_the_appliance_still_has(
        self, authed: Server
    ) -> None:
        """The connection drops (a proxy in between cuts it) but the appliance stays up: the
        next call reconnects and the keep_state session goes on with its variables."""
        async with CuttableProxy(authed.port) as proxy, over_stdio(proxy.port, TOKEN) as mcp:
            first = await mcp.call_tool("run_python", {"code": "x = 41", "keep_state": True})
            assert not first.isError, text_of(first)
            cut = await proxy.cut()
            assert cut >= 1  # the bridge's WebSocket was open through the proxy
            after = await mcp.call_tool("run_python", {"code": "x + 1", "keep_state": True})
            assert not after.isError and "--- result ---\n42" in text_of(after), text_of(after)
            assert proxy.accepted >= 2  # it did reconnect

    async def test_a_call_made_while_the_appliance_is_down_waits_for_it_with_backoff(
        self, tmp_path: Path
    ) -> None:
        port = free_port()
        async with over_stdio(port, TOKEN, "--reconnect-s", str(scaled(300))) as mcp:
            call = asyncio.create_task(mcp.call_tool("run_python", {"code": "print('came back')"}))
            # The call is in flight (the bridge retrying) while the appliance starts.
            server = await asyncio.to_thread(
                start_server, tmp_path / "late", port=port, SANDBOX_AUTH_TOKEN=TOKEN
            )
            try:
                result = await call
            finally:
                server.stop()
        assert not result.isError and "came back" in text_of(result), text_of(result)
