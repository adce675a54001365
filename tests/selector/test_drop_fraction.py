"""The capacity path's expected drop under uniform routing, against sampled loads.

`poisson_drop_fraction(mean, cap)` is E[max(X - cap, 0)] / mean for X ~ Poisson(mean):
the share of tokens an expert of capacity `cap` drops. The capacity warnings and the
capacity_factor fix both read it, so each of its three regimes (the exact sum, the
normal tail for large means, and the cut-off far above the mean) is checked against a
sample of a million Poisson loads drawn by numpy, not against the formula again.
"""

from __future__ import annotations

import numpy as np
import pytest

from selector.rules import poisson_drop_fraction

SAMPLES = 1_000_000


def sampled_drop_fraction(mean: float, cap: int) -> float:
    loads = np.random.default_rng(0).poisson(mean, SAMPLES)
    return float(np.maximum(loads - cap, 0).mean() / mean)


@pytest.mark.parametrize(
    ("mean", "cap"),
    [
        (1.0, 0),  # every token over: the whole load drops
        (1.0, 1),  # e^-1 of the mean
        (0.5, 2),
        (3.0, 4),
        (8.0, 10),
        (40.0, 50),
        (100.0, 114),  # past 12 / sqrt(mean) above the mean: a cut-off there loses it
        (2000.0, 2050),  # the normal tail
        (2000.0, 2150),  # the normal tail, less than one token over (never floored at one)
        (5000.0, 4900),  # the normal tail below the mean
    ],
)
def test_the_drop_fraction_is_what_sampled_loads_drop(mean, cap):
    sampled = sampled_drop_fraction(mean, cap)
    # A million draws: the sample's relative error is under 2% at these tails.
    assert poisson_drop_fraction(mean, cap) == pytest.approx(sampled, rel=0.02, abs=1e-5)


def test_the_drop_fraction_has_the_closed_forms():
    # cap 0 drops every token; cap 1 at mean 1 drops E[X] - 1 + P(X = 0) = e^-1.
    assert poisson_drop_fraction(1.0, 0) == pytest.approx(1.0, rel=1e-12)
    assert poisson_drop_fraction(1.0, 1) == pytest.approx(np.exp(-1.0), rel=1e-12)
    assert poisson_drop_fraction(0.0, 4) == 0.0
    assert poisson_drop_fraction(4.0, 200) == 0.0  # 98 standard deviations above


def test_the_drop_fraction_falls_as_the_capacity_grows():
    drops = [poisson_drop_fraction(20.0, cap) for cap in range(0, 60)]
    assert all(a > b for a, b in zip(drops[:-1], drops[1:], strict=True) if a > 0)
    assert drops[0] == pytest.approx(1.0)
