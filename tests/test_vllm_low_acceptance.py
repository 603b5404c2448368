"""The low-acceptance policy in one long-lived engine, through vLLM 0.26's real schedulers on the CPU.

The plugin's proposer (``SpecdecProposer``, its defaults) drafts for a fake model runner that verifies drafts against
each request's fixed target sequence, drafts verified a step late as on the GPU (``benchmarks.vllm_cpu_engine``:
thread mode on vLLM's synchronous ``Scheduler``, schedule mode on its ``AsyncScheduler`` with the slot book).

One engine serves, in order: a batch whose drafts are not accepted (with requests whose text turns repetitive midway)
and requests whose drafts would be accepted arriving one at a time into it; an idle gap; a batch of such requests;
a batch of one. Each request whose drafts would be accepted must have a draft verified with an accepted token within
``PROBE_FIRST_AFTER`` steps of the first step whose drafts could be (the drafts are drafted from a context that holds
the repetition); every output is the target's.
"""

from __future__ import annotations

import importlib.util
import random

import pytest

from benchmarks.vllm_cpu_engine import Engine as CpuEngine
from benchmarks.vllm_cpu_engine import K, Req
from specdec.drafters.suffix import native_available
from specdec.vllm_plugin.core.backoff import PROBE_FIRST_AFTER

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not importable (scripts/test.sh has it)"),
    pytest.mark.skipif(not native_available(), reason="native suffix core not built"),
]

LOW_VOCAB = (20, 32)  # low-acceptance text: random tokens over a few ids (the drafter always finds a wrong match)
HIGH_VOCAB = (100, 4000)  # each repeated segment: random tokens over many ids (unique in the engine)
SEGMENT = 32  # tokens of a repeated segment
TURN_AFTER = 40  # a turning request's random tokens before its text starts repeating its prompt's segment


def random_tokens(rng: random.Random, n: int, vocab: tuple[int, int]) -> list[int]:
    return [rng.randrange(*vocab) for _ in range(n)]


def low_request(rng: random.Random, max_tokens: int) -> Req:
    t = random_tokens(rng, 48 + max_tokens + 2 * K + 8, LOW_VOCAB)
    return Req(t, 48, max_tokens, None)


