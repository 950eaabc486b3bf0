"""Process trees from /proc: every thread's children; descendants leave out zombies."""

from __future__ import annotations

import subprocess
import sys
import time

from appliance.sandbox import proctree
from tests.support import scaled

# A child that forks a grandchild which exits at once and is never reaped (a zombie), and a
# second grandchild that keeps running.
PARENT = """
import os, subprocess, sys, time
if os.fork() == 0:
    os._exit(0)
sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(sleeper.pid, flush=True)
time.sleep(60)
"""


def test_descendants_leave_out_zombies_and_the_root_but_the_tree_has_both() -> None:
    proc = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        sleeper = int(proc.stdout.readline())
        deadline = time.monotonic() + scaled(10)
        while True:
            zombies = [p for p in proctree.tree(proc.pid) if proctree.state(p) == "Z"]
            if zombies or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        assert len(zombies) == 1, proctree.tree(proc.pid)
        assert proctree.descendants(proc.pid) == [sleeper]
        assert set(proctree.tree(proc.pid)) == {proc.pid, sleeper, zombies[0]}
    finally:
        proc.kill()
        proc.wait()


def test_a_gone_process_has_no_state_and_no_descendants() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert proctree.state(proc.pid) == ""
    assert proctree.descendants(proc.pid) == []
