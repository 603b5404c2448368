"""CPU tests of the vLLM benchmark's bookkeeping (summary, ratios, mismatch counts, lossless table, markdown)."""

from __future__ import annotations

from types import SimpleNamespace

from benchmarks.bench_vllm import METHODS, _spec_config, markdown, summarise


class BookHolder:
    """Stands for a schedule-mode proposer holding a slot book (what ``engine_timer.slot_counters`` reads)."""

    def __init__(self, book) -> None:
        self.scheduled = SimpleNamespace(slot_book=book)


def _cell(tps: float, outs: list[list[int]], accepted: float = 0.0) -> dict:
    n = sum(map(len, outs))
    return {
        "batch_size": 8,
        "prompts": len(outs),
        "output_tokens": n,
        "wall_s": n / tps,
        "tokens_per_s": tps,
        "tpot_ms": 1.0,
        "mat": n / (n - accepted),
        "accepted_tokens": accepted,
        "drafted_tokens": 2 * accepted,
        "acceptance_rate": 0.5,
        "engine_steps": 10,
        "draft_ms_per_step": 0.1,
        "draft_share": 0.01,
        "outputs": outs,
    }


def _run(method: str, cells: dict) -> dict:
    return {"method": method, "dtype": "bfloat16", "startup_s": 1.0, "datasets": {"code": cells}}


def test_summary_ratios_mismatches_and_lossless_counts():
    ref = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    runs = {
        "nospec": _run("nospec", {"8": _cell(100.0, ref)}),
        "specdec": _run("specdec", {"8": _cell(250.0, [[1, 2, 3], [4, 5, 0], [7, 8, 9]], accepted=4)}),
    }
    lossless = {
        "nospec": _run("nospec", {"1": _cell(10.0, ref)}),
        "specdec": _run("specdec", {"1": _cell(20.0, ref)}),
        "bad": _run("bad", {"1": _cell(20.0, [[1, 2, 3], [4, 0, 6], [7, 8]])}),
    }
    s = summarise(runs, lossless)
    row = next(r for r in s["rows"] if r["method"] == "specdec")
    assert row["speedup_vs_nospec"] == 2.5 and row["mismatches_vs_nospec"] == 1
    assert "outputs" not in row
    assert row["mat"] == 9 / 5
    assert s["lossless_fp32"] == [
        {
            "method": "specdec",
            "dataset": "code",
            "batch_size": 1,
            "compared": 3,
            "identical": 3,
            "mean_output_tokens": 3.0,
            "first_diffs": [],
        },
        {
            "method": "bad",
            "dataset": "code",
            "batch_size": 1,
            "compared": 3,
            "identical": 1,
            "mean_output_tokens": 3.0,
            "first_diffs": [
                {"prompt": 1, "position": 1, "tokens": 3, "reference_tokens": 3},
                {"prompt": 2, "position": 2, "tokens": 2, "reference_tokens": 3},
            ],
        },
    ]
    doc = {
        "date": "2026-11-22",
        "device": "h100",
        "settings": {"batch_sizes": [8], "cache_policy": "disjoint"},
        "summary": s,
    }
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
    doc = {
        "date": "2026-11-22",
        "device": "h100",
        "settings": {"batch_sizes": [8], "cache_policy": "disjoint"},
        "summary": s,
    }
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
    assert row["specdec"]["gpu_wait_parts_share"] == {
        "sync_scheduling": 0.125,
        "speculation": 0.125,
        "drafting": 0.0625,
    }
    assert "gpu_wait_parts_ms" not in row["nospec-sync"]  # the references are not split
    doc = {
        "date": "2026-11-22",
        "device": "h100",
        "settings": {"batch_sizes": [8], "cache_policy": "disjoint"},
        "summary": s,
    }
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

    from benchmarks import bench_vllm, bench_vllm_driver
    from specdec.eval import inflate_model

    src = tmp_path / "code-target-53m"
    src.mkdir()
    cfg = {
        "hidden_size": 640,
        "intermediate_size": 1728,
        "num_hidden_layers": 10,
        "num_attention_heads": 10,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": 16384,
        "tie_word_embeddings": True,
    }
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
    monkeypatch.setattr(inflate_model.subprocess, "check_call", check_call)
    monkeypatch.setattr(
        bench_vllm_driver, "_spawn", lambda args, method, *a, **kw: spawned.append((method, args.model))
    )
    bench_vllm.main(
        [
            "--prompts",
            str(prompts),
            "--model",
            str(src),
            "--inflate",
            "llama-8b",
            "--methods",
            "nospec-v1,specdec-sched",
            "--datasets",
            "code",
            "--batch-sizes",
            "1",
            "--out-dir",
            str(tmp_path / "out"),
        ]
    )
    want = str(tmp_path / "shapes" / "code-target-53m-llama-8b")
    assert len(built) == 1 and built[0][built[0].index("--shape") + 1] == "llama-8b"
    assert spawned == [("nospec-v1", want), ("specdec-sched", want)]
    doc = json.loads(next((tmp_path / "out").glob("*.json")).read_text())
    assert doc["settings"]["model"].startswith("code-target-53m-llama-8b (6.9B parameters: code-target-53m inflated")


