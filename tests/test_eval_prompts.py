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
    write(
        d / "human_eval" / "HumanEval.jsonl.gz",
        [{"task_id": "HumanEval/0", "prompt": 'def f():\n    """d"""\n', "entry_point": "f"}],
        gz=True,
    )
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
    y.write_text(
        "runs:\n  - {drafter: arctic, budget: 32, options: {max_depth: 64}}\n  - {drafter: vllm-ngram, budget: 5}\n"
    )
    s = build_settings(drafters=None, budgets=None, tree=None, preset=str(y))
    assert [x.label for x in s] == ["arctic[max_depth=64] b32", "vllm-ngram b5"]
    assert s[0].options == {"arctic": {"max_depth": 64}}
    y.write_text("runs:\n  - {drafter: arctic, depth: 3}\n")
    with pytest.raises(ConfigError, match="unknown key"):
        build_settings(drafters=None, budgets=None, tree=None, preset=str(y))
    s = build_settings(drafters=None, budgets=None, tree=None, preset="eval_anchors")
    assert len(s) == 4 and s[1].options == {"arctic": {"max_depth": 64}}


# --------------------------------------------------------------------------- bench_vllm's prompt sets (prepare_prompts)
def test_closed_picks_keep_the_original_rule():
    from benchmarks.prepare_prompts import closed_picks

    # 3 instances of 10, 4, 7 calls, 5 prompts: 2 evenly spaced calls per instance (the start left out), first 5
    assert closed_picks([10, 4, 7], 5) == [(0, 3), (0, 6), (1, 1), (1, 2), (2, 2)]


def test_sustained_picks_spread_evenly_and_take_all_of_short_instances():
    from benchmarks.prepare_prompts import sustained_picks

    picks = sustained_picks([12, 2, 9], 12)  # q = 5: 5 + 2 + 5 = 12
    assert len(picks) == len(set(picks)) == 12
    assert [sum(i == k for i, _ in picks) for k in range(3)] == [5, 2, 5]
    assert all(0 <= c < n for (i, c), n in ((p, [12, 2, 9][p[0]]) for p in picks))
    assert sustained_picks([3, 3], 4) == [(0, 1), (0, 2), (1, 1), (1, 2)]  # q = 2, the same spread per instance
    with pytest.raises(SystemExit, match="8 prompts wanted, its instances have only 5"):
        sustained_picks([2, 3], 8)


def test_check_disjoint_names_the_repeated_prompt():
    from benchmarks.prepare_prompts import check_disjoint

    check_disjoint("code", {"warmup": [[0, 1]], "bs1": [[0, 2]], "sus32": [[0, 3]]})
    with pytest.raises(SystemExit, match=r"code: prompt sus32\[1\] repeats bs1\[0\]"):
        check_disjoint("code", {"warmup": [[0, 1]], "bs1": [[0, 2]], "sus32": [[0, 3], [0, 2]]})


