"""The reference verifier on CUDA (tiny random Llama, float32): lossless greedy and seeded sampling."""

from __future__ import annotations

import pytest
import torch

from core_support import OracleDrafter, RandomDrafter, random_prompts, tiny_llama
from specdec.generation import SpecGenerator

pytestmark = pytest.mark.gpu

MAX_NEW = 24


@pytest.fixture(scope="module")
def setup():
    model = tiny_llama(seed=1).to("cuda")
    prompts = random_prompts(4, seed=3)
    gen = SpecGenerator(model)
    baseline = [gen.generate([p], max_new_tokens=MAX_NEW).tokens[0] for p in prompts]
    return model, prompts, baseline, {tuple(p): b for p, b in zip(prompts, baseline)}


def test_plain_cuda_matches_cpu(setup):
    model, prompts, baseline, _ = setup
    cpu = SpecGenerator(tiny_llama(seed=1)).generate(prompts, max_new_tokens=MAX_NEW).tokens
    assert cpu == baseline


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("kind", ["oracle", "noisy", "random"])
def test_lossless_greedy_on_cuda(setup, kind, tree, batch):
    model, prompts, baseline, truth = setup
    drafter = {
        "oracle": lambda: OracleDrafter(truth),
        "noisy": lambda: OracleDrafter(truth, noise=0.3),
        "random": lambda: RandomDrafter(seed=1),
    }[kind]()
    gen = SpecGenerator(model, drafter, budget=8, tree=tree)
    tokens = []
    for lo in range(0, len(prompts), batch):
        res = gen.generate(prompts[lo : lo + batch], max_new_tokens=MAX_NEW)
        tokens += res.tokens
        assert res.stats.draft_errors == 0
    assert tokens == baseline


def test_seeded_sampling_on_cuda_is_reproducible(setup):
    model, prompts, _, truth = setup
    runs = [
        SpecGenerator(model, OracleDrafter(truth), tree=True, temperature=0.8, top_k=20, seed=5)
        .generate(prompts, max_new_tokens=MAX_NEW)
        .tokens
        for _ in range(2)
    ]
    assert runs[0] == runs[1] and all(len(t) == MAX_NEW for t in runs[0])
    assert torch.cuda.is_available()
