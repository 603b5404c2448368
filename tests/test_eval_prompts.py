"""Prompt-set loaders for live runs, prompt rendering, results files, preset `runs`."""
from __future__ import annotations

import gzip
import json
import re

import pytest

from specdec.config import ConfigError
from specdec.eval.loaders import TraceError
from specdec.eval.prompts import GENERATION_CUE, load_prompts, render_prompt
from specdec.eval.results import results_path, write_results
from specdec.eval.settings import build_settings


def write(path, rows, gz=False):
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if gz:
        with gzip.open(path, "wt") as fh:
            fh.write(text)
    else:
        path.write_text(text)
    return path


def test_prompt_sets(tmp_path) -> None:
    d = tmp_path / "data"
    (d / "human_eval").mkdir(parents=True)
    (d / "mbpp").mkdir()
    (d / "spec_bench").mkdir()
    (d / "gsm8k").mkdir()
    write(d / "human_eval" / "HumanEval.jsonl.gz", [{"task_id": "HumanEval/0", "prompt": "def f():\n    \"\"\"d\"\"\"\n",
                                                     "entry_point": "f"}], gz=True)
    write(d / "mbpp" / "mbpp.jsonl", [{"task_id": 11, "text": "Do x.", "test_list": ["assert f(1) == 2"]}])
    write(d / "spec_bench" / "question.jsonl", [{"question_id": 81, "category": "writing", "turns": ["a", "b"]}])
    write(d / "gsm8k" / "test.jsonl", [{"question": "2+2?", "answer": "4"}, {"question": "3+3?", "answer": "6"}])
    name, he = load_prompts("humaneval", data=str(d))
    assert name == "humaneval" and he[0].id == "HumanEval/0" and he[0].prompt == 'def f():\n    """d"""'
    assert load_prompts("mbpp", data=str(d))[1][0].prompt == '"""\nDo x.\nassert f(1) == 2\n"""'
    sb = load_prompts("spec_bench", data=str(d))[1][0]
    assert sb.prompt == [{"role": "user", "content": "a"}] and sb.turns == ["b"] and sb.meta["category"] == "writing"
    assert len(load_prompts("gsm8k", data=str(d), limit=1)[1]) == 1
    with pytest.raises(TraceError, match="missing file for prompt set 'mt_bench'"):
        load_prompts("mt_bench", data=str(d))


class WordTok:
    """A stand-in HF tokenizer: one id per character, BOS 0, no chat template."""

    bos_token_id = 0
    chat_template = None

    def __call__(self, text):
        return {"input_ids": [ord(c) for c in text]}


def test_render_prompt_text_chat_and_bos() -> None:
    from specdec.eval.records import PromptRecord

    tok = WordTok()
    assert render_prompt(PromptRecord("a", "hi"), tok) == [0, ord("h"), ord("i")]
    assert render_prompt(PromptRecord("a", "hi"), tok, bos=False) == [ord("h"), ord("i")]
    chat = render_prompt(PromptRecord("b", [{"role": "user", "content": "q"}]), tok, bos=False)
    assert "".join(map(chr, chat)) == "user: q\n" + GENERATION_CUE


def test_results_file_name_and_atomic_write(tmp_path) -> None:
    p = results_path("my_run", directory=tmp_path, date="2026-01-02")
    assert re.fullmatch(r"2026-01-02_cpu-\d+core_my_run\.json", p.name)
    assert results_path("x", device="cuda-h100", directory=tmp_path).name.endswith("_cuda-h100_x.json")
    write_results(p, {"a": 1}, [{"dataset": "d", "mat": float("nan")}])
    doc = json.loads(p.read_text())
    assert doc["settings"] == {"a": 1} and doc["results"][0]["mat"] is None and "python" in doc["versions"]
    assert [f.name for f in tmp_path.iterdir()] == [p.name]  # no temp file left


def test_preset_runs(tmp_path) -> None:
    y = tmp_path / "r.yaml"
    y.write_text("runs:\n  - {drafter: arctic, budget: 32, options: {max_depth: 64}}\n  - {drafter: vllm-ngram, budget: 5}\n")
    s = build_settings(drafters=None, budgets=None, tree=None, preset=str(y))
    assert [x.label for x in s] == ["arctic[max_depth=64] b32", "vllm-ngram b5"]
    assert s[0].options == {"arctic": {"max_depth": 64}}
    y.write_text("runs:\n  - {drafter: arctic, depth: 3}\n")
    with pytest.raises(ConfigError, match="unknown key"):
        build_settings(drafters=None, budgets=None, tree=None, preset=str(y))
    s = build_settings(drafters=None, budgets=None, tree=None, preset="eval_anchors")
    assert len(s) == 4 and s[1].options == {"arctic": {"max_depth": 64}}
