"""The control pipe's writer on a real pipe, no jail: it never blocks the event loop, holds
at most what a caller allows, and lets nothing wait forever on a driver that is gone."""

from __future__ import annotations

import asyncio
import fcntl
import os
from collections.abc import Iterator

import pytest

from appliance.core.domain import PipeFull
from appliance.sandbox.control import ControlPipe

PIPE_BYTES = 4096  # the pipe's capacity in these tests (one page: the smallest Linux allows)


@pytest.fixture
def pipe() -> Iterator[list[int]]:
    """[read end, write end]; a test that closes an end itself sets it to -1. The write end is
    the ControlPipe's, which each test closes."""
    ends = list(os.pipe2(os.O_CLOEXEC))
    fcntl.fcntl(ends[1], fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    yield ends
    if ends[0] >= 0:
        os.close(ends[0])


def read_all(fd: int) -> bytes:
    os.set_blocking(fd, False)
    parts = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            break
        if not chunk:
            break
        parts.append(chunk)
    return b"".join(parts)


async def test_what_the_pipe_cannot_take_waits_and_goes_out_as_the_driver_reads(
    pipe: list[int],
) -> None:
    r, w = pipe
    control = ControlPipe(w, asyncio.get_running_loop())
    data = bytes(range(256)) * 64  # four pipes' worth
    control.write(data)  # returns at once although the pipe is full
    assert 0 < control.pending() < len(data)
    flushed = asyncio.ensure_future(control.flushed())
    got = b""
    while len(got) < len(data):
        await asyncio.sleep(0)  # let the writer run as the pipe drains
        got += read_all(r)
    await asyncio.wait_for(flushed, 5)
    assert got == data and control.pending() == 0
    control.close()


async def test_a_limit_refuses_what_would_wait_past_it_and_keeps_what_waits(pipe: list[int]) -> None:
    r, w = pipe
    control = ControlPipe(w, asyncio.get_running_loop())
    control.write(b"x" * (PIPE_BYTES + 100))  # the pipe takes PIPE_BYTES: 100 wait
    with pytest.raises(PipeFull):
        control.write(b"y" * 50, limit=120)
    control.write(b"z" * 20, limit=120)
    assert control.pending() == 120
    assert read_all(r) == b"x" * PIPE_BYTES
    control.close()


async def test_a_driver_that_is_gone_drops_what_waits_and_releases_its_waiters(pipe: list[int]) -> None:
    r, w = pipe
    control = ControlPipe(w, asyncio.get_running_loop())
    control.write(b"x" * (PIPE_BYTES * 2))
    flushed = asyncio.ensure_future(control.flushed())
    os.close(r)  # the driver is gone: the next write gets EPIPE
    pipe[0] = -1
    await asyncio.wait_for(flushed, 5)
    assert control.closed and control.pending() == 0
    with pytest.raises(BrokenPipeError):
        control.write(b"more")


async def test_closing_releases_waiters_and_refuses_later_writes(pipe: list[int]) -> None:
    _, w = pipe
    control = ControlPipe(w, asyncio.get_running_loop())
    control.write(b"x" * (PIPE_BYTES * 2))
    flushed = asyncio.ensure_future(control.flushed())
    await asyncio.sleep(0)
    control.close()
    await asyncio.wait_for(flushed, 5)
    control.close()  # twice is harmless
    with pytest.raises(BrokenPipeError):
        control.write(b"x")
