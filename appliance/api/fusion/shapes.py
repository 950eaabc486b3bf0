"""SandboxFusion's request and response bodies, read and built; pure.

Field names, defaults and status words are facts of SandboxFusion's HTTP API, as its server
declares them and as clients (verl's sandbox_fusion reward among them) read them:

- `/run_code` takes `{code, language, compile_timeout, run_timeout, memory_limit_MB, stdin,
  files: {name: base64 | null}, fetch_files: [name]}` (timeouts in seconds, default 10;
  `memory_limit_MB` -1: no limit of the request's own) and answers `{status: Success |
  Failed | SandboxError, message, compile_result, run_result, files: {name: base64}}`, each
  result `{status: Finished | TimeLimitExceeded | Error, execution_time, return_code,
  stdout, stderr}`.
- `/run_jupyter` takes `{cells, cell_timeout, total_timeout, memory_limit_MB, kernel, files,
  fetch_files}` and answers `{status, message, driver, cells: [{stdout, stderr, display,
  error}], files}`.
- Fields a client sends that are not listed are ignored, as SandboxFusion ignores them. A
  file to fetch that does not exist after the run is left out of `files`, as there.

`/run_tests` is the appliance's own (SandboxFusion has none): one program, N cases, a verdict
per case (docs/fusion.md).
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from appliance.wire.protocol import upload_path_problem

DEFAULT_TIMEOUT_S = 10.0  # SandboxFusion's default compile and run timeout
DEFAULT_TOTAL_TIMEOUT_S = 45.0  # /run_jupyter's default for all its cells
MAX_FETCH_FILES = 100
MAX_CELLS = 256
MAX_CASES = 256
MAX_CASE_TEXT = 1 << 20  # one case's stdin, expected output or assert, in characters
MAX_MEMORY_MB = 1 << 20

SUCCESS, FAILED, SANDBOX_ERROR = "Success", "Failed", "SandboxError"
FINISHED, TLE, ERROR = "Finished", "TimeLimitExceeded", "Error"


class BadRequest(ValueError):
    """A body this server refuses before running anything (HTTP 400, a SandboxError body)."""


@dataclass(frozen=True)
class Upload:
    path: str
    data: str  # base64, checked


@dataclass(frozen=True)
class CodeAsk:
    """A /run_code request, checked."""

    code: str
    language: str
    compile_timeout_s: float
    run_timeout_s: float
    memory_mb: int | None  # None: the server's own limit
    stdin: str | None
    files: tuple[Upload, ...]
    fetch: tuple[str, ...]


@dataclass(frozen=True)
class JupyterAsk:
    cells: tuple[str, ...]
    cell_timeout_s: float  # 0: only the total bounds a cell
    total_timeout_s: float
    memory_mb: int | None
    files: tuple[Upload, ...]
    fetch: tuple[str, ...]


@dataclass(frozen=True)
class Case:
    stdin: str | None
    expected: str | None  # compared as SandboxFusion's clients compare: trailing newlines aside
    check: str  # code appended to the program (an assert), or ""


@dataclass(frozen=True)
class TestsAsk:
    program: CodeAsk
    cases: tuple[Case, ...]


@dataclass
class Result:
    """One command's result (SandboxFusion's CommandRunResult)."""

    status: str
    execution_time: float | None = None
    return_code: int | None = None
    stdout: str = ""
    stderr: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "execution_time": self.execution_time,
            "return_code": self.return_code,
            "stdout": self.stdout,
            "stderr": self.stderr,
        }


@dataclass
class CellOutput:
    """One Jupyter cell's output (SandboxFusion's CellRunResult)."""

    stdout: str = ""
    stderr: str = ""
    display: list[dict[str, Any]] = field(default_factory=list)
    error: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"stdout": self.stdout, "stderr": self.stderr, "display": self.display, "error": self.error}


# -- reading requests ---------------------------------------------------------------------------
def _object(body: object) -> Mapping[str, Any]:
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


def _string(body: Mapping[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise BadRequest(f"'{key}' must be a string")
    return value


def _required(body: Mapping[str, Any], key: str) -> str:
    value = _string(body, key)
    if value is None:
        raise BadRequest(f"missing required field '{key}'")
    return value


def _seconds(body: Mapping[str, Any], key: str, default: float, zero_ok: bool = False) -> float:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadRequest(f"'{key}' must be a number of seconds")
    if value < 0 or (value == 0 and not zero_ok):
        raise BadRequest(f"'{key}' must be more than 0 seconds")
    return float(value)


def _memory(body: Mapping[str, Any]) -> int | None:
    value = body.get("memory_limit_MB", -1)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest("'memory_limit_MB' must be a whole number of MiB (-1: the server's limit)")
    # Over 1 TiB asks for no limit of its own (the server's applies), as -1 does.
    return value if 0 < value <= MAX_MEMORY_MB else None


def check_name(name: object, what: str) -> str:
    """A file name relative to the working directory; refused when absolute, climbing out,
    empty or unreadable (the native protocol's rule for uploads, which also refuses links
    when it writes them)."""
    if not isinstance(name, str):
        raise BadRequest(f"{what} must be a string")
    problem = upload_path_problem(name)
    if problem is not None:
        raise BadRequest(f"{what} {name[:200]!r} is refused: {problem}")
    return name


def _files(body: Mapping[str, Any]) -> tuple[Upload, ...]:
    raw = body.get("files")
    if raw is None:
        return ()
    if not isinstance(raw, dict):
        raise BadRequest("'files' must be an object from file name to base64 content")
    out = []
    for name, data in raw.items():
        check_name(name, "file name")
        if data is None:  # SandboxFusion skips a file whose content is null
            continue
        if not isinstance(data, str):
            raise BadRequest(f"file {name[:200]!r}: the content must be a base64 string")
        try:
            base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise BadRequest(f"file {name[:200]!r}: the content is not valid base64") from None
        out.append(Upload(name, data))
    return tuple(out)


def _fetch(body: Mapping[str, Any]) -> tuple[str, ...]:
    raw = body.get("fetch_files")
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise BadRequest("'fetch_files' must be a list of file names")
    if len(raw) > MAX_FETCH_FILES:
        raise BadRequest(f"'fetch_files' names {len(raw)} files; at most {MAX_FETCH_FILES}")
    return tuple(dict.fromkeys(check_name(n, "fetch_files entry") for n in raw))


def code_ask(body: object) -> CodeAsk:
    b = _object(body)
    return CodeAsk(
        code=_required(b, "code"),
        language=_required(b, "language"),
        compile_timeout_s=_seconds(b, "compile_timeout", DEFAULT_TIMEOUT_S),
        run_timeout_s=_seconds(b, "run_timeout", DEFAULT_TIMEOUT_S),
        memory_mb=_memory(b),
        stdin=_string(b, "stdin"),
        files=_files(b),
        fetch=_fetch(b),
    )


def jupyter_ask(body: object) -> JupyterAsk:
    b = _object(body)
    cells = b.get("cells")
    if not isinstance(cells, list) or not all(isinstance(c, str) for c in cells):
        raise BadRequest("'cells' must be a list of strings")
    if len(cells) > MAX_CELLS:
        raise BadRequest(f"'cells' has {len(cells)} cells; at most {MAX_CELLS}")
    kernel = b.get("kernel", "python3")
    if kernel not in (None, "python3"):
        raise BadRequest(f"kernel {str(kernel)[:40]!r} is not served here; the only kernel is 'python3'")
    return JupyterAsk(
        cells=tuple(cells),
        cell_timeout_s=_seconds(b, "cell_timeout", 0.0, zero_ok=True),
        total_timeout_s=_seconds(b, "total_timeout", DEFAULT_TOTAL_TIMEOUT_S),
        memory_mb=_memory(b),
        files=_files(b),
        fetch=_fetch(b),
    )


def _case(i: int, raw: object) -> Case:
    if not isinstance(raw, dict):
        raise BadRequest(f"cases[{i}] must be an object like {{stdin, expected_output}} or {{assert}}")
    values = {}
    for key in ("stdin", "expected_output", "assert"):
        value = raw.get(key)
        if value is not None and (not isinstance(value, str) or len(value) > MAX_CASE_TEXT):
            raise BadRequest(f"cases[{i}].{key} must be a string of at most {MAX_CASE_TEXT} characters")
        values[key] = value
    return Case(stdin=values["stdin"], expected=values["expected_output"], check=values["assert"] or "")


def tests_ask(body: object) -> TestsAsk:
    b = _object(body)
    program = code_ask(b)
    cases = b.get("cases")
    if not isinstance(cases, list) or not cases:
        raise BadRequest("'cases' must be a non-empty list")
    if len(cases) > MAX_CASES:
        raise BadRequest(f"'cases' has {len(cases)} cases; at most {MAX_CASES}")
    return TestsAsk(program=program, cases=tuple(_case(i, c) for i, c in enumerate(cases)))


# -- building responses -------------------------------------------------------------------------
def run_status(results: Sequence[Result | None]) -> tuple[str, str]:
    """The response's (status, message), as SandboxFusion derives them: an Error anywhere is
    the sandbox's (its stderr the message); a time limit or a non-zero exit fails."""
    done = [r for r in results if r is not None]
    for r in done:
        if r.status == ERROR:
            return SANDBOX_ERROR, r.stderr
    if any(r.status == TLE for r in done):
        return FAILED, ""
    if any(r.return_code not in (None, 0) for r in done):
        return FAILED, ""
    return SUCCESS, ""


