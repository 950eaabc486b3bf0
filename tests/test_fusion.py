"""SandboxFusion's API (/run_code, /run_jupyter, /run_tests) against a real server and real jails,
driven by verl's own sandbox_fusion client code, unmodified, from the verl package on PyPI.

`import verl` pulls in ray and torch (its __init__ imports its DataProto), so the reward's
package, verl/utils/reward_score/sandbox_fusion/, is loaded from the installed files by path,
as a package of its own: its two files are executed as shipped, and need only `requests`.
verl's client sends no headers of its own; the tenant's token rides in its URL as an HTTP
Basic password, as docs/fusion.md tells a trainer to configure it.

The request shapes verl never sends (files in and out, Jupyter cells, the appliance's batched
cases) are sent with `requests` in SandboxFusion's wire shape.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import requests

from tests.support import Server, scaled, start_server

ALICE = "alice-fusion-token-0123456789"
BOB = "bob-fusion-token-0123456789ab"
CAROL = "carol-fusion-token-0123456789"  # a tenant allowed one session
MAX_UPLOAD = 64 * 1024


def _verl_sandbox_fusion() -> ModuleType:
    """verl's sandbox_fusion package, loaded by path (see the module docstring)."""
    spec = importlib.util.find_spec("verl")  # finds the installed package without importing it
    assert spec is not None and spec.submodule_search_locations, "verl is not installed (make setup)"
    root = Path(next(iter(spec.submodule_search_locations))) / "utils" / "reward_score" / "sandbox_fusion"
    name = "verl_sandbox_fusion"
    package = importlib.util.spec_from_file_location(
        name, root / "__init__.py", submodule_search_locations=[str(root)]
    )
    assert package is not None and package.loader is not None
    module = importlib.util.module_from_spec(package)
    sys.modules[name] = module  # its `from .utils import ...` resolves under this name
    package.loader.exec_module(module)
    return module


verl_sf = _verl_sandbox_fusion()
verl_utils: Any = sys.modules["verl_sandbox_fusion.utils"]


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("fusion")
    tenants = tmp / "tenants.toml"
    tenants.write_text(
        f'[[tenant]]\nname = "alice"\ntoken = "{ALICE}"\n\n'
        f'[[tenant]]\nname = "bob"\ntoken = "{BOB}"\n\n'
        f'[[tenant]]\nname = "carol"\ntoken = "{CAROL}"\nmax_sessions = 1\n'
    )
    tenants.chmod(0o600)
    server = start_server(
        tmp,
        SANDBOX_AUTH_TOKENS_FILE=str(tenants),
        SANDBOX_POOL_SIZE="2",
        SANDBOX_MAX_UPLOAD_BYTES=str(MAX_UPLOAD),
        SANDBOX_MAX_EXEC_MS=str(int(scaled(30_000))),
    )
    yield server
    server.stop()


def url(srv: Server, token: str = ALICE, path: str = "/run_code") -> str:
    """The URL a trainer configures: the tenant's token as an HTTP Basic password."""
    return srv.http.replace("http://", f"http://trainer:{token}@") + path


def post(srv: Server, path: str, body: Any, token: str = ALICE) -> requests.Response:
    return requests.post(url(srv, token, path), json=body, timeout=scaled(60))


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# -- verl's own client --------------------------------------------------------------------------
def test_verl_compute_score_passes_stdin_cases(srv: Server) -> None:
    completion = "```python\nn = int(input())\nprint(n * 2)\n```"
    score, meta = verl_sf.compute_score(
        url(srv), threading.Semaphore(4), 512, completion, {"inputs": ["2\n", "5\n"], "outputs": ["4", "10"]}
    )
    assert score == 1.0, meta
    assert [m["status"] for m in meta] == ["success", "success"]
    assert meta[0]["api_response"]["run_result"]["status"] == "Finished"


def test_verl_failed_assert_is_a_runtime_error_with_its_stderr(srv: Server) -> None:
    results, meta = verl_utils.check_correctness(
        url(srv),
        {"inputs": [""], "outputs": [None], "assert_case": ["assert add(2, 2) == 5, 'add is wrong'"]},
        "def add(a, b):\n    return a + b\n",
        timeout=10,
    )
    assert results == [-2], meta
    assert meta[0]["status"] == "runtime_error"
    assert meta[0]["api_status"] == "Failed"
    assert meta[0]["exit_code"] == 1
    assert "AssertionError: add is wrong" in meta[0]["stderr"]


