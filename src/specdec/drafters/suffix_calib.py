"""Calibrated chain probabilities of the suffix drafter's reference engine (the native core's suffix_calib.inc).

Before each token the library appends, the top continuation of each trie's longest match with one is checked
against it; hits and trials are counted per cell: source (0 the request's own trie, 1 the global one), tokens matched
(``ell``, bucketed), the continuation's count (bucketed) and its share of its node's total (all, >= 3/4, >= 1/2,
>= 1/4, less). A calibrated chain token's probability is its cell's hit rate shrunk towards count / total by
``CALIB_PRIOR`` pseudo-trials: how often such a candidate was the next token before. What is learned depends only on
the tokens appended, never on the drafts.
"""

from __future__ import annotations

CALIB_PRIOR = 2.0  # pseudo-trials at count / total in a calibrated probability
CALIB_ELL_EDGES = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 20, 24, 32, 48, 64)  # tokens matched <= edge: its bucket
CALIB_COUNT_EDGES = (1, 2, 3, 4, 8, 16)
CALIB_N_ELL, CALIB_N_COUNT, CALIB_N_SHARE = len(CALIB_ELL_EDGES) + 1, len(CALIB_COUNT_EDGES) + 1, 5


class Calibration:
    """The learned table (see the module docstring): ``hits`` and ``trials`` per cell."""

    def __init__(self) -> None:
        n = 2 * CALIB_N_ELL * CALIB_N_COUNT * CALIB_N_SHARE
        self.hits = [0.0] * n
        self.trials = [0.0] * n

    @staticmethod
    def cell(src: int, ell: int, c: int, t: int) -> int:
        e = next((i for i, edge in enumerate(CALIB_ELL_EDGES) if ell <= edge), CALIB_N_ELL - 1)
        k = next((i for i, edge in enumerate(CALIB_COUNT_EDGES) if c <= edge), CALIB_N_COUNT - 1)
        share = 0 if c == t else 1 if 4 * c >= 3 * t else 2 if 2 * c >= t else 3 if 4 * c >= t else 4
        return ((src * CALIB_N_ELL + e) * CALIB_N_COUNT + k) * CALIB_N_SHARE + share

    def prob(self, src: int, ell: int, c: int, t: int) -> float:
        i = self.cell(src, ell, c, t)
        return (self.hits[i] + CALIB_PRIOR * c / t) / (self.trials[i] + CALIB_PRIOR)

    def observe(self, src: int, ell: int, c: int, t: int, hit: bool) -> None:
        i = self.cell(src, ell, c, t)
        self.trials[i] += 1.0
        self.hits[i] += 1.0 if hit else 0.0
