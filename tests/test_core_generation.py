"""Lossless greedy generation on tiny random Llama targets: every drafter gives plain greedy's tokens."""

from __future__ import annotations

import logging

import pytest

from core_support import (
    EmptyDrafter,
    OracleDrafter,
    OverBudgetDrafter,
    RaisingDrafter,
    RandomDrafter,
    random_prompts,
    tiny_llama,
)
from specdec.generation import SpecGenerator, generate

MAX_NEW = 24
BUDGET = 8


@pytest.fixture(scope="module")
def model(one_thread):
    return tiny_llama(seed=1)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(4, seed=3)


@pytest.fixture(scope="module")
def baseline(model, prompts):
    """Plain greedy (drafter=None), one prompt at a time."""
    gen = SpecGenerator(model)
    return [gen.generate([p], max_new_tokens=MAX_NEW).tokens[0] for p in prompts]


@pytest.fixture(scope="module")
def truth(prompts, baseline):
    return {tuple(p): out for p, out in zip(prompts, baseline)}


def run(model, drafter, prompts, *, batch, tree, budget=BUDGET, max_new=MAX_NEW, **kw):
    gen = SpecGenerator(model, drafter, budget=budget, tree=tree, **kw)
    tokens, stats = [], []
    for k in range(0, len(prompts), batch):
        res = gen.generate(prompts[k : k + batch], max_new_tokens=max_new)
        tokens += res.tokens
        stats.append(res.stats)
    return tokens, stats


def test_plain_decoding_matches_hf_generate(model, prompts, baseline):
    import torch

    for p, ours in zip(prompts, baseline):
        out = model.generate(
            torch.tensor([p]),
            max_new_tokens=MAX_NEW,
            min_new_tokens=MAX_NEW,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=1,
        )
        assert ours == out[0, len(p) :].tolist()


def test_plain_batch_equals_single(model, prompts, baseline):
    tokens, stats = run(model, None, prompts, batch=4, tree=False)
    assert tokens == baseline
    assert stats[0].mat == 1.0 and stats[0].steps == 4 * MAX_NEW
    assert all(len(t) == MAX_NEW for t in tokens)


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("tree", [False, True])
def test_oracle_is_lossless_with_high_mat(model, prompts, baseline, truth, batch, tree):
    drafter = OracleDrafter(truth)
    tokens, stats = run(model, drafter, prompts, batch=batch, tree=tree)
    assert tokens == baseline
    mat = sum(s.emitted_tokens for s in stats) / sum(s.steps for s in stats)
    # chain: budget 8 -> up to 9 tokens per step; tree: 2 true tokens per 6 nodes -> up to 3
    assert mat > (5.0 if not tree else 2.0)
    assert all(s.accepted_tokens > 0 and s.draft_errors == 0 for s in stats)


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("tree", [False, True])
def test_noisy_oracle_is_lossless(model, prompts, baseline, truth, batch, tree):
    """Partial acceptance that differs across rows exercises the per-row cache rewind."""
    tokens, stats = run(model, OracleDrafter(truth, noise=0.3, seed=batch), prompts, batch=batch, tree=tree)
    assert tokens == baseline
    mat = sum(s.emitted_tokens for s in stats) / sum(s.steps for s in stats)
    assert mat > 1.0


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("tree", [False, True])
def test_random_drafter_is_lossless(model, prompts, baseline, batch, tree):
    tokens, stats = run(model, RandomDrafter(seed=batch, with_probs=tree), prompts, batch=batch, tree=tree)
    assert tokens == baseline
    assert sum(s.drafted_tokens for s in stats) > 0


@pytest.mark.parametrize("batch", [1, 4])
def test_empty_drafter(model, prompts, baseline, batch):
    tokens, stats = run(model, EmptyDrafter(), prompts, batch=batch, tree=True)
    assert tokens == baseline
    assert all(s.drafted_tokens == 0 and s.mat == 1.0 for s in stats)


@pytest.mark.parametrize("batch", [1, 4])
def test_raising_drafter_degrades_to_no_draft(model, prompts, baseline, truth, batch, caplog):
    caplog.set_level(logging.WARNING, logger="specdec.drafters")
    tokens, stats = run(model, RaisingDrafter(truth), prompts, batch=batch, tree=False)
    assert tokens == baseline
    assert all(s.draft_errors > 0 for s in stats)
    assert sum(s.accepted_tokens for s in stats) > 0  # the steps between failures still drafted
    per_call = [r for r in caplog.records if "boom" in r.getMessage()]
    assert len(per_call) == len(stats)  # logged once per generate call, not per failure
    assert "gen1-0" in per_call[0].getMessage()  # names the request id


