"""The server's loop waits for its child processes by pidfd, not a thread per child
(appliance.runtime.children): a jail starts two children, every run paid for two threads."""

from __future__ import annotations

import asyncio
import sys
import threading

import pytest

from appliance.runtime.children import pidfds_work, watch_children_by_pidfd

pytestmark = pytest.mark.skipif(not pidfds_work(), reason="this kernel gives no pidfds")


@pytest.fixture(autouse=True)
def _restore_watcher() -> object:
    """The child watcher is the process's policy: put back whatever the test found."""
    if sys.version_info >= (3, 12):
        yield None
        return
    old = asyncio.get_child_watcher()
    yield None
    asyncio.set_child_watcher(old)
    old.attach_loop(None)


async def test_a_child_is_waited_for_without_a_thread_of_its_own() -> None:
    assert watch_children_by_pidfd()
    before = {t.ident for t in threading.enumerate()}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "import sys; sys.stdin.read()", stdin=asyncio.subprocess.PIPE
    )
    try:
        # The child is running (it waits for its stdin): a thread that waits for it would be now.
        during = {t.name for t in threading.enumerate() if t.ident not in before}
        assert not [name for name in during if name.startswith("waitpid")], during
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
    assert await asyncio.wait_for(proc.wait(), 30) == 0


async def test_exit_codes_and_signals_reach_the_caller_as_before() -> None:
    assert watch_children_by_pidfd()
    failed = await asyncio.create_subprocess_exec(sys.executable, "-c", "raise SystemExit(3)")
    killed = await asyncio.create_subprocess_exec(sys.executable, "-c", "import time; time.sleep(60)")
    killed.kill()
    codes = await asyncio.wait_for(asyncio.gather(failed.wait(), killed.wait()), 30)
    assert list(codes) == [3, -9]
