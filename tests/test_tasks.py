"""Structured concurrency: every task the server starts has an owner (appliance.core.tasks).

The package starts tasks only through a `TaskScope` (or a TaskGroup held in an `async with`);
a raw create_task, ensure_future, call_soon, call_later or run_in_executor is allowed only
where ALLOWED names it, with the owner that keeps and ends it.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import inspect
import shutil
from pathlib import Path
from typing import cast

import pytest

from appliance.core.sessions import SessionRegistry
from appliance.core.tasks import TaskScope, cancel_and_wait, within
from appliance.runtime.lifecycle import Lifecycle
from appliance.runtime.metrics import Metrics
from appliance.sandbox import cell
from appliance.sandbox.jail import Jail
from appliance.settings import Settings

PACKAGE = Path(__file__).resolve().parent.parent / "appliance"

# Calls that start a task, or schedule a callback, that nobody holds unless someone keeps it.
RAW = frozenset(
    {
        "create_task",
        "ensure_future",
        "call_soon",
        "call_soon_threadsafe",
        "call_later",
        "call_at",
        "run_in_executor",
        "run_coroutine_threadsafe",
        "Task",
    }
)

# (module, function, call) -> its owner and why the raw call stays.
ALLOWED: dict[tuple[str, str, str], str] = {
    ("core/tasks.py", "TaskScope.spawn", "create_task"): "the owner itself: its TaskGroup's create_task",
    ("sandbox/pool.py", "JailPool.take", "call_later"): "the refill nudge: the pool cancels it at close",
    ("sandbox/cell.py", "_run_cell", "call_later"): "the disk watchdog's timer: cancelled in its finally",
    ("sandbox/cell.py", "_run_cell", "create_task"): "the disk watchdog: cancelled in run_cell's finally",
    ("sandbox/jail.py", "JailFactory._make_workdir", "ensure_future"): "awaited in place, shielded",
    ("sandbox/jail.py", "_shielded", "ensure_future"): "awaited in place, shielded; again when cancelled",
    ("api/wsmeter.py", "MeteredReader._arm", "call_at"): "the frame deadline: cancelled at release",
    (
        "sandbox/egresssplice.py",
        "_Relay.__init__",
        "call_at",
    ): "a relay's idle deadline: cancelled by its close, which its awaiter's finally calls",
    ("sandbox/egresssplice.py", "_Relay._idle", "call_at"): "the same deadline, re-armed",
    ("api/wsmeter.py", "MeteredReader._expired", "call_later"): "the same timer, re-armed",
    ("api/wsmeter.py", "HeapTrimmer.freed", "call_later"): "a trim timer: cancelled at close",
    ("api/wsmeter.py", "HeapTrimmer._run", "run_in_executor"): "malloc_trim in a thread: close awaits it",
    ("core/service.py", "RunService.execute", "call_soon"): "a gauge update next loop turn: holds nothing",
    (
        "api/e2b/envd/connect.py",
        "serve",
        "ensure_future",
    ): "a Connect call and the watch for its client: awaited in place, cancelled in its finally",
    ("core/tasks.py", "TaskScope.close", "call_later"): "the stuck-children report: cancelled as close ends",
    ("core/tasks.py", "within", "ensure_future"): "awaited in place; cancelled and ended if the wait is",
    (
        "sandbox/lease.py",
        "PoolLeases.teardown",
        "call_soon",
    ): "the teardowns' start at the next turn: the leases' close cancels it and destroys what it held",
    (
        "api/transport.py",
        "_GoneWatch.add",
        "call_later",
    ): "the poll of waiting connections: it ends when none waits",
    ("api/transport.py", "_GoneWatch._tick", "call_later"): "the same poll, re-armed while one waits",
    (
        "sandbox/egressproxy.py",
        "EgressProxy._accept",
        "create_task",
    ): "a jail's connection: held in its listener's conns, cancelled and awaited at unlisten",
    (
        "sandbox/egressproxy.py",
        "EgressProxy._accept",
        "call_later",
    ): "the accept pause: cancelled at unlisten",
}


def _group_names(func: ast.AST) -> set[str]:
    """Names bound by `async with asyncio.TaskGroup() as NAME` in this function: structured."""
    names: set[str] = set()
    for node in ast.walk(func):
        if isinstance(node, ast.AsyncWith):
            for item in node.items:
                call = item.context_expr
                if (
                    isinstance(call, ast.Call)
                    and _name_of(call.func) == "TaskGroup"
                    and isinstance(item.optional_vars, ast.Name)
                ):
                    names.add(item.optional_vars.id)
    return names


def _name_of(func: ast.expr) -> str | None:
    if isinstance(func, ast.Attribute):
        return func.attr
    if isinstance(func, ast.Name):
        return func.id
    return None


def raw_calls(root: Path) -> list[tuple[str, str, str, int]]:
    """(module, enclosing function, call, line) of every raw task start under root."""
    found: list[tuple[str, str, str, int]] = []
    for path in sorted(root.rglob("*.py")):
        module = path.relative_to(root).as_posix()
        tree = ast.parse(path.read_text(), str(path))

        def visit(node: ast.AST, scope: list[str], groups: set[str], module: str = module) -> None:
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                scope = [*scope, node.name]
                if not isinstance(node, ast.ClassDef):
                    groups = groups | _group_names(node)
            if isinstance(node, ast.Call):
                name = _name_of(node.func)
                if name == "Task" and not (
                    isinstance(node.func, ast.Attribute) and _is_asyncio(node.func.value)
                ):
                    name = None  # a class of ours named Task, not asyncio's
                structured = (
                    name == "create_task"
                    and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name)
                    and node.func.value.id in groups
                )
                if name in RAW and not structured:
                    found.append((module, ".".join(scope) or "<module>", name, node.lineno))
            for child in ast.iter_child_nodes(node):
                visit(child, scope, groups)

        visit(tree, [], set())
    return found


def _is_asyncio(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id == "asyncio"


def unowned(root: Path) -> list[str]:
    return [
        f"{module}:{line} {func}: {call}"
        for module, func, call, line in raw_calls(root)
        if (module, func, call) not in ALLOWED
    ]


def test_every_task_the_package_starts_has_an_owner() -> None:
    assert unowned(PACKAGE) == [], (
        "start it in a TaskScope (appliance.core.tasks), or name its owner in ALLOWED"
    )


PLANTED = {
    "fresh task": ("api/planted.py", "import asyncio\n\nasync def f():\n    asyncio.create_task(f())\n"),
    "loop's task": ("runtime/planted.py", "import asyncio\n\ndef f(loop):\n    loop.create_task(g())\n"),
    "timer": (
        "sandbox/planted.py",
        "import asyncio\n\ndef f():\n    asyncio.get_running_loop().call_later(1, f)\n",
    ),
    "future": ("gpu/planted.py", "from asyncio import ensure_future\n\ndef f(c):\n    ensure_future(c)\n"),
    "executor": ("core/planted.py", "import asyncio\n\ndef f(loop):\n    loop.run_in_executor(None, f)\n"),
    "Task()": ("api/planted2.py", "import asyncio\n\ndef f(c):\n    asyncio.Task(c)\n"),
}


@pytest.mark.parametrize("kind", sorted(PLANTED))
def test_a_raw_task_start_planted_in_a_copy_of_the_package_is_found(tmp_path: Path, kind: str) -> None:
    copy = tmp_path / "appliance"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    module, source = PLANTED[kind]
    (copy / module).write_text(source)
    assert [line.split(" ")[0] for line in unowned(copy)] == [f"{module}:4"]


def test_an_allowed_call_moved_to_another_function_of_its_module_is_found(tmp_path: Path) -> None:
    copy = tmp_path / "appliance"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    pool = copy / "sandbox/pool.py"
    pool.write_text(pool.read_text() + "\n\ndef later(loop):\n    loop.call_later(1, later)\n")
    assert [line.split(" ", 1)[1] for line in unowned(copy)] == ["later: call_later"]


def test_a_task_group_held_in_an_async_with_is_structured(tmp_path: Path) -> None:
    root = tmp_path / "appliance"
    root.mkdir()
    (root / "m.py").write_text(
        "import asyncio\n\nasync def f(c, d):\n    async with asyncio.TaskGroup() as tg:\n"
        "        tg.create_task(c)\n    other.create_task(d)\n"
    )
    assert unowned(root) == ["m.py:6 f: create_task"]


# -- TaskScope ---------------------------------------------------------------------------------


async def forever() -> None:
    await asyncio.Event().wait()


async def test_closing_a_scope_cancels_its_children_and_waits_for_their_cleanup() -> None:
    cleaned: list[str] = []
    started = asyncio.Event()

    async def child(name: str) -> None:
        try:
            started.set()
            await asyncio.Event().wait()
        finally:
            await asyncio.sleep(0)  # a cleanup that itself awaits is waited for too
            cleaned.append(name)

    scope = await TaskScope("test").open()
    tasks = [scope.spawn(child("a")), scope.spawn(child("b"))]
    await started.wait()
    await scope.close()
    assert sorted(cleaned) == ["a", "b"] and all(t.cancelled() for t in tasks)
    assert scope.tasks == frozenset()


async def test_a_child_s_error_ends_that_child_only_and_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    async def fails() -> None:
        raise ValueError("boom")

    async with TaskScope("test") as scope:
        sibling = scope.spawn(forever())
        failing = scope.spawn(fails())
        await asyncio.wait([failing])
        assert not sibling.done(), "a sibling of a failed child is left running"
    assert sibling.cancelled()
    assert any("background task failed" in r.message and r.exc_info for r in caplog.records)


async def test_a_closed_scope_starts_nothing() -> None:
    scope = await TaskScope("test").open()
    await scope.close()
    assert not scope.running
    coro = forever()
    with pytest.raises(RuntimeError, match="closed"):
        scope.spawn(coro)
    assert inspect.getcoroutinestate(coro) == inspect.CORO_CLOSED, "refused, yet left never-awaited"


async def test_a_second_close_waits_for_the_first_to_end() -> None:
    release = asyncio.Event()
    ended: list[str] = []

    async def slow_cleanup() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            await release.wait()
            ended.append("child")

    scope = await TaskScope("test").open()
    scope.spawn(slow_cleanup())
    await asyncio.sleep(0)
    first = asyncio.ensure_future(scope.close())
    second = asyncio.ensure_future(scope.close())
    await asyncio.sleep(0)
    assert not second.done(), "a second close returned while the first still waits for a child"
    release.set()
    await asyncio.gather(first, second)
    assert ended == ["child"]


async def test_wait_lets_children_finish_within_a_bound() -> None:
    scope = await TaskScope("test").open()
    quick = scope.spawn(asyncio.sleep(0))
    stuck = scope.spawn(forever())
    assert await scope.wait(tasks=[quick]) is True
    assert await scope.wait(timeout_s=0, tasks=[stuck]) is False
    await scope.close()
    assert stuck.cancelled()


async def test_a_child_cancelled_before_its_first_step_leaves_no_coroutine_unawaited() -> None:
    scope = await TaskScope("test").open()
    coro = forever()
    scope.spawn(coro)
    await scope.close()  # before the child ever ran
    assert inspect.getcoroutinestate(coro) == inspect.CORO_CLOSED


# -- a cancelled task ends ---------------------------------------------------------------------
# A close cancels and then waits: a task that swallows its cancellation and goes on (to a
# loop's next 300 s sleep, say) holds the close, and whatever waits on it, until it wakes.


def wait_for_calls(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and _name_of(node.func) == "wait_for":
                found.append(f"{path.relative_to(root).as_posix()}:{node.lineno}")
    return found


def test_the_package_bounds_its_waits_with_within_not_wait_for() -> None:
    """On Python 3.11, `asyncio.wait_for` returns its awaitable's result, and drops the
    cancellation, when both land in the same turn of the event loop."""
    assert wait_for_calls(PACKAGE) == [], "use appliance.core.tasks.within"


async def test_within_is_cancelled_with_its_caller_even_as_its_awaitable_completes() -> None:
    done = asyncio.Event()
    waiting = asyncio.ensure_future(within(done.wait(), 60))
    await asyncio.sleep(0)
    done.set()
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting


async def test_within_times_out_with_a_timeout_error_in_a_task_already_cancelled() -> None:
    """A cleanup's bounded wait (a jail's kill after its launch was cancelled): 3.11's
    asyncio.timeout raises CancelledError there, so the fallback on TimeoutError never ran
    and the jail's processes were left (tests/test_pool.py's cancelled launches)."""
    timed_out: list[bool] = []

    async def cleanup_after_cancel() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            try:
                await within(asyncio.Event().wait(), 0.01)
            except TimeoutError:
                timed_out.append(True)
            raise

    task = asyncio.ensure_future(cleanup_after_cancel())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert timed_out == [True]


async def test_a_cell_cancelled_as_its_interpreter_exits_is_cancelled() -> None:
    waiting, exited = asyncio.Event(), asyncio.Event()

    class Process:
        async def wait(self) -> int:
            waiting.set()
            await exited.wait()
            return 0

    class FakeJail:
        process = Process()

    ending = asyncio.ensure_future(cell._exit_code(cast(Jail, FakeJail())))
    await waiting.wait()
    exited.set()
    ending.cancel()  # in the same turn: the exit code and the cancellation arrive together
    with pytest.raises(asyncio.CancelledError):
        await ending


async def test_the_canary_loop_ends_though_its_probe_swallowed_the_cancellation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The hang of a closing server (its canary loop went on to sleep CANARY_EVERY_S): the
    lifecycle's close cancelled the canary as its probe ended, and the probe dropped the
    cancellation (as `wait_for` did), so the loop never saw it."""
    probing = asyncio.Event()

    async def probe(self: Lifecycle) -> list[str]:
        probing.set()
        # Swallowed, as 3.11's wait_for does when its awaitable ends meanwhile.
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.Event().wait()
        return []

    monkeypatch.setattr(Lifecycle, "canary", probe)
    life = Lifecycle(Settings(), Metrics())
    await life.tasks.open()
    canary = life.tasks.spawn(life._canary_loop(), name="canary")
    await probing.wait()
    async with asyncio.timeout(30):  # a bound on a hang: the loop's next sleep is 300 s
        await life.tasks.cancel(canary)
    assert canary.cancelled()
    await life.tasks.close()


