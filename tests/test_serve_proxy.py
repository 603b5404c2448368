"""The CPU proxy of the gate's low-acceptance serve check (``benchmarks.serve_proxy``): its traffic (random prompts,
Poisson arrivals in engine steps) and (vLLM) one engine serving arrivals against given target outputs."""

from __future__ import annotations

import importlib.util
import random

import pytest

from benchmarks import serve_proxy as sp
from benchmarks.step_model import H200_8B, step_seconds


def test_prompts_are_reproducible_random_ids_of_the_checks_length_without_special_ids():
    a, b = sp.prompts(5, 1000, seed=0), sp.prompts(5, 1000, seed=0)
    assert a == b and a != sp.prompts(5, 1000, seed=1)
    assert all(len(p) == sp.PROMPT_TOKENS for p in a)
    assert min(min(p) for p in a) >= sp.FIRST_ORDINARY_ID and max(max(p) for p in a) < 1000


def test_arrivals_are_a_poisson_process_at_the_rate_in_engine_steps():
    at = sp.arrivals(2000, 20.0, seed=0)
    assert at == sorted(at) and at == sp.arrivals(2000, 20.0, seed=0)
    seconds = at[-1] * sp.STEP_MS / 1000.0
    assert 2000 / seconds == pytest.approx(20.0, rel=0.1)  # 2,000 arrivals: within 10% of the rate
    gaps = [b - a for a, b in zip(at, at[1:])]
    assert 0 < gaps.count(0) < len(gaps) / 5  # 0.1 arrivals a step: a few steps see two, most gaps are longer


def test_the_table_reads_each_variants_steps_per_token_against_the_first():
    cols = ("engine_steps", "slot_steps", "slot_tokens", "drafted_steps", "drafted", "accepted", "back_offs")
    row = {c: 1.0 for c in (*cols, "recoveries")}
    res = {
        "off": {**row, "withheld": 0.0, "steps_per_token_p50": 1.25},
        "on": {**row, "withheld": 3.0, "steps_per_token_p50": 1.0},
    }
    res["on"]["host_ms_per_step"] = {"capture": 0.25, "fill": 1.0, "finish": 0.5, "wait": 0.75}  # wait: inside fill
    lines = sp.table(res).splitlines()
    # without a step model no modeled TPOT: "-" in its two columns
    assert lines[2].split()[-5:] == ["1.250", "1.000", "0.000", "-", "-"]
    assert lines[3].split()[-5:] == ["1.000", "0.800", "1.750", "-", "-"]
    res["on"] |= {"tpot_ms_p50": 5.25, "plain_tpot_ms_p50": 5.0}  # a step model's: 1.05x no speculation's
    assert sp.table(res).splitlines()[3].split()[-2:] == ["5.250", "1.050"]


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not importable (scripts/test.sh has it)")
def test_one_engine_serves_the_arrivals_and_emits_the_targets_outputs():
    from specdec.drafters.suffix import native_available
    from specdec.paths import TARGET_MODEL, model_path

    if not native_available() or not model_path(TARGET_MODEL).is_dir():
        pytest.skip("native suffix core or shared target model missing")
    rng = random.Random(0)
    ps = sp.prompts(12, 900, seed=0)
    seg = [rng.randrange(500, 900) for _ in range(10)]
    # half the requests repeat a segment (drafts accepted), half are random (not)
    outs = [(seg * 4)[:32] if i % 2 else [rng.randrange(2, 900) for _ in range(32)] for i in range(12)]
    at = sp.arrivals(12, 200.0, seed=0)
    res = sp.replay(ps, outs, at, None)  # asserts every output is the target's
    assert res["accepted"] > 0 and 0 < res["drafted_steps"] <= res["engine_steps"] <= res["wall_steps"]
    # what the GPU would verify (slots follow the drafts a round late, so not the plugin's drafted steps one for one)
    assert 0 < res["slot_steps"] <= min(res["engine_steps"], res["slot_tokens"])
    assert 0 < res["steps_per_token_p50"] <= 1.0  # a request emits at least a token per step once decoding
    assert res["host_ms_per_step"]["fill"] > 0 and res["host_ms_per_step"]["capture"] > 0  # the plugin's hook
    # on the modeled clock: arrivals by time, a TPOT in modeled ms beside no speculation's for the same traffic
    model = H200_8B
    timed = sp.replay(ps, outs, at, None, timed=(sp.arrival_times(12, 200.0, seed=0), model))
    assert timed["accepted"] > 0 and timed["plain_tpot_ms_p50"] >= 1e3 * step_seconds(
        model, 1
    )  # at least a one-row step
    assert 0 < timed["tpot_ms_p50"] < 2 * timed["plain_tpot_ms_p50"]


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not importable (scripts/test.sh has it)")
def test_all_at_once_past_the_kv_cache_with_and_without_a_concurrency_cap(monkeypatch: pytest.MonkeyPatch):
    """16 requests of 900 prompt tokens at once, a KV cache of 400 blocks (6,400 tokens: seven such requests) and
    2,048 tokens a step (the engine's least: its max_model_len): vLLM preempts requests and resumes them as prompt
    chunks split across steps; a chunk samples no token (vLLM's async scheduler asserts otherwise), and every request
    still emits exactly its target's outputs. Under a cap of 5, at most 5 are in the engine at once."""
    from benchmarks import vllm_cpu_engine
    from specdec.drafters.suffix import native_available
    from specdec.paths import TARGET_MODEL, model_path

    if not native_available() or not model_path(TARGET_MODEL).is_dir():
        pytest.skip("native suffix core or shared target model missing")
    monkeypatch.setattr(sp, "MAX_BATCHED", sp.MAX_LEN)
    monkeypatch.setattr(vllm_cpu_engine, "KV_BLOCKS", 400)
    rng = random.Random(1)
    ps = [[rng.randrange(500, 900) for _ in range(900)] for _ in range(16)]
    outs = [[rng.randrange(2, 900) for _ in range(64)] for _ in range(16)]
    uncapped = sp.replay(ps, outs, [0] * 16, None)  # asserts every output is the target's
    capped = sp.replay(ps, outs, [0] * 16, None, concurrency=5)
    assert uncapped["peak_requests"] == 16 and capped["peak_requests"] == 5
