"""A small log-linear histogram of milliseconds, for the SLA windows' percentiles.

The SLA windows live in the audit job's per-queue state, which is written back at every
micro-batch, so a window cannot keep every time in queue it saw. Values under 2,048 ms are kept
exactly; above, each power of two is cut into 1,024 buckets, so a percentile is at most 0.1 % under
the true value (its bucket's lower bound). Percentiles are nearest-rank, as Spark's
``percentile_approx`` gives them on small inputs: the smallest value with at least ``q`` of the
values at or below it. Histograms merge by adding counts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

__all__ = ["EXACT_BELOW", "bucket_of", "lower_bound", "percentiles"]

_BITS = 11
EXACT_BELOW = 1 << _BITS
"""Values below this are their own bucket."""
_MASK = EXACT_BELOW - 1


def bucket_of(value: int) -> int:
    """The bucket of a non-negative value (negative values count as 0); monotonic in the value."""
    if value < EXACT_BELOW:
        return max(0, value)
    shift = value.bit_length() - _BITS
    return (shift << _BITS) + (value >> shift)


def lower_bound(bucket: int) -> int:
    """The smallest value that falls in ``bucket``."""
    if bucket < EXACT_BELOW:
        return bucket
    shift = bucket >> _BITS
    return (bucket & _MASK) << shift


def percentiles(hist: Mapping[int, int], qs: Iterable[float]) -> list[int | None]:
    """Nearest-rank percentiles of a histogram (bucket -> count); None for an empty one."""
    total = sum(hist.values())
    wanted = list(qs)
    if total == 0:
        return [None for _ in wanted]
    # rank = ceil(q * total), at least 1; computed in integers so 0.95 * 20 is exactly 19.
    ranks = [max(1, -(-round(q * 1_000_000) * total // 1_000_000)) for q in wanted]
    out: list[int | None] = [None] * len(wanted)
    seen = 0
    order = sorted(range(len(wanted)), key=lambda i: ranks[i])
    pending = iter(order)
    i = next(pending, None)
    for bucket in sorted(hist):
        seen += hist[bucket]
        while i is not None and ranks[i] <= seen:
            out[i] = lower_bound(bucket)
            i = next(pending, None)
        if i is None:
            break
    return out
