"""benchmarks/target_outputs.py: batched, left-padded greedy outputs equal a one-prompt argmax loop.

The JSONL the script writes replays."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.target_outputs import greedy_outputs, load_prompt_set, main, write_jsonl
from core_support import LlamaSpec, tiny_llama
from specdec.eval.loaders import load_traces

VOCAB = 50
TARGET_SPEC = LlamaSpec(  # untied, lm_head x40: peaked logits, no near-ties, so the greedy paths are numerically stable
    vocab=VOCAB, hidden=32, heads=2, kv_heads=1, max_pos=128, token_ids=(None, 2, 0), head_scale=40.0
)


def tiny_target(path):
    model = tiny_llama(0, spec=TARGET_SPEC)
    model.save_pretrained(path)
    return model


def argmax_loop(model, prompt, n):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def test_batched_outputs_equal_one_prompt_greedy_and_replay(tmp_path):
    model = tiny_target(tmp_path / "target")
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [2, 2, 3, 4, 20]]  # unequal lengths (left padding), EOS id 2 inside
    got = greedy_outputs(model, prompts, max_tokens=9, batch=2, progress=False)
    assert got == [argmax_loop(model, p, 9) for p in prompts]
    assert all(len(r) == 9 for r in got)  # EOS never stops a response (the benchmark's ignore_eos)
    out = tmp_path / "t.jsonl"
    write_jsonl(out, prompts, got, prefix="code-bs8")
    _, records = load_traces(out, use_cache=False)
    assert [r.id for r in records] == ["code-bs8-0", "code-bs8-1", "code-bs8-2"]
    assert [r.prompt_list() for r in records] == prompts and [r.response_list() for r in records] == got


def test_cli_writes_the_named_set_and_names_a_missing_one(tmp_path, capsys):
    tiny_target(tmp_path / "target")
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"datasets": {"code": {"bs8": [[5, 6, 7], [8, 9], [10, 11, 12]]}}}))
    out = tmp_path / "o.jsonl"
    main(
        [
            "--prompts",
            str(prompts),
            "--dataset",
            "code",
            "--set",
            "bs8",
            "--limit",
            "2",
            "--max-tokens",
            "4",
            "--model",
            str(tmp_path / "target"),
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["prompt_ids"] for x in lines] == [[5, 6, 7], [8, 9]] and all(len(x["response_ids"]) == 4 for x in lines)
    assert "2 prompts x 4 tokens" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no set 'sus64'"):
        load_prompt_set(prompts, "code", "sus64")
    with pytest.raises(SystemExit, match="no dataset 'chat'"):
        load_prompt_set(prompts, "chat", "bs8")
