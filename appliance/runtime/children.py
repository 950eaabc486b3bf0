"""How the server's event loop learns that a child process (a jail's firejail, a helper) ended.

Python 3.11's asyncio waits for each child in a thread of its own (ThreadedChildWatcher): a
thread started, blocked in waitpid, and ended for every subprocess, and a jail starts two (its
launcher and the caps' helper), so a one-shot run paid for two threads on the server's CPU.
A pidfd (Linux 5.3+) in the event loop says the same without a thread: it is readable once
the child has ended, and only then is it reaped (waitpid of that one pid, as before). Python
3.12 chooses the pidfd watcher by itself where the kernel has pidfds; there is nothing to do.
"""

from __future__ import annotations

import asyncio
import os
import sys


def pidfds_work() -> bool:
    """Whether this kernel (and its seccomp policy, in a container) gives pidfds."""
    try:
        fd = os.pidfd_open(os.getpid())
    except (AttributeError, OSError):
        return False
    os.close(fd)
    return True


def watch_children_by_pidfd() -> bool:
    """Make the running loop wait for its children by pidfd (Python < 3.12, where the default
    is a thread per child); whether it does. Call it from the loop's own thread, before any
    subprocess starts: children started under the previous watcher would be left unwaited."""
    if sys.version_info >= (3, 12):
        return True  # asyncio's own choice there (a pidfd where there is one)
    if not pidfds_work():
        return False  # the thread per child stays: slower, never wrong
    watcher = asyncio.PidfdChildWatcher()
    watcher.attach_loop(asyncio.get_running_loop())
    asyncio.set_child_watcher(watcher)  # closes the previous one (none started a child yet)
    return True
