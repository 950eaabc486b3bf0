"""The run service on fakes of the sandbox (tests/core_fakes.py): admission and its queue,
sessions, how errors become `done`, interrupt and cancellation. No root, jail or server."""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path

import pytest

from appliance.api.frames import framed
from appliance.core.domain import CellOutcome, RunRequest
from appliance.core.errors import Busy, JailFailure, RequestRejected
from appliance.core.events import Done, Emit, Event, GpuShare, Output
from appliance.core.service import Run
from appliance.core.tenants import owner_of
from appliance.wire import protocol
from appliance.wire.protocol import Frame
from tests.core_fakes import Core, FakeFile, FakeJail, FakeOutputs, Script, until

ALICE = "alice-" + secrets.token_hex(12)


async def submit(core: Core, code: str, **fields: object) -> tuple[Run, list[Frame]]:
    """Start a run as a task of the test's scope, as a connection does; its Run and the frames
    a client reads of its events."""
    frames: list[Frame] = []

    async def collect(frame: Frame) -> None:
        frames.append(frame)

    req = protocol.ExecuteRequest(code=code, **fields)  # type: ignore[arg-type]
    if not core.tasks.running:
        await core.tasks.open()
    return core.service.submit(req, "alice", framed(req.id, collect), core.tasks), frames


def held(gate: asyncio.Event) -> Script:
    """A cell script that prints its code, then waits for `gate`."""

    async def script(jail: FakeJail, req: RunRequest, emit: Emit) -> CellOutcome:
        await emit(Output("stdout", req.code))
        await gate.wait()
        return CellOutcome("ok", exit_code=0)

    return script


class TestOneShotRuns:
    async def test_a_run_sends_start_its_output_and_exactly_one_done(self) -> None:
        core = Core()
        frames = await core.run("print(2 + 2)")
        assert [f["type"] for f in frames] == ["start", "stream", "done"]
        assert frames[-1]["status"] == "ok" and frames[-1]["exit_code"] == 0
        assert frames[0]["queued_ms"] == 0 and frames[0]["session"] is None
        assert core.metrics.runs.count(status="ok") == 1

    async def test_its_jail_is_single_use_and_its_lease_ends_with_the_run(self) -> None:
        core = Core()
        await core.run("1")
        await core.run("2")
        first, second = core.leases.leases
        assert first.ended and second.ended
        assert core.cells.runs[0][0] is not core.cells.runs[1][0]

    async def test_the_code_goes_first_and_stdin_sent_early_follows_it_in_order(self) -> None:
        core = Core()
        gate = asyncio.Event()
        core.cells.script = held(gate)
        run, _ = await submit(core, "input()")
        run.stdin("a", eof=False)  # before the run has a jail
        run.stdin("b", eof=True)
        await core.cells.running.wait()
        run.stdin("c", eof=False)  # after: straight to the jail
        jail = core.cells.runs[0][0]
        assert jail.process.written == [b"run:input()", b"stdin:a", b"stdin:b", b"eof", b"stdin:c"]
        gate.set()
        assert run.task is not None
        await run.task

    async def test_stdin_past_its_bound_while_the_run_waits_is_refused_by_name(self) -> None:
        core = Core({"SANDBOX_MAX_STDIN_BYTES": "1024"})
        core.runtime.started.clear()  # the run cannot reach a jail yet
        run, _ = await submit(core, "input()")
        run.stdin("x" * 1000, eof=False)
        with pytest.raises(RequestRejected, match="SANDBOX_MAX_STDIN_BYTES"):
            run.stdin("x" * 100, eof=False)
        assert run.task is not None
        run.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run.task