def test_ratios_use_nospec_v1_when_it_is_the_only_reference_and_compare_specdec_with_its_peers(tmp_path):
    import json

    from benchmarks.bench_vllm_report import main

    ref = [[1, 2, 3]]
    tps = {"nospec-v1": 100.0, "suffix": 200.0, "ngram": 160.0, "specdec-sync": 250.0, "specdec-sched": 320.0}
    runs = {m: _run(m, {"8": _cell(v, ref)}) for m, v in tps.items()}
    s = summarise(runs, {})
    row = {r["method"]: r for r in s["rows"]}
    assert row["specdec-sched"]["speedup_vs_nospec"] == 3.2 and row["specdec-sched"]["reference"] == "nospec-v1"
    assert row["specdec-sched"]["mismatches_vs_nospec"] == 0
    assert row["specdec-sched"]["speedup_vs_peers"] == {"suffix": 1.6, "ngram": 2.0, "specdec-sync": 1.28}
    assert "speedup_vs_peers" not in row["specdec-sync"] and "speedup_vs_peers" not in row["suffix"]  # peers
    doc = {
        "date": "2026-11-22",
        "device": "h200",
        "settings": {"batch_sizes": [8], "cache_policy": "disjoint"},
        "summary": s,
    }
    md = markdown(doc)
    assert "| specdec-sched | 320 (3.20x); MAT 1.00; 0.10 ms, 0/1 mm |" in md
    assert "| specdec-sched | 1.60x suffix, 2.00x ngram, 1.28x sync |" in md
    for r in doc["summary"]["rows"]:  # a results file written before the ratios existed: re-rendered with them
        r.pop("speedup_vs_nospec", None), r.pop("speedup_vs_peers", None)
    path = tmp_path / "run.json"
    path.write_text(json.dumps(doc))
    main([str(path), "--write"])
    assert "| specdec-sched | 1.60x suffix, 2.00x ngram, 1.28x sync |" in path.with_suffix(".md").read_text()


# --------------------------------------------------------------------------- sustained load (bench_vllm --load)
class FakeEngine:
    """vLLM's LLMEngine as the feed loop uses it: request i of prompt [n, ...] finishes n steps after it was added
    (its output: the prompt's ids + 100); each step takes ``STEP_S`` on ``clock``; steps also report unfinished
    requests, as an engine with cumulative outputs would."""

    STEP_S = 0.5

    def __init__(self, clock: list[float]) -> None:
        self.clock, self.steps = clock, 0
        self.running: dict[str, list] = {}  # request id -> [steps left, prompt]
        self.added: list[tuple[int, str, list[int]]] = []  # (step, request id, prompt ids)
        self.widths: list[int] = []

    def add_request(self, request_id: str, prompt: dict, params: object) -> str:
        assert request_id not in self.running and params == "sp"
        self.added.append((self.steps, request_id, prompt["prompt_token_ids"]))
        self.running[request_id] = [prompt["prompt_token_ids"][0], prompt["prompt_token_ids"]]
        return request_id + "-internal"

    def has_unfinished_requests(self) -> bool:
        return bool(self.running)

    def step(self) -> list:
        from types import SimpleNamespace

        self.steps += 1
        self.clock[0] += self.STEP_S
        self.widths.append(len(self.running))
        outs = []
        for rid, state in list(self.running.items()):
            state[0] -= 1
            ids = [t + 100 for t in state[1]]
            outs.append(
                SimpleNamespace(
                    request_id=rid, finished=state[0] == 0, metrics=None, outputs=[SimpleNamespace(token_ids=ids)]
                )
            )
            if state[0] == 0:
                del self.running[rid]
        return outs


def _fake_clock(monkeypatch) -> list[float]:
    from benchmarks import bench_vllm_load

    clock = [10.0]
    monkeypatch.setattr(bench_vllm_load.time, "perf_counter", lambda: clock[0])
    return clock


def test_feed_keeps_at_most_b_in_flight_and_refills_as_requests_finish(monkeypatch):
    from benchmarks.bench_vllm_load import feed

    engine = FakeEngine(_fake_clock(monkeypatch))
    prompts = [[3, 0], [1, 1], [1, 2], [2, 3], [1, 4]]  # first id: steps to finish
    outs, wall = feed(engine, prompts, 2, "sp", request_prefix="code-sus2")
    # step 1 finishes prompt 1 -> prompt 2 enters; step 2 finishes 2 -> 3 enters; step 3 finishes 0 -> 4 enters
    assert [(step, rid) for step, rid, _ in engine.added] == [
        (0, "code-sus2-0"),
        (0, "code-sus2-1"),
        (1, "code-sus2-2"),
        (2, "code-sus2-3"),
        (3, "code-sus2-4"),
    ]
    assert [ids for _, _, ids in engine.added] == prompts  # each prompt submitted once, in order
    assert engine.widths == [2, 2, 2, 2] and max(engine.widths) <= 2
    assert [o.outputs[0].token_ids for o in outs] == [[t + 100 for t in p] for p in prompts]  # prompt order
    assert wall == 4 * FakeEngine.STEP_S


def test_feed_with_a_lead_request_runs_it_alone_for_one_step(monkeypatch):
    """SPECDEC_BENCH_LEAD_REQUEST=1 (a diagnostic): the first request runs one step alone, then the rest of the first
    b join; a lead request that finishes in that step is booked and refilled as usual."""
    from benchmarks.bench_vllm_load import LEAD_REQUEST_ENV, feed

    monkeypatch.setenv(LEAD_REQUEST_ENV, "1")
    engine = FakeEngine(_fake_clock(monkeypatch))
    outs, wall = feed(engine, [[2, 0], [1, 1], [1, 2]], 2, "sp")
    assert [(s, r) for s, r, _ in engine.added] == [(0, "sus-0"), (1, "sus-1"), (2, "sus-2")]
    assert engine.widths == [1, 2, 1] and wall == 3 * FakeEngine.STEP_S and len(outs) == 3
    engine = FakeEngine(_fake_clock(monkeypatch))
    outs, _ = feed(engine, [[1, 0], [1, 1]], 2, "sp")  # the lead finishes in its own step
    assert [o.outputs[0].token_ids for o in outs] == [[101, 100], [101, 101]] and engine.widths == [1, 1]


