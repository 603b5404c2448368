"""Back-off on low acceptance (``core/backoff.py``): forced acceptance sequences drive ``ProposerCore`` on every
path (Python engine, native lane, schedule mode's token-matrix step, thread mode's submit / collect) and the slot
book of schedule mode."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from specdec.drafters.suffix import SuffixDrafter, native_available
from specdec.vllm_plugin.core import backoff as backoff_module
from specdec.vllm_plugin.core.backoff import (
    EMA_ALPHA,
    MIN_STEPS,
    PAD_MIN_ACCEPTED,
    PROBE_FIRST_AFTER,
    RECOVER_ACCEPTED,
    STEP_GATE_FROM_ROWS,
    STEP_GATE_SHARE,
    STRICT_BELOW,
    BackOff,
    RowBackOff,
)
from specdec.vllm_plugin.core.batch import StepBatch
from specdec.vllm_plugin.core.policy import NARROW_FROM_ROWS, NARROW_WIDTH
from specdec.vllm_plugin.core.proposer_core import ProposerCore
from specdec.vllm_plugin.entry.options import SpecdecOptions
from specdec.vllm_plugin.internal import InternalSettings
from specdec.vllm_plugin.modes.schedule import ScheduledDrafting
from specdec.vllm_plugin.modes.slots import SlotBook
from specdec.vllm_plugin.modes.thread import ThreadedProposerCore

pytestmark = pytest.mark.skipif(not native_available(), reason="native suffix core not built")

K = 8
ROWS = 4
MAX_LEN = 4096
SMALL_VOCAB = 12  # random contexts over few tokens: the suffix drafter always finds something to draft
STEP_S = 1e-3
TINY_TARGET = 53e6  # pad_drafts="auto" pads every step for a target this small (until the back-off)
Accept = Callable[[str, int, list[int]], int]  # (request id, step, its draft) -> draft tokens the verifier accepts


def make_core(path: str, clock: Callable[[], float], **opts) -> ProposerCore:
    """A core on ``path``: "python" (Python engine), "lane" / "matrix" (native lane, ``step`` / ``step_tokens``),
    "thread" (``ThreadedProposerCore``). ``clock``: a batch's, whose steps all take ``STEP_S`` whatever they verify
    (the step-cost fit finds no cost per token, so the confidence cut never shortens a draft)."""
    options = {"num_speculative_tokens": K, "draft_timeout_ms": 0.0, "native_step": path != "python", **opts}
    user, internal = InternalSettings.split(options)
    cls = ThreadedProposerCore if path == "thread" else ProposerCore
    return cls(
        SuffixDrafter(backend="native"),
        SpecdecOptions.from_dict(user),
        max_model_len=MAX_LEN,
        internal=internal,
        target_params=TINY_TARGET,
        clock=clock,
    )


class Batch:
    """``ROWS`` requests over random contexts; each step the verifier accepts what ``accept`` says of each row's
    last draft, then a bonus token that is not the draft's next one (so exactly that many are accepted). A row whose
    draft was withheld (the back-off keeps it in shadow) emits one token: the shadow's next one if ``accept`` takes
    at least one of it (the target goes on as the drafter said), else another."""

    def __init__(self, seed: int = 0, rows: int = ROWS) -> None:
        self.rng = random.Random(seed)
        self.ctx: dict[str, list[int]] = {}
        self.prompt: dict[str, int] = {}
        for i in range(rows):
            self.add(f"r{i}")
        self.drafts: dict[str, list[int]] = {}
        self.t = 0.0
        self.clock = lambda: self.t

    def add(self, rid: str) -> None:
        self.ctx[rid] = [self.rng.randrange(SMALL_VOCAB) for _ in range(40)]
        self.prompt[rid] = 40

    def verify(self, step: int, accept: Accept, core: ProposerCore) -> tuple[list[str], list[list[int]]]:
        order = list(self.ctx)
        self.rng.shuffle(order)  # rows move between steps
        sampled = []
        for rid in order:
            d, one = self.drafts.get(rid, []), False
            st = core.backoff.rows.get(rid)
            if not d and st is not None and st.shadow:  # withheld: a plain step checks its shadow by one token
                d, one = st.shadow[st.matched :], True
            a = max(0, min(len(d), accept(rid, step, d)))
            if one and a:
                self.ctx[rid].append(d[0])
                sampled.append([d[0]])
                continue
            bonus = self.rng.randrange(SMALL_VOCAB)
            while a < len(d) and bonus == d[a]:
                bonus = self.rng.randrange(SMALL_VOCAB)
            out = d[:a] + [bonus]
            self.ctx[rid] += out
            sampled.append(out)
        return order, sampled

    def arrays(self, order: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        tokens = np.zeros((len(order), MAX_LEN), np.int32)  # [rows, max_model_len] like token_ids_cpu
        lengths, prompts = np.zeros(len(order), np.int32), np.zeros(len(order), np.int32)
        for row, rid in enumerate(order):
            c = self.ctx[rid]
            tokens[row, : len(c)] = c
            lengths[row], prompts[row] = len(c), self.prompt[rid]
        return tokens, lengths, prompts

    def step(self, core: ProposerCore, path: str, step: int, accept: Accept) -> dict[str, list[int]]:
        """One step on ``path``; returns each request's draft as handed to vLLM."""
        self.t += STEP_S
        order, sampled = self.verify(step, accept, core)
        tokens, lengths, prompts = self.arrays(order)
        if path == "matrix":
            drafts = matrix_step(core, order, sampled, tokens, lengths, prompts)
        elif path == "thread":
            assert isinstance(core, ThreadedProposerCore)
            core.submit(StepBatch(order, sampled, lengths, tokens, prompts))
            drafts = core.collect()
        else:
            drafts = core.step(StepBatch(order, sampled, lengths, tokens, prompts))
        self.drafts = dict(zip(order, drafts))
        return self.drafts


