"""The statistics of the benchmark, as plain functions of numbers (tested on the CPU).

One cell's latency in one repeat is the MAX over Attention ranks of each rank's median over
its timed replays; the cell's latency is the median over repeats; a comparison between two
arms is the geometric mean over repeats of the per-repeat ratio (paired by repeat index),
reported as a percentage change.
"""

from __future__ import annotations

import math
import statistics
from typing import Dict, Iterable, List, Optional, Sequence


def median(values: Iterable[float]) -> Optional[float]:
    """Median of the finite values; None when there are none."""
    v = [float(x) for x in values if x is not None and math.isfinite(float(x))]
    return statistics.median(v) if v else None


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """Linear-interpolated q-th percentile (0..100) of the values; None when empty."""
    v = sorted(float(x) for x in values)
    if not v:
        return None
    if len(v) == 1:
        return v[0]
    pos = (len(v) - 1) * q / 100.0
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def summarize_samples(samples_us: Sequence[float]) -> Dict[str, Optional[float]]:
    """One rank's timed replays -> median (what the benchmark uses) and spread."""
    return {
        "median_us": median(samples_us),
        "p10_us": percentile(samples_us, 10),
        "p90_us": percentile(samples_us, 90),
        "min_us": min(samples_us) if samples_us else None,
        "n": len(samples_us),
    }


def max_over_ranks(per_rank_median_us: Dict[int, Optional[float]]) -> Optional[float]:
    """A repeat's latency: the slowest Attention rank's median. None if any rank has none
    (a failed rank makes the repeat invalid rather than optimistic)."""
    if not per_rank_median_us:
        return None
    vals = list(per_rank_median_us.values())
    if any(v is None or not math.isfinite(v) for v in vals):
        return None
    return max(vals)


def paired_ratios(a: Sequence[Optional[float]], b: Sequence[Optional[float]]) -> List[float]:
    """a[i] / b[i] for every repeat i where both are positive numbers."""
    out = []
    for x, y in zip(a, b):
        if x is None or y is None:
            continue
        if not (math.isfinite(x) and math.isfinite(y)) or x <= 0 or y <= 0:
            continue
        out.append(x / y)
    return out


def geomean(values: Sequence[float]) -> Optional[float]:
    v = [float(x) for x in values]
    if not v or any(x <= 0 for x in v):
        return None
    return math.exp(sum(math.log(x) for x in v) / len(v))


def paired_change_pct(a: Sequence[Optional[float]], b: Sequence[Optional[float]]
                      ) -> Optional[float]:
    """Percent change of arm a against arm b: (geomean of per-repeat a/b - 1) * 100.
    Negative = a is faster. None without a single complete pair."""
    g = geomean(paired_ratios(a, b))
    return None if g is None else (g - 1.0) * 100.0


def wins(a: Sequence[Optional[float]], b: Sequence[Optional[float]]) -> str:
    """'w/n': in how many of the n complete repeat pairs a was faster than b."""
    r = paired_ratios(a, b)
    return f"{sum(1 for x in r if x < 1.0)}/{len(r)}"
