"""Mount envd's Connect services under the E2B prefix: `{prefix}/{package.Service}/{Method}`."""

from __future__ import annotations

from aiohttp import web

from appliance.api.e2b.envd import connect, files, filesystem, process
from appliance.api.e2b.envd.messages import filesystem_connect, process_connect


def add_routes(app: web.Application, prefix: str) -> None:
    fs = filesystem_connect.FilesystemASGIApplication(
        filesystem.Filesystem(),
        interceptors=connect.interceptors(),
        read_max_bytes=connect.MAX_MESSAGE_BYTES,
    )
    connect.mount(app, prefix, "filesystem.Filesystem", fs)
    files.add_routes(app, prefix)
    proc = process_connect.ProcessASGIApplication(
        process.Process(),
        interceptors=connect.interceptors(),
        read_max_bytes=connect.MAX_MESSAGE_BYTES,
    )
    connect.mount(app, prefix, "process.Process", proc)
