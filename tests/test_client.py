"""The Python client speaks the protocol's types: typed arguments in, typed parts out."""

from __future__ import annotations

import asyncio
import base64
import json
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from appliance_client import agents
from appliance_client.client import (
    AsyncClient,
    AuthenticationError,
    Client,
    ClientError,
    ConnectionFailed,
    ConnectionLost,
    DoneEvent,
    ErrorEvent,
    Event,
    Execution,
    ExecutionError,
    FileEvent,
    InvalidURL,
    Output,
    OutputFile,
    ResultEvent,
    SessionLost,
    StartEvent,
    StderrEvent,
    StdoutEvent,
    event,
    http_base,
    normalise_url,
    request_frame,
)
from appliance_client.protocol import GpuRequest
from tests.support import Server, start_server

T = TypeVar("T")
PNG = b"\x89PNG\r\n\x1a\n fake"


class TestArguments:
    def test_files_are_a_mapping_of_path_to_bytes_or_text_sent_as_base64(self) -> None:
        frame = request_frame("1", "r1", files={"a.bin": b"\x00\x01", "b.txt": "hé"}, timeout_ms=500)
        assert frame["files"] == [
            {"path": "a.bin", "data": "AAE="},
            {"path": "b.txt", "data": base64.b64encode("hé".encode()).decode()},
        ]
        assert frame["timeout_ms"] == 500 and frame["type"] == "execute" and frame["id"] == "r1"

    async def test_a_client_used_outside_async_with_says_so(self) -> None:
        # A RuntimeError that names the fix, not an assert (python -O drops those).
        with pytest.raises(RuntimeError, match="not connected: use `async with`"):
            await AsyncClient("ws://127.0.0.1:9/exec").send({"type": "interrupt", "id": "r1"})

    def test_files_given_as_the_wire_list_is_a_clear_type_error(self) -> None:
        wire = [{"path": "a", "data": "aGk="}]
        with pytest.raises(TypeError, match=r"files must be a mapping of path -> bytes or str.*got list"):
            request_frame("1", "r1", files=wire)  # type: ignore[arg-type]

    @pytest.mark.parametrize(
        ("options", "problem"),
        [
            ({"files": {"a": 5}}, "files\\['a'\\] must be bytes or str, got int"),
            ({"files": {7: b""}}, "a path must be a str, got int"),
            ({"timeout_ms": True}, "timeout_ms must be an int"),
            ({"timeout_ms": "15s"}, "timeout_ms must be an int"),
            ({"session": 3}, "session must be str, got int"),
            ({"gpu": 2048}, "gpu must be a GpuRequest or a mapping"),
            ({"stdin_eof": "yes"}, "stdin_eof must be bool"),
            ({"egress_allow": "api.example.com:443"}, "egress_allow must be a list"),
            ({"timeuot_ms": 5}, "unexpected keyword argument\\(s\\): timeuot_ms"),
        ],
    )
    def test_a_wrong_argument_is_a_type_error_naming_it(self, options: dict[str, Any], problem: str) -> None:
        with pytest.raises(TypeError, match=problem):
            request_frame("1", "r1", **options)

    def test_code_must_be_text(self) -> None:
        with pytest.raises(TypeError, match="code must be str, got bytes"):
            request_frame(b"print(1)", "r1")  # type: ignore[arg-type]

    def test_gpu_is_a_gpu_request_or_its_wire_mapping(self) -> None:
        assert request_frame("1", "r1", gpu=GpuRequest(memory_mb=512))["gpu"] == {"memory_mb": 512}
        assert request_frame("1", "r1", gpu={"memory_mb": 512})["gpu"] == {"memory_mb": 512}

    def test_unset_options_stay_off_the_wire(self) -> None:
        assert request_frame("1", "r1", session=None, timeout_ms=None, files={}, stdin_eof=False) == {
            "type": "execute",
            "id": "r1",
            "code": "1",
        }
        assert request_frame("1", "r1", stdin_eof=True)["stdin_eof"] is True
        allow = request_frame("1", "r1", egress_allow=("api.example.com:443",))["egress"]
        assert allow == {"allow": ["api.example.com:443"]}


