"""Helpers for the adversarial suite: the hostile server's secrets, running code, leftovers."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from appliance_client.client import AsyncClient, Execution
from tests.support import Server, run_descendants, run_root, scaled

# The hostile server is started with these in its environment; no frame may ever carry them.
TOKEN = "attack-suite-token-7c1e9a4b"
AWS_SECRET = "AKIAFAKEATTACKSUITE/s3cr3t-value-9f8e7d"
SECRETS = (TOKEN, AWS_SECRET)

# ctypes access to raw system calls (x86_64 numbers) for the escape attacks.
SYSCALLS = """
import ctypes, errno, json, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def sc(nr, *args):
    ctypes.set_errno(0)
    conv = [ctypes.c_char_p(a) if isinstance(a, bytes) else ctypes.c_long(a) for a in args]
    r = libc.syscall(ctypes.c_long(nr), *conv)
    return {"ret": r, "errno": ctypes.get_errno(), "name": errno.errorcode.get(ctypes.get_errno(), "0")}
"""


def attack(name: str, expected: str) -> pytest.MarkDecorator:
    """Mark a test as one attack of the audit; its class comes from the test file."""
    return pytest.mark.attack(name=name, expected=expected)


def assert_no_secret(frames: Sequence[dict[str, Any]]) -> None:
    blob = json.dumps(frames, ensure_ascii=False)
    for secret in SECRETS:
        assert secret not in blob, "a server secret reached the client"


def assert_one_done(frames: Sequence[dict[str, Any]]) -> None:
    dones = [f for f in frames if f.get("type") == "done"]
    assert len(dones) == 1 and frames[-1] is dones[0], f"expected exactly one final done, got {len(dones)}"


async def run(
    server: Server, code: str, *, token: str | None = TOKEN, timeout: float = 90, **fields: Any
) -> Execution:
    """Run code on server and gather the frames; checks one done and no leaked secret."""
    async with AsyncClient(server.url, token) as client:
        ex = await asyncio.wait_for(client.execute(code, **fields), scaled(timeout))
    assert_no_secret(ex.frames)
    assert_one_done(ex.frames)
    return ex


async def probe(server: Server, code: str, **fields: Any) -> tuple[Execution, Any]:
    """Run code whose last stdout line is a JSON report; return the run and the report."""
    ex = await run(server, code, **fields)
    lines = [ln for ln in ex.stdout.splitlines() if ln.strip()]
    assert lines, f"no report printed: status={ex.status} stderr={ex.stderr[-800:]} error={ex.error}"
    return ex, json.loads(lines[-1])


def run_dirs(server: Server) -> list[str]:
    """Run directories the server has under its SANDBOX_TMP_ROOT (besides the jails' prepared /etc)."""
    base = run_root(Path(server.env["SANDBOX_TMP_ROOT"]), server.proc.pid)
    try:
        return sorted(set(os.listdir(base)) - {"etc"})
    except FileNotFoundError:
        return []


def leftovers(server: Server, timeout: float = 15) -> tuple[list[int], list[str]]:
    """Processes under the server and run directories still there after timeout (pool off)."""
    deadline = time.monotonic() + scaled(timeout)
    while True:
        procs, dirs = run_descendants(server.proc.pid), run_dirs(server)
        if (not procs and not dirs) or time.monotonic() > deadline:
            return procs, dirs
        time.sleep(0.1)


async def assert_contained(server: Server, token: str | None = TOKEN) -> str:
    """Nothing of the run is left and the server still runs code (for `token`); returns a short note."""
    procs, dirs = await asyncio.to_thread(leftovers, server)
    assert not procs, f"processes of the run survived: {procs}"
    assert not dirs, f"run directories left behind: {dirs}"
    assert server.proc.poll() is None, "the server died"
    ex = await run(server, "print('still here')", token=token)
    assert ex.status == "ok" and ex.stdout == "still here\n", ex
    return "no process or run dir left; server answered the next run"
