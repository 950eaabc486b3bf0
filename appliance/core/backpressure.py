"""When to come back: the retry hint a `busy` answer carries (`done.retry_after_ms`, and the
REST routes' `Retry-After`).

The estimate: a refused request finds the queue full, `waiting` requests in line ahead of any
new one and `limit` runs holding slots. Runs leave at about `limit / mean_run_s` a second, so
half the line has gone after `(waiting / 2 + 1) * mean_run_s / limit`. Coming back then, a
refused client finds room, and the runs queued meanwhile keep every slot busy (the line is not
empty yet), so retries neither spin on a full queue nor leave slots idle. The clients add
their own jitter on top (the appliance client: up to +50 %), so a burst refused together does
not come back together.

Bounded: never under FLOOR_MS (a refusal costs the server little, but a flood of retries at
once costs it a lot more than the run it asks for), never over CEILING_MS (a hint is a
guess from recent runs; a long one would idle a client that could already be served).
"""

from __future__ import annotations

import math

FLOOR_MS = 100
CEILING_MS = 30_000
PRIOR_RUN_S = 1.0  # the mean run before any has ended (a bare one-shot run takes well under it)
SMOOTHING = 0.2  # weight of the newest run in the running mean: about the last ten runs count


def retry_after_ms(waiting: int, limit: int, mean_run_s: float) -> int:
    """The hint, in milliseconds, for a request refused with `waiting` in line and `limit`
    slots whose runs last `mean_run_s` on average; FLOOR_MS to CEILING_MS."""
    if not math.isfinite(mean_run_s) or mean_run_s < 0:
        mean_run_s = PRIOR_RUN_S
    estimate = (max(0, waiting) / 2 + 1) * mean_run_s / max(1, limit) * 1000
    return int(min(CEILING_MS, max(FLOOR_MS, math.ceil(round(estimate, 6)))))


def clamp_ms(ms: float) -> int:
    """A hint computed elsewhere (a rate bucket's refill), in the same bounds."""
    if not math.isfinite(ms):
        return CEILING_MS
    return int(min(CEILING_MS, max(FLOOR_MS, math.ceil(ms))))


def smoothed(mean_s: float | None, sample_s: float) -> float:
    """The running mean of run durations after one more run of `sample_s` seconds."""
    if mean_s is None:
        return sample_s
    return mean_s + SMOOTHING * (sample_s - mean_s)
