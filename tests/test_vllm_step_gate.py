"""The back-off's per-step gate (``core/backoff.py``, ``BATCH_GATE``; a candidate, off by default): a step that does
not pad hands vLLM drafts only where the drafting rows' expected accepted tokens cover ``DRAFT_STEP_PENALTY`` x the
batch's rows. By hand on ``BackOff``, then through vLLM 0.26's real schedulers (``test_vllm_low_acceptance``'s
engine): the bound a request whose drafts would be accepted is held to, and the engine steps that verify drafts
under low-acceptance arrivals, with the gate and without."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from specdec.vllm_plugin.core import backoff
from specdec.vllm_plugin.core.backoff import DRAFT_STEP_PENALTY, NEW_ROW_PRIOR, PROBE_FIRST_AFTER, BackOff, RowBackOff
from test_vllm_low_acceptance import Engine, K, Req, late_steps, serve_scenario
from test_vllm_low_acceptance import pytestmark as engine_marks

pytestmark = engine_marks  # vLLM importable, the native suffix core built

ROWS = 11  # a low-acceptance server's batch: the penalty is 2.2 expected tokens at 0.2


def gated(rows: dict[str, RowBackOff], drafts: dict[str, list[int]]) -> tuple[list[tuple[int, int]], BackOff]:
    """``withhold`` over ``ROWS`` rows (the given states, the rest backed off) with the gate on."""
    bo = BackOff(gate=True)
    ids = [*rows, *(f"off{i}" for i in range(ROWS - len(rows)))]
    bo.rows = {**rows, **{r: RowBackOff(ema=0.0, seen=4, off=True, known=True) for r in ids[len(rows) :]}}
    lists = [list(drafts.get(r, [])) for r in ids]
    return bo.withhold(ids, lists), bo


def test_the_gate_is_off_by_default():
    assert backoff.BATCH_GATE is False and BackOff().gate is False
    assert pytest.approx(2.2) == DRAFT_STEP_PENALTY * ROWS


def test_one_recovered_row_does_not_make_a_low_batch_a_drafted_step():
    cut, bo = gated({"r": RowBackOff(ema=0.5, known=True)}, {"r": [7, 8, 9]})
    assert cut == [(0, 3)] and bo.stats.gated_steps == 1  # 0.5 < 2.2: withheld
    assert bo.rows["r"].shadow == [7, 8, 9] and not bo.rows["r"].off  # checked in shadow, not backed off
    off = BackOff(gate=False)
    off.rows = {"r": RowBackOff(ema=0.5, known=True)}
    lists = [[7, 8, 9]]
    assert off.withhold(["r"], lists) == [] and lists == [[7, 8, 9]]  # without the gate it drafts


@pytest.mark.parametrize(
    ("emas", "handed"),
    [
        ((0.8, 0.8, 0.8), True),  # 2.4 >= 2.2
        ((0.7, 0.7, 0.7), False),  # 2.1
        ((2.2,), True),  # one row worth it alone
    ],
)
def test_the_drafting_rows_gains_add_up_against_the_batchs_penalty(emas, handed):
    rows = {f"r{i}": RowBackOff(ema=e, known=True) for i, e in enumerate(emas)}
    cut, bo = gated(rows, {r: [1, 2] for r in rows})
    assert (cut == []) is handed
    assert bo.stats.gated_steps == (0 if handed else 1)


def test_a_withheld_draft_still_matching_counts_as_far_as_it_matched():
    st = RowBackOff(ema=0.5, known=True, shadow=[4, 5, 6, 7], matched=3)
    cut, _ = gated({"r": st}, {"r": [6, 7, 8]})
    assert cut == []  # 3 matched so far >= 2.2
    st = RowBackOff(ema=0.5, known=True, shadow=[4, 5, 6, 7], matched=2)
    cut, _ = gated({"r": st}, {"r": [6, 7, 8]})
    assert cut == [(0, 3)]


def test_the_shadow_that_brings_a_request_back_stays_the_gates_evidence():
    """Backed off, its withheld draft matches two tokens (EMA 0.5: back); it goes on being checked, a third match
    makes its draft pay for the batch, and when it settles it is no second outcome."""
    bo = BackOff(gate=True)
    ids = ["r", *(f"off{i}" for i in range(ROWS - 1))]
    bo.rows = {r: RowBackOff(ema=0.0, seen=4, off=True, known=True) for r in ids}
    bo.rows["r"].shadow = [5, 6, 7, 8]
    quiet = lambda i: [0]  # noqa: E731 - the other rows' tokens match nothing
    for token in (5, 6):
        bo.observe(ids, [1] * ROWS, lambda i, t=token: [t] if i == 0 else quiet(i))
    st = bo.rows["r"]
    assert not st.off and st.ema == pytest.approx(0.5)
    assert (st.shadow, st.matched, st.evidence_only) == ([5, 6, 7, 8], 2, True)
    lists = [[7, 8, 9]] + [[1] for _ in ids[1:]]
    assert bo.withhold(ids, lists)[0] == (0, 3)  # 2 matched < 2.2: gated
    bo.observe(ids, [1] * ROWS, lambda i: [7] if i == 0 else quiet(i))
    lists = [[8, 9]] + [[1] for _ in ids[1:]]
    assert [i for i, _ in bo.withhold(ids, lists)] == list(range(1, ROWS)) and lists[0] == [8, 9]  # 3 >= 2.2
    bo.observe(ids, [1] * ROWS, lambda i: [4] if i == 0 else quiet(i))  # it settles: no second outcome
    assert st.ema == pytest.approx(0.5) and not st.shadow and not st.evidence_only and bo.stats.recoveries == 1


def test_rows_without_an_outcome_count_the_prior():
    bo = BackOff(gate=True)
    ids = [f"new{i}" for i in range(8)]  # a fresh batch: 8 x NEW_ROW_PRIOR >= 0.2 x 8
    lists = [[1, 2, 3] for _ in ids]
    assert bo.withhold(ids, lists) == [] and all(lists)
    assert NEW_ROW_PRIOR >= DRAFT_STEP_PENALTY


@pytest.mark.parametrize("schedule", [False, True], ids=["thread", "schedule"])
def test_requests_whose_drafts_would_be_accepted_draft_soon_with_the_gate(schedule, monkeypatch):
    """The long-lived engine of ``test_vllm_low_acceptance`` with the gate on: lossless, and a request whose drafts
    would be accepted drafts within ``PROBE_FIRST_AFTER`` steps in thread mode and one more in schedule mode (its
    evidence must cover a dozen rows' penalty, then the slot book grants a round late). Measured: 3 and 5 steps at
    most (4 and 6 when a recovery restarted the evidence from a new shadow)."""
    monkeypatch.setattr(backoff, "BATCH_GATE", True)
    engine = Engine(schedule=schedule)
    try:
        high = serve_scenario(engine)
    finally:
        engine.close()
    for rid, r in engine.reqs.items():
        assert r.ctx == r.target[: len(r.ctx)] and len(r.ctx) >= r.prompt + r.max_tokens, rid
    late = {rid: late_steps(r) for rid, r in high.items()}
    assert max(late.values()) <= PROBE_FIRST_AFTER + (1 if schedule else 0), late


def markov_target(rng: random.Random, predictable: float, n: int) -> list[int]:
    """A random prompt, then text whose next token is its last one's fixed successor with probability
    ``predictable`` (else random): the suffix drafter's drafts are accepted about that often per token."""
    successor = random.Random(7)
    nxt: dict[int, int] = {}
    out = [rng.randrange(20, 4000) for _ in range(64)]
    while len(out) < n:
        t = out[-1]
        nxt.setdefault(t, successor.randrange(20, 300))
        out.append(nxt[t] if rng.random() < predictable else rng.randrange(20, 300))
    return out


def arrivals(predictable: float, monkeypatch: pytest.MonkeyPatch, *, gate: bool) -> tuple[int, int]:
    """40 requests of 128 tokens arriving every 10 steps through schedule mode: (engine steps that verified a draft,
    accepted draft tokens)."""
    monkeypatch.setattr(backoff, "BATCH_GATE", gate)
    steps: Counter[int] = Counter()
    now = [0]
    verify = Engine._verify

    def counting(self: Engine, rid: str, draft: list[int]) -> list[int]:
        r = self.reqs[rid]
        if len(r.ctx) > r.prompt and draft:
            steps[now[0]] += 1
        return verify(self, rid, draft)

    monkeypatch.setattr(Engine, "_verify", counting)
    rng, engine = random.Random(0), Engine(schedule=True)
    try:
        for i in range(40):
            engine.add(f"r{i}", Req(markov_target(rng, predictable, 64 + 128 + 2 * K + 8), 64, 128, None))
            for _ in range(10):
                now[0] += 1
                engine.step()
        engine.run()
        accepted = engine.proposer.stats()["accepted_tokens"]
    finally:
        engine.close()
        monkeypatch.undo()
    return len(steps), accepted


def test_low_acceptance_arrivals_verify_drafts_on_few_steps_with_the_gate(monkeypatch):
    """Held newcomers that recover on a lucky two-token shadow turn most steps into drafted ones without the gate
    (measured: 687 of 1,112 steps at 100 requests); with it, a few."""
    without, _ = arrivals(0.5, monkeypatch, gate=False)
    with_gate, _ = arrivals(0.5, monkeypatch, gate=True)
    print(f"engine steps verifying drafts: {without} without the gate, {with_gate} with it")
    assert with_gate <= 0.25 * without, (with_gate, without)


def test_high_acceptance_arrivals_draft_as_without_the_gate(monkeypatch):
    without, acc_without = arrivals(0.97, monkeypatch, gate=False)
    with_gate, acc_gate = arrivals(0.97, monkeypatch, gate=True)
    print(f"drafted steps {without} / {with_gate}, accepted {acc_without} / {acc_gate} (without / with the gate)")
    assert with_gate >= 0.9 * without and acc_gate >= 0.9 * acc_without, (with_gate, without, acc_gate, acc_without)
