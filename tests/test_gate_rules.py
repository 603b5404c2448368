"""The GPU gate's verdict rules at their boundaries, and the parsing of what vLLM hands back (no vLLM here)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks import gate_rules as rules
from benchmarks.gate_metrics import (
    bench_result,
    digest,
    log_phases,
    mismatches,
    repeat_share,
    request_rate,
    spec_counts,
    spec_delta,
    speed,
    wall_split,
)

P, W, F, V, N = rules.PASS, rules.WARN, rules.FAIL, rules.VOID, rules.NONE


@pytest.mark.parametrize(
    ("first", "rerun", "verdict"),
    [
        (1.0, None, P),  # at the bar: no re-run needed
        (1.3, None, P),
        (0.999, None, F),  # under it and not re-run
        (0.98, 1.00, P),  # re-run mean 0.99 exactly: passes
        (0.97, 1.01, P),
        (0.98, 0.999, F),  # mean 0.9895
        (0.5, 1.2, F),  # mean 0.85
        (None, None, N),
    ],
)
def test_vs_nospec_rerun_mean(first, rerun, verdict):
    assert rules.vs_nospec(first, rerun)[0] == verdict


@pytest.mark.parametrize(
    ("steps", "verdict"),
    [
        ((202.0, 50.0), F),  # the cache cut the re-run's steps: the first run (0.96) decides
        ((200.0, 180.0), P),  # 90% of the steps: noise, the mean counts
        ((200.0, 179.0), F),
        ((0.0, 50.0), P),  # steps unknown (no plugin stats): the mean counts
        (None, P),
    ],
)
def test_a_rerun_the_cache_made_faster_does_not_count(steps, verdict):
    assert rules.vs_nospec(0.96, 1.5, steps)[0] == verdict


@pytest.mark.parametrize(
    ("r", "verdict"), [(1.5, P), (2.0, P), (1.4999, W), (1.3, W), (1.2999, F), (0.8, F), (None, N)]
)
def test_vs_suffix_bands(r, verdict):
    assert rules.vs_suffix(r) == verdict


def test_start_and_kv_bounds():
    assert rules.start_verdict(125.0, 100.0) == P
    assert rules.start_verdict(125.01, 100.0) == F
    assert rules.start_verdict(80.0, 100.0) == P
    assert rules.start_verdict(None, 100.0) == N
    assert rules.kv_verdict(97.0, 100.0) == P
    assert rules.kv_verdict(96.99, 100.0) == F
    assert rules.kv_verdict(120.0, 100.0) == P
    assert rules.kv_verdict(97.0, None) == N


def test_void_over_two_percent():
    assert not rules.repeats_void(101.0, 99.0)  # 2.0% of their mean: not more than 2%
    assert rules.repeats_void(101.01, 99.0)
    assert not rules.repeats_void(100.0, 100.0)
    assert rules.repeat_diff(0.0, 0.0) == 0.0


def test_tpot_within_three_percent():
    assert rules.tpot_verdict(1.03) == P
    assert rules.tpot_verdict(0.9) == P
    assert rules.tpot_verdict(1.0301) == F
    assert rules.tpot_verdict(rules.ratio(8.73, 4.01)) == F  # issue 41's 2.2x
    assert rules.tpot_verdict(None) == N


def test_overall_takes_the_most_severe():
    assert rules.overall([P, W, P]) == W
    assert rules.overall([P, F, W]) == F
    assert rules.overall([F, V]) == V
    assert rules.overall([N, P]) == P
    assert rules.overall([]) == N


def _m(name: str, value: float, **labels) -> SimpleNamespace:
    return SimpleNamespace(name=name, labels=labels, value=value)


def test_spec_counts_from_get_metrics():
    metrics = [
        _m("vllm:spec_decode_num_drafts", 10, engine="0"),
        _m("vllm:spec_decode_num_drafts", 5, engine="1"),  # label sets are summed
        _m("vllm:spec_decode_num_draft_tokens_total", 60),
        _m("vllm:spec_decode_num_accepted_tokens", 20),
        SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens_per_pos", labels={}, values=[9, 7, 4]),
        _m("vllm:generation_tokens", 1000),
        _m("vllm:num_requests_running", 3.0),
    ]
    assert spec_counts(metrics) == {"drafts": 15.0, "draft_tokens": 60.0, "accepted_tokens": 20.0}
    assert spec_counts([]) == {"drafts": 0.0, "draft_tokens": 0.0, "accepted_tokens": 0.0}


def test_emitted_tokens_per_drafted_step():
    before = {"drafts": 5.0, "draft_tokens": 40.0, "accepted_tokens": 3.0}
    after = {"drafts": 15.0, "draft_tokens": 120.0, "accepted_tokens": 18.0}
    d = spec_delta(before, after)
    assert d["drafts"] == 10.0 and d["accepted_tokens"] == 15.0
    assert d["emitted_per_step"] == pytest.approx(2.5)  # (10 + 15) / 10
    assert spec_delta(before, before)["emitted_per_step"] is None  # no drafts (no speculation)
    # issue 41's symptom: drafts proposed, none accepted
    assert spec_delta({}, {"drafts": 7.0, "draft_tokens": 50.0})["emitted_per_step"] == 1.0


def test_repeat_share_hand_checked():
    # 4-grams of 1 2 3 4 1 2 3 4: 1234 2341 3412 4123 1234 -> the fifth repeats the first
    assert repeat_share([[1, 2, 3, 4, 1, 2, 3, 4]]) == pytest.approx(1 / 5)
    # a loop of one token: 7 four-grams, all but the first repeated
    assert repeat_share([[7] * 10]) == pytest.approx(6 / 7)
    # no repeats; outputs shorter than 4 add nothing; repeats count within an output only
    assert repeat_share([[1, 2, 3, 4, 5], [1, 2], [1, 2, 3, 4]]) == 0.0
    assert repeat_share([[1, 2, 3], []]) is None
    # pooled over outputs: (1 + 6) repeated of (5 + 7)
    assert repeat_share([[1, 2, 3, 4, 1, 2, 3, 4], [7] * 10]) == pytest.approx(7 / 12)


def test_digests_and_mismatches():
    a = [digest([1, 2, 3]), digest([4, 5])]
    b = [digest([1, 2, 3]), digest([4, 6])]
    assert digest([1, 2, 3]) == digest((1, 2, 3))
    assert mismatches(a, a) == 0
    assert mismatches(a, b) == 1
    assert mismatches(a, b[:1]) is None  # cells that do not line up are not compared


BENCH_TEXT = """============ Serving Benchmark Result ============
Successful requests:                     200
Benchmark duration (s):                  11.02
Output token throughput (tok/s):         2315.80
---------------Time to First Token----------------
Mean TTFT (ms):                          12.31
Median TTFT (ms):                        11.87
-----Time per Output Token (excl. 1st token)------
Mean TPOT (ms):                          4.52
Median TPOT (ms):                        4.01
P99 TPOT (ms):                           6.20
---------------Inter-token Latency----------------
Median ITL (ms):                         3.90
"""


def test_bench_serve_result_json_then_text():
    js = {"median_tpot_ms": 8.73, "mean_tpot_ms": 9.1, "output_throughput": 1800.0, "completed": 200, "itls": [1, 2]}
    out = bench_result(js, BENCH_TEXT)
    assert out["median_tpot_ms"] == 8.73 and out["completed"] == 200.0  # the JSON wins
    text = bench_result(None, BENCH_TEXT)
    assert text["median_tpot_ms"] == 4.01 and text["p99_tpot_ms"] == 6.2 and text["output_throughput"] == 2315.8
    assert text["completed"] == 200.0 and text["median_ttft_ms"] == 11.87
    assert bench_result(None, "Traceback: server went away") == {}
    assert bench_result({"mean_tpot_ms": 3.0}, "") == {}  # no median TPOT: no result


def test_engine_log_phases():
    log = """INFO 11-28 [default_loader.py:431] Loading weights took 12.50 seconds
