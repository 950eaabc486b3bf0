"""Percentiles and summaries of latency samples. Pure: numbers in, numbers out."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks."""
    if not values:
        raise ValueError("percentile of no samples")
    ordered = sorted(values)
    if len(ordered) == 1:
        return float(ordered[0])
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = math.ceil(rank)
    return float(ordered[low] + (ordered[high] - ordered[low]) * (rank - low))


@dataclass(frozen=True)
class Summary:
    """Latency of one scenario on one target, in milliseconds."""

    n: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float
    min_ms: float
    max_ms: float

    def as_dict(self) -> dict[str, Any]:
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in asdict(self).items()}


def summarize(samples_ms: Sequence[float]) -> Summary:
    """p50/p90/p99 (and mean, min, max) of samples in milliseconds."""
    if not samples_ms:
        raise ValueError("no samples to summarize")
    return Summary(
        n=len(samples_ms),
        p50_ms=percentile(samples_ms, 50),
        p90_ms=percentile(samples_ms, 90),
        p99_ms=percentile(samples_ms, 99),
        mean_ms=sum(samples_ms) / len(samples_ms),
        min_ms=float(min(samples_ms)),
        max_ms=float(max(samples_ms)),
    )


def median_ratio(
    a: Sequence[float], b: Sequence[float], resamples: int = 2000, seed: int = 0
) -> tuple[float, float, float]:
    """median(a) / median(b), and the 95% interval of that ratio over `resamples` bootstrap
    resamples of each (seeded: the same samples always give the same interval)."""
    if not a or not b:
        raise ValueError("a ratio of no samples")
    rng = random.Random(seed)  # noqa: S311 (resampling, not secrets)
    ratios = sorted(
        percentile(rng.choices(a, k=len(a)), 50) / percentile(rng.choices(b, k=len(b)), 50)
        for _ in range(resamples)
    )
    low, high = ratios[int(resamples * 0.025)], ratios[int(resamples * 0.975) - 1]
    return percentile(a, 50) / percentile(b, 50), low, high
