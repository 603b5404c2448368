"""The two-sample chi-square test of serve_features' sampling check, and its negative control (a biased sampler)."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.serve_stats import biased, chi_square_p, chi_square_two_sample

SAMPLES = 2000
P_MIN = 1e-3
PROBS = np.array([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02])  # a first-token distribution


def _draw(rng: np.random.Generator, probs: np.ndarray, n: int) -> list[str]:
    return [f"t{i}" for i in rng.choice(len(probs), size=n, p=probs)]


def test_statistic_by_hand() -> None:
    # a: 30 x, 10 y; b: 10 x, 30 y; expected 20 in every cell: 4 * 10^2 / 20 = 20, 1 degree of freedom
    stat, dof, p = chi_square_two_sample(["x"] * 30 + ["y"] * 10, ["x"] * 10 + ["y"] * 30)
    assert (stat, dof) == (pytest.approx(20.0), 1)
    assert p == pytest.approx(7.744e-6, rel=1e-3)  # P(chi2_1 >= 20) = erfc(sqrt(10))


def test_p_value_matches_scipy() -> None:
    stats = pytest.importorskip("scipy.stats")
    for stat, dof in ((3.0, 1), (12.5, 6), (40.0, 20), (0.5, 3)):
        assert chi_square_p(stat, dof) == pytest.approx(stats.chi2.sf(stat, dof), rel=1e-9)


def test_same_distribution_passes() -> None:
    rng = np.random.default_rng(0)
    ps = [chi_square_two_sample(_draw(rng, PROBS, SAMPLES), _draw(rng, PROBS, SAMPLES))[2] for _ in range(20)]
    assert min(ps) > P_MIN
    assert 0.2 < float(np.mean(ps)) < 0.8  # p-values of a true null are uniform


def test_biased_sampler_fails() -> None:
    rng = np.random.default_rng(1)
    for _ in range(10):
        a, b = _draw(rng, PROBS, SAMPLES), _draw(rng, PROBS, SAMPLES)
        assert chi_square_two_sample(a, biased(b, fraction=0.15))[2] < P_MIN


def test_rare_categories_are_pooled() -> None:
    a = ["x"] * 50 + ["y"] * 50 + [f"r{i}" for i in range(5)]
    b = ["x"] * 50 + ["y"] * 50 + [f"s{i}" for i in range(5)]
    _, dof, p = chi_square_two_sample(a, b)
    assert dof == 2 and p > 0.9  # x, y and one pooled "other": identical counts


def test_biased_moves_mass_to_the_mode() -> None:
    out = biased(["a"] * 6 + ["b", "c", "d", "e"], fraction=0.5)
    assert out.count("a") == 8 and len(out) == 10
