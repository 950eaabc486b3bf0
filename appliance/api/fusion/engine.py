"""SandboxFusion's requests as runs of the run service; its events back into results.

Nothing here reaches a jail but through `RunService.submit` (or `execute`, to open a session
with no cell), so every request is under the same admission, tenant quotas, limits and
watchdogs as a native run:

- a Python program with nothing to fetch is one one-shot run (the fast path trainers take);
- a compiled language, or files to fetch, take a session (one jail): the compile cell (or,
  without one, the session opened with no cell), the run cell, then a cell that copies the
  files to fetch to outputs/, which the server reads back within its own bounds; a run that
  ended its jail (a time limit) has its files read from the host instead, through the
  working directory held from before the run (`Jail.hold_workspace`: the directory outlives
  the jail until it is released) (`salvage`); the hold is released and the session closed at
  the end, whatever happened;
- /run_jupyter is a session, a cell per cell, its files fetched after the cells as /run_code's
  are (read from the host when a cell ended the jail);
- /run_tests runs the program once per case, each case in a jail of its own (docs/fusion.md
  says why), at most SANDBOX_MAX_CONCURRENCY of one request's cases at a time.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from appliance.api import busy
from appliance.api.fusion import languages, salvage, shapes
from appliance.api.fusion.shapes import BadRequest, CellOutput, CodeAsk, Result
from appliance.api.transport import FrameParser
from appliance.core import events
from appliance.core.errors import RequestRejected
from appliance.core.ports import HeldWorkspace
from appliance.core.service import RunService
from appliance.core.tasks import TaskScope
from appliance.wire.protocol import ExecuteRequest, ProtocolError

OOM_EXIT = 137  # what a shell reports for a process the kernel killed (128 + SIGKILL)


@dataclass
class Refused(Exception):
    """A request the server did not run: an HTTP status and SandboxFusion's body for it."""

    status: int
    message: str
    retry_after_ms: int | None = None  # a `busy` refusal: when to come back (appliance.api.busy)


@dataclass
class Collected:
    """One run's events, gathered: what a result is made of."""

    clock: Callable[[], float] = time.monotonic
    stdout: list[str] = field(default_factory=list)
    stderr: list[str] = field(default_factory=list)
    display: list[dict[str, Any]] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)
    tracebacks: list[str] = field(default_factory=list)
    # path -> (base64 data, why not)
    files: dict[str, tuple[str | None, str | None]] = field(default_factory=dict)
    started: float | None = None
    ended: float | None = None
    done: events.Done | None = None

    async def emit(self, event: events.Event) -> None:
        if isinstance(event, events.Output):
            (self.stderr if event.name == "stderr" else self.stdout).append(event.text)
        elif isinstance(event, (events.Display, events.Result)):
            self.display.append(event.data)
        elif isinstance(event, events.CellError):
            tb = event.traceback
            self.errors.append({"ename": event.ename, "evalue": event.evalue, "traceback": tb})
            # A script's uncaught exception is on its stderr (as `python file.py` prints it);
            # a Jupyter cell's is in its `error` list only (`result` adds them).
            self.tracebacks.append("\n".join(tb) + "\n")
        elif isinstance(event, events.Started):
            self.started = self.clock()
        elif isinstance(event, events.FileOut):
            data = base64.b64encode(event.data).decode() if event.data is not None else None
            self.files[event.path] = (data, event.message)
        elif isinstance(event, events.Done):
            self.ended = self.clock()
            self.done = event

    @property
    def status(self) -> str:
        return self.done.status if self.done is not None else "internal"

    @property
    def message(self) -> str:
        return (self.done.message if self.done is not None else None) or ""

    @property
    def session(self) -> str | None:
        return self.done.session if self.done is not None else None

    def refusal(self) -> Refused | None:
        """The HTTP refusal for a run that never ran (busy, rejected), else None."""
        if self.status == "busy":
            return Refused(
                busy.STATUS,
                self.message or "the appliance is busy; try again shortly",
                self.done.retry_after_ms if self.done is not None else None,
            )
        if self.status == "rejected":
            return Refused(400, self.message or "the request was rejected")
        return None

    def result(self) -> Result:
        """The run as SandboxFusion's CommandRunResult."""
        seconds = None
        if self.started is not None and self.ended is not None:
            seconds = round(self.ended - self.started, 6)
        out, err = "".join(self.stdout), "".join(self.stderr) + "".join(self.tracebacks)
        status, exit_code = self.status, (self.done.exit_code if self.done is not None else None)
        if status in ("ok", "error"):
            code = exit_code if isinstance(exit_code, int) else (0 if status == "ok" else 1)
            return Result(shapes.FINISHED, seconds, code, out, err)
        if status == "timeout":
            return Result(shapes.TLE, seconds, None, out, err)
        if status in ("memory_limit", "output_limit", "gpu_memory_limit"):
            # The program's own failing: it ran and was stopped for what it did.
            code = exit_code if isinstance(exit_code, int) and exit_code else OOM_EXIT
            return Result(shapes.FINISHED, seconds, code, out, _with_note(err, self.message))
        return Result(shapes.ERROR, seconds, None, out, _with_note(err, self.message or status))


