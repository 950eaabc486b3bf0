"""The server's short scheduler slice (appliance.sandbox.sched): asked for at startup, kept with
the nice value and any policy an operator chose, inherited by what the server starts."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from typing import Any

from appliance.sandbox import sched
from appliance_client.client import AsyncClient
from tests.support import Server

# Custom slices for the normal policy came with Linux 6.12; an older kernel accepts the request
# and keeps the default, which request_slice must then report instead of claiming it.
_release = re.match(r"(\d+)\.(\d+)", os.uname().release)
KEEPS_SLICES = _release is not None and (int(_release[1]), int(_release[2])) >= (6, 12)

PROBE = """
import json, os, subprocess, sys
from appliance.sandbox import sched
before = sched.current_slice()
refused = sched.request_slice()
child = subprocess.run(
    [sys.executable, "-c", "from appliance.sandbox import sched; print(sched.current_slice())"],
    capture_output=True, text=True, check=True,
).stdout
print(json.dumps({
    "before": before, "refused": refused, "after": sched.current_slice(), "child": int(child),
    "nice": os.getpriority(os.PRIO_PROCESS, 0), "policy": os.sched_getscheduler(0),
}))
"""


def probe(*prefix: str) -> dict[str, Any]:
    """PROBE run in a fresh interpreter under `prefix` (nice, chrt): what it saw."""
    out = subprocess.run(
        [*prefix, sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60, check=True
    )
    seen: dict[str, Any] = json.loads(out.stdout)
    return seen


def test_the_slice_is_granted_inherited_and_the_nice_value_kept() -> None:
    seen = probe("nice", "-n", "7")
    assert seen["nice"] == 7 and seen["policy"] == os.SCHED_OTHER
    if KEEPS_SLICES:
        assert seen["before"] > sched.SLICE_NS  # the kernel's default
        assert seen["refused"] is None
        assert seen["after"] == seen["child"] == sched.SLICE_NS
    else:
        assert seen["refused"].startswith("the kernel keeps no custom slice")
        assert seen["after"] == seen["child"] == seen["before"]


def test_a_policy_the_operator_chose_is_left_as_it_is() -> None:
    seen = probe("chrt", "--batch", "0")
    assert seen["refused"] == f"the server runs under scheduling policy {os.SCHED_BATCH}, left as it is"
    assert seen["policy"] == os.SCHED_BATCH
    assert seen["after"] == seen["before"]


def test_attr_round_trips_the_slice_and_the_nice_value() -> None:
    raw = sched.attr(-3, 250_000)
    assert len(raw) == 48 and sched.slice_of(raw) == 250_000
    assert int.from_bytes(raw[16:20], "little", signed=True) == -3


JAILED = """
import ctypes, struct
buf = ctypes.create_string_buffer(48)
nr = {"x86_64": 315, "aarch64": 275}[__import__("os").uname().machine]
rc = ctypes.CDLL(None).syscall(*(ctypes.c_long(x) for x in (nr, 0, ctypes.addressof(buf), 48, 0)))
print(rc, struct.unpack_from("=IIQiIQ", buf.raw)[5])
"""


async def test_the_server_and_its_jails_run_with_the_short_slice(server: Server) -> None:
    expected = sched.SLICE_NS if KEEPS_SLICES else sched.current_slice(os.getpid())
    assert sched.current_slice(server.proc.pid) == expected
    async with AsyncClient(server.url) as c:
        ex = await c.execute(JAILED)
    assert ex.status == "ok", ex.message
    assert ex.stdout.split() == ["0", str(expected)]
