"""envd's Filesystem service (stat, list, make_dir, move, remove, watch) on a sandbox's files.

A sandbox's files are its default context's working directory (`paths`), reached by the
server from outside by descriptor, following no link (`appliance.sandbox.workfiles`).
Errors are Connect's codes as the SDK maps them: a missing path NOT_FOUND
(FileNotFoundException), an existing one ALREADY_EXISTS (make_dir's False), a bad or
unreachable path INVALID_ARGUMENT, a link or a foreign file on the way PERMISSION_DENIED.
"""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from protobuf.wkt.google.protobuf.timestamp_pb import Timestamp

from appliance.api.e2b.envd import connect, paths
from appliance.api.e2b.envd.messages import filesystem_connect
from appliance.api.e2b.envd.messages import filesystem_pb as pb
from appliance.api.e2b.registry import Sandbox
from appliance.core.ports import Workspace
from appliance.sandbox import workfiles
from appliance.sandbox.workfiles import FileProblem, Info

T = TypeVar("T")

# The most entries one ListDir returns: a tree past it is refused, naming the cap.
MAX_LIST_ENTRIES = 10_000

CODES = {
    "not_found": Code.NOT_FOUND,
    "exists": Code.ALREADY_EXISTS,
    "not_dir": Code.INVALID_ARGUMENT,
    "is_dir": Code.INVALID_ARGUMENT,
    "invalid": Code.INVALID_ARGUMENT,
    "refused": Code.PERMISSION_DENIED,
    "too_many": Code.FAILED_PRECONDITION,
    "no_space": Code.RESOURCE_EXHAUSTED,
}

TYPES = {"file": pb.FileType.FILE, "dir": pb.FileType.DIRECTORY, "symlink": pb.FileType.SYMLINK}


def target(path: str) -> paths.Target:
    try:
        return paths.resolve(path)
    except paths.BadPath as exc:
        raise ConnectError(Code.INVALID_ARGUMENT, str(exc)) from None


def user_name(uid: int, ws_uid: int) -> str:
    """E2B's names for owners: the sandbox's user is `user`."""
    return "user" if uid == ws_uid else ("root" if uid == 0 else str(uid))


def entry(info: Info, path: str, ws_uid: int) -> pb.EntryInfo:
    seconds = int(info.mtime)
    return pb.EntryInfo(
        name=info.name or posixpath_name(path),
        type=TYPES.get(info.kind, pb.FileType.UNSPECIFIED),
        path=path,
        size=info.size,
        mode=stat.S_IMODE(info.mode),
        permissions=stat.filemode(info.mode),
        owner=user_name(info.uid, ws_uid),
        group=user_name(info.gid, ws_uid),
        modified_time=Timestamp(seconds=seconds, nanos=int((info.mtime - seconds) * 1e9)),
        symlink_target=info.target,
        is_symlink=info.kind == "symlink",
    )


def posixpath_name(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def open_workspace(sandbox: Sandbox) -> Workspace:
    ws = connect.reached().sandboxes.open_workspace(sandbox)
    if ws is None:
        raise ConnectError(Code.NOT_FOUND, f"sandbox {sandbox.id!r} was not found (its session has ended)")
    return ws


async def on_files(sandbox: Sandbox, fn: Callable[[Workspace], T]) -> T:
    """Run fn on the sandbox's working directory in a thread; FileProblem as a Connect error."""
    ws = open_workspace(sandbox)
    try:
        return await asyncio.to_thread(fn, ws)
    except FileProblem as exc:
        raise ConnectError(CODES.get(exc.kind, Code.INTERNAL), exc.message) from None
    finally:
        os.close(ws.fd)


class Filesystem(filesystem_connect.Filesystem):
    """envd's `filesystem.Filesystem`, one instance per server."""

    async def stat(self, request: pb.StatRequest, ctx: RequestContext[Any, Any], /) -> pb.StatResponse:
        sandbox = connect.sandbox_of(ctx)
        t = target(request.path)
        info, uid = await on_files(sandbox, lambda ws: (workfiles.stat_path(ws, t.parts, t.shown), ws.uid))
        return pb.StatResponse(entry=entry(info, t.shown, uid))

    async def make_dir(
        self, request: pb.MakeDirRequest, ctx: RequestContext[Any, Any], /
    ) -> pb.MakeDirResponse:
        sandbox = connect.sandbox_of(ctx)
        t = target(request.path)
        info, uid = await on_files(sandbox, lambda ws: (workfiles.make_dir(ws, t.parts, t.shown), ws.uid))
        return pb.MakeDirResponse(entry=entry(info, t.shown, uid))

    async def move(self, request: pb.MoveRequest, ctx: RequestContext[Any, Any], /) -> pb.MoveResponse:
        sandbox = connect.sandbox_of(ctx)
        src, dst = target(request.source), target(request.destination)
        info, uid = await on_files(
            sandbox, lambda ws: (workfiles.move(ws, src.parts, dst.parts, (src.shown, dst.shown)), ws.uid)
        )
        return pb.MoveResponse(entry=entry(info, dst.shown, uid))

    async def list_dir(
        self, request: pb.ListDirRequest, ctx: RequestContext[Any, Any], /
    ) -> pb.ListDirResponse:
        sandbox = connect.sandbox_of(ctx)
        t = target(request.path)
        depth = request.depth or 1
        found, uid = await on_files(
            sandbox, lambda ws: (workfiles.listing(ws, t.parts, depth, MAX_LIST_ENTRIES, t.shown), ws.uid)
        )
        return pb.ListDirResponse(entries=[entry(info, t.child(rel), uid) for rel, info in found])

    async def remove(self, request: pb.RemoveRequest, ctx: RequestContext[Any, Any], /) -> pb.RemoveResponse:
        sandbox = connect.sandbox_of(ctx)
        t = target(request.path)
        await on_files(sandbox, lambda ws: workfiles.remove(ws, t.parts, t.shown))
        return pb.RemoveResponse()

    # -- watching -------------------------------------------------------------------------
    async def watch_dir(
        self, request: pb.WatchDirRequest, ctx: RequestContext[Any, Any], /
    ) -> AsyncIterator[pb.WatchDirResponse]:
        raise ConnectError(Code.UNIMPLEMENTED, "watch_dir is not built yet")
        yield pb.WatchDirResponse()  # pragma: no cover (makes this an async generator)

    async def create_watcher(
        self, request: pb.CreateWatcherRequest, ctx: RequestContext[Any, Any], /
    ) -> pb.CreateWatcherResponse:
        raise ConnectError(Code.UNIMPLEMENTED, "watchers are not built yet")

    async def get_watcher_events(
        self, request: pb.GetWatcherEventsRequest, ctx: RequestContext[Any, Any], /
    ) -> pb.GetWatcherEventsResponse:
        raise ConnectError(Code.UNIMPLEMENTED, "watchers are not built yet")

    async def remove_watcher(
        self, request: pb.RemoveWatcherRequest, ctx: RequestContext[Any, Any], /
    ) -> pb.RemoveWatcherResponse:
        raise ConnectError(Code.UNIMPLEMENTED, "watchers are not built yet")
