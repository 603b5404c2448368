"""Lossless sampling: emitted tokens follow the target distribution (chi-square, fixed seeds).

The same check must reject deliberately broken samplers (always accept the draft; resample from the
full target instead of the residual).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import numpy as np
import pytest
import torch

from core_support import (
    EmptyDrafter,
    tiny_llama,
)
from specdec.drafters.base import DraftRequest
from specdec.generation import SpecGenerator
from specdec.sampling import SamplingParams, accept, accept_sampled, target_probs
from specdec.tree import ROOT, TokenTree

V = 8  # vocabulary of the forced-distribution tests
TRIALS = 12_000
P_MIN = 1e-3  # a correct sampler passes every chi-square test at this level (fixed seeds: deterministic)
MIN_CONDITIONAL = 300  # test the second token's distribution only given first tokens seen this often

pytestmark = pytest.mark.usefixtures("one_thread")

Sampler = Callable[[TokenTree, torch.Tensor, torch.Generator], tuple[list[int], int]]


def chi_square_p(observed: Counter, probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square test of ``observed`` counts against ``probs`` [V]."""
    total = sum(observed.values())
    if any(probs[t] <= 0 for t in observed):
        return 0.0  # a token the target never emits
    support = [t for t in range(probs.numel()) if probs[t] > 0]
    stat = sum((observed.get(t, 0) - total * float(probs[t])) ** 2 / (total * float(probs[t])) for t in support)
    dof = len(support) - 1
    if dof == 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(stat / 2.0)))


def forced_probs(n_nodes: int, seed: int) -> torch.Tensor:
    """[n + 1, V] target distributions: random, with a zero-probability token (V - 1) everywhere."""
    rs = np.random.RandomState(seed)
    p = rs.dirichlet(np.full(V, 0.8), size=n_nodes + 1)
    p[:, V - 1] = 0.0
    p[0, :4] = [0.3, 0.25, 0.15, 0.1]  # root: drafted tokens with large mass
    p[0, 4:] = p[0, 4:] / p[0, 4:].sum() * 0.2
    p[0, V - 1] = 0.0
    return torch.tensor(p / p.sum(1, keepdims=True), dtype=torch.float64)


def node_of(tree: TokenTree, parent: int, token: int) -> int | None:
    return next((c for c in tree.children(parent) if int(tree.tokens[c]) == token), None)


def min_p_value(sampler: Sampler, tree: TokenTree, probs: torch.Tensor, seed: int = 0) -> float:
    """Smallest p-value over: the first emitted token vs the root distribution, and the second emitted
    token given each frequent accepted first token vs that node's distribution."""
    gen = torch.Generator().manual_seed(seed)
    first: Counter = Counter()
    second: dict[int, Counter] = {}
    for _ in range(TRIALS):
        nodes, token = sampler(tree, probs, gen)
        emitted = [int(tree.tokens[i]) for i in nodes] + [token]
        first[emitted[0]] += 1
        if len(emitted) > 1:
            second.setdefault(emitted[0], Counter())[emitted[1]] += 1
    pvals = [chi_square_p(first, probs[0])]
    for tok, counts in second.items():
        node = node_of(tree, ROOT, tok)
        if sum(counts.values()) >= MIN_CONDITIONAL and node is not None:
            pvals.append(chi_square_p(counts, probs[node + 1]))
    return min(pvals)


def always_accept(tree: TokenTree, probs: torch.Tensor, gen: torch.Generator) -> tuple[list[int], int]:
    """Broken: accepts the first child at every node, samples the bonus from the target at the leaf."""
    nodes, cur = [], ROOT
    while tree.children(cur):
        cur = tree.children(cur)[0]
        nodes.append(cur)
    return nodes, int(torch.multinomial(probs[cur + 1], 1, generator=gen))


def no_residual(tree: TokenTree, probs: torch.Tensor, gen: torch.Generator) -> tuple[list[int], int]:
    """Broken: after rejections, resamples from the full target instead of the residual."""
    nodes, cur = [], ROOT
    while True:
        p = probs[cur + 1]
        nxt = next(
            (
                c
                for c in tree.children(cur)
                if float(torch.rand((), generator=gen, dtype=torch.float64)) < float(p[int(tree.tokens[c])])
            ),
            None,
        )
        if nxt is None:
            return nodes, int(torch.multinomial(p, 1, generator=gen))
        nodes.append(nxt)
        cur = nxt


