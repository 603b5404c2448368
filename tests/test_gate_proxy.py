"""The CPU proxy of the GPU gate (``benchmarks.gate_proxy``): the gate engine's order of cells, the back-off
variants set in-process and restored, and (vLLM) one engine replaying cells against given target outputs."""

from __future__ import annotations

import importlib.util
import random

import pytest

from benchmarks import gate_proxy as gp
from benchmarks.step_model import H200_8B
from specdec.vllm_plugin.core import backoff


def inputs() -> dict:
    rng = random.Random(0)

    def items(n: int, max_tokens: int) -> list[dict]:
        return [{"ids": [0, *(rng.randrange(20, 400) for _ in range(40))], "max_tokens": max_tokens} for _ in range(n)]

    return {
        "sets": {
            "agentic": {"warmup": items(2, 64), "b8": items(8, 48), "b1": items(2, 40)},
            "code": {"warmup": items(2, 64), "b1": items(2, 40), "s8": items(8, 48)},
        }
    }


def test_the_plan_follows_a_gate_engine_warm_up_first_then_each_sets_cells_in_order():
    doc = inputs()
    steps = gp.plan(doc, ["agentic", "code"], ["b1", "b8", "s8"])
    assert [(s, c) for s, c, _ in steps] == [("all", "warmup"), ("agentic", "b1"), ("agentic", "b8"), ("code", "b1")]
    warm = steps[0][2]
    assert len(warm) == 4 and {it["max_tokens"] for it in warm} == {gp.WARMUP_MAX_TOKENS}  # sampled cell skipped
    assert [(s, c) for s, c, _ in gp.plan(doc, ["agentic"], ["b8"])] == [("all", "warmup"), ("agentic", "b8")]


def test_cell_keys_follow_the_prompts_and_their_max_tokens():
    items = inputs()["sets"]["agentic"]["b1"]
    key = gp.cell_key(items, [40, 40])
    assert key == gp.cell_key([dict(it) for it in items], [40, 40])
    assert key != gp.cell_key(items, [40, 41]) and key != gp.cell_key(items[::-1], [40, 40])


def test_a_variant_sets_the_back_offs_constants_and_restores_them():
    before = backoff.MIN_STEPS
    with gp.variant({"MIN_STEPS": 2}):  # a request may back off after two verified steps, not four
        assert backoff.MIN_STEPS == 2
        bo = backoff.BackOff()
        for token in (5, 6):  # two verified drafted steps, nothing accepted: it backs off at the second
            bo.record(["r"], [3])
            bo.observe(["r"], [1], lambda i, t=token: [t])
        assert bo.rows["r"].off and bo.stats.requests_backed_off == 1
    assert backoff.MIN_STEPS == before == 4
    with pytest.raises(RuntimeError), gp.variant({"MIN_STEPS": 1}):
        raise RuntimeError
    assert before == backoff.MIN_STEPS
    assert gp.VARIANTS["off"] == {} and "on" not in gp.VARIANTS
    from specdec.vllm_plugin.patches import runner

    with gp.variant({"runner.NEAR_END_ON": False, "MIN_STEPS": 1}):  # another module's constant by its name
        assert not runner.NEAR_END_ON and backoff.MIN_STEPS == 1
    assert runner.NEAR_END_ON and before == backoff.MIN_STEPS
    from specdec.vllm_plugin.core import policy

    with gp.variant(gp.VARIANTS["unpad8"]):  # the drafting policy's constants too
        assert policy.NARROW_FROM_ROWS == 8
    assert policy.NARROW_FROM_ROWS == 16


def test_the_table_has_a_row_per_cell_and_variant_with_ratios_to_the_first():
    row = dict.fromkeys([*gp.COUNTERS, *gp.ENGINE_COUNTERS], 10.0)
    results = {"off": {"agentic/b1": row}, "on": {"agentic/b1": {**row, gp.STEPS: 12.0, "accepted": 5.0}}}
    lines = gp.table(results, ["off", "on"]).splitlines()
    assert len(lines) == 4 and lines[3].split()[1] == "on"
    assert lines[3].split()[-3:] == ["1.200", "0.500", "-"]  # no step model: no modeled speed


