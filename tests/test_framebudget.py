"""The frame meter (appliance/api/framebudget.py): frames judged at their headers, in step with the
reader whatever the chunking, and every reserved byte given back."""

from __future__ import annotations

import os
import random
import struct

import pytest

from appliance.api.framebudget import Closing, Fed, FrameBudget, FrameMeter, Refusal
from appliance.api.wsmeter import MeteredReader
from appliance.settings import from_env

LIMIT = 1000


def frame(opcode: int, payload: bytes, fin: bool = True, announced: int | None = None) -> bytes:
    """A masked client frame; `announced` overrides the length in the header."""
    size = len(payload) if announced is None else announced
    first = (0x80 if fin else 0) | opcode
    if size < 126:
        header = struct.pack("!BB", first, 0x80 | size)
    elif size < 65536:
        header = struct.pack("!BBH", first, 0x80 | 126, size)
    else:
        header = struct.pack("!BBQ", first, 0x80 | 127, size)
    mask = os.urandom(4)
    return header + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def meter(total: int = 10 * LIMIT, tenant: int = 10 * LIMIT, owner: str = "alice") -> FrameMeter:
    return FrameMeter(FrameBudget(total, tenant), owner, LIMIT, lambda: 0.0)


def feed_in_chunks(m: FrameMeter, data: bytes, size: int) -> Fed:
    out = Fed()
    for at in range(0, len(data), size):
        fed = m.feed(data[at : at + size])
        out.pieces.extend(fed.pieces)
        out.refusals.extend(fed.refusals)
        if fed.closing is not None:
            out.closing = fed.closing
            break
    return out


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 14, 100, 4096])
def test_kept_frames_reach_the_reader_byte_for_byte_whatever_the_chunking(chunk: int) -> None:
    stream = (
        frame(1, b"a" * 10)
        + frame(9, b"ping")
        + frame(2, b"b" * 300)
        + frame(1, b"")
        + frame(1, b"c" * LIMIT)
    )
    m = meter()
    fed = feed_in_chunks(m, stream, chunk)
    assert b"".join(fed.pieces) == stream and not fed.refusals and fed.closing is None
    assert list(m.taken) == [10, 300, 0, LIMIT] and not m.unfinished
    for _ in range(4):
        m.handled()
    assert m.budget.held == 0 and m.budget.by_owner == {}


@pytest.mark.parametrize("chunk", [1, 5, 64, 100000])
def test_a_frame_over_the_limit_is_skipped_unseen_and_refused_and_the_next_one_passes(chunk: int) -> None:
    before, big, after = frame(1, b"before"), frame(1, b"x" * (LIMIT + 1)), frame(1, b"after")
    m = meter()
    fed = feed_in_chunks(m, before + big + after, chunk)
    assert b"".join(fed.pieces) == before + after
    assert fed.refusals == [
        Refusal("rejected", f"frame of {LIMIT + 1} bytes exceeds SANDBOX_MAX_MESSAGE_BYTES ({LIMIT})")
    ]
    assert list(m.taken) == [6, 5] and m.budget.held == 11


def test_far_over_the_limit_or_fragmented_over_it_closes_at_the_header() -> None:
    m = meter()
    fed = m.feed(frame(1, b"", announced=2 * LIMIT + 1)[:14])
    assert fed.closing == Closing(1009, "message over SANDBOX_MAX_MESSAGE_BYTES") and not fed.pieces
    m = meter()
    fed = m.feed(frame(1, b"x" * 600, fin=False) + frame(0, b"", fin=True, announced=500)[:8])
    assert fed.closing is not None and fed.closing.code == 1009
    assert m.closed and m.budget.held == 0  # closing gave back the first fragment


def test_fragments_are_reserved_as_they_come_and_released_with_the_message() -> None:
    m = meter()
    fed = m.feed(frame(1, b"a" * 400, fin=False) + frame(9, b"") + frame(0, b"b" * 400, fin=False))
    assert fed.closing is None and m.unfinished and m.budget.held == 800
    m.feed(frame(0, b"c" * 100, fin=True))
    assert not m.unfinished and list(m.taken) == [900]
    m.handled()
    assert m.budget.held == 0


def test_an_unfinished_frame_holds_its_announced_size_until_the_connection_goes() -> None:
    budget = FrameBudget(10 * LIMIT, 10 * LIMIT)
    m = FrameMeter(budget, "alice", LIMIT, lambda: 5.0)
    m.feed(frame(1, b"x" * 900)[:-100])
    assert m.unfinished and m.started == 5.0 and budget.held == 900
    assert m.close() == 900 and budget.held == 0 and budget.by_owner == {}


