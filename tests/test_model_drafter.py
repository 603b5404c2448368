"""ModelDrafter behaviour on a tiny random Llama (core_support builds it): greedy chains, rollback, trees, batching."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from core_support import SAVED_SPEC, SAVED_VOCAB, save_tiny_llama
from specdec.config import ConfigError
from specdec.drafters import DraftRequest, build_drafter
from specdec.drafters.model import ModelDrafter, ModelDrafterConfig, check_tokenizer_compat

VOCAB = SAVED_VOCAB
DRAFT_SPEC = replace(SAVED_SPEC, max_pos=256, rope_theta=None, rms_norm_eps=1e-5)  # Llama's rope_theta
BACKENDS = ["eager", "torch", "onnx"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny_llama")
    save_tiny_llama(path, seed=0, spec=DRAFT_SPEC)
    return path


@pytest.fixture(scope="module")
def hf(tiny: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32).eval()


def _logits(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1].float()  # [V]


def _greedy(hf: torch.nn.Module, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    ids, toks, probs = list(ids), [], []
    for _ in range(n):
        p = torch.softmax(_logits(hf, ids), -1)
        t = int(p.argmax())
        toks.append(t)
        probs.append(float(p[t]))
        ids.append(t)
    return toks, probs


def _drafter(path: Path, backend: str, **kw: object) -> ModelDrafter:
    return ModelDrafter(ModelDrafterConfig.from_dict({"path": str(path), "backend": backend, **kw}))


def _prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(2, VOCAB, size=n).tolist()


@pytest.mark.parametrize("backend", BACKENDS)
def test_chain_is_greedy_continuation_with_probs(tiny: Path, hf: torch.nn.Module, backend: str) -> None:
    d = _drafter(tiny, backend)
    prompt = _prompt(1, 12)
    d.start("a", prompt)
    tree = d.draft("a", 6)
    want, probs = _greedy(hf, prompt, 6)
    assert tree.is_chain() and tree.tokens.tolist() == want
    np.testing.assert_allclose(tree.probs, probs, rtol=1e-4, atol=1e-5)
    assert tree.expected_accepted() > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_rollback_equals_fresh_draft(tiny: Path, hf: torch.nn.Module, backend: str) -> None:
    d = _drafter(tiny, backend)
    prompt = _prompt(2, 10)
    d.start("a", prompt)
    first = d.draft("a", 5).tokens.tolist()
    # Verifier accepted 2 draft tokens and emitted a different bonus token (rejection at position 3).
    bonus = (first[2] + 1) % VOCAB
    d.extend("a", first[:2] + [bonus])
    again = d.draft("a", 5)
    ctx = prompt + first[:2] + [bonus]
    fresh = _drafter(tiny, backend)
    fresh.start("b", ctx)
    ref = fresh.draft("b", 5)
    assert again.tokens.tolist() == ref.tokens.tolist() == _greedy(hf, ctx, 5)[0]
    np.testing.assert_allclose(again.probs, ref.probs, rtol=1e-4, atol=1e-6)
    # All accepted (+ bonus) and a second rollback round.
    d.extend("a", again.tokens.tolist() + [3])
    ctx = ctx + again.tokens.tolist() + [3]
    assert d.draft("a", 4).tokens.tolist() == _greedy(hf, ctx, 4)[0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_budget_respected_and_empty(tiny: Path, backend: str) -> None:
    d = _drafter(tiny, backend)
    d.start("a", _prompt(3, 8))
    d.start("empty", [])
    for budget in (0, 1, 3, 7):
        for tree in (False, True):
            t, e = d.draft_batch([DraftRequest("a", budget, tree), DraftRequest("empty", budget, tree)])
            assert len(t) == budget and len(e) == 0
            assert tree or t.is_chain()
    d.stop("a")
    d.stop("never-started")  # tolerated
    assert d.active_requests() == ["empty"]
    with pytest.raises(KeyError, match="never started"):
        d.extend("a", [1])
    with pytest.raises(ValueError, match="twice"):
        d.draft_batch([DraftRequest("empty", 2), DraftRequest("empty", 2)])


@pytest.mark.parametrize("backend", BACKENDS)
def test_tree_shape_and_children_are_topk(tiny: Path, hf: torch.nn.Module, backend: str) -> None:
    d = _drafter(tiny, backend, tree_top_k=2, tree_branch_depths=[1, 2])
    prompt = _prompt(4, 9)
    d.start("a", prompt)
    budget = 9
    tree = d.draft("a", budget, tree=True)
    assert len(tree) == budget
    depths = tree.depths.tolist()
    assert depths.count(1) == 2 and depths.count(2) == 4 and depths.count(3) == 3  # 2 + 4 + best 3 of 4
    for parent in [-1] + list(range(len(tree))):
        kids = tree.children(parent)
        if not kids:
            continue
        path = [] if parent == -1 else tree.tokens[tree.path_to(parent)].tolist()
        p = torch.softmax(_logits(hf, prompt + path), -1)
        top = torch.topk(p, len(kids)).indices.tolist()
        assert tree.tokens[kids].tolist() == top, f"children of node {parent}"
        np.testing.assert_allclose(tree.probs[kids], p[top].numpy(), rtol=1e-4, atol=1e-6)
    # After a tree draft the cache is consistent: a chain draft equals the greedy continuation.
    d.extend("a", [int(tree.tokens[0])])
    ctx = prompt + [int(tree.tokens[0])]
    assert d.draft("a", 4).tokens.tolist() == _greedy(hf, ctx, 4)[0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_equals_single(tiny: Path, backend: str) -> None:
    d = _drafter(tiny, backend)
    single = _drafter(tiny, backend)
    prompts = {f"r{i}": _prompt(10 + i, 5 + 7 * i) for i in range(4)}
    for rid, p in prompts.items():
        d.start(rid, p)
        single.start(rid, p)
    reqs = [DraftRequest(rid, 3 + i % 3, tree=i % 2 == 1) for i, rid in enumerate(prompts)]
    for rnd in range(3):
        batch = d.draft_batch(reqs)
        for r, t in zip(reqs, batch):
            s = single.draft(r.request_id, r.budget, tree=r.tree)
            assert t.as_lists() == s.as_lists()
            emitted = t.tokens[:1].tolist() + [rnd + 2]
            d.extend(r.request_id, emitted)
            single.extend(r.request_id, emitted)


def test_context_longer_than_window(tmp_path: Path) -> None:
    save_tiny_llama(tmp_path, seed=5, spec=DRAFT_SPEC, max_pos=32)
    d = _drafter(tmp_path, "eager")
    d.start("a", _prompt(6, 40))
    for _ in range(5):
        t = d.draft("a", 4)
        assert len(t) == 4
        d.extend("a", t.tokens[:2].tolist() + [7])


def _save_tokenizer(path: Path, words: list[str]) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    path.mkdir(parents=True, exist_ok=True)
    Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0])).save(str(path / "tokenizer.json"))


def test_tokenizer_mismatch_refused(tmp_path: Path, tiny: Path) -> None:
    _save_tokenizer(tmp_path / "same1", ["<unk>", "a", "b"])
    _save_tokenizer(tmp_path / "same2", ["<unk>", "a", "b"])
    _save_tokenizer(tmp_path / "other", ["<unk>", "b", "a"])
    check_tokenizer_compat(tmp_path / "same1", tmp_path / "same2")
    with pytest.raises(ConfigError, match="different tokenizers.*'a': draft 1 vs target 2"):
        check_tokenizer_compat(tmp_path / "same1", tmp_path / "other")
    model = tmp_path / "model"
    save_tiny_llama(model, seed=1, spec=DRAFT_SPEC)
    _save_tokenizer(model, ["<unk>", "a", "b"])
    with pytest.raises(ConfigError, match="different tokenizers"):
        _drafter(model, "eager", target_tokenizer=str(tmp_path / "other"))
    assert _drafter(model, "eager", target_tokenizer=str(tmp_path / "same2")).name == "model"


def test_config_errors_and_registry(tiny: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="backend='gpu'"):
        ModelDrafterConfig.from_dict({"backend": "gpu"})
    with pytest.raises(ConfigError, match="tree_branch_depths"):
        ModelDrafterConfig.from_dict({"tree_branch_depths": [0]})
    with pytest.raises(ConfigError, match="not a Hugging Face model folder"):
        _drafter(tmp_path, "eager")
    d = build_drafter("model", {"model": {"path": str(tiny), "backend": "eager"}})
    assert isinstance(d, ModelDrafter) and d.backend.name == "eager"
    json.dumps(d.config.to_dict())


@pytest.mark.parametrize("backend", ["torch"])
def test_draft_after_changes_no_drafts(tiny: Path, hf: torch.nn.Module, backend: str) -> None:
    d = _drafter(tiny, backend)
    prompt = _prompt(8, 11)
    d.start("a", prompt)
    before = d.draft("a", 5, tree=True)
    hedge = d.draft_after("a", [4, 9], 5)
    assert hedge.tokens.tolist() == _greedy(hf, prompt + [4, 9], 5)[0]
    assert d.draft("a", 5, tree=True).as_lists() == before.as_lists()  # context unchanged
    d.extend("a", [4, 9])
    assert d.draft("a", 5).tokens.tolist() == hedge.tokens.tolist()
