"""Statistics the benches print beside their ratios (stdlib only: a bench's worker may run another revision)."""

import math


def median_ci95(values: list) -> tuple:
    """(low, high): a distribution-free 95% interval of the median of `values`, the order statistics x_(k) and
    x_(n+1-k) with the largest k such that P(Binomial(n, 1/2) < k) <= 0.025 (Conover, Practical Nonparametric
    Statistics, 3rd ed., sec. 3.2); (min, max) when n < 6, where no k reaches 95%.

    Raises ValueError when `values` is empty."""
    if not values:
        raise ValueError("median_ci95: values is empty")
    xs, n = sorted(values), len(values)
    below, k = 0.0, 0  # below = P(Binomial(n, 1/2) < k + 1)
    while k < n // 2 and below + math.comb(n, k) / 2 ** n <= 0.025:
        below += math.comb(n, k) / 2 ** n
        k += 1
    return (xs[k - 1], xs[n - k]) if k else (xs[0], xs[-1])