def test_feed_with_fewer_prompts_than_the_cap_submits_them_all_at_once(monkeypatch):
    from benchmarks.bench_vllm_load import feed

    engine = FakeEngine(_fake_clock(monkeypatch))
    outs, wall = feed(engine, [[2, 7], [1, 8]], 64, "sp")
    assert [(s, r) for s, r, _ in engine.added] == [(0, "sus-0"), (0, "sus-1")]
    assert engine.widths == [2, 1] and wall == 1.0 and len(outs) == 2


def test_sustained_cell_books_tokens_wall_mat_and_steps(monkeypatch):
    from types import SimpleNamespace

    from benchmarks.bench_vllm_load import run_sustained
    from benchmarks.step_timer import StepTimer

    engine = FakeEngine(_fake_clock(monkeypatch))
    counters = {"accepted": 0.0}
    step = engine.step

    def counted_step() -> list:
        timer.steps += 1  # what StepTimer's execute_model wrapper does
        counters["accepted"] += 1.0
        return step()

    engine.step = counted_step

    def metrics() -> list:  # vLLM's counters: one acceptance per step, four drafts per acceptance
        return [
            SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens_total", value=counters["accepted"]),
            SimpleNamespace(name="vllm:spec_decode_num_draft_tokens_total", value=4 * counters["accepted"]),
        ]

    llm = SimpleNamespace(llm_engine=engine, get_metrics=metrics)
    timer = StepTimer()
    prompts = [[2, 5, 6], [1, 7, 8], [3, 9, 1], [1, 2, 3]]
    cell = run_sustained(llm, prompts, 2, "sp", timer)
    assert cell["load"] == "sustained" and cell["concurrency"] == 2 and cell["batch_size"] == 2
    assert cell["prompts"] == 4 and cell["output_tokens"] == 12
    assert cell["outputs"] == [[t + 100 for t in p] for p in prompts]
    assert cell["engine_steps"] == 4 and cell["wall_s"] == 2.0 and cell["tokens_per_s"] == 6.0
    assert cell["accepted_tokens"] == 4.0 and cell["mat"] == 12 / 8 and cell["acceptance_rate"] == 0.25
    assert cell["gpu_gap_ms_per_step"] is None and timer.gpu_on is False  # no GPU events on a fake engine


def _sus(cell: dict, b: int = 8) -> dict:
    return {**cell, "load": "sustained", "concurrency": b, "prompts": len(cell["outputs"])}


def test_sustained_cells_get_their_own_ratios_mismatches_and_tables():
    ref, other = [[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 5, 0]]
    tps = {"nospec-v1": (100.0, 200.0), "suffix": (150.0, 250.0), "specdec-sched": (300.0, 500.0)}
    runs = {
        m: _run(
            m,
            {"8": {**_cell(c, ref), "load": "closed"}, "sus8": _sus(_cell(s, other if m == "specdec-sched" else ref))},
        )
        for m, (c, s) in tps.items()
    }
    for m, run in runs.items():
        run["datasets"]["code"]["sus8"].update(
            gpu_gap_ms_per_step=1.0 if m == "nospec-v1" else 2.0, gpu_busy_ms_per_step=3.0, trace={"reqs": [8]}
        )
    s = summarise(runs, {})
    row = {(r["method"], r["load"]): r for r in s["rows"]}
    assert row[("specdec-sched", "closed")]["speedup_vs_nospec"] == 3.0
    assert row[("specdec-sched", "sustained")]["speedup_vs_nospec"] == 2.5  # against no-spec's sustained cell
    assert row[("specdec-sched", "sustained")]["speedup_vs_peers"] == {"suffix": 2.0}
    assert row[("specdec-sched", "sustained")]["mismatches_vs_nospec"] == 1
    assert row[("specdec-sched", "closed")]["mismatches_vs_nospec"] == 0
    assert row[("specdec-sched", "sustained")]["gpu_wait_for_drafts_ms"] == 1.0
    assert "gpu_wait_for_drafts_ms" not in row[("specdec-sched", "closed")]  # closed cells: no GPU figures
    assert set(s["traces"]) == {f"{m}|code:sustained|8" for m in tps}  # step_trace's "method|dataset|batch"
    doc = {
        "date": "2026-11-22",
        "device": "h200",
        "settings": {"batch_sizes": [8], "cache_policy": "disjoint"},
        "summary": s,
    }
    md = markdown(doc)
    closed, sustained = md.split("## code, sustained load: N prompts, at most b in flight: tokens/s (x no-spec)")
    assert "| specdec-sched | 300 (3.00x); MAT 1.00; 0.10 ms, 0/2 mm |" in closed
    assert "| method | b 8, N 2 |" in sustained
    assert "| specdec-sched | 500 (2.50x); MAT 1.00; 0.10 ms, 1/2 mm |" in sustained
    assert "### code, sustained load: specdec tokens/s over the same run's peers" in sustained
    assert "| specdec-sched | 2.00x suffix |" in sustained and "| specdec-sched | 2.00x suffix |" in closed
    assert "### code, sustained load: GPU idle gap / busy per step (ms)" in sustained
    assert "| specdec-sched | 2.000 / 3.000; wait 20.0% |" in sustained
    assert "GPU idle gap" not in closed


