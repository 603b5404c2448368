"""specdec-eval end to end (in-process): outputs, sweeps, settings, cost model, errors, --help."""

from __future__ import annotations

import json

import pytest

from specdec.config import ConfigError
from specdec.drafters import registry
from specdec.eval.cli import build_parser, main
from specdec.eval.costmodel import CostModel
from specdec.eval.records import TraceRecord
from specdec.eval.replay import replay
from specdec.eval.settings import build_settings, parse_options

SCHEMA_KEYS = (
    "mat",
    "acceptance_rate",
    "per_position_acceptance",
    "steps",
    "drafted_tokens",
    "accepted_tokens",
    "draft_us_per_token",
    "update_us_per_token",
    "emitted_tokens",
    "records",
    "response_tokens",
    "dataset",
    "drafter",
    "budget",
    "tree",
    "projected_speedup",
)


@pytest.fixture(autouse=True)
def toys(monkeypatch, tmp_path):
    monkeypatch.setitem(registry._CLASSES, "toy", "eval_toys:LookupDrafter")
    monkeypatch.setitem(registry._CLASSES, "none", "eval_toys:NothingDrafter")
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("SPECDEC_DATA", raising=False)


def run(args: list[str]) -> int:
    return main(args + ["--no-progress"])


def test_embedded_default_writes_table_json_plots(tmp_path, capsys) -> None:
    out = tmp_path / "out"
    assert run(["--drafter", "toy", "none", "--tokenizer", "bytes", "--limit", "6", "--out", str(out)]) == 0
    doc = json.loads((out / "results.json").read_text())
    assert {"settings", "versions", "results", "device"} <= set(doc)
    assert {"python", "numpy", "torch", "cpu"} <= set(doc["versions"])
    res = doc["results"]
    assert {r["dataset"] for r in res} == {"embedded_agent", "embedded_code", "embedded_chat"} and len(res) == 6
    for r in res:
        assert all(k in r for k in SCHEMA_KEYS)
    by = {(r["dataset"], r["drafter"]): r for r in res}
    assert by["embedded_agent", "none"]["mat"] == 1.0 and by["embedded_agent", "toy"]["mat"] > 2.0
    assert (out / "per_position_acceptance.png").stat().st_size > 10_000 and (out / "mat.png").exists()
    text = capsys.readouterr().out
    assert "== embedded_agent" in text and "speedup" in text and "cost model:" in text
    assert "built-in workload, tokenizer bytes" in text and doc["settings"]["tokenizer"]["name"] == "bytes"
    assert all(r["workload"] == "built-in workload" and r["tokenizer"] == "bytes" for r in res)
    assert max(len(line) for line in text.splitlines() if not line.startswith("wrote ")) <= 120
    assert text.count("columns: ") == 1 and "MAT: tokens emitted per verify step" in text  # each column said once


def test_replay_file_numbers_equal_the_engine(tmp_path) -> None:
    rows = [
        {"prompt_ids": [1, 2, 3, 1, 2], "response_ids": [3, 1, 2, 3, 9]},
        {"prompt_ids": [4, 4, 4], "response_ids": [4, 4, 5]},
    ]
    f = tmp_path / "t.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "o"
    assert (
        run(
            [
                "replay",
                str(f),
                "--drafter",
                "toy",
                "--budget",
                "3",
                "--tokenizer",
                "bytes",
                "--out",
                str(out),
                "--step-csv",
                "--no-plots",
            ]
        )
        == 0
    )
    got = json.loads((out / "results.json").read_text())["results"][0]
    from eval_toys import LookupDrafter

    ref = replay(
        LookupDrafter(),
        [TraceRecord(str(i), r["prompt_ids"], r["response_ids"]) for i, r in enumerate(rows)],
        budget=3,
        tree=False,
    )
    assert (got["steps"], got["accepted_tokens"], got["drafted_tokens"]) == (
        ref.steps,
        ref.accepted_tokens,
        ref.drafted_tokens,
    )
    assert got["mat"] == pytest.approx(ref.mat) and got["per_position_accepted"] == ref.per_position_accepted
    assert (out / "steps_t_toy_b3.csv").exists() and not (out / "mat.png").exists()


def test_sweep_is_the_cartesian_product(tmp_path) -> None:
    out = tmp_path / "s"
    assert (
        run(
            [
                "sweep",
                "--drafter",
                "toy",
                "--grid",
                "toy.max_n=2,4",
                "--grid",
                "budget=4,8",
                "--tokenizer",
                "bytes",
                "--limit",
                "3",
                "--out",
                str(out),
                "--no-plots",
            ]
        )
        == 0
    )
    res = json.loads((out / "results.json").read_text())["results"]
    labels = sorted({r["label"] for r in res})
    assert labels == sorted(["toy[max_n=2] b4", "toy[max_n=2] b8", "toy[max_n=4] b4", "toy[max_n=4] b8"])
    assert {r["drafter_config"]["max_n"] for r in res} == {2, 4}


