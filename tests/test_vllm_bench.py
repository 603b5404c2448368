"""CPU tests of the vLLM benchmark's bookkeeping (summary, ratios, mismatch counts, lossless table, markdown)."""
from __future__ import annotations

from specdec.eval.bench_vllm import METHODS, _spec_config, markdown, summarise


def _cell(tps: float, outs: list[list[int]], accepted: float = 0.0) -> dict:
    n = sum(map(len, outs))
    return {"batch_size": 8, "prompts": len(outs), "output_tokens": n, "wall_s": n / tps, "tokens_per_s": tps,
            "tpot_ms": 1.0, "mat": n / (n - accepted), "accepted_tokens": accepted, "drafted_tokens": 2 * accepted,
            "acceptance_rate": 0.5, "engine_steps": 10, "draft_ms_per_step": 0.1, "draft_share": 0.01,
            "outputs": outs}


def _run(method: str, cells: dict) -> dict:
    return {"method": method, "dtype": "bfloat16", "startup_s": 1.0, "datasets": {"code": cells}}


def test_summary_ratios_mismatches_and_lossless_counts():
    ref = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    runs = {"nospec": _run("nospec", {"8": _cell(100.0, ref)}),
            "specdec": _run("specdec", {"8": _cell(250.0, [[1, 2, 3], [4, 5, 0], [7, 8, 9]], accepted=4)})}
    lossless = {"nospec": _run("nospec", {"1": _cell(10.0, ref)}),
                "specdec": _run("specdec", {"1": _cell(20.0, ref)}),
                "bad": _run("bad", {"1": _cell(20.0, [[1, 2, 3], [4, 0, 6], [7, 8]])})}
    s = summarise(runs, lossless)
    row = next(r for r in s["rows"] if r["method"] == "specdec")
    assert row["speedup_vs_nospec"] == 2.5 and row["mismatches_vs_nospec"] == 1
    assert "outputs" not in row
    assert row["mat"] == 9 / 5
    assert s["lossless_fp32"] == [
        {"method": "specdec", "dataset": "code", "batch_size": 1, "compared": 3, "identical": 3,
         "mean_output_tokens": 3.0, "first_diffs": []},
        {"method": "bad", "dataset": "code", "batch_size": 1, "compared": 3, "identical": 1, "mean_output_tokens": 3.0,
         "first_diffs": [{"prompt": 1, "position": 1, "tokens": 3, "reference_tokens": 3},
                         {"prompt": 2, "position": 2, "tokens": 2, "reference_tokens": 3}]}]
    doc = {"date": "2026-11-22", "device": "h100", "settings": {"batch_sizes": [8], "cache_policy": "disjoint"},
           "summary": s}
    md = markdown(doc)
    assert "| specdec | 250 (2.50x); MAT 1.80; 0.10 ms, 1/3 mm |" in md
    assert "| specdec | code | 1 | 3/3 | 3.0 |" in md


def test_method_configs_use_the_plugin_method_and_overrides():
    assert _spec_config("nospec", {}) is None
    cfg = _spec_config("specdec", {"num_speculative_tokens": 8, "draft_timeout_ms": 5})
    assert cfg["method"] == "specdec" and cfg["num_speculative_tokens"] == 8 and cfg["draft_timeout_ms"] == 5
    assert _spec_config("ngram", {"num_speculative_tokens": 99}) == METHODS["ngram"]  # peers are never overridden
    assert METHODS["specdec-async"]["async"] is True


def test_gpu_wait_for_drafts_is_the_gap_beyond_nospec_v1s():
    ref = [[1, 2, 3]]
    cells = {m: _cell(100.0, ref) for m in ("nospec", "nospec-v1", "specdec")}
    cells["nospec-v1"].update(gpu_gap_ms_per_step=0.25, gpu_busy_ms_per_step=2.0)
    cells["specdec"].update(gpu_gap_ms_per_step=0.75, gpu_busy_ms_per_step=4.25)
    runs = {m: _run(m, {"8": c}) for m, c in cells.items()}
    s = summarise(runs, {})
    row = {r["method"]: r for r in s["rows"]}
    assert row["specdec"]["gpu_wait_for_drafts_ms"] == 0.5
    assert row["specdec"]["gpu_wait_for_drafts_share"] == 0.5 / 5.0
    assert row["nospec-v1"]["gpu_wait_for_drafts_ms"] == 0.0
    assert "gpu_wait_for_drafts_ms" not in row["nospec"]  # not measured (no events): no figure
    doc = {"date": "2026-11-22", "device": "h100", "settings": {"batch_sizes": [8], "cache_policy": "disjoint"},
           "summary": s}
    assert "| specdec | 0.750 / 4.250; wait 10.0% |" in markdown(doc)


def test_gpu_wait_is_split_into_sync_scheduling_speculation_and_drafting():
    ref = [[1, 2, 3]]
    cells = {m: _cell(100.0, ref) for m in ("nospec", "nospec-v1", "nospec-sync", "specdec")}
    cells["nospec-v1"].update(gpu_gap_ms_per_step=1.0, gpu_busy_ms_per_step=0.5)
    cells["nospec-sync"].update(gpu_gap_ms_per_step=1.5, gpu_busy_ms_per_step=0.5)
    cells["specdec"].update(gpu_gap_ms_per_step=2.25, gpu_busy_ms_per_step=1.75, draft_ms_per_step=0.25)
    s = summarise({m: _run(m, {"8": c}) for m, c in cells.items()}, {})
    row = {r["method"]: r for r in s["rows"]}
    assert row["specdec"]["gpu_wait_for_drafts_ms"] == 1.25  # 2.25 - 1.0
    assert row["specdec"]["gpu_wait_parts_ms"] == {"sync_scheduling": 0.5, "speculation": 0.5, "drafting": 0.25}
    assert row["specdec"]["gpu_wait_parts_share"] == {"sync_scheduling": 0.125, "speculation": 0.125,
                                                      "drafting": 0.0625}
    assert "gpu_wait_parts_ms" not in row["nospec-sync"]  # the references are not split
    doc = {"date": "2026-11-22", "device": "h100", "settings": {"batch_sizes": [8], "cache_policy": "disjoint"},
           "summary": s}
    assert "| specdec | 12.5% + 12.5% + 6.2% |" in markdown(doc)