def test_raising_drafter_strict_raises(model, prompts, truth):
    with pytest.raises(RuntimeError, match="boom"):
        run(model, RaisingDrafter(truth, fail_every=1), prompts, batch=4, tree=False, strict=True)


def test_budget_is_enforced(model, prompts, baseline, truth):
    drafter = OverBudgetDrafter(truth)
    budget = 3
    tokens, stats = run(model, drafter, prompts, batch=4, tree=False, budget=budget)
    assert tokens == baseline
    s = stats[0]
    assert s.drafted_tokens <= budget * s.steps
    assert len(s.per_position_drafted) == budget  # nothing deeper than the budget reached the verifier
    assert s.mat > 2.0


def test_request_budget_shrinks_near_max_new_tokens(model, prompts, truth):
    drafter = OracleDrafter(truth)
    run(model, drafter, prompts, batch=4, tree=False, budget=8, max_new=5)
    assert drafter.sizes and all(b <= 4 for b, _ in drafter.sizes)


@pytest.mark.parametrize("max_new", [1, 5, 13])
def test_never_emits_past_max_new_tokens(model, prompts, baseline, truth, max_new):
    tokens, _ = run(model, OracleDrafter(truth), prompts, batch=4, tree=False, max_new=max_new)
    assert tokens == [b[:max_new] for b in baseline]


def test_stops_at_eos(model, prompts, baseline, truth):
    eos = baseline[0][6]
    gen = SpecGenerator(model, OracleDrafter(truth), budget=BUDGET)
    res = gen.generate(prompts, max_new_tokens=MAX_NEW, eos_token_id=eos)
    for out, ref in zip(res.tokens, baseline):
        expected = ref[: ref.index(eos) + 1] if eos in ref else ref
        assert out == expected
    assert res.stats.emitted_tokens == sum(len(t) for t in res.tokens)


def test_drafter_lifecycle(model, prompts, baseline, truth):
    drafter = OracleDrafter(truth, noise=0.3)
    gen = SpecGenerator(model, drafter, budget=BUDGET)
    res = gen.generate(prompts, max_new_tokens=MAX_NEW)
    rids = [f"gen1-{i}" for i in range(len(prompts))]
    assert [c for c in drafter.calls if c[0] == "start"] == [("start", r) for r in rids]
    assert sorted(c for c in drafter.calls if c[0] == "stop") == sorted(("stop", r) for r in rids)
    for rid, out in zip(rids, res.tokens):
        assert drafter.extended[rid] == out  # extend() received exactly the emitted tokens
    assert drafter.active_requests() == []
    assert res.stats.draft_seconds > 0 and res.stats.verify_seconds > 0
    assert res.stats.wall_seconds >= res.stats.verify_seconds


def test_stats_are_consistent(model, prompts, truth):
    _, stats = run(model, OracleDrafter(truth, noise=0.3), prompts, batch=4, tree=True)
    s = stats[0]
    assert s.emitted_tokens == 4 * MAX_NEW
    assert s.accepted_tokens == s.per_position_accepted[0] + sum(s.per_position_accepted[1:])
    assert s.per_position_accepted == sorted(s.per_position_accepted, reverse=True)
    assert all(a <= d for a, d in zip(s.per_position_accepted, s.per_position_drafted))
    assert 0 < s.acceptance_rate < 1 and s.mat == s.emitted_tokens / s.steps
    d = s.as_dict()
    assert d["mat"] == s.mat and d["draft_errors"] == 0


def test_out_of_vocab_draft_is_absorbed(model, prompts, baseline):
    class Bad(EmptyDrafter):
        name = "bad"

        def draft_one(self, request):
            from specdec.tree import TokenTree

            return TokenTree.chain([10_000])

    tokens, stats = run(model, Bad(), prompts, batch=4, tree=False)
    assert tokens == baseline and stats[0].draft_errors > 0


def test_generate_function_with_drafter_and_token_prompts(model, prompts, baseline, truth):
    res = generate(
        model, prompts, drafter=OracleDrafter(truth), max_new_tokens=MAX_NEW, eos_token_id=None, budget=4, tree=True
    )
    assert res.tokens == baseline and res.texts is None


def test_generate_rejects_bad_input(model):
    from specdec.config import ConfigError

    with pytest.raises(ConfigError, match="budgett"):
        generate(model, [[1, 2]], budgett=3)
    with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
        SpecGenerator(model).generate([[1], []], max_new_tokens=2)
    with pytest.raises(ValueError, match="tokenizer"):
        generate(model, ["text"], max_new_tokens=2)