def test_code_sustained_sets_are_mbpp_after_the_warmup_disjoint_and_sized(tmp_path, monkeypatch):
    from benchmarks import prepare_prompts as pp

    data = tmp_path / "data"
    (data / "human_eval").mkdir(parents=True)
    (data / "mbpp").mkdir()
    with gzip.open(data / "human_eval" / "HumanEval.jsonl.gz", "wt") as fh:
        fh.write("".join(json.dumps({"prompt": f"def f{i}():\n"}) + "\n" for i in range(200)))
    tasks = [{"text": f"task {i}", "test_list": [f"assert f({i})"]} for i in range(40)]
    tasks[15] = dict(tasks[5])  # MBPP repeats a task: offered once
    (data / "mbpp" / "mbpp.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    monkeypatch.setattr(pp, "data_dir", lambda: data)
    monkeypatch.setattr(pp, "SUSTAINED_BATCHES", (2, 3))
    monkeypatch.setattr(pp, "WARMUP_PROMPTS", 4)

    class CharTok:
        def encode(self, text: str, add_special_tokens: bool = False):
            return type("Enc", (), {"ids": [ord(c) for c in text]})()

    sets = pp.code_sets(CharTok(), 64)

    def text(ids: list[int]) -> str:
        return "".join(map(chr, ids[1:]))  # BOS first

    assert [len(sets[k]) for k in ("sus2", "sus3")] == [8, 12]  # SUSTAINED_FACTOR x b
    # the warm-up's format, right after it, opening the function the test calls
    assert text(sets["sus2"][0]) == '"""task 4\nassert f(4)\n"""\ndef f('
    assert text(sets["sus3"][-1]) == '"""task 24\nassert f(24)\n"""\ndef f('  # 4 + 8 + 12 distinct tasks + the repeat
    pp.check_disjoint("code", sets)
    monkeypatch.setattr(pp, "SUSTAINED_BATCHES", (2, 8))
    with pytest.raises(SystemExit, match="MBPP has 35 distinct tasks after the warm-up: sustained set sus8 needs 40"):
        pp.code_sets(CharTok(), 64)


def test_code_sets_from_the_shared_data_keep_the_closed_sets_and_add_disjoint_sustained_ones():
    from benchmarks import prepare_prompts as pp

    needed = [
        pp.data_dir() / "mbpp" / "mbpp.jsonl",
        pp.data_dir() / "human_eval" / "HumanEval.jsonl.gz",
        pp.model_path(pp.TARGET_MODEL) / "tokenizer.json",
    ]
    if not all(p.exists() for p in needed):
        pytest.skip("shared data or target tokenizer not present")
    sets = pp.code_sets(pp._tokenizer(), 1024)
    assert {k: len(v) for k, v in sets.items()} == {
        "warmup": 16,
        "bs1": 8,
        "bs8": 16,
        "bs32": 32,
        "bs64": 64,
        "sus32": 128,
        "sus64": 256,
    }
    pp.check_disjoint("code", sets)


def test_mbpp_header_names_the_function_the_test_calls():
    from benchmarks.prepare_prompts import _mbpp_header

    def task(test: str) -> dict:
        return {"text": "t", "test_list": [test]}

    assert _mbpp_header(task('assert remove_Occ("hello","l") == "heo"')) == "def remove_Occ("
    assert _mbpp_header(task("assert not is_not_prime(2)")) == "def is_not_prime("
    assert _mbpp_header(task("assert set(similar_elements((3, 4), (5, 4))) == set((4,))")) == "def similar_elements("
    assert _mbpp_header(task("assert math.isclose(volume(3), 1)")) == ""  # no plain call first: no header


def test_installed_versions_name_each_package_and_the_machine():
    import numpy
    import torch

    from specdec.eval.results import installed_versions

    v = installed_versions(["numpy", "no-such-package-xyz"])
    assert v["numpy"] == numpy.__version__ and v["no-such-package-xyz"] == "not installed"
    assert {"python", "platform", "cpu", "cpu_count"} <= set(v)
    assert v["gpu"] == (torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")


def test_random_sets_are_bos_then_ordinary_ids_sized_per_batch_disjoint_and_seeded():
    from benchmarks import prepare_prompts as pp

    sets = pp.random_sets(50, tokens=12)
    assert {k: len(v) for k, v in sets.items()} == {
        "warmup": pp.WARMUP_PROMPTS,
        "bs1": 8,  # batches of one run 8 prompts one after another
        "bs8": 16,
        "bs16": 16,
        "bs32": 32,
        "bs64": 64,
        "sus16": 64,  # SUSTAINED_FACTOR x b, from the serve check's concurrency up
        "sus32": 128,
        "sus64": 256,
        "bs100": 100,  # a loaded closed batch, drawn last
    }
    assert list(sets)[-1] == "bs100"  # the earlier sets keep the tokens they had before it was added
    ids = [t for prompts in sets.values() for p in prompts for t in p[1:]]
    assert all(p[0] == pp.BOS_ID and len(p) == 12 for prompts in sets.values() for p in prompts)
    assert min(ids) == pp.FIRST_ORDINARY_ID and max(ids) == 49  # uniform over the ordinary ids: every one drawn
    pp.check_disjoint("random", sets)
    assert pp.random_sets(50, tokens=12) == sets and pp.random_sets(50, tokens=12, seed=1) != sets