def test_a_sustained_only_run_has_no_closed_tables():
    runs = {m: _run(m, {"sus8": _sus(_cell(v, [[1, 2]]))}) for m, v in (("nospec", 10.0), ("specdec", 30.0))}
    doc = {
        "date": "2026-11-22",
        "device": "h200",
        "settings": {"batch_sizes": [8], "cache_policy": "disjoint"},
        "summary": summarise(runs, {}),
    }
    md = markdown(doc)
    assert "## code: tokens/s" not in md and "| specdec | 30 (3.00x); MAT 1.00; 0.10 ms, 0/1 mm |" in md


def test_load_both_runs_each_load_in_its_own_engine_and_joins_the_cells(tmp_path, monkeypatch):
    import json

    from benchmarks import bench_vllm, bench_vllm_driver

    prompts = tmp_path / "prompts.json"
    sets = {"warmup": [[1]], "bs8": [[1, 2]], "bs32": [[3]], "sus32": [[4], [5], [6]]}
    prompts.write_text(json.dumps({"policy": "test", "datasets": {"code": sets}}))
    calls = []

    firsts = []

    def spawn(args, method, dtype, batches, max_tokens, eager, tmp, *, load="closed", first=False):
        calls.append((method, load))
        firsts.append(first)
        key = "32" if load == "closed" else "sus32"
        cell = _sus(_cell(50.0, [[1]]), 32) if load == "sustained" else {**_cell(40.0, [[1]]), "load": "closed"}
        return {
            "method": method,
            "dtype": dtype,
            "startup_s": 1.0 if load == "closed" else 2.0,
            "load": load,
            "datasets": {"code": {key: cell}},
        }

    monkeypatch.setattr(bench_vllm_driver, "_spawn", spawn)
    bench_vllm.main(
        [
            "--prompts",
            str(prompts),
            "--methods",
            "nospec,specdec",
            "--datasets",
            "code",
            "--batch-sizes",
            "8,32",
            "--load",
            "both",
            "--out-dir",
            str(tmp_path / "out"),
        ]
    )
    assert calls == [("nospec", "closed"), ("nospec", "sustained"), ("specdec", "closed"), ("specdec", "sustained")]
    assert firsts == [True, False, False, False]  # only the run's first engine gets the compile allowance
    doc = json.loads(next((tmp_path / "out").glob("*.json")).read_text())
    assert doc["settings"]["load"] == "both" and doc["settings"]["sustained_prompts"] == {"32": 3}
    rows = {(r["method"], r["load"]): r for r in doc["summary"]["rows"]}
    assert rows[("specdec", "sustained")]["concurrency"] == 32 and rows[("specdec", "closed")]["batch_size"] == 8
    assert doc["summary"]["sustained_engine"]["specdec"]["startup_s"] == 2.0
    assert doc["summary"]["startup_s"]["specdec"] == 1.0


def test_merge_loads_keeps_either_side_alone():
    from benchmarks.bench_vllm import _merge_loads

    closed = {"method": "m", "startup_s": 1.0, "datasets": {"code": {"8": {"a": 1}}}}
    sustained = {"method": "m", "startup_s": 2.0, "datasets": {"code": {"sus8": {"b": 2}}, "agentic": {"sus8": {}}}}
    assert _merge_loads(closed, None) is closed and _merge_loads(None, sustained) is sustained
    merged = _merge_loads(closed, sustained)
    assert merged["datasets"] == {"code": {"8": {"a": 1}, "sus8": {"b": 2}}, "agentic": {"sus8": {}}}
    assert merged["load"] == "both" and merged["sustained_engine"]["startup_s"] == 2.0