class TestAMemoryLimitOfItsOwn:
    async def test_a_lower_limit_is_set_on_the_jail_before_the_code(self) -> None:
        core = Core()
        await core.run("1", memory_mb=256)
        await core.run("2", memory_mb=core.service.settings.memory_mb + 1)  # never raised
        await core.run("3")
        lowered, above, plain = (lease.jail for lease in core.leases.leases)
        assert getattr(lowered, "memory_mb", None) == 256
        assert not hasattr(above, "memory_mb") and not hasattr(plain, "memory_mb")

    async def test_a_session_keeps_the_limit_it_opened_with(self) -> None:
        core = Core()
        opened = await core.run("1", session="new", memory_mb=128)
        sid = opened[-1]["session"]
        later = await core.run("2", session=sid, memory_mb=64)
        assert later[-1]["status"] == "rejected"
        assert "memory limit was set when it opened" in later[-1]["message"]
        assert (await core.run("3", session=sid))[-1]["status"] == "ok"

    async def test_a_limit_the_jail_cannot_take_is_rejected_before_the_code(self) -> None:
        core = Core()

        def refuse(memory_mb: int) -> None:
            raise RequestRejected(f"no cgroup for {memory_mb}")

        original = core.leases.new_jail

        def new_jail() -> FakeJail:
            jail = original()
            jail.limit_memory = refuse  # type: ignore[method-assign]
            return jail

        core.leases.new_jail = new_jail  # type: ignore[method-assign]
        frames = await core.run("print(1)", memory_mb=100)
        assert frames[-1]["status"] == "rejected" and "no cgroup for 100" in frames[-1]["message"]
        assert core.cells.runs == [] and core.leases.leases[0].ended


class TestAdmission:
    async def test_runs_past_the_limit_wait_in_line_and_past_the_queue_are_busy(self) -> None:
        core = Core({"SANDBOX_MAX_CONCURRENCY": "1", "SANDBOX_MAX_QUEUE": "1"})
        gate = asyncio.Event()
        core.cells.script = held(gate)
        first, first_frames = await submit(core, "first")
        await core.cells.running.wait()
        second, second_frames = await submit(core, "second")
        await until(lambda: core.service.admission.waiting == 1)
        third = await core.run("third")
        assert third[-1]["type"] == "done" and third[-1]["status"] == "busy"
        assert "queue is full" in third[-1]["message"]
        assert len(third) == 1  # refused before any jail: no `start`
        core.clock.advance(0.25)
        gate.set()
        assert first.task is not None and second.task is not None
        await asyncio.gather(first.task, second.task)
        assert first_frames[-1]["status"] == second_frames[-1]["status"] == "ok"
        assert second_frames[0]["type"] == "start" and second_frames[0]["queued_ms"] == 250
        assert 1 in core.metrics.queue_depth.values  # the waiting run was counted
        assert core.metrics.runs.count(status="busy") == 1
        assert core.service.admission.active == 0

    async def test_a_run_that_comes_while_the_appliance_starts_waits_for_it(self) -> None:
        core = Core()
        core.runtime.started.clear()
        run, frames = await submit(core, "early")
        await until(lambda: core.service.admission.active == 1)  # waiting, within the queue
        assert frames == []
        core.runtime.started.set()
        assert run.task is not None
        await run.task
        assert frames[-1]["status"] == "ok"


