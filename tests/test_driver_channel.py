"""The in-jail driver's control channel, driven directly (no server, no jail): what the main
thread reads with the first cell reaches the cell, and the reader thread is woken only when
the channel has something for it."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from appliance.inside import channel as jail_end
from appliance.sandbox import channel
from appliance.sandbox.workdir import stage_runtime
from tests.support import scaled

# Needs root, firejail or a real server: never in the fast tier (tests/tiers.py).
pytestmark = pytest.mark.host


class DriverUnderTest:
    def __init__(self, proc: subprocess.Popen[bytes], control: int, events: int) -> None:
        self.proc = proc  # unshare, whose one child is the driver
        self.control = control
        self.events = events
        self._buf = b""
        self.pid = 0  # the driver's, once it is ready

    def find(self) -> None:
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        assert len(children) == 1, children
        self.pid = int(children[0])

    def send(self, data: bytes) -> None:
        """One write: what fits in a pipe's atomic write arrives in one read of the driver's."""
        assert len(data) <= select.PIPE_BUF
        assert os.write(self.control, data) == len(data)

    def event(self, timeout: float = 10.0) -> dict[str, Any]:
        deadline = time.monotonic() + scaled(timeout)
        while (size := channel.take_event(self._buf)) is None:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.events], [], [], max(0.0, left))
            if not ready:
                raise TimeoutError(f"no event from the driver within {timeout} s")
            chunk = os.read(self.events, 65536)
            if not chunk:
                raise EOFError("the driver closed its event pipe")
            self._buf += chunk
        line, self._buf = self._buf[:size], self._buf[size:]
        event = channel.parse_event(line)
        assert event is not None, line
        return dict(event)

    def until(self, kind: str) -> list[dict[str, Any]]:
        seen = []
        while (event := self.event())["ev"] != kind:
            seen.append(event)
        return [*seen, event]

    def reader_tid(self) -> int:
        tids = [int(t) for t in os.listdir(f"/proc/{self.pid}/task") if int(t) != self.pid]
        assert len(tids) == 1, tids
        return tids[0]

    def wakeups(self, tid: int) -> int:
        """Times the thread went to sleep and was woken again."""
        for line in Path(f"/proc/{self.pid}/task/{tid}/status").read_text().splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                return int(line.split()[1])
        raise AssertionError("no voluntary_ctxt_switches")

    def settled(self, tid: int) -> None:
        """Wait until the thread sleeps (S) and its wake-up count holds still."""
        deadline = time.monotonic() + scaled(5)
        last = -1
        while time.monotonic() < deadline:
            state = Path(f"/proc/{self.pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            now = self.wakeups(tid)
            if state == "S" and now == last:
                return
            last = now
            time.sleep(0.05)
        raise AssertionError("the reader thread did not settle")


@pytest.fixture
def driver(tmp_path: Path) -> Iterator[DriverUnderTest]:
    runtime = stage_runtime(tmp_path, Path(sys.executable))
    events_r, events_w = os.pipe()
    control_r, control_w = os.pipe()
    home = tmp_path / "home"
    home.mkdir()
    # In a PID namespace of its own: the driver ends each cell by killing every other process
    # it can see (kill(-1)), which in a jail is the cell's leftovers and here would be the host's.
    unshare = ["unshare", "--pid", "--fork", "--kill-child", "--"]
    proc = subprocess.Popen(
        [
            *unshare,
            sys.executable,
            "-I",
            "-u",
            str(runtime / "appliance" / "inside" / "driver.py"),
            str(events_w),
        ],
        stdin=control_r,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        pass_fds=(events_w,),
        cwd=home,
        env={"HOME": str(home), "PATH": "/usr/bin:/bin", "APPLIANCE_PRELOAD": ""},
    )
    os.close(control_r)
    os.close(events_w)
    under = DriverUnderTest(proc, control_w, events_r)
    try:
        assert under.until("ready")[-1]["ev"] == "ready"
        under.find()
        yield under
    finally:
        proc.kill()
        proc.wait()
        os.close(under.control)
        os.close(events_r)


def stdout_of(events: list[dict[str, Any]]) -> str:
    return "".join(e["text"] for e in events if e["ev"] == "stream" and e["name"] == "stdout")


def test_lines_read_along_with_the_first_cell_reach_it(driver: DriverUnderTest) -> None:
    # The run op and the cell's stdin in one write: the main thread reads them together, so
    # the reader thread must be told (no more bytes will come to wake it through the pipe).
    driver.send(
        channel.run_op("print(input().upper())", [], stdin_eof=False)
        + channel.stdin_op("hello\n")
        + channel.stdin_eof_op()
    )
    events = driver.until("done")
    assert stdout_of(events) == "HELLO\n"
    assert events[-1]["exit_code"] == 0


def test_the_reader_thread_sleeps_through_a_cell_nothing_follows(driver: DriverUnderTest) -> None:
    reader = driver.reader_tid()
    driver.settled(reader)
    before = driver.wakeups(reader)
    driver.send(channel.run_op("print(2 + 2)", [], stdin_eof=True))
    events = driver.until("done")
    assert stdout_of(events) == "4\n"
    assert driver.wakeups(reader) == before, "the first cell woke the reader thread"
    # A second cell (a session's) comes through the reader, which the line wakes.
    driver.send(channel.run_op("print(input())", [], stdin_eof=False))
    driver.send(channel.stdin_op("later\n"))
    assert stdout_of(driver.until("done")) == "later\n"
    # The reader may still be on its way back to sleep after the stdin line: its count grows
    # as it sleeps again, so wait for that rather than race it.
    driver.settled(reader)
    assert driver.wakeups(reader) > before
    # The server gone (its end of the channel closed): the driver ends.
    os.close(driver.control)
    driver.control = os.open(os.devnull, os.O_RDONLY)  # what the fixture closes
    assert driver.proc.wait(scaled(10)) == 0


def test_code_and_files_arrive_byte_for_byte_after_a_run_header(driver: DriverUnderTest) -> None:
    # Counted bytes, not JSON: a newline, quotes, a backslash and non-ASCII in the code, a
    # path with a space and a multi-byte name, contents with every byte value and a newline
    # where a line reader would stop. The second cell (through the reader thread) reads them.
    data = bytes(range(256)) + b"\nrun 1 2\n"
    code = (
        'import hashlib\ns = "tab\\t\\"q\\" \\\\ é ✓"\n'
        "print(s, len(s))\n"
        "print(hashlib.sha256(open('in dir/ünï.bin', 'rb').read()).hexdigest())"
    )
    op = channel.run_op(code, [("in dir/ünï.bin", data)], stdin_eof=True)
    assert op.startswith(b"run 1 ") and op.count(b"\n", 0, op.index(b"import")) == 1
    driver.send(op)
    events = driver.until("done")
    expected = f'tab\t"q" \\ é ✓ 13\n{__import__("hashlib").sha256(data).hexdigest()}\n'
    assert stdout_of(events) == expected
    assert events[-1]["exit_code"] == 0
    driver.send(channel.run_op("print(open('in dir/ünï.bin', 'rb').read() == " + repr(data) + ")", [], True))
    assert stdout_of(driver.until("done")) == "True\n"


@pytest.mark.parametrize(
    "line",
    [
        b"run 1\n",  # no code count
        b"run 2 4\n",  # stdin_eof is 0 or 1
        b"run 1 4 5\n",  # a file's path count without its size
        b"run 1 -4\n",  # no sign
        b"run 1 4.0\n",
        b"run 1 \xd9\xa4\n",  # a digit, but not an ASCII one
        b"running 1 4\n",
    ],
)
def test_a_malformed_run_header_is_no_op(line: bytes) -> None:
    assert jail_end.parse_op(line) is None


def test_a_run_header_counts_what_follows() -> None:
    op = channel.run_op("é", [("a", b"xyz"), ("", b"")], stdin_eof=False)
    header, _, body = op.partition(b"\n")
    parsed = jail_end.parse_op(header + b"\n")
    assert parsed == {
        "op": "run",
        "code_bytes": 2,
        "stdin_eof": False,
        "files": [{"path_bytes": 1, "size": 3}, {"path_bytes": 0, "size": 0}],
    }
    assert body == "é".encode() + b"a" + b"xyz"


@pytest.mark.parametrize(
    "event",
    [
        {"ev": "stream", "name": "stdout", "text": "4\n"},
        {"ev": "stream", "name": "stderr", "text": 'é ✓ "q" \\ \n\nstream stdout 9\n'},
        {"ev": "stream", "name": "stdout", "text": ""},
        {"ev": "done", "exit_code": 0, "cpu_ms": 12, "max_rss_mb": 15.5, "import_ms": 3},
        {"ev": "done", "exit_code": 255, "cpu_ms": None, "max_rss_mb": None, "import_ms": None},
        {"ev": "result", "data": {"text/plain": "4"}},
    ],
)
def test_an_event_arrives_whole_however_the_pipe_cuts_it(event: jail_end.Event) -> None:
    first = len(jail_end.encode_event(event))
    wire = jail_end.encode_event(event) + jail_end.encode_event(
        {"ev": "stream", "name": "stdout", "text": "x"}
    )
    for cut in range(first):  # a read that ends anywhere before the event's last byte
        assert channel.take_event(wire[:cut]) is None, cut
    assert channel.take_event(wire) == first
    assert channel.parse_event(wire[:first]) == event


def test_a_lone_surrogate_in_text_arrives_replaced_as_before() -> None:
    wire = jail_end.encode_event({"ev": "stream", "name": "stdout", "text": "a\ud800b"})
    assert channel.parse_event(wire) == {"ev": "stream", "name": "stdout", "text": "a?b"}


@pytest.mark.parametrize(
    "wire",
    [
        b"stream stdout 4\nab\n",  # a count that is not the text's (the text was cut short)
        b"stream stdin 2\nab",
        b"stream stdout -2\n",
        b"stream stdout 2 3\nab",
        b"stream stdout 2\n\xff\xfe",  # not UTF-8
        b"stream stdout " + b"9" * 5000 + b"\n",  # int() of this would raise
        b"done\n",
        b"done x 1 1.0 1\n",
        b"done 0 1 1.0\n",
        b"done " + b"1" * 5000 + b" - - -\n",
        b"done 0 1 1.0 1",  # no newline
    ],
)
def test_a_malformed_event_is_none_and_raises_nothing(wire: bytes) -> None:
    size = channel.take_event(wire)
    assert channel.parse_event(wire if size is None else wire[:size]) is None


def test_done_fields_that_are_not_numbers_are_none() -> None:
    assert channel.parse_event(b"done 3 nan inf 1e9\n") == {
        "ev": "done",
        "exit_code": 3,
        "cpu_ms": None,
        "max_rss_mb": None,
        "import_ms": None,
    }


def test_a_stream_header_that_promises_more_than_comes_is_held_not_parsed() -> None:
    # The reader keeps waiting for the text; it is JailProcess's bound on what it buffers
    # (its max_event_bytes and a header) that ends such a run with an output limit.
    assert channel.take_event(b"stream stdout 999999999\nabc") is None
    assert channel.take_event(b"stream stdout 5\nabcde") == len(b"stream stdout 5\nabcde")
