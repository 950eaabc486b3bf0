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
import secrets
import stat
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal, TypeVar

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from protobuf import Oneof
from protobuf.wkt.google.protobuf.timestamp_pb import Timestamp

from appliance.api.e2b.envd import connect, paths
from appliance.api.e2b.envd.messages import filesystem_connect
from appliance.api.e2b.envd.messages import filesystem_pb as pb
from appliance.api.e2b.registry import Sandbox
from appliance.core.ports import Workspace
from appliance.core.tasks import within
from appliance.sandbox import workfiles
from appliance.sandbox.workfiles import FileProblem, Info
from appliance.sandbox.workwatch import Change, DirWatch, Inotify

T = TypeVar("T")

# The most entries one ListDir returns: a tree past it is refused, naming the cap.
MAX_LIST_ENTRIES = 10_000
# A sandbox's watches at once, the directories one recursive watch holds (each an inotify
# watch of root's, counted against the host's max_user_watches), and the changes one keeps
# unread: past these the watch is refused, or ends saying why.
MAX_WATCHES = 8
MAX_WATCH_DIRS = 256
MAX_WATCH_EVENTS = 1000
MAX_WATCHING_SANDBOXES = 32  # sandboxes watching at once: an inotify instance of root's each

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

    def __init__(self) -> None:
        self.watches = Watches()

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
        """The async SDK's watch: a stream that starts with `start`, then the changes as they
        come, a keepalive when none came for the interval the client asked; it ends with the
        sandbox, the watched directory, or the client."""
        sandbox = connect.sandbox_of(ctx)
        t = target(request.path)
        watch_id, w = await self.watches.open(sandbox, t, request.recursive)
        try:
            yield pb.WatchDirResponse(event=_start())
            interval = keepalive_s(ctx.request_headers.get(KEEPALIVE_HEADER))
            while True:
                if not w.changes and not w.ended:
                    try:
                        await within(w.wake.wait(), interval)
                    except TimeoutError:
                        yield pb.WatchDirResponse(event=_keepalive())
                        continue
                for event in await self._events(w, t, request.include_entry):
                    yield pb.WatchDirResponse(event=_change(event))
                if w.ended:
                    if w.failed:
                        raise ConnectError(Code.FAILED_PRECONDITION, w.failed)
                    return
        finally:
            self.watches.close(sandbox, watch_id)

    async def create_watcher(
        self, request: pb.CreateWatcherRequest, ctx: RequestContext[Any, Any], /
    ) -> pb.CreateWatcherResponse:
        """The sync SDK's watch: a watcher kept here, polled with GetWatcherEvents."""
        sandbox = connect.sandbox_of(ctx)
        t = target(request.path)
        watch_id, _ = await self.watches.open(sandbox, t, request.recursive, request.include_entry)
        return pb.CreateWatcherResponse(watcher_id=watch_id)

    async def get_watcher_events(
        self, request: pb.GetWatcherEventsRequest, ctx: RequestContext[Any, Any], /
    ) -> pb.GetWatcherEventsResponse:
        sandbox = connect.sandbox_of(ctx)
        w = self.watches.get(sandbox, request.watcher_id)
        events = await self._events(w, w.target, w.include_entry)
        if not events and w.ended and w.failed:
            raise ConnectError(Code.FAILED_PRECONDITION, w.failed)
        return pb.GetWatcherEventsResponse(events=events)

    async def remove_watcher(
        self, request: pb.RemoveWatcherRequest, ctx: RequestContext[Any, Any], /
    ) -> pb.RemoveWatcherResponse:
        sandbox = connect.sandbox_of(ctx)
        self.watches.get(sandbox, request.watcher_id)  # NOT_FOUND when not this sandbox's
        self.watches.close(sandbox, request.watcher_id)
        return pb.RemoveWatcherResponse()

    async def _events(self, w: Watch, t: paths.Target, include_entry: bool) -> list[pb.FilesystemEvent]:
        changes = w.take()
        entries: list[Info | None] = [None] * len(changes)
        if include_entry and changes:
            entries = await asyncio.to_thread(_entries, w, changes)
        return [
            pb.FilesystemEvent(
                name=c.name,
                type=EVENTS[c.kind],
                entry=entry(info, t.child(c.name), w.ws.uid) if info is not None else None,
            )
            for c, info in zip(changes, entries, strict=True)
        ]


EVENTS = {
    "create": pb.EventType.CREATE,
    "write": pb.EventType.WRITE,
    "remove": pb.EventType.REMOVE,
    "rename": pb.EventType.RENAME,
    "chmod": pb.EventType.CHMOD,
}
KEEPALIVE_HEADER = "Keepalive-Ping-Interval"


def _start() -> Oneof[Literal["start"], pb.WatchDirResponse.StartEvent]:
    return Oneof("start", pb.WatchDirResponse.StartEvent())


def _keepalive() -> Oneof[Literal["keepalive"], pb.WatchDirResponse.KeepAlive]:
    return Oneof("keepalive", pb.WatchDirResponse.KeepAlive())


