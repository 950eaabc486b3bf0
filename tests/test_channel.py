"""The two ends of the server-driver channel agree: what one encodes the other decodes to the
same thing, however the pipe cuts it; and the host's end rejects what the jail's could not
have sent. Pure data: no driver, no jail, no server."""

from __future__ import annotations

import io
import json
from typing import Any, get_type_hints

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from appliance.inside import channel as jail_end
from appliance.sandbox import channel as host_end

# Text as Python code and output hold it: no lone surrogates (those have tests of their own).
TEXT = st.text(st.characters(exclude_categories=["Cs"]), max_size=200)
JSON_SCALAR = (
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | TEXT
)
JSON_VALUE = st.recursive(
    JSON_SCALAR,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=12,
)
COUNT = st.integers(min_value=0, max_value=10**12)

STREAM = st.fixed_dictionaries(
    {"ev": st.just("stream"), "name": st.sampled_from(["stdout", "stderr"]), "text": TEXT}
)
DONE = st.fixed_dictionaries(
    {
        "ev": st.just("done"),
        "exit_code": st.integers(min_value=-(2**31), max_value=2**31),
        "cpu_ms": st.none() | COUNT,
        # The driver reports a tenth of a megabyte at most finely.
        "max_rss_mb": st.none() | st.integers(min_value=0, max_value=10**8).map(lambda n: n / 10),
        "import_ms": st.none() | COUNT,
    }
)
DATA = st.fixed_dictionaries(
    {"ev": st.sampled_from(["result", "display"]), "data": st.dictionaries(TEXT, JSON_VALUE, max_size=4)}
)
ERROR = st.fixed_dictionaries(
    {
        "ev": st.just("error"),
        "ename": TEXT,
        "evalue": TEXT,
        "traceback": st.lists(TEXT, max_size=4),
        "memory": st.booleans(),
    }
)
READY = st.fixed_dictionaries(
    {
        "ev": st.just("ready"),
        "check": st.dictionaries(TEXT, JSON_VALUE, max_size=4),
        "preload_failed": st.dictionaries(TEXT, TEXT, max_size=4),
        "preload_ms": COUNT,
    }
)
CUDA = st.fixed_dictionaries({"ev": st.just("cuda_context"), "ok": st.booleans()}, optional={"error": TEXT})
EVENT = STREAM | DONE | DATA | ERROR | READY | CUDA

FILES = st.lists(st.tuples(TEXT, st.binary(max_size=300)), max_size=3)
RUN = st.tuples(st.just("run"), TEXT, FILES, st.booleans())
OP = (
    RUN
    | st.tuples(st.just("stdin"), TEXT)
    | st.tuples(st.just("stdin_eof"))
    | st.tuples(st.just("interrupt"))
    | st.tuples(st.just("cuda_context"), TEXT)
)
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
BOUND = 4096  # the decoder's bound in these tests: an event's text at most, its header besides


def encode_op(op: tuple[Any, ...]) -> bytes:
    kind = op[0]
    if kind == "run":
        return host_end.run_op(op[1], op[2], stdin_eof=op[3])
    if kind == "stdin":
        return host_end.stdin_op(op[1])
    if kind == "stdin_eof":
        return host_end.stdin_eof_op()
    if kind == "interrupt":
        return host_end.interrupt_op()
    return host_end.cuda_context_op(op[1])


def read_ops(wire: bytes) -> list[tuple[Any, ...]]:
    """The ops on the wire as the driver reads them: a line, and for a `run` the bytes it counts."""
    pipe = io.BytesIO(wire)

    def read_exactly(size: int) -> bytes:
        data = pipe.read(size)
        if len(data) != size:
            raise EOFError
        return data

    ops: list[tuple[Any, ...]] = []
    for line in iter(pipe.readline, b""):
        op = jail_end.parse_op(line)
        assert op is not None, line
        if op["op"] == "run":
            code, files = jail_end.read_run(op, read_exactly)
            ops.append(("run", code, files, op["stdin_eof"]))
        elif op["op"] in ("stdin", "cuda_context"):
            ops.append((op["op"], op["data"] if op["op"] == "stdin" else op["lib"]))
        else:
            ops.append((op["op"],))
    return ops


def decode_in_pieces(
    wire: bytes, cuts: list[int], bound: int = BOUND
) -> tuple[list[Any], host_end.EventDecoder]:
    """What the host's decoder makes of wire fed in the pieces cuts makes of it."""
    decoder = host_end.EventDecoder(bound)
    got: list[Any] = []
    start = 0
    for end in [*sorted(c % (len(wire) + 1) for c in cuts), len(wire)]:
        decoder.feed(wire[start:end])
        start = max(start, end)
        while (item := decoder.next()) is not None:
            got.append(item)
    return got, decoder