# --------------------------------------------------------------------------- output lengths (--output-lengths)
class LengthParams:
    """SamplingParams as feed uses it: ``max_tokens``, ``clone`` (counted)."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens, self.clones = max_tokens, 0

    def clone(self) -> LengthParams:
        self.clones += 1
        return LengthParams(self.max_tokens)


class LengthEngine:
    """vLLM's LLMEngine as the feed loop uses it: a request finishes after as many steps as its params'
    ``max_tokens`` (ignore_eos), its output that many tokens; records the params each request was added with."""

    def __init__(self) -> None:
        self.running: dict[str, list] = {}  # request id -> [tokens so far, params]
        self.params: dict[str, object] = {}

    def add_request(self, request_id: str, prompt: dict, params: object) -> str:
        self.params[request_id] = params
        self.running[request_id] = [[], params]
        return request_id

    def has_unfinished_requests(self) -> bool:
        return bool(self.running)

    def step(self) -> list:
        from types import SimpleNamespace

        outs = []
        for rid, (tokens, params) in list(self.running.items()):
            tokens.append(len(tokens))
            done = len(tokens) == params.max_tokens
            outs.append(
                SimpleNamespace(
                    request_id=rid, finished=done, metrics=None, outputs=[SimpleNamespace(token_ids=list(tokens))]
                )
            )
            if done:
                del self.running[rid]
        return outs


def test_varied_lengths_are_seeded_bounded_and_average_the_fixed_length():
    from benchmarks.bench_vllm_load import VARIED_LENGTHS, varied_lengths

    lengths = varied_lengths(256)
    assert lengths == varied_lengths(256)  # the same draw for every method
    assert varied_lengths(8) == lengths[:8]  # a prefix: one seed, drawn in prompt order
    assert all(type(n) is int and VARIED_LENGTHS[0] <= n <= VARIED_LENGTHS[1] for n in lengths)
    assert abs(sum(lengths) / len(lengths) - 256) < 20 and len(set(lengths)) > 100


def test_feed_gives_each_request_its_own_length_and_leaves_sp_alone():
    from types import SimpleNamespace

    from benchmarks.bench_vllm_load import feed

    lengths = [3, 1, 4, 1, 5]
    for sp in (LengthParams(256), SimpleNamespace(max_tokens=256, ignore_eos=True)):  # clone(), else copy.copy
        engine = LengthEngine()
        outs, _ = feed(engine, [[i] for i in range(5)], 2, sp, request_prefix="p", max_tokens=lengths)
        assert [engine.params[f"p-{i}"].max_tokens for i in range(5)] == lengths
        assert all(p is not sp for p in engine.params.values()) and sp.max_tokens == 256
        assert [len(o.outputs[0].token_ids) for o in outs] == lengths
    assert engine.params["p-0"].ignore_eos is True
    fixed = LengthEngine()
    sp = LengthParams(2)
    feed(fixed, [[1], [2]], 2, sp)  # no lengths: every request gets sp itself
    assert all(p is sp for p in fixed.params.values()) and sp.clones == 0


def test_feed_rejects_a_length_list_of_the_wrong_size():
    import pytest

    from benchmarks.bench_vllm_load import feed

    with pytest.raises(ValueError, match="2 lengths for 3 prompts"):
        feed(LengthEngine(), [[1], [2], [3]], 2, LengthParams(4), max_tokens=[1, 2])


def test_varied_sustained_cells_use_the_seeded_lengths_and_closed_cells_keep_max_tokens(monkeypatch):
    import argparse
    from types import SimpleNamespace

    from benchmarks import bench_vllm, bench_vllm_worker
    from benchmarks.bench_vllm_load import varied_lengths
    from benchmarks.step_timer import StepTimer

    monkeypatch.setattr(bench_vllm_worker, "_final_only", lambda sp: sp)  # vLLM's RequestOutputKind: not on CPU
    generated = []
    llm = SimpleNamespace(
        llm_engine=LengthEngine(),
        get_metrics=list,
        generate=lambda prompts, sp, use_tqdm: generated.append(sp.max_tokens),
    )
    sets = {"warmup": [[1]], "sus2": [[i] for i in range(5)]}
    args = argparse.Namespace(
        load="sustained",
        output_lengths="varied",
        batch_sizes=[2, 8],
        method="nospec",
        dtype="bfloat16",
        prompts="prompts.json",
        profile_dir="",
    )
    sp = LengthParams(256)
    cells, saved = {}, []
    bench_vllm._dataset_cells(
        args, llm, "code", sets, sp, StepTimer(), cells=cells, on_cell=lambda: saved.append(list(cells))
    )
    assert saved == [["sus2"]]  # each finished cell handed on at once (the worker writes it)
    assert list(cells) == ["sus2"] and cells["sus2"]["output_lengths"] == "varied"
    assert list(map(len, cells["sus2"]["outputs"])) == varied_lengths(5)
    assert sp.max_tokens == 256 and generated == [256]  # the warm-up: the fixed length
    args.output_lengths = "fixed"
    llm.llm_engine = LengthEngine()
    cells = {}
    bench_vllm._dataset_cells(args, llm, "code", sets, LengthParams(3), StepTimer(), cells=cells, on_cell=list)
    assert "output_lengths" not in cells["sus2"] and list(map(len, cells["sus2"]["outputs"])) == [3] * 5


def _two_method_args(prompts, tmp_path) -> list[str]:
    """bench_vllm arguments of a no-speculation / specdec run on the code set at batch 8."""
    return [
        "--prompts",
        str(prompts),
        "--methods",
        "nospec,specdec",
        "--datasets",
        "code",
        "--batch-sizes",
        "8",
        "--raw-dir",
        str(tmp_path / "raw"),
    ]


def _fake_workers(monkeypatch, cells_of):
    """bench_vllm's worker subprocess, faked: each call writes a result whose dataset "code" holds
    ``cells_of(cmd, load)`` ({cell key: cell}) for the worker's ``--load``. Returns the commands received (a list
    that fills as the driver spawns workers)."""
    import json

    from benchmarks import bench_vllm_driver

    cmds = _Cmds()
    cmds.paths = []

    def call(cmd, timeout, *, path=None):
        cmds.append(cmd)
        cmds.paths.append(path)
        load = cmd[cmd.index("--load") + 1]
        result = {
            "method": cmd[cmd.index("--method") + 1],
            "dtype": "bfloat16",
            "startup_s": 1.0,
            "load": load,
            "datasets": {"code": cells_of(cmd, load)},
        }
        with open(cmd[cmd.index("--worker-out") + 1], "w") as f:
            json.dump(result, f)
        return 0

    monkeypatch.setattr(bench_vllm_driver, "run_worker", call)
    return cmds


class _Cmds(list):
    """The workers' commands (a list), and ``paths``: the ``path`` each was run with (a variant's tree first on its
    import path, or None)."""

    paths: list[str | None]


def test_output_lengths_flag_reaches_the_workers_and_the_settings(tmp_path, monkeypatch):
    import json

    import pytest

    from benchmarks import bench_vllm

    prompts = tmp_path / "prompts.json"
    sets = {"warmup": [[1]], "bs8": [[1, 2]], "sus8": [[4], [5], [6]]}
    prompts.write_text(json.dumps({"policy": "test", "datasets": {"code": sets}}))

    def cells_of(cmd, load):  # one cell of the worker's load
        cell = _sus(_cell(50.0, [[1]]), 8) if load == "sustained" else {**_cell(40.0, [[1]]), "load": "closed"}
        if load == "sustained" and cmd[cmd.index("--output-lengths") + 1] == "varied":
            cell["output_lengths"] = "varied"
        return {"8" if load == "closed" else "sus8": cell}

    cmds = _fake_workers(monkeypatch, cells_of)
    base = _two_method_args(prompts, tmp_path)
    bench_vllm.main(base + ["--load", "both", "--output-lengths", "varied", "--out-dir", str(tmp_path / "out")])
    assert len(cmds) == 4 and all(c[c.index("--output-lengths") + 1] == "varied" for c in cmds)
    doc = json.loads(next((tmp_path / "out").glob("*.json")).read_text())
    assert doc["settings"]["output_lengths"] == {"varied": [128, 384], "seed": 0}
    assert {r["load"]: r.get("output_lengths") for r in doc["summary"]["rows"]} == {
        "closed": None,
        "sustained": "varied",
    }
    md = next((tmp_path / "out").glob("*.md")).read_text()
    assert "## code, sustained load, output lengths 128-384: N prompts, at most b in flight" in md
    assert '"output_lengths": {"varied": [128, 384], "seed": 0}' in md  # the settings line
    assert "## code: tokens/s" in md  # closed tables: titled as before
    cmds.clear()
    bench_vllm.main(base + ["--load", "sustained", "--out-dir", str(tmp_path / "fixed")])
    assert all(c[c.index("--output-lengths") + 1] == "fixed" for c in cmds)
    doc = json.loads(next((tmp_path / "fixed").glob("*.json")).read_text())
    assert doc["settings"]["output_lengths"] == "fixed"
    md = next((tmp_path / "fixed").glob("*.md")).read_text()
    assert "## code, sustained load: N prompts" in md and "output lengths" not in md.split("Cache policy")[1]
    for bad in (["--output-lengths", "random", "--load", "sustained"], ["--output-lengths", "varied"]):
        with pytest.raises(SystemExit) as exc:  # a bad choice; varied without sustained load
            bench_vllm.main(base + bad)
        assert exc.value.code == 2


def test_the_report_titles_varied_sustained_tables_and_reads_results_without_the_key():
    from benchmarks.bench_vllm_report import _lengths_note

    assert _lengths_note({"output_lengths": {"varied": [128, 384], "seed": 0}}) == ", output lengths 128-384"
    assert _lengths_note({"output_lengths": "fixed"}) == "" and _lengths_note({}) == ""


def test_real_sampling_params_are_cloned_with_each_length():
    import pytest

    vllm = pytest.importorskip("vllm")
    from vllm.sampling_params import RequestOutputKind

    from benchmarks.bench_vllm_load import feed

    sp = vllm.SamplingParams(
        temperature=0.0, max_tokens=256, ignore_eos=True, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY
    )
    engine = LengthEngine()
    outs, _ = feed(engine, [[1], [2], [3]], 2, sp, request_prefix="v", max_tokens=[2, 5, 3])
    params = [engine.params[f"v-{i}"] for i in range(3)]
    assert [p.max_tokens for p in params] == [2, 5, 3] and sp.max_tokens == 256
    assert all(
        isinstance(p, vllm.SamplingParams)
        and p.ignore_eos
        and p.temperature == 0.0
        and p.output_kind == RequestOutputKind.FINAL_ONLY
        for p in params
    )
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 5, 3]


def test_report_renders_the_gap_split_and_fills_late_shares_of_older_results():
    from benchmarks.bench_vllm_report import _fill_late_shares, _split_table

    row = {
        "method": "specdec",
        "dataset": "code",
        "batch_size": 64,
        "load": "sustained",
        "gap_split_ms": {"held_ms": 0.9, "after_ms": 0.08, "sync_ms": 4.0, "finish_ms": 4.6},
    }
    summary = {"rows": [row], "traces": {"specdec|code:sustained|64": {"sync_ms": [4.0, 0.1, 3.0, 0.2]}}}
    _fill_late_shares(summary)
    assert row["gap_split_ms"]["host_late_share"] == 0.5
    lines = _split_table([row], "code", [64], ["b 64"])
    assert lines[0].startswith("### code: GPU gap (ms)")
    assert "| specdec | 0.90 + 0.08; drafting 0.60; host late 50% |" in lines  # no busy / gap: no share
    timed = {**row, "gpu_busy_ms_per_step": 11.0, "gpu_gap_ms_per_step": 1.0}  # a 12 ms step
    assert "| specdec | 0.90 + 0.08; drafting 0.60 (5.0% of step); host late 50% |" in _split_table(
        [timed], "code", [64], ["b 64"]
    )
    assert _split_table([{**row, "gap_split_ms": None}], "code", [64]) == []


def test_report_renders_the_host_phases_per_step_period():
    from benchmarks.bench_vllm_report import _phase_table

    row = {
        "method": "specdec",
        "dataset": "code",
        "batch_size": 64,
        "load": "sustained",
        "host_phase_ms": {"period_ms": 14.0, "sched_ms": 2.0, "exec_ms": 6.5, "sample_ms": 1.25, "update_ms": 3.0},
    }
    lines = _phase_table([row], "code", [64], ["b 64"])
    assert lines[0].startswith("### code: host ms per step period")
    assert "| specdec | 2.00 + 6.50 + 1.25 + 3.00 = 12.75 of 14.00 |" in lines
    hooked = _phase_table([{**row, "draft_ms_per_step": 2.5}], "code", [64], ["b 64"])
    assert "| specdec | 2.00 + 6.50 + 1.25 + 3.00 = 12.75 of 14.00; drafting hooks 2.50 |" in hooked
    assert _phase_table([{**row, "host_phase_ms": None}], "code", [64]) == []


def test_step_traces_move_to_a_gzip_file_beside_the_results_and_read_back(tmp_path):
    """save_step_traces: the traces leave the JSON for RESULTS.traces.json.gz (named in summary.traces_file);
    read_step_traces finds them there, under a renamed stem too, and still reads older inline files."""
    import json

    from benchmarks.step_trace import read_step_traces, save_step_traces, traces_path

    traces = {"specdec|code:sustained|64": {"reqs": [64, 64], "sync_ms": [4.0, 0.1]}}
    doc = {"summary": {"rows": [], "traces": json.loads(json.dumps(traces))}}
    path = tmp_path / "2026-11-23_h200_vllm_bench.json"
    save_step_traces(doc, path)
    assert (
        "traces" not in doc["summary"] and doc["summary"]["traces_file"] == "2026-11-23_h200_vllm_bench.traces.json.gz"
    )
    path.write_text(json.dumps(doc))
    assert traces_path(path).is_file() and read_step_traces(path) == traces
    renamed = tmp_path / "run99_x.json"  # results copied under a new name, the traces file alike
    path.rename(renamed)
    traces_path(path).rename(traces_path(renamed))
    assert read_step_traces(renamed) == traces
    inline = tmp_path / "old.json"
    inline.write_text(json.dumps({"summary": {"traces": traces}}))
    assert read_step_traces(inline) == traces
    empty = {"summary": {"rows": []}}
    save_step_traces(empty, tmp_path / "none.json")
    assert empty == {"summary": {"rows": []}} and not traces_path(tmp_path / "none.json").exists()
    assert read_step_traces(tmp_path / "none.json", empty) == {}


def test_slot_counters_include_the_narrow_schedules_by_width():
    """bench_vllm's per-cell slot-book counters (deltas over a cell) carry the narrow schedules, also by width."""
    from benchmarks.engine_timer import slot_counters as _slot_counters
    from specdec.vllm_plugin.modes.slots import SlotBook
    from specdec.vllm_plugin.proposer import INSTANCES

    book = SlotBook(16, narrow=6, narrow_rows=(16, 48), high=(8, 4.0))
    holder = BookHolder(book)
    INSTANCES.add(holder)
    try:
        for _ in range(3):
            book.begin_schedule(running=32)
        counters = _slot_counters()
    finally:
        INSTANCES.discard(holder)
    assert counters["narrow_steps"] == 3 and counters["narrow_steps_w6"] == 3 and "narrow_steps_w8" not in counters
    assert _slot_counters() == {}


