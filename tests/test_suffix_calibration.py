"""Calibrated suffix chains: the learned table and drafts by hand, on the reference and the native core."""

from __future__ import annotations

import pytest

from specdec.drafters.suffix_calib import Calibration
from specdec.drafters.suffix_ref import RefEngine

ENGINES = [RefEngine]
try:
    from specdec.drafters._suffix_native import Engine as NativeEngine

    ENGINES.append(NativeEngine)
except ImportError:  # pragma: no cover - native core not built
    pass

CHAIN = (4, False, 8.0, 0.0, 0.0, True, True, 0.0)  # budget 4, chain, factor 8, offset 0, min_prob 0, both tries


def _learned(engine_cls):
    """Prompt 5 6 7 8 5 6 7, then 8 | 4 | 6 7 8 appended. Before each appended token the top continuation of the
    longest local match (nothing is cached yet) is checked:
      8: "5 6 7" (3 tokens) -> 8, count 1 of 1: hit            -> cell (local, ell 3, count 1, all) 1 / 1
      4: "5 6 7 8" (4)     -> 5, count 1 of 1: miss           -> cell (local, ell 4, count 1, all) 0 / 1
      6: "4" never seen before: no match, nothing learned
      7: "6" (1)           -> 7, count 2 of 2: hit            -> cell (local, ell 1, count 2, all) 1 / 1
      8: "6 7" (2)         -> 8, count 2 of 2: hit            -> cell (local, ell 2, count 2, all) 1 / 1"""
    e = engine_cls(8, 10, 1000)
    e.start(0, [5, 6, 7, 8, 5, 6, 7])
    for toks in ([8], [4], [6, 7, 8]):
        e.extend(0, toks)
    return e


def test_table_learns_each_tries_top_continuation_by_hand():
    e = _learned(RefEngine)
    cells = {Calibration.cell(0, 3, 1, 1): (1, 1), Calibration.cell(0, 4, 1, 1): (0, 1)}
    cells |= {Calibration.cell(0, 1, 2, 2): (1, 1), Calibration.cell(0, 2, 2, 2): (1, 1)}
    got = {i: (e.calib.hits[i], e.calib.trials[i]) for i in range(len(e.calib.trials)) if e.calib.trials[i]}
    assert got == cells
    assert cells.keys() == {70, 105, 5, 40}  # ((src * 17 + ell bucket) * 7 + count bucket) * 5 + share
    # the global trie: request 0's response 8 4 6 7 8 is cached; "8 4" continues with 6 there (count 1 of 1): a hit
    e.stop(0)
    e.start(1, [9, 8, 4])
    e.extend(1, [6])
    assert (e.calib.hits[630], e.calib.trials[630]) == (1.0, 1.0) and Calibration.cell(1, 2, 1, 1) == 630


@pytest.mark.parametrize("engine_cls", ENGINES)
def test_calibrated_chain_by_hand(engine_cls):
    """Context 5 6 7 8 5 6 7 8 4 6 7 8. The matches "6 7 8", "7 8" and "8" have the same two continued occurrences
    (followed by 5, then by 4), so only the longest (3 tokens) is drafted from: the shorter ones' chains would be its
    chain with fewer tokens matched. Its chain: 4 (count 1 of 2, share 1/2: an unseen cell, (0 + 2 x 1/2) / (0 + 2)
    = 0.5), 6 (ell 4, count 1 of 1: 0 hits in 1 trial, (0 + 2) / (1 + 2) = 2/3), 7 and 8 (unseen cells: 1); score
    0.5 + 1/3 + 1/3 + 1/3. Counts alone give 0.5 1 1 1 (score 2.0)."""
    e = _learned(engine_cls)
    toks, parents, probs, score, match, src = e.draft(0, *CHAIN, True)
    assert (toks, parents, match, src) == ([4, 6, 7, 8], [-1, 0, 1, 2], 3, 0)
    assert probs == pytest.approx([0.5, 2 / 3, 1.0, 1.0], abs=1e-12)
    assert score == pytest.approx(0.5 + 1 / 3 + 1 / 3 + 1 / 3, abs=1e-12)
    toks, _, probs, score, match, _ = e.draft(0, *CHAIN, False)
    assert (toks, probs, score, match) == ([4, 6, 7, 8], [0.5, 1.0, 1.0, 1.0], 2.0, 3)
    cut = e.draft(0, 4, False, 8.0, 0.0, 0.4, True, True, 0.0, True)  # min_prob 0.4: path 0.5, then 1/3 stops
    assert cut[0] == [4] and cut[4] == 3


@pytest.mark.parametrize("engine_cls", ENGINES)
def test_trees_ignore_calibration(engine_cls):
    e = _learned(engine_cls)
    tree = (4, True, 8.0, 0.0, 0.0, True, True, 0.0)
    assert e.draft(0, *tree, True) == e.draft(0, *tree, False)


@pytest.mark.parametrize("backend", ["python", "native"] if len(ENGINES) > 1 else ["python"])
def test_cache_response_feeds_the_global_trie(backend):
    from specdec.drafters.suffix import SuffixDrafter

    d = SuffixDrafter(backend=backend)
    d.cache_response([1, 2, 3, 4])
    d.start("a", [9, 1, 2])
    assert d.draft("a", 4).tokens.tolist() == [3, 4] and d.last_sources == ["global"]
    assert d.global_stats()["cached_requests"] == 1


@pytest.mark.parametrize("backend", ["python", "native"] if len(ENGINES) > 1 else ["python"])
def test_min_confidence_turns_calibration_on_and_cuts_on_it(backend):
    from specdec.drafters.suffix import SuffixDrafter

    def drafter(**opts):
        d = SuffixDrafter(backend=backend, max_depth=8, **opts)
        d.start("a", [5, 6, 7, 8, 5, 6, 7])
        for toks in ([8], [4], [6, 7, 8]):
            d.extend("a", toks)
        return d

    t = drafter(min_confidence=1e-9).draft("a", 4)  # the hand-checked chain above
    assert t.tokens.tolist() == [4, 6, 7, 8] and t.probs.tolist() == pytest.approx([0.5, 2 / 3, 1, 1])
    assert drafter(min_confidence=0.4).draft("a", 4).tokens.tolist() == [4]
    assert drafter(min_confidence=0.0, min_token_prob=0.4).draft("a", 4).probs.tolist() == [0.5, 1, 1, 1]
