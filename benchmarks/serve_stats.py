"""Chi-square goodness of fit of sampled tokens to the target's exact distributions (serve_features' sampling
check), its power against a biased sampler, with no SciPy: p-values are the regularized upper incomplete gamma
function Q(dof / 2, statistic / 2) (torch.special.gammaincc); power is a noncentral chi-square tail (a Poisson
mixture of central ones)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

MIN_EXPECTED = 5.0  # categories expected fewer times than this in either sample are pooled into one
OTHER = "\x00other"
MAX_CELLS = 4  # goodness of fit: the most likely categories and one pooled cell. A bias that moves mass to the mode
# keeps its noncentrality however the rest is pooled, so fewer degrees of freedom only add power against it


def chi_square_p(stat: float, dof: int) -> float:
    """P(X >= stat) for X ~ chi-square(dof)."""
    import torch

    return float(
        torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64))
    )


def pooled_cells(n: int, probs: dict[str, float]) -> tuple[dict[str, float], dict[str, str]]:
    """The cells of a goodness-of-fit test on ``n`` samples: the MAX_CELLS - 1 most likely categories with
    expected count >= MIN_EXPECTED kept, the rest (and the mass ``probs`` leaves out) pooled into OTHER, which
    folds into the smallest kept cell if it is still too small. Returns ({cell: probability}, {category: its
    cell}); a category not in the second map belongs to the OTHER cell's heir (``where``)."""
    cells: dict[str, float] = {}
    cell_of: dict[str, str] = {}
    kept = set(sorted(probs, key=lambda k: -probs[k])[: MAX_CELLS - 1])
    for cat, p in probs.items():
        key = cat if n * p >= MIN_EXPECTED and cat in kept else OTHER
        cells[key] = cells.get(key, 0.0) + p
        cell_of[cat] = key
    cells[OTHER] = cells.get(OTHER, 0.0) + max(0.0, 1.0 - sum(probs.values()))
    heir = OTHER
    if n * cells[OTHER] < MIN_EXPECTED and len(cells) > 1:
        heir = min((k for k in cells if k != OTHER), key=lambda k: cells[k])
        cells[heir] += cells.pop(OTHER)
        cell_of = {c: heir if k == OTHER else k for c, k in cell_of.items()}
    cell_of[OTHER] = heir
    return cells, cell_of


def where(cell_of: dict[str, str], category: str) -> str:
    return cell_of.get(category, cell_of[OTHER])


def chi_square_fit(groups: Sequence[tuple[Sequence[str], dict[str, float]]]) -> tuple[float, int, float]:
    """(statistic, degrees of freedom, p-value) of "each group's samples follow its probabilities": per group
    (samples, {category: probability}) a chi-square goodness of fit over ``pooled_cells``; the groups' statistics
    and degrees of freedom add."""
    stat, dof = 0.0, 0
    for samples, probs in groups:
        n = len(samples)
        cells, cell_of = pooled_cells(n, probs)
        if n == 0 or len(cells) < 2:
            continue
        seen = Counter(where(cell_of, s) for s in samples)
        stat += sum((seen.get(c, 0) - n * p) ** 2 / (n * p) for c, p in cells.items())
        dof += len(cells) - 1
    return stat, dof, chi_square_p(stat, dof) if dof else 1.0


def shifted(probs: dict[str, float], *, share: float) -> dict[str, float]:
    """A sampler biased by ``share`` of total variation: that much probability moved from the other categories
    (in proportion, the mass ``probs`` leaves out included) to the most likely one."""
    mode = max(probs, key=lambda k: probs[k])
    rest = 1.0 - probs[mode]
    out = {k: (p + share if k == mode else p * (1.0 - share / rest)) for k, p in probs.items()}
    return out


def fit_power(groups: Sequence[tuple[int, dict[str, float]]], *, share: float, p_min: float) -> float:
    """The probability that ``chi_square_fit`` on groups of (n samples, true probabilities) rejects at ``p_min``
    when the samples come from ``shifted(probs, share)`` instead: a noncentral chi-square with noncentrality
    sum n (p1 - p0)^2 / p0 over the pooled cells, its tail a Poisson mixture of central ones."""
    lam, dof = 0.0, 0
    for n, probs in groups:
        cells, cell_of = pooled_cells(n, probs)
        if n == 0 or len(cells) < 2:
            continue
        moved = shifted(probs, share=share)
        p1 = dict.fromkeys(cells, 0.0)
        for cat, p in moved.items():
            p1[where(cell_of, cat)] += p
        p1[cell_of[OTHER]] += max(0.0, 1.0 - sum(moved.values()))
        lam += sum(n * (p1[c] - p0) ** 2 / p0 for c, p0 in cells.items())
        dof += len(cells) - 1
    if not dof:
        return 0.0
    crit = chi_square_quantile(1.0 - p_min, dof)
    return noncentral_tail(crit, dof, lam)


def chi_square_quantile(q: float, dof: int) -> float:
    """x with P(X <= x) = q for X ~ chi-square(dof), by bisection on chi_square_p."""
    lo, hi = 0.0, float(dof) + 100.0 * (dof + 10.0) ** 0.5
    for _ in range(200):
        mid = (lo + hi) / 2
        if chi_square_p(mid, dof) > 1.0 - q:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def noncentral_tail(x: float, dof: int, lam: float) -> float:
    """P(X > x) for X ~ noncentral chi-square(dof, lam) = sum_j Poisson(j; lam / 2) P(chi-square(dof + 2j) > x)."""
    import math

    half = lam / 2.0
    top = int(half + 12.0 * (half + 1.0) ** 0.5 + 30)
    total = 0.0
    for j in range(top + 1):
        w = math.exp(-half + j * math.log(half) - math.lgamma(j + 1)) if half > 0 else float(j == 0)
        total += w * chi_square_p(x, dof + 2 * j)
    return total


def shift_samples(samples: Sequence[str], *, share: float) -> list[str]:
    """A deliberately biased sampler's output: ``share`` of all samples, evenly spread over those not of the most
    common category, replaced by the most common one."""
    n = len(samples)
    mode = Counter(samples).most_common(1)[0][0]
    others = [i for i, s in enumerate(samples) if s != mode]
    moves = min(len(others), round(share * n))
    if not moves:
        return list(samples)
    pick = {others[int(k * len(others) / moves)] for k in range(moves)}
    return [mode if i in pick else s for i, s in enumerate(samples)]