def test_shaped_model_resizes_the_config_and_keeps_the_tokenizer(tmp_path, monkeypatch):
    import json

    from specdec.eval import model_shapes

    src = tmp_path / "small"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"hidden_size": 640, "vocab_size": 16384, "model_type": "llama"}))
    (src / "tokenizer.json").write_text('{"model": {}}')
    monkeypatch.setattr(model_shapes, "SHAPE_DIR", tmp_path / "shapes")
    assert model_shapes.shaped_model(str(src), "") == str(src)  # no shape: the model itself
    out = model_shapes.shaped_model(str(src), "llama-8b")
    config = json.loads((tmp_path / "shapes" / "llama-8b" / "config.json").read_text())
    assert out.endswith("llama-8b") and config["hidden_size"] == 4096 and config["num_hidden_layers"] == 32
    assert config["vocab_size"] == 16384 and config["model_type"] == "llama"  # the tokenizer's vocabulary stays
    assert (tmp_path / "shapes" / "llama-8b" / "tokenizer.json").read_text() == '{"model": {}}'


def test_inflate_builds_once_and_every_engine_gets_the_inflated_model(tmp_path, monkeypatch):
    import json
    from pathlib import Path

    from specdec.eval import bench_vllm, inflate_model

    src = tmp_path / "code-target-53m"
    src.mkdir()
    cfg = {"hidden_size": 640, "intermediate_size": 1728, "num_hidden_layers": 10, "num_attention_heads": 10,
           "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 16384, "tie_word_embeddings": True}
    (src / "config.json").write_text(json.dumps(cfg))
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"policy": "test", "datasets": {"code": {"warmup": [[1]], "bs1": [[1, 2]]}}}))
    built, spawned = [], []

    def check_call(cmd):  # the inflate subprocess: writes the config it would write
        out = Path(cmd[cmd.index("--out") + 1])
        built.append(cmd)
        out.mkdir(parents=True, exist_ok=True)
        big = inflate_model.inflated_config(cfg, inflate_model.INFLATE_SHAPES["llama-8b"])
        (out / "config.json").write_text(json.dumps(big))
        return 0

    monkeypatch.setattr(inflate_model, "INFLATE_DIR", tmp_path / "shapes")
    monkeypatch.setattr(bench_vllm.subprocess, "check_call", check_call)
    monkeypatch.setattr(bench_vllm, "_spawn", lambda args, method, *a: spawned.append((method, args.model)))
    bench_vllm.main(["--prompts", str(prompts), "--model", str(src), "--inflate", "llama-8b", "--methods",
                     "nospec-v1,specdec-sched", "--datasets", "code", "--batch-sizes", "1",
                     "--out-dir", str(tmp_path / "out")])
    want = str(tmp_path / "shapes" / "code-target-53m-llama-8b")
    assert len(built) == 1 and built[0][built[0].index("--shape") + 1] == "llama-8b"
    assert spawned == [("nospec-v1", want), ("specdec-sched", want)]
    doc = json.loads(next((tmp_path / "out").glob("*.json")).read_text())
    assert doc["settings"]["model"].startswith("code-target-53m-llama-8b (6.9B parameters: code-target-53m inflated")


def test_ratios_use_nospec_v1_when_it_is_the_only_reference_and_compare_specdec_with_its_peers(tmp_path):
    import json

    from specdec.eval.bench_vllm_report import main

    ref = [[1, 2, 3]]
    tps = {"nospec-v1": 100.0, "suffix": 200.0, "ngram": 160.0, "specdec-sync": 250.0, "specdec-sched": 320.0}
    runs = {m: _run(m, {"8": _cell(v, ref)}) for m, v in tps.items()}
    s = summarise(runs, {})
    row = {r["method"]: r for r in s["rows"]}
    assert row["specdec-sched"]["speedup_vs_nospec"] == 3.2 and row["specdec-sched"]["reference"] == "nospec-v1"
    assert row["specdec-sched"]["mismatches_vs_nospec"] == 0
    assert row["specdec-sched"]["speedup_vs_peers"] == {"suffix": 1.6, "ngram": 2.0, "specdec-sync": 1.28}
    assert "speedup_vs_peers" not in row["specdec-sync"] and "speedup_vs_peers" not in row["suffix"]  # peers
    doc = {"date": "2026-11-22", "device": "h200", "settings": {"batch_sizes": [8], "cache_policy": "disjoint"},
           "summary": s}
    md = markdown(doc)
    assert "| specdec-sched | 320 (3.20x); MAT 1.00; 0.10 ms, 0/1 mm |" in md
    assert "| specdec-sched | 1.60x suffix, 2.00x ngram, 1.28x sync |" in md
    for r in doc["summary"]["rows"]:  # a results file written before the ratios existed: re-rendered with them
        r.pop("speedup_vs_nospec", None), r.pop("speedup_vs_peers", None)
    path = tmp_path / "run.json"
    path.write_text(json.dumps(doc))
    main([str(path), "--write"])
    assert "| specdec-sched | 1.60x suffix, 2.00x ngram, 1.28x sync |" in path.with_suffix(".md").read_text()
