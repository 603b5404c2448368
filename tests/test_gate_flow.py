"""The GPU gate's whole flow on the CPU: the driver with fake engines (two lanes, the before tree on its own path,
re-runs, the wall budget), the report's merge, the shell script's options, and the serve part on fake servers."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from benchmarks import (
    gate,
    gate_args,
    gate_compare,
    gate_metrics,
    gate_report,
    gate_serve,
    gate_serve_report,
    gate_worker,
)
from benchmarks.gate_prompts import BATCH
from specdec.paths import REPO_ROOT

CELLS = {"warmup": 2, "b1": 2, "b8": 3, "b32": 3, "b64": 3}


def _inputs(path: Path) -> Path:
    """A small gate inputs file: every prompt distinct, recorded-style max_tokens."""
    sets, n = {}, 0
    for name in gate.SETS:
        cells = {}
        for cell, k in {**CELLS, **({"s8": 2} if name == "code" else {})}.items():
            cells[cell] = [
                {"ids": [0, 100 + n + i, 7, 8, 9], "max_tokens": 32 + 8 * i, "source": f"t{n + i}"} for i in range(k)
            ]
            n += k
        sets[name] = cells
    doc = {
        "commit": "c" * 40,
        "dirty": False,
        "before": {"commit": "b" * 40},
        "batch": BATCH,
        "policy": "t",
        "sets": sets,
    }
    path.write_text(json.dumps(doc))
    return path


def _serve_argv(tmp_path: Path) -> list[str]:
    """A fake serve call of the tpot-53m check on two GPUs, its inputs and output under ``tmp_path``."""
    argv = ["--part", "serve", "--fake", "--gpus", "2", "--checks", "tpot-53m", "--out-dir", str(tmp_path)]
    return argv + ["--work-dir", str(tmp_path / "w"), "--inputs", str(_inputs(tmp_path / "inputs.json"))]


def _before(tmp: Path) -> Path:
    """A stand-in base tree: a ``specdec`` package of its own and the commit stamp gpu_gate.sh copies beside it."""
    (tmp / "before" / "specdec").mkdir(parents=True)
    (tmp / "before" / "specdec" / "__init__.py").write_text('"""the base tree"""\n')
    (tmp / "before" / "specdec" / "drafters").mkdir()  # its native suffix core, as a stand-in module
    for name in ("__init__.py", "_suffix_native.py"):
        (tmp / "before" / "specdec" / "drafters" / name).write_text('"""stand-in"""\n')
    (tmp / "before" / "GATE_COMMIT").write_text("b" * 40 + "\n")
    return tmp / "before"


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gate")
    inputs, out = _inputs(tmp / "inputs.json"), tmp / "out"
    argv = ["--fake", "--gpus", "2", "--inputs", str(inputs), "--out-dir", str(out), "--work-dir", str(tmp / "w")]
    gate.main([*argv, "--before-path", str(_before(tmp))])
    (path,) = out.glob("*_gate_tp1_ccccccc.json")
    return json.loads(path.read_text()), path, tmp


def test_dry_run_writes_every_engine_and_cell(dry_run):
    doc, path, _ = dry_run
    engines = doc["gates"]["tp1"]["engines"]
    assert set(engines) == {"nospec", "suffix", "specdec", "specdec-before"}
    keys = {f"{s}/{c}" for s in gate.SETS for c in CELLS if c != "warmup"} | {"code/s8"}
    for m, eng in engines.items():
        assert set(eng["cells"]) == keys, m
        assert eng["kv_tokens"] > 0 and eng["start_s"] > 0 and not eng["partial"] and eng["rc"] == 0
    assert all(len(c["runs"]) == 2 for c in engines["nospec"]["cells"].values())  # no speculation: twice
    assert engines["suffix"]["resolved_speculative_config"]["method"] == "suffix"
    assert engines["nospec"]["gpus"] == "0" and engines["suffix"]["gpus"] == "1"  # two lanes
    assert path.with_suffix(".md").exists() and Path(str(path)[:-5] + "_engines.log").exists()
    src = doc["sources"][0]
    assert src["commit"] == "c" * 40 and src["before_commit"] == "b" * 40 and not src["partial"]
    assert src["device"]["label"] == "fakex2" and src["device"]["cpu_count"] > 0
    assert {"vllm", "torch", "transformers", "arctic-inference", "specdec_commit"} <= set(src["versions"])


def test_before_engine_imports_its_own_tree(dry_run):
    doc, _, tmp = dry_run
    engines = doc["gates"]["tp1"]["engines"]
    before = engines["specdec-before"]["origin"]["worker"]
    assert before["file"] == str(tmp / "before" / "specdec" / "__init__.py") and before["commit"] == "b" * 40
    assert not engines["specdec"]["origin"]["worker"]["file"].startswith(str(tmp))


def test_dry_run_verdicts(dry_run):
    doc, _, _ = dry_run
    v = doc["verdicts"]["tp1"]
    assert v["overall"] == "PASS" and not v["void"]
    cell = v["cells"]["code/b8"]
    assert cell["vs_nospec"][0] == "PASS" and cell["vs_suffix"] == "PASS" and cell["x_rerun"] is None
    # the fake before engine emits one token per step at a higher step cost: re-run, and still under 0.99
    before = doc["gates"]["tp1"]["engines"]["specdec-before"]["cells"]["chat/b32"]
    assert "rerun" in before and before["rerun"]["tokens_per_s"] < before["rerun"]["reference_tokens_per_s"]
    row = gate_report.cell_row("chat/b32", doc["gates"]["tp1"]["engines"])
    assert row["specdec-before"]["vs_nospec"][0] == "FAIL" and row["specdec"]["mismatch"] == 0
    eng = {e["method"]: e for e in v["engines"]}
    assert eng["specdec"]["start"] == "PASS" and eng["specdec-before"]["start"] == "FAIL"
    assert eng["specdec-before"]["kv"] == "FAIL"  # 95% of nospec's KV tokens


def test_table_fits_120_columns(dry_run):
    doc, _, _ = dry_run
    text = gate_report.render(doc)
    assert "GATE: PASS" in text and "agentic b64" in text and "code s8" in text
    assert max(map(len, text.splitlines())) <= gate_report.WIDTH


def test_merge_of_two_halves_judges_as_one(dry_run):
    doc, _, _ = dry_run
    engines = doc["gates"]["tp1"]["engines"]
    halves = []
    for methods in (("nospec", "specdec"), ("suffix", "specdec-before")):
        gate_doc = {**doc["gates"]["tp1"], "engines": {m: engines[m] for m in methods}}
        halves.append({**doc, "gates": {"tp1": gate_doc}})
    alone = gate_report.gate_verdicts(halves[0]["gates"]["tp1"])
    assert "vs_suffix" not in alone["cells"][0]["specdec"]  # no suffix engine in this half
    merged = gate_report.merge(halves)
    assert gate_report.gate_verdicts(merged["gates"]["tp1"]) == gate_report.gate_verdicts(doc["gates"]["tp1"])
    assert len(merged["sources"]) == 2
    partial = {**engines["specdec"], "cells": dict(list(engines["specdec"]["cells"].items())[:2])}
    again = gate_report.merge([doc, {**doc, "gates": {"tp1": {"engines": {"specdec": partial}}}}])
    assert again["gates"]["tp1"]["engines"]["specdec"] == engines["specdec"]  # the run with more cells wins


def test_report_cli_merges_files(dry_run, tmp_path, capsys):
    doc, path, _ = dry_run
    serve = {"kind": gate_report.KIND, "gates": {}, "serve": {"tpot-53m": _tpot(4.0, 4.1)}, "sources": []}
    (tmp_path / "serve.json").write_text(json.dumps(serve))
    gate_report.main([str(path), str(tmp_path / "serve.json"), "--out", str(tmp_path / "merged.json")])
    text = capsys.readouterr().out
    assert "GATE: PASS" in text and "tpot-53m" in text
    merged = json.loads((tmp_path / "merged.json").read_text())
    assert merged["verdicts"]["serve"][0]["verdict"] == "PASS" and merged["verdicts"]["tp1"]["overall"] == "PASS"
    with pytest.raises(SystemExit, match="not a gate results file"):
        gate_report.merge([{"kind": "other"}])


def _tpot(none_ms: float, spec_ms: float) -> dict:
    servers = {"nospec": {"bench": {"median_tpot_ms": none_ms}}, "specdec": {"bench": {"median_tpot_ms": spec_ms}}}
    servers["specdec"].update(start_s=100.0, answered=True, spec={"emitted_per_step": 1.1})
    return {"kind": "tpot", "model": "m", "tp": 1, "servers": servers}


def test_serve_rows_verdicts():
    rows = gate_serve_report.serve_rows(
        {
            "a": _tpot(4.0, 4.12),  # 1.03: within 3%
            "b": _tpot(4.01, 8.73),
            "c": {"kind": "start", "skipped": "needs 2 GPUs, 1 here"},
            "d": {"kind": "start", "servers": {"specdec-tp2": {"error": "server exited with code 1"}}},
        }
    )
    got = {r["check"]: r["verdict"] for r in rows}
    assert got == {
        "a": "PASS",
        "a specdec serves": "PASS",
        "b": "FAIL",
        "b specdec serves": "PASS",
        "c": "-",
        "d specdec-tp2 serves": "FAIL",
    }


def test_worker_stops_at_its_deadline(tmp_path):
    inputs, out = _inputs(tmp_path / "inputs.json"), tmp_path / "w.json"
    argv = ["--inputs", str(inputs), "--method", "nospec", "--sets", "code", "--out", str(out), "--fake"]
    gate_worker.main([*argv, "--deadline", str(time.time() + 1)])
    res = json.loads(out.read_text())
    assert res["cells"] == {} and res["partial"] and "code/b1" in res["skipped"]
    # 15 s left, two repeats a cell, estimated from CELL_EST_S until measured: b1 (2 x 20 s) and b64 (2 x 8 s)
    # do not fit, b8 and b32 (2 x 6 s) and s8 (2 x 4 s) do
    gate_worker.main([*argv, "--deadline", str(time.time() + 15)])
    res = json.loads(out.read_text())
    assert res["skipped"] == ["code/b1", "code/b64"] and set(res["cells"]) == {"code/b8", "code/b32", "code/s8"}


def test_driver_budget_starts_no_engine_it_cannot_finish(tmp_path, capsys):
    inputs = _inputs(tmp_path / "inputs.json")
    budget = gate_args.FINISH_MARGIN_S + gate.ENGINE_START_EST_S + gate.MIN_CELLS_S - 5
    gate.main(
        ["--fake", "--inputs", str(inputs), "--out-dir", str(tmp_path), "--work-dir", str(tmp_path / "w")]
        + ["--methods", "nospec,specdec", "--max-wall-s", str(budget)]
    )
    (path,) = tmp_path.glob("*_gate_tp1_*.json")
    doc = json.loads(path.read_text())
    assert doc["gates"]["tp1"]["skipped"] == ["nospec", "specdec"] and doc["sources"][0]["partial"]
    assert "not run or no result (see the log): nospec, specdec" in capsys.readouterr().out


def _ns(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"fake": True, "gpus": 2, "tp": 1, "methods": list(gate.DEFAULT_METHODS), **kw})


def test_lanes():
    two = gate.lanes(_ns())
    assert [ln["methods"] for ln in two] == [["nospec", "specdec"], ["suffix", "specdec-before"]]
    assert [ln["gpus"] for ln in two] == ["0", "1"]
    assert not set(two[0]["cpus"]) & set(two[1]["cpus"])
    (one,) = gate.lanes(_ns(tp=2))
    assert one["gpus"] == "0,1" and one["methods"] == list(gate.DEFAULT_METHODS) and one["cpus"] == []
    assert len(gate.lanes(_ns(gpus=1))) == 1


def test_lanes_on_four_gpus():
    four = gate.lanes(_ns(gpus=4))  # TP=1: one engine per GPU, a quarter of the cores each
    assert [ln["methods"] for ln in four] == [[m] for m in gate.DEFAULT_METHODS]
    assert [ln["gpus"] for ln in four] == ["0", "1", "2", "3"]
    cpus = [set(ln["cpus"]) for ln in four]
    assert all(not a & b for i, a in enumerate(cpus) for b in cpus[i + 1 :])
    pairs = gate.lanes(_ns(gpus=4, tp=2))  # TP=2: two engines of two GPUs at once, no speculation first
    assert [ln["methods"] for ln in pairs] == [["nospec", "specdec"], ["suffix", "specdec-before"]]
    assert [ln["gpus"] for ln in pairs] == ["0,1", "2,3"]


def test_bad_options_stop_before_anything_starts(tmp_path, capsys):
    inputs = str(_inputs(tmp_path / "inputs.json"))
    for argv, msg in (
        (["--methods", "nospec,eagle"], "--methods: 'eagle' is unknown; valid: nospec, suffix"),
        (["--sets", "code,math"], "--sets: 'math' is unknown"),
        (["--methods", "specdec-before"], "no installed base tree at"),
        (["--part", "serve", "--checks", "tpot-70b"], "--checks: 'tpot-70b' is unknown"),
        (["--part", "serve", "--serve-methods", "eagle"], "--serve-methods: 'eagle' is unknown; valid: nospec"),
        (["--inputs", str(_near_end(tmp_path)), "--sets", "agentic"], "--sets: 'agentic' is not in "),
    ):
        with pytest.raises(SystemExit):
            gate.main(["--fake", "--inputs", inputs, "--before-path", str(tmp_path / "none"), *argv])
        assert msg in capsys.readouterr().err


def _script(*args: str, out: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUT": str(out), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run(
        ["bash", str(REPO_ROOT / "scripts" / "gpu_gate.sh"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def test_script_help_and_dry_run_reach_the_driver(tmp_path):
    helped = _script("--help", out=tmp_path)
    assert helped.returncode == 0 and "--max-wall-s" in helped.stdout and "--dry-run" in helped.stdout
    inputs = _inputs(tmp_path / "inputs.json")
    run = _script("--dry-run", "--methods", "nospec,specdec", "--sets", "code", "--inputs", str(inputs), out=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    (path,) = tmp_path.glob("*_gate_tp1_ccccccc_nospec-specdec_code.json")
    doc = json.loads(path.read_text())
    assert set(doc["gates"]["tp1"]["engines"]) == {"nospec", "specdec"}
    assert all(k.startswith("code/") for k in doc["gates"]["tp1"]["engines"]["specdec"]["cells"])
    assert doc["sources"][0]["command"].startswith("bash scripts/gpu_gate.sh --dry-run --methods nospec,specdec")


def test_serve_part_on_fake_servers(tmp_path):
    gate.main(_serve_argv(tmp_path))
    (path,) = tmp_path.glob("*_gate_serve_ccccccc.json")
    doc = json.loads(path.read_text())
    servers = doc["serve"]["tpot-53m"]["servers"]
    assert servers["nospec"]["bench"]["median_tpot_ms"] > 0 and servers["specdec"]["bench"]["completed"] == 600
    assert servers["specdec"]["answered"] and servers["specdec"]["spec"]["emitted_per_step"] > 1
    assert {servers["nospec"]["gpus"], servers["specdec"]["gpus"]} == {"0", "1"}  # started at once, a GPU each
    windows = servers["nospec"]["bench_runs"]  # one measured run of 600 requests, seen as three windows of 200
    assert len(windows) == gate_serve.BENCH_WINDOWS == 3 and [w["completed"] for w in windows] == [200] * 3
    assert all(w["median_tpot_ms"] > 0 and w["median_itl_ms"] > 0 for w in windows)
    row = doc["verdicts"]["serve"][0]
    assert row["verdict"] in ("PASS", "FAIL") and len(row["runs"]) == 3
    assert row["ratio"] == pytest.approx(sorted(row["runs"])[1])  # the median of the windows' ratios


def test_serve_swap_puts_specdec_on_the_first_gpu_and_records_each_servers_cores(tmp_path):
    """``--serve-swap``: the same check with the pair's GPUs (and cores) exchanged, so that two calls show what the
    placement does; the verdict still reads specdec against no speculation."""
    gate.main([*_serve_argv(tmp_path), "--serve-swap"])
    (path,) = tmp_path.glob("*_gate_serve_ccccccc.json")
    servers = json.loads(path.read_text())["serve"]["tpot-53m"]["servers"]
    assert list(servers)[:2] == ["specdec", "nospec"]
    assert (servers["specdec"]["gpus"], servers["nospec"]["gpus"]) == ("0", "1")
    assert all(servers[k]["cores"] for k in ("specdec", "nospec"))  # where each ran, recorded
    with pytest.raises(SystemExit):
        gate.main([*_serve_argv(tmp_path), "--serve-swap", "--before-round"])


def test_a_serve_check_that_cannot_finish_says_what_it_needs_and_what_was_left(tmp_path, capsys):
    """A call whose ``--max-wall-s`` cannot cover a check skips it at once and says the estimate, so that the next
    call asks for enough (a round skipped in silence costs the call's device time)."""
    argv = ["--part", "serve", "--fake", "--gpus", "2", "--checks", "tpot-53m", "--out-dir", str(tmp_path)]
    gate.main([*argv, "--max-wall-s", "60", "--work-dir", str(tmp_path / "w")])
    (path,) = tmp_path.glob("*_gate_serve_*.json")
    skipped = json.loads(path.read_text())["serve"]["tpot-53m"]["skipped"]
    need, left = (float(x) for x in re.fullmatch(r"time: (\d+) s > (\d+) s left", skipped).groups())
    assert need > left and left <= 60
    out = capsys.readouterr().out
    assert f"gate: tpot-53m not run: {skipped}" in out and f"not run: {skipped}" in out  # the log and the table
    assert len(f"not run: {skipped}") <= 33  # the serve table's note column


def test_engine_info_records_kv_tokens_and_resolved_configs():
    from types import SimpleNamespace as NS

    spec = NS(method="custom_class", model="specdec.vllm_plugin.proposer.SpecdecProposer", num_speculative_tokens=16)
    cfg = NS(
        cache_config=NS(num_gpu_blocks=1000, block_size=16, gpu_memory_utilization=0.9, enable_prefix_caching=True),
        speculative_config=spec,
        additional_config={"specdec": {}},
        scheduler_config=NS(async_scheduling=True, max_num_seqs=1024, max_num_batched_tokens=8192),
    )
    info = gate_worker.engine_info(NS(llm_engine=NS(vllm_config=cfg)))
    assert info["kv_tokens"] == 16_000 and info["resolved_speculative_config"]["num_speculative_tokens"] == 16
    assert info["specdec_options"]["num_speculative_tokens"] == 16 and "drafter" in info["specdec_options"]
    assert info["engine_config"]["max_num_seqs"] == 1024 and info["engine_config"]["max_model_len"] is None
    suffix = NS(**{**vars(cfg), "speculative_config": NS(method="suffix", suffix_decoding_max_tree_depth=24)})
    assert gate_worker.engine_info(NS(llm_engine=NS(vllm_config=suffix)))["specdec_options"] is None


def test_origin_notes_flag_a_wrong_tree(dry_run):
    doc, _, _ = dry_run
    gate_doc = doc["gates"]["tp1"]
    assert gate_report.origin_notes(gate_doc, doc["sources"]) == []
    before = dict(gate_doc["engines"]["specdec-before"])
    before["origin"] = {"worker": {"file": "/site/specdec/__init__.py", "commit": None}, "engine": [{"file": "/x"}]}
    notes = gate_report.origin_notes({"engines": {"specdec-before": before}}, doc["sources"])
    assert any("engine workers import specdec from /x" in n for n in notes)
    assert any("not " + "b" * 40 in n for n in notes)


def test_serve_references_run_in_rounds_and_get_rows(tmp_path):
    argv = _serve_argv(tmp_path)
    gate.main([*argv, "--serve-methods", "specdec-schedule,nospec-v1,specdec-before"])
    (path,) = tmp_path.glob("*_gate_serve_ccccccc.json")
    doc = json.loads(path.read_text())
    servers = doc["serve"]["tpot-53m"]["servers"]
    assert list(servers) == ["nospec", "specdec", "specdec-schedule", "nospec-v1", "specdec-before"]
    assert [servers[k]["gpus"] for k in servers] == ["0", "1", "0", "1", "0"]  # two per round, a GPU each
    rows = {r["check"]: r for r in doc["verdicts"]["serve"]}
    assert rows["tpot-53m"]["verdict"] in ("PASS", "FAIL")  # the verdict reads nospec and specdec only
    for ref in ("specdec-schedule", "nospec-v1", "specdec-before"):
        row = rows[f"tpot-53m {ref}"]
        ratio = gate_compare.serve_ratio(servers[ref], servers["nospec"])  # the median of the windows' ratios
        assert row["verdict"] == "-" and row["ratio"] == pytest.approx(ratio)
    assert rows["tpot-53m nospec-v1"]["emit"] is None and rows["tpot-53m specdec-before"]["emit"] > 1


def test_once_per_issue_references_get_their_own_table(tmp_path):
    """vLLM ngram, the synchronous path and no speculation on the V1 runner: run once per issue, shown beside the
    cells (x nospec, emit) without verdicts; the default table has no such block."""
    argv = ["--fake", "--gpus", "2", "--inputs", str(_inputs(tmp_path / "inputs.json")), "--sets", "code"]
    argv += ["--out-dir", str(tmp_path / "out"), "--work-dir", str(tmp_path / "w")]
    gate.main([*argv, "--methods", "nospec,specdec,ngram,specdec-sync,nospec-v1"])
    (path,) = (tmp_path / "out").glob("*_gate_tp1_ccccccc_*_code.json")
    doc = json.loads(path.read_text())
    assert set(doc["gates"]["tp1"]["engines"]) == {"nospec", "specdec", "ngram", "specdec-sync", "nospec-v1"}
    text = gate_report.render(doc)
    head = next(line for line in text.splitlines() if "ngram ×nospec" in line)
    assert "nospec-v1 ×nospec" in head and "specdec-sync ×nospec" in head
    rows = gate_report.gate_verdicts(doc["gates"]["tp1"])["cells"]
    assert all(r["ngram"]["x_nospec"] > 1 and "vs_nospec" not in r["ngram"] for r in rows)
    assert gate_report.render_references([{"key": "code/b1", "specdec": {}, "suffix": {}}]) == []


def test_the_no_draft_server_runs_the_defaults_with_drafts_of_depth_zero():
    """``specdec-nodraft``: a valid specdec config whose suffix drafter, as the plugin resolves it, drafts nothing."""
    from benchmarks.bench_vllm_methods import _spec_config
    from benchmarks.gate_serve import SERVE_SPECS
    from specdec.drafters.base import DraftRequest
    from specdec.drafters.suffix import SuffixDrafter
    from specdec.vllm_plugin.entry.options import SpecdecOptions

    spec, env = SERVE_SPECS["specdec-nodraft"]
    assert spec["method"] == "specdec" and env == {}
    bench = _spec_config("specdec-nodraft", {})  # the vLLM benchmark's engine of the same name (its step trace)
    assert bench is not None and bench["drafter_options"] == spec["drafter_options"]
    opts = SpecdecOptions.from_dict({k: v for k, v in spec.items() if k != "method"})
    drafter = SuffixDrafter(SuffixDrafter.Config(**opts.resolved_drafter_options()["suffix"]))
    drafter.start("a", [1, 2, 3] * 8)  # a loop any suffix drafter would continue
    chains = drafter.draft_chains([DraftRequest("a", 16), DraftRequest("a", 16, free=True)])
    assert [list(tokens) for tokens, _ in chains] == [[], []]


def test_every_serve_server_the_gate_accepts_is_one_gate_serve_can_start():
    """``gate_args.SERVE_METHODS`` (checked at the command line, before gate_serve is imported) names SERVE_SPECS's
    keys."""
    from benchmarks.gate_args import SERVE_METHODS
    from benchmarks.gate_serve import SERVE_SPECS

    assert tuple(SERVE_SPECS) == SERVE_METHODS


def test_serve_checks_at_other_rates_run_on_the_same_servers_and_are_kept_apart(tmp_path):
    """``--serve-rate 20,inf``: each server runs the issue's 20/s and then all at once, two checks on the same
    servers (one start each), ``tpot-53m`` and ``tpot-53m@inf`` (a merge keeps both); a rate that is not one stops
    the command."""
    argv = _serve_argv(tmp_path)
    gate.main([*argv, "--serve-rate", "20,inf"])
    (path,) = tmp_path.glob("*_gate_serve_ccccccc.json")
    doc = json.loads(path.read_text())
    assert list(doc["serve"]) == ["tpot-53m", "tpot-53m@inf"] and doc["serve"]["tpot-53m@inf"]["rate"] == "inf"
    first, load = (doc["serve"][k]["servers"] for k in ("tpot-53m", "tpot-53m@inf"))
    assert first["specdec"]["start_s"] == load["specdec"]["start_s"] and first["specdec"]["answered"]
    assert load["specdec"]["bench"]["completed"] == 600 and len(load["nospec"]["bench_runs"]) == 3
    assert "plugin" not in load["specdec"]  # the plugin's totals since the start: on the first check only
    assert [r["check"] for r in doc["verdicts"]["serve"] if r["verdict"] != "-"][:1] == ["tpot-53m"]
    assert any(r["check"] == "tpot-53m@inf" for r in doc["verdicts"]["serve"])
    serves = [r["check"] for r in doc["verdicts"]["serve"] if r["check"].endswith(" serves")]
    assert serves == ["tpot-53m specdec serves"]  # started and answered once, judged once (not again at inf)
    for bad in ("0", "fast", "20,-1", "c0", "c", "c1.5"):
        with pytest.raises(SystemExit):
            gate.main([*argv, "--serve-rate", bad])


def test_a_concurrency_rate_sends_all_at_once_with_at_most_n_in_flight(tmp_path):
    """``--serve-rate c50``: `vllm bench serve --request-rate inf --max-concurrency 50` on the same servers, recorded as
    ``<check>@c50``, its time estimate by waves of 50."""
    from benchmarks import gate_serve

    argv = _serve_argv(tmp_path)
    gate.main([*argv, "--serve-rate", "20,c50"])
    (path,) = tmp_path.glob("*_gate_serve_ccccccc.json")
    doc = json.loads(path.read_text())
    assert list(doc["serve"]) == ["tpot-53m", "tpot-53m@c50"] and doc["serve"]["tpot-53m@c50"]["rate"] == "c50"
    sent = json.loads((tmp_path / "w" / "serve" / "specdec-run@c50.result.json").read_text())
    # at cN a window is CONCURRENCY_WINDOW_WAVES x N requests: 3 windows of 300 at c50 (of 200 at 20/s)
    assert (sent["request_rate"], sent["max_concurrency"], sent["completed"]) == ("inf", 50, 900)
    windows = doc["serve"]["tpot-53m@c50"]["servers"]["specdec"]["bench_runs"]
    assert [w["completed"] for w in windows] == [300] * 3
    assert [gate_serve.window_prompts(r) for r in ("20", "inf", "c10", "c100")] == [200, 200, 200, 600]
    assert gate_serve.rate_flags("c4") == ["--request-rate", "inf", "--max-concurrency", "4"]
    assert gate_serve.rate_flags("20") == ["--request-rate", "20"]
    assert gate_serve.arrivals_s("c100") == 18 * gate_serve.WAVE_EST_S  # 1,800 requests, 100 at a time


def test_the_base_commit_is_the_installed_tree_s(tmp_path):
    """The results name the base tree the specdec-before engine ran (its GATE_COMMIT stamp), not the one the inputs
    were exported with, where the two differ (a tree swapped in for one call)."""
    from benchmarks.gate_env import load_inputs

    inputs = tmp_path / "gate_inputs.json"
    inputs.write_text(json.dumps({"commit": "a" * 40, "before": {"commit": "b" * 40}}))
    assert load_inputs(str(inputs), str(tmp_path / "none"))["before"]["commit"] == "b" * 40
    (tmp_path / "tree").mkdir()
    (tmp_path / "tree" / "GATE_COMMIT").write_text("c" * 40 + "\n")
    assert load_inputs(str(inputs), str(tmp_path / "tree"))["before"]["commit"] == "c" * 40
    assert load_inputs(str(tmp_path / "missing.json"), str(tmp_path / "tree")) == {"before": {"commit": "c" * 40}}


def test_an_engine_is_budgeted_by_the_starts_this_machine_already_saw(tmp_path):
    """A warm machine (engines started before, vLLM's compile cache filled) budgets an engine start at
    START_EST_MARGIN x the slowest start it saw, never more than ENGINE_START_EST_S; a cold one at the latter."""
    from types import SimpleNamespace as NS

    run = NS(args=NS(work_dir=str(tmp_path)))
    assert gate.CellsRun.start_estimate(run) == gate.ENGINE_START_EST_S
    (tmp_path / "tp2").mkdir()
    (tmp_path / "tp2" / "specdec.json").write_text(json.dumps({"start_s": 59.0}))
    (tmp_path / "tp2" / "nospec.json").write_text(json.dumps({"start_s": 76.0}))
    (tmp_path / "tp2" / "broken.json").write_text("{")
    assert gate.CellsRun.start_estimate(run) == pytest.approx(gate.START_EST_MARGIN * 76.0)
    (tmp_path / "tp2" / "slow.json").write_text(json.dumps({"start_s": 400.0}))
    assert gate.CellsRun.start_estimate(run) == gate.ENGINE_START_EST_S


def test_a_crossed_before_after_call_runs_two_pairs_on_swapped_gpus(tmp_path):
    """``specdec.2`` / ``specdec-before.2``: a second engine pair in the same call. On two GPUs the lanes cross
    them (GPU 0: nospec, specdec, specdec-before.2; GPU 1: suffix, specdec-before, specdec.2), so each pair compares
    engines at the same place in their lanes and the two pairs sit on opposite GPUs; a cell's before/after ratio is
    the geometric mean of the pairs'."""
    inputs = _inputs(tmp_path / "inputs.json")
    methods = "nospec,suffix,specdec,specdec-before,specdec-before.2,specdec.2"
    argv = ["--fake", "--gpus", "2", "--inputs", str(inputs), "--out-dir", str(tmp_path / "out")]
    gate.main([*argv, "--work-dir", str(tmp_path / "w"), "--before-path", str(_before(tmp_path)), "--methods", methods])
    (path,) = (tmp_path / "out").glob("*_gate_tp1_*.json")
    doc = json.loads(path.read_text())
    engines = doc["gates"]["tp1"]["engines"]
    assert {m: e["gpus"] for m, e in engines.items() if m.startswith("specdec")} == {
        "specdec": "0",
        "specdec-before": "1",
        "specdec-before.2": "0",
        "specdec.2": "1",
    }
    before_tree = str(tmp_path / "before" / "specdec" / "__init__.py")
    assert engines["specdec-before.2"]["origin"]["worker"]["file"] == before_tree
    assert engines["specdec.2"]["origin"]["worker"]["file"] != before_tree
    assert engines["specdec.2"]["resolved_speculative_config"]["method"] == "specdec"
    assert "rerun" not in json.dumps(engines["specdec.2"]["cells"])  # a replica is never re-run
    tp1 = doc["verdicts"]["before_after"]["tps"]["tp1"]
    assert len(tp1["pairs"]) == 2
    text = path.with_suffix(".md").read_text()
    assert "pairs (each a geomean; the cell is theirs):" in text and "specdec.2 ×nospec" in text


def test_replica_methods_are_named_and_checked_before_anything_starts(tmp_path, capsys):
    assert gate_worker.base_method("specdec-before.2") == "specdec-before" and gate_worker.known_method("specdec.3")
    assert not gate_worker.known_method("specdec.1") and not gate_worker.known_method("eagle.2")
    inputs = str(_inputs(tmp_path / "inputs.json"))
    for methods, msg in (
        ("nospec,specdec.1", "--methods: 'specdec.1' is unknown"),
        ("nospec,specdec,specdec", "names an engine twice; a second engine is <method>.2"),
        ("nospec,specdec-before.2", "--methods specdec-before.2: no installed base tree at"),
    ):
        with pytest.raises(SystemExit):
            gate.main(["--fake", "--inputs", inputs, "--before-path", str(tmp_path / "none"), "--methods", methods])
        assert msg in capsys.readouterr().err


def _near_end(tmp: Path) -> Path:
    """Near-end inputs (``gate_prompts --to-max-len 2048``): the code set's batches of 8 and 32 only."""
    doc = json.loads(_inputs(tmp / "inputs.json").read_text())
    doc["max_model_len"], doc["sets"] = 2048, {"code": {c: doc["sets"]["code"][c] for c in ("b8", "b32")}}
    (tmp / "end.json").write_text(json.dumps(doc))
    return tmp / "end.json"


def test_near_end_inputs_get_their_own_key_engines_and_file(tmp_path):
    """Inputs with a max_model_len (``gate_prompts --to-max-len``) are a gate of their own: results under
    ``tp1_mml<M>`` (work folder, results key and file name), the engine setting recorded, the inputs' sets run
    without ``--sets``; the default inputs' no speculation is never their reference."""
    inputs = _near_end(tmp_path)
    assert gate.gate_key(1, json.loads(inputs.read_text())) == "tp1_mml2048"
    assert gate.gate_key(2, {"max_model_len": None}) == "tp2"
    argv = ["--fake", "--gpus", "2", "--inputs", str(inputs), "--out-dir", str(tmp_path / "out")]
    gate.main([*argv, "--work-dir", str(tmp_path / "w"), "--methods", "nospec,specdec"])
    (path,) = (tmp_path / "out").glob("*_gate_tp1_mml2048_ccccccc_nospec-specdec_code.json")
    res = json.loads(path.read_text())
    assert list(res["gates"]) == ["tp1_mml2048"] and set(res["gates"]["tp1_mml2048"]["engines"]) == {
        "nospec",
        "specdec",
    }
    assert res["sources"][0]["settings"]["engine_args"].endswith("; max_model_len 2048")
    assert (tmp_path / "w" / "tp1_mml2048" / "nospec.json").exists() and not (tmp_path / "w" / "tp1").exists()


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not importable (scripts/test.sh has it)")
@pytest.mark.parametrize("max_model_len", [None, 2048])
def test_the_worker_builds_its_engine_at_the_inputs_max_model_len(monkeypatch, max_model_len):
    """Near-end inputs set the engine's max_model_len; the default inputs leave it to vLLM."""
    import vllm

    made = []
    monkeypatch.setattr(vllm, "LLM", lambda **kw: made.append(kw) or "engine")
    args = SimpleNamespace(fake=False, model="m", tp=1)
    llm, _, _ = gate_worker.make_engine(args, {"method": "specdec"}, max_model_len=max_model_len)
    assert llm == "engine" and made[0].get("max_model_len") == max_model_len
    assert ("max_model_len" in made[0]) == bool(max_model_len)


def test_the_near_end_check_names_its_arguments_before_starting_anything():
    from benchmarks import near_end_check

    for argv in (["maybe"], [], ["on", "off"]):
        with pytest.raises(SystemExit, match=r"usage: python -m benchmarks.near_end_check off\|on"):
            near_end_check.main(argv)


def test_a_before_round_in_a_call_of_its_own_merges_into_one_serve_check(tmp_path):
    """Three 8B servers do not fit one call: the candidate's round (nospec, specdec), then ``--before-round``
    (nospec, specdec-before); gate_report joins the two files' servers and judges the before/after."""
    base = ["--part", "serve", "--fake", "--gpus", "1", "--checks", "tpot-53m"]
    base += ["--work-dir", str(tmp_path / "w"), "--inputs", str(_inputs(tmp_path / "inputs.json"))]
    gate.main([*base, "--out-dir", str(tmp_path / "a")])
    gate.main([*base, "--before-round", "--out-dir", str(tmp_path / "b")])
    (first,) = (tmp_path / "a").glob("*_gate_serve_*.json")
    (second,) = (tmp_path / "b").glob("*_gate_serve_*.json")
    assert list(json.loads(second.read_text())["serve"]["tpot-53m"]["servers"]) == ["nospec", "specdec-before"]
    doc = gate_report.merge([json.loads(first.read_text()), json.loads(second.read_text())])
    servers = doc["serve"]["tpot-53m"]["servers"]
    assert list(servers) == ["nospec", "specdec", "nospec-2", "specdec-before"]
    cand, before = gate_compare.compare({}, doc["serve"])["serve"]
    # each against its own call's no speculation
    assert cand == pytest.approx(gate_compare.serve_ratio(servers["specdec"], servers["nospec"]))
    assert before == pytest.approx(gate_compare.serve_ratio(servers["specdec-before"], servers["nospec-2"]))
    assert before != pytest.approx(gate_compare.serve_ratio(servers["specdec-before"], servers["nospec"]))
    rows = {r["check"]: r for r in gate_serve_report.serve_rows(doc["serve"])}
    assert rows["tpot-53m nospec-2"]["verdict"] == "-"  # the second call's no speculation: the calls' spread
    with pytest.raises(SystemExit):  # not with other servers, nor outside the serve part
        gate.main([*base, "--before-round", "--serve-methods", "nospec-v1"])


def _runs(*ms: float) -> dict[str, Any]:
    return {"bench": {"median_tpot_ms": sum(ms) / len(ms)}, "bench_runs": [{"median_tpot_ms": m} for m in ms]}


def test_a_joined_check_judges_each_server_against_its_own_calls_no_speculation():
    """Hand numbers of the 007521f lease: the candidate's call read no speculation at 5.08 / 5.28 ms (two seeds),
    the before's call at 5.25 / 5.42; each server's ratio, and each run's, is against its own call's."""
    first = {"kind": "tpot", "servers": {"nospec": _runs(5.08, 5.28), "specdec": _runs(5.25, 6.08)}}
    second = {"kind": "tpot", "servers": {"nospec": _runs(5.25, 5.42), "specdec-before": _runs(5.30, 5.40)}}
    serve = {"tpot-8b": gate_serve_report.join_servers(first, second)}
    cand, before = gate_compare.compare({}, serve)["serve"]  # the median of the runs' ratios (of two: their mean)
    assert cand == pytest.approx((5.25 / 5.08 + 6.08 / 5.28) / 2)
    assert before == pytest.approx((5.30 / 5.25 + 5.40 / 5.42) / 2)
    rows = {r["check"]: r for r in gate_serve_report.serve_rows(serve)}
    assert rows["tpot-8b"]["runs"] == pytest.approx([5.25 / 5.08, 6.08 / 5.28])
    assert rows["tpot-8b specdec-before"]["runs"] == pytest.approx([5.30 / 5.25, 5.40 / 5.42])
    assert rows["tpot-8b nospec-2"]["ratio"] == pytest.approx((5.25 / 5.08 + 5.42 / 5.28) / 2)  # the calls' spread
    assert list(rows)[0] == "tpot-8b" and rows["tpot-8b specdec-before"]["verdict"] == "-"
    assert "runs 1.033 1.152" in "\n".join(gate_serve_report.render_serve(list(rows.values())))
    third = {"kind": "tpot", "servers": {"nospec": _runs(5.08, 5.28, 5.10), "specdec": _runs(5.25, 6.08, 5.30)}}
    # three runs: the one run off (1.152) does not move the ratio, the mean's would (1.076)
    ratio = gate_compare.serve_ratio(third["servers"]["specdec"], third["servers"]["nospec"])
    assert ratio == pytest.approx(5.30 / 5.10)


def test_join_servers_fills_a_skipped_server_and_keeps_unmeasured_ones_out():
    ran = {"bench": {"median_tpot_ms": 5.0}}
    have = {"kind": "tpot", "servers": {"nospec": ran, "specdec": ran, "specdec-before": {"skipped": "time budget"}}}
    later = {"kind": "tpot", "servers": {"nospec": ran, "specdec-before": ran, "specdec": {"skipped": "time budget"}}}
    joined = gate_serve_report.join_servers(have, later)
    # the skipped one, measured in the later call, judged against that call's no speculation
    assert joined["servers"]["specdec-before"] == {**ran, "reference": "nospec-2"}
    assert list(joined["servers"]) == ["nospec", "specdec", "specdec-before", "nospec-2"]
    assert gate_serve_report.join_servers(None, later) is later
    assert gate_serve_report.join_servers(have, {"skipped": "no GPU"}) is have


def test_bench_windows_cut_a_detailed_run_into_paired_samples_by_hand():
    """Six requests in two windows (seconds, as vLLM writes them): TPOT = the ITLs' sum over the tokens after the
    first; an errored request and a one-token one count in no TPOT."""
    result = {
        "output_lens": [3, 5, 1, 4, 0, 2],
        "ttfts": [0.01, 0.02, 0.03, 0.04, 0.0, 0.06],
        "itls": [[0.004, 0.006], [0.005] * 4, [], [0.003, 0.003, 0.006], [], [0.008]],
        "errors": ["", "", "", "", "timeout", ""],
    }
    first, second = gate_metrics.bench_windows(result, 2)
    assert first["median_tpot_ms"] == pytest.approx(5.0) and first["completed"] == 3  # (10 / 2, 20 / 4): 5, 5
    assert second["median_tpot_ms"] == pytest.approx((4.0 + 8.0) / 2) and second["completed"] == 2
    assert second["median_ttft_ms"] == pytest.approx(50.0) and first["median_itl_ms"] == pytest.approx(5.0)
    assert gate_metrics.bench_windows({"output_lens": [3]}, 2) == []  # no per-request detail


def test_before_after_reads_every_rate_no_loss_at_any_and_a_win_at_one():
    """Two rates' checks, each server against its own call's no speculation: a win under load with no loss at the
    issue's 20/s keeps the change; a loss at either rate drops it."""

    def check(cand: float, before: float) -> dict[str, Any]:
        return {
            "kind": "tpot",
            "servers": {
                "nospec": _runs(5, 5, 5),
                "specdec": _runs(*[cand] * 3),
                "specdec-before": _runs(*[before] * 3),
            },
        }

    keep = gate_compare.compare({}, {"tpot-8b": check(5.05, 5.05), "tpot-8b@inf": check(5.5, 7.5)})
    assert keep["verdict"] == "PASS" and keep["win"] and keep["serve"] == pytest.approx((1.01, 1.01))
    assert keep["serve_checks"]["tpot-8b@inf"] == pytest.approx((1.1, 1.5))
    lines = "\n".join(gate_compare.render_compare(keep))
    assert "(tpot-8b@inf): specdec 1.100, before 1.500" in lines and "KEEP" in lines
    drop = gate_compare.compare({}, {"tpot-8b": check(5.5, 5.05), "tpot-8b@inf": check(5.5, 7.5)})
    assert drop["verdict"] == "FAIL" and drop["reason"] == "a loss"


def test_a_tp_that_ran_without_a_before_engine_is_named_beside_the_verdict():
    """Two-GPU lease of cd1369b: TP = 2 ran both engines, TP = 1 only the candidate (the before did not fit its
    call). The verdict covers what was compared, and the report says which TP it does not cover."""

    def row(key: str, cand: float, before: float | None) -> dict[str, Any]:
        engine = {"x_nospec": cand, "emit": 2.0, "repeat4": 0.5}
        r: dict[str, Any] = {"key": key, "nospec_tps": 100.0, "repeat4": 0.5, "specdec": engine}
        if before is not None:
            r["specdec-before"] = {"x_nospec": before, "emit": 2.0, "repeat4": 0.5}
        return r

    tp2 = [row("chat/b8", 2.2, 2.0), row("code/b8", 4.0, 4.0)]
    tp1 = [row("chat/b8", 2.4, None), row("code/b8", 2.9, None)]
    result = gate_compare.compare({"tp1": tp1, "tp2": tp2}, {})
    assert result["verdict"] == "PASS" and result["uncompared"] == ["tp1"]
    assert result["reason"] == "a win; not compared: tp1 (no before engine)"
    assert "before/after: KEEP (a win; not compared: tp1 (no before engine))" in gate_compare.render_compare(result)
    both = gate_compare.compare({"tp2": tp2}, {})
    assert both["uncompared"] == [] and both["reason"] == "a win"


def test_a_later_round_is_estimated_from_the_round_before_it_as_measured(tmp_path):
    """A call that covers the check by the constants (one cold start, two servers' runs) also covers, by the
    constants, a second round of two, less what the first took: by the constants alone that round is skipped.
    Measured, the first round says the second fits, and it runs."""
    est = gate_serve.ServeRun.__new__(gate_serve.ServeRun)
    est.args, est.gpus = argparse.Namespace(serve_rates=["20"]), 2
    need = est._need_s("53m", "tpot-53m")
    assert need == gate_serve.START_EST_S["53m"] + 2 * est._bench_est()  # = a round of two by the constants
    wall = int(need + gate_args.FINISH_MARGIN_S) + 5  # the check fits; by the constants, a second round not
    gate.main([*_serve_argv(tmp_path), "--serve-methods", "nospec-v1,specdec-nodraft", "--max-wall-s", str(wall)])
    (path,) = tmp_path.glob("*_gate_serve_*.json")
    servers = json.loads(path.read_text())["serve"]["tpot-53m"]["servers"]
    assert [k for k, v in servers.items() if "skipped" in v] == []
    assert servers["specdec-nodraft"]["bench"]["completed"] > 0
    assert gate_serve.RoundTime(start_s=100.0, bench_s=50.0).need_s(2) == pytest.approx(
        200.0 * gate_serve.ROUND_EST_MARGIN
    )