class TestSessions:
    async def test_a_session_runs_its_cells_in_the_jail_it_opened_with(self) -> None:
        core = Core()
        opened = await core.run("x = 1", session="new")
        sid = opened[-1]["session"]
        assert opened[-1]["status"] == "ok" and isinstance(sid, str)
        assert opened[0]["session"] == sid
        again = await core.run("x", session=sid)
        assert again[-1]["status"] == "ok" and again[-1]["session"] == sid
        (lease,) = core.leases.leases  # one lease for the whole session
        jails = [jail for jail, _ in core.cells.runs]
        assert jails[0] is jails[1] and lease.kept and not lease.ended
        assert jails[0].frozen  # between cells the jail does nothing
        assert await core.service.close_session(sid, "alice")
        assert lease.ended and not jails[0].alive

    async def test_a_session_opened_without_a_first_cell_runs_none(self) -> None:
        # The E2B dialect's create: the context is ready once its jail is leased.
        core = Core()
        events = await core.service.open_session(protocol.ExecuteRequest(code=""), "alice", first_cell=False)
        done = events[-1]
        assert [type(e) for e in events] == [Done] and isinstance(done, Done)
        assert done.status == "ok" and done.session is not None
        assert core.cells.runs == []  # no cell ran
        (lease,) = core.leases.leases
        assert lease.kept and lease.jail is not None and not lease.jail.frozen  # as the pool kept it
        again = await core.run("x", session=done.session)
        assert again[-1]["status"] == "ok" and [jail for jail, _ in core.cells.runs] == [lease.jail]
        assert lease.jail.frozen  # after its first cell, as after every cell
        with pytest.raises(ValueError, match="no code"):
            await core.service.open_session(protocol.ExecuteRequest(code="1"), "alice", first_cell=False)

    async def test_a_session_opened_without_a_cell_on_a_dead_jail_is_not_kept(self) -> None:
        core = Core()
        new_jail = core.leases.new_jail

        def dead() -> FakeJail:
            jail = new_jail()
            jail.ended = True
            return jail

        core.leases.new_jail = dead  # type: ignore[method-assign]
        done = (await core.service.open_session(protocol.ExecuteRequest(code=""), "alice", first_cell=False))[
            -1
        ]
        assert (
            isinstance(done, Done) and done.status != "ok" and "interpreter is gone" in (done.message or "")
        )
        assert len(core.service.sessions) == 0 and core.leases.leases[0].ended

    async def test_another_owners_session_is_reported_as_missing(self) -> None:
        core = Core()
        sid = (await core.run("secret = 1", session="new"))[-1]["session"]
        theirs = (await core.run("secret", owner="mallory", session=sid))[-1]
        missing = (await core.run("secret", owner="mallory", session="f" * 32))[-1]
        assert theirs["status"] == missing["status"] == "rejected"
        assert theirs["message"].replace(sid, "X") == missing["message"].replace("f" * 32, "X")
        assert len(core.cells.runs) == 1

    async def test_a_busy_session_refuses_a_second_cell(self) -> None:
        core = Core()
        sid = (await core.run("1", session="new"))[-1]["session"]
        gate = asyncio.Event()
        core.cells.script = held(gate)
        core.cells.running.clear()
        run, frames = await submit(core, "slow", session=sid)
        await core.cells.running.wait()
        refused = await core.run("2", session=sid)
        assert refused[-1]["status"] == "rejected" and "busy" in refused[-1]["message"]
        gate.set()
        assert run.task is not None
        await run.task
        assert frames[-1]["status"] == "ok"

    async def test_sessions_past_their_cap_are_refused_by_name(self) -> None:
        core = Core({"SANDBOX_MAX_SESSIONS": "1"})
        await core.run("1", session="new")
        over = await core.run("1", session="new")
        assert over[-1]["status"] == "rejected" and "SANDBOX_MAX_SESSIONS" in over[-1]["message"]
        assert len(core.leases.leases) == 1

    async def test_a_session_whose_cell_was_cut_off_is_ended(self) -> None:
        core = Core()
        sid = (await core.run("1", session="new"))[-1]["session"]
        gate = asyncio.Event()
        core.cells.script = held(gate)
        core.cells.running.clear()
        run, _ = await submit(core, "slow", session=sid)
        await core.cells.running.wait()
        assert run.task is not None
        run.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run.task
        assert len(core.service.sessions) == 0 and core.leases.leases[0].ended
        after = await core.run("1", session=sid)
        assert after[-1]["status"] == "rejected" and "cut off" in after[-1]["message"]


class TestOutputs:
    async def test_a_runs_files_follow_its_output_and_what_was_left_out_makes_it_output_limit(self) -> None:
        core = Core()
        note = "1 outputs/ file(s) not returned"
        core.cells.left = FakeOutputs(
            [FakeFile("a.txt", b"hi"), FakeFile("big.bin", None, "too big")], note, 1
        )
        frames = await core.run("1")
        assert [f["type"] for f in frames] == ["start", "stream", "file", "file", "done"]
        assert (frames[2]["path"], frames[2]["data"], frames[2]["size"]) == ("a.txt", "aGk=", 2)
        assert frames[3]["data"] is None and frames[3]["message"] == "too big"
        assert (frames[-1]["status"], frames[-1]["message"]) == ("output_limit", note)
        assert frames[-1]["files_skipped"] == 1
        ((_jail, killed_first),) = core.cells.read_outputs_of
        assert killed_first  # files are read only once every process of the run is gone

    async def test_a_failed_run_keeps_its_status_and_the_note_is_added(self) -> None:
        core = Core()

        async def fails(jail: FakeJail, req: RunRequest, emit: Emit) -> CellOutcome:
            return CellOutcome("error", exit_code=1, message="the interpreter exited with code 1")

        core.cells.script = fails
        core.cells.left = FakeOutputs([], "outputs/ directories nested too deep were not read")
        done = (await core.run("1"))[-1]
        assert done["status"] == "error"
        assert done["message"] == (
            "the interpreter exited with code 1; outputs/ directories nested too deep were not read"
        )


