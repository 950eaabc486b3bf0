"""What the server holds for WebSocket messages clients have not finished, or it has not yet
taken: counted from each frame's header, bounded per connection, per tenant and server-wide. Pure.

A client may announce a frame of up to 2**63 bytes, send all but its last byte and stall: a
reader that buffers frames holds whatever was sent. So each frame is judged at its header,
before any of its payload is kept (`FrameMeter`, one per connection, reading the same bytes
aiohttp's reader does, in step with it):

- a message announced over SANDBOX_MAX_MESSAGE_BYTES is not kept: a single frame is skipped
  as its bytes arrive and answered `rejected` at once (the connection stays usable); a fragmented
  one, or one over twice the limit, closes the connection (1009);
- a kept frame reserves its announced length in the `FrameBudget` (the server's and its
  tenant's) until the handler has taken the whole message; a frame the budget cannot hold
  is skipped and answered `busy` (a fragment of one closes the connection, 1013);
- a connection holds at most twice SANDBOX_MAX_MESSAGE_BYTES: one message being received and
  one the server has not taken yet;
- a message must be finished within SANDBOX_FRAME_DEADLINE_MS of its first header (the
  clock does not run against a client while the server has not taken its previous message).

Control frames (ping, pong, close: at most 125 bytes) pass uncounted. Protocol errors pass
through unjudged: aiohttp's reader refuses them and closes the connection.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

OP_CONTINUATION, OP_TEXT, OP_BINARY = 0x0, 0x1, 0x2
CLOSE_TOO_BIG, CLOSE_POLICY, CLOSE_TRY_LATER = 1009, 1008, 1013


@dataclass(frozen=True)
class Refusal:
    """A frame skipped whole: the client gets a `done` with this status and message."""

    status: str  # "rejected" or "busy"
    message: str


@dataclass(frozen=True)
class Closing:
    """The connection must close with this WebSocket code and reason."""

    code: int
    reason: str


@dataclass
class Fed:
    """What to do with one chunk of bytes: hand `pieces` to the WebSocket reader in order,
    answer `refusals`, then close if `closing` is set (nothing after it is handed on)."""

    pieces: list[bytes] = field(default_factory=list)
    refusals: list[Refusal] = field(default_factory=list)
    closing: Closing | None = None


def too_big(size: int, limit: int) -> str:
    # The words protocol.check_size uses for a frame over the limit.
    return f"frame of {size} bytes exceeds SANDBOX_MAX_MESSAGE_BYTES ({limit})"


class FrameBudget:
    """Bytes reserved by kept frames, server-wide and per tenant (owner), against two limits."""

    def __init__(self, total_bytes: int, tenant_bytes: int) -> None:
        self.total_bytes = total_bytes
        self.tenant_bytes = tenant_bytes
        self.held = 0
        self.by_owner: dict[str, int] = {}

    def reserve(self, owner: str, size: int) -> str | None:
        """Reserve size bytes for owner; None if done, else why not (nothing reserved)."""
        mine = self.by_owner.get(owner, 0)
        if self.held + size > self.total_bytes:
            return (
                f"the server holds {self.held} bytes of unfinished messages; a frame of {size} more "
                f"would pass SANDBOX_FRAME_BUFFER_BYTES ({self.total_bytes}): try again later"
            )
        if mine + size > self.tenant_bytes:
            return (
                f"this tenant holds {mine} bytes of unfinished messages; a frame of {size} more "
                f"would pass SANDBOX_TENANT_FRAME_BUFFER_BYTES ({self.tenant_bytes}): try again later"
            )
        self.held += size
        self.by_owner[owner] = mine + size
        return None

    def release(self, owner: str, size: int) -> None:
        if size <= 0:
            return
        left = self.by_owner.get(owner, 0) - size
        if left < 0 or size > self.held:
            raise RuntimeError(f"released {size} bytes that were not reserved")
        if left:
            self.by_owner[owner] = left
        else:
            self.by_owner.pop(owner, None)
        self.held -= size


class FrameMeter:
    """One connection's client-to-server byte stream after the upgrade, frame by frame.

    `feed` returns which bytes go on to the WebSocket reader (the headers and payloads of
    frames that are kept, a partial header held back until it is whole, so a skipped frame
    is never seen by the reader at all) and what the frames it judged call for."""

    def __init__(
        self, budget: FrameBudget, owner: str, max_message_bytes: int, now: Callable[[], float]
    ) -> None:
        self.budget = budget
        self.owner = owner
        self.limit = max_message_bytes
        self._now = now
        self._header = b""  # a header not yet whole (at most 14 bytes)
        self._remaining = 0  # payload bytes of the current frame still to come
        self._in_payload = False
        self._skipping = False  # the current frame's payload is dropped, not handed on
        self._skip_fin = False
        self._data_frame = False
        self._fin = False
        self._message = 0  # bytes reserved for the message being received
        self._in_message = False  # a fragmented message started and not finished
        self.taken: deque[int] = deque()  # sizes of finished messages the handler has not taken
        self.started: float | None = None  # when the unfinished message (or skipped frame) began
        self.closed = False
        self._refusal: Refusal | None = None

    @property
    def held(self) -> int:
        """Bytes this connection holds reserved."""
        return self._message + sum(self.taken)

    def feed(self, data: bytes) -> Fed:  # noqa: C901, PLR0912 (one incremental parser of RFC 6455 frame headers; its states share the buffer)
        whole = self._whole(data)
        if whole is not None:
            return whole
        fed = Fed()
        if self.closed:
            return fed
        pos, run, end = 0, 0, len(data)  # data[run:pos] is the run of bytes to hand on
        while pos < end:
            if not self._in_payload:
                need = _header_size(self._header + data[pos : pos + 14 - len(self._header)])
                have = len(self._header) + end - pos
                if need is None or have < need:  # hold the partial header back
                    if run < pos:
                        fed.pieces.append(data[run:pos])
                    self._header += data[pos:]
                    return fed
                used = need - len(self._header)
                header = self._header + data[pos : pos + used]
                held_back, self._header = len(header) - used, b""
                verdict = self._judge(header)
                if isinstance(verdict, Closing):  # nothing more of this connection is read
                    self.close()
                    return Fed(closing=verdict)
                if self._skipping:  # answered now: the client need not send the rest
                    if self._refusal is not None:
                        fed.refusals.append(self._refusal)
                        self._refusal = None
                    if run < pos:
                        fed.pieces.append(data[run:pos])
                    pos += used
                    run = pos
                else:
                    if held_back:  # the header's first bytes came in an earlier chunk
                        if run < pos:
                            fed.pieces.append(data[run:pos])
                        fed.pieces.append(header[:held_back])
                        run = pos
                    pos += used
                self._in_payload = True
            take = min(self._remaining, end - pos)
            pos += take
            self._remaining -= take
            if self._skipping:
                run = pos
            if self._remaining == 0:
                self._frame_done(fed)
        if run < end:
            fed.pieces.append(data[run:] if run else data)
        return fed

    def _whole(self, data: bytes) -> Fed | None:
        """`feed`'s answer when data is exactly one whole masked text or binary frame, not a
        fragment, within the limits and the budgets, with nothing else in progress (what a
        run's frame nearly always is): kept and handed on, as the general path would. None
        for anything else, which the general path judges. tests/test_framebudget.py holds
        the two to the same answers."""
        return Fed(pieces=[data]) if self.take_whole(data) else None

    def take_whole(self, data: bytes) -> bool:
        """Whether data is such a whole frame (`_whole`), kept: then all of it goes on to the
        reader as it is, and nothing else is to be done."""
        if self._header or self._in_payload or self._in_message or self.closed or len(data) < 6:
            return False
        second = data[1]
        flag = second & 0x7F
        if flag == 127:
            return False
        size, header = (int.from_bytes(data[2:4], "big"), 8) if flag == 126 else (flag, 6)
        # FIN and a data opcode (RSV bits are the reader's to refuse), a mask, one frame exactly.
        if data[0] & 0x8F not in (0x81, 0x82) or not second & 0x80 or len(data) != header + size:
            return False
        if size > self.limit or self._reserve(size) is not None:
            return False  # refused: the general path says why
        self.taken.append(size)
        return True

    def _judge(self, header: bytes) -> Closing | None:  # noqa: C901 (one verdict per RFC 6455 header rule, in the order they apply)
        opcode, fin = header[0] & 0x0F, bool(header[0] & 0x80)
        size = _payload_size(header)
        self._remaining, self._fin, self._skipping = size, fin, False
        self._data_frame = opcode in (OP_CONTINUATION, OP_TEXT, OP_BINARY)
        if not self._data_frame:
            return None  # control frames, and opcodes the reader will refuse
        if opcode == OP_CONTINUATION:
            if not self._in_message:
                self._data_frame = False  # the reader refuses a continuation of nothing
                return None
            if self._message + size > self.limit:
                return Closing(CLOSE_TOO_BIG, "a fragmented message over SANDBOX_MAX_MESSAGE_BYTES")
            problem = self._reserve(size)
            if problem is not None:
                return Closing(CLOSE_TRY_LATER, "the server holds too many unfinished messages")
            self._message += size
            return None
        if self._in_message:
            self._data_frame = False  # a new message inside a fragmented one: the reader refuses it
            return None
        self.started = self._now()
        if size > 2 * self.limit or (size > self.limit and not fin):
            return Closing(CLOSE_TOO_BIG, "message over SANDBOX_MAX_MESSAGE_BYTES")
        if size > self.limit:
            self._skip(Refusal("rejected", too_big(size, self.limit)))
            return None
        problem = self._reserve(size)
        if problem is not None:
            if not fin:
                return Closing(CLOSE_TRY_LATER, "the server holds too many unfinished messages")
            self._skip(Refusal("busy", problem))
            return None
        self._message = size
        self._in_message = not fin
        return None

    def _reserve(self, size: int) -> str | None:
        if self.held + size > 2 * self.limit:
            return (
                f"this connection holds {self.held} bytes of messages the server has not taken "
                f"yet; send the next when it answers"
            )
        return self.budget.reserve(self.owner, size)

    def _skip(self, refusal: Refusal) -> None:
        self._skipping = True
        self._refusal = refusal

    def _frame_done(self, fed: Fed) -> None:
        self._in_payload = False
        if self._skipping:
            self._skipping, self.started = False, None
            return
        if self._data_frame and self._fin:
            self.taken.append(self._message)
            self._message, self._in_message, self.started = 0, False, None

    @property
    def unfinished(self) -> bool:
        """Whether a data frame or a fragmented message is still being received."""
        return self.started is not None

    def handled(self) -> None:
        """The handler is done with the oldest finished message: its bytes are free."""
        if self.taken:
            self.budget.release(self.owner, self.taken.popleft())

    def close(self) -> int:
        """The connection is gone: release everything it held; returns how much that was."""
        freed = self.held
        self.budget.release(self.owner, freed)
        self._message, self.taken, self.started, self.closed = 0, deque(), None, True
        return freed


def _header_size(start: bytes) -> int | None:
    """A frame header's length from its first bytes, or None if fewer than 2 are known."""
    if len(start) < 2:
        return None
    flag = start[1] & 0x7F
    extended = 2 if flag == 126 else 8 if flag == 127 else 0
    return 2 + extended + (4 if start[1] & 0x80 else 0)


def _payload_size(header: bytes) -> int:
    flag = header[1] & 0x7F
    if flag == 126:
        return int.from_bytes(header[2:4], "big")
    if flag == 127:
        return int.from_bytes(header[2:10], "big")
    return flag
