"""A latency histogram cheap enough for every CachePolicy call.

Log-spaced buckets, four per power of two of microseconds (each bucket spans at most 19%),
from 1 µs to about 17 minutes: ``record`` is O(1) with no allocation, a percentile is O(number
of buckets). Percentiles are reported as the upper edge of their bucket, so they never flatter.
"""

from __future__ import annotations

import math

_PER_OCTAVE = 4
_BUCKETS = 30 * _PER_OCTAVE + 1


class LatencyHistogram:
    __slots__ = ("count", "counts", "max_us", "total_us")

    def __init__(self) -> None:
        self.counts = [0] * _BUCKETS
        self.count = 0
        self.total_us = 0.0
        self.max_us = 0.0

    def record(self, seconds: float) -> None:
        us = seconds * 1e6
        self.count += 1
        self.total_us += us
        if us > self.max_us:
            self.max_us = us
        i = 0 if us <= 1.0 else min(_BUCKETS - 1, math.ceil(math.log2(us) * _PER_OCTAVE))
        self.counts[i] += 1

    def percentile(self, q: float) -> float:
        """The ``q`` quantile (0 < q <= 1) in µs: the upper edge of its bucket, at most the max."""
        if not self.count:
            return 0.0
        rank = max(1, math.ceil(q * self.count))
        seen = 0
        for i, n in enumerate(self.counts):
            seen += n
            if seen >= rank:
                return min(self.max_us, 2.0 ** (i / _PER_OCTAVE))
        return self.max_us

    def summary(self) -> dict[str, float]:
        """count, mean, p50, p99 and max in µs."""
        return {
            "count": self.count,
            "mean_us": round(self.total_us / self.count, 1) if self.count else 0.0,
            "p50_us": round(self.percentile(0.5), 1),
            "p99_us": round(self.percentile(0.99), 1),
            "max_us": round(self.max_us, 1),
        }