def gathered(*frames: dict[str, Any]) -> Execution:
    ex = Execution(id="r1")
    for frame in frames:
        ex.add({"id": "r1", **frame})
    return ex


class TestExecution:
    def test_figures_are_in_results_with_the_cells_value_and_displays_is_their_alias(self) -> None:
        ex = gathered(
            {
                "type": "display",
                "data": {"text/plain": "<Figure>", "image/png": base64.b64encode(PNG).decode()},
            },
            {
                "type": "result",
                "data": {"text/plain": "42", "text/html": "<b>42</b>", "application/json": {"v": 42}},
            },
        )
        shown, result = ex.results
        assert isinstance(shown, Output) and ex.results[0].png == PNG and shown.text == "<Figure>"
        assert (
            not shown.is_main_result and shown.html is None and shown.formats() == ["text/plain", "image/png"]
        )
        assert result.is_main_result and result.text == "42" and result.html == "<b>42</b>"
        assert result.json == {"v": 42} and result.png is None
        assert ex.displays == [shown] and ex.text == "42"
        assert ex.results[1] == {"text/plain": "42", "text/html": "<b>42</b>", "application/json": {"v": 42}}

    def test_the_text_is_the_main_results_not_a_later_displays(self) -> None:
        ex = gathered(
            {"type": "result", "data": {"text/plain": "1"}},
            {"type": "display", "data": {"text/plain": "<Figure>"}},
        )
        assert ex.text == "1"
        assert gathered({"type": "display", "data": {"text/plain": "<Figure>"}}).text is None

    def test_the_error_is_typed_and_still_reads_as_its_frame(self) -> None:
        ex = gathered(
            {
                "type": "error",
                "ename": "ZeroDivisionError",
                "evalue": "division by zero",
                "traceback": ["Traceback", "ZeroDivisionError: division by zero"],
            },
            {"type": "done", "status": "error", "exit_code": 1},
        )
        assert ex.error == ExecutionError(
            "ZeroDivisionError", "division by zero", ["Traceback", "ZeroDivisionError: division by zero"], {}
        )
        assert ex.error.name == "ZeroDivisionError" and ex.error.value == "division by zero"
        assert ex.error["ename"] == "ZeroDivisionError" and ex.error.get("evalue") == "division by zero"
        assert ex.status == "error" and ex.exit_code == 1

    def test_files_are_typed_with_their_bytes_decoded(self) -> None:
        ex = gathered(
            {"type": "file", "path": "r.txt", "size": 6, "data": base64.b64encode(b"result").decode()},
            {"type": "file", "path": "big.bin", "size": 10**6, "data": None, "message": "too big"},
        )
        small, big = ex.files
        assert isinstance(small, OutputFile) and small.path == "r.txt" and small.bytes == b"result"
        assert small.size == 6 and small["size"] == 6 and ex.file("r.txt") is small
        assert big.bytes is None and big.message == "too big" and big["data"] is None
        assert ex.file_bytes("r.txt") == b"result"
        with pytest.raises(KeyError):
            ex.file_bytes("big.bin")
        with pytest.raises(KeyError):
            ex.file("absent")

    def test_a_file_whose_data_is_not_base64_is_a_client_error(self) -> None:
        with pytest.raises(ClientError, match="not base64"):
            gathered({"type": "file", "path": "x", "size": 1, "data": "***"})

    @pytest.mark.parametrize(
        ("status", "name"),
        [
            ("timeout", "Timeout"),
            ("memory_limit", "MemoryLimit"),
            ("gpu_memory_limit", "GpuMemoryLimit"),
            ("output_limit", "OutputLimit"),
            ("cancelled", "Cancelled"),
            ("rejected", "Rejected"),
            ("busy", "Busy"),
            ("internal", "InternalError"),
        ],
    )
    def test_every_status_but_ok_has_a_typed_error(self, status: str, name: str) -> None:
        ex = gathered({"type": "done", "status": status, "message": f"why {status}"})
        assert ex.error, status  # so `if ex.error:` catches it
        assert (ex.error.name, ex.error.value, ex.error.status) == (name, f"why {status}", status)
        assert not ex.error.raised and ex.error["status"] == status and not ex.ok
        silent = gathered({"type": "done", "status": status})
        assert silent.error is not None and silent.error.value, (
            "without a message it still says what happened"
        )

    def test_ok_has_no_error_and_a_code_error_stays_the_codes(self) -> None:
        assert gathered({"type": "done", "status": "ok"}).error is None
        raised = {"type": "error", "ename": "ValueError", "evalue": "bad", "traceback": ["tb"]}
        ex = gathered(raised, {"type": "done", "status": "error", "exit_code": 1})
        assert ex.error is not None and ex.error.name == "ValueError" and ex.error.raised
        # Under a memory limit the code's own MemoryError is the error, with the status beside it.
        oom = {"type": "error", "ename": "MemoryError", "evalue": "", "traceback": ["tb"]}
        ex = gathered(oom, {"type": "done", "status": "memory_limit", "message": "over 256 MiB"})
        assert ex.error is not None and (ex.error.name, ex.error.status) == ("MemoryError", "memory_limit")
        assert ex.error["ename"] == "MemoryError" and ex.error.raised

    def test_a_status_error_reads_like_an_error_frame_too(self) -> None:
        ex = gathered({"type": "done", "status": "busy", "message": "queue full"})
        assert ex.error is not None and (ex.error["ename"], ex.error.get("evalue")) == ("Busy", "queue full")
        assert ex.error["traceback"] == [] and ex.error["status"] == "busy"

    def test_a_timeout_that_stopped_the_code_keeps_where_it_was(self) -> None:
        ex = gathered(
            {"type": "error", "ename": "KeyboardInterrupt", "evalue": "", "traceback": ["in sleep()"]},
            {"type": "done", "status": "timeout", "message": "the run exceeded its 1000 ms time limit"},
        )
        assert ex.error is not None and ex.error.name == "Timeout" and ex.error.traceback == ["in sleep()"]

    def test_a_non_zero_exit_without_an_exception_says_its_code(self) -> None:
        ex = gathered({"type": "done", "status": "error", "exit_code": 3})
        assert ex.error is not None and ex.error.name == "NonZeroExit" and "code 3" in ex.error.value