def test_verl_timeout_is_time_limit_exceeded(srv: Server) -> None:
    results, meta = verl_utils.check_correctness(
        url(srv),
        {"inputs": [""], "outputs": ["done"]},
        "import time\ntime.sleep(30)\nprint('done')",
        timeout=1,
    )
    assert results == [-3], meta
    assert meta[0]["run_status"] == "TimeLimitExceeded"
    assert meta[0]["status"] == "timeout"


def test_verl_memory_limit_is_the_runs_own(srv: Server) -> None:
    # 200 MiB under a 512 MiB limit runs; under a 128 MiB limit the kernel kills it. The
    # server's own limit (SANDBOX_MEMORY_MB, 1024 MiB) is the same for both.
    program = "x = bytearray(200 * 1024 * 1024)\nprint('held', len(x) >> 20)"
    roomy, _ = verl_utils.check_correctness(
        url(srv), {"inputs": [""], "outputs": ["held 200"]}, program, memory_limit_mb=512
    )
    tight, meta = verl_utils.check_correctness(
        url(srv), {"inputs": [""], "outputs": ["held 200"]}, program, memory_limit_mb=128
    )
    assert roomy == [True]
    assert tight == [-2], meta
    assert "memory limit (128 MiB" in meta[0]["stderr"]


def test_verl_bash_and_a_cpp_compile_error(srv: Server) -> None:
    response, error = verl_utils.call_sandbox_api(
        url(srv), 'read x; echo "got $x"; echo oops >&2; exit 4', "hi\n", 10, 10, 256, "bash"
    )
    assert error is None
    assert response["status"] == "Failed"
    assert response["run_result"]["stdout"] == "got hi\n"
    assert response["run_result"]["stderr"] == "oops\n"
    assert response["run_result"]["return_code"] == 4
    results, meta = verl_utils.check_correctness(
        url(srv), {"inputs": [""], "outputs": [""]}, "int main() { return }", language="cpp"
    )
    assert results == [-4], meta
    assert meta[0]["compile_status"] == "Finished"
    assert "error" in meta[0]["compile_stderr"]


# -- what verl does not send ------------------------------------------------------------------------
def test_cpp_compiles_then_runs_with_stdin(srv: Server) -> None:
    code = "#include <iostream>\nint main() { long x; std::cin >> x; std::cout << x * 3 << std::endl; }\n"
    body = post(srv, "/run_code", {"code": code, "language": "cpp", "stdin": "14"}).json()
    assert body["status"] == "Success", body
    assert body["compile_result"]["return_code"] == 0
    assert body["run_result"]["stdout"] == "42\n"


def test_files_in_and_fetched(srv: Server) -> None:
    code = (
        "import os\n"
        "data = open('in/data.txt').read()\n"
        "open('out.txt', 'w').write(data.upper())\n"
        "os.symlink('/etc/passwd', 'link.txt')\n"
    )
    body = post(
        srv,
        "/run_code",
        {
            "code": code,
            "language": "python",
            "files": {"in/data.txt": b64(b"hello fusion"), "ignored.txt": None},
            "fetch_files": ["out.txt", "missing.txt", "link.txt", "in/data.txt"],
        },
    ).json()
    assert body["status"] == "Success", body
    # A missing file is left out, as SandboxFusion does; a link is never followed.
    assert body["files"] == {"out.txt": b64(b"HELLO FUSION"), "in/data.txt": b64(b"hello fusion")}


# A program that ignores the interrupt a time limit sends first: its interpreter, and so its
# session and jail, end with the limit (a program that takes the interrupt keeps its session,
# and its files are fetched by a cell as after any run).
HANG = (
    "def _hang(step):\n"
    "    while True:\n"
    "        try:\n"
    "            step()\n"
    "        except KeyboardInterrupt:\n"
    "            pass\n"
)


