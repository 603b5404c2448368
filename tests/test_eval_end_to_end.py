"""About twenty whole ``specdec-eval`` runs with ``--limit 1`` as a user types them (in-process ``main(argv)``, real
drafters, tiny models for ``live``): each ends with status 0, its results JSON, and terminal output within 120
columns, with no traceback and no warning printed."""

from __future__ import annotations

import json
import pathlib

import pytest

from specdec.eval.cli import main
from specdec.paths import data_dir

WIDTH = 120


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("e2e")
    ids = root / "ids.jsonl"
    rows = [{"prompt_ids": [1, 2, 3, 1, 2, 3, 1], "response_ids": [2, 3, 1, 2, 3, 1, 2, 9]}] * 2
    ids.write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = root / "text.jsonl"
    text.write_text(json.dumps({"prompt": "def add(a, b):\n", "response": "    return a + b\n" * 3}) + "\n")
    return {"ids": ids, "text": text, "root": root}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, pathlib.Path]:
    pytest.importorskip("transformers")
    from test_eval_live import WORDS, tiny_models

    root = tmp_path_factory.mktemp("live")
    paths = tiny_models(root)
    prompts = root / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": " ".join(WORDS[:8] * 3)}) + "\n")
    long = root / "long.jsonl"
    long.write_text(json.dumps({"prompt": " ".join(WORDS * 5)}) + "\n")
    return {**paths, "prompts": prompts, "long": long}


REPLAY = [
    [],  # the main job: the built-in workload
    ["--tokenizer", "bytes", "--drafter", "suffix", "ngram"],
    ["replay", "{ids}", "--tokenizer", "none", "--drafter", "suffix", "ngram"],
    ["replay", "{text}", "--tokenizer", "bytes", "--drafter", "suffix+ngram", "--budget", "4", "8"],
    ["replay", "{ids}", "--tokenizer", "none", "--drafter", "suffix", "--tree"],
    ["replay", "{ids}", "--tokenizer", "none", "--drafter", "suffix", "--option", "suffix.max_depth=16"],
    ["replay", "{ids}", "--tokenizer", "none", "--verify-table", "1:5,9:5.2,17:5.6"],
    ["replay", "{ids}", "--tokenizer", "none", "--verify-ms", "8", "--verify-ms-per-token", "0.05"],
    ["replay", "{ids}", "--tokenizer", "none", "--batch-size", "2", "--step-csv"],
    ["replay", "{text}", "--tokenizer", "bytes", "--format", "generic", "--json", "{root}/r.json"],
    [
        "sweep",
        "{ids}",
        "--tokenizer",
        "none",
        "--drafter",
        "suffix",
        "--grid",
        "budget=4,8",
        "--grid",
        "tree=false,true",
    ],
    ["sweep", "{ids}", "--tokenizer", "none", "--drafter", "suffix", "--grid", "suffix.max_depth=16,32"],
    ["sweep", "{ids}", "--tokenizer", "none", "--config", "eval_sweep_suffix"],
    ["replay", "{ids}", "--tokenizer", "none", "--drafter", "ngram", "--option", "ngram.max_n=4", "--plots"],
]
LIVE = [
    ["--drafter", "suffix", "--max-new-tokens", "8"],
    ["--drafter", "ngram", "--tree", "--baselines", "hf-greedy", "--max-new-tokens", "8"],
    ["--drafter", "suffix", "ngram", "--baselines", "", "--max-new-tokens", "8", "--plots"],
    ["--drafter", "model", "--option", "model.backend=eager", "--baselines", "specdec-greedy", "--max-new-tokens", "8"],
    ["--drafter", "suffix", "--baselines", "hf-greedy", "--max-new-tokens", "8", "--truncate-prompts", "--long"],
]


def _run(argv: list[str], out: pathlib.Path, capsys) -> dict:
    plots = "--plots" in argv
    argv = [a for a in argv if a != "--plots"] + ["--out", str(out), "--no-progress", "--limit", "1"]
    argv += [] if plots else ["--no-plots"]
    capsys.readouterr()
    rc = main(argv)
    cap = capsys.readouterr()
    assert rc == 0, (argv, cap.err)
    assert "Traceback" not in cap.err and "warning" not in cap.err.lower() and "deprecat" not in cap.err.lower()
    wide = [line for line in cap.out.splitlines() if len(line) > WIDTH and not line.startswith("wrote ")]
    assert not wide, wide
    json_path = pathlib.Path(argv[argv.index("--json") + 1]) if "--json" in argv else out / "results.json"
    doc = json.loads(json_path.read_text())
    assert doc["results"] and (not plots or any(p.suffix == ".png" for p in out.iterdir()))
    return doc


@pytest.mark.parametrize("argv", REPLAY, ids=[" ".join(a)[:60] or "main job" for a in REPLAY])
def test_replay_and_sweep_end_to_end(files, tmp_path, capsys, monkeypatch, argv) -> None:
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("SPECDEC_DATA", raising=False)
    doc = _run([a.format(**files) for a in argv], tmp_path / "out", capsys)
    assert doc["settings"]["tokenizer"]["name"] and doc["settings"]["workload"]


@pytest.mark.skipif(not (data_dir() / "code").is_dir(), reason="../shared/data not here")
def test_a_shared_set_end_to_end(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    doc = _run(["replay", "code_alpaca", "--data", str(data_dir())], tmp_path / "out", capsys)
    assert doc["results"][0]["dataset"] == "code_alpaca" and doc["results"][0]["records"] == 1


@pytest.mark.parametrize("argv", LIVE, ids=[" ".join(a)[:60] for a in LIVE])
def test_live_end_to_end(tiny, tmp_path, capsys, argv) -> None:
    prompts = tiny["long" if "--long" in argv else "prompts"]
    flags = [a for a in argv if a != "--long"]
    if "model" in flags:
        flags += ["--option", f"model.path={tiny['draft']}"]
    base = ["live", str(prompts), "--target", str(tiny["target"]), "--draft-model", str(tiny["draft"])]
    doc = _run([*base, *flags, "--threads", "1"], tmp_path / "out", capsys)
    assert all(r["lossless_equal_prompts"] == r["prompts"] == 1 for r in doc["results"])
