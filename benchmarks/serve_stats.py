"""Two-sample chi-square test of categorical samples (first tokens drawn by two servers), with no SciPy: the
p-value is the regularized upper incomplete gamma function Q(dof / 2, statistic / 2) (torch.special.gammaincc)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

MIN_EXPECTED = 5.0  # categories expected fewer times than this in either sample are pooled into one
OTHER = "\x00other"


def chi_square_two_sample(a: Sequence[str], b: Sequence[str]) -> tuple[float, int, float]:
    """(statistic, degrees of freedom, p-value) of "a and b come from one distribution": a 2 x C contingency
    table over the categories seen, rare ones (expected < MIN_EXPECTED in a row) pooled into one category."""
    if not a or not b:
        raise ValueError("chi-square needs samples on both sides")
    ca, cb = Counter(a), Counter(b)
    na, nb = len(a), len(b)
    n = na + nb
    table: dict[str, list[int]] = {}
    for cat in set(ca) | set(cb):
        total = ca[cat] + cb[cat]
        key = cat if min(na, nb) * total / n >= MIN_EXPECTED else OTHER
        row = table.setdefault(key, [0, 0])
        row[0] += ca[cat]
        row[1] += cb[cat]
    if OTHER in table and min(na, nb) * sum(table[OTHER]) / n < MIN_EXPECTED and len(table) > 1:
        # a pooled category still too small: fold it into the smallest kept one
        small = min((k for k in table if k != OTHER), key=lambda k: sum(table[k]))
        table[small] = [x + y for x, y in zip(table[small], table.pop(OTHER))]
    if len(table) < 2:
        return 0.0, 0, 1.0
    stat = 0.0
    for oa, ob in table.values():
        tot = oa + ob
        ea, eb = na * tot / n, nb * tot / n
        stat += (oa - ea) ** 2 / ea + (ob - eb) ** 2 / eb
    dof = len(table) - 1
    return stat, dof, chi_square_p(stat, dof)


def chi_square_p(stat: float, dof: int) -> float:
    """P(X >= stat) for X ~ chi-square(dof)."""
    import torch

    return float(
        torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64))
    )


def biased(samples: Sequence[str], *, fraction: float) -> list[str]:
    """A deliberately biased sampler's output: every k-th sample not of the most common category (k = 1 /
    ``fraction``) replaced by the most common one, moving about ``fraction`` of the rest's mass to the mode."""
    mode = Counter(samples).most_common(1)[0][0]
    step = max(1, round(1 / fraction))
    out, seen = [], 0
    for s in samples:
        if s != mode:
            seen += 1
            out.append(mode if seen % step == 0 else s)
        else:
            out.append(s)
    return out
