"""Suffix drafter: hand-checked token arrays on both backends, reference == native, replay property."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.config import ConfigError
from specdec.drafters import build_drafter
from specdec.drafters.base import DraftRequest
from specdec.drafters.suffix import SuffixDrafter, native_available
from specdec.drafters.suffix_ref import RefEngine

BACKENDS = ["python"] + (["native"] if native_available() else [])


def make(backend: str, **kw) -> SuffixDrafter:
    return SuffixDrafter(backend=backend, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_match_gives_empty_draft(backend):
    d = make(backend)
    d.start("a", [1, 2, 3, 4])
    assert len(d.draft("a", 8)) == 0
    assert len(d.draft("unknown", 8)) == 0  # unknown ids: nothing to propose


@pytest.mark.parametrize("backend", BACKENDS)
def test_longest_match_preferred(backend):
    # "2 3" is followed by 10 twice and by 20 once; the longer context "4 2 3" only by 20 21 22.
    prompt = [1, 2, 3, 10, 1, 2, 3, 10, 4, 2, 3, 20, 21, 22, 4, 2, 3]
    d = make(backend, max_spec_factor=1.0)
    d.start("a", prompt)
    tree = d.draft("a", 4)
    assert tree.tokens.tolist() == [20, 21, 22]  # match length 3 caps the draft at 3 tokens (factor 1)
    assert tree.is_chain()
    np.testing.assert_allclose(tree.probs, [1.0, 1.0, 1.0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_tree_branching_and_chain_tie_break(backend):
    prompt = [1, 2, 3, 1, 2, 4, 1, 2]  # "1 2" continues with 3 once and 4 once
    d = make(backend, max_spec_factor=2.0)
    d.start("a", prompt)
    tree = d.draft("a", 2, tree=True)
    assert sorted(tree.tokens.tolist()) == [3, 4]
    assert tree.parents.tolist() == [-1, -1]
    np.testing.assert_allclose(tree.probs, [0.5, 0.5])
    assert tree.expected_accepted() == pytest.approx(1.0)
    chain = d.draft("a", 3)
    assert chain.is_chain()
    assert chain.tokens.tolist() == [4, 1, 2]  # equal counts: the most recent continuation wins
    np.testing.assert_allclose(chain.probs, [0.5, 1.0, 1.0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_leaf_prior_fades_single_occurrence_continuations(backend):
    # "7 8" occurs once before the end, followed by 1 2 3 4 5: match length m = 2, every continuation seen once.
    prompt = [7, 8, 1, 2, 3, 4, 5, 9, 7, 8]
    plain = make(backend, max_spec_factor=8.0, min_token_prob=0.0)
    plain.start("a", prompt)
    np.testing.assert_allclose(plain.draft("a", 4).probs, [1.0] * 4)  # count / total: certain
    d = make(backend, max_spec_factor=8.0, min_token_prob=0.0, leaf_prior=1.0)
    d.start("a", prompt)
    chain = d.draft("a", 4)
    assert chain.tokens.tolist() == [1, 2, 3, 4]
    np.testing.assert_allclose(chain.probs, [3 / 4, 4 / 5, 5 / 6, 6 / 7])  # (l + 1) / (l + 2), l = 2, 3, 4, 5
    assert chain.expected_accepted() == pytest.approx(3 / 4 + 3 / 5 + 3 / 6 + 3 / 7)  # path = (m + 1) / (m + n + 1)
    tree = d.draft("a", 4, tree=True)
    np.testing.assert_allclose(tree.probs, chain.probs)
    cut = make(backend, max_spec_factor=8.0, min_token_prob=0.55, leaf_prior=1.0)
    cut.start("a", prompt)
    assert cut.draft("a", 8).tokens.tolist() == [1, 2]  # paths 0.75, 0.6, then 0.5 < 0.55
    # seen twice: count / total as before, the prior does not apply
    twice = make(backend, min_token_prob=0.0, leaf_prior=1.0)
    twice.start("a", [7, 8, 1, 2, 7, 8, 1, 2, 9, 7, 8])
    np.testing.assert_allclose(twice.draft("a", 2).probs, [1.0, 1.0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_min_token_prob_stops_paths(backend):
    prompt = [1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2, 6, 1, 2]  # four continuations, 0.25 each
    d = make(backend, min_token_prob=0.3)
    d.start("a", prompt)
    assert len(d.draft("a", 8)) == 0
    d2 = make(backend, min_token_prob=0.2)
    d2.start("a", prompt)
    assert d2.draft("a", 8).tokens.tolist()[:1] == [6]


@pytest.mark.parametrize("backend", BACKENDS)
def test_global_tree_drafts_from_past_responses(backend):
    d = make(backend)
    d.start("a", [50, 51])
    d.extend("a", [7, 8, 9, 10, 11])
    d.stop("a")
    d.start("b", [60, 7, 8])
    tree = d.draft("b", 3)
    assert tree.tokens.tolist() == [9, 10, 11]
    assert d.last_sources == ["global"]
    d.stop("b")
    d.stop("b")  # unknown ids are tolerated


@pytest.mark.parametrize("backend", BACKENDS)
def test_eviction_bounds_global_tree(backend):
    d = make(backend, max_cached_requests=2)
    for i in range(6):
        d.start(f"r{i}", [99])
        d.extend(f"r{i}", [100 + 10 * i + k for k in range(5)])
        d.stop(f"r{i}")
    stats = d.global_stats()
    assert stats["cached_requests"] == 2 and stats["cached_tokens"] == 10
    d.start("q", [100, 101])  # r0's response was evicted: no draft from it
    assert len(d.draft("q", 4)) == 0
    d.start("q2", [150, 151])  # r5's response is still cached
    assert d.draft("q2", 3).tokens.tolist() == [152, 153, 154]
    # token bound: a 4-token cap keeps only the newest response
    e = make(backend, max_cached_tokens=6)
    for i in range(3):
        e.start(f"r{i}", [1])
        e.extend(f"r{i}", [200 + 10 * i + k for k in range(4)])
        e.stop(f"r{i}")
    assert e.global_stats()["cached_requests"] == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_eviction_frees_all_nodes(backend):
    d = make(backend, max_cached_requests=1, max_depth=8)
    counts = []
    for i in range(6):
        d.start(f"b{i}", [1])
        d.extend(f"b{i}", [3, 4, 3, 4, 3, 5])
        d.stop(f"b{i}")
        counts.append(d.global_stats()["nodes"])
    # The same response cached once at a time: the tree stops changing (nothing leaks). The native core
    # may keep nodes explicit after an eviction (count 1) instead of folding them back into a leaf.
    assert len(set(counts[1:])) == 1
    if backend == "python":
        assert counts[0] == counts[1]
    e = make(backend, max_cached_tokens=3, max_depth=8)  # every response is over the token bound
    e.start("x", [1])
    e.extend("x", [3, 4, 3, 4, 3, 5])
    e.stop("x")
    assert e.global_stats()["nodes"] == 1 and e.global_stats()["cached_requests"] == 0  # only the root
    assert d.memory_bytes() > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_budget_and_chain_respected(backend):
    rng = random.Random(1)
    d = make(backend)
    d.start("a", [rng.randrange(4) for _ in range(300)])
    for budget in (1, 2, 5, 16):
        for tree in (False, True):
            t = d.draft("a", budget, tree=tree)
            assert len(t) <= budget
            assert tree or t.is_chain()
            assert t.probs is not None or len(t) == 0
    assert [len(t) for t in d.draft_batch([DraftRequest("a", 0), DraftRequest("zz", 4)])] == [0, 0]


def test_config_errors_and_registry():
    with pytest.raises(ConfigError, match="max_depth"):
        build_drafter({"name": "suffix", "max_depth": 1})
    with pytest.raises(ConfigError, match="unknown key"):
        build_drafter({"name": "suffix", "depth": 3})
    d = build_drafter({"name": "suffix", "max_depth": 16, "backend": "python"})
    assert isinstance(d, SuffixDrafter) and d.backend == "python"


def run_twin_engines(a, b, rng, *, ops: int, p_start: float, p_stop: float, prompt, draft_args, tokens) -> None:
    """Random start / stop / draft-then-extend operations on the native engine ``a`` and the reference ``b``:
    every draft must be the same (tokens, parents, match length, source; probabilities and score to rounding)."""
    active: list[int] = []
    for op in range(ops):
        r = rng.random()
        if r < p_start or not active:
            ids = prompt()
            a.start(op, ids)
            b.start(op, ids)
            active.append(op)
        elif r < p_stop:
            rid = active.pop(rng.randrange(len(active)))
            a.stop(rid)
            b.stop(rid)
        else:
            rid = rng.choice(active)
            args = (rid, *draft_args())
            da, db = a.draft(*args), b.draft(*args)
            assert (da[0], da[1], da[4], da[5]) == (db[0], db[1], db[4], db[5])
            np.testing.assert_allclose(da[2], db[2], rtol=0, atol=1e-12)
            assert da[3] == pytest.approx(db[3], abs=1e-9)
            toks = tokens()
            a.extend(rid, toks)
            b.extend(rid, toks)


@pytest.mark.skipif(not native_available(), reason="native core not built")
def test_reference_equals_native_random():
    from specdec.drafters._suffix_native import Engine

    rng = random.Random(7)
    for _ in range(150):
        depth, vocab = rng.choice([2, 3, 5, 8]), rng.choice([2, 3, 5])
        limits = (rng.choice([1, 2, 50]), rng.choice([6, 30, 1000]))
        run_twin_engines(
            Engine(depth, *limits),
            RefEngine(depth, *limits),
            rng,
            ops=40,
            p_start=0.2,
            p_stop=0.35,
            prompt=lambda vocab=vocab: [rng.randrange(vocab) for _ in range(rng.randint(0, 20))],
            draft_args=lambda: (
                rng.choice([1, 3, 8]),
                rng.random() < 0.5,
                rng.choice([0.5, 1.0, 3.0]),
                rng.choice([0.0, 1.0]),
                rng.choice([0.0, 0.1, 0.4]),
                rng.random() < 0.8,
                rng.random() < 0.8,
                rng.choice([0.0, 0.0, 0.5, 2.0]),
                rng.random() < 0.5,  # calibrated
            ),
            tokens=lambda vocab=vocab: [rng.randrange(vocab) for _ in range(rng.randint(1, 4))],
        )


@pytest.mark.skipif(not native_available(), reason="native core not built")
def test_reference_equals_native_while_tables_grow_and_evict():
    """Large tries: the native edge map grows incrementally (old and new tables live side by side for a while)
    and node pages are added, while evictions erase edges; drafts must still equal the reference's."""
    from specdec.drafters._suffix_native import Engine

    rng = random.Random(11)
    for limits in ((3, 100_000), (50, 900)):
        a = Engine(8, *limits)
        phrases = [[rng.randrange(40) for _ in range(rng.randint(2, 7))] for _ in range(12)]
        run_twin_engines(
            a,
            RefEngine(8, *limits),
            rng,
            ops=400,
            p_start=0.15,
            p_stop=0.3,
            prompt=lambda phrases=phrases: [t for _ in range(rng.randint(5, 60)) for t in rng.choice(phrases)],
            draft_args=lambda: (8, False, 1.0, 0.0, 0.0, True, True, 0.0, rng.random() < 0.5),
            tokens=lambda phrases=phrases: rng.choice(phrases) if rng.random() < 0.8 else [rng.randrange(40, 60)],
        )
        assert a.memory_bytes() > 100_000  # large enough that both tables grew many times