CHAIN = TokenTree.chain([1, 0, 2])
# root ─ 1 ─ 0 ─ 5        tokens 7 have zero target probability
#      │   └ 3
#      ├ 7 (zero prob)
#      └ 0 ─ 2
TREE = TokenTree(np.array([1, 0, 5, 3, 7, 0, 2]), np.array([-1, 0, 1, 0, -1, -1, 5]))
CASES = {
    "chain": CHAIN,
    "chain-probs": TokenTree.chain([1, 0, 2], [0.9, 0.8, 0.1]),
    "tree": TREE,
    "tree-probs": TokenTree(TREE.tokens, TREE.parents, np.array([0.6, 0.5, 0.4, 0.2, 0.3, 0.1, 0.9])),
    "empty": TokenTree.empty(),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sampler_preserves_target_distribution(case):
    tree = CASES[case]
    probs = forced_probs(len(tree), seed=len(case))
    assert min_p_value(accept_sampled, tree, probs) > P_MIN


@pytest.mark.parametrize("broken", [always_accept, no_residual])
@pytest.mark.parametrize("case", ["chain", "tree"])
def test_same_check_fails_for_broken_samplers(broken, case):
    tree = CASES[case]
    probs = forced_probs(len(tree), seed=len(case))
    assert min_p_value(broken, tree, probs) < 1e-6


def test_zero_probability_draft_is_never_accepted():
    probs = forced_probs(len(TREE), seed=1)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2000):
        nodes, token = accept_sampled(TREE, probs, gen)
        assert 4 not in nodes and token != V - 1


def test_target_probs_shaping():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    assert torch.allclose(
        target_probs(logits, SamplingParams(1.0)), torch.tensor([[0.4, 0.3, 0.2, 0.1]], dtype=torch.float64)
    )
    assert torch.allclose(
        target_probs(logits, SamplingParams(1.0, top_k=2))[0], torch.tensor([4 / 7, 3 / 7, 0, 0], dtype=torch.float64)
    )
    assert torch.allclose(
        target_probs(logits, SamplingParams(1.0, top_p=0.5))[0], torch.tensor([4 / 7, 3 / 7, 0, 0], dtype=torch.float64)
    )
    assert torch.allclose(
        target_probs(logits, SamplingParams(1.0, top_p=0.75))[0],
        torch.tensor([4 / 9, 3 / 9, 2 / 9, 0], dtype=torch.float64),
    )
    hot = target_probs(logits, SamplingParams(2.0))[0]
    expected = torch.sqrt(torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64))
    assert torch.allclose(hot, expected / expected.sum())
    assert target_probs(logits, SamplingParams(0.0))[0].tolist() == [1.0, 0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="top_p=1.5"):
        SamplingParams(1.0, top_p=1.5)


def test_shaped_sampling_preserves_shaped_distribution():
    """Temperature + top-k + top-p applied to logits, then lossless acceptance of a tree."""
    params = SamplingParams(temperature=0.7, top_k=6, top_p=0.9)
    logits = torch.randn(len(TREE) + 1, V, generator=torch.Generator().manual_seed(4)) * 1.5
    shaped = target_probs(logits, params)
    assert min_p_value(lambda t, _p, g: accept(t, logits, params, g), TREE, shaped) > P_MIN


def test_generator_sampling_matches_model_distribution():
    """End to end through SpecGenerator: 1500 copies of a prompt, trees of the model's likely tokens."""
    model = tiny_llama(seed=3, vocab=16, init_range=0.15)
    prompt = [3, 9, 4]
    with torch.inference_mode():
        p1 = torch.softmax(model(torch.tensor([prompt])).logits[0, -1].double(), -1)
        top = torch.topk(p1, 3).indices.tolist()
        mode = top[0]
        p2 = torch.softmax(model(torch.tensor([prompt + [mode]])).logits[0, -1].double(), -1)

    class Likely(EmptyDrafter):
        def draft_one(self, request: DraftRequest) -> TokenTree:
            k = int(request.request_id.split("-")[1]) % 3  # rows get a tree, a chain or nothing
            if len(self.ctx[request.request_id]) > len(prompt) or k == 2:
                return TokenTree.empty()
            if k == 0:
                return TokenTree(np.array([top[1], top[0], 5, 6]), np.array([-1, -1, 1, 1]))
            return TokenTree.chain([top[0], int(p2.argmax())])

    gen = SpecGenerator(model, Likely(), budget=4, tree=True, temperature=1.0, seed=11)
    out = gen.generate([prompt] * 1500, max_new_tokens=2).tokens
    assert chi_square_p(Counter(t[0] for t in out), p1) > P_MIN
    assert chi_square_p(Counter(t[1] for t in out if t[0] == mode), p2) > P_MIN
    plain = SpecGenerator(model, None, temperature=1.0, seed=11).generate([prompt] * 1500, max_new_tokens=1).tokens
    assert chi_square_p(Counter(t[0] for t in plain), p1) > P_MIN
