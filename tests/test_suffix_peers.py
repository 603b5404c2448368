"""Benchmark peer wrappers: Arctic's path probabilities become per-node probabilities; lifecycle."""

from __future__ import annotations

import numpy as np
import pytest

from specdec.eval.peers import _arctic_tree


def test_arctic_path_probs_become_conditional():
    # Arctic reports path probabilities: root children 0.8 and 0.2, then 0.4 under the first
    tree = _arctic_tree([5, 6, 7], [-1, -1, 0], [0.8, 0.2, 0.4])
    np.testing.assert_allclose(tree.probs, [0.8, 0.2, 0.5], rtol=1e-6)
    np.testing.assert_allclose(tree.path_probs(), [0.8, 0.2, 0.4], rtol=1e-6)
    assert len(_arctic_tree([], [], [])) == 0


def test_arctic_drafter_lifecycle():
    pytest.importorskip("arctic_inference.suffix_decoding")
    from specdec.eval.peers import ArcticDrafter

    d = ArcticDrafter()
    d.start("a", [1, 2, 3, 4, 1, 2, 3, 4, 1, 2])
    t = d.draft("a", 4)
    assert t.is_chain() and 0 < len(t) <= 4 and t.tokens.tolist()[0] == 3
    d.extend("a", [3, 4])
    d.stop("a")
    d.stop("a")  # unknown ids are tolerated
    assert d.active_requests() == []
    d.start("b", [9, 1, 2])  # the global cache holds a's response "3 4"
    assert len(d.draft("b", 4, tree=True)) <= 4
