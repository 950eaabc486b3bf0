"""When to send a request again that the appliance refused `busy` (over HTTP: 429).

A `busy` answer means nothing ran (docs/protocol.md), so sending the request again can never
run it twice; any other answer, or none (a dropped connection), is never retried here. The
wait before each new try is an exponential backoff (`first_s`, doubling, up to `max_s`), never
shorter than the server's hint (`done.retry_after_ms`, or the `Retry-After` header), spread
by a random jitter of up to `jitter` (+50 % by default) so that clients refused together do
not all come back at once. Retries stop after `attempts` sends in all, or when the next wait
would end past `deadline_s` from the first send; the caller then gets the last `busy`.
"""

from __future__ import annotations

import email.utils
import math
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

DEADLINE_S = 60.0
ATTEMPTS = 10


@dataclass(frozen=True)
class BusyRetry:
    """The retry policy for `busy`; `deadline_s` 0 or `attempts` 1 turns retrying off."""

    deadline_s: float = DEADLINE_S
    attempts: int = ATTEMPTS
    first_s: float = 0.1
    max_s: float = 10.0
    jitter: float = 0.5

    def __post_init__(self) -> None:
        if not math.isfinite(self.deadline_s) or self.deadline_s < 0:
            raise ValueError(
                f"the busy retry deadline must be a finite number of seconds >= 0, got {self.deadline_s!r}"
            )
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int) or self.attempts < 1:
            raise ValueError(f"busy retry attempts must be an int >= 1 (1: no retry), got {self.attempts!r}")

    def delay(
        self, sent: int, elapsed_s: float, hint_s: float | None, rand: Callable[[], float] = random.random
    ) -> float | None:
        """Seconds to wait before send number `sent + 1`, after `sent` sends refused `busy` and
        `elapsed_s` since the first; None: give up (out of attempts, or past the deadline)."""
        if sent >= self.attempts:
            return None
        backoff = min(self.max_s, math.ldexp(self.first_s, max(0, sent - 1)))
        wait = max(backoff, hint_s or 0.0) * (1 + self.jitter * rand())
        if elapsed_s + wait > self.deadline_s:
            return None
        return wait


def hint_of_done(done: Mapping[str, Any]) -> float | None:
    """The server's hint in a `busy` done frame (`retry_after_ms`), in seconds."""
    ms = done.get("retry_after_ms")
    if isinstance(ms, bool) or not isinstance(ms, int | float) or not math.isfinite(ms) or ms < 0:
        return None
    return float(ms) / 1000


def hint_of_header(value: str | None, now: Callable[[], float] = time.time) -> float | None:
    """A `Retry-After` header, in seconds: delay-seconds or an HTTP date (RFC 9110)."""
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - now())