def replay_tokens(drafter, prompt, response, *, budget, tree, rid="r"):
    """The replay loop: draft, accept the longest matching path, emit accepted + bonus, extend."""
    drafter.start(rid, prompt)
    out: list[int] = []
    while len(out) < len(response):
        t = drafter.draft(rid, budget, tree=tree)
        assert len(t) <= budget and (tree or t.is_chain())
        acc = [int(t.tokens[i]) for i in t.match_length(response[len(out) :])]
        emit = acc + response[len(out) + len(acc) : len(out) + len(acc) + 1]
        out.extend(emit)
        drafter.extend(rid, emit)
    drafter.stop(rid)
    return out


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 5), min_size=0, max_size=40), min_size=1, max_size=4),
    st.sampled_from(BACKENDS),
    st.booleans(),
    st.integers(1, 8),
)
def test_replay_reconstructs_response(traces, backend, tree, budget):
    d = make(backend, max_depth=8, max_cached_requests=2)
    for i, resp in enumerate(traces):
        prompt = resp[: len(resp) // 2] + [1, 2]
        assert replay_tokens(d, prompt, resp, budget=budget, tree=tree, rid=f"r{i}") == resp


@pytest.mark.parametrize("backend", BACKENDS)
def test_draft_chains_equal_the_best_path_of_chain_trees(backend):
    """The proposer's fast path (plain lists, no trees) gives the same tokens and path probabilities."""
    from specdec.tree import best_chain

    rng = random.Random(3)
    d = SuffixDrafter(backend=backend)
    for i in range(6):
        ctx = [rng.randrange(6) for _ in range(120)]
        d.start(f"r{i}", ctx[:60])
        d.extend(f"r{i}", ctx[60:])
    reqs = [DraftRequest(f"r{i}", b) for i, b in zip(range(6), (1, 4, 8, 16, 0, 32))] + [DraftRequest("gone", 8)]
    fast = d.draft_chains(reqs)
    slow = [best_chain(t) for t in d.draft_batch(reqs)]
    assert [f[0] for f in fast] == [s[0] for s in slow]
    for (_, fp), (_, sp) in zip(fast, slow):
        assert (fp is None) == (sp is None)
        if fp and sp:
            assert fp == pytest.approx(sp, rel=1e-5)
    assert any(len(f[0]) for f in fast)


@pytest.mark.parametrize("backend", BACKENDS)
def test_free_requests_draft_with_free_spec_factor(backend):
    from specdec.drafters.base import DraftRequest

    prompt = [7, 8, 1, 2, 3, 4, 5, 9, 7, 8]  # match "7 8" (m = 2), then 1 2 3 4 5 9 7 8
    d = make(backend, max_spec_factor=1.0, free_spec_factor=3.0, min_token_prob=0.0)
    d.start("a", prompt)
    dear, free = d.draft_batch([DraftRequest("a", 8), DraftRequest("a", 8, free=True)])
    assert dear.tokens.tolist() == [1, 2]  # <= m x 1
    assert free.tokens.tolist() == [1, 2, 3, 4, 5, 9]  # <= m x 3: the verifier checks 8 slots anyway
    chains = d.draft_chains([DraftRequest("a", 8, free=True), DraftRequest("a", 8)])
    assert [c[0] for c in chains] == [[1, 2, 3, 4, 5, 9], [1, 2]]
    same = make(backend, max_spec_factor=1.0, min_token_prob=0.0)  # free_spec_factor -1: max_spec_factor
    same.start("a", prompt)
    assert same.draft_batch([DraftRequest("a", 8, free=True)])[0].tokens.tolist() == [1, 2]
