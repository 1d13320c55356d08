"""How sure a number is: 95 % Wilson intervals for rates, seeded bootstrap intervals for means, sides of a threshold.

A leaf module (like ``errors``): lessons, experiments and figures all judge their numbers with it, so a verdict,
an arena cell and a seed-table mark say "how sure" the same way.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

Z95 = 1.959963984540054  # the standard normal's 97.5 % quantile: a two-sided 95 % interval
RESAMPLES = 2000  # bootstrap resamples: the interval's ends move by well under 1 % of its width between seeds


@dataclass(frozen=True)
class Interval:
    """An estimate with its 95 % interval and the number of cases it rests on (NaN everywhere when n = 0; NaN ends
    where one case gives no interval)."""

    estimate: float
    low: float
    high: float
    n: int

    def side(self, threshold: float) -> str:
        """'above' when the whole interval lies above ``threshold``, 'below' when it lies below, else 'straddles'
        (touching counts as straddling; an interval with no cases straddles every threshold: it says nothing)."""
        if self.n == 0 or math.isnan(self.low):
            return "straddles"
        if self.low > threshold:
            return "above"
        if self.high < threshold:
            return "below"
        return "straddles"

    def text(self, digits: int = 2, percent: bool = False) -> str:
        """'0.62 [0.31, 0.86]' or, with ``percent``, '62 % [31–86 %]'; a number with no cases is '—', one with no
        interval (a bootstrap of one case) its value and 'n = 1'."""
        if self.n == 0 or math.isnan(self.estimate):
            return "—"
        if math.isnan(self.low):
            return f"{100 * self.estimate:.0f} % (n = 1)" if percent else f"{self.estimate:.{digits}f} (n = 1)"
        if percent:
            return f"{100 * self.estimate:.0f} % [{100 * self.low:.0f}–{100 * self.high:.0f} %]"
        return f"{self.estimate:.{digits}f} [{self.low:.{digits}f}, {self.high:.{digits}f}]"


NO_CASES = Interval(math.nan, math.nan, math.nan, 0)


def wilson(successes: int, n: int, z: float = Z95) -> Interval:
    """The Wilson score interval of ``successes`` out of ``n`` (Wilson, 1927): never outside [0, 1], and sound at
    0 or n successes, where the normal approximation collapses to a point."""
    if not 0 <= successes <= n:
        raise ValueError(f"successes must lie between 0 and n, not {successes} of {n}")
    if n == 0:
        return NO_CASES
    p = successes / n
    z2 = z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    # the ends are exactly 0 at 0 successes and 1 at n: say so rather than leave float noise there
    low = 0.0 if successes == 0 else centre - half
    high = 1.0 if successes == n else centre + half
    return Interval(p, low, high, n)


def bootstrap(samples: Sequence[Sequence[float]] | Sequence[float], statistic: Callable[[np.ndarray], np.ndarray],
              seed: int = 0, resamples: int = RESAMPLES, level: float = 0.95) -> Interval:
    """``statistic`` of ``samples`` with a percentile bootstrap interval (Efron): the samples (one per case, a number
    or a row of numbers) are resampled with replacement ``resamples`` times from a generator seeded with ``seed``, so
    the same samples and seed give the same interval. ``statistic`` maps resampled data [resamples, n, ...] to one
    value per resample [resamples] (it sees the original data as [1, n, ...]). One case has its value and no interval
    (NaN ends, which straddle every threshold)."""
    data = np.asarray(samples, dtype=float)  # [n] or [n, d]
    if data.shape[0] == 0:
        return NO_CASES
    if data.shape[0] == 1:  # every resample is the one case: an interval of no width would read as certainty
        return Interval(float(statistic(data[None])[0]), math.nan, math.nan, 1)
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, data.shape[0], size=(resamples, data.shape[0]))  # [resamples, n]
    values = statistic(data[picks])  # [resamples]
    tail = (1 - level) / 2
    low, high = np.quantile(values, [tail, 1 - tail])
    return Interval(float(statistic(data[None])[0]), float(low), float(high), int(data.shape[0]))


def bootstrap_mean(values: Iterable[float | None], seed: int = 0, resamples: int = RESAMPLES,
                   level: float = 0.95) -> Interval:
    """The mean of ``values`` with its seeded percentile bootstrap interval (see ``bootstrap``); NaN and None
    values are skipped (a failed run has no score)."""
    data = [v for v in values if v is not None and not math.isnan(v)]  # [n]
    return bootstrap(data, lambda x: x.mean(axis=1), seed, resamples, level)