def test_a_worker_cut_short_keeps_its_finished_cells(tmp_path):
    """bench_vllm's worker writes every finished cell at once: a worker killed by the method timeout (or failing)
    is read back with those cells, marked partial with its rc; one with none, or no file, gives None; rc 0 is whole.
    The summary marks the cut-short engine's rows and skips lossless cells its reference never reached."""
    import json

    from benchmarks.bench_vllm import _read_worker

    out = tmp_path / "w.json"
    assert _read_worker(out, 124, "m") is None  # killed before its first cell
    whole = _run("specdec", {"8": _cell(100.0, [[1, 2]])})
    out.write_text(json.dumps({**whole, "partial": True}))
    cut = _read_worker(out, 124, "m")
    assert cut is not None and cut["partial"] and cut["rc"] == 124 and list(cut["datasets"]["code"]) == ["8"]
    out.write_text(json.dumps({**whole, "datasets": {"code": {}}, "partial": True}))
    assert _read_worker(out, 1, "m") is None  # no finished cell
    out.write_text(json.dumps(whole))
    assert _read_worker(out, 0, "m") == whole
    ref = [[1, 2, 3]]
    rows = summarise({"nospec": _run("nospec", {"8": _cell(100.0, ref)}), "specdec": cut}, {})["rows"]
    assert [r.get("engine_rc") for r in rows] == [None, 124]
    lossless = {
        "nospec": _run("nospec", {"8": _cell(10.0, ref)}),  # cut short: no batch-16 cell
        "specdec": _run("specdec", {"8": _cell(20.0, ref), "16": _cell(20.0, ref)}),
    }
    checks = summarise({}, lossless)["lossless_fp32"]
    assert [c["batch_size"] for c in checks] == [8]
    out.write_text('{"datasets": {"code": {"8": ')  # a torn file (not expected: the worker renames) reads as None
    assert _read_worker(out, 124, "m") is None


