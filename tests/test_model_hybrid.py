"""The hybrid ["suffix", "model"]: model drafts carry probabilities, so composition by score can use them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from core_support import LlamaSpec, save_tiny_llama
from specdec.config import load_yaml
from specdec.drafters import DraftRequest, build_drafter
from specdec.drafters.model import ModelDrafterConfig

VOCAB = 61


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = LlamaSpec(vocab=VOCAB, hidden=32, layers=1, heads=2, kv_heads=1, max_pos=256, tied=True)
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama_h"), seed=11, spec=spec)


def test_preset_is_valid() -> None:
    cfg = ModelDrafterConfig.from_dict(load_yaml("model"))
    assert cfg.backend == "auto" and cfg.tree_top_k >= 1


def test_hybrid_uses_model_when_suffix_has_nothing(tiny: Path) -> None:
    opts = {"model": {"path": str(tiny), "backend": "torch"}}
    hybrid = build_drafter(["suffix", "model"], opts)
    alone = build_drafter("model", opts)
    prompt = np.random.default_rng(0).permutation(VOCAB)[:40].tolist()  # no repeats: nothing for suffix
    for d in (hybrid, alone):
        d.start("a", prompt)
    for tree in (False, True):
        got = hybrid.draft_batch([DraftRequest("a", 5, tree)])[0]
        want = alone.draft_batch([DraftRequest("a", 5, tree)])[0]
        assert got.as_lists() == want.as_lists() and got.probs is not None and got.expected_accepted() > 0


def test_hybrid_prefers_confident_suffix_draft(tiny: Path) -> None:
    hybrid = build_drafter(["suffix", "model"], {"model": {"path": str(tiny), "backend": "torch"}})
    motif = [3, 14, 15, 9, 26, 5, 35, 8, 9, 7]
    hybrid.start("a", motif * 6 + motif[:3])  # the continuation is certain from the repeats
    got = hybrid.draft("a", 6)
    assert got.tokens.tolist() == (motif[3:] + motif)[:6]
    hybrid.extend("a", got.tokens[:2].tolist() + [1])  # rejection: both parts roll back
    assert len(hybrid.draft("a", 4)) <= 4