def matrix_step(core, order, sampled, tokens, lengths, prompts) -> list[list[int]]:
    """``step_tokens`` as schedule mode calls it; every row past its draft holds its last token."""
    n = len(order)
    new = [len(s) for s in sampled]
    matrix = np.full((n, max(new) + 2), -1, np.int32)  # [rows, w]
    for i, s in enumerate(sampled):
        matrix[i, : len(s)] = s
    known = [int(lengths[i]) - new[i] for i in range(n)]
    fillers = [int(tokens[i, known[i] - 1]) for i in range(n)]
    out = np.full((n, K), -7, np.int32)  # [rows, k]
    lens = core.step_tokens(
        order, matrix, new, known, fillers, out, context=lambda i: (tokens[i, : int(lengths[i])].tolist(), prompts[i])
    )
    assert lens is not None
    for i in range(n):
        assert (out[i, lens[i] :] == sampled[i][-1]).all()
    return [out[i, : lens[i]].tolist() for i in range(n)]


def never(rid: str, step: int, draft: list[int]) -> int:
    return 0


PATHS = ["python", "lane", "matrix", "thread"]


def handed(batch: Batch, core: ProposerCore, path: str, steps: range, accept: Accept) -> list[dict[str, int]]:
    """Each step's draft lengths as handed to vLLM, by request."""
    return [{rid: len(d) for rid, d in batch.step(core, path, s, accept).items()} for s in steps]


@pytest.mark.parametrize("path", PATHS)
def test_zero_acceptance_withholds_every_draft_and_stops_padding(path):
    batch = Batch()
    core = make_core(path, batch.clock)
    steps = 200
    lengths = handed(batch, core, path, range(steps), never)
    # a new batch pads every row to k until its requests have MIN_STEPS verified steps; then every draft is withheld
    assert all(n == K for step in lengths[:MIN_STEPS] for n in step.values())
    assert all(n == 0 for step in lengths[MIN_STEPS:] for n in step.values())
    st = core.stats_dict()
    assert st["backoff_requests_backed_off"] == st["backoff_requests_off"] == ROWS and st["backoff_recoveries"] == 0
    assert st["backoff_batch_low"] and st["backoff_batch_accepted_per_row"] == 0.0
    assert st["backoff_unpadded_steps"] == steps - MIN_STEPS
    assert st["backoff_shadow_checks"] == ROWS * (steps - MIN_STEPS - 1)  # each withheld draft checked, one a step
    assert st["backoff_withheld_rows"] > 0 and st["backoff_withheld_tokens"] > 0
    assert st["drafted_tokens"] == sum(sum(s.values()) for s in lengths)  # what vLLM got, not what was drafted
    assert st["drafted_steps"] == sum(1 for s in lengths if any(s.values())) == MIN_STEPS  # the rest: plain graphs
    assert st["accepted_tokens"] == 0
    core.close()