class TestOps:
    @FUZZ
    @given(st.lists(OP, max_size=6))
    def test_every_op_the_host_writes_the_driver_reads_back_the_same(
        self, ops: list[tuple[Any, ...]]
    ) -> None:
        wire = b"".join(encode_op(op) for op in ops)
        expected = [(op[0], op[1], list(op[2]), op[3]) if op[0] == "run" else op for op in ops]
        assert read_ops(wire) == expected

    def test_a_lone_surrogate_in_code_and_paths_arrives_intact(self) -> None:
        wire = host_end.run_op("s = '\ud800'", [("\udfff", b"x")], stdin_eof=False)
        assert read_ops(wire) == [("run", "s = '\ud800'", [("\udfff", b"x")], False)]

    def test_a_lone_surrogate_in_stdin_arrives_replaced(self) -> None:
        assert read_ops(host_end.stdin_op("a\ud800b")) == [("stdin", "a?b")]

    def test_a_run_cut_short_is_an_eof_for_the_driver(self) -> None:
        with pytest.raises(EOFError):
            read_ops(host_end.run_op("print(1)", [("f", b"data")], stdin_eof=True)[:-1])


class TestEvents:
    @FUZZ
    @given(st.lists(EVENT, max_size=6), st.lists(st.integers(min_value=0), max_size=8))
    def test_every_event_the_driver_writes_the_host_reads_back_the_same_however_cut(
        self, events: list[Any], cuts: list[int]
    ) -> None:
        wire = b"".join(jail_end.encode_event(e) for e in events)
        got, decoder = decode_in_pieces(wire, cuts, bound=len(wire) + 1)
        assert [r.event for r in got] == events
        assert sum(r.nbytes for r in got) == len(wire)
        assert decoder.rejected == 0 and decoder.pending() == 0

    @pytest.mark.parametrize("kind", ["stream", "done"])
    @FUZZ
    @given(data=st.data())
    def test_stream_and_done_as_json_lines_are_read_too(self, kind: str, data: st.DataObject) -> None:
        event = data.draw(STREAM if kind == "stream" else DONE)
        line = (json.dumps(event) + "\n").encode()
        assert host_end.parse_event(line) == event

    def test_a_lone_surrogate_in_output_arrives_replaced(self) -> None:
        wire = jail_end.encode_event({"ev": "stream", "name": "stdout", "text": "a\ud800b"})
        assert host_end.parse_event(wire) == {"ev": "stream", "name": "stdout", "text": "a?b"}


def valid(event: Any) -> bool:
    """The promise the host's decoder makes of every event it hands over."""
    kind = event["ev"]
    if kind == "stream":
        return event["name"] in ("stdout", "stderr") and isinstance(event["text"], str)
    if kind == "done":
        return (
            type(event["exit_code"]) is int
            and (event["cpu_ms"] is None or type(event["cpu_ms"]) is int)
            and (event["max_rss_mb"] is None or type(event["max_rss_mb"]) is float)
            and (event["import_ms"] is None or type(event["import_ms"]) is int)
        )
    if kind in ("result", "display"):
        return isinstance(event["data"], dict)
    if kind == "error":
        return (
            isinstance(event["ename"], str)
            and isinstance(event["evalue"], str)
            and all(isinstance(line, str) for line in event["traceback"])
            and isinstance(event["memory"], bool)
        )
    if kind == "ready":
        return (
            isinstance(event["check"], dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in event["preload_failed"].items())
            and type(event["preload_ms"]) is int
        )
    if kind == "cuda_context":
        return isinstance(event["ok"], bool) and isinstance(event.get("error", ""), str)
    return False


# Pieces a hostile jail might send: fragments of real events, headers, JSON of the wrong shape.
HOSTILE_PIECE = (
    st.binary(max_size=64)
    | st.sampled_from(
        [
            b"\n",
            b"stream stdout ",
            b"stream stderr 3\n",
            b"stream stdin 2\nab",
            b"done ",
            b"done 0 - - -\n",
            b"done 1 2 3.5 4",
            b'{"ev":"stream","name":"stdout","text":1}\n',
            b'{"ev":"done","exit_code":true}\n',
            b'{"ev":"result","data":[]}\n',
            b'{"ev":"ready","preload_failed":{"a":1},"preload_ms":"x"}\n',
            b'{"ev":"nope"}\n',
            b"[1,2]\n",
            b"9" * 40,
        ]
    )
    | EVENT.map(lambda event: jail_end.encode_event(event))  # type: ignore[arg-type]  # a dict drawn to the shape
)