def test_the_server_and_tenant_budgets_refuse_with_busy_and_a_fragment_over_them_closes() -> None:
    budget = FrameBudget(3 * LIMIT, 2 * LIMIT)
    alice = [FrameMeter(budget, "alice", LIMIT, lambda: 0.0) for _ in range(3)]
    bob = [FrameMeter(budget, "bob", LIMIT, lambda: 0.0) for _ in range(2)]
    unfinished = frame(1, b"x" * LIMIT)[:-1]
    assert [m.feed(unfinished).refusals for m in alice[:2]] == [[], []]
    fed = alice[2].feed(frame(1, b"x" * LIMIT))
    assert fed.refusals[0].status == "busy" and "SANDBOX_TENANT_FRAME_BUFFER_BYTES" in fed.refusals[0].message
    assert not fed.pieces  # skipped: the reader saw none of it
    assert bob[0].feed(unfinished).refusals == []
    fed = bob[1].feed(frame(1, b"x" * LIMIT))
    assert fed.refusals[0].status == "busy" and "SANDBOX_FRAME_BUFFER_BYTES" in fed.refusals[0].message
    alice[0].close()
    assert alice[2].feed(frame(1, b"x" * LIMIT)).refusals == []  # room again once one went
    fed = meter(total=LIMIT).feed(
        frame(1, b"x" * 10, fin=False) + frame(0, b"x" * LIMIT, announced=LIMIT)[:14]
    )
    assert fed.closing is not None and fed.closing.code == 1009


def test_a_connection_holds_at_most_two_messages() -> None:
    m = meter()
    m.feed(frame(1, b"x" * LIMIT) + frame(1, b"y" * LIMIT))
    fed = m.feed(frame(1, b"z"))
    assert fed.refusals[0].status == "busy" and "has not taken" in fed.refusals[0].message
    m.handled()
    assert m.feed(frame(1, b"z")).refusals == []


def test_protocol_errors_pass_to_the_reader_unjudged() -> None:
    stray = frame(0, b"x" * 5) + frame(3, b"?")  # a continuation of nothing, a reserved opcode
    m = meter()
    fed = m.feed(stray)
    assert b"".join(fed.pieces) == stray and m.budget.held == 0


def test_the_default_budgets_follow_the_message_limit_and_tenants() -> None:
    single = from_env({"SANDBOX_MAX_MESSAGE_BYTES": "1048576"})
    assert single.frame_budget() == (4 << 20, 4 << 20)
    assert from_env(
        {"SANDBOX_FRAME_BUFFER_BYTES": "100", "SANDBOX_TENANT_FRAME_BUFFER_BYTES": "500"}
    ).frame_budget() == (
        100,
        100,
    )
    assert from_env({}).frame_deadline_ms == 30000


def unmasked(opcode: int, payload: bytes) -> bytes:
    """A frame as no client may send it (no mask): the reader refuses it, the meter passes it."""
    return bytes((0x80 | opcode, len(payload))) + payload