@pytest.mark.parametrize("path", PATHS)
def test_requests_whose_drafts_would_be_accepted_again_draft_within_the_bound(path):
    turn = 80  # from this step on the target agrees with every draft, handed or withheld

    def later(rid: str, step: int, draft: list[int]) -> int:
        return len(draft) if step >= turn else 0

    batch = Batch(seed=1)
    core = make_core(path, batch.clock)
    lengths = handed(batch, core, path, range(turn), later)
    st = core.stats_dict()
    assert st["backoff_requests_off"] == ROWS and st["backoff_batch_low"]
    lengths += handed(batch, core, path, range(turn, turn + 40), later)
    for rid in batch.ctx:
        back = next(s for s in range(turn, turn + 40) if lengths[s][rid])
        assert back - turn < PROBE_FIRST_AFTER, (rid, back)
    assert all(n == K for s in lengths[turn + 2 * PROBE_FIRST_AFTER :] for n in s.values())  # full, padded again
    st = core.stats_dict()
    assert st["backoff_recoveries"] == ROWS and st["backoff_requests_off"] == 0 and not st["backoff_batch_low"]
    assert st["accepted_tokens"] >= 10 * ROWS * K
    core.close()


@pytest.mark.parametrize("path", PATHS)
def test_a_request_new_to_a_low_batch_starts_in_shadow_then_drafts_alone_unpadded(path):
    """A request joining a backed-off batch starts backed off too (no draft, no slot: the plain batch stays plain);
    its shadow drafts would be accepted, so it drafts from its third step on (its own chains, unpadded) while the
    others stay without drafts and the batch, whose rows accept too little on average to pay for padding, unpadded."""
    join = 60

    def newcomer(rid: str, step: int, draft: list[int]) -> int:
        return min(2, len(draft)) if rid == "new" else 0

    batch = Batch(seed=5, rows=6)
    core = make_core(path, batch.clock)
    lengths = handed(batch, core, path, range(join), newcomer)
    assert core.backoff.low()
    batch.add("new")
    lengths += handed(batch, core, path, range(join, join + 60), newcomer)
    assert lengths[join]["new"] == 0  # held
    back = next(s for s in range(join, join + 60) if lengths[s]["new"])
    assert back - join < PROBE_FIRST_AFTER
    new = [s["new"] for s in lengths[back:]]
    assert sum(n > 0 for n in new) > 0.9 * len(new) and max(new) <= K
    others = [n for s in lengths[join:] for r, n in s.items() if r != "new"]
    assert max(others) == 0
    st = core.stats_dict()
    assert st["backoff_newcomers_held"] == 1 and st["backoff_recoveries"] == 1 and st["backoff_batch_low"]
    assert st["backoff_requests_off"] == 6
    core.close()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("share", [1.0, 0.5])
def test_a_high_acceptance_batch_drafts_exactly_as_without_back_off(path, share):
    """Rows accept ``share`` of their drafts, but for one that accepts nothing: the batch keeps padding every row to
    k (the one that backs off too: the uniform batch is what the others need), draft for draft as a twin core whose
    back-off is off."""

    def mostly(rid: str, step: int, draft: list[int]) -> int:
        return 0 if rid == "r0" else int(share * len(draft))

    batches = [Batch(seed=2), Batch(seed=2)]
    cores = [make_core(path, b.clock) for b in batches]
    cores[1].backoff.enabled = False
    for step in range(120):
        drafts = [b.step(c, path, step, mostly) for c, b in zip(cores, batches)]
        assert drafts[0] == drafts[1], step
        if step:
            assert all(len(d) == K for d in drafts[0].values()), step
    st = cores[0].stats_dict()
    assert st["backoff_requests_backed_off"] == st["backoff_requests_off"] == 1  # r0, padded all the same
    assert st["backoff_withheld_rows"] == st["backoff_unpadded_steps"] == 0 and not st["backoff_batch_low"]
    for c in cores:
        c.close()


def test_back_off_counts_only_with_adaptive_drafting():
    batch = Batch()
    core = make_core("lane", batch.clock, adaptive=False)
    for step in range(60):
        drafts = batch.step(core, "lane", step, never)
        if step:
            assert all(len(d) == K for d in drafts.values())
    st = core.stats_dict()
    assert st["backoff_requests_backed_off"] == 0 and not st["backoff_batch_low"]