def _change(event: pb.FilesystemEvent) -> Oneof[Literal["filesystem"], pb.FilesystemEvent]:
    return Oneof("filesystem", event)


def keepalive_s(asked: str | None) -> float:
    """The keepalive interval the client asked for (seconds), within 1 s and 5 minutes."""
    try:
        return float(min(max(int(asked or "50"), 1), 300))
    except ValueError:
        return 50.0


def _entries(w: Watch, changes: list[Change]) -> list[Info | None]:
    """What each changed entry is now, where it still is (a watch's include_entry)."""
    found: list[Info | None] = []
    for c in changes:
        if c.kind in ("remove", "rename"):
            found.append(None)
            continue
        try:
            found.append(workfiles.stat_path(w.ws, (*w.parts, *c.name.split("/")), c.name))
        except (FileProblem, OSError):
            found.append(None)
    return found


class Watch(DirWatch):
    """A watch as a call asked for it: its path as reported, and whether events carry entries."""

    target: paths.Target = paths.Target((), paths.HOME)
    include_entry: bool = False


class Watches:
    """The live watches of every sandbox, each bounded in what it holds (`workwatch`), and
    at most MAX_WATCHES per sandbox; all of a sandbox's end with it."""

    def __init__(self) -> None:
        self._of: dict[str, dict[str, Watch]] = {}
        self._hubs: dict[str, Inotify] = {}  # one inotify instance per sandbox that watches
        self._opening: dict[str, int] = {}  # watches being built, by sandbox
        self._hooked: set[str] = set()  # sandboxes whose end ends their watches (Sandbox.on_end)

    async def open(
        self, sandbox: Sandbox, t: paths.Target, recursive: bool, include_entry: bool = False
    ) -> tuple[str, Watch]:
        live = self._of.setdefault(sandbox.id, {})
        if len(live) >= MAX_WATCHES:
            raise ConnectError(
                Code.FAILED_PRECONDITION,
                f"a sandbox watches at most {MAX_WATCHES} directories at once; stop one first",
            )
        hub = self._hubs.get(sandbox.id)
        if hub is None:
            if len(self._hubs) >= MAX_WATCHING_SANDBOXES:
                raise ConnectError(
                    Code.FAILED_PRECONDITION,
                    f"{MAX_WATCHING_SANDBOXES} sandboxes watch directories already (each costs root an "
                    "inotify instance); try again once one has stopped",
                )
            hub = self._hubs[sandbox.id] = Inotify(MAX_WATCHES * MAX_WATCH_DIRS)
        self._opening[sandbox.id] = self._opening.get(sandbox.id, 0) + 1  # its hub stays meanwhile
        try:
            ws = open_workspace(sandbox)
            w = await asyncio.to_thread(Watch, hub, ws, t.parts, recursive, MAX_WATCH_DIRS, MAX_WATCH_EVENTS)
        except BaseException as exc:
            self._opened(sandbox.id)
            self._release_if_idle(sandbox.id)
            if isinstance(exc, FileProblem):
                raise ConnectError(CODES.get(exc.kind, Code.INTERNAL), exc.message) from None
            raise
        self._opened(sandbox.id)
        if sandbox.ended.is_set() or len(live) >= MAX_WATCHES:  # it ended, or filled up, meanwhile
            w.close()
            self._release_if_idle(sandbox.id)
            raise ConnectError(Code.NOT_FOUND, f"sandbox {sandbox.id!r} was not found")
        w.target, w.include_entry = t, include_entry
        w.start(asyncio.get_running_loop())
        watch_id = secrets.token_urlsafe(12)
        if sandbox.id not in self._hooked:
            self._hooked.add(sandbox.id)
            sandbox.on_end.append(lambda: self.end_all(sandbox.id))
        live[watch_id] = w
        return watch_id, w

    def get(self, sandbox: Sandbox, watch_id: str) -> Watch:
        w = self._of.get(sandbox.id, {}).get(watch_id)
        if w is None:
            raise ConnectError(Code.NOT_FOUND, f"watcher {watch_id[:64]!r} not found")
        return w

    def close(self, sandbox: Sandbox, watch_id: str) -> None:
        live = self._of.get(sandbox.id, {})
        w = live.pop(watch_id, None)
        if w is not None:
            w.close()
        self._release_if_idle(sandbox.id)

    def _opened(self, sandbox_id: str) -> None:
        self._opening[sandbox_id] -= 1
        if not self._opening[sandbox_id]:
            del self._opening[sandbox_id]

    def _release_if_idle(self, sandbox_id: str) -> None:
        """A sandbox's inotify instance goes back with its last watch."""
        if self._of.get(sandbox_id) or self._opening.get(sandbox_id):
            return
        hub = self._hubs.pop(sandbox_id, None)
        if hub is not None:
            hub.close()

    def end_all(self, sandbox_id: str) -> None:
        self._hooked.discard(sandbox_id)
        for w in self._of.pop(sandbox_id, {}).values():
            w.close()
        hub = self._hubs.pop(sandbox_id, None)
        if hub is not None:
            hub.close()
