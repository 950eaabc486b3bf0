"""envd's process service (E2B's `sandbox.commands`), on the sandbox's jail.

Start runs a command in the jail of the sandbox's default context (appliance.sandbox.jailexec:
as the jail's uid, in its namespaces, cgroup and limits) and streams its output: a `start`
event with its number, `data` events as it writes, one `end`. Connect streams a running
command's output from then on; List, SendInput, StreamInput, CloseStdin and SendSignal act on
the sandbox's table of commands (appliance.api.e2b.commands). A stream whose client goes away
leaves its command running (E2B's `disconnect`); a client that stops reading is cut after
SANDBOX_CLIENT_STALL_MS, and until then the command blocks on its output instead of the
server buffering it. Terminals (`pty`) and Update are not supported: they answer
`unimplemented`, naming the feature.

Env vars: the jail's own, then the sandbox's `envs`, then the command's. The working
directory: /workspace (E2B's /home/user); `cwd` as E2B names it (appliance.api.e2b.commands).
"""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator
from typing import Any, Literal

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from protobuf import Oneof

from appliance.api.e2b import commands
from appliance.api.e2b.commands import Command, TableFull
from appliance.api.e2b.envd.connect import reached, sandbox_of
from appliance.api.e2b.envd.messages import process_connect
from appliance.api.e2b.envd.messages import process_pb as pb
from appliance.api.e2b.registry import Sandbox
from appliance.core.domain import PipeFull
from appliance.core.errors import JailFailure
from appliance.core.tasks import within
from appliance.sandbox.jailexec import Data, Ended, Reader

KEEPALIVE_S = 30.0  # a stream with nothing to say says so this often (proxies close idle ones)
SIGNALS = {pb.Signal.SIGTERM: signal.SIGTERM, pb.Signal.SIGKILL: signal.SIGKILL}


def _started(pid: int) -> pb.ProcessEvent:
    event: Oneof[Literal["start"], pb.ProcessEvent.StartEvent] = Oneof(
        "start", pb.ProcessEvent.StartEvent(pid=pid)
    )
    return pb.ProcessEvent(event=event)


def _data(item: Data) -> pb.ProcessEvent:
    stdout: Oneof[Literal["stdout"], bytes] = Oneof("stdout", item.data)
    stderr: Oneof[Literal["stderr"], bytes] = Oneof("stderr", item.data)
    output = stdout if item.stream == "stdout" else stderr
    event: Oneof[Literal["data"], pb.ProcessEvent.DataEvent] = Oneof(
        "data", pb.ProcessEvent.DataEvent(output=output)
    )
    return pb.ProcessEvent(event=event)


def _keepalive() -> pb.ProcessEvent:
    event: Oneof[Literal["keepalive"], pb.ProcessEvent.KeepAlive] = Oneof(
        "keepalive", pb.ProcessEvent.KeepAlive()
    )
    return pb.ProcessEvent(event=event)


def _end(ended: Ended) -> pb.ProcessEvent:
    end = pb.ProcessEvent.EndEvent(
        exit_code=ended.exit_code,
        exited=ended.signal is None and ended.error is None,
        status=ended.status,
        error=ended.error,
    )
    event: Oneof[Literal["end"], pb.ProcessEvent.EndEvent] = Oneof("end", end)
    return pb.ProcessEvent(event=event)


def _table(sandbox: Sandbox) -> commands.Table:
    return reached().sandboxes.commands_of(sandbox)


def _selected(sandbox: Sandbox, selector: pb.ProcessSelector | None) -> Command:
    """The running command a selector names; not_found otherwise."""
    chosen = selector.selector if selector is not None else None
    command = None
    if chosen is not None and chosen.field == "pid":
        command = _table(sandbox).find(pid=chosen.value)
    elif chosen is not None and chosen.field == "tag":
        command = _table(sandbox).find(tag=chosen.value)
    if command is None:
        what = f"{chosen.field} {chosen.value!r}" if chosen is not None else "no process"
        raise ConnectError(Code.NOT_FOUND, f"process with {what} not found")
    return command


async def _stream(reader: Reader, sandbox: Sandbox) -> AsyncIterator[pb.ProcessEvent]:
    """The command's events from `reader` until its end (keepalives while it is quiet)."""
    try:
        while True:
            try:
                item = await within(reader.next(), KEEPALIVE_S)
            except TimeoutError:
                yield _keepalive()
                continue
            if isinstance(item, Data):
                yield _data(item)
            else:
                yield _end(item)
                return
    finally:
        reader.close()