def test_withheld_drafts_leave_the_python_engines_calibration_alone():
    batch = Batch()
    core = make_core("python", batch.clock)
    handed(batch, core, "python", range(30), never)
    for rid in batch.ctx:
        st = core.requests[rid]
        assert st.last_draft == st.last_real == 0 and st.last_pred is None  # forgotten: nothing of it was verified
        assert core.backoff.rows[rid].shadow  # ... but kept in shadow


def low_batch(bo: BackOff, ids: list[str]) -> None:
    """``bo`` after MIN_STEPS verified steps of ``ids`` with nothing accepted: every request backed off."""
    for _ in range(MIN_STEPS + 1):
        bo.observe(ids, [1] * len(ids), lambda i: [0])
        bo.record(ids, [3] * len(ids))


def test_shadow_checks_by_hand(monkeypatch):
    monkeypatch.setattr(backoff_module, "RECOVER_LOW_BATCH", RECOVER_ACCEPTED)  # the usual threshold (see below)
    bo = BackOff()
    low_batch(bo, ["a", "b"])
    assert bo.requests_off == 2 and bo.low() and bo.rows["a"].ema == 0.0
    drafts = [[5, 6, 7], [8, 9]]
    assert bo.withhold(["a", "b"], drafts) == [(0, 3), (1, 2)] and drafts == [[], []]
    bo.record(["a", "b"], [0, 0])
    assert bo.rows["a"].shadow == [5, 6, 7] and bo.stats.withheld_tokens == 5
    new = {"a": [5], "b": [1]}  # a's shadow matches one token so far; b's fails at once
    bo.observe(["a", "b"], [1, 1], lambda i: new["ab"[i]])
    a, b = bo.rows["a"], bo.rows["b"]
    assert (a.shadow, a.matched, a.off) == ([5, 6, 7], 1, True)  # 0.25 x 1 < RECOVER_ACCEPTED: not settled yet
    assert (b.shadow, b.ema, b.off) == ([], 0.0, True) and bo.stats.shadow_checks == 1
    bo.observe(["a", "b"], [1, 1], lambda i: [6] if i == 0 else [2])
    assert not a.off and a.ema == pytest.approx(0.25 * 2) and a.ema >= RECOVER_ACCEPTED and a.seen == 0
    assert bo.stats.recoveries == 1 and bo.requests_off == 1
    drafts = [[6, 7], [4]]
    assert bo.withhold(["a", "b"], drafts) == [(1, 1)] and drafts == [[6, 7], []]  # a drafts again, b in shadow
    assert (bo.stats.outcomes_first, bo.stats.outcomes_recovered) == (2 * MIN_STEPS, 0)
    bo.record(["a", "b"], [2, 0])
    bo.observe(["a", "b"], [1, 1], lambda i: [9])  # a's draft verified, nothing accepted; b still in shadow
    assert (bo.stats.outcomes_first, bo.stats.outcomes_recovered) == (2 * MIN_STEPS, 1)


def test_the_batch_is_low_only_while_its_low_requests_are_there():
    """No state outlives the requests it was measured on: a batch of one after a low batch drafts at once."""
    bo = BackOff()
    low_batch(bo, ["a", "b", "c"])
    assert bo.low() and bo.as_dict()["backoff_batch_accepted_per_row"] == 0.0
    drafts = [[1, 2]]
    bo.prune({"new"})  # the low requests finished; a new one arrives alone
    assert not bo.low() and bo.withhold(["new"], drafts) == [] and drafts == [[1, 2]]
    assert bo.stats.newcomers_held == 0
    bo2 = BackOff()
    low_batch(bo2, ["a"])
    drafts = [[1, 2], [3]]
    assert bo2.withhold(["a", "new"], drafts) == [(0, 2), (1, 1)]  # new to a low batch: held, in shadow
    assert bo2.stats.newcomers_held == 1 and bo2.rows["new"].shadow == [3]
    assert PAD_MIN_ACCEPTED <= RECOVER_ACCEPTED  # a recovered request does not keep its batch low by itself


