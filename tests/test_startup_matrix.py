"""The start-up matrix's log parsing and output comparison, on hand-written vLLM 0.26 log lines."""

from __future__ import annotations

from benchmarks.startup_matrix import compare, parse_log, table

# Long log lines are split with a backslash continuation, which leaves them whole in the string.
LOG = """\
(EngineCore pid=1) INFO [gpu_model_runner.py:6612] Profiling CUDA graph memory: \
PIECEWISE=64 (largest=1088), FULL=144 (largest=1088)
(EngineCore pid=1) DEBUG [gpu_model_runner.py:6688] Estimated PIECEWISE CUDA graph memory: \
352.00 MiB first-capture + (64-1) × 4.00 MiB per-graph
(EngineCore pid=1) DEBUG [gpu_model_runner.py:6688] Estimated FULL CUDA graph memory: \
-16.00 MiB first-capture + (144-1) × 1.00 MiB per-graph
(EngineCore pid=1) INFO [gpu_model_runner.py:6737] Estimated CUDA graph memory: 0.90 GiB total
(EngineCore pid=1) INFO [gpu_worker.py:560] Available KV cache memory: 57.97 GiB
(EngineCore pid=1) INFO [kv_cache_utils.py:2177] GPU KV cache size: 949,744 tokens
(EngineCore pid=1) INFO [graphs.py:334] specdec: added 80 CUDA graphs \
(narrow 48, ragged 16, ragged with prompt chunks 16): 106 MiB
(EngineCore pid=1) INFO [gpu_worker.py:793] CUDA graph pool memory: 1.18 GiB (actual), 0.9 GiB (estimated), difference
"""


def test_parse_log_reads_vllms_start_up_lines() -> None:
    got = parse_log(LOG)
    assert got["graph_profile"] == "PIECEWISE=64 (largest=1088), FULL=144 (largest=1088)"
    assert got["graph_estimate_gib"] == 0.90 and got["graph_actual_gib"] == 1.18
    assert got["kv_cache_gib"] == 57.97 and got["kv_cache_tokens"] == 949744
    assert got["graph_mode_estimate"] == {
        "PIECEWISE": {"first_mib": 352.0, "graphs": 64, "per_graph_mib": 4.0},
        "FULL": {"first_mib": -16.0, "graphs": 144, "per_graph_mib": 1.0},
    }
    assert got["specdec_graphs"].startswith("added 80 CUDA graphs")
    assert "error" not in got


def test_parse_log_reads_the_start_up_failure() -> None:
    got = parse_log("ValueError: No available memory for the cache blocks. Try increasing it.\n")
    assert got["error"].startswith("ValueError: No available memory")


def test_compare_counts_differing_prompts_against_no_speculation() -> None:
    rows = [
        {"config": "defaults", "method": "nospec", "outputs": [[1, 2], [3, 4]], "started": True},
        {"config": "defaults", "method": "specdec", "outputs": [[1, 2], [3, 5]], "started": True},
        {"config": "eager", "method": "specdec", "outputs": [[1, 2], [3, 4]], "started": True},
        {"config": "eager", "method": "suffix", "rc": 1, "started": False},
    ]
    compare(rows)
    assert rows[1]["prompts_differing"] == 1
    assert rows[2]["prompts_differing"] == 0  # no no-spec engine of its own: compared to the first one's
    assert "prompts_differing" not in rows[3]  # it did not start
    assert "| eager | suffix | NO: 1 |" in table(rows)