class TestEvents:
    def test_each_frame_type_gets_its_typed_event_and_stays_the_wire_dict(self) -> None:
        frames: list[dict[str, Any]] = [
            {"type": "start", "id": "r1", "run": "run-1", "session": None},
            {"type": "stream", "id": "r1", "name": "stdout", "text": "hi\n"},
            {"type": "stream", "id": "r1", "name": "stderr", "text": "oops\n"},
            {"type": "display", "id": "r1", "data": {"image/png": base64.b64encode(PNG).decode()}},
            {"type": "result", "id": "r1", "data": {"text/plain": "42"}},
            {"type": "error", "id": "r1", "ename": "E", "evalue": "v", "traceback": []},
            {"type": "file", "id": "r1", "path": "a", "size": 1, "data": "eA=="},
            {"type": "done", "id": "r1", "status": "ok", "exit_code": 0},
            {"type": "from_the_future", "id": "r1"},
        ]
        events = [event(f) for f in frames]
        kinds = [type(e) for e in events]
        assert kinds == [
            StartEvent,
            StdoutEvent,
            StderrEvent,
            ResultEvent,
            ResultEvent,
            ErrorEvent,
            FileEvent,
            DoneEvent,
            Event,
        ]
        assert events == frames and json.loads(json.dumps(events)) == frames
        start, out, err, shown, value, raised, wrote, done, _ = events
        assert isinstance(start, StartEvent) and start.run == "run-1"
        assert isinstance(out, StdoutEvent) and out.text == "hi\n" and out["name"] == "stdout"
        assert isinstance(err, StderrEvent) and err.text == "oops\n"
        assert isinstance(shown, ResultEvent) and shown.result.png == PNG and not shown.result.is_main_result
        assert isinstance(value, ResultEvent) and value.result.is_main_result and value.result.text == "42"
        assert isinstance(raised, ErrorEvent) and raised.error.name == "E"
        assert isinstance(wrote, FileEvent) and wrote.file.bytes == b"x"
        assert isinstance(done, DoneEvent) and done.ok and done.exit_code == 0 and done.type == "done"


