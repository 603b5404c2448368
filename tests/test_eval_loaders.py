"""Trace loaders on small fixtures written here (every format), the cache, and one-line errors."""

from __future__ import annotations

import gzip
import io
import json
import tarfile
from pathlib import Path

import pytest

from specdec.eval.loaders import TraceError, cache_dir, detect_format, load_traces
from specdec.eval.tokenization import ByteTokenizer, HFTokenizer, message_text, render_tool_calls
from specdec.paths import TARGET_MODEL, data_dir, model_path

BYTES = ByteTokenizer()


def b(text: str) -> list[int]:
    return list(text.encode())


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_generic_text_messages_and_ids(tmp_path) -> None:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    f = write_jsonl(
        tmp_path / "mix.jsonl",
        [
            {"prompt": "abc", "response": "de"},
            {"id": "m", "group": "g1", "prompt": msgs, "response": "ok\u2028x"},  # U+2028 inside a string
            {"prompt_ids": [5, 6], "response_ids": [7]},
        ],
    )
    name, recs = load_traces(str(f), tokenizer="bytes")
    assert name == "mix" and [r.id for r in recs] == ["0", "m", "2"]
    assert recs[0].prompt_list() == b("abc") and recs[0].response_list() == b("de")
    assert recs[1].prompt_list() == b("system: be brief\n") + b("user: hi\n") and recs[1].group == "g1"
    assert recs[1].response_list() == b("ok\u2028x")
    assert recs[2].prompt_list() == [5, 6] and recs[2].response_list() == [7]
    assert load_traces(str(f), tokenizer="bytes", limit=1)[1] == recs[:1]


def test_alpaca_and_code_alpaca(tmp_path) -> None:
    f = tmp_path / "code.json"
    f.write_text(
        json.dumps(
            [
                {"instruction": "Sum", "input": "1 2", "output": "3"},
                {"instruction": "Hi", "input": "", "output": "yo", "generator": "m"},
            ]
        )
    )
    g = tmp_path / "outs.model_outputs.json.gz"
    with gzip.open(g, "wt") as fh:
        json.dump([{"instruction": "Q", "output": "A", "generator": "m", "dataset": "d"}], fh)
    assert detect_format(f) == "alpaca" and detect_format(g) == "alpaca"
    _, recs = load_traces(str(f), tokenizer="bytes")
    assert recs[0].prompt_list() == b("Sum\n1 2") and recs[1].prompt_list() == b("Hi")
    name, recs = load_traces(str(g), tokenizer="bytes")
    assert name == "outs.model_outputs" and recs[0].response_list() == b("A")


def test_fastchat_answers_turn_one_and_all_turns(tmp_path) -> None:
    (tmp_path / "sub").mkdir()
    write_jsonl(tmp_path / "question.jsonl", [{"question_id": 7, "turns": ["q1", "q2"]}])
    f = write_jsonl(
        tmp_path / "sub" / "answers.jsonl",
        [{"question_id": 7, "model_id": "m", "choices": [{"index": 0, "turns": ["a1", "a2"]}]}],
    )
    _, recs = load_traces(str(f), tokenizer="bytes")
    assert len(recs) == 1 and recs[0].prompt_list() == b("q1") and recs[0].response_list() == b("a1")
    _, recs = load_traces(str(f), tokenizer="bytes", all_turns=True)
    assert [r.id for r in recs] == ["7/t1", "7/t2"] and recs[1].group == "7"
    assert recs[1].prompt_list() == b("user: q1\n") + b("assistant: a1\n") + b("user: q2\n")


def test_gsm8k_solutions(tmp_path) -> None:
    f = tmp_path / "example_model_solutions.jsonl.gz"
    with gzip.open(f, "wt") as fh:
        fh.write(
            json.dumps(
                {"question": "2+2?", "ground_truth": "4", "175b_finetuning": {"solution": "4", "is_correct": True}}
            )
            + "\n"
        )
    assert detect_format(f) == "gsm8k"
    _, recs = load_traces(str(f), tokenizer="bytes")
    assert recs[0].prompt_list() == b("2+2?") and recs[0].response_list() == b("4")


def _member(tf: tarfile.TarFile, name: str, obj: dict) -> None:
    data = json.dumps(obj).encode()
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tf.addfile(info, io.BytesIO(data))


def make_openhands(path: Path) -> Path:
    call = lambda ts, msgs, content, calls: {  # noqa: E731
        "timestamp": ts,
        "messages": msgs,
        "response": {"choices": [{"message": {"content": content, "tool_calls": calls}}]},
    }
    bash = [{"function": {"name": "execute_bash", "arguments": json.dumps({"command": "ls", "timeout": 5})}}]
    sys_m = {"role": "system", "content": [{"type": "text", "text": "S"}]}
    with tarfile.open(path, "w:gz") as tf:
        _member(
            tf, "run/llm_completions/b_inst/x-2.json", call(2.0, [sys_m, {"role": "user", "content": "u2"}], "", bash)
        )
        _member(tf, "run/llm_completions/b_inst/x-1.json", call(1.0, [sys_m], "think", bash))
        _member(tf, "run/llm_completions/a_inst/x-9.json", call(9.0, [sys_m], "only text", None))
        _member(tf, "run/metadata.json", {"k": "v"})
    return path