class TestSessionsEnd:
    async def test_a_session_whose_jail_does_not_freeze_is_ended_and_its_done_says_so(self) -> None:
        core = Core()

        async def refuse(jail: FakeJail, req: RunRequest, emit: Emit) -> CellOutcome:
            jail.refuse_freeze = "the freezer did not confirm FROZEN"
            return CellOutcome("ok", exit_code=0)

        core.cells.script = refuse
        done = (await core.run("1", session="new"))[-1]
        assert done["status"] == "ok"
        assert "could not be frozen between cells" in done["message"]
        assert len(core.service.sessions) == 0 and core.leases.leases[0].ended
        after = (await core.run("1", session=done["session"]))[-1]
        assert after["status"] == "rejected" and "could not be frozen" in after["message"]

    async def test_a_session_whose_interpreter_died_is_ended(self) -> None:
        core = Core()

        async def dies(jail: FakeJail, req: RunRequest, emit: Emit) -> CellOutcome:
            return CellOutcome("error", exit_code=None, interpreter_alive=False)

        core.cells.script = dies
        done = (await core.run("import os; os._exit(1)", session="new"))[-1]
        assert "its interpreter could not be recovered" in done["message"]
        assert core.cells.runs[0][0].process.killed and len(core.service.sessions) == 0

    async def test_a_later_cell_cannot_change_the_gpu_budget_its_session_holds(self) -> None:
        core = Core()
        core.leases.gpu = GpuShare(0, "GPU-0", 512)
        sid = (await core.run("1", session="new"))[-1]["session"]
        changed = (await core.run("1", session=sid, gpu=protocol.GpuRequest(memory_mb=1024)))[-1]
        assert changed["status"] == "rejected" and "512 MiB for its whole life" in changed["message"]
        same = (await core.run("1", session=sid, gpu=protocol.GpuRequest(memory_mb=512)))[-1]
        assert same["status"] == "ok"


class AskedOrDefault:
    """GPU mode's budget rule in small: a run holds what it asks for, else 1000 MiB."""

    def budget_mb(self, req: RunRequest) -> int:
        return req.gpu.memory_mb if req.gpu is not None else 1000


class TestTheGpuBudgetIsGiven:
    """The service charges a tenant's GPU quota with what the budget it is given says, and has
    no rule of its own (appliance.core.ports.GpuBudget)."""

    @staticmethod
    def tenants(tmp_path: Path) -> dict[str, str]:
        path = tmp_path / "tenants.toml"
        path.write_text(f'[[tenant]]\nname = "alice"\ntoken = "{ALICE}"\nmax_gpu_mb = 1500\n')
        path.chmod(0o600)
        return {"SANDBOX_AUTH_TOKENS_FILE": str(path)}

    async def test_a_session_holds_its_budget_of_the_tenants_gpu_quota_until_it_ends(
        self, tmp_path: Path
    ) -> None:
        core = Core(self.tenants(tmp_path), gpu=AskedOrDefault())
        owner = owner_of(ALICE)
        first = (await core.run("1", owner=owner, session="new"))[-1]
        assert first["status"] == "ok"
        refused = (await core.run("1", owner=owner, session="new"))[-1]
        assert refused["status"] == "busy" and "max_gpu_mb=1500: 1000 MiB held" in refused["message"]
        small = (await core.run("1", owner=owner, gpu=protocol.GpuRequest(memory_mb=500)))[-1]
        assert small["status"] == "ok"  # a one-shot run fits beside the session, and gives it back
        await core.service.sessions.close(first["session"], reason="test")
        assert (await core.run("1", owner=owner, session="new"))[-1]["status"] == "ok"

    async def test_by_default_no_run_holds_gpu_memory(self, tmp_path: Path) -> None:
        core = Core(self.tenants(tmp_path))
        owner = owner_of(ALICE)
        asks = protocol.GpuRequest(memory_mb=1000)
        done = [(await core.run("1", owner=owner, session="new", gpu=asks))[-1] for _ in range(3)]
        assert [d["status"] for d in done] == ["ok"] * 3