class TestURLs:
    @pytest.mark.parametrize(
        ("given", "url"),
        [
            ("ws://h:9100/exec", "ws://h:9100/exec"),
            ("ws://h:9100", "ws://h:9100/exec"),
            ("ws://h:9100/", "ws://h:9100/exec"),
            ("http://h:9100", "ws://h:9100/exec"),
            ("http://h:9100/exec", "ws://h:9100/exec"),
            ("https://h.example", "wss://h.example/exec"),
            ("wss://h.example/exec/", "wss://h.example/exec"),
            ("HTTPS://h.example/sandbox", "wss://h.example/sandbox/exec"),
            ("  ws://[::1]:9100 ", "ws://[::1]:9100/exec"),
        ],
    )
    def test_ws_wss_http_https_with_or_without_exec(self, given: str, url: str) -> None:
        assert normalise_url(given) == url
        assert AsyncClient(given).url == url

    @pytest.mark.parametrize("given", ["127.0.0.1:9100", "ftp://h/exec", "ws://", "", "/exec"])
    def test_anything_else_is_refused_at_once_naming_the_forms(self, given: str) -> None:
        with pytest.raises(InvalidURL, match="give ws://HOST:PORT"):
            AsyncClient(given)
        with pytest.raises(ValueError, match="not an appliance URL"):
            normalise_url(given)

    def test_the_http_base_follows_the_websocket(self) -> None:
        assert http_base("ws://h:9100") == "http://h:9100"
        assert http_base("wss://h/sandbox/exec") == "https://h/sandbox"


TOKEN = "client-test-token"


@pytest.fixture(scope="module")
def typed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(
        tmp_path_factory.mktemp("client"),
        SANDBOX_MAX_FILE_OUT_BYTES="1000",
        SANDBOX_MAX_OUTPUT_BYTES="100000",
        SANDBOX_AUTH_TOKEN=TOKEN,
        SANDBOX_SNAPSHOT_DIR=str(tmp_path_factory.mktemp("client-snapshots") / "store"),
    )
    yield srv
    srv.stop()


RICH = (
    "import os\n"
    "class Rich:\n"
    "    def _repr_html_(self): return '<i>rich</i>'\n"
    f"    def _repr_png_(self): return {PNG!r}\n"
    "    def __repr__(self): return 'Rich()'\n"
    "display(Rich())\n"
    "os.makedirs('outputs', exist_ok=True)\n"
    "open('outputs/small.txt', 'w').write(open('in.txt').read().upper())\n"
    "open('outputs/big.bin', 'wb').write(b'x' * 5000)\n"
    "print('printed')\n"
    "Rich()"
)


async def test_a_real_run_comes_back_as_typed_parts(typed: Server) -> None:
    async with AsyncClient(typed.url, TOKEN) as c:
        ex = await c.execute(RICH, files={"in.txt": "uploaded"}, timeout_ms=20000)
    assert ex.status == "ok" and ex.ok and ex.error is None, ex.frames
    assert ex.stdout == "printed\n" and ex.text == "Rich()"
    shown, value = ex.results
    assert shown.png == PNG and shown.html == "<i>rich</i>" and not shown.is_main_result
    assert value.is_main_result and value.html == "<i>rich</i>" and ex.displays == [shown]
    files = {f.path: f for f in ex.files}
    assert files["small.txt"].bytes == b"UPLOADED" and files["small.txt"].size == 8
    assert files["big.bin"].bytes is None and files["big.bin"].size == 5000 and files["big.bin"].message


async def test_a_real_error_is_typed(typed: Server) -> None:
    async with AsyncClient(typed.url, TOKEN) as c:
        ex = await c.execute("def f():\n    return 1 / 0\nf()")
    assert ex.status == "error" and ex.error is not None
    assert (ex.error.name, ex.error.value) == ("ZeroDivisionError", "division by zero")
    assert any("return 1 / 0" in line for line in ex.error.traceback)


