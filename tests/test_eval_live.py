"""specdec-eval live on a tiny random Llama pair (core_support builds it): every method, lossless check, JSON, plots."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from core_support import LlamaSpec, save_tiny_llama  # noqa: E402
from specdec.drafters import registry  # noqa: E402
from specdec.eval.cli import main  # noqa: E402

WORDS = [f"w{i}" for i in range(60)]


def tiny_models(root):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, "<pad>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
    spec = LlamaSpec(  # untied, lm_head x40: peaked logits, no near-ties, so greedy paths are numerically stable
        vocab=len(vocab),
        hidden=32,
        heads=2,
        kv_heads=1,
        max_pos=256,
        token_ids=(None, 0, 1),
        head_scale=40.0,
    )
    return {
        name: save_tiny_llama(root / name, seed=seed, spec=spec, layers=layers, tokenizer=tok)
        for name, seed, layers in (("target", 0, 2), ("draft", 1, 1))
    }


def test_live_runs_every_method_and_checks_lossless(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setitem(registry._CLASSES, "toy", "eval_toys:LookupDrafter")
    paths = tiny_models(tmp_path)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": " ".join(WORDS[i : i + 6] * 2)}) + "\n" for i in range(3)))
    out = tmp_path / "out"
    rc = main(
        [
            "live",
            str(prompts),
            "--target",
            str(paths["target"]),
            "--draft-model",
            str(paths["draft"]),
            "--drafter",
            "toy",
            "--budget",
            "4",
            "--max-new-tokens",
            "24",
            "--out",
            str(out),
            "--no-progress",
            "--threads",
            "1",
            "--no-eos",
        ]
    )
    assert rc == 0
    doc = json.loads((out / "results.json").read_text())
    res = {r["method"]: r for r in doc["results"]}
    assert list(res) == ["hf-greedy", "specdec-greedy", "hf-assisted", "specdec toy b4"]
    for r in res.values():
        assert r["prompts"] == 3 and r["new_tokens"] == 3 * 24
        assert r["lossless_equal_prompts"] == 3, (r["method"], r["mismatched_prompts"])
    spec = res["specdec toy b4"]
    assert spec["mat"] >= 1.0 and spec["steps"] <= 3 * 24 and spec["emitted_tokens"] == 3 * 24
    assert sum(spec["per_position_accepted"]) == spec["accepted_tokens"]
    assert spec["speedup_vs_hf_greedy"] > 0 and "speedup_vs_hf_assisted" in spec
    assert (out / "per_position_acceptance.png").exists() and (out / "speedup.png").exists()
    text = capsys.readouterr().out
    assert "lossless" in text and "specdec toy " in text and text.count("columns: ") == 1
    assert max(len(line) for line in text.splitlines() if not line.startswith("wrote ")) <= 120


def test_lossless_margin_reports_each_first_difference_with_the_reference_margin():
    """benchmarks/lossless_margin.py: the first differing position of every differing prompt, the reference's top-2
    margin there, and the near-tie verdict against the threshold; identical prompts are not reported."""
    from types import SimpleNamespace

    from benchmarks.lossless_margin import _margin, compare

    lp = lambda **kw: {int(t[1:]): SimpleNamespace(logprob=v) for t, v in kw.items()}  # noqa: E731
    assert _margin(5, lp(t5=-0.1, t7=-2.6)) == pytest.approx(2.5)
    assert _margin(5, lp(t5=-0.1)) is None
    ref = {
        "code|8": {"tokens": [[1, 2, 3], [4, 5, 6], [7, 8]], "margins": [[3.0, 2.0, 1.0], [0.5, 1e-5, 2.0], [1.0, 1.0]]}
    }
    got = {"code|8": {"tokens": [[1, 2, 3], [4, 9, 6], [7, 8, 9]]}}
    rows = compare(ref, got, tie_margin=1e-3)
    assert [(r["prompt"], r["position"], r["reference_token"], r["method_token"], r["near_tie"]) for r in rows] == [
        (1, 1, 5, 9, True),
        (2, 2, None, 9, False),
    ]
    assert rows[0]["margin"] == 1e-5 and rows[1]["margin"] is None
