"""Intervals: Wilson against values worked out by hand, the bootstrap reproducible by seed, the three-way judgement."""

from __future__ import annotations

import math

import pytest

from kvlab.experiments.tables import interval_text
from kvlab.stats import NO_CASES, Interval, bootstrap, bootstrap_mean, wilson


def test_wilson_matches_the_hand_computed_interval() -> None:
    # 7 of 10, z = 1.96 (rounded here, as a hand calculation would): z² = 3.8416
    # centre = (0.7 + 3.8416 / 20) / (1 + 3.8416 / 10) = 0.89208 / 1.38416 = 0.644492
    # half   = 1.96 / 1.38416 · sqrt(0.7 · 0.3 / 10 + 3.8416 / 400) = 1.416021 · sqrt(0.030604)
    #        = 1.416021 · 0.174940 = 0.247719
    # → [0.644492 − 0.247719, 0.644492 + 0.247719] = [0.396773, 0.892211]
    got = wilson(7, 10, z=1.96)
    assert got.estimate == 0.7 and got.n == 10
    assert got.low == pytest.approx(0.396773, abs=2e-6) and got.high == pytest.approx(0.892211, abs=2e-6)


def test_wilson_at_none_and_all_successes_is_one_sided_and_not_a_point() -> None:
    # 0 of 8: centre = (3.8416 / 16) / (1 + 3.8416 / 8) = 0.2401 / 1.4802 = 0.162208
    #         half = 1.96 / 1.4802 · sqrt(0 + 3.8416 / 256) = 1.324145 · 0.122500 = 0.162208
    # → [0, 0.324416]; 8 of 8 mirrors it
    none, every = wilson(0, 8, z=1.96), wilson(8, 8, z=1.96)
    assert none.low == 0.0 and none.high == pytest.approx(0.324416, abs=2e-6)
    assert every.high == 1.0 and every.low == pytest.approx(1 - 0.324416, abs=2e-6)


def test_wilson_narrows_with_more_cases_and_refuses_impossible_counts() -> None:
    assert wilson(50, 100).high - wilson(50, 100).low < wilson(5, 10).high - wilson(5, 10).low
    assert wilson(0, 0) is NO_CASES and wilson(0, 0).text() == "—"
    with pytest.raises(ValueError):
        wilson(3, 2)


def test_the_bootstrap_is_reproducible_by_seed_and_covers_the_mean() -> None:
    values = [0.1, 0.4, 0.35, 0.8, 0.05, 0.6, 0.2, 0.9, 0.3]
    a, b, other = bootstrap_mean(values, seed=3), bootstrap_mean(values, seed=3), bootstrap_mean(values, seed=4)
    assert a == b and a != other  # the same seed gives the same interval; another seed moves its ends
    assert a.estimate == pytest.approx(sum(values) / len(values)) and a.n == len(values)
    assert min(values) < a.low < a.estimate < a.high < max(values)


def test_the_bootstrap_skips_missing_scores_and_a_constant_has_no_spread() -> None:
    got = bootstrap_mean([0.5, None, math.nan, 0.5])
    assert (got.estimate, got.low, got.high, got.n) == (0.5, 0.5, 0.5, 2)
    assert bootstrap_mean([None]) is NO_CASES


def test_one_case_has_its_value_and_no_interval_not_one_of_no_width() -> None:
    """A walk read the arena's "KL 95 % [1.633, 1.633]" for one question: certainty from a single case."""
    one = bootstrap_mean([1.633, None])
    assert (one.estimate, one.n) == (1.633, 1) and math.isnan(one.low) and math.isnan(one.high)
    assert one.side(0.0) == one.side(5.0) == "straddles" and one.text(3) == "1.633 (n = 1)"
    assert interval_text(one.low, one.high) is None  # the arena table's cell: empty, not "[1.633, 1.633]"


@pytest.mark.parametrize(("interval", "threshold", "side"), [
    (Interval(0.8, 0.7, 0.9, 10), 0.5, "above"),
    (Interval(0.2, 0.1, 0.3, 10), 0.5, "below"),
    (Interval(0.5, 0.3, 0.7, 10), 0.5, "straddles"),
    (Interval(0.6, 0.5, 0.7, 10), 0.5, "straddles"),  # touching the threshold is not clear of it
    (NO_CASES, 0.5, "straddles"),
])
def test_the_judgement_says_above_only_when_the_whole_interval_is(interval: Interval, threshold: float,
                                                                  side: str) -> None:
    assert interval.side(threshold) == side


def test_the_interval_reads_as_numbers_or_percent() -> None:
    assert Interval(0.625, 0.3, 0.86, 8).text() == "0.62 [0.30, 0.86]"
    assert Interval(0.625, 0.306, 0.863, 8).text(percent=True) == "62 % [31–86 %]"


def test_the_bootstrap_of_a_statistic_resamples_whole_cases() -> None:
    # pairs (before, after): the share of the total closed is 1 − Σafter / Σbefore = 1 − 1.0 / 4.0 = 0.75
    pairs = [[1.0, 0.2], [1.0, 0.3], [1.0, 0.25], [1.0, 0.25]]
    got = bootstrap(pairs, lambda x: 1 - x[..., 1].sum(axis=1) / x[..., 0].sum(axis=1), seed=1)
    assert got.estimate == pytest.approx(0.75) and got.n == 4
    assert 0.7 <= got.low <= 0.75 <= got.high <= 0.8  # each case's own share lies in [0.7, 0.8]