async def test_a_close_that_is_cancelled_while_it_waits_for_a_task_is_cancelled() -> None:
    """`task.cancel()` and then awaiting it under `suppress(CancelledError)` swallows the
    closer's own cancellation too: the sessions' close_all went on after a shutdown was cancelled."""
    release = asyncio.Event()

    async def slow_to_end() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            await release.wait()

    registry = SessionRegistry(limit=1, idle_s=60)
    scope = await TaskScope("test").open()
    reaper = scope.spawn(slow_to_end())
    registry._reaper = reaper
    await asyncio.sleep(0)  # the reaper waits
    closing = asyncio.ensure_future(registry.close_all())
    await asyncio.sleep(0)  # close_all waits for the reaper's end
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    assert not reaper.done()
    release.set()
    await scope.close()


async def test_cancel_and_wait_raises_the_task_s_error_and_not_its_cancellation() -> None:
    async def fails_as_it_ends() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            raise ValueError("cleanup failed")

    async def ends() -> None:
        await asyncio.Event().wait()

    failing, quiet = asyncio.ensure_future(fails_as_it_ends()), asyncio.ensure_future(ends())
    await asyncio.sleep(0)
    with pytest.raises(ValueError, match="cleanup failed"):
        await cancel_and_wait(failing)
    await cancel_and_wait(quiet)
    assert quiet.cancelled()


async def test_a_close_that_waits_long_names_the_task_it_waits_on_and_where(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr("appliance.core.tasks.CLOSE_REPORT_S", 0.0)
    release = asyncio.Event()
    reported = asyncio.Event()

    async def stubborn() -> None:
        while True:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                reported.set()
                await release.wait()  # the bug under report: it goes on
                return

    scope = await TaskScope("test").open()
    scope.spawn(stubborn(), name="stubborn")
    await asyncio.sleep(0)
    closing = asyncio.ensure_future(scope.close())
    await reported.wait()
    while not any(r.message == "task scope still waits on cancelled tasks" for r in caplog.records):
        await asyncio.sleep(0)
    release.set()
    await closing
    (record,) = [r for r in caplog.records if r.message == "task scope still waits on cancelled tasks"]
    where = record.__dict__["tasks"]["stubborn"]
    assert where[1].endswith(" stubborn") and "wait" in where[-1]
