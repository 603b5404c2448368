"""Lossless on the shared pair: code-target-53m (fp32, CPU) with real drafters == plain greedy.

CI checks 5 HumanEval prompts; ``SPECDEC_LOSSLESS_PROMPTS=20`` checks the closing-note set. The same code
is the CLI ``python -m benchmarks.lossless_check`` (which also records MAT to eval/results/).
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from specdec.paths import DRAFT_MODEL, TARGET_MODEL, data_dir, model_path

PROMPTS = int(os.environ.get("SPECDEC_LOSSLESS_PROMPTS", "5"))
MAX_NEW = 64
BUDGET = 8

_MISSING = [p for p in (model_path(TARGET_MODEL), model_path(DRAFT_MODEL), data_dir() / "human_eval") if not p.exists()]
pytestmark = pytest.mark.skipif(
    bool(_MISSING),
    reason=f"shared folder incomplete (missing {_MISSING}); put ../shared beside the repo or set SPECDEC_SHARED",
)


@pytest.fixture(scope="module")
def pair(one_thread):
    from benchmarks.lossless_check import humaneval_prompts, load_pair_target, plain_greedy

    target, tok = load_pair_target("cpu")
    prompts = humaneval_prompts(tok, PROMPTS)
    baseline, _ = plain_greedy(target, prompts, max_new_tokens=MAX_NEW, eos_token_id=tok.eos_token_id)
    return target, tok, prompts, baseline


def model_drafter():
    """The project's ModelDrafter (eager backend); a plain in-test draft model if it cannot be built."""
    try:
        from specdec.drafters.model import ModelDrafter, ModelDrafterConfig

        return ModelDrafter(ModelDrafterConfig(backend="eager"))
    except ImportError:
        from transformers import AutoModelForCausalLM

        from core_support import HFModelDrafter

        return HFModelDrafter(AutoModelForCausalLM.from_pretrained(str(model_path(DRAFT_MODEL))).float())


def run(pair, drafter, *, tree, batch):
    from benchmarks.lossless_check import run_one

    target, tok, prompts, _ = pair
    return run_one(
        target,
        drafter,
        prompts,
        tree=tree,
        batch_size=batch,
        budget=BUDGET,
        max_new_tokens=MAX_NEW,
        eos_token_id=tok.eos_token_id,
    )


def test_baseline_is_nontrivial(pair):
    _, tok, prompts, baseline = pair
    assert len(baseline) == PROMPTS
    assert sum(len(b) for b in baseline) >= PROMPTS * MAX_NEW // 2  # mostly full-length responses


def test_plain_batch4_equals_batch1(pair):
    tokens, stats = run(pair, None, tree=False, batch=4)
    assert tokens == pair[3] and stats.mat == 1.0


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_draft_model_is_lossless(pair, tree, batch):
    drafter = model_drafter()
    tokens, stats = run(pair, drafter, tree=tree, batch=batch)
    drafter.close()
    assert tokens == pair[3]
    assert stats.draft_errors == 0
    assert stats.mat > 1.5  # the shared draft model agrees with the target most of the time


@pytest.mark.parametrize("name", ["suffix", "ngram"])
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_lookup_drafters_are_lossless(pair, name, tree):
    if importlib.util.find_spec(f"specdec.drafters.{name}") is None:
        pytest.skip(f"specdec.drafters.{name} is not available yet")
    from specdec.drafters.registry import build_drafter

    drafter = build_drafter(name)
    tokens, stats = run(pair, drafter, tree=tree, batch=4)
    drafter.close()
    assert tokens == pair[3]
    assert stats.draft_errors == 0 and stats.steps > 0