def test_settings_from_yaml_preset_and_flags(tmp_path) -> None:
    p = tmp_path / "p.yaml"
    p.write_text("drafters: [toy, toy+none]\noptions: {toy: {max_n: 3}}\nbudget: [4, 8]\n")
    s = build_settings(drafters=None, options=["toy.min_n=1"], budgets=None, tree=None, preset=str(p))
    assert [x.label for x in s] == [
        "toy[max_n=3,min_n=1] b4",
        "toy[max_n=3,min_n=1] b8",
        "toy+none[toy.max_n=3,toy.min_n=1] b4",
        "toy+none[toy.max_n=3,toy.min_n=1] b8",
    ]
    assert parse_options(["suffix.max_depth=32", "model.path=/x"]) == {
        "suffix": {"max_depth": 32},
        "model": {"path": "/x"},
    }
    with pytest.raises(ConfigError, match="unknown key"):
        p.write_text("drafter: [toy]\n")
        build_settings(drafters=None, budgets=None, tree=None, preset=str(p))
    with pytest.raises(ConfigError, match="must name the drafter"):
        parse_options(["max_depth=3"])


def test_cost_model_formula() -> None:
    cm = CostModel(t1_ms=10.0, per_token_ms=1.0)
    # MAT 3, 4 drafted per step -> verify t(5) = 14 ms; draft+update 2 us/token * 300 tokens / 100 steps = 0.006 ms
    r = {
        "mat": 3.0,
        "drafted_per_step": 4.0,
        "steps": 100,
        "emitted_tokens": 300,
        "draft_us_per_token": 1.5,
        "update_us_per_token": 0.5,
    }
    p = cm.project(r)
    assert p["verify_ms_per_step"] == pytest.approx(14.0)
    assert p["projected_speedup"] == pytest.approx(3 * 10.0 / (14.0 + 0.006))
    assert p["hidden_draft_speedup"] == pytest.approx(3 * 10.0 / 14.0)
    table = CostModel.parse_table("1:5,9:7")
    assert table.verify_ms(5) == pytest.approx(6.0) and table.verify_ms(20) == 7.0 and table.base_ms == 5.0
    with pytest.raises(ValueError, match="n:ms pairs"):
        CostModel.parse_table("1-5")


@pytest.mark.parametrize(
    "args, pattern",
    [
        (["replay", "missing.jsonl"], "missing.jsonl: no such file"),
        (["replay", "--drafter", "nosuch"], "drafter=.nosuch. is unknown"),
        (["replay", "--drafter", "toy", "--option", "toy.bogus=1"], "unknown key.*bogus"),
        (["replay", "code_alpaca", "--data", "/nonexistent"], "missing file for trace set 'code_alpaca'"),
    ],
)
def test_cli_errors_are_one_line_and_write_nothing(tmp_path, capsys, args, pattern) -> None:
    out = tmp_path / "never"
    assert run(args + ["--out", str(out), "--tokenizer", "bytes"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("specdec-eval: error:")
    import re

    assert re.search(pattern, err[0]), err[0]
    assert not out.exists() and not any(p.name.startswith(".never") for p in tmp_path.iterdir())


def test_vocab_mismatch_is_reported(tmp_path, capsys) -> None:
    f = tmp_path / "ids.jsonl"
    f.write_text(json.dumps({"prompt_ids": [1], "response_ids": [999]}) + "\n")
    assert run(["replay", str(f), "--drafter", "toy", "--tokenizer", "bytes", "--out", str(tmp_path / "o")]) == 2
    assert "token id 999 >= vocab size 256" in capsys.readouterr().err


def test_every_option_has_help() -> None:
    parser = build_parser()
    subs = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    for name, sp in subs.choices.items():
        for action in sp._actions:
            if action.dest != "help":
                assert action.help and len(action.help) > 10, f"{name} {action.option_strings or action.dest}"


def test_real_default_drafters_if_present(tmp_path) -> None:
    try:
        registry.drafter_class("suffix"), registry.drafter_class("ngram")
    except ImportError:
        pytest.skip("suffix/ngram drafters not implemented yet")
    out = tmp_path / "d"
    assert run(["--out", str(out), "--tokenizer", "bytes", "--limit", "10"]) == 0
    res = json.loads((out / "results.json").read_text())["results"]
    assert {r["drafter"] for r in res} == {"suffix", "ngram"}
    assert all(r["draft_errors"] == 0 and r["budget_violations"] == 0 for r in res)
    agent = {r["drafter"]: r["mat"] for r in res if r["dataset"] == "embedded_agent"}
    assert min(agent.values()) > 1.5  # copy-heavy workload: both drafters must accept a lot
