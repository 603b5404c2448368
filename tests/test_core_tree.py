"""TokenTree utilities against hand-checked arrays.

The example tree (tokens / parents), depth in brackets:

    root ─ n0:10 [1] ─ n1:11 [2] ─ n4:14 [3]
         │           └ n2:12 [2]
         └ n3:13 [1]
"""

from __future__ import annotations

import numpy as np
import pytest

from specdec.tree import ROOT, TokenTree, merge_trees

TOKENS = [10, 11, 12, 13, 14]
PARENTS = [-1, 0, 0, -1, 1]


@pytest.fixture
def tree() -> TokenTree:
    return TokenTree(np.array(TOKENS), np.array(PARENTS))


def test_structure(tree):
    assert tree.depths.tolist() == [1, 2, 2, 1, 3]
    assert tree.max_depth == 3 and len(tree) == 5 and not tree.is_chain()
    assert tree.children(ROOT) == [0, 3] and tree.children(0) == [1, 2] and tree.children(4) == []
    assert tree.path_to(4) == [0, 1, 4]


def test_positions(tree):
    # flattened input: [root] + nodes; root at p0 = 5, node i at 5 + depth[i]
    assert tree.positions(5).tolist() == [5, 6, 7, 7, 6, 8]
    assert TokenTree.empty().positions(3).tolist() == [3]


def test_ancestor_mask(tree):
    expected = np.array(
        [
            # r  n0 n1 n2 n3 n4
            [1, 0, 0, 0, 0, 0],  # root
            [1, 1, 0, 0, 0, 0],  # n0
            [1, 1, 1, 0, 0, 0],  # n1
            [1, 1, 0, 1, 0, 0],  # n2
            [1, 0, 0, 0, 1, 0],  # n3
            [1, 1, 1, 0, 0, 1],  # n4
        ],
        dtype=bool,
    )
    assert np.array_equal(tree.ancestor_mask(), expected)


def test_chain_mask_is_causal():
    chain = TokenTree.chain([4, 5, 6])
    assert chain.is_chain() and chain.parents.tolist() == [-1, 0, 1]
    assert np.array_equal(chain.ancestor_mask(), np.tril(np.ones((4, 4), bool)))
    assert chain.positions(0).tolist() == [0, 1, 2, 3]


def test_accept_greedy(tree):
    # target_next[k]: target's choice after flattened input k (0 = root, i + 1 = node i)
    assert tree.accept_greedy(np.array([10, 12, 0, 99, 0, 0])) == ([0, 2], 99)
    assert tree.accept_greedy(np.array([10, 11, 14, 0, 0, 42])) == ([0, 1, 4], 42)  # whole path: bonus
    assert tree.accept_greedy(np.array([13, 0, 0, 0, 7, 0])) == ([3], 7)
    assert tree.accept_greedy(np.array([50, 10, 11, 12, 13, 14])) == ([], 50)
    assert TokenTree.empty().accept_greedy(np.array([3])) == ([], 3)


def test_match_length(tree):
    assert tree.match_length([10, 11, 14, 5]) == [0, 1, 4]
    assert tree.match_length([10, 13]) == [0]
    assert tree.match_length([]) == []


def test_to_chain_without_probs(tree):
    chain = tree.to_chain()
    assert chain.tokens.tolist() == [10, 11, 14] and chain.is_chain() and chain.probs is None
    assert tree.to_chain(max_len=2).tokens.tolist() == [10, 11]
    assert len(TokenTree.empty().to_chain()) == 0


def test_to_chain_with_probs():
    # path probs: .9 .18 .63 .1 .162; cumulative along paths: n2 = 1.53 beats n4 = 1.242
    tree = TokenTree(np.array(TOKENS), np.array(PARENTS), np.array([0.9, 0.2, 0.7, 0.1, 0.9]))
    chain = tree.to_chain()
    assert chain.tokens.tolist() == [10, 12]
    assert np.allclose(chain.probs, [0.9, 0.7])
    assert tree.expected_accepted() == pytest.approx(0.9 + 0.18 + 0.63 + 0.1 + 0.162, abs=1e-6)


def test_truncate(tree):
    t = tree.truncate(3)
    assert t.tokens.tolist() == [10, 11, 12] and t.parents.tolist() == [-1, 0, 0]
    assert tree.truncate(10) is tree


def test_merge_trees():
    a = TokenTree.chain([1, 2, 3])
    b = TokenTree(np.array([1, 5]), np.array([-1, 0]))
    c = TokenTree.chain([4])
    merged = merge_trees([a, b, c], budget=5)
    assert merged.tokens.tolist() == [1, 2, 3, 5, 4]
    assert merged.parents.tolist() == [-1, 0, 1, 0, -1]
    assert merged.probs is None
    small = merge_trees([a, b, c], budget=4)
    assert small.tokens.tolist() == [1, 2, 3, 5] and small.parents.tolist() == [-1, 0, 1, 0]


def test_merge_trees_keeps_probs():
    a = TokenTree.chain([1, 2], [0.5, 0.4])
    b = TokenTree.chain([1, 7])
    merged = merge_trees([a, b], budget=8)
    assert merged.tokens.tolist() == [1, 2, 7] and merged.parents.tolist() == [-1, 0, 0]
    assert np.allclose(merged.probs, [0.5, 0.4, 1.0])


def test_subtree_after(tree):
    below = tree.subtree_after([10])
    assert below.tokens.tolist() == [11, 12, 14] and below.parents.tolist() == [-1, -1, 0]
    deeper = tree.subtree_after([10, 11])
    assert deeper.tokens.tolist() == [14] and deeper.parents.tolist() == [-1]
    assert len(tree.subtree_after([99])) == 0
    assert tree.subtree_after([]).tokens.tolist() == TOKENS


def test_invalid_trees_are_rejected():
    with pytest.raises(ValueError, match="parents"):
        TokenTree(np.array([1, 2]), np.array([1, -1]))
    with pytest.raises(ValueError, match="must match"):
        TokenTree(np.array([1, 2]), np.array([-1]))
    with pytest.raises(ValueError, match="probs"):
        TokenTree.chain([1, 2], [0.5])