def test_a_verified_accepted_token_of_a_backed_off_request_feeds_the_same_ema():
    """A padded step verifies a backed-off request's draft: what it gets accepted counts as any outcome."""
    bo = BackOff()
    low_batch(bo, ["a"])
    bo.record(["a"], [8])  # padded: its draft went out
    bo.observe(["a"], [5], lambda i: [0] * 5)  # 4 accepted: an EMA of 1.0, over either recovery threshold
    assert not bo.rows["a"].off and bo.rows["a"].ema == pytest.approx(1.0)


def test_slot_book_of_a_low_batch_grants_each_request_its_draft_and_nothing_without_one():
    low = [False]
    book = SlotBook.policy(K, low_batch=lambda: low[0])
    book.note(["a", "b"], [3, 0], emitted=[1, 1])
    rows = NARROW_FROM_ROWS + 1  # a mid-size schedule: narrow
    book.begin_schedule(rows)
    assert book.width == NARROW_WIDTH and [book.slots(r, K) for r in "abc"] == [NARROW_WIDTH] * 3
    book.begin_schedule(2)  # small: per-request slots, k for a request without a draft length
    assert [book.slots(r, K) for r in "abc"] == [6, 0, K]  # "a": 3 + growth
    low[0] = True
    book.begin_schedule(rows)
    assert book.width == 0 and [book.slots(r, K) for r in "abc"] == [6, 0, 0]
    assert book.as_dict()["low_batch_schedules"] == 1


def drive_schedule(
    sched: ScheduledDrafting, targets: dict[str, list[int]], clock: SimpleNamespace, *, steps: int, seed: int = 0
) -> tuple[dict[str, list[int]], list[int]]:
    """vLLM's async timeline over ``targets`` (each request starts with its first 40 tokens as prompt): each step the
    scheduler grants slots (the slot book's, else k), the buffer of the step before is filled, its drafts are
    verified greedily up to the slots, the tokens captured, the next buffer submitted. Returns each request's tokens
    and the slots granted per step."""
    rng = random.Random(seed)
    seq = {rid: t[:40] for rid, t in targets.items()}
    state = {rid: SimpleNamespace(prompt_token_ids=list(s), output_token_ids=[]) for rid, s in seq.items()}
    book = sched.slot_book
    out, prev_rows, slots_per_step = None, {}, []
    for _ in range(steps):
        clock.t += STEP_S
        order = list(seq)
        rng.shuffle(order)
        if book is not None:
            book.begin_schedule(len(order))  # the scheduler: this step's slots, from the latest drafts
        slots = {rid: book.slots(rid, K) if book is not None else K for rid in order}
        slots_per_step.append(sum(slots.values()))
        if out is not None:
            assert sched.fill(out)  # the drafts this step verifies, from the tokens of the one before
        sampled = torch.full((len(order), K + 1), -1, dtype=torch.int32)  # [rows, k+1], -1: rejected
        for row, rid in enumerate(order):
            draft = out[prev_rows[rid]].tolist()[: slots[rid]] if rid in prev_rows else []
            got: list[int] = []
            for d in draft + [None]:  # greedy verification against the target
                got.append(targets[rid][len(seq[rid])])
                seq[rid].append(got[-1])
                if d != got[-1]:
                    break
            sampled[row, : len(got)] = torch.tensor(got, dtype=torch.int32)
        sched.capture(sampled, order, set(), requests=state)
        for rid in order:
            state[rid].output_token_ids.append(-1)
        out = sched.submit(order, k=None, eager=False)  # [rows, k], filled at the next step's start
        prev_rows = {rid: row for row, rid in enumerate(order)}
    return seq, slots_per_step


def test_schedule_mode_below_the_narrow_rows_stops_granting_slots_on_a_zero_acceptance_batch():
    """Schedule mode, adaptive slots, fewer rows than NARROW_FROM_ROWS (every row padded to k, k slots): on a batch
    whose drafts are seldom accepted (random text over a few dozen ids: a chance match now and then) the slots
    follow the back-off, one round late, down to nearly none; the emitted tokens are the target's throughout."""
    rng = random.Random(3)
    targets = {f"r{i}": [rng.randrange(3 * SMALL_VOCAB) for _ in range(900)] for i in range(ROWS)}
    clock = SimpleNamespace(t=0.0)
    core = make_core("matrix", lambda: clock.t, pad_drafts="auto")
    core.policy.use_adaptive_slots()  # as the proposer does for adaptive slots
    book = SlotBook.policy(K, low_batch=core.backoff.low)
    sched = ScheduledDrafting(core, k=K, max_rows=ROWS, device="cpu", slot_book=book)
    seq, slots_per_step = drive_schedule(sched, targets, clock, steps=200, seed=3)
    sched.close()
    for rid, s in seq.items():  # lossless
        assert s == targets[rid][: len(s)]
    assert slots_per_step[1] == ROWS * K  # k slots each at first (below the narrow rows, padded)
    late = slots_per_step[-100:]
    assert sum(late) <= ROWS * K  # about one return (a chance match of its shadow) per request at most
    st = sched.stats()
    assert st["backoff_requests_off"] == ROWS and st["schedule"]["low_batch_schedules"] > 150