def test_steps_by_set_pool_the_measured_cells_geometrically_without_warm_up():
    def row(steps: float) -> dict:
        return {**dict.fromkeys([*gp.COUNTERS, *gp.ENGINE_COUNTERS], 1.0), gp.STEPS: steps}

    off = {"all/warmup": row(10), "agentic/b1": row(100), "agentic/b8": row(50), "code/b1": row(40)}
    on = {"all/warmup": row(99), "agentic/b1": row(200), "agentic/b8": row(25), "code/b1": row(30)}
    by_set = gp.set_steps({"off": off, "on": on}, ["off", "on"])
    assert by_set["off"] == {"agentic": 1.0, "code": 1.0}
    assert by_set["on"] == {"agentic": pytest.approx(1.0), "code": pytest.approx(0.75)}  # sqrt(2 * 0.5); 30 / 40
    lines = gp.set_table(by_set).splitlines()
    assert lines[0].split()[-2:] == ["agentic", "code"] and lines[3].split() == ["on", "1.000", "0.750"]


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not importable (scripts/test.sh has it)")
def test_one_engine_replays_the_cells_against_the_targets_outputs():
    from specdec.drafters.suffix import native_available
    from specdec.paths import TARGET_MODEL, model_path

    if not native_available() or not model_path(TARGET_MODEL).is_dir():
        pytest.skip("native suffix core or shared target model missing")
    steps = gp.plan(inputs(), ["agentic", "code"], ["b1", "b8"])
    rng = random.Random(1)
    seg = [rng.randrange(500, 900) for _ in range(12)]
    # repetitive outputs (drafts accepted), each ending at EOS before its max_tokens or cut at it
    outs = [[(seg * 8)[: it["max_tokens"] - 3] + [gp.EOS] for it in items] for _, _, items in steps]
    for settings, model in ((gp.VARIANTS["off"], None), ({"MIN_STEPS": 2}, H200_8B)):
        with gp.variant(settings):
            res = gp.replay(steps, outs, step_model=model)  # asserts every output is the target's
        assert list(res) == ["all/warmup", "agentic/b1", "agentic/b8", "code/b1"]
        b8 = res["agentic/b8"]
        assert b8["accepted"] > 0 and 0 < b8["drafted_steps"] <= b8["steps"] == b8[gp.STEPS] and b8["zeroed"] == 0
        assert all(c["steps"] > 0 for c in res.values())
        # with a step model every cell has modeled walls (repetitive outputs: speculation is modeled faster)
        assert all((gp.modeled_x(c) is not None) == (model is not None) for c in res.values())
    assert gp.modeled_x(res["agentic/b8"]) > 1.0


def test_a_variants_plugin_options_are_not_back_off_constants():
    settings = gp.VARIANTS["calib0.06"]
    assert settings[gp.OPTIONS] == {"drafter_options": {"suffix": {"min_confidence": 0.06}}}
    with gp.variant(settings):  # no back-off constant named "options" is set
        assert not hasattr(backoff, gp.OPTIONS)


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not importable (scripts/test.sh has it)")
def test_the_engine_builds_the_plugin_with_a_variants_options():
    from benchmarks.vllm_cpu_engine import Engine
    from specdec.drafters.suffix import native_available
    from specdec.paths import TARGET_MODEL, model_path
    from specdec.vllm_plugin.entry.options import VLLM_SUFFIX_MIN_CONFIDENCE

    if not native_available() or not model_path(TARGET_MODEL).is_dir():
        pytest.skip("native suffix core or shared target model missing")
    for options, want in ((None, VLLM_SUFFIX_MIN_CONFIDENCE), (gp.VARIANTS["calib0.06"][gp.OPTIONS], 0.06)):
        engine = Engine(str(model_path(TARGET_MODEL)), schedule=True, options=options)
        try:
            assert engine.proposer.core.guard.drafter.config.min_confidence == want
        finally:
            engine.close()
