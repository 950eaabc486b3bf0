"""E2B sandboxes on the run service: each code context is a session, every cell a request.

Nothing here reaches a jail but through `RunService` (submit, execute, close_session), so a
sandbox is under the same admission, tenant quotas, limits and watchdogs as a native session.
A sandbox ends at its timeout (the reaper), when killed, or when its default context's session
ends (idle past SANDBOX_SESSION_IDLE_S, or over a limit between cells).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from appliance.api.e2b import commands, registry, shapes
from appliance.api.e2b.registry import Context, Registry, Sandbox
from appliance.core.errors import ApplianceError, Busy, RequestRejected, UnknownSnapshot
from appliance.core.events import Done, Emit, Event
from appliance.core.ports import Workspace
from appliance.core.service import Run, RunService
from appliance.core.sessions import Session
from appliance.core.tasks import TaskScope, cancel_and_wait, checkpoint
from appliance.sandbox.jail import Jail
from appliance.wire.protocol import ExecuteRequest, GpuRequest

log = logging.getLogger("appliance.api.e2b")

REAP_S = 0.5
WORKDIR = "/workspace"  # the jail's working directory: what a context reports as its cwd


@dataclass
class Refused(Exception):
    """A call the server did not carry out: an HTTP status and a message for the SDK."""

    status: int
    message: str
    retry_after_ms: int | None = None  # a `busy` refusal: when to come back (appliance.api.busy)


def refusal(done: Done) -> Refused:
    """The HTTP error for a cell that did not end ok (busy 429 with its hint, rejected 400,
    else 500)."""
    return Refused(
        {"busy": 429, "rejected": 400}.get(done.status, 500), done.message or done.status, done.retry_after_ms
    )


def _setup_code(envs: dict[str, str]) -> str:
    """A cell that puts envs into the interpreter's environment, binding no name of the user's."""
    if not envs:
        return ""
    return f"__import__('os').environ.update(__import__('json').loads({json.dumps(json.dumps(envs))}))"


def set_envs_code(envs: dict[str, str]) -> str:
    """Per-call env vars: remember what they replace (on the os module, out of the user's
    namespace), then set them; `RESTORE_ENVS_CODE` puts the environment back after the cell."""
    payload = json.dumps(json.dumps(envs))
    return (
        "(lambda os, new: (setattr(os, '_appliance_e2b_env', {k: os.environ.get(k) for k in new}), "
        f"os.environ.update(new)))(__import__('os'), __import__('json').loads({payload}))"
    )


RESTORE_ENVS_CODE = (
    "(lambda os: [os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v) "
    "for k, v in os.__dict__.pop('_appliance_e2b_env', {}).items()])(__import__('os'))"
)


class Sandboxes:
    def __init__(self, service: RunService, clock: Callable[[], float] = time.time) -> None:
        self.service = service
        self.registry = Registry()
        self.snapshots = registry.SnapshotBook()  # E2B's snapshots, per tenant
        self.clock = clock
        self._reaper: asyncio.Task[None] | None = None
        self.tasks: TaskScope | None = None  # the server's scope: commands' watchers run in it
        self.commands: dict[str, commands.Table] = {}  # sandbox id -> its commands
        self.proxied: dict[str, int] = {}  # sandbox id -> connections its port proxy holds

    # -- lifetime ---------------------------------------------------------------------------
    def start(self, owner: TaskScope) -> None:
        self.tasks = owner
        if self._reaper is None:
            self._reaper = owner.spawn(self._reap(), name="e2b-reaper")

    async def close(self) -> None:
        if self._reaper is not None:
            await cancel_and_wait(self._reaper)
        for sandbox in self.registry.all():
            await self.kill(sandbox)

    async def _reap(self) -> None:
        while True:
            checkpoint()
            await asyncio.sleep(REAP_S)
            for sandbox in self.registry.expired(self.clock()):
                try:
                    await self.kill(sandbox)
                except Exception:  # one sandbox's teardown must not stop the others'
                    log.exception("could not end an expired E2B sandbox", extra={"sandbox": sandbox.id})

    # -- sandboxes --------------------------------------------------------------------------
    async def create(  # noqa: PLR0913 (the create request's parts, one argument each)
        self,
        owner: str,
        template: str,
        timeout_s: int,
        metadata: dict[str, str],
        envs: dict[str, str],
        gpu_mb: int = 0,
        from_snapshot: str | None = None,
    ) -> Sandbox:
        """A new sandbox; its default context restored from a snapshot of the owner's when named."""
        if gpu_mb and not self.service.settings.gpu:
            raise Refused(
                400,
                f"metadata {shapes.GPU_KEY}={gpu_mb} asks for a GPU, but this appliance runs without "
                "SANDBOX_GPU (leave the key out)",
            )
        now = self.clock()
        sandbox = Sandbox(
            id=registry.new_id(),
            owner=owner,
            template=template,
            token=registry.new_token(),
            started_at=now,
            end_at=now + timeout_s,
            metadata=metadata,
            envs=envs,
            gpu_mb=gpu_mb,
        )
        default = await self.new_context(sandbox, from_snapshot=from_snapshot)
        sandbox.default = default.id
        self.registry.add(sandbox)
        return sandbox

    async def kill(self, sandbox: Sandbox) -> None:
        """End a sandbox, running or paused (its snapshot is deleted)."""
        async with sandbox.transition:  # after a pause or resume under way, never in its middle
            self.registry.remove(sandbox.id)
            await self._end_jails(sandbox)
            if sandbox.paused is not None:
                await self._forget_snapshot(sandbox, sandbox.paused)

    async def _end_jails(self, sandbox: Sandbox) -> None:
        """End what runs in the sandbox: its watchers, commands and every context's session."""
        sandbox.ended.set()
        while sandbox.on_end:
            try:
                sandbox.on_end.pop()()
            except Exception:  # one watcher's teardown must not keep the sandbox's sessions open
                log.exception("could not end what lived with an E2B sandbox", extra={"sandbox": sandbox.id})
        table = self.commands.pop(sandbox.id, None)
        if table is not None:
            await table.close()
        for ctx in list(sandbox.contexts.values()):
            await self.service.close_session(ctx.session, sandbox.owner)
        sandbox.contexts.clear()

    async def _forget_snapshot(self, sandbox: Sandbox, snapshot_id: str) -> None:
        try:
            await self.service.delete_snapshot(snapshot_id, sandbox.owner)
        except Exception:  # the sandbox is gone or running either way; the store's quota says the rest
            log.exception("could not delete a paused E2B sandbox's snapshot", extra={"sandbox": sandbox.id})

    def _quiet_default(self, sandbox: Sandbox, what: str, feature: str) -> Context:
        """The default context, when a snapshot of it (for a pause or a snapshot) keeps all the
        sandbox holds: refused (nothing changes) while other contexts, commands or a cell exist."""
        if not self.service.snapshots.enabled:
            raise Refused(
                501, f"{feature} is not supported by this server: it needs SANDBOX_SNAPSHOT_DIR set"
            )
        others = [c for c in sandbox.contexts if c != sandbox.default]
        if others:
            raise Refused(
                400,
                f"a {what} keeps the default context only; remove the other contexts first: {', '.join(others)}",
            )
        table = self.commands.get(sandbox.id)
        running = table.running() if table is not None else []
        if running:
            pids = ", ".join(str(c.pid) for c in running)
            raise Refused(
                400, f"commands are running (pid {pids}); a {what} keeps no process: kill them first"
            )
        ctx = sandbox.contexts.get(sandbox.default)
        if ctx is None:
            raise Refused(404, f"sandbox {sandbox.id} has ended")
        if ctx.lock.locked():
            raise Refused(
                400, f"a cell is running in the default context; the {what} can be taken after it ends"
            )
        return ctx

    # -- snapshots (E2B's: templates made of a sandbox) -------------------------------------------
    async def snapshot(self, sandbox: Sandbox, name: str) -> registry.SnapshotEntry:
        """Keep the default context's state as a snapshot new sandboxes can start from; the
        sandbox goes on running. The same refusals as a pause; a paused sandbox is refused."""
        async with sandbox.transition:
            if sandbox.paused is not None:
                raise Refused(409, f"sandbox {sandbox.id} is paused; resume it to take a snapshot")
            ctx = self._quiet_default(sandbox, "snapshot", "snapshots")
            async with ctx.lock:
                info = await self.service.snapshot_session(ctx.session, sandbox.owner)
            entry = registry.SnapshotEntry(
                id=info.id, owner=sandbox.owner, sandbox_id=sandbox.id, name=name, created=self.clock()
            )
            await self.snapshots_of(sandbox.owner)  # what the native API deleted goes: a bounded book
            self.snapshots.add(entry)
            if info.skipped:
                log.warning(
                    "an E2B sandbox's snapshot did not keep everything",
                    extra={"sandbox": sandbox.id, "skipped": list(info.skipped)},
                )
            return entry

    async def snapshots_of(self, owner: str) -> list[registry.SnapshotEntry]:
        """A tenant's E2B snapshots, less any the store no longer has (deleted through the
        native API): at most SANDBOX_MAX_SNAPSHOTS manifests read."""
        kept = []
        for entry in self.snapshots.of_owner(owner):
            try:
                await self.service.find_snapshot(entry.id, owner)
            except UnknownSnapshot:
                self.snapshots.remove(owner, entry.id)
                continue
            kept.append(entry)
        return kept

    async def find_snapshot(self, owner: str, ref: str) -> registry.SnapshotEntry | None:
        """A tenant's snapshot by id or name; None for anything else (another tenant's too). An
        id the book does not hold but the store does (taken before a restart, or through the
        native API) is the tenant's all the same, and is listed from then on."""
        entry = self.snapshots.find(owner, ref)
        if entry is not None or not self.service.snapshots.enabled:
            return entry
        try:
            info = await self.service.find_snapshot(ref, owner)
        except ApplianceError:  # UnknownSnapshot for any id that is not the tenant's
            return None
        entry = registry.SnapshotEntry(id=info.id, owner=owner, sandbox_id="", name="", created=info.created)
        self.snapshots.add(entry)
        return entry

    async def delete_snapshot(self, owner: str, ref: str) -> bool:
        """Delete a tenant's E2B snapshot (by id or name); False when it has none such."""
        entry = await self.find_snapshot(owner, ref)
        if entry is None:
            return False
        # The store's answer is False when it was deleted there already (the native API); an
        # error leaves it listed, to delete again.
        await self.service.delete_snapshot(entry.id, owner)
        self.snapshots.remove(owner, entry.id)
        return True

    # -- pause and resume ---------------------------------------------------------------------
    async def pause(self, sandbox: Sandbox) -> bool:
        """Keep the default context's state as a snapshot and end the sandbox's jails; False when
        it was paused already. Refused (and nothing changes) while it has other contexts, running
        commands or a running cell: a pause keeps only what a snapshot holds, and names no loss."""
        async with sandbox.transition:
            if sandbox.paused is not None:
                return False
            ctx = self._quiet_default(sandbox, "pause", "pause")
            # The context's turn is held to the end, so a cell that waited for it finds the
            # session gone rather than running after the snapshot was taken.
            async with ctx.lock:
                info = await self.service.snapshot_session(ctx.session, sandbox.owner)
                # Paused before its sessions end, so it never reads as ended in between.
                sandbox.paused = info.id
                sandbox.paused_executions = ctx.executions
                await self._end_jails(sandbox)
            if info.skipped:
                log.warning(
                    "an E2B sandbox's pause did not keep everything",
                    extra={"sandbox": sandbox.id, "skipped": list(info.skipped)},
                )
            return True

    async def resume(self, sandbox: Sandbox) -> bool:
        """Restore a paused sandbox's default context into a new session under the same sandbox
        id, context id and access token; False when it was running. If the restore fails, the
        sandbox stays paused and its snapshot kept (the error says why)."""
        async with sandbox.transition:
            snapshot_id = sandbox.paused
            if snapshot_id is None:
                return False
            sandbox.ended = asyncio.Event()
            try:
                ctx = await self.new_context(sandbox, sandbox.default, from_snapshot=snapshot_id)
            except BaseException:
                sandbox.ended.set()
                raise
            ctx.executions = sandbox.paused_executions
            sandbox.paused = None
            await self._forget_snapshot(sandbox, snapshot_id)
            return True

    def owned(self, sandbox_id: str, owner: str) -> Sandbox | None:
        return self._alive(self.registry.owned(sandbox_id, owner))

    def reached(self, sandbox_id: str, token: str | None) -> Sandbox | None:
        """A running sandbox, for sandbox traffic (a paused one has no jail to reach)."""
        found = self._alive(self.registry.reached(sandbox_id, token))
        return found if found is not None and found.paused is None else None

    def of_owner(self, owner: str) -> list[Sandbox]:
        return [s for s in self.registry.of_owner(owner) if self._alive(s) is not None]

    def _alive(self, sandbox: Sandbox | None) -> Sandbox | None:
        """The sandbox, unless it is past its end or its default context's session has ended
        (then it is forgotten here; its other sessions end with it, by the reaper). A paused
        one lives to its end, with no session."""
        if sandbox is None:
            return None
        if sandbox.paused is not None:
            return sandbox if sandbox.end_at > self.clock() else None
        if sandbox.end_at <= self.clock() or not self._session_alive(sandbox, sandbox.default):
            sandbox.end_at = min(sandbox.end_at, self.clock())  # the reaper ends the rest
            return None
        return sandbox

    def _session_alive(self, sandbox: Sandbox, context_id: str) -> bool:
        return self._session_of(sandbox, context_id) is not None

    def _session_of(self, sandbox: Sandbox, context_id: str) -> Session | None:
        """The live session of one of the sandbox's contexts; None once it has ended."""
        ctx = sandbox.contexts.get(context_id)
        if ctx is None:
            return None
        try:
            return self.service.sessions.get(ctx.session, sandbox.owner)
        except RequestRejected:
            return None

    def open_workspace(self, sandbox: Sandbox) -> Workspace | None:
        """The working directory of the sandbox's default context (its files, envd's
        filesystem), as a descriptor of the caller's own; None once that session has ended."""
        session = self._session_of(sandbox, sandbox.default)
        if session is None:
            return None
        return session.jail.open_workspace()

    def jail_of(self, sandbox: Sandbox) -> Jail | None:
        """The jail of the sandbox's default context, where its commands run and its ports
        are; None once it is gone. Its session counts as used (commands and proxied
        requests keep a sandbox from ending idle, as cells do)."""
        session = self._session_of(sandbox, sandbox.default)
        if session is None:
            return None
        jail = session.jail
        if not isinstance(jail, Jail) or not jail.alive:
            return None
        session.last_used = self.service.clock()
        return jail

    def commands_of(self, sandbox: Sandbox) -> commands.Table:
        return self.commands.setdefault(sandbox.id, commands.Table())

    def set_timeout(self, sandbox: Sandbox, timeout_s: int) -> None:
        sandbox.end_at = self.clock() + timeout_s

    # -- contexts ---------------------------------------------------------------------------
    async def new_context(
        self, sandbox: Sandbox, context_id: str | None = None, from_snapshot: str | None = None
    ) -> Context:
        """Open a session for a context (its own jail and interpreter, with the sandbox's GPU
        budget) with the sandbox's env vars; from a snapshot when resuming."""
        req = ExecuteRequest(
            code=_setup_code(sandbox.envs),
            stdin_eof=True,
            gpu=GpuRequest(memory_mb=sandbox.gpu_mb) if sandbox.gpu_mb else None,
            from_snapshot=from_snapshot,
        )
        # Without env vars to set or a snapshot to restore, no first cell: the context is
        # ready when its jail is leased.
        first_cell = bool(req.code) or from_snapshot is not None
        done = _done_of(await self.service.open_session(req, sandbox.owner, first_cell=first_cell))
        session = done.session
        if done.status != "ok" or session is None:
            if session is not None:  # opened, but its first cell failed: not kept
                await self.service.close_session(session, sandbox.owner)
            raise refusal(done)
        ctx = Context(id=context_id or registry.new_id(), session=session, cwd=WORKDIR)
        sandbox.contexts[ctx.id] = ctx
        return ctx

    async def remove_context(self, sandbox: Sandbox, ctx: Context) -> None:
        sandbox.contexts.pop(ctx.id, None)
        await self.service.close_session(ctx.session, sandbox.owner)

    async def restart_context(self, sandbox: Sandbox, ctx: Context) -> Context:
        """A fresh interpreter under the same context id. The old session ends first, so a
        tenant at its session quota can restart too; if the new one cannot open, the context
        is gone (and with the default context, its sandbox)."""
        await self.remove_context(sandbox, ctx)
        return await self.new_context(sandbox, ctx.id)

    # -- cells ------------------------------------------------------------------------------
    async def quiet_cell(self, sandbox: Sandbox, ctx: Context, code: str) -> None:
        """Run a cell of the server's own (env vars in, env vars out); its output is dropped."""
        events: list[Event] = []

        async def collect(event: Event) -> None:
            events.append(event)

        req = ExecuteRequest(code=code, session=ctx.session, stdin_eof=True)
        await self.service.execute(req, sandbox.owner, collect)
        done = _done_of(events)
        if done.status != "ok":
            raise refusal(done)

    def submit(
        self,
        sandbox: Sandbox,
        ctx: Context,
        code: str,
        emit: Emit,
        tasks: TaskScope,
    ) -> Run:
        req = ExecuteRequest(code=code, session=ctx.session, stdin_eof=True)
        return self.service.submit(req, sandbox.owner, emit, tasks)


def _done_of(events: list[Event]) -> Done:
    """A run's `Done`: its last event (the service always sends one)."""
    last = events[-1] if events else None
    return last if isinstance(last, Done) else Done("internal", message="no reply")


def as_refused(exc: ApplianceError) -> Refused:
    if isinstance(exc, Busy):
        return Refused(429, exc.message, exc.retry_after_ms)
    return Refused(400, exc.message)