def test_engine_process_flag_reaches_the_workers_and_the_settings_and_refuses_the_profiler(tmp_path, monkeypatch):
    """--engine-process: every worker runs its engine core in a process of its own (vLLM's default layout); the
    settings say so; --trace goes with it; --profile-methods (cProfile of the worker's own process) is refused."""
    import json

    import pytest

    from benchmarks import bench_vllm

    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"policy": "test", "datasets": {"code": {"warmup": [[1]], "bs8": [[1, 2]]}}}))
    cmds = _fake_workers(monkeypatch, lambda cmd, load: {"8": {**_cell(40.0, [[1]]), "load": "closed"}})
    base = _two_method_args(prompts, tmp_path)
    bench_vllm.main(base + ["--engine-process", "--out-dir", str(tmp_path / "mp")])
    assert len(cmds) == 2 and all("--engine-process" in c for c in cmds)
    doc = json.loads(next((tmp_path / "mp").glob("*.json")).read_text())
    assert doc["settings"]["engine"] == bench_vllm.ENGINE_PROCESS_SETTING
    cmds.clear()
    bench_vllm.main(base + ["--out-dir", str(tmp_path / "inproc")])
    assert cmds and not any("--engine-process" in c for c in cmds)
    doc = json.loads(next((tmp_path / "inproc").glob("*.json")).read_text())
    assert doc["settings"]["engine"] == bench_vllm.ENGINE_INPROC_SETTING
    with pytest.raises(SystemExit) as exc:
        bench_vllm.main(base + ["--engine-process", "--profile-methods", "specdec"])
    assert exc.value.code == 2
    cmds.clear()
    bench_vllm.main(base + ["--engine-process", "--trace", "--out-dir", str(tmp_path / "traced")])
    assert cmds and all("--engine-process" in c and "--trace" in c for c in cmds)