def matched_to_recover(threshold: float) -> int:
    """Shadow tokens a backed-off request at an EMA of 0 must match to reach ``threshold``."""
    return math.ceil(threshold / EMA_ALPHA - 1e-9)


@pytest.mark.parametrize("strict", [0.5, 0.75, 1.0])
def test_in_a_low_batch_recovery_takes_the_stricter_threshold(monkeypatch, strict):
    monkeypatch.setattr(backoff_module, "RECOVER_LOW_BATCH", strict)
    bo = BackOff()
    low_batch(bo, ["a", "b"])
    drafts = [[5, 6, 7, 8, 9], [1]]
    bo.withhold(["a", "b"], drafts)
    bo.record(["a", "b"], [0, 0])
    need = matched_to_recover(max(strict, RECOVER_ACCEPTED))  # 2, 3 or 4 tokens
    offs = []
    for t in (5, 6, 7, 8):  # one token a step: a's shadow matches one more each step (an EMA of 0.25 each)
        bo.observe(["a", "b"], [1, 1], lambda i, t=t: [t] if i == 0 else [2])
        offs.append(bo.rows["a"].off)
    assert offs == [m < need for m in (1, 2, 3, 4)]
    mixed = BackOff()  # beside requests whose drafts are accepted the batch is not low: the usual threshold
    mixed.rows = {"c": RowBackOff(off=True, shadow=[3, 4, 5]), **{r: RowBackOff(ema=2.0, seen=MIN_STEPS) for r in "de"}}
    assert not mixed.low()
    for t in (3, 4):
        mixed.observe(["c"], [1], lambda i, t=t: [t])
    assert not mixed.rows["c"].off


def recovered_in_a_low_batch(bo: BackOff) -> None:
    """``a`` and ``b`` backed off; ``a``'s shadow matches enough tokens to bring it back (the stricter threshold)."""
    low_batch(bo, ["a", "b"])
    shadow = [5, 6, 7, 8, 9, 10]
    bo.withhold(["a", "b"], [shadow, [1]])
    bo.record(["a", "b"], [0, 0])
    for t in shadow[: matched_to_recover(backoff_module.RECOVER_LOW_BATCH)]:
        bo.observe(["a", "b"], [1, 1], lambda i, t=t: [t] if i == 0 else [2])
    assert not bo.rows["a"].off and bo.rows["a"].recovered and bo.low(STRICT_BELOW)


@pytest.mark.parametrize("exit_steps", [0, 2])
def test_in_a_low_batch_a_recovered_request_that_accepts_nothing_leaves_after_strict_exit_steps(
    monkeypatch, exit_steps
):
    monkeypatch.setattr(backoff_module, "STRICT_EXIT_STEPS", exit_steps)
    bo = BackOff()
    recovered_in_a_low_batch(bo)
    offs = []
    for _ in range(MIN_STEPS):  # a's drafts verified, nothing accepted (b stays backed off)
        bo.record(["a", "b"], [3, 0])
        bo.observe(["a", "b"], [1, 1], lambda i: [9])
        offs.append(bo.rows["a"].off)
    # 0 (off): MIN_STEPS steps and an EMA under MIN_ACCEPTED; 2: at its second verified step with nothing accepted
    assert offs == ([False, False, False, True] if exit_steps == 0 else [False, True, True, True])
    monkeypatch.setattr(backoff_module, "STRICT_EXIT_STEPS", 1)
    kept = BackOff()  # a token accepted since the recovery: the usual rule, however many zeros follow
    recovered_in_a_low_batch(kept)
    kept.record(["a", "b"], [3, 0])
    kept.observe(["a", "b"], [2, 1], lambda i: [9, 9] if i == 0 else [9])
    for _ in range(2):
        kept.record(["a", "b"], [3, 0])
        kept.observe(["a", "b"], [1, 1], lambda i: [9])
    assert not kept.rows["a"].off and kept.rows["a"].accepted == 1


