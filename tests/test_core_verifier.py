"""Reference verifier internals: tree-masked logits and the rewound KV cache equal plain computation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from core_support import (
    RandomDrafter,
    random_prompts,
    tiny_llama,
)
from specdec.drafters.base import DraftRequest
from specdec.sampling import SamplingParams
from specdec.tree import TokenTree
from specdec.verifiers.reference import ReferenceVerifier

ATOL = 1e-4


@pytest.fixture(scope="module")
def model(one_thread):
    return tiny_llama(seed=2)


def full_logits(model, ids):
    """[len(ids), V] logits of a plain causal forward without cache."""
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0]


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def any_attention(request, one_thread):
    """The tiny model with each attention implementation (the 4D additive mask must work in both)."""
    m = tiny_llama(seed=2)
    m.set_attn_implementation(request.param)
    assert m.config._attn_implementation == request.param
    return m


def test_tree_logits_equal_plain_forward_of_each_path(any_attention):
    model = any_attention
    prompts = random_prompts(3, seed=5)
    tree = TokenTree(np.array([10, 11, 12, 13, 14]), np.array([-1, 0, 0, -1, 1]))
    trees = [tree, TokenTree.chain([7, 8]), TokenTree.empty()]
    verifier = ReferenceVerifier(model)
    verifier.reset(prompts)
    captured = {}
    forward = verifier._forward

    def spy(ids, positions, allowed):
        captured["logits"] = forward(ids, positions, allowed)
        return captured["logits"]

    verifier._forward = spy
    verifier.step(trees)
    for b, (prompt, t) in enumerate(zip(prompts, trees)):
        got = captured["logits"][b]  # [N, V]
        assert torch.allclose(got[0], full_logits(model, prompt)[-1], atol=ATOL)
        for i in range(len(t)):
            path = [int(t.tokens[j]) for j in t.path_to(i)]
            assert torch.allclose(got[i + 1], full_logits(model, prompt + path)[-1], atol=ATOL), (b, i)


def test_rewound_cache_equals_fresh_prefill(model):
    """After steps with random trees, each row's valid cache equals a fresh prefill of its committed text."""
    prompts = random_prompts(4, seed=6)
    verifier = ReferenceVerifier(model)
    verifier.reset(prompts)
    drafter = RandomDrafter(seed=0)
    committed = [list(p) for p in prompts]
    for step in range(6):
        trees = [drafter.draft_one(DraftRequest(f"r{b}", 6, tree=True)) for b in range(len(prompts))]
        if step == 2:  # make one row accept deep paths too
            nxt = int(full_logits(model, committed[0])[-1].argmax())
            trees[0] = TokenTree.chain([nxt, 3, 4])
        for b, outcome in enumerate(verifier.step(trees)):
            committed[b] += outcome.tokens
    for b, seq in enumerate(committed):
        n = int(verifier.cache_len[b])
        assert n == len(seq) - 1 and int(verifier.last[b]) == seq[-1]
        with torch.inference_mode():
            fresh = model(torch.tensor([seq[:-1]]), use_cache=True).past_key_values
        for ours, ref in zip(verifier.cache.layers, fresh.layers):
            assert torch.allclose(ours.keys[b, :, :n], ref.keys[0], atol=ATOL)
            assert torch.allclose(ours.values[b, :, :n], ref.values[0], atol=ATOL)


def test_select_drops_rows_and_keeps_the_rest_consistent(model):
    prompts = random_prompts(4, seed=7)
    verifier = ReferenceVerifier(model)
    verifier.reset(prompts)
    committed = [list(p) for p in prompts]
    for b, o in enumerate(verifier.step([TokenTree.empty()] * 4)):
        committed[b] += o.tokens
    verifier.select([3, 1])
    committed = [committed[3], committed[1]]
    out = verifier.step([TokenTree.empty()] * 2)
    for seq, o in zip(committed, out):
        assert o.tokens == [int(full_logits(model, seq)[-1].argmax())]
    assert verifier.batch_size == 2


def test_greedy_outcome_fields(model):
    prompt = random_prompts(1, seed=8)[0]
    nxt = int(full_logits(model, prompt)[-1].argmax())
    nxt2 = int(full_logits(model, prompt + [nxt])[-1].argmax())
    wrong = (nxt2 + 1) % 96
    verifier = ReferenceVerifier(model)
    verifier.reset([prompt])
    tree = TokenTree(np.array([nxt, wrong, nxt2]), np.array([-1, 0, -1]))  # n0 accepted, n1 rejected
    (o,) = verifier.step([tree])
    assert o.accepted == [0] and o.tokens == [nxt, nxt2] and o.drafted == 3 and o.num_accepted == 1


def test_sampling_verifier_is_reproducible_with_seed(model):
    prompts = random_prompts(2, seed=9)
    params = SamplingParams(temperature=1.0)
    runs = []
    for _ in range(2):
        v = ReferenceVerifier(model, sampling=params, seed=123)
        v.reset(prompts)
        runs.append([o.tokens for _ in range(4) for o in v.step([TokenTree.chain([5, 6])] * 2)])
    assert runs[0] == runs[1]


def test_bad_prompts_are_rejected(model):
    v = ReferenceVerifier(model)
    with pytest.raises(ValueError, match=r"prompts\[0\] has token ids \[500\]"):
        v.reset([[500]])
    v.reset([[3]])
    with pytest.raises(ValueError, match="one per row"):
        v.step([TokenTree.empty()] * 2)
