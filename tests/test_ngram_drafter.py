"""N-gram drafter and the vLLM-rule peer: hand-checked token arrays and the replay property."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.config import ConfigError
from specdec.drafters import build_drafter
from specdec.drafters.ngram import NgramDrafter, NgramIndex
from specdec.eval.peers import VllmNgramDrafter


def test_no_match_gives_empty_draft():
    d = NgramDrafter()
    d.start("a", [1, 2, 3, 4, 5])
    assert len(d.draft("a", 8)) == 0
    d.start("b", [])
    assert len(d.draft("b", 8)) == 0
    assert len(d.draft("zz", 8)) == 0


def test_longest_match_preferred():
    # bigram "2 3" -> 9 (most recent), but the trigram "1 2 3" -> 4 5
    d = NgramDrafter(min_n=2, max_n=4)
    d.start("a", [1, 2, 3, 4, 5, 7, 2, 3, 9, 1, 2, 3])
    assert d.draft("a", 2).tokens.tolist() == [4, 5]


def test_tree_of_disagreeing_occurrences():
    d = NgramDrafter(min_n=2, max_n=3)
    d.start("a", [1, 2, 7, 8, 1, 2, 9, 6, 1, 2])
    tree = d.draft("a", 4, tree=True)
    # two occurrences of "1 2": continuations 9 6 (recent) and 7 8; siblings with probability 0.5 each
    assert tree.tokens.tolist() == [9, 7, 6, 8]
    assert tree.parents.tolist() == [-1, -1, 0, 1]
    np.testing.assert_allclose(tree.probs, [0.5, 0.5, 1.0, 1.0])
    chain = d.draft("a", 4)
    assert chain.tokens.tolist() == [9, 6, 1, 2]  # tie: the most recent occurrence
    assert chain.is_chain()


def test_majority_vote_and_min_prob():
    d = NgramDrafter(min_n=1, max_n=1, min_token_prob=0.5)
    d.start("a", [5, 1, 5, 1, 5, 2, 5])
    t = d.draft("a", 1)
    assert t.tokens.tolist() == [1] and t.probs[0] == pytest.approx(2 / 3)
    d2 = NgramDrafter(min_n=1, max_n=1, min_token_prob=0.7)
    d2.start("a", [5, 1, 5, 1, 5, 2, 5])
    assert len(d2.draft("a", 1)) == 0


def test_extend_updates_index_incrementally():
    d = NgramDrafter(min_n=2, max_n=3)
    d.start("a", [4, 5, 6])
    assert len(d.draft("a", 4)) == 0
    d.extend("a", [7, 4, 5])
    assert d.draft("a", 3).tokens.tolist() == [6, 7, 4]
    idx = NgramIndex([1, 2, 1, 2], [2], keep_all=True)
    ref = NgramIndex([1, 2], [2], keep_all=True)
    ref.extend([1, 2])
    assert idx.head == ref.head and idx.prev == ref.prev
    assert idx.longest_match() == (2, [1])
    assert NgramIndex([1, 2, 1, 2], [2], keep_all=False).longest_match() == (2, [1])


def test_vllm_rule_earliest_occurrence_and_k():
    v = VllmNgramDrafter(min_n=2, max_n=4)
    v.start("a", [1, 2, 3, 4, 1, 2, 3, 5, 9, 1, 2, 3])
    assert v.draft("a", 3).tokens.tolist() == [4, 1, 2]  # earliest "1 2 3", k = budget = 3
    v2 = VllmNgramDrafter(min_n=2, max_n=4, num_speculative_tokens=2)
    v2.start("a", [1, 2, 3, 4, 1, 2, 3])
    assert v2.draft("a", 16).tokens.tolist() == [4, 1]
    v3 = VllmNgramDrafter(min_n=3, max_n=4)
    v3.start("a", [8, 2, 3, 9, 2, 3])  # only a bigram matches: under min_n
    assert len(v3.draft("a", 4)) == 0


def test_config_errors():
    with pytest.raises(ConfigError, match="min_n"):
        build_drafter({"name": "ngram", "min_n": 5, "max_n": 2})
    with pytest.raises(ConfigError, match="unknown key"):
        build_drafter({"name": "vllm-ngram", "n": 2})


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 4), min_size=0, max_size=60),
    st.booleans(),
    st.integers(1, 8),
    st.sampled_from(["ngram", "vllm-ngram"]),
)
def test_replay_reconstructs_response(resp, tree, budget, name):
    d = build_drafter(name)
    prompt = resp[: len(resp) // 3] + [0, 1]
    d.start("r", prompt)
    out: list[int] = []
    while len(out) < len(resp):
        t = d.draft("r", budget, tree=tree)
        assert len(t) <= budget and (tree or t.is_chain())
        acc = [int(t.tokens[i]) for i in t.match_length(resp[len(out) :])]
        emit = acc + resp[len(out) + len(acc) : len(out) + len(acc) + 1]
        out.extend(emit)
        d.extend("r", emit)
    d.stop("r")
    assert out == resp


def brute_longest(tokens, lengths):
    last = len(tokens) - 1
    for n in sorted(lengths, reverse=True):
        if last < n:
            continue
        w = tokens[last - n + 1 :]
        ends = [e for e in range(n - 1, last) if tokens[e - n + 1 : e + 1] == w]
        if ends:
            return n, ends
    return None


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=50), st.lists(st.integers(0, 3), max_size=20), st.booleans())
def test_index_matches_brute_force(prompt, more, keep_all):
    idx = NgramIndex(prompt, [1, 2, 3, 5], keep_all=keep_all)
    idx.extend(more)
    want = brute_longest(prompt + more, [1, 2, 3, 5])
    got = idx.longest_match()
    if want is None:
        assert got is None
    elif keep_all:
        assert got == (want[0], want[1][::-1])  # most recent first
    else:
        assert got == (want[0], want[1][:1])  # earliest


def test_numpy_and_loop_builds_agree():
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 6, 3000).tolist()
    for keep_all in (True, False):
        big = NgramIndex(toks, [1, 3, 4], keep_all=keep_all)  # numpy build (>= NUMPY_BUILD_MIN tokens)
        small = NgramIndex(toks[:10], [1, 3, 4], keep_all=keep_all)  # loop build, then extended
        small.extend(toks[10:])
        assert big.head == small.head and big.prev == small.prev