def gate_batch(rows: int, recovered: dict[str, float]) -> tuple[BackOff, list[str]]:
    """A low batch of ``rows`` requests with the large-batch step gate on: all backed off, but ``recovered``
    (request id -> its EMA), which draft again."""
    bo = BackOff(step_gate=True)
    ids = [f"r{i}" for i in range(rows)]
    low_batch(bo, ids)
    for rid, ema in recovered.items():
        st = bo.rows[rid]
        st.off, st.ema, st.seen, st.recovered = False, ema, 0, True
    assert bo.low()
    return bo, ids


def test_the_step_gate_withholds_a_large_low_batchs_few_drafts_in_shadow():
    """Two recovered rows of a low batch of STEP_GATE_FROM_ROWS expect 2 x 0.5 accepted tokens, under
    STEP_GATE_SHARE per row: the step hands vLLM no draft; their requests stay drafting, their drafts in shadow."""
    rows = STEP_GATE_FROM_ROWS
    bo, ids = gate_batch(rows, {"r0": 0.5, "r1": 0.5})
    assert STEP_GATE_SHARE * rows > 2 * 0.5
    drafts = [[7, 8]] * 2 + [[1]] * (rows - 2)
    cut = bo.withhold(ids, drafts)
    assert cut == [(0, 2), (1, 2)] + [(i, 1) for i in range(2, rows)] and not any(drafts)
    assert (bo.stats.gated_steps, bo.stats.gated_rows) == (1, 2)
    assert not bo.rows["r0"].off and bo.rows["r0"].shadow == [7, 8]
    bo.record(ids, [0] * rows)
    bo.observe(ids, [1] * rows, lambda i: [7] if i < 2 else [0])  # r0 / r1's shadows match one token so far
    bo.observe(ids, [1] * rows, lambda i: [8] if i < 2 else [0])  # ... and both: settled at 2 matched
    assert bo.rows["r0"].ema == pytest.approx(0.75 * 0.5 + 0.25 * 2) and not bo.rows["r0"].off


def test_the_step_gate_lets_a_step_through_that_pays_and_never_gates_small_batches():
    rows = STEP_GATE_FROM_ROWS
    enough = {f"r{i}": 1.0 for i in range(4)}  # 4 x 1.0 accepted tokens >= STEP_GATE_SHARE x 16
    assert sum(enough.values()) >= STEP_GATE_SHARE * rows
    bo, ids = gate_batch(rows, enough)
    drafts = [[5, 6]] * 4 + [[1]] * (rows - 4)
    assert bo.withhold(ids, drafts) == [(i, 1) for i in range(4, rows)] and drafts[:4] == [[5, 6]] * 4
    assert bo.stats.gated_steps == 0
    small, ids = gate_batch(rows - 1, {"r0": 0.1})  # one row short: only the back-off decides
    drafts = [[5, 6]] + [[1]] * (rows - 2)
    assert small.withhold(ids, drafts)[0] == (1, 1) and drafts[0] == [5, 6] and small.stats.gated_steps == 0
    off, ids = gate_batch(rows, {"r0": 0.1})
    off.step_gate = False  # off: only the back-off decides
    drafts = [[5, 6]] + [[1]] * (rows - 1)
    assert off.withhold(ids, drafts)[0] == (1, 1) and drafts[0] == [5, 6]


def test_the_step_gate_needs_a_low_batch():
    """A batch whose drafts are accepted is never gated, however few rows draft."""
    rows = STEP_GATE_FROM_ROWS
    bo = BackOff(step_gate=True)
    ids = [f"r{i}" for i in range(rows)]
    for _ in range(MIN_STEPS + 1):  # every row accepts 2 tokens per drafted step
        bo.observe(ids, [3] * rows, lambda i: [0, 0, 0])
        bo.record(ids, [3] * rows)
    assert not bo.low()
    drafts = [[5, 6]] + [[]] * (rows - 1)
    assert bo.withhold(ids, drafts) == [] and drafts[0] == [5, 6] and bo.stats.gated_steps == 0