def code_response(
    compile_result: Result | None, run_result: Result | None, files: Mapping[str, str], note: str = ""
) -> dict[str, Any]:
    status, message = run_status([compile_result, run_result])
    if note:
        message = f"{message}; {note}" if message else note
    return {
        "status": status,
        "message": message,
        "compile_result": compile_result.as_dict() if compile_result else None,
        "run_result": run_result.as_dict() if run_result else None,
        "executor_pod_name": None,
        "files": dict(files),
    }


def refusal(message: str) -> dict[str, Any]:
    """A request refused before anything ran: SandboxFusion's body, status SandboxError."""
    return {
        "status": SANDBOX_ERROR,
        "message": message,
        "compile_result": None,
        "run_result": None,
        "executor_pod_name": None,
        "files": {},
    }


def jupyter_response(
    status: str, message: str, driver: Result, cells: Sequence[CellOutput], files: Mapping[str, str]
) -> dict[str, Any]:
    return {
        "status": status,
        "message": message,
        "driver": driver.as_dict(),
        "cells": [c.as_dict() for c in cells],
        "executor_pod_name": None,
        "files": dict(files),
    }


def verdict(compile_result: Result | None, run_result: Result | None, case: Case) -> str:
    """One case's verdict: passed, wrong_answer, runtime_error, timeout, compile_error or
    sandbox_error (the words verl's reward reports for the same outcomes)."""
    status, _ = run_status([compile_result, run_result])
    if status == SANDBOX_ERROR:
        return "sandbox_error"
    if compile_result is not None and (compile_result.status != FINISHED or compile_result.return_code != 0):
        return "compile_error"
    if run_result is None:
        return "sandbox_error"
    if run_result.status == TLE:
        return "timeout"
    if run_result.return_code != 0:
        return "runtime_error"
    if case.expected is not None and run_result.stdout.rstrip("\n") != case.expected.rstrip("\n"):
        return "wrong_answer"
    return "passed"


def tests_response(
    rows: Sequence[tuple[str, Result | None, Result | None]], isolation: str
) -> dict[str, Any]:
    passed = sum(1 for v, _, _ in rows if v == "passed")
    errors = [v for v, _, _ in rows if v == "sandbox_error"]
    return {
        "status": SANDBOX_ERROR if errors else (SUCCESS if passed == len(rows) else FAILED),
        "message": f"{len(errors)} case(s) hit a sandbox error" if errors else "",
        "isolation": isolation,
        "passed": passed,
        "total": len(rows),
        "cases": [
            {
                "verdict": v,
                "compile_result": c.as_dict() if c else None,
                "run_result": r.as_dict() if r else None,
            }
            for v, c, r in rows
        ],
    }