def high_request(rng: random.Random, max_tokens: int) -> Req:
    """Its prompt holds a segment and the segment's start again; it goes on repeating the segment."""
    seg = random_tokens(rng, SEGMENT, HIGH_VOCAB)
    t = (seg * (3 + (max_tokens + 2 * K) // SEGMENT))[: 6 + SEGMENT + max_tokens + 2 * K + 8]
    return Req(t, SEGMENT + 6, max_tokens, SEGMENT + 6)


def turning_request(rng: random.Random, max_tokens: int) -> Req:
    """Random text, then (after TURN_AFTER tokens) a copy of its prompt's segment, over and over."""
    seg = random_tokens(rng, SEGMENT, HIGH_VOCAB)
    prompt = random_tokens(rng, 24, LOW_VOCAB) + seg + random_tokens(rng, 16, LOW_VOCAB)
    t = prompt + random_tokens(rng, TURN_AFTER, LOW_VOCAB) + seg * (3 + max_tokens // SEGMENT)
    # the first copied token is unique to the segment: drafts from a context holding two of them are right
    return Req(t[: len(prompt) + max_tokens + 2 * K + 8], len(prompt), max_tokens, len(prompt) + TURN_AFTER + 2)


class Engine(CpuEngine):
    """``benchmarks.vllm_cpu_engine``'s engine on the shared target's config (skipped where it is not here)."""

    def __init__(self, *, schedule: bool, **kw) -> None:
        from specdec.paths import TARGET_MODEL, model_path

        if not model_path(TARGET_MODEL).is_dir():
            pytest.skip("the shared target model is not here (SPECDEC_SHARED)")
        super().__init__(str(model_path(TARGET_MODEL)), schedule=schedule, **kw)


def late_steps(req: Req) -> int | None:
    """Decoding steps from the first one whose drafts would be accepted to the first with an accepted draft token
    (None: the request never got to such a step)."""
    start = next((i for i, (_, before, _) in enumerate(req.steps) if before >= req.accept_from), None)
    if start is None:
        return None
    hit = next((i for i in range(start, len(req.steps)) if req.steps[i][2] > 0), len(req.steps))
    return hit - start


def serve_scenario(engine: Engine, seed: int = 0) -> dict[str, Req]:
    """A low-acceptance batch with turning requests, high-acceptance requests arriving one at a time into it, an idle
    gap, a batch of high-acceptance requests, a batch of one. Returns the requests whose drafts would be accepted."""
    rng = random.Random(seed)
    for i in range(8):
        engine.add(f"low{i}", low_request(rng, 120 if i < 4 else 260))
    for i in range(2):
        engine.add(f"turn{i}", turning_request(rng, 110))
    for _ in range(60):  # the batch backs off
        engine.step()
    for i in range(4):  # one at a time, into the low batch
        engine.add(f"one{i}", high_request(rng, 60))
        for _ in range(12):
            engine.step()
    engine.run()
    for _ in range(5):  # an idle gap: nothing to schedule
        engine.step()
    for i in range(8):
        engine.add(f"batch{i}", high_request(rng, 60))
    engine.run()
    engine.add("single", high_request(rng, 60))
    engine.run()
    return {rid: r for rid, r in engine.reqs.items() if r.accept_from is not None}


@pytest.mark.parametrize("schedule", [False, True], ids=["thread", "schedule"])
def test_requests_whose_drafts_would_be_accepted_draft_within_the_bound_in_a_long_lived_engine(schedule):
    """As the module docstring says."""
    engine = Engine(schedule=schedule)
    try:
        high = serve_scenario(engine)
    finally:
        engine.close()
    for rid, r in engine.reqs.items():  # lossless: every output is the target's
        assert r.ctx == r.target[: len(r.ctx)] and len(r.ctx) >= r.prompt + r.max_tokens, rid
    late = {rid: late_steps(r) for rid, r in high.items()}
    assert all(n is not None for n in late.values()), late
    assert max(late.values()) <= PROBE_FIRST_AFTER, late
    # and once back, they keep drafting: most of their later steps verify accepted tokens
    for rid, r in high.items():
        start = next(i for i, (_, before, _) in enumerate(r.steps) if before >= r.accept_from)
        after = [acc for _, _, acc in r.steps[start + PROBE_FIRST_AFTER :]]
        assert sum(a > 0 for a in after) >= 0.8 * len(after), (rid, after)
    lows = [acc for rid, r in engine.reqs.items() if rid.startswith("low") for _, _, acc in r.steps[-40:]]
    assert sum(lows) <= 0.25 * len(lows)  # the low requests stayed low (the scenario is what it says)


@pytest.mark.parametrize("schedule", [False, True], ids=["thread", "schedule"])
@pytest.mark.parametrize("near_end", [False, True], ids=["vllm-guard", "near-end-row"])
def test_a_prompt_near_max_model_len_has_its_copy_drafted_and_accepted(schedule, near_end, monkeypatch):
    """serve_features' long prompt on the CPU: a prompt of max_model_len - 8 tokens repeating a 116-token unit, whose
    target goes on with the copy. vLLM's guard runs no drafter while a sequence is within k tokens of max_model_len
    and verifies zeros: every decoding step of it, none accepted (the GPU's 0 of 42). With the plugin's row for the
    guard (``NEAR_END_ON``) the first decoding step verifies a draft cut to the room left (6 tokens past the prompt's
    first sampled token) and accepts all of it."""
    from specdec.vllm_plugin.patches import runner

    monkeypatch.setattr(runner, "NEAR_END_ON", near_end)
    rng = random.Random(1)
    unit = random_tokens(rng, 116, HIGH_VOCAB)
    engine = Engine(schedule=schedule)
    plen = engine.max_len - 8
    target = (unit * (engine.max_len // len(unit) + 2))[: engine.max_len + 2 * K]
    try:
        engine.add("long", Req(target, plen, 7, plen))
        engine.run()
    finally:
        engine.close()
    r = engine.reqs["long"]
    assert r.ctx == target[: len(r.ctx)] and len(r.ctx) >= plen + 7  # the target's tokens (the fake runner's)
    if near_end:
        assert r.steps == [(0, plen + 1, 6)] and engine.zeroed_steps == 0
    else:
        assert [acc for _, _, acc in r.steps] == [0] * 6 and engine.zeroed_steps >= 6


@pytest.mark.parametrize("schedule", [False, True], ids=["thread", "schedule"])
def test_a_request_reaching_max_model_len_leaves_the_batch_its_drafts(schedule, monkeypatch):
    """Four requests whose drafts are accepted share the engine with one of random text that runs up to max_model_len
    (as a request without max_tokens does). Under vLLM's guard the steps while that one is within k tokens of the end
    (one token a step) verify zeros for every row: the four accept nothing there. With the plugin's row they go on
    accepting."""
    from specdec.vllm_plugin.patches import runner

    idle, zeroed = {}, {}
    for near_end in (False, True):
        monkeypatch.setattr(runner, "NEAR_END_ON", near_end)
        rng = random.Random(2)
        engine = Engine(schedule=schedule)
        long_prompt = engine.max_len - 3 * K
        others = [high_request(rng, 900) for _ in range(4)]  # still running when the long one ends
        try:
            for i, req in enumerate(others):
                engine.add(f"high{i}", req)
            for _ in range(4):
                engine.step()
            long_req = Req(random_tokens(rng, engine.max_len + 2 * K, LOW_VOCAB), long_prompt, 3 * K - 1, None)
            engine.add("long", long_req)
            engine.run()
        finally:
            engine.close()
        for r in engine.reqs.values():
            assert r.ctx == r.target[: len(r.ctx)]
        # decoding steps of the four, once their drafts are accepted, that accepted nothing
        idle[near_end] = sum(
            sum(acc == 0 for _, before, acc in engine.reqs[f"high{i}"].steps if before >= others[i].accept_from + K)
            for i in range(4)
        )
        zeroed[near_end] = engine.zeroed_steps
    assert zeroed[False] >= K // 2 and zeroed[True] == 0
    # vLLM's guard: each of the four verifies zeros on those steps (schedule mode's other idle step: the long one's
    # prefill, which gives decoding rows no slot, in both runs)
    assert idle[False] - idle[True] >= 4 * (K // 2) and idle[True] <= 4


def low_arrivals(engine: Engine, rng: random.Random) -> dict[str, int]:
    """24 low-acceptance requests, then one more every 4 steps (up to 140): a batch of 24-64 running requests
    whose drafts are seldom accepted, as random prompts at temperature 1 are under load. The proposer's counters."""
    n = 0
    for n in range(24):
        engine.add(f"a{n}", low_request(rng, 128))
    for step in range(600):
        if step % 4 == 0 and n < 139:
            n += 1
            engine.add(f"a{n}", low_request(rng, 128))
        if not engine.step():
            break
    engine.run()
    return engine.proposer.core.stats_dict()


@pytest.mark.parametrize("schedule", [False, True], ids=["thread", "schedule"])
def test_the_step_gate_takes_a_large_low_batch_off_mixed_steps(schedule, monkeypatch):
    """Without the gate, requests backed off keep coming back on chance shadow matches, and their steps verify some
    draft (a mixed batch every row pays for); with it (``STEP_GATE_ON``), under a fifth as many do, and every output
    is still the target's."""
    from specdec.vllm_plugin.core import backoff

    stats = {}
    monkeypatch.setattr(backoff, "RECOVER_LOW_BATCH", backoff.RECOVER_ACCEPTED)  # recovery on two matched tokens:
    monkeypatch.setattr(backoff, "STRICT_EXIT_STEPS", 0)  # chance recoveries, what the gate alone must take off
    for gate in (False, True):
        monkeypatch.setattr(backoff, "STEP_GATE_ON", gate)
        engine = Engine(schedule=schedule, max_seqs=64)
        try:
            stats[gate] = low_arrivals(engine, random.Random(0))
        finally:
            engine.close()
        assert all(r.ctx == r.target[: len(r.ctx)] for r in engine.reqs.values())
    off, on = stats[False], stats[True]
    assert off["drafted_steps"] >= 20 and off["backoff_gated_steps"] == 0
    assert on["drafted_steps"] <= 0.2 * off["drafted_steps"] and on["backoff_gated_steps"] > 0.5 * on["steps"]