INFO 11-28 [gpu_model_runner.py:5348] Model loading took 13.2 GiB memory and 14.100000 seconds
INFO 11-28 [monitor.py:53] torch.compile took 41.07 s in total
INFO 11-28 [gpu_model_runner.py:6845] Graph capturing finished in 23 secs, took 0.51 GiB
INFO 11-28 [core.py:331] init engine (profile, create kv cache, warmup model) took 70.12 s (compilation: 41.07 s)
"""
    out = log_phases(log)
    assert out == {
        "weights_s": 12.5,
        "model_load_s": 14.1,
        "compile_s": 41.07,
        "graph_capture_s": 23.0,
        "engine_init_s": 70.12,
        "compile_cached": False,
    }
    hit = "Directly load the compiled graph(s) for compile range (1, 8192) from the cache, took 3.1 s\n"
    assert log_phases(hit + "torch.compile took 5.00 s in total")["compile_cached"] is True
    assert log_phases("") == {}
    graphs = """INFO [runner] Profiling CUDA graph memory: PIECEWISE=64 (largest=1088), FULL=160 (largest=1088)
INFO [runner] Estimated CUDA graph memory: 0.92 GiB total
INFO [gpu_worker.py:560] Available KV cache memory: 112.87 GiB
"""
    assert log_phases(graphs) == {
        "graph_mem_gib": 0.92,
        "kv_mem_gib": 112.87,
        "graph_counts": "PIECEWISE=64 (largest=1088), FULL=160 (largest=1088)",
    }


def test_plugin_counters_per_cell_are_differences_of_numeric_leaves():
    from benchmarks.gate_metrics import flat_numbers, plugin_delta

    before = [{"steps": 10, "native_step": True, "graphs": {"plain_full": 4, "narrow_full": 1}, "mode": "schedule"}]
    after = [{"steps": 25, "native_step": True, "graphs": {"plain_full": 9, "narrow_full": 1}, "mode": "schedule"}]
    assert flat_numbers(after[0]) == {"steps": 25.0, "graphs.plain_full": 9.0, "graphs.narrow_full": 1.0}
    assert plugin_delta(before, after) == [{"steps": 15.0, "graphs.plain_full": 5.0}]
    assert plugin_delta(None, after) is None and plugin_delta(before, after * 2) is None


def test_plugin_table_shows_rank_zeros_counters():
    from benchmarks.gate_report import render_plugin

    cell = {"runs": [{"plugin": [{"steps": 30.0, "graphs.plain_full": 12.0}, {"steps": 30.0}]}]}
    lines = render_plugin({"cells": {"code/b8": cell, "code/b1": {"runs": [{}]}}})
    assert lines[0].split()[:4] == ["specdec", "steps", "plain", "narrow"]
    assert lines[2].split()[:5] == ["code", "b8", "30", "12", "-"] and len(lines) == 4
    assert render_plugin({}) == []


def test_the_wall_table_shows_each_engines_first_tokens_and_tail_per_cell():
    from benchmarks.gate_report import render_walls

    split = {"first_tokens_s": 1.25, "tail_s": 0.5, "slowest_tokens": 255.0, "slowest_s": 0.8}
    engines = {
        "nospec": {"cells": {"agentic/b32": {"runs": [{"wall_split": split, "request_tokens_per_s": 100.0}, {}]}}},
        "specdec": {
            "cells": {
                "agentic/b32": {
                    "runs": [
                        {"wall_split": {**split, "tail_s": 0.375, "slowest_s": 1.0}, "request_tokens_per_s": 130.0}
                    ]
                },
                "code/b1": {},
            }
        },
        "suffix": {"cells": {"agentic/b32": {"runs": [{}]}}},  # recorded none: no columns
    }
    lines = render_walls(engines, ("nospec", "specdec", "suffix"))
    assert lines[0].split() == [
        "wall", "s", "nospec", "1st", "nospec", "tail", "specdec", "1st", "specdec", "tail",
        "specdec", "slow×", "specdec", "req×",
    ]  # fmt: skip
    # the slowest request took 1.25x the reference's, the mean request decoded 1.3x faster
    assert lines[2].split() == ["agentic", "b32", "1.250", "0.500", "1.250", "0.375", "1.25", "1.30"]
    assert lines[3].split() == ["code", "b1", "-", "-", "-", "-", "-", "-"] and lines[-1] == ""
    assert render_walls({"nospec": {"cells": {"code/b1": {"runs": [{}]}}}}, ("nospec",)) == []


def _result(n: int, first: float, last: float) -> SimpleNamespace:
    return SimpleNamespace(
        outputs=[SimpleNamespace(token_ids=list(range(n)))],
        metrics=SimpleNamespace(first_token_ts=first, last_token_ts=last),
    )


def test_request_rate_is_tokens_after_the_first_over_first_to_last_token():
    # 9 tokens after the first in 0.9 s, 3 in 0.3 s: 12 / 1.2 = 10 tok/s; a one-token and an untimed request add nothing
    results = [_result(10, 1.0, 1.9), _result(4, 2.0, 2.3), _result(1, 3.0, 3.0), SimpleNamespace(outputs=[])]
    assert request_rate(results) == pytest.approx(10.0)
    assert request_rate([SimpleNamespace(outputs=[SimpleNamespace(token_ids=[1, 2])], metrics=None)]) is None


def _timed(n: int, queued: float, first: float, last: float) -> SimpleNamespace:
    metrics = SimpleNamespace(queued_ts=queued, first_token_ts=first, last_token_ts=last)
    return SimpleNamespace(outputs=[SimpleNamespace(token_ids=list(range(n)))], metrics=metrics)


def test_the_wall_split_sums_each_batchs_first_tokens_and_decode_tail():
    # batch 1: queued at 10.0, last first token at 10.5, last token at 11.25 (the 9-token request, first at 10.25);
    # batch 2: queued at 20.0, first token 20.25, last 20.5
    batch1 = [_timed(9, 10.0, 10.25, 11.25), _timed(4, 10.0, 10.5, 10.75)]
    batch2 = [_timed(3, 20.0, 20.25, 20.5)]
    split = wall_split([batch1, batch2])
    assert split == pytest.approx({"first_tokens_s": 0.75, "tail_s": 1.0, "slowest_tokens": 10.0, "slowest_s": 1.25})
    assert wall_split([batch1, [SimpleNamespace(outputs=[], metrics=None)]]) is None
    assert wall_split([]) is None


def test_sampled_cells_are_judged_on_the_requests_decode_rate():
    # same seeds, other lengths: fewer output tokens in the same wall, at the same per-request rate
    nospec = {"tokens_per_s": 2048 / 1.2, "request_tokens_per_s": 200.0}
    specdec = {"tokens_per_s": 1728 / 1.18, "request_tokens_per_s": 210.0}
    assert speed(specdec, 0.8) / speed(nospec, 0.8) == pytest.approx(1.05)
    assert speed(specdec, 0.0) / speed(nospec, 0.0) == pytest.approx((1728 / 1.18) / (2048 / 1.2))  # greedy: tok/s
    assert speed({"tokens_per_s": 5.0}, 0.8) == 5.0  # no timestamps recorded: tok/s
    assert speed(None, 0.8) is None


OLD_LINE = (  # vLLM 0.26 server log, the plugin at 49d32a6 (before the verified-step split)
    "(EngineCore pid=4594) INFO 11-28 14:09:37 [reporting.py:104] specdec: 299 steps (35 with drafts), drafted 141, "
    "accepted 4 (2.8%), 0.124 ms/step in propose, 0 timeouts, 0 errors, 0 plain steps, 1 requests backed off (low "
    "acceptance; 8 back-offs, 8 recoveries, 19 newcomers held so far), batch not padded"
)
FINAL_LINE = (
    "(EngineCore pid=7) INFO 11-28 15:40:01 [reporting.py:130] specdec: final: 2104 steps (451 with drafts), drafted "
    "1757, accepted 202 (11.5%), 0.131 ms/step in propose, 0 timeouts, 0 errors, 3 plain steps, 2 requests backed "
    "off (low acceptance; 150 back-offs, 149 recoveries, 120 newcomers held so far; verified drafted steps 380 before "
    "any back-off, 211 after a recovery)"
)

IDLE_LINE = (  # the totals the plugin logs when the engine goes idle (vLLM 0.26 force-kills it at shutdown)
    "(EngineCore pid=7) INFO 11-28 15:39:58 [reporting.py:128] specdec: idle: 2101 steps (450 with drafts), drafted "
    "1755, accepted 201 (11.5%), 0.131 ms/step in propose, 0 timeouts, 0 errors, 3 plain steps, 2 requests backed "
    "off (low acceptance; 150 back-offs, 149 recoveries, 120 newcomers held so far; verified drafted steps 379 before "
    "any back-off, 211 after a recovery)"
)


def test_the_plugins_statistics_line_is_read_back_from_a_server_log():
    from benchmarks.gate_metrics import plugin_line

    assert plugin_line("no plugin here\n") is None
    old = plugin_line(OLD_LINE)
    assert old == {
        "steps": 299, "drafted_steps": 35, "drafted": 141, "accepted": 4,
        "back_offs": 8, "recoveries": 8, "newcomers_held": 19,
    }  # fmt: skip
    got = plugin_line(f"{OLD_LINE}\nother\n{FINAL_LINE}\n")  # the last line: the totals at shutdown
    keys = ("steps", "drafted_steps", "outcomes_first", "outcomes_recovered")
    assert tuple(got[k] for k in keys) == (2104, 451, 380, 211)


def test_the_idle_line_is_read_back_and_the_last_line_wins():
    """A server whose engine is force-killed at shutdown leaves no final line: its last idle line has the totals."""
    from benchmarks.gate_metrics import plugin_line

    idle = plugin_line(f"{OLD_LINE}\nother\n{IDLE_LINE}\n(APIServer) [shutdown] force killing\n")
    assert idle == {
        "steps": 2101, "drafted_steps": 450, "drafted": 1755, "accepted": 201, "back_offs": 150, "recoveries": 149,
        "newcomers_held": 120, "outcomes_first": 379, "outcomes_recovered": 211,
    }  # fmt: skip
    assert plugin_line(f"{IDLE_LINE}\n{FINAL_LINE}\n")["steps"] == 2104  # a final line after it: the final's
    assert plugin_line(f"{FINAL_LINE}\n{IDLE_LINE}\n")["steps"] == 2101  # whichever came last


def test_the_step_gates_count_is_read_back_where_logged():
    """Since cd1369b the line ends with the steps the large-batch step gate withheld every draft of; older lines
    (without it) still parse, without the key."""
    from benchmarks.gate_metrics import plugin_line

    gated = IDLE_LINE.replace("211 after a recovery)", "211 after a recovery; 17 steps gated)") + ", batch not padded"
    got = plugin_line(gated)
    assert got is not None and got["gated_steps"] == 17 and got["outcomes_recovered"] == 211
    assert "gated_steps" not in plugin_line(IDLE_LINE)


def test_the_serve_table_shows_the_plugins_totals():
    from benchmarks.gate_metrics import plugin_line
    from benchmarks.gate_report import serve_rows

    servers = {
        "nospec": {"bench": {"median_tpot_ms": 4.9}, "answered": True},
        "specdec": {"bench": {"median_tpot_ms": 5.3}, "answered": True, "plugin": plugin_line(FINAL_LINE)},
    }
    rows = serve_rows({"tpot-8b": {"kind": "tpot", "servers": servers}})
    (row,) = [r for r in rows if r["check"] == "tpot-8b specdec drafting"]
    assert row["note"] == "2104 steps, 451 drafted, 380/211"