def test_openhands_tarball_order_and_rendering(tmp_path) -> None:
    f = make_openhands(tmp_path / "oh.tar.gz")
    _, recs = load_traces(str(f), tokenizer="bytes")
    assert [r.id for r in recs] == ["a_inst/x-9.json", "b_inst/x-1.json", "b_inst/x-2.json"]
    assert [r.group for r in recs] == ["a_inst", "b_inst", "b_inst"]
    call_text = (
        "<function=execute_bash>\n<parameter=command>ls</parameter>\n<parameter=timeout>5</parameter>\n</function>"
    )
    assert (
        render_tool_calls(
            [{"function": {"name": "execute_bash", "arguments": json.dumps({"command": "ls", "timeout": 5})}}]
        )
        == call_text
    )
    assert recs[1].response_list() == b("think\n" + call_text) and recs[2].response_list() == b(call_text)
    assert recs[2].prompt_list() == b("system: S\n") + b("user: u2\n")
    _, first = load_traces(str(f), tokenizer="bytes", limit=1)  # limit counts instances
    assert [r.id for r in first] == ["a_inst/x-9.json"]


def test_cache_is_used_and_keyed_by_content(tmp_path) -> None:
    f = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "ab", "response": "cd"}])
    _, a = load_traces(str(f), tokenizer="bytes")
    files = list(cache_dir().glob("*.npz"))
    assert len(files) == 1
    _, a2 = load_traces(str(f), tokenizer="bytes")
    assert a2 == a
    write_jsonl(f, [{"prompt": "ab", "response": "XY"}])  # same name, new content -> new entry
    _, c = load_traces(str(f), tokenizer="bytes")
    assert c[0].response_list() == b("XY") and len(list(cache_dir().glob("*.npz"))) == 2


@pytest.mark.parametrize(
    "name, body, pattern",
    [
        ("x.txt", "hello", r"x\.txt: unknown trace format"),
        ("e.jsonl", "", r"e\.jsonl: empty dataset"),
        ("k.jsonl", '{"a": 1}\n', r"k\.jsonl: unknown trace format .*expected prompt\+response"),
        ("bad.jsonl", '{"prompt": "a", "response": "b"}\nnot json\n', r"bad\.jsonl:2: not valid JSON"),
        ("j.json", '{"a": 1}', r"j\.json: unknown JSON trace format"),
    ],
)
def test_one_line_errors(tmp_path, name, body, pattern) -> None:
    f = tmp_path / name
    f.write_text(body)
    with pytest.raises(TraceError, match=pattern) as exc:
        load_traces(str(f), tokenizer="bytes")
    assert "\n" not in str(exc.value)


def test_missing_file_and_vocab_mismatch(tmp_path) -> None:
    with pytest.raises(TraceError, match=r"nope\.jsonl: no such file"):
        load_traces(str(tmp_path / "nope.jsonl"), tokenizer="bytes")
    f = write_jsonl(tmp_path / "ids.jsonl", [{"prompt_ids": [1, 2], "response_ids": [300]}])
    with pytest.raises(TraceError, match=r"ids\.jsonl: token id 300 >= vocab size 256 of tokenizer bytes"):
        load_traces(str(f), tokenizer="bytes")
    with pytest.raises(TraceError, match=r"missing file for trace set 'code_alpaca'"):
        load_traces("code_alpaca", data=str(tmp_path))


SHARED_TOK = model_path(TARGET_MODEL)
needs_shared = pytest.mark.skipif(
    not (data_dir() / "code").exists() or not (SHARED_TOK / "tokenizer.json").exists(),
    reason="needs ../shared data and the shared tokenizer",
)


@needs_shared
def test_shared_sets_match_the_anchors_token_counts() -> None:
    # ANCHORS.md: first 400 records, response tokens (records with an empty response excluded there).
    for name, tokens, nonempty in (
        ("code_alpaca", 27_171, 399),
        ("gsm8k_175b", 45_956, 400),
        ("mt_bench_vicuna7b_t1", 24_525, 80),
    ):
        _, recs = load_traces(name, tokenizer=str(SHARED_TOK), limit=400)
        assert sum(r.response_ids.size for r in recs) == tokens
        assert sum(1 for r in recs if r.response_ids.size) == nonempty


@needs_shared
def test_fast_tokenizer_equals_autotokenizer() -> None:
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(str(SHARED_TOK))
    fast = HFTokenizer(SHARED_TOK)
    texts = [
        "def f(x):\n    return x  # ünïcode\u2028",
        message_text({"role": "user", "content": "  spaces\t\n"}),
        "<|endoftext|> special in text",
        "",
    ]
    for t in texts:
        assert fast.encode(t) == auto(t, add_special_tokens=False)["input_ids"]
    assert fast.vocab_size == len(auto) and fast.eos_token_id == auto.eos_token_id
