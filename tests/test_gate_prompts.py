"""The GPU gate's inputs: disjoint cells, max_tokens from recorded response lengths, determinism, the base tree."""

from __future__ import annotations

import json
import subprocess

import pytest

from benchmarks import gate_prompts as gp
from specdec.paths import REPO_ROOT, data_dir


@pytest.fixture(scope="module")
def built():
    if not (data_dir() / "agent").exists():
        pytest.skip("no shared data folder")
    tok = gp._tokenizer()
    return tok, gp.build(tok, 1536, 1024)


def test_cells_and_sizes(built):
    _, sets = built
    assert set(sets) == set(gp.SETS)
    for name, cells in sets.items():
        for cell, n in gp.CELLS.items():
            assert len(cells[cell]) == n, (name, cell)
        assert len(cells["warmup"]) == gp.WARMUP_PROMPTS
    assert len(sets[gp.SAMPLED_SET][gp.SAMPLED_CELL]) == gp.SAMPLED_PROMPTS
    assert all(gp.SAMPLED_CELL not in cells for name, cells in sets.items() if name != gp.SAMPLED_SET)


def test_every_prompt_distinct_across_sets_and_cells(built):
    _, sets = built
    ids = [tuple(it["ids"]) for cells in sets.values() for items in cells.values() for it in items]
    assert len(ids) == len(set(ids))
    assert all(i[0] == 0 for i in ids)  # BOS first, as the shared models were trained
    assert max(map(len, ids)) <= 1536


def test_check_disjoint_names_the_repeat():
    item = {"ids": [0, 5, 6], "max_tokens": 32}
    with pytest.raises(SystemExit, match="chat/b8\\[0\\] repeats code/b1\\[0\\]"):
        gp.check_disjoint({"code": {"b1": [item]}, "chat": {"b8": [dict(item)]}})


def test_clamp_tokens():
    assert gp.clamp_tokens(None) == gp.MAX_TOKENS
    assert gp.clamp_tokens(1) == gp.MIN_TOKENS
    assert gp.clamp_tokens(32) == 32
    assert gp.clamp_tokens(100) == 100
    assert gp.clamp_tokens(256) == 256
    assert gp.clamp_tokens(5000) == gp.MAX_TOKENS


def _n(tok, text: str) -> int:
    return len(tok.encode(text, add_special_tokens=False).ids)


def test_max_tokens_from_recorded_lengths(built):
    tok, sets = built
    for it in sets["code"]["b8"]:  # HumanEval records no LLM response (its solutions are human-written)
        assert it["max_tokens"] == gp.MAX_TOKENS
    answers = [json.loads(x) for x in (data_dir() / "mt_bench/model_answer_gpt-4o.jsonl").read_text().split("\n") if x]
    gpt4o = {f"mt_bench/{a['question_id']}": a["choices"][0]["turns"][0] for a in answers}
    chat = [it for items in sets["chat"].values() for it in items]
    for it in chat:  # MT-Bench: GPT-4o's answer; Spec-Bench records no model answer
        want = gp.clamp_tokens(_n(tok, gpt4o[it["source"]])) if it["source"] in gpt4o else gp.MAX_TOKENS
        assert it["max_tokens"] == want
    assert {it["source"].split("/")[0] for it in chat} == {"mt_bench", "spec_bench"}
    agentic = [it["max_tokens"] for items in sets["agentic"].values() for it in items]
    assert min(agentic) >= gp.MIN_TOKENS and max(agentic) <= gp.MAX_TOKENS and len(set(agentic)) > 5


def test_build_is_deterministic(built):
    tok, sets = built
    assert gp.build(tok, 1536, 1024) == sets


def test_main_writes_inputs_and_the_base_tree(tmp_path, built):
    base = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD~1"], capture_output=True, text=True)
    if base.returncode != 0:
        pytest.skip("no git history")
    out = tmp_path / "device_inputs" / "gate_inputs.json"
    gp.main(["--out", str(out), "--before-commit", "HEAD~1"])
    doc = json.loads(out.read_text())
    assert doc["before"]["commit"] == base.stdout.strip()
    assert doc["commit"] and doc["batch"]["b1"] == 1 and doc["sets"] == built[1]
    tree = out.parent / gp.BEFORE_DIR
    assert (tree / gp.BEFORE_STAMP).read_text().strip() == base.stdout.strip()
    assert (tree / "pyproject.toml").exists()
    assert any((tree / d / "specdec" / "__init__.py").exists() for d in (".", "src"))  # either layout
    assert not (tree / "eval" / "results").exists()  # results files stay behind
    assert out.stat().st_size < 10 * 2**20


def test_the_near_end_inputs_run_every_request_to_max_model_len():
    """``--to-max-len``: only the code set's near-end cells, each request's max_tokens the room its prompt leaves
    (as vLLM gives a request without max_tokens); a prompt with no room stops it before any GPU work."""
    item = {"ids": [0, 5, 6], "max_tokens": 40, "source": "s"}
    sets = {
        "code": {"warmup": [item], "b1": [item], "b8": [item, {**item, "ids": [0] * 10}], "b32": [item], "s8": [item]},
        "chat": {"b8": [item]},
    }
    out = gp.to_end(sets, 64)
    assert set(out) == {"code"} and set(out["code"]) == {"warmup", "b8", "b32"}
    assert [it["max_tokens"] for it in out["code"]["b8"]] == [61, 54] and out["code"]["b8"][0]["ids"] == [0, 5, 6]
    with pytest.raises(SystemExit, match="--to-max-len 3: a code prompt has no room left"):
        gp.to_end(sets, 3)


def test_candidates_are_parsed_with_one_line_errors():
    assert gp.parse_candidates("hold48=abc123, ragged=HEAD~2") == {"hold48": "abc123", "ragged": "HEAD~2"}
    assert gp.parse_candidates("") == {}
    for bad in ("hold48", "=abc", "a b=HEAD", "x=HEAD,x=HEAD~1", "-x=HEAD"):
        with pytest.raises(SystemExit, match=r"--candidates .*: give name=COMMIT"):
            gp.parse_candidates(bad)


def test_candidates_export_one_tree_each(tmp_path):
    base = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD~1"], capture_output=True, text=True)
    if base.returncode != 0:
        pytest.skip("no git history")
    inputs = tmp_path / "device_inputs"
    stale = inputs / gp.CANDIDATES_DIR / "old"
    stale.mkdir(parents=True)  # an earlier export's tree goes
    got = gp.export_candidates("prev=HEAD~1", inputs)
    assert got == {"prev": {"commit": base.stdout.strip(), "folder": f"device_inputs/{gp.CANDIDATES_DIR}/prev"}}
    tree = inputs / gp.CANDIDATES_DIR / "prev"
    assert (tree / gp.BEFORE_STAMP).read_text().strip() == base.stdout.strip() and (tree / "pyproject.toml").exists()
    assert not stale.exists()
    assert gp.export_candidates("", inputs) == {} and not (inputs / gp.CANDIDATES_DIR).exists()  # none: all go
    with pytest.raises(SystemExit, match="--candidates no-such-ref: not a commit"):
        gp.export_candidates("x=no-such-ref", inputs)