class TestErrorsBecomeDone:
    @pytest.mark.parametrize(
        ("error", "status", "message"),
        [
            (Busy("no GPU memory free"), "busy", "no GPU memory free"),
            (RequestRejected("bad gpu budget"), "rejected", "bad gpu budget"),
            (JailFailure("the jail did not start"), "internal", "the jail did not start"),
            (RuntimeError("/secret/path leaked"), "internal", "internal error"),
        ],
    )
    async def test_a_failure_to_lease_ends_the_run_with_one_done(
        self, error: Exception, status: str, message: str
    ) -> None:
        core = Core()
        core.leases.fail = error
        frames = await core.run("1")
        assert frames == [frames[-1]] and frames[-1]["type"] == "done"
        assert (frames[-1]["status"], frames[-1]["message"]) == (status, message)
        assert core.metrics.runs.count(status=status) == 1

    async def test_a_cell_that_fails_ends_with_one_done_and_its_lease_ended(self) -> None:
        core = Core()

        async def broken(jail: FakeJail, req: RunRequest, emit: Emit) -> CellOutcome:
            raise RuntimeError("driver protocol error at 0xdeadbeef")

        core.cells.script = broken
        frames = await core.run("1")
        assert [f["type"] for f in frames] == ["start", "done"]
        assert (frames[-1]["status"], frames[-1]["message"]) == ("internal", "internal error")
        assert core.leases.leases[0].ended

    async def test_a_client_that_stopped_reading_cannot_keep_done_from_being_counted(self) -> None:
        core = Core()

        async def gone(event: Event) -> None:
            if isinstance(event, Done):
                raise ConnectionResetError

        await core.service.execute(protocol.ExecuteRequest(code="1"), "alice", gone)
        assert core.metrics.runs.count(status="ok") == 1 and core.leases.leases[0].ended

    async def test_done_reports_the_duration_by_the_injected_clock(self) -> None:
        core = Core()

        async def slow(jail: FakeJail, req: RunRequest, emit: Emit) -> CellOutcome:
            core.clock.advance(1.5)
            return CellOutcome("ok", exit_code=0)

        core.cells.script = slow
        frames = await core.run("1")
        assert frames[-1]["duration_ms"] == 1500
        assert core.metrics.run_seconds.values == [1.5]


class TestInterruptAndCancel:
    async def test_an_interrupt_before_the_run_has_a_jail_reaches_it_once_it_has_one(self) -> None:
        core = Core()
        gate = asyncio.Event()
        core.cells.script = held(gate)
        run, _ = await submit(core, "while True: pass")
        run.interrupt("stop it")
        await core.cells.running.wait()
        jail = core.cells.runs[0][0]
        assert jail.process.interrupts == ["stop it"]
        run.interrupt("again")  # while it runs: straight to the jail
        assert jail.process.interrupts == ["stop it", "again"]
        gate.set()
        assert run.task is not None
        await run.task

    async def test_a_cancelled_run_frees_its_slot_ends_its_lease_and_is_counted(self) -> None:
        core = Core({"SANDBOX_MAX_CONCURRENCY": "1"})
        core.cells.script = held(asyncio.Event())
        run, frames = await submit(core, "while True: pass")
        await core.cells.running.wait()
        assert run.task is not None
        run.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run.task
        assert [f["type"] for f in frames] == ["start", "stream"]  # the caller is gone: no done
        assert core.leases.leases[0].ended
        assert core.service.admission.active == 0
        assert core.metrics.runs.count(status="cancelled") == 1
