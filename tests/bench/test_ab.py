"""bench/ab.py's judgment of old against new: a change inside either side's spread is none, and
"worse" knows a rate (higher is better) from a time (lower is better)."""

from __future__ import annotations

from bench.ab import compare


def test_a_time_or_a_rate_worse_than_the_old_sides_whole_range_is_worse() -> None:
    assert compare("x_ms", [1.0, 1.1, 1.2], [1.3, 1.4, 1.5])["worse_beyond_spread"]  # slower
    assert not compare("x_ms", [1.3, 1.4, 1.5], [1.0, 1.1, 1.2])["worse_beyond_spread"]  # faster
    assert compare("x_gbps", [5.0, 5.1, 5.2], [4.0, 4.1, 4.2])["worse_beyond_spread"]  # lower rate
    assert not compare("x_gbps", [4.0, 4.1, 4.2], [5.0, 5.1, 5.2])["worse_beyond_spread"]


def test_overlapping_ranges_are_within_the_spread_and_the_ratio_is_of_medians() -> None:
    f = compare("x_ms", [1.0, 2.0, 3.0], [2.5, 4.0, 6.0])
    assert f["within_spread"] and not f["worse_beyond_spread"] and f["ratio"] == 2.0
