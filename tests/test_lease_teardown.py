"""A one-shot run's jail is torn down after its `done` is written, off the run's path
(appliance.sandbox.lease.PoolLeases.teardown): not even the teardown's task is made before
the run's task yields; and no jail whose teardown was asked for is left when the leases close."""

from __future__ import annotations

import asyncio
from typing import cast

from appliance.core.tasks import TaskScope
from appliance.sandbox.jail import Jail
from appliance.sandbox.lease import PoolLeases
from appliance.sandbox.pool import ProfilePools


class Doomed:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    async def destroy(self) -> None:
        self.log.append(f"destroy {self.name}")


class Pools:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    async def close(self) -> None:
        self.log.append("pools closed")


def leases(log: list[str], owner: TaskScope) -> PoolLeases:
    return PoolLeases(cast(ProfilePools, Pools(log)), owner)


def jail(log: list[str], name: str) -> Jail:
    return cast(Jail, Doomed(log, name))


async def test_the_teardown_starts_only_once_the_runs_task_yields() -> None:
    log: list[str] = []
    async with TaskScope("test") as owner:
        source = leases(log, owner)

        async def run() -> None:
            source.teardown(jail(log, "a"))
            source.teardown(jail(log, "b"))
            log.append("done written")  # what the run does next, before it yields
            assert not owner.tasks, "no task is made on the run's path"

        await asyncio.create_task(run())
        await owner.wait(5.0, owner.tasks)
        while len(log) < 3:
            await asyncio.sleep(0)
        assert log == ["done written", "destroy a", "destroy b"]
        await source.close()
        assert log[-1] == "pools closed"


async def test_a_teardown_asked_for_as_the_leases_close_is_done_by_close() -> None:
    log: list[str] = []
    async with TaskScope("test") as owner:
        source = leases(log, owner)
        source.teardown(jail(log, "late"))
        await source.close()  # before the loop's next turn: nothing was spawned yet
        assert log == ["destroy late", "pools closed"]
        await asyncio.sleep(0)
        assert not owner.tasks and log.count("destroy late") == 1


async def test_a_teardown_whose_owner_is_closing_is_left_to_close() -> None:
    log: list[str] = []
    owner = TaskScope("test")
    await owner.open()
    source = leases(log, owner)
    source.teardown(jail(log, "j"))
    await owner.close()  # the owner closes before the loop turns: no task may be made then
    await asyncio.sleep(0)
    assert log == []
    await source.close()
    assert log == ["destroy j", "pools closed"]
