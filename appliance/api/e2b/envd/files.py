"""envd's HTTP `/files`: a sandbox's files downloaded (GET) and uploaded (POST), as the SDK sends them.

Download: `GET /files?path=P` streams the file (chunked, gzip when the client asks), read
by descriptor from a file that is the sandbox's own (`appliance.sandbox.workfiles`).
Upload: `POST /files` with a `multipart/form-data` body, one `file` part per file named by
its path (the `path` query names a lone file's), or `application/octet-stream` with `path`
in the query; answered with `[{"name", "type": "file", "path"}]`. Each file is streamed to a
fresh name and renamed over its target, so a link planted there is replaced, never
followed. A request's files together are bounded by SANDBOX_MAX_DISK_MB (the working
directory cannot hold more; its tmpfs refuses it first: 507, NotEnoughSpaceException) and
their number by SANDBOX_MAX_UPLOAD_FILES.

Errors are the statuses the SDK maps: 400 InvalidArgument, 404 FileNotFound (an unknown
sandbox or a wrong token too), 507 NotEnoughSpace; a link or foreign file 403.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from email.message import Message
from typing import Any

from aiohttp import BodyPartReader, web

from appliance.api.e2b.envd import connect, paths
from appliance.api.e2b.registry import Sandbox
from appliance.api.transport import send_within
from appliance.core.errors import Cancelled
from appliance.core.ports import Workspace
from appliance.sandbox import workfiles
from appliance.sandbox.workfiles import FileProblem

CHUNK = 1 << 16
STATUS = {
    "not_found": 404,
    "exists": 409,
    "not_dir": 400,
    "is_dir": 400,
    "invalid": 400,
    "refused": 403,
    "too_many": 400,
    "no_space": 507,
}


def error(status: int, message: str) -> web.Response:
    return web.json_response({"code": status, "message": message}, status=status)


class Refusal(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _target(path: str | None) -> paths.Target:
    if not path:
        raise Refusal(400, "a file's path is required")
    try:
        return paths.resolve(path)
    except paths.BadPath as exc:
        raise Refusal(400, str(exc)) from None


def _workspace(found: connect.Reach, sandbox: Sandbox) -> Workspace:
    ws = found.sandboxes.open_workspace(sandbox)
    if ws is None:
        raise Refusal(404, f"sandbox {sandbox.id!r} was not found (its session has ended)")
    return ws


def handler(fn: Any) -> Any:
    async def wrapped(request: web.Request) -> web.StreamResponse:
        found = connect.reach(request)
        if found.sandbox is None:
            return error(404 if found.code.name == "NOT_FOUND" else 502, found.message)
        try:
            response: web.StreamResponse = await fn(request, found, found.sandbox)
        except Refusal as exc:
            return error(exc.status, exc.message)
        except FileProblem as exc:
            return error(STATUS.get(exc.kind, 500), exc.message)
        return response

    return wrapped


async def download(request: web.Request, found: connect.Reach, sandbox: Sandbox) -> web.StreamResponse:
    t = _target(request.query.get("path"))
    ws = _workspace(found, sandbox)
    try:
        fd, _size = await asyncio.to_thread(workfiles.open_file, ws, t.parts, t.shown)
    finally:
        os.close(ws.fd)
    stall_s = found.sandboxes.service.settings.client_stall_ms / 1000
    try:
        response = web.StreamResponse(
            headers={
                "Content-Type": "application/octet-stream",
                "Cache-Control": "no-store",
            }
        )
        if "gzip" in request.headers.get("Accept-Encoding", ""):
            response.enable_compression()
        try:
            await send_within(request, response.prepare(request), stall_s)
            while chunk := await asyncio.to_thread(os.read, fd, CHUNK):
                await send_within(request, response.write(chunk), stall_s)
            await send_within(request, response.write_eof(), stall_s)
        except Cancelled:
            pass  # the client went away or stopped reading: the connection is dropped
        return response
    finally:
        os.close(fd)


async def _parts(request: web.Request) -> AsyncIterator[tuple[str | None, BodyPartReader]]:
    reader = await request.multipart()
    while True:
        part = await reader.next()
        if part is None:
            return
        if not isinstance(part, BodyPartReader):
            raise Refusal(400, "a nested multipart body is not a file")
        yield _filename(part.headers.get("Content-Disposition", "")), part


def _filename(disposition: str) -> str | None:
    """A part's filename as sent: the SDK puts the file's whole path there, which aiohttp's
    own parser would strip of its leading '/' (the stdlib's keeps it, RFC 2231 included)."""
    header = Message()
    header["Content-Disposition"] = disposition
    return header.get_filename()


class Budget:
    def __init__(self, max_bytes: int, max_files: int) -> None:
        self.left = max_bytes
        self.max_bytes = max_bytes
        self.files = 0
        self.max_files = max_files

    def file(self) -> None:
        self.files += 1
        if self.files > self.max_files:
            raise Refusal(400, f"more than {self.max_files} files in one upload (SANDBOX_MAX_UPLOAD_FILES)")

    def take(self, n: int) -> None:
        self.left -= n
        if self.left < 0:
            raise Refusal(
                413,
                f"the upload passes {self.max_bytes} bytes, all the sandbox's disk holds (SANDBOX_MAX_DISK_MB)",
            )


async def _store(
    ws: Workspace, t: paths.Target, chunks: AsyncIterator[bytes], budget: Budget
) -> dict[str, str]:
    """Stream chunks into a new file at t; its name, type and path for the reply."""
    new = await asyncio.to_thread(workfiles.NewFile, ws, t.parts, t.shown)
    try:
        async for chunk in chunks:
            budget.take(len(chunk))
            await asyncio.to_thread(new.write, chunk)
        await asyncio.to_thread(new.commit)
    except BaseException:
        await asyncio.to_thread(new.abort)
        raise
    return {"name": t.parts[-1], "type": "file", "path": t.shown}


async def _part_chunks(part: BodyPartReader) -> AsyncIterator[bytes]:
    while chunk := await part.read_chunk(CHUNK):
        yield chunk


async def _body_chunks(request: web.Request) -> AsyncIterator[bytes]:
    while chunk := await request.content.read(CHUNK):
        yield chunk


async def upload(request: web.Request, found: connect.Reach, sandbox: Sandbox) -> web.StreamResponse:
    settings = found.sandboxes.service.settings
    budget = Budget(settings.max_disk_mb * 1024 * 1024, settings.max_upload_files)
    lone = request.query.get("path")
    written: list[dict[str, str]] = []
    ws = _workspace(found, sandbox)
    try:
        if request.content_type == "multipart/form-data":
            async for filename, part in _parts(request):
                budget.file()
                if lone is not None and budget.files > 1:
                    raise Refusal(400, "'path' names one file; send each file's path as its part's filename")
                written.append(await _store(ws, _target(lone or filename), _part_chunks(part), budget))
        else:
            budget.file()
            written.append(await _store(ws, _target(lone), _body_chunks(request), budget))
    finally:
        os.close(ws.fd)
    if not written:
        raise Refusal(400, "no file in the upload")
    return web.json_response(written)


def add_routes(app: web.Application, prefix: str) -> None:
    app.router.add_get(f"{prefix}/files", handler(download))
    app.router.add_post(f"{prefix}/files", handler(upload))