@pytest.mark.parametrize(
    ("code", "options", "name"),
    [
        ("import time\ntime.sleep(60)", {"timeout_ms": 1000}, "Timeout"),
        ("print('x' * 300_000)", {}, "OutputLimit"),
        ("1", {"session": "0" * 32}, "Rejected"),
        ("import sys\nsys.exit(3)", {}, "NonZeroExit"),
    ],
)
async def test_real_limits_and_refusals_are_typed_errors(
    typed: Server, code: str, options: dict[str, Any], name: str
) -> None:
    async with AsyncClient(typed.url, TOKEN) as c:
        ex = await c.execute(code, **options)
    assert ex.error, ex.frames  # `if ex.error:` catches every one of them
    assert ex.error.name == name and ex.error.status == ex.status != "ok" and ex.error.value


async def test_a_wrong_argument_fails_before_anything_is_sent_and_the_connection_stays_usable(
    typed: Server,
) -> None:
    async with AsyncClient(typed.url, TOKEN) as c:
        with pytest.raises(TypeError, match="files must be a mapping"):
            await c.execute("print('never')", id="bad", files=[{"path": "a", "data": ""}])  # type: ignore[arg-type]
        after = await c.execute("print('after')")
    assert after.status == "ok" and after.stdout == "after\n"
    assert c.unrouted == [], "the bad request must never have reached the server"


def test_the_sync_client_and_its_session_take_the_same_typed_arguments(typed: Server) -> None:
    with Client(typed.url, TOKEN) as c:
        ex = c.execute("print(open('a.txt').read())", files={"a.txt": b"sync"})
        with c.session() as s:
            s.execute("x = 20", timeout_ms=10000)
            again = s.execute("x + 1")
            with pytest.raises(TypeError, match="sets 'session' and 'from_snapshot' itself"):
                s.execute("1", session="other")  # type: ignore[call-arg]
    assert ex.stdout == "sync\n" and again.text == "21" and again.session


def test_a_session_snapshot_forks_into_new_sessions(typed: Server) -> None:
    with Client(typed.url, TOKEN) as c:
        with c.session() as s:
            with pytest.raises(ClientError, match="not open yet"):
                s.snapshot()
            s.execute("import threading\nx = 20\nlock = threading.Lock()")
            taken = s.snapshot()
            s.execute("x = 0")  # the session goes on; the snapshot keeps x = 20
        assert taken["skipped"][0].startswith("lock: ") and c.snapshot_info(taken["snapshot"]) == taken
        with c.session(from_snapshot=taken["snapshot"]) as fork:
            first = fork.execute("x += 1\nx")
            second = fork.execute("x")
        with c.session(from_snapshot=taken["snapshot"]) as other:
            other_x = other.execute("x")
        c.delete_snapshot(taken["snapshot"])
        with pytest.raises(ClientError, match="404"):
            c.snapshot_info(taken["snapshot"])
    assert (first.text, second.text, other_x.text) == ("21", "21", "20")
    assert fork.id is None and first.session != other_x.session


async def test_the_async_client_takes_and_restores_snapshots(typed: Server) -> None:
    async with AsyncClient(typed.url, TOKEN) as c:
        s = c.session()
        await s.execute("y = 'kept'")
        taken = await s.snapshot()
        await s.close()
        fork = c.session(from_snapshot=taken["snapshot"])
        got = await fork.execute("y")
        await fork.close()
        await c.delete_snapshot(taken["snapshot"])
    assert got.text == "'kept'"


@pytest.mark.parametrize("form", ["{http}", "{http}/", "{http}/exec", "{ws}", "{ws}/exec"])
def test_the_base_url_in_any_form_reaches_the_appliance(typed: Server, form: str) -> None:
    url = form.format(http=typed.http, ws=typed.http.replace("http://", "ws://"))
    with Client(url, TOKEN) as c:
        assert c.execute("print(6 * 7)").stdout == "42\n"
        assert c.url == typed.url


async def test_a_wrong_or_missing_token_is_an_authentication_error(typed: Server) -> None:
    for token in ("wrong", None):
        with pytest.raises(AuthenticationError, match=r"HTTP 401.*SANDBOX_AUTH_TOKEN"):
            async with AsyncClient(typed.url, token):
                pass
    with pytest.raises(AuthenticationError, match="401"):
        Client(typed.url, "wrong")
    with pytest.raises(AuthenticationError, match="401"):
        await AsyncClient(typed.url, "wrong").models()


