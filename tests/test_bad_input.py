"""Every bad input of issue 35, fed exactly: a one-line error (exit status 2, before any long work) or the right
behaviour. The table of answers is docs/bad-input.md."""

from __future__ import annotations

import errno
import gzip
import json
import logging
import pathlib

import numpy as np
import pytest

from bad_input_support import fails, trace_file
from specdec.eval.cli import main

pytestmark = pytest.mark.usefixtures("toys")  # the toy drafter and a fresh trace cache, every test


def fails_live(tmp_path: pathlib.Path, *, target: pathlib.Path, draft: pathlib.Path, capsys) -> str:
    """``specdec-eval live`` of one prompt with ``draft`` as the draft model of ``target``: its one error line."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "w1 w2"}) + "\n")
    args = ["live", str(prompts), "--target", str(target), "--draft-model", str(draft), "--out", str(tmp_path / "o")]
    return fails(args, capsys)


# ------------------------------------------------------------------------------------------- raw tracebacks
def test_jsonl_gz_that_is_not_gzip(tmp_path, capsys, no_replay) -> None:
    f = tmp_path / "t.jsonl.gz"
    f.write_text('{"prompt_ids": [1], "response_ids": [2]}\n')
    line = fails(["replay", str(f), "--drafter", "toy", "--out", str(tmp_path / "o")], capsys)
    assert str(f) in line and "not a valid gzip file" in line


def test_grid_budget_without_values(tmp_path, capsys, no_replay) -> None:
    line = fails(
        ["sweep", str(trace_file(tmp_path)), "--drafter", "toy", "--grid", "budget=", "--out", str(tmp_path / "o")],
        capsys,
    )
    assert "--grid 'budget='" in line and "budget=8,16" in line


def test_out_is_an_existing_file(tmp_path, capsys, no_replay) -> None:
    out = tmp_path / "taken"
    out.write_text("x")
    line = fails(["replay", str(trace_file(tmp_path)), "--drafter", "toy", "--out", str(out)], capsys)
    assert f"--out {out}" in line and "existing file" in line and out.read_text() == "x"


def test_out_and_json_on_a_read_only_file_system(tmp_path, capsys, monkeypatch, no_replay) -> None:
    ro = tmp_path / "ro"
    real_mkdir, real_write = pathlib.Path.mkdir, pathlib.Path.write_bytes

    def mkdir(self, *a, **k):
        if str(self).startswith(str(ro)):
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real_mkdir(self, *a, **k)

    def write_bytes(self, data):
        if str(self).startswith(str(ro)):
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real_write(self, data)

    monkeypatch.setattr(pathlib.Path, "mkdir", mkdir)
    monkeypatch.setattr(pathlib.Path, "write_bytes", write_bytes)
    line = fails(["replay", str(trace_file(tmp_path)), "--drafter", "toy", "--out", str(ro / "out")], capsys)
    assert f"--out {ro / 'out'}" in line and "Read-only file system" in line
    real_mkdir(ro)
    line = fails(
        [
            "replay",
            str(trace_file(tmp_path)),
            "--drafter",
            "toy",
            "--out",
            str(tmp_path / "o"),
            "--json",
            str(ro / "r.json"),
        ],
        capsys,
    )
    assert f"--json {ro / 'r.json'}" in line and "Read-only file system" in line


# ------------------------------------------------------------------------------------------- silently wrong
@pytest.mark.parametrize("flag", [["--option", "sufix.max_depth=2"], ["--grid", "sufix.max_depth=16,32"]])
def test_mistyped_drafter_name_in_option_or_grid(tmp_path, capsys, no_replay, flag) -> None:
    cmd = "sweep" if flag[0] == "--grid" else "replay"
    line = fails([cmd, str(trace_file(tmp_path)), "--drafter", "suffix", *flag, "--out", str(tmp_path / "o")], capsys)
    assert "unknown drafter 'sufix'" in line and "suffix" in line.split("valid drafters:")[1]


def test_option_for_a_drafter_not_run(tmp_path, capsys, no_replay) -> None:
    line = fails(
        [
            "replay",
            str(trace_file(tmp_path)),
            "--drafter",
            "suffix",
            "--option",
            "ngram.max_n=3",
            "--out",
            str(tmp_path / "o"),
        ],
        capsys,
    )
    assert "drafter 'ngram' is not among the drafters run (suffix)" in line


def test_unknown_option_key_is_refused_before_loading(tmp_path, capsys, no_replay) -> None:
    line = fails(
        [
            "replay",
            str(trace_file(tmp_path)),
            "--drafter",
            "suffix",
            "--option",
            "suffix.max_dept=3",
            "--out",
            str(tmp_path / "o"),
        ],
        capsys,
    )
    assert "'max_dept'" in line and "max_depth" in line


def test_grid_tree_maybe(tmp_path, capsys, no_replay) -> None:
    line = fails(
        ["sweep", str(trace_file(tmp_path)), "--drafter", "toy", "--grid", "tree=maybe", "--out", str(tmp_path / "o")],
        capsys,
    )
    assert "tree='maybe' must be true or false" in line


@pytest.mark.parametrize("limit", ["0", "-1"])
def test_live_limit_validated_like_replay(tmp_path, capsys, limit) -> None:
    line = fails(["live", "humaneval", "--limit", limit, "--out", str(tmp_path / "o")], capsys)
    assert f"--limit {limit} is out of range: must be >= 1" in line
    line = fails(
        ["replay", str(trace_file(tmp_path)), "--drafter", "toy", "--limit", limit, "--out", str(tmp_path / "o")],
        capsys,
    )
    assert f"--limit {limit} is out of range: must be >= 1" in line


# ------------------------------------------------------------------------------------------- unhelpful
@pytest.mark.parametrize("name", ["junk.json", "junk.jsonl"])
def test_random_bytes_name_the_file_and_line(tmp_path, capsys, no_replay, name) -> None:
    f = tmp_path / name
    f.write_bytes(b'{"prompt": "a", "response": "b"}\n' + bytes(range(128, 256)) + b"\n")
    line = fails(["replay", str(f), "--drafter", "toy", "--tokenizer", "bytes", "--out", str(tmp_path / "o")], capsys)
    assert f"{f}:2: not UTF-8 text" in line


def test_grid_budget_not_a_number(tmp_path, capsys, no_replay) -> None:
    line = fails(
        [
            "sweep",
            str(trace_file(tmp_path)),
            "--drafter",
            "toy",
            "--grid",
            "budget=8,abc",
            "--out",
            str(tmp_path / "o"),
        ],
        capsys,
    )
    assert "budget='abc' must be an integer >= 0" in line


def test_tar_gz_error_is_whole(tmp_path, capsys, no_replay) -> None:
    f = tmp_path / "agent.tar.gz"
    f.write_bytes(gzip.compress(b"not a tar archive at all" * 40))
    line = fails(["replay", str(f), "--drafter", "toy", "--tokenizer", "bytes", "--out", str(tmp_path / "o")], capsys)
    assert str(f) in line and line.endswith("expected an OpenHands llm_completions tarball")


def test_id_traces_of_another_vocabulary_need_tokenizer_none(tmp_path, capsys) -> None:
    f = tmp_path / "rollouts.jsonl"
    f.write_text(json.dumps({"prompt_ids": [151649, 7, 151649, 7], "response_ids": [151649, 7, 9]}) + "\n")
    line = fails(["replay", str(f), "--drafter", "toy", "--tokenizer", "bytes", "--out", str(tmp_path / "o")], capsys)
    assert "token id 151649 >= vocab size 256" in line and "--tokenizer none" in line
    out = tmp_path / "ok"
    assert (
        main(
            [
                "replay",
                str(f),
                "--drafter",
                "toy",
                "--tokenizer",
                "none",
                "--out",
                str(out),
                "--no-progress",
                "--no-plots",
            ]
        )
        == 0
    )
    res = json.loads((out / "results.json").read_text())["results"][0]
    assert res["records"] == 1 and res["response_tokens"] == 3


def test_tokenizer_none_with_text_traces(tmp_path, capsys) -> None:
    f = tmp_path / "text.jsonl"
    f.write_text(json.dumps({"prompt": "hello", "response": "world"}) + "\n")
    line = fails(["replay", str(f), "--drafter", "toy", "--tokenizer", "none", "--out", str(tmp_path / "o")], capsys)
    assert f"{f}: record 1" in line and "--tokenizer none" in line
    line = fails(["replay", "--drafter", "toy", "--tokenizer", "none", "--out", str(tmp_path / "o")], capsys)
    assert "built-in workload is text" in line


def test_projection_says_when_the_cpu_bounds_it(tmp_path, capsys) -> None:
    out = tmp_path / "o"
    assert (
        main(
            [
                "replay",
                str(trace_file(tmp_path)),
                "--drafter",
                "toy",
                "--verify-ms",
                "0.000001",
                "--verify-ms-per-token",
                "0",
                "--out",
                str(out),
                "--no-progress",
                "--no-plots",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "more than the modelled verification" in text and "CPU core(s)" in text


def test_cpu_note_names_the_draft_model() -> None:
    from specdec.eval.checks import cpu_notes

    r = {
        "dataset": "d",
        "label": "suffix+model b16",
        "names": ["suffix", "model"],
        "cpu_ms_per_step": 50.0,
        "verify_ms_per_step": 5.2,
        "projected_speedup": 0.1,
    }
    (note,) = cpu_notes([r])
    assert "50.00 ms per step" in note and "5.20 ms" in note and "draft model's forward passes" in note
    assert cpu_notes([{**r, "cpu_ms_per_step": 1.0}]) == []


def test_live_medians_and_stalled_prompts() -> None:
    from specdec.eval.checks import slow_prompt_notes
    from specdec.eval.live_report import MethodRun, live_entry

    def run(method: str, secs: list[float]) -> MethodRun:
        m = MethodRun(method, seconds=sum(secs), tokens=10 * len(secs))
        m.per_prompt = [{"id": f"p{i}", "seconds": s, "equal_to_reference": True} for i, s in enumerate(secs)]
        return m

    hf = run("hf-greedy", [48.0, 66.0] + [2.0] * 8)
    spec = run("specdec-greedy", [2.0, 2.0] + [1.6] * 8)
    e = live_entry("set", spec, [hf, spec])
    assert e["speedup_vs_hf_greedy"] == pytest.approx(130.0 / 16.8)  # the sum: skewed by two stalled prompts
    assert e["median_speedup_vs_hf_greedy"] == pytest.approx(2.0 / 1.6)
    h = live_entry("set", hf, [hf, spec])
    assert h["median_seconds"] == 2.0 and [p["id"] for p in h["slow_prompts"]] == ["p0", "p1"]
    (note,) = slow_prompt_notes([h, e])
    assert "hf-greedy" in note and "p0 (48.00 s)" in note and "3x the median 2.00 s" in note


# ------------------------------------------------------------------------------------------- draft model
def test_draft_model_of_another_tokenizer_is_refused(tmp_path, capsys) -> None:
    pytest.importorskip("transformers")
    from core_support import save_tiny_llama
    from test_eval_live import tiny_models

    paths = tiny_models(tmp_path)
    other = save_tiny_llama(tmp_path / "other", seed=3)  # vocabulary 97, no tokenizer
    # replay: the traces' tokenizer against the draft model's
    line = fails(
        [
            "replay",
            str(trace_file(tmp_path)),
            "--drafter",
            "model",
            "--option",
            f"model.path={paths['draft']}",
            "--tokenizer",
            "bytes",
            "--out",
            str(tmp_path / "o"),
        ],
        capsys,
    )
    assert "tokenized as UTF-8 bytes" in line
    # live: the draft model against the target, before any model is loaded
    line = fails_live(tmp_path, target=paths["target"], draft=other, capsys=capsys)
    assert "vocabulary of 97 tokens, the target 63" in line


def test_library_refuses_a_draft_model_of_another_vocabulary(tmp_path) -> None:
    pytest.importorskip("transformers")
    from core_support import SAVED_VOCAB, save_tiny_llama, tiny_llama
    from specdec.config import ConfigError
    from specdec.drafters.model import ModelDrafter, ModelDrafterConfig
    from specdec.generation import SpecGenerator

    drafter = ModelDrafter(ModelDrafterConfig(path=str(save_tiny_llama(tmp_path / "d", seed=1)), backend="eager"))
    for vocab in (SAVED_VOCAB - 10, SAVED_VOCAB + 10):  # smaller and larger
        with pytest.raises(ConfigError, match=f"vocabulary of {SAVED_VOCAB} tokens, the target {vocab}"):
            SpecGenerator(tiny_llama(vocab=vocab), drafter)
    SpecGenerator(tiny_llama(vocab=SAVED_VOCAB), drafter)  # same size: accepted


# ------------------------------------------------------------------------------------------- library
class _Tok:
    """A character tokenizer: ids = ord(c) % 60 + 2."""

    eos_token_id = None

    def __call__(self, text: str) -> dict:
        return {"input_ids": [ord(c) % 60 + 2 for c in text]}

    def decode(self, ids) -> str:
        return "".join(chr(i) for i in ids)


def test_bare_string_prompt_is_one_prompt() -> None:
    import specdec
    from core_support import tiny_llama

    model = tiny_llama()
    res = specdec.generate(model, "def fib(n):", tokenizer=_Tok(), max_new_tokens=4)
    assert len(res.tokens) == 1 and len(res.tokens[0]) == 4
    ref = specdec.generate(model, ["def fib(n):"], tokenizer=_Tok(), max_new_tokens=4)
    assert res.tokens == ref.tokens
    ids = specdec.generate(model, [5, 6, 7], max_new_tokens=3)  # a flat id list is one prompt too
    assert len(ids.tokens) == 1


def test_drafter_returning_none_counts_as_a_failure(caplog) -> None:
    from core_support import tiny_llama
    from specdec.drafters.base import Drafter
    from specdec.generation import SpecGenerator

    class NoneDrafter(Drafter):
        name = "nones"

        def start(self, request_id, prompt_ids):
            pass

        def extend(self, request_id, token_ids):
            pass

        def stop(self, request_id):
            pass

        def draft_batch(self, requests):
            return [None for _ in requests]

    gen = SpecGenerator(tiny_llama(), NoneDrafter(), budget=4)
    plain = SpecGenerator(tiny_llama(), None).generate([[3, 4, 5]], max_new_tokens=6)
    with caplog.at_level(logging.WARNING, logger="specdec.drafters"):
        res = gen.generate([[3, 4, 5]], max_new_tokens=6)
    assert res.tokens == plain.tokens  # the steps went on without drafts
    assert res.stats.draft_errors == res.stats.steps - 1 >= 1  # every step but the last (no room) drafted
    assert sum("returned NoneType" in r.getMessage() for r in caplog.records) == 1  # logged once
    with pytest.raises(TypeError, match="returned NoneType"):
        SpecGenerator(tiny_llama(), NoneDrafter(), budget=4, strict=True).generate([[3, 4]], max_new_tokens=3)


def test_replay_counts_a_none_draft_as_a_failure() -> None:
    from eval_toys import LookupDrafter
    from specdec.eval.records import TraceRecord
    from specdec.eval.replay import replay

    class Nones(LookupDrafter):
        def draft_batch(self, requests):
            return [None for _ in requests]

    res = replay(Nones(), [TraceRecord("a", [1, 2, 3], [1, 2, 3])], budget=4, tree=False)
    assert res.draft_errors == res.steps == 3 and res.mat == 1.0


# ------------------------------------------------------------------------------------------- suffix ids
BACKENDS = ["python"] + (["native"] if __import__("specdec.drafters.suffix", fromlist=["x"]).native_available() else [])


@pytest.mark.parametrize("backend", BACKENDS)
def test_64_bit_ids_draft_the_same_on_both_engines(backend) -> None:
    from specdec.drafters.suffix import SuffixDrafter

    d = SuffixDrafter(backend=backend)
    d.start("r", [5, 7, 2**32 + 5, 9, 5])
    assert d.draft("r", 8).tokens.tolist() == [7, 2**32 + 5, 9, 5]
    d.start("s", [2**31, 3, 2**31, 4, 2**31])  # 2**31 is neither -2**31 nor 0
    assert d.draft("s", 8).tokens.tolist()[0] in (3, 4)
    assert d.draft("r", 2**31).tokens.tolist() == [7, 2**32 + 5, 9, 5]  # no OverflowError
    assert d.draft("r", 2**40).tokens.tolist() == [7, 2**32 + 5, 9, 5]
    for dtype, big in ((np.uint32, 2**32 - 3), (np.uint64, 2**63 - 1), (np.int64, 2**40)):
        d.start("u", np.array([5, 7, big, 9, 5], dtype=dtype))
        assert d.draft("u", 8).tokens.tolist() == [7, big, 9, 5], dtype
    for bad in ([1, -2], [2**64], np.array([1, -3]), np.array([1, -3], np.int32), np.array([2**64 - 1], np.uint64)):
        with pytest.raises(ValueError, match=r"token id"):
            d.start("x", bad)
        assert "x" not in d.active_requests()


def test_draft_model_with_a_different_tokenizer_of_the_same_size(tmp_path, capsys) -> None:
    pytest.importorskip("transformers")
    import shutil

    from test_eval_live import tiny_models

    paths = tiny_models(tmp_path)
    other = tmp_path / "swapped"
    shutil.copytree(paths["draft"], other)
    tj = json.loads((other / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    vocab["w0"], vocab["w1"] = vocab["w1"], vocab["w0"]  # same size, two ids swapped
    (other / "tokenizer.json").write_text(json.dumps(tj))
    line = fails_live(tmp_path, target=paths["target"], draft=other, capsys=capsys)
    assert "use different tokenizers" in line and "2 differ" in line
    line = fails(
        [
            "replay",
            str(trace_file(tmp_path)),
            "--drafter",
            "model",
            "--option",
            f"model.path={other}",
            "--tokenizer",
            str(paths["target"]),
            "--out",
            str(tmp_path / "o"),
        ],
        capsys,
    )
    assert "use different tokenizers" in line and f"--tokenizer {paths['target']}" in line
