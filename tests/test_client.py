"""The Python client speaks the protocol's types: typed arguments in, typed parts out."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import pytest

from appliance.client import (
    AsyncClient,
    Client,
    ClientError,
    Execution,
    ExecutionError,
    Output,
    OutputFile,
    request_frame,
)
from appliance.protocol import GpuRequest
from tests.support import Server, start_server

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


def gathered(*frames: dict[str, Any]) -> Execution:
    ex = Execution(id="r1")
    for frame in frames:
        ex.add({"id": "r1", **frame})
    return ex


class TestExecution:
    def test_results_and_displays_are_mime_bundles_with_typed_views(self) -> None:
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
        shown, result = ex.displays[0], ex.results[0]
        assert (
            isinstance(shown, Output) and shown.png == PNG and shown.text == "<Figure>" and shown.html is None
        )
        assert (
            result.text == "42"
            and result.html == "<b>42</b>"
            and result.json == {"v": 42}
            and result.png is None
        )
        assert ex.text == "42"
        assert ex.results == [{"text/plain": "42", "text/html": "<b>42</b>", "application/json": {"v": 42}}]

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


@pytest.fixture(scope="module")
def typed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp("client"), SANDBOX_MAX_FILE_OUT_BYTES="1000")
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
    async with AsyncClient(typed.url) as c:
        ex = await c.execute(RICH, files={"in.txt": "uploaded"}, timeout_ms=20000)
    assert ex.status == "ok", ex.frames
    assert ex.stdout == "printed\n" and ex.text == "Rich()"
    assert (
        ex.displays[0].png == PNG
        and ex.displays[0].html == "<i>rich</i>"
        and ex.results[0].html == "<i>rich</i>"
    )
    files = {f.path: f for f in ex.files}
    assert files["small.txt"].bytes == b"UPLOADED" and files["small.txt"].size == 8
    assert files["big.bin"].bytes is None and files["big.bin"].size == 5000 and files["big.bin"].message


async def test_a_real_error_is_typed(typed: Server) -> None:
    async with AsyncClient(typed.url) as c:
        ex = await c.execute("def f():\n    return 1 / 0\nf()")
    assert ex.status == "error" and ex.error is not None
    assert (ex.error.name, ex.error.value) == ("ZeroDivisionError", "division by zero")
    assert any("return 1 / 0" in line for line in ex.error.traceback)


async def test_a_wrong_argument_fails_before_anything_is_sent_and_the_connection_stays_usable(
    typed: Server,
) -> None:
    async with AsyncClient(typed.url) as c:
        with pytest.raises(TypeError, match="files must be a mapping"):
            await c.execute("print('never')", id="bad", files=[{"path": "a", "data": ""}])  # type: ignore[arg-type]
        after = await c.execute("print('after')")
    assert after.status == "ok" and after.stdout == "after\n"
    assert c.unrouted == [], "the bad request must never have reached the server"


def test_the_sync_client_and_its_session_take_the_same_typed_arguments(typed: Server) -> None:
    with Client(typed.url) as c:
        ex = c.execute("print(open('a.txt').read())", files={"a.txt": b"sync"})
        with c.session() as s:
            s.execute("x = 20", timeout_ms=10000)
            again = s.execute("x + 1")
            with pytest.raises(TypeError, match="sets 'session' itself"):
                s.execute("1", session="other")  # type: ignore[call-arg]
    assert ex.stdout == "sync\n" and again.text == "21" and again.session