class Process(process_connect.Process):
    """envd's `process.Process`, as the SDK calls it (e2b.envd.process.process_connect)."""

    async def start(self, request: pb.StartRequest, ctx: Any, /) -> AsyncIterator[pb.StartResponse]:
        sandbox = sandbox_of(ctx)
        config = request.process
        if config is None or not config.cmd:
            raise ConnectError(Code.INVALID_ARGUMENT, "a process to start names its cmd")
        if request.has_field("pty"):
            raise ConnectError(Code.UNIMPLEMENTED, "terminals (pty) are not supported by this server")
        sandboxes = reached().sandboxes
        jail = sandboxes.jail_of(sandbox)
        if jail is None or sandboxes.tasks is None:
            raise ConnectError(
                Code.NOT_FOUND, f"sandbox {sandbox.id!r} was not found (its session has ended)"
            )
        envs = {**sandbox.envs, **dict(config.envs)}
        stdin = request.stdin if request.has_field("stdin") else True
        try:
            command = await commands.start(
                _table(sandbox),
                jail,
                [config.cmd, *config.args],
                envs,
                config.cwd if config.has_field("cwd") else None,
                request.tag if request.has_field("tag") else None,
                stdin,
                sandboxes.tasks,
            )
        except TableFull as exc:
            raise ConnectError(Code.RESOURCE_EXHAUSTED, str(exc)) from None
        except ValueError as exc:
            raise ConnectError(Code.INVALID_ARGUMENT, str(exc)) from None
        except JailFailure as exc:
            raise ConnectError(Code.UNAVAILABLE, exc.message) from None
        reader = command.process.reader()  # before any await: no output is missed
        yield pb.StartResponse(event=_started(command.pid))
        async for event in _stream(reader, sandbox):
            yield pb.StartResponse(event=event)

    async def connect(self, request: pb.ConnectRequest, ctx: Any, /) -> AsyncIterator[pb.ConnectResponse]:
        sandbox = sandbox_of(ctx)
        command = _selected(sandbox, request.process)
        reader = command.process.reader()
        yield pb.ConnectResponse(event=_started(command.pid))
        async for event in _stream(reader, sandbox):
            yield pb.ConnectResponse(event=event)

    async def list(self, request: pb.ListRequest, ctx: Any, /) -> pb.ListResponse:
        sandbox = sandbox_of(ctx)
        return pb.ListResponse(
            processes=[
                pb.ProcessInfo(
                    config=pb.ProcessConfig(cmd=c.cmd, args=list(c.args), envs=dict(c.envs), cwd=c.cwd),
                    pid=c.pid,
                    tag=c.tag,
                )
                for c in _table(sandbox).running()
            ]
        )

    async def send_input(self, request: pb.SendInputRequest, ctx: Any, /) -> pb.SendInputResponse:
        sandbox = sandbox_of(ctx)
        command = _selected(sandbox, request.process)
        _write(command, request.input)
        return pb.SendInputResponse()

    async def stream_input(
        self, request: AsyncIterator[pb.StreamInputRequest], ctx: Any, /
    ) -> pb.StreamInputResponse:
        sandbox = sandbox_of(ctx)
        command: Command | None = None
        async for message in request:
            event = message.event
            if event is None:
                continue
            if event.field == "start":
                command = _selected(sandbox, event.value.process)
            elif event.field == "data":
                if command is None:
                    raise ConnectError(Code.INVALID_ARGUMENT, "stream input names its process first")
                _write(command, event.value.input)
        return pb.StreamInputResponse()

    async def close_stdin(self, request: pb.CloseStdinRequest, ctx: Any, /) -> pb.CloseStdinResponse:
        sandbox = sandbox_of(ctx)
        command = _selected(sandbox, request.process)
        try:
            command.process.close_stdin()
        except ValueError as exc:
            raise ConnectError(Code.FAILED_PRECONDITION, str(exc)) from None
        return pb.CloseStdinResponse()

    async def send_signal(self, request: pb.SendSignalRequest, ctx: Any, /) -> pb.SendSignalResponse:
        sandbox = sandbox_of(ctx)
        command = _selected(sandbox, request.process)
        sig = SIGNALS.get(request.signal)
        if sig is None:
            raise ConnectError(Code.INVALID_ARGUMENT, "the signal must be SIGTERM or SIGKILL")
        try:
            command.process.send_signal(sig)
        except ProcessLookupError:
            raise ConnectError(Code.NOT_FOUND, f"process {command.pid} has ended") from None
        return pb.SendSignalResponse()

    async def update(self, request: pb.UpdateRequest, ctx: Any, /) -> pb.UpdateResponse:
        sandbox_of(ctx)
        raise ConnectError(Code.UNIMPLEMENTED, "terminals (pty) are not supported by this server")


def _write(command: Command, data: pb.ProcessInput | None) -> None:
    chosen = data.input if data is not None else None
    if chosen is None:
        return
    if chosen.field == "pty":
        raise ConnectError(Code.UNIMPLEMENTED, "terminals (pty) are not supported by this server")
    try:
        command.process.write_stdin(chosen.value)
    except ValueError as exc:
        raise ConnectError(Code.FAILED_PRECONDITION, str(exc)) from None
    except (PipeFull, BrokenPipeError) as exc:
        raise ConnectError(Code.RESOURCE_EXHAUSTED, f"stdin not taken: {exc}") from None