async def test_nothing_listening_is_a_connection_failure_not_a_websockets_exception(typed: Server) -> None:
    with socket.socket() as probe:  # a port that was free a moment ago: nothing listens there
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(
        ConnectionFailed, match=f"could not reach the appliance at ws://127.0.0.1:{port}/exec"
    ):
        async with AsyncClient(f"ws://127.0.0.1:{port}", reconnect_s=0):
            pass
    with pytest.raises(ConnectionError):  # also the builtin kind, for code that catches that
        Client(f"http://127.0.0.1:{port}")


async def test_a_server_that_is_not_the_appliances_exec_is_named_so(typed: Server) -> None:
    with pytest.raises(ConnectionFailed, match="answered HTTP 404 instead of accepting a WebSocket"):
        async with AsyncClient(f"{typed.http}/not-here", TOKEN):
            pass


async def test_the_sync_client_works_inside_a_running_event_loop(typed: Server) -> None:
    # Jupyter and async web apps call sync code from inside a running loop: asyncio.run() or a
    # Runner would raise there; the client's own loop thread does not.
    asyncio.get_running_loop()
    with Client(typed.url, TOKEN) as c:
        assert c.execute("print('inside')").stdout == "inside\n"
        assert [e.type for e in c.stream("print(1)")][-1] == "done"


async def test_callbacks_get_the_output_as_it_arrives(typed: Server) -> None:
    seen: list[tuple[str, object]] = []

    async def on_result(result: Output) -> None:  # a coroutine function is awaited
        seen.append(("result", result.is_main_result))

    code = (
        "import sys\nprint('out', flush=True)\nprint('err', file=sys.stderr, flush=True)\n"
        f"class P:\n    def _repr_png_(self): return {PNG!r}\n"
        "display(P())\n1 / 0"
    )
    async with AsyncClient(typed.url, TOKEN) as c:
        ex = await c.execute(
            code,
            on_stdout=lambda text: seen.append(("stdout", text)),
            on_stderr=lambda text: seen.append(("stderr", text)),
            on_result=on_result,
            on_error=lambda error: seen.append(("error", error.name)),
        )
        late = await c.execute(
            "import time\ntime.sleep(60)",
            timeout_ms=1000,
            on_error=lambda error: seen.append(("late", error.name)),
        )
    assert ex.status == "error" and late.status == "timeout"
    assert seen == [
        ("stdout", "out\n"),
        ("stderr", "err\n"),
        ("result", False),
        ("error", "ZeroDivisionError"),
        ("late", "Timeout"),
    ]


def test_the_sync_clients_callbacks_too(typed: Server) -> None:
    lines: list[str] = []
    with Client(typed.url, TOKEN) as c:
        c.execute("for i in range(3): print(i, flush=True)", on_stdout=lines.append)
    assert "".join(lines) == "0\n1\n2\n"


async def test_a_callback_that_raises_stops_the_run_and_the_error_reaches_the_caller(typed: Server) -> None:
    def refuse(text: str) -> None:
        raise RuntimeError(f"the callback refused {text!r}")

    async with AsyncClient(typed.url, TOKEN) as c:
        with pytest.raises(RuntimeError, match="refused 'first"):
            await c.execute(
                "import time\nprint('first', flush=True)\ntime.sleep(60)", id="refused", on_stdout=refuse
            )
        after = await c.execute("print('still usable')")
        assert after.stdout == "still usable\n"
        # The run was interrupted, not left to sleep: its done comes back (unrouted) as cancelled.
        done = await until(
            lambda: [f for f in c.unrouted if f.get("id") == "refused" and f["type"] == "done"]
        )
    assert done[0]["status"] == "cancelled"


async def until(found: Callable[[], list[T]], deadline_s: float = 60) -> list[T]:
    """What `found` returns once it is not empty (polled: the frames come on the reader's task)."""
    end = asyncio.get_running_loop().time() + deadline_s
    while not (items := found()):
        assert asyncio.get_running_loop().time() < end, "never came"
        await asyncio.sleep(0.05)
    return items