class TestHostileInput:
    @FUZZ
    @given(st.lists(HOSTILE_PIECE, max_size=12), st.lists(st.integers(min_value=0), max_size=8))
    def test_whatever_the_jail_sends_the_host_hands_over_only_valid_events_and_holds_a_bounded_amount(
        self, pieces: list[bytes], cuts: list[int]
    ) -> None:
        got, decoder = decode_in_pieces(b"".join(pieces), cuts)
        for item in got:
            assert isinstance(item, (host_end.Received, host_end.Oversized))
            if isinstance(item, host_end.Received):
                assert valid(item.event), item
        assert decoder.pending() <= BOUND + host_end.HEADER_BYTES

    @pytest.mark.parametrize(
        "wire",
        [
            b'{"ev":"stream","name":"stdin","text":"x"}\n',
            b'{"ev":"stream","name":"stdout","text":1}\n',
            b'{"ev":"done","exit_code":true}\n',
            b'{"ev":"done","exit_code":"0"}\n',
            b'{"ev":"result","data":[]}\n',
            b'{"ev":"display"}\n',
            b'{"ev":"nope"}\n',
            b'{"ev":1}\n',
            b"[1,2]\n",
            b'"stream"\n',
            b"not json\n",
            b"stream stdout 2\n\xff\xfe",
            b"done x 1 1.0 1\n",
        ],
    )
    def test_a_malformed_event_is_rejected_and_the_next_one_still_read(self, wire: bytes) -> None:
        after = jail_end.encode_event({"ev": "stream", "name": "stdout", "text": "ok"})
        got, decoder = decode_in_pieces(wire + after, [])
        assert [r.event for r in got] == [{"ev": "stream", "name": "stdout", "text": "ok"}]
        assert decoder.rejected == 1

    @pytest.mark.parametrize("piece", [1000, 10**6])
    def test_an_event_longer_than_the_bound_is_cut_off_in_small_reads_or_one_large(self, piece: int) -> None:
        text = "x" * (BOUND + host_end.HEADER_BYTES)
        wire = jail_end.encode_event({"ev": "stream", "name": "stdout", "text": text})
        got, decoder = decode_in_pieces(wire, list(range(0, len(wire), piece)))
        assert got[0] == host_end.Oversized(BOUND)
        assert not any(
            isinstance(item, host_end.Received)
            and item.event["ev"] == "stream"
            and item.event["text"] == text
            for item in got
        )
        assert decoder.pending() <= BOUND + host_end.HEADER_BYTES

    def test_a_line_that_never_ends_is_cut_off(self) -> None:
        got, decoder = decode_in_pieces(b"{" * (BOUND + host_end.HEADER_BYTES + 1), [])
        assert got == [host_end.Oversized(BOUND)]
        assert decoder.pending() == 0

    @FUZZ
    @given(EVENT)
    def test_an_event_cut_short_is_held_not_handed_over(self, event: Any) -> None:
        wire = jail_end.encode_event(event)
        got, decoder = decode_in_pieces(wire[:-1], [])
        assert got == []
        assert decoder.pending() == len(wire) - 1


class TestSharedFacts:
    def test_both_ends_name_the_same_grant_file(self) -> None:
        assert jail_end.GRANT_FILE == host_end.GRANT_FILE

    def test_both_ends_name_the_same_snapshot_archive_and_report(self) -> None:
        assert jail_end.SNAPSHOT_ARCHIVE == host_end.SNAPSHOT_ARCHIVE
        assert jail_end.SNAPSHOT_MIME == host_end.SNAPSHOT_MIME
        for op in (host_end.snapshot_op(), host_end.restore_op()):
            assert jail_end.parse_op(op) == json.loads(op)

    def test_both_ends_mark_the_counted_messages_alike(self) -> None:
        assert (jail_end.RUN, jail_end.STREAM, jail_end.DONE) == (
            host_end.RUN,
            host_end.STREAM,
            host_end.DONE,
        )

    @pytest.mark.parametrize(
        "name", ["ReadyEvent", "StreamEvent", "DataEvent", "ErrorEvent", "DoneEvent", "CudaContextEvent"]
    )
    def test_both_ends_declare_the_same_fields_of_each_event(self, name: str) -> None:
        jail_type, host_type = getattr(jail_end, name), getattr(host_end, name)
        assert get_type_hints(jail_type) == get_type_hints(host_type)
        assert jail_type.__required_keys__ == host_type.__required_keys__
