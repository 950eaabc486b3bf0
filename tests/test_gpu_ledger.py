"""The GPU ledger against the simulated backend: admission, FIFO queueing, rejection, reconciliation."""

from __future__ import annotations

import asyncio
import time
import types

import pytest

from appliance.core.errors import Busy, RequestRejected
from appliance.core.events import GpuShare
from appliance.gpu import ledger as ledger_module
from appliance.gpu.ledger import GpuLedger
from appliance.gpu.simulated import SimulatedBackend
from appliance.settings import parse_simulated_devices as parse_spec
from tests.support import until_async


def ledger_for(backend: SimulatedBackend, margin_mb: int = 256, max_wait_ms: int = 5000) -> GpuLedger:
    return GpuLedger(backend.devices(), margin_mb=margin_mb, max_wait_ms=max_wait_ms)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The ledger's monotonic clock, set by the test (`clock[0]`): a grant's queued_ms is then
    exact, whatever the machine's speed. The event loop keeps the real clock."""
    now = [1000.0]
    monkeypatch.setattr(ledger_module, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    return now


def test_simulated_device_specs_parse_counts_and_lists() -> None:
    assert parse_spec("2x16384") == (16384, 16384)
    assert parse_spec("16384, 8192") == (16384, 8192)
    for bad in ("", "2x", "x100", "0x100", "abc", "2x-5"):
        with pytest.raises(ValueError, match=r"is not COUNTxMIB or MIB|must be positive"):
            parse_spec(bad)


async def test_a_run_is_admitted_to_the_device_with_the_most_room(clock: list[float]) -> None:
    backend = SimulatedBackend((16384, 16384))
    backend.set_foreign_mb(0, 4000)
    ledger = ledger_for(backend)
    ledger.load(backend.devices(), backend.processes(), ours=())
    asked = asyncio.create_task(ledger.acquire(2048))
    await asyncio.sleep(0)  # one step of the task: admitted there, not put in line
    assert ledger.waiting == 0 and ledger.snapshot()[1]["reserved_mb"] == 2048
    clock[0] += 5  # admission was at the asking: time passing after it is not queue time
    grant = await asked
    assert (grant.index, grant.uuid, grant.memory_mb) == (1, "GPU-SIM-1", 2048)
    assert grant.share() == GpuShare(1, "GPU-SIM-1", 2048)
    assert grant.queued_ms == 0


async def test_reserved_plus_margin_plus_foreign_must_fit() -> None:
    backend = SimulatedBackend((10000,))
    ledger = ledger_for(backend, margin_mb=1000, max_wait_ms=200)
    first = await ledger.acquire(8000)  # 8000 + 1000 margin <= 10000
    with pytest.raises(Busy):
        await ledger.acquire(1001)  # 8000 + 1001 + 1000 > 10000: waits, then busy
    ledger.release(first)
    second = await ledger.acquire(9000)  # exactly total - margin
    assert second.memory_mb == 9000


async def test_waiting_runs_are_admitted_first_in_first_out() -> None:
    backend = SimulatedBackend((16384,))
    ledger = ledger_for(backend)
    holder = await ledger.acquire(16000)
    order: list[str] = []

    async def ask(name: str, mb: int) -> None:
        grant = await ledger.acquire(mb)
        order.append(name)
        await asyncio.sleep(0.05)
        ledger.release(grant)

    big = asyncio.create_task(ask("big", 12000))
    await until_async(lambda: ledger.waiting == 1, 10, "big in line")
    small = asyncio.create_task(ask("small", 100))  # would fit beside `big`'s wait, but queues behind it
    await until_async(lambda: ledger.waiting == 2, 10, "small in line behind big")
    assert order == []
    ledger.release(holder)
    await asyncio.gather(big, small)
    assert order == ["big", "small"]


async def test_a_budget_larger_than_any_device_is_rejected_at_once_not_queued() -> None:
    ledger = ledger_for(SimulatedBackend((16384, 8192)), max_wait_ms=60000)
    with pytest.raises(RequestRejected, match="can never fit"):
        await asyncio.wait_for(ledger.acquire(16384 - 255), timeout=1)
    assert ledger.waiting == 0
    for bad in (0, -5):
        with pytest.raises(RequestRejected):
            await ledger.acquire(bad)


async def test_reconciliation_counts_memory_of_non_runs_and_frees_it_when_it_goes(clock: list[float]) -> None:
    backend = SimulatedBackend((16384,))
    ledger = ledger_for(backend)
    backend.set_usage(pid=999_999, index=0, used_mb=10000)  # a process that is not one of our runs
    ledger.load(backend.devices(), backend.processes(), ours=())
    assert ledger.snapshot()[0]["foreign_mb"] == 10000
    waiter = asyncio.create_task(ledger.acquire(8000))
    await until_async(lambda: ledger.waiting == 1, 10, "the run in line")
    assert not waiter.done()
    clock[0] += 2.5  # the foreign memory is held for 2.5 s of the ledger's clock
    backend.set_usage(pid=999_999, index=0, used_mb=0)
    ledger.load(backend.devices(), backend.processes(), ours=())
    grant = await asyncio.wait_for(waiter, 1)
    assert grant.queued_ms == 2500


async def test_usage_of_our_own_runs_is_not_counted_twice() -> None:
    backend = SimulatedBackend((16384,))
    ledger = ledger_for(backend)
    grant = await ledger.acquire(6000)
    backend.set_usage(pid=4242, index=0, used_mb=5500)
    ledger.load(backend.devices(), backend.processes(), ours={4242})
    assert ledger.snapshot()[0] == {
        "index": 0,
        "uuid": "GPU-SIM-0",
        "total_mb": 16384,
        "reserved_mb": 6000,
        "foreign_mb": 0,
        "runs": 1,
        "reclaiming": 0,
        "reclaim_timeouts": 0,
    }
    ledger.release(grant)


async def test_what_our_runs_hold_beyond_their_grants_admits_nobody() -> None:
    # An overrunner between two polls: its grant covers 2000 MiB, it holds 7000. Counted as
    # covered, the books showed 14000 MiB of room on a device with 9000 free, and a 10000 MiB
    # run was admitted into memory that was not there (the acceptance kit's out-of-memory).
    backend = SimulatedBackend((16384,))
    ledger = ledger_for(backend, margin_mb=256, max_wait_ms=200)
    over = await ledger.acquire(2000)
    backend.set_usage(pid=4242, index=0, used_mb=7000)
    ledger.load(backend.devices(), backend.processes(), ours={4242})
    book = ledger.snapshot()[0]
    assert (book["reserved_mb"], book["foreign_mb"], book["over_grant_mb"]) == (2000, 0, 5000)
    with pytest.raises(Busy):
        await ledger.acquire(10000)  # 2000 + 5000 + 10000 + 256 > 16384
    fits = await ledger.acquire(9000)  # what is really free, less the margin
    ledger.release(fits)
    ledger.release(over)


async def test_the_margin_each_running_run_may_use_is_kept_for_it() -> None:
    # The watchdog stops a run only past grant + margin. With one margin per device, two runs
    # of 4000 each at 4500 (both within their limits, never stopped) and a third admitted with
    # 1400 held 10400 MiB on a 10000 MiB device: the third run's grant was not there.
    backend = SimulatedBackend((10000,))
    ledger = ledger_for(backend, margin_mb=500, max_wait_ms=200)
    a, b = await ledger.acquire(4000), await ledger.acquire(4000)
    with pytest.raises(Busy):
        await ledger.acquire(1400)  # 4000 + 500 + 4000 + 500 + 1400 + 500 > 10000
    backend.set_usage(pid=1, index=0, used_mb=4500)
    backend.set_usage(pid=2, index=0, used_mb=4500)
    ledger.load(backend.devices(), backend.processes(), ours={1, 2})
    with pytest.raises(Busy):
        await ledger.acquire(1400)  # the same, with the margins in use
    fits = await ledger.acquire(500)  # 9000 + 500 + its own 500 margin = 10000
    for grant in (fits, a, b):
        ledger.release(grant)


async def test_queued_runs_that_can_no_longer_fit_are_rejected_when_a_device_vanishes() -> None:
    big, small = SimulatedBackend((16384, 8192)), SimulatedBackend((8192,))
    ledger = ledger_for(big)
    holder = await ledger.acquire(16000)
    waiter = asyncio.create_task(ledger.acquire(15000))
    await until_async(lambda: ledger.waiting == 1, 10, "the run in line")
    assert not waiter.done()
    ledger.load(small.devices(), (), ())  # the 16 GiB device is gone (its holder still runs)
    with pytest.raises(RequestRejected, match="no longer fit"):
        await asyncio.wait_for(waiter, 1)
    ledger.release(holder)


async def test_a_cancelled_waiter_leaves_the_queue_and_frees_nothing_it_did_not_hold() -> None:
    ledger = ledger_for(SimulatedBackend((16384,)))
    holder = await ledger.acquire(16000)
    waiter = asyncio.create_task(ledger.acquire(1000))
    await until_async(lambda: ledger.waiting == 1, 10, "the run in line")
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert ledger.waiting == 0 and ledger.snapshot()[0]["reserved_mb"] == 16000
    ledger.release(holder)
    assert ledger.snapshot()[0]["reserved_mb"] == 0


async def test_a_released_grant_is_held_until_a_later_reading_no_longer_lists_the_run() -> None:
    backend = SimulatedBackend((4096,))
    ledger = GpuLedger(backend.devices(), margin_mb=0, max_wait_ms=60000, reclaim_ms=600000)
    grant = await ledger.acquire(3000)
    backend.set_usage(pid=4242, index=0, used_mb=2900)
    early = time.monotonic()
    ledger.release(grant, ids={4242, 4243})
    waiter = asyncio.ensure_future(ledger.acquire(3000))
    await asyncio.sleep(0)
    ledger.load(backend.devices(), [], ours=(), taken_at=early)  # a reading from before the release
    ledger.load(backend.devices(), backend.processes(), ours=(), taken_at=time.monotonic())  # still listed
    await asyncio.sleep(0)
    assert not waiter.done() and ledger.snapshot()[0]["reclaiming"] == 1
    backend.set_usage(pid=4242, index=0, used_mb=0)
    ledger.load(backend.devices(), backend.processes(), ours=(), taken_at=time.monotonic())
    assert (await waiter).memory_mb == 3000 and ledger.snapshot()[0]["reclaiming"] == 0


async def test_a_reclaim_that_outlasts_its_bound_marks_the_device_and_the_memory_stays_foreign(
    clock: list[float],
) -> None:
    backend = SimulatedBackend((4096,))
    ledger = GpuLedger(backend.devices(), margin_mb=0, max_wait_ms=60000, reclaim_ms=1000)
    grant = await ledger.acquire(3000)
    backend.set_usage(pid=4242, index=0, used_mb=2900)
    ledger.release(grant, ids={4242})
    clock[0] += 1.001  # past the 1000 ms bound; the run still listed
    ledger.load(backend.devices(), backend.processes(), ours=(), taken_at=clock[0])
    book = ledger.snapshot()[0]
    assert (
        book["reclaiming"] == 0
        and book["reclaim_timeouts"] == 1
        and "SANDBOX_GPU_RECLAIM_MS" in str(book["note"])
    )
    assert book["foreign_mb"] == 2900, "what NVML still shows keeps the next run off that memory"
