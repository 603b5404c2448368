"""The CPU proxy of the gate's sampled cell (``benchmarks.sampled_proxy``): samples cut at EOS, the paired difference
between variants, and (vLLM) one engine through several sample sets against the given outputs."""

from __future__ import annotations

import importlib.util
import random

import pytest

from benchmarks import sampled_proxy as sp


def test_a_sample_ends_with_its_first_eos_and_keeps_it():
    assert sp._until_eos([5, 6, sp.EOS, sp.EOS, sp.EOS]) == [5, 6, sp.EOS]  # generate pads finished rows with EOS
    assert sp._until_eos([5, 6, 7]) == [5, 6, 7]  # ran to max_tokens


def test_the_difference_to_the_reference_is_paired_by_sample_set():
    runs = {
        "base": [{"accepted": 10.0}, {"accepted": 20.0}, {"accepted": 30.0}],
        "off": [{"accepted": 9.0}, {"accepted": 17.0}, {"accepted": 31.0}],
    }
    got = sp.paired(runs, "base", "accepted")
    assert got["base"] == {"total": 60.0, "mean_diff": 0.0, "se": 0.0, "lower": 0, "higher": 0}
    off = got["off"]  # differences -1, -3, +1: mean -1, SD 2, SE 2 / sqrt(3)
    assert off["total"] == 57.0 and off["mean_diff"] == pytest.approx(-1.0)
    assert off["se"] == pytest.approx(2.0 / 3**0.5) and (off["lower"], off["higher"]) == (2, 1)
    line = sp.table({v: [{c: r.get("accepted", 0.0) for c in sp.COLS} for r in rs] for v, rs in runs.items()}, "base")
    assert "-1.0 ± 1.2 a set (2 lower, 1 higher)" in line.splitlines()[3]


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not importable (scripts/test.sh has it)")
def test_one_engine_runs_every_sample_set_as_a_closed_batch_and_emits_its_outputs():
    from specdec.drafters.suffix import native_available
    from specdec.paths import TARGET_MODEL, model_path

    if not native_available() or not model_path(TARGET_MODEL).is_dir():
        pytest.skip("native suffix core or shared target model missing")
    rng = random.Random(0)
    items = [{"ids": [rng.randrange(500, 900) for _ in range(16)], "max_tokens": 24} for _ in range(4)]
    seg = [rng.randrange(500, 900) for _ in range(6)]
    # two sets: the first repeats a segment (drafts accepted), the second ends at EOS before max_tokens
    sets = [[(seg * 4)[:24] for _ in items], [[rng.randrange(2, 900) for _ in range(20)] + [sp.EOS] for _ in items]]
    res = sp.replay(items, sets, None)  # asserts every output is the set's, EOS included
    assert len(res) == 2 and res[0]["accepted"] > 0
    assert all(r["engine_steps"] > 0 and r["drafted"] >= r["accepted"] for r in res)
