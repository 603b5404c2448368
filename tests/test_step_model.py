"""The modeled GPU step of the CPU engine (``benchmarks.step_model``) and the gate proxy's modeled speed."""

from __future__ import annotations

import pytest

from benchmarks import gate_proxy as gp
from benchmarks.step_model import H200_8B, parse_step_model, plain_serve, plain_wall, step_seconds
from specdec.eval.costmodel import CostModel


def linear(base_s: float, token_s: float) -> CostModel:
    """A step of T tokens in ``base_s + token_s * T`` seconds, as the project's cost model (t(1) and a per-token ms)."""
    return CostModel(t1_ms=1e3 * (base_s + token_s), per_token_ms=1e3 * token_s)


def test_a_step_costs_its_base_and_its_tokens_and_an_empty_one_nothing():
    model = linear(1e-3, 2e-5)
    assert step_seconds(model, 100) == pytest.approx(3e-3) and step_seconds(model, 0) == 0.0
    assert step_seconds(H200_8B, 100) == pytest.approx(4.5e-3 + 100 * 2e-5)


def test_no_speculations_wall_follows_chunked_prefill_then_one_token_a_row():
    model = linear(1.0, 0.1)
    # step 1: request 0's whole prompt (4, its first token) and 6 of request 1's 8 (10 tokens, the budget): 2.0
    # step 2: request 0 decodes (1), request 1's last 2 prompt tokens and its only token: 3 tokens, 1.3
    # step 3: request 0's last token: 1.1
    assert plain_wall([4, 8], [3, 1], model, max_batched=10) == pytest.approx(2.0 + 1.3 + 1.1)
    # one request of one token: its prompt's step only
    assert plain_wall([5], [1], model, max_batched=10) == pytest.approx(1.5)
    # a batch of one decodes a token a step after its prompt
    assert plain_wall([2], [4], model, max_batched=10) == pytest.approx(1.2 + 3 * 1.1)


def test_the_step_model_option_takes_a_name_or_two_numbers_and_says_what_is_wrong():
    assert parse_step_model("off") is None
    assert parse_step_model("h200-8b") == H200_8B
    custom = parse_step_model("4.5,20")  # 4.5 ms a step, 20 µs a token
    assert custom is not None and step_seconds(custom, 1) == pytest.approx(4.52e-3)
    assert step_seconds(custom, 101) == pytest.approx(6.52e-3)
    for bad in ("fast", "4.5", "0,20", "4.5,-1"):
        with pytest.raises(ValueError, match="--step-model"):
            parse_step_model(bad)


def test_a_cells_modeled_speed_is_no_speculations_wall_over_the_engines():
    row = dict.fromkeys([*gp.COUNTERS, *gp.ENGINE_COUNTERS], 10.0)
    assert gp.modeled_x(row) is None  # no step model: no column
    fast = {**row, "model_ms": 500.0, "plain_ms": 1000.0}
    slow = {**row, "model_ms": 1250.0, "plain_ms": 1000.0}
    assert gp.modeled_x(fast) == 2.0 and gp.modeled_x(slow) == 0.8
    lines = gp.table({"off": {"agentic/b32": fast}, "calib": {"agentic/b32": slow}}, ["off", "calib"]).splitlines()
    assert lines[0].split()[-1] == "model×" and lines[2].split()[-1] == "2.000" and lines[3].split()[-1] == "0.800"
    results = {"off": {"all/warmup": fast, "agentic/b8": fast, "agentic/b32": slow, "code/b1": row}}
    assert gp.set_modeled(results, ["off"]) == {"off": {"agentic": pytest.approx((2.0 * 0.8) ** 0.5)}}


def test_no_speculation_serving_admits_by_arrival_and_idles_to_the_next_one():
    model = linear(1.0, 0.1)
    # request 0 at 0: its prompt (4 tokens, first token) at 1.4, its last token at 2.5; request 1 arrives at 1.5,
    # after the step that began at 1.4 was scheduled: it joins at 2.5 and its prompt's step ends at 3.9
    times = plain_serve([4, 4], [2, 1], [0.0, 1.5], model, max_batched=10, max_seqs=4)
    assert times == [pytest.approx([1.4, 2.5]), pytest.approx([3.9])]
    # both at once, at most one in the engine: the same, request 1 waiting for request 0 to finish
    capped = plain_serve([4, 4], [2, 1], [0.0, 0.0], model, max_batched=10, max_seqs=4, concurrency=1)
    assert capped == [pytest.approx([1.4, 2.5]), pytest.approx([3.9])]
    # both at once, no cap: one step holds both prompts (8 tokens), then request 0's last token
    assert plain_serve([4, 4], [2, 1], [0.0, 0.0], model, max_batched=10, max_seqs=4) == [
        pytest.approx([1.8, 2.9]),
        pytest.approx([1.8]),
    ]
    # an idle engine waits for a late arrival: its prompt's step ends one step after it arrives
    assert plain_serve([4], [1], [10.0], model, max_batched=10, max_seqs=4) == [pytest.approx([11.4])]
