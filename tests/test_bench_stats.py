"""The interval the benches (`bench/bench_server_batching.py`, `bench/bench_decode.py`) print beside their median
ratios: `bench/bench_stats.py`."""

import os
import sys

import pytest
from scipy import stats

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import bench_stats  # noqa: E402


@pytest.mark.parametrize("n", [6, 9, 10, 31, 32, 100])
def test_median_interval_is_the_narrowest_order_statistic_pair_with_95_coverage(n):
    """x_(k)..x_(n+1-k) covers the median with probability 1 - 2 P(Binomial(n, 1/2) <= k - 1) (scipy's binomial
    here, the bench's own sum of binomial coefficients there); k is the largest with coverage >= 0.95."""
    low, high = bench_stats.median_ci95([float(i) for i in reversed(range(n))])  # unsorted input
    k = int(low) + 1
    assert high == n - k

    def coverage(j):
        return 1 - 2 * stats.binom.cdf(j - 1, n, 0.5)

    assert coverage(k) >= 0.95 > coverage(k + 1)


def test_median_interval_of_few_rounds_is_the_range():
    assert bench_stats.median_ci95([0.7, 0.5, 0.6]) == (0.5, 0.7)


def test_median_interval_of_nothing_is_an_error():
    with pytest.raises(ValueError, match="values is empty"):
        bench_stats.median_ci95([])