def test_files_fetched_after_a_time_limit(srv: Server) -> None:
    # A program that wrote its answer, then hung: its jail ends with the time limit, and the
    # files come back as SandboxFusion returns them; one still being written gives what it holds.
    code = HANG + (
        "import time\n"
        "open('answer.txt', 'w').write('partial answer')\n"
        "log = open('log.txt', 'w')\n"
        "log.write('started\\n'); log.flush()\n"
        "def tick():\n"
        "    log.write('tick\\n'); log.flush(); time.sleep(0.01)\n"
        "_hang(tick)\n"
    )
    body = post(
        srv,
        "/run_code",
        {"code": code, "language": "python", "run_timeout": 1, "fetch_files": ["answer.txt", "log.txt"]},
    ).json()
    assert body["run_result"]["status"] == "TimeLimitExceeded", body
    assert body["status"] == "Failed", body
    assert body["files"]["answer.txt"] == b64(b"partial answer"), body
    log = base64.b64decode(body["files"]["log.txt"])
    assert log.startswith(b"started\n"), log[:100]


def jupyter_fetching(srv: Server, cells: list[str], name: str, **fields: object) -> dict[str, Any]:
    """/run_jupyter's answer for cells that end the request early, fetching `name`."""
    body: dict[str, Any] = post(
        srv, "/run_jupyter", {"cells": cells, "kernel": "python3", "fetch_files": [name], **fields}
    ).json()
    assert body["status"] == "Failed", body
    assert len(body["cells"]) == 2, body  # the cells run so far; the third never ran
    return body


def test_jupyter_files_fetched_after_a_cell_time_limit(srv: Server) -> None:
    # A cell that wrote a file, then hung through the interrupt: the kernel and its jail end
    # with the cell's limit, and the file still comes back, exact.
    cells = [
        HANG,
        "import time\nopen('answer.txt', 'w').write('cell answer')\n_hang(lambda: time.sleep(0.05))",
        "print('never')",
    ]
    body = jupyter_fetching(srv, cells, "answer.txt", cell_timeout=1)
    assert body["driver"]["status"] == "TimeLimitExceeded", body
    assert body["files"] == {"answer.txt": b64(b"cell answer")}, body


def test_jupyter_files_fetched_after_the_kernel_died_of_its_memory_limit(srv: Server) -> None:
    cells = ["open('kept.txt', 'w').write('kept')", "x = bytearray(400 * 1024 * 1024)", "print('never')"]
    body = jupyter_fetching(srv, cells, "kept.txt", memory_limit_MB=128)
    assert "memory limit (128 MiB" in body["message"], body
    assert body["files"] == {"kept.txt": b64(b"kept")}, body


def test_jupyter_cells_share_state(srv: Server) -> None:
    body = post(
        srv,
        "/run_jupyter",
        {"cells": ["a = 21\na * 2", "print(a)", "raise ValueError('cell three')"], "kernel": "python3"},
    ).json()
    assert body["status"] == "Success", body
    first, second, third = body["cells"]
    assert first["display"] == [{"text/plain": "42"}]
    assert second["stdout"] == "21\n"
    assert third["stderr"] == ""
    assert third["error"][0]["ename"] == "ValueError"
    assert third["error"][0]["evalue"] == "cell three"
    assert body["driver"]["status"] == "Finished"


def test_batched_cases_get_a_verdict_each(srv: Server) -> None:
    body = post(
        srv,
        "/run_tests",
        {
            "code": "def f(x):\n    return x * 2\nimport sys\nprint(f(int(sys.stdin.read() or 0)))\n",
            "language": "python",
            "run_timeout": 5,
            "cases": [
                {"stdin": "3", "expected_output": "6"},
                {"stdin": "3", "expected_output": "7"},
                {"assert": "assert f(2) == 4"},
                {"assert": "assert f(2) == 5, 'f(2) is not 5'"},
                {"assert": "while True: pass"},
            ],
        },
    ).json()
    verdicts = [c["verdict"] for c in body["cases"]]
    assert verdicts == ["passed", "wrong_answer", "passed", "runtime_error", "timeout"], body
    assert (body["passed"], body["total"], body["status"]) == (2, 5, "Failed")
    assert "f(2) is not 5" in body["cases"][3]["run_result"]["stderr"]


def test_languages_listed(srv: Server) -> None:
    status, text = srv.get("/v1/languages", ALICE)
    assert status == 200
    assert {"python", "bash"} <= set(json.loads(text)["languages"])