def _with_note(text: str, note: str) -> str:
    if not note:
        return text
    return f"{text}{'' if not text or text.endswith(chr(10)) else chr(10)}{note}\n"


MAX_SECONDS = 7 * 24 * 3600  # past any server's SANDBOX_MAX_EXEC_MS, which bounds it anyway


def _ms(seconds: float) -> int:
    return max(1, math.ceil(min(seconds, MAX_SECONDS) * 1000))


class Runner:
    """Runs SandboxFusion's requests for one caller on the run service."""

    def __init__(
        self, service: RunService, parser: FrameParser, owner: str, tools: dict[str, tuple[str, ...]]
    ) -> None:
        self.service = service
        self.parser = parser
        self.owner = owner
        self.tools = tools  # language -> its tools' paths (languages.available)

    # -- one run ------------------------------------------------------------------------------
    async def _request(self, frame: dict[str, Any]) -> ExecuteRequest:
        """The native execute request for frame, checked by the codec as any client's is."""
        try:
            message = await self.parser.parse(json.dumps(frame).encode(), self.owner)
        except ProtocolError as exc:
            raise BadRequest(exc.message) from None
        if not isinstance(message, ExecuteRequest):  # the frame above is always one
            raise BadRequest("not an execute request")
        return message

    async def run(self, frame: dict[str, Any], stdin: str | None = None) -> Collected:
        """Submit one execute frame (stdin fed and closed at once) and gather its events."""
        if stdin is not None and len(stdin.encode()) > self.service.settings.max_stdin_bytes:
            raise BadRequest(
                f"'stdin' is over SANDBOX_MAX_STDIN_BYTES ({self.service.settings.max_stdin_bytes} bytes)"
            )
        req = await self._request({**frame, "stdin_eof": stdin is None})
        collected = Collected()
        async with TaskScope("fusion-run") as tasks:
            run = self.service.submit(req, self.owner, collected.emit, tasks)
            if stdin is not None:
                try:
                    run.stdin(stdin, True)
                except RequestRejected as exc:
                    run.interrupt(exc.message)
                    raise BadRequest(exc.message) from None
            if run.task is None:
                raise RuntimeError("RunService.submit returned a run without its task")
            await run.task
        return collected

    async def close(self, session: str | None) -> None:
        if session is not None:
            await self.service.close_session(session, self.owner)

    # -- /run_code ----------------------------------------------------------------------------
    def language(self, name: str) -> tuple[languages.Language | None, dict[str, str]]:
        """(the language, its tools' paths); (None, {}) for Python. BadRequest naming the
        supported languages for any other."""
        if name == languages.PYTHON:
            return None, {}
        lang = languages.by_name().get(name)
        if lang is None or name not in self.tools:
            supported = ", ".join(sorted(self.tools))
            raise BadRequest(f"language {name[:40]!r} is not supported here; supported: {supported}")
        return lang, languages.tool_paths(lang, self.tools[name])

    async def run_code(self, ask: CodeAsk) -> tuple[Result | None, Result | None, dict[str, str], str]:
        """(compile result, run result, fetched files, a note for `message`)."""
        lang, tools = self.language(ask.language)
        base: dict[str, Any] = {"files": [{"path": f.path, "data": f.data} for f in ask.files]}
        if ask.memory_mb is not None:
            base["memory_mb"] = ask.memory_mb
        run_code = ask.code if lang is None else languages.run_cell(lang, ask.code, tools)
        compile_code = None if lang is None else languages.compile_cell(lang, ask.code, tools)
        if compile_code is None and not ask.fetch:
            run = await self.run({**base, "code": run_code, "timeout_ms": _ms(ask.run_timeout_s)}, ask.stdin)
            _raise_refusal(run)
            return None, run.result(), {}, ""
        session: str | None = None
        held: HeldWorkspace | None = None
        try:
            compiled: Result | None = None
            rest: dict[str, Any] = {**base, "session": "new"}
            if compile_code is not None:
                step = await self.run(
                    {**rest, "code": compile_code, "timeout_ms": _ms(ask.compile_timeout_s)}
                )
                session = step.session  # closed below, whatever the compile's end
                _raise_refusal(step)
                compiled = step.result()
                if compiled.status != shapes.FINISHED or compiled.return_code != 0:
                    return compiled, None, {}, ""
                if session is None:  # compiled, but its jail is gone: nothing to run
                    return (
                        compiled,
                        Result(shapes.ERROR, stderr="the compile's jail ended before the run"),
                        {},
                        "",
                    )
                rest = {"session": session}
            else:
                # Files to fetch: the session opens first (no cell), so that its working
                # directory is held before the program runs (`salvage`).
                opened = await self.open_session({k: v for k, v in base.items() if k != "files"})
                session = opened.session  # closed below, whatever happens
                _raise_refusal(opened)
                if session is None or opened.status != "ok":
                    return None, Result(shapes.ERROR, stderr=opened.message or opened.status), {}, ""
                rest = {"session": session, "files": base["files"]}
            held = self._hold(session)
            run = await self.run({**rest, "code": run_code, "timeout_ms": _ms(ask.run_timeout_s)}, ask.stdin)
            _raise_refusal(run)
            files, note = await self._fetch(session, ask.fetch, held)
            return compiled, run.result(), files, note
        finally:
            await self._end(session, held)

    async def open_session(self, frame: dict[str, Any]) -> Collected:
        """Open a session without running a cell (frame's `memory_mb` applies); its `done`."""
        req = await self._request({**frame, "session": "new", "code": "", "stdin_eof": True})
        collected = Collected()
        await self.service.execute(req, self.owner, collected.emit, cell=False)
        return collected

    def _hold(self, session: str | None) -> HeldWorkspace | None:
        """The session's working directory, of the caller's own, held past its jail's end
        until `_end`; None if gone."""
        if session is None:
            return None
        try:
            return self.service.sessions.get(session, self.owner).jail.hold_workspace()
        except RequestRejected:
            return None

    async def _end(self, session: str | None, held: HeldWorkspace | None) -> None:
        """Release the working directory (first: its removal starts before any wait), then
        close the session."""
        try:
            if held is not None:
                await held.release()
        finally:
            await self.close(session)

    def _alive(self, session: str) -> bool:
        try:
            self.service.sessions.get(session, self.owner)
        except RequestRejected:
            return False
        return True

    async def _fetch(
        self, session: str | None, names: tuple[str, ...], held: HeldWorkspace | None = None
    ) -> tuple[dict[str, str], str]:
        """The named files of the session's workspace (base64), and why any was left out: by a
        cell while the session lives, else (its jail ended with the run) from `held`, the
        working directory held from before the run."""
        if not names:
            return {}, ""
        if session is None or not self._alive(session):
            if held is None:
                return {}, "files were not fetched: the run's jail ended with it"
            if not held.jail_ended:  # read only once no process of the jail is left
                return {}, "files were not fetched: the run's jail had not ended"
            settings = self.service.settings
            # A descriptor of the reader's own, closed by it: a release while it reads (the
            # client gone) never closes one in use, whose number could be reused meanwhile.
            ws = dataclasses.replace(held.workspace, fd=os.dup(held.workspace.fd))
            read, left_out = await asyncio.to_thread(
                salvage.read_closing, ws, names, settings.max_file_out_bytes, settings.max_outputs_bytes
            )
            return read, "; ".join(left_out)
        got = await self.run({"session": session, "code": languages.fetch_cell(names)})
        if got.status not in ("ok", "output_limit"):
            return {}, f"files were not fetched: {got.message or got.status}"
        files: dict[str, str] = {}
        notes = []
        for i, name in enumerate(names):
            data, why = got.files.get(f"{languages.FETCH_DIR.removeprefix('outputs/')}/{i}", (None, None))
            if data is not None:
                files[name] = data
            elif why:
                notes.append(f"{name!r} not fetched: {why}")
        if got.status == "output_limit":
            notes.append(got.message)
        return files, "; ".join(notes)

    # -- /run_jupyter -------------------------------------------------------------------------
    async def run_jupyter(self, ask: shapes.JupyterAsk) -> dict[str, Any]:
        clock = time.monotonic
        began = clock()
        opening: dict[str, Any] = {
            "session": "new",
            "code": "",
            "files": [{"path": f.path, "data": f.data} for f in ask.files],
            "timeout_ms": _ms(ask.total_timeout_s),
        }
        if ask.memory_mb is not None:
            opening["memory_mb"] = ask.memory_mb
        opened = await self.run(opening)
        _raise_refusal(opened)
        session = opened.session
        cells: list[CellOutput] = []
        status, message, timed_out = shapes.SUCCESS, "", False
        held: HeldWorkspace | None = None
        try:
            if session is None:
                raise Refused(200, opened.message or "the session did not open")
            # Held before any cell runs: a cell that ends the jail (a time limit it ignores, a
            # kernel the OOM killer took) leaves its files to be read from the host (`salvage`).
            held = self._hold(session)
            for code in ask.cells:
                left = ask.total_timeout_s - (clock() - began)
                limit = min(left, ask.cell_timeout_s) if ask.cell_timeout_s > 0 else left
                if limit <= 0:
                    status, timed_out = shapes.FAILED, True
                    break
                got = await self.run({"session": session, "code": code, "timeout_ms": _ms(limit)})
                _raise_refusal(got)
                cells.append(CellOutput("".join(got.stdout), "".join(got.stderr), got.display, got.errors))
                if got.status == "timeout":
                    status, timed_out = shapes.FAILED, True
                    break
                if got.status not in ("ok", "error"):
                    status, message = shapes.FAILED, got.message or got.status
                    if got.status == "internal":
                        status = shapes.SANDBOX_ERROR
                    break
            # Fetched whatever the cells' end, as /run_code fetches after a time limit.
            files, note = await self._fetch(session, ask.fetch, held)
        finally:
            await self._end(session, held)
        driver = Result(
            shapes.TLE if timed_out else shapes.FINISHED, round(clock() - began, 6), None if timed_out else 0
        )
        return shapes.jupyter_response(
            status, "; ".join(m for m in (message, note) if m), driver, cells, files
        )

    # -- /run_tests ---------------------------------------------------------------------------
    async def run_tests(self, ask: shapes.TestsAsk) -> dict[str, Any]:
        gate = asyncio.Semaphore(max(1, min(len(ask.cases), self.service.settings.max_concurrency)))
        self.language(ask.program.language)  # an unknown language is refused before any case runs

        async def one(case: shapes.Case) -> tuple[str, Result | None, Result | None]:
            code = ask.program.code + (f"\n\n{case.check}\n" if case.check else "")
            program = shapes.CodeAsk(
                code=code,
                language=ask.program.language,
                compile_timeout_s=ask.program.compile_timeout_s,
                run_timeout_s=ask.program.run_timeout_s,
                memory_mb=ask.program.memory_mb,
                stdin=case.stdin,
                files=ask.program.files,
                fetch=(),
            )
            async with gate:
                compiled, ran, _, _ = await self.run_code(program)
            return shapes.verdict(compiled, ran, case), compiled, ran

        try:
            # A case refused (busy, over a quota) refuses the request; the others are cancelled.
            async with asyncio.TaskGroup() as group:
                running = [group.create_task(one(c)) for c in ask.cases]
        except ExceptionGroup as failed:
            raise failed.exceptions[0] from None
        return shapes.tests_response([t.result() for t in running], "jail_per_case")


def _raise_refusal(collected: Collected) -> None:
    refused = collected.refusal()
    if refused is not None:
        raise refused