async def test_stream_yields_typed_events(typed: Server) -> None:
    kinds: list[str] = []
    async with AsyncClient(typed.url, TOKEN) as c:
        async for ev in c.stream("import sys\nprint('a')\nprint('b', file=sys.stderr)\n42"):
            match ev:
                case StartEvent(run=run):
                    kinds.append(f"start {bool(run)}")
                case StderrEvent(text=text):  # before StdoutEvent: a StderrEvent is one too
                    kinds.append(f"stderr {text!r}")
                case StdoutEvent(text=text):
                    kinds.append(f"stdout {text!r}")
                case ResultEvent(result=result):
                    kinds.append(f"result {result.text}")
                case DoneEvent(status=status):
                    kinds.append(f"done {status}")
            assert ev["type"] == ev.type  # still the wire frame
    assert kinds == ["start True", "stdout 'a\\n'", "stderr 'b\\n'", "result 42", "done ok"]


def drop(client: AsyncClient) -> None:
    """Cut the client's TCP connection under it, as a network failure would (no Close frame)."""
    assert client._ws is not None
    client._ws.transport.abort()


async def test_a_dropped_connection_reconnects_and_the_session_goes_on(typed: Server) -> None:
    async with AsyncClient(typed.url, TOKEN) as c, c.session() as s:
        await s.execute("x = 41")
        drop(c)
        after = await s.execute("x + 1")  # the appliance still has the session: it is resumed
        assert after.text == "42" and after.session == s.id
        assert c.connections == 2


async def test_a_run_in_flight_when_the_connection_drops_ends_with_connection_lost(typed: Server) -> None:
    async with AsyncClient(typed.url, TOKEN) as c:

        async def drop_once_it_runs() -> None:
            async for ev in c.stream("import time\nprint('started', flush=True)\ntime.sleep(60)"):
                if isinstance(ev, StdoutEvent):
                    drop(c)

        with pytest.raises(ConnectionLost, match=r"closed before request .* was done.*outcome is unknown"):
            await drop_once_it_runs()
        assert (await c.execute("print('back')")).stdout == "back\n"


@pytest.fixture
def restartable(tmp_path: Path) -> Iterator[list[Server]]:
    """A server a test may stop and start again on the same port; the last one is stopped after."""
    servers = [start_server(tmp_path / "first", SANDBOX_AUTH_TOKEN=TOKEN)]
    yield servers
    servers[-1].stop()


async def test_after_the_appliance_restarts_the_client_reconnects_and_says_a_session_was_lost(
    restartable: list[Server], tmp_path: Path
) -> None:
    first = restartable[0]
    async with AsyncClient(first.url, TOKEN) as c:
        session = c.session()
        await session.execute("x = 1")
        lost_id = session.id
        tools = agents.Dispatcher(c)  # what the MCP bridge and agent loops run calls through
        await tools.call("run_python", {"code": "y = 1", "keep_state": True})
        first.stop()
        restartable.append(start_server(tmp_path / "second", port=first.port, SANDBOX_AUTH_TOKEN=TOKEN))
        assert (await c.execute("print('after the restart')")).stdout == "after the restart\n"
        with pytest.raises(SessionLost, match=f"session {lost_id} was lost.*variables.*are gone") as lost:
            await session.execute("x")
        assert lost.value.session == lost_id and session.id is None
        fresh = await session.execute("x = 2\nx")  # the next cell opens a new session
        assert fresh.text == "2" and session.id not in (None, lost_id)
        told = await tools.call("run_python", {"code": "y", "keep_state": True})
        assert told.is_error and "was lost" in told.text and "keep_state=true again" in told.text
        assert tools.session is None
        again = await tools.call("run_python", {"code": "y = 3\ny", "keep_state": True})
        assert not again.is_error and "--- result ---\n3" in again.text
        # A session id that was never good is still the server's plain refusal, not SessionLost.
        assert (await c.execute("1", session="0" * 32)).status == "rejected"


async def test_a_lazy_client_waits_with_backoff_for_an_appliance_that_is_not_up_yet(tmp_path: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    async with AsyncClient(f"http://127.0.0.1:{port}", TOKEN, lazy=True, reconnect_s=120) as c:
        pending = asyncio.create_task(c.execute("print('came up')"))
        srv = await asyncio.to_thread(start_server, tmp_path, port=port, SANDBOX_AUTH_TOKEN=TOKEN)
        try:
            ex = await pending
        finally:
            srv.stop()
    assert ex.stdout == "came up\n" and c.connections == 1