def test_a_variants_path_goes_first_on_its_workers_import_path(tmp_path, monkeypatch):
    """--variants {"before": {"base": "specdec", "path": DIR}}: that method's worker runs with DIR (the GPU gate's
    install of the base commit) first on its import path, the others with none; run_worker puts it before the
    inherited PYTHONPATH."""
    import json
    import sys

    from benchmarks import bench_vllm
    from benchmarks.bench_vllm import run_worker

    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"policy": "test", "datasets": {"code": {"warmup": [[1]], "bs8": [[1, 2]]}}}))
    cmds = _fake_workers(monkeypatch, lambda cmd, load: {"8": {**_cell(40.0, [[1]]), "load": "closed"}})
    base = _two_method_args(prompts, tmp_path)
    variants = json.dumps({"before": {"base": "specdec", "path": "/tmp/base-tree"}})
    i = base.index("--methods")
    base[i + 1] = "nospec,before,specdec"
    bench_vllm.main([*base, "--variants", variants, "--out-dir", str(tmp_path / "out")])
    methods = [c[c.index("--method") + 1] for c in cmds]
    assert methods == ["nospec", "before", "specdec"] and cmds.paths == [None, "/tmp/base-tree", None]
    monkeypatch.undo()  # the real run_worker: the child prints its import path
    monkeypatch.setenv("PYTHONPATH", "/inherited")
    out = tmp_path / "path.txt"
    code = f"import sys; open({str(out)!r}, 'w').write('\\n'.join(sys.path))"
    assert run_worker([sys.executable, "-c", code], 30.0, path=str(tmp_path / "first")) == 0
    seen = out.read_text().splitlines()
    assert seen.index(str(tmp_path / "first")) < seen.index("/inherited")


def test_a_timed_out_worker_takes_its_whole_process_group_with_it(tmp_path):
    """run_worker: a worker past its timeout gives TIMEOUT_RC, and a process it started (an engine core in its own
    process holds GPU memory) is killed with it; a worker that exits gives its own code and leaves nothing behind."""
    import sys
    import time

    from benchmarks.bench_vllm import TIMEOUT_RC, run_worker

    pid_file = tmp_path / "child.pid"
    script = (
        "import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; "
        f"time.sleep(60)']); open({str(pid_file)!r}, 'w').write(str(c.pid)); time.sleep(60)"
    )
    t0 = time.perf_counter()
    assert run_worker([sys.executable, "-c", script], 3.0) == TIMEOUT_RC
    assert time.perf_counter() - t0 < 30
    child = int(pid_file.read_text())
    for _ in range(100):  # the child is reaped by init once killed
        if not _alive(child):
            break
        time.sleep(0.05)
    assert not _alive(child)
    assert run_worker([sys.executable, "-c", "raise SystemExit(3)"], 30.0) == 3


def _alive(pid: int) -> bool:
    """A process ``pid`` exists and is not a zombie."""
    from pathlib import Path

    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_temperature_reaches_the_workers_and_the_settings_and_sampled_cells_count_no_mismatches(tmp_path, monkeypatch):
    import json

    from benchmarks import bench_vllm

    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"policy": "test", "datasets": {"code": {"warmup": [[1]], "bs8": [[1, 2]]}}}))

    def cells_of(cmd, load):  # specdec's outputs differ from no speculation's, as sampled outputs do
        outs = [[1, 2]] if cmd[cmd.index("--method") + 1] == "nospec" else [[1, 3]]
        return {"8": {**_cell(40.0, outs), "load": "closed"}}

    cmds = _fake_workers(monkeypatch, cells_of)
    base = _two_method_args(prompts, tmp_path)
    bench_vllm.main(base + ["--out-dir", str(tmp_path / "greedy")])
    assert all(c[c.index("--temperature") + 1] == "0.0" for c in cmds)
    doc = json.loads(next((tmp_path / "greedy").glob("*.json")).read_text())
    assert doc["settings"]["greedy"] and doc["settings"]["temperature"] == 0.0
    assert next(r for r in doc["summary"]["rows"] if r["method"] == "specdec")["mismatches_vs_nospec"] == 1
    cmds.clear()
    bench_vllm.main(base + ["--temperature", "1", "--out-dir", str(tmp_path / "sampled")])
    assert all(c[c.index("--temperature") + 1] == "1.0" for c in cmds)
    doc = json.loads(next((tmp_path / "sampled").glob("*.json")).read_text())
    assert not doc["settings"]["greedy"] and doc["settings"]["temperature"] == 1.0
    runs = {  # what the workers record: their cells' temperature
        m: {**_run(m, {"8": _cell(40.0, outs)}), "temperature": 1.0}
        for m, outs in (("nospec", [[1, 2]]), ("specdec", [[1, 3]]))
    }
    assert "mismatches_vs_nospec" not in next(r for r in summarise(runs, {})["rows"] if r["method"] == "specdec")