# -- bad input ------------------------------------------------------------------------------------
def test_unknown_fields_are_ignored_and_huge_limits_are_the_servers(srv: Server) -> None:
    body = {
        "code": "print(7)",
        "language": "python",
        "dataset": "x",
        "extra": {"deep": [1]},
        "run_timeout": 1e308,
        "memory_limit_MB": 10**30,
    }
    body = post(srv, "/run_code", body).json()
    assert body["status"] == "Success"
    assert body["run_result"]["stdout"] == "7\n"


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"language": "python"}, "missing required field 'code'"),
        ({"code": "print(1)", "language": "cobol"}, "supported: "),
        ({"code": 5, "language": "python"}, "'code' must be a string"),
        ({"code": "", "language": "python", "run_timeout": "soon"}, "'run_timeout' must be a number"),
        ({"code": "", "language": "python", "memory_limit_MB": 1.5}, "'memory_limit_MB' must be a whole"),
        ({"code": "", "language": "python", "files": {"a": "not base64!"}}, "not valid base64"),
        ({"code": "", "language": "python", "files": ["a"]}, "'files' must be an object"),
        ({"code": "", "language": "python", "fetch_files": "out.txt"}, "'fetch_files' must be a list"),
        ([1, 2], "the body must be a JSON object"),
    ],
)
def test_bad_bodies_are_a_sandbox_error(srv: Server, body: object, says: str) -> None:
    response = post(srv, "/run_code", body)
    assert response.status_code == 400
    assert response.json()["status"] == "SandboxError"
    assert says in response.json()["message"]


def test_malformed_json_and_wrong_content_type(srv: Server) -> None:
    bad = requests.post(
        url(srv),
        data=b'{"code": "print(1)", "language":',
        headers={"Content-Type": "application/json"},
        timeout=10,
    )
    assert bad.status_code == 400
    assert bad.json() == {**bad.json(), "status": "SandboxError", "message": "the body is not JSON"}
    form = requests.post(url(srv), data={"code": "print(1)", "language": "python"}, timeout=10)
    assert form.status_code == 415


def test_oversize_files_are_refused_with_a_message(srv: Server) -> None:
    big = b64(b"x" * (MAX_UPLOAD + 1))
    response = post(srv, "/run_code", {"code": "print(1)", "language": "python", "files": {"big.bin": big}})
    assert response.status_code == 400
    assert "SANDBOX_MAX_UPLOAD_BYTES" in response.json()["message"]
    huge = requests.post(
        url(srv),
        data=b'{"code": "' + b"#" * (17 * 1024 * 1024) + b'", "language": "python"}',
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert huge.status_code == 413
    assert "SANDBOX_MAX_MESSAGE_BYTES" in huge.json()["message"]


@pytest.mark.parametrize("name", ["../up.txt", "/etc/cron.d/x", "a/../../b", "", "a\x00b"])
def test_bad_file_names_are_refused(srv: Server, name: str) -> None:
    for body in (
        {"code": "", "language": "python", "files": {name: b64(b"x")}},
        {"code": "", "language": "python", "fetch_files": [name]},
    ):
        response = post(srv, "/run_code", body)
        assert response.status_code == 400, body
        assert "is refused" in response.json()["message"]


def test_tokens_and_tenants(srv: Server) -> None:
    plain = requests.post(srv.http + "/run_code", json={"code": "print(1)", "language": "python"}, timeout=10)
    assert plain.status_code == 401
    assert (
        post(srv, "/run_code", {"code": "print(1)", "language": "python"}, token="not-a-tenant").status_code
        == 401
    )
    bearer = requests.post(
        srv.http + "/run_code",
        json={"code": "print(1)", "language": "python"},
        headers={"Authorization": f"Bearer {BOB}"},
        timeout=scaled(30),
    )
    assert bearer.json()["run_result"]["stdout"] == "1\n"
    # A tenant's quotas hold here too: carol's one session is taken, so a compiled language
    # (a session: compile, then run) is refused for her, not for alice.
    status, _ = srv.request("POST", "/v1/sessions", CAROL, {"code": ""}, timeout=scaled(30))
    assert status == 201
    cpp = {"code": "int main() { return 0; }", "language": "cpp"}
    refused = post(srv, "/run_code", cpp, token=CAROL)
    assert refused.status_code in (400, 429)
    assert "session" in refused.json()["message"]
    assert post(srv, "/run_code", cpp).json()["status"] == "Success"
