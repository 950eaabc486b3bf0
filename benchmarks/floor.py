"""The floor of a warm run on this machine: the appliance's exchange with nothing else.

    python -m benchmarks.floor PORT_FILE

An aiohttp WebSocket server (the appliance's transport, compression off) with one warm
child interpreter behind two pipes, and nothing of a sandbox: no jail, no admission, no
cgroup, no disk check, no kill. Per request it does what the appliance's hot path cannot do
without: parse the frame, write the op to the child, send `start`, read the child's two
events (output, then the end of the cell) and send `stream` and `done`. The child runs the
code with `exec` and writes each event as it happens, as the driver does; it lives on
across requests, so it is always warmer than a single-use jail. It asks the scheduler for the
appliance's short slice (`appliance.sandbox.sched`), so that neither has an edge there.

`python -m benchmarks.hotpath --floor` measures it beside the appliance, run for run with
the same client and the same idle time before each run: what the appliance adds to the
round trip is the difference, and the floor is what no change to the server can remove.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import socket
import sys
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

from aiohttp import WSMsgType, web

from appliance.sandbox import sched

CHILD = "child"


def child() -> None:
    """Read one op per line from stdin; write a `stream` event, then a `done` event, each
    as one line of JSON and one write to stdout (fd 1)."""
    out = os.fdopen(1, "wb", buffering=0)
    namespace: dict[str, Any] = {}
    for line in sys.stdin.buffer:
        op = json.loads(line)
        buf = io.StringIO()
        with redirect_stdout(buf):
            exec(compile(op["code"], "<cell>", "exec"), namespace)  # noqa: S102 - the benchmark's own code
        out.write(json.dumps({"ev": "stream", "text": buf.getvalue()}).encode() + b"\n")
        out.write(json.dumps({"ev": "done", "exit_code": 0}).encode() + b"\n")


class Worker:
    """The warm child and its two pipes; one request at a time."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.lock = asyncio.Lock()

    async def run(self, ws: web.WebSocketResponse, rid: str, code: str) -> None:
        async with self.lock:
            stdin, stdout = self.proc.stdin, self.proc.stdout
            if stdin is None or stdout is None:
                raise RuntimeError("the child has no pipes")
            stdin.write(json.dumps({"code": code}).encode() + b"\n")
            await ws.send_str(json.dumps({"type": "start", "id": rid, "run": rid, "queued_ms": 0}))
            while True:
                event = json.loads(await stdout.readline())
                if event["ev"] == "stream":
                    await ws.send_str(
                        json.dumps({"type": "stream", "id": rid, "name": "stdout", "text": event["text"]})
                    )
                else:
                    await ws.send_str(json.dumps({"type": "done", "id": rid, "status": "ok", "exit_code": 0}))
                    return


async def exec_socket(request: web.Request) -> web.WebSocketResponse:
    ws = web.WebSocketResponse(compress=False, max_msg_size=0)
    await ws.prepare(request)
    worker: Worker = request.app["worker"]
    async for msg in ws:
        if msg.type != WSMsgType.TEXT:
            break
        frame = json.loads(msg.data)
        await worker.run(ws, str(frame["id"]), str(frame["code"]))
    return ws


async def serve(sock: socket.socket) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "benchmarks.floor",
        CHILD,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    app = web.Application()
    app["worker"] = Worker(proc)
    app.router.add_get("/exec", exec_socket)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.SockSite(runner, sock).start()
    await asyncio.Event().wait()


def main() -> None:
    if sys.argv[1:] == [CHILD]:
        child()
    else:
        sched.request_slice()  # as the appliance's server does, its child inheriting it
        # Bound and listening before the port is told: a client may connect at once.
        sock = socket.create_server(("127.0.0.1", 0))
        Path(sys.argv[1]).write_text(str(sock.getsockname()[1]))
        asyncio.run(serve(sock))


if __name__ == "__main__":
    main()
