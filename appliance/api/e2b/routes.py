"""Mount the E2B dialect on the server's app, under one prefix for both of the SDK's URLs."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from appliance.api.e2b import control, interpreter
from appliance.api.e2b.engine import Sandboxes
from appliance.api.e2b.envd import routes as envd
from appliance.api.transport import TASKS_KEY

PREFIX = "/e2b"


def add_routes(app: web.Application, service_key: web.AppKey[Any]) -> None:
    """Routes under PREFIX; the sandboxes start with the app and end with it."""

    sandboxes = app[control.SANDBOXES_KEY] = Sandboxes(app[service_key])

    async def start(app: web.Application) -> None:
        sandboxes.start(app[TASKS_KEY])  # the server's scope, opened by an earlier startup step

    async def stop(app: web.Application) -> None:
        await sandboxes.close()

    app.on_startup.append(start)
    app.on_cleanup.insert(0, stop)  # before the service's sessions are drained
    control.add_routes(app, PREFIX)
    interpreter.add_routes(app, PREFIX)
    envd.add_routes(app, PREFIX)