@pytest.mark.parametrize("seed", range(40))
def test_a_whole_frame_in_one_read_gets_the_same_answer_as_from_the_general_path(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`FrameMeter._whole` (one whole frame in one read) against the general path alone, over
    random streams: frames of every kind and size around the limit, read whole, in pieces, and
    several in one read, with budgets that refuse some."""
    rng = random.Random(seed)  # noqa: S311 (reproducible streams, not secrets)
    makers = [
        lambda: frame(1, rng.randbytes(rng.choice([0, 5, 125, 126, 127, 300, LIMIT, LIMIT + 1]))),
        lambda: frame(2, rng.randbytes(rng.randrange(200))),
        lambda: frame(1, b"x" * 20, fin=False) + frame(0, b"y" * 20),
        lambda: frame(9, b"ping"),
        lambda: frame(1, b"", announced=3 * LIMIT),
        lambda: unmasked(1, b"bare"),
        lambda: frame(1, b"z" * 70000),
    ]
    reads: list[bytes] = []
    for _ in range(30):
        data = rng.choice(makers)()
        how = rng.randrange(3)
        if how == 0:
            reads.append(data)
        elif how == 1:
            cut = rng.randrange(len(data) + 1)
            reads += [data[:cut], data[cut:]]
        else:
            reads[-1:] = [(reads[-1] if reads else b"") + data]
    budget_total = rng.choice([10 * LIMIT, LIMIT + 50, 400])
    both = [meter(total=budget_total), meter(total=budget_total)]
    general = both[1]
    monkeypatch.setattr(general, "_whole", lambda data: None)
    for data in reads:
        if not data:
            continue
        a, b = (m.feed(data) for m in both)
        assert (a.pieces, a.refusals, a.closing) == (b.pieces, b.refusals, b.closing)
        if rng.random() < 0.5:
            for m in both:
                m.handled()
        states = [(list(m.taken), m.held, m.unfinished, m.closed, m.budget.held) for m in both]
        assert states[0] == states[1]


class Inner:
    """What aiohttp's WebSocket reader would be given, in order."""

    def __init__(self) -> None:
        self.got: list[bytes] = []

    def feed_data(self, data: bytes) -> tuple[bool, bytes]:
        self.got.append(data)
        return False, b""

    def feed_eof(self) -> None:
        self.got.append(b"<eof>")


class Told:
    def __init__(self) -> None:
        self.said: list[object] = []

    def refused(self, refusal: Refusal) -> None:
        self.said.append(refusal)

    def closed(self, closing: Closing) -> None:
        self.said.append(closing)

    def gone(self, freed: int) -> None:
        self.said.append(("gone", freed))


class Wire:
    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.shut = False

    def write(self, data: bytes) -> None:
        self.sent.append(data)

    def close(self) -> None:
        self.shut = True


def reads_of(rng: random.Random) -> list[bytes]:
    """Random client bytes as reads: whole frames, fragments, control frames, over-limit
    headers, some cut in two."""
    makers = [
        lambda: frame(1, rng.randbytes(rng.choice([0, 5, 125, 126, 300, LIMIT, LIMIT + 1]))),
        lambda: frame(1, rng.randbytes(rng.randrange(60))),  # a run's frame
        lambda: frame(2, rng.randbytes(rng.randrange(60))),
        lambda: frame(1, b"x" * 20, fin=False) + frame(0, b"y" * 20),
        lambda: frame(9, b"ping"),
    ]
    reads: list[bytes] = []
    for _ in range(30):
        data = rng.choice(makers)()
        cut = rng.randrange(len(data) + 1) if rng.randrange(2) else len(data)
        reads += [part for part in (data[:cut], data[cut:]) if part]
    if rng.randrange(2):  # and a header far over the limit: the meter closes the connection
        reads.insert(rng.randrange(len(reads) // 2, len(reads)), frame(1, b"", announced=3 * LIMIT))
    return reads


@pytest.mark.parametrize("seed", range(20))
async def test_the_reader_hands_on_a_whole_frame_as_the_metered_path_would(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`MeteredReader.feed_data`'s shortcut for one whole frame (straight to the reader)
    against the path through `FrameMeter.feed`, over random reads: the reader gets the same
    bytes, the same refusals and closes are told, the meters end in the same state."""
    rng = random.Random(seed)  # noqa: S311 (reproducible streams, not secrets)
    reads = reads_of(rng)
    total = rng.choice([10 * LIMIT, LIMIT + 50, 400])
    shortcuts: list[bool] = []
    short, metered = meter(total=total), meter(total=total)
    take = short.take_whole

    def counted(data: bytes) -> bool:
        taken = take(data)
        shortcuts.append(taken)
        return taken

    monkeypatch.setattr(short, "take_whole", counted)
    monkeypatch.setattr(metered, "take_whole", lambda data: False)
    sides = [(m, Inner(), Told(), Wire()) for m in (short, metered)]
    readers = [MeteredReader(inner, m, wire, 30.0, told) for m, inner, told, wire in sides]  # type: ignore[arg-type]
    for data in reads:
        answers = [reader.feed_data(data) for reader in readers]
        assert answers[0] == answers[1]
        if rng.random() < 0.7:  # the handler takes what it was given, now or later
            while short.taken or metered.taken:
                short.handled()
                metered.handled()
        (m1, i1, t1, w1), (m2, i2, t2, w2) = sides
        assert b"".join(i1.got) == b"".join(i2.got) and t1.said == t2.said and w1.sent == w2.sent
        assert (list(m1.taken), m1.held, m1.unfinished, m1.closed) == (
            list(m2.taken),
            m2.held,
            m2.unfinished,
            m2.closed,
        )
    for reader in readers:
        reader.release()
    assert any(shortcuts), "the shortcut was taken (else both sides took the same path)"


def test_the_whole_frame_path_takes_a_runs_frame() -> None:
    # Else the test above compares the general path with itself.
    m = meter()
    payload = b'{"type": "execute", "code": "print(2+2)"}'
    assert m._whole(frame(1, payload)) is not None and list(m.taken) == [len(payload)]
    assert m._whole(frame(1, b"x", fin=False)) is None and m._whole(frame(9, b"p")) is None
    assert m.take_whole(frame(1, payload)) and list(m.taken) == [len(payload)] * 2
