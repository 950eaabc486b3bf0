"""appliance.sandbox.egresssplice: the proxy's in-kernel download relay, on real TCP sockets
(loopback): every byte arrives in order and is counted, a reader that stops ends the relay
after the idle time, and the caller's descriptors stay open."""

from __future__ import annotations

import asyncio
import os
import socket
import threading

import pytest

from appliance.sandbox import egresssplice

pytestmark = pytest.mark.skipif(not egresssplice.available(), reason="no os.splice on this platform")


def _pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        a = socket.create_connection(listener.getsockname())
        b, _ = listener.accept()
    a.setblocking(False)
    b.setblocking(False)
    return a, b


async def test_every_byte_arrives_in_order_and_is_counted() -> None:
    payload = os.urandom(5 * (1 << 20) + 17)
    far, src = _pair()  # far end writes into src
    dst, jail = _pair()  # the relay writes into dst, the jail reads from jail
    counted: list[int] = []
    got = bytearray()

    def far_end() -> None:
        far.setblocking(True)
        far.sendall(payload)
        far.shutdown(socket.SHUT_WR)

    def reader() -> None:
        jail.setblocking(True)
        while chunk := jail.recv(65536):
            got.extend(chunk)

    threads = [threading.Thread(target=far_end), threading.Thread(target=reader)]
    for t in threads:
        t.start()
    await egresssplice.relay(src.fileno(), dst.fileno(), 5.0, counted.append)
    dst.shutdown(socket.SHUT_WR)
    for t in threads:
        await asyncio.to_thread(t.join, 10)
    assert bytes(got) == payload and sum(counted) == len(payload)
    assert src.fileno() >= 0 and dst.fileno() >= 0  # still the caller's to close
    for s in (far, src, dst, jail):
        s.close()


def _sending(far: socket.socket, piece: bytes, stop: threading.Event) -> threading.Thread:
    """A far end that sends `piece` again and again until `stop` (or its socket breaks), started."""

    def far_end() -> None:
        far.setblocking(True)
        far.settimeout(0.2)
        while not stop.is_set():
            try:
                far.send(piece)
            except TimeoutError:
                continue
            except OSError:
                return

    writer = threading.Thread(target=far_end)
    writer.start()
    return writer


async def test_a_reader_that_stops_ends_the_relay_after_the_idle_time() -> None:
    far, src = _pair()
    dst, jail = _pair()
    stop = threading.Event()
    writer = _sending(far, b"x" * 65536, stop)
    counted: list[int] = []
    with pytest.raises(TimeoutError):
        await egresssplice.relay(src.fileno(), dst.fileno(), 0.5, counted.append)
    stop.set()
    await asyncio.to_thread(writer.join, 10)
    assert 0 < sum(counted) < 1 << 30  # it moved what the jail's buffers took, then gave up
    for s in (far, src, dst, jail):
        s.close()


async def test_each_part_goes_on_at_once_and_a_silent_far_end_times_out() -> None:
    """A far end that sends a little and waits for the answer (a stream, a long poll) has each
    part relayed as it comes, not held for more; once it falls silent, the relay ends after
    the idle time."""
    far, src = _pair()
    dst, jail = _pair()
    far.setblocking(True)
    jail.setblocking(True)
    jail.settimeout(5)
    relay = asyncio.create_task(egresssplice.relay(src.fileno(), dst.fileno(), 1.0, lambda n: None))
    for i in range(20):
        part = b"event %d\n" % i
        far.sendall(part)
        assert await asyncio.to_thread(jail.recv, 4096) == part  # before the next is sent
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(relay, 10)
    for s in (far, src, dst, jail):
        s.close()


async def test_a_pipe_full_of_small_parts_does_not_spin_the_relay(monkeypatch: pytest.MonkeyPatch) -> None:
    """A far end sending 100-byte segments to a jail that never reads: the pipe is full at
    256 parts, far below its size in bytes, while the far end's socket stays readable. The
    relay must then wait for the jail's room (none comes) and end at the idle time, not step
    again at every turn of the loop (which burnt a CPU for the whole idle time)."""
    far, src = _pair()
    dst, jail = _pair()
    far.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # each part its own segment
    stop = threading.Event()
    nothing: list[int] = []  # splices that moved nothing
    real = egresssplice._splice

    def spied(a: int, b: int, size: int) -> int:
        moved = real(a, b, size)
        if moved < 0:
            nothing.append(1)
        return moved

    monkeypatch.setattr(egresssplice, "_splice", spied)

    writer = _sending(far, b"s" * 100, stop)
    counted: list[int] = []
    try:
        with pytest.raises(TimeoutError):
            await egresssplice.relay(src.fileno(), dst.fileno(), 1.0, counted.append)
    finally:
        stop.set()
        await asyncio.to_thread(writer.join, 10)
    assert sum(counted) > 0
    # Each idle splice is one the loop woke the relay for: a few hundred at most while the
    # pipe and the jail's buffers fill, where a spin makes one every few microseconds.
    assert len(nothing) < 2000, len(nothing)
    for s in (far, src, dst, jail):
        s.close()
