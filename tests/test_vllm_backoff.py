"""Back-off on low acceptance (``core/backoff.py``): forced acceptance sequences drive ``ProposerCore`` on every
path (Python engine, native lane, schedule mode's token-matrix step, thread mode's submit / collect) and the slot
book of schedule mode."""

from __future__ import annotations

import random
from collections.abc import Callable
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from specdec.drafters.suffix import SuffixDrafter, native_available
from specdec.vllm_plugin.core.adaptive import PROBE_TOKENS
from specdec.vllm_plugin.core.backoff import (
    BATCH_MIN_STEPS,
    PROBE_FIRST_AFTER,
    PROBE_MAX_AFTER,
    BackOff,
)
from specdec.vllm_plugin.core.proposer_core import ProposerCore
from specdec.vllm_plugin.core.slots import NARROW_FROM_ROWS, NARROW_WIDTH, SlotBook
from specdec.vllm_plugin.entry.options import SpecdecOptions
from specdec.vllm_plugin.modes.schedule import ScheduledDrafting
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
    cls = ThreadedProposerCore if path == "thread" else ProposerCore
    return cls(
        SuffixDrafter(backend="native"),
        SpecdecOptions.from_dict(options),
        max_model_len=MAX_LEN,
        target_params=TINY_TARGET,
        clock=clock,
    )


class Batch:
    """``ROWS`` requests over random contexts; each step the verifier accepts what ``accept`` says of each row's
    last draft, then a bonus token that is not the draft's next one (so exactly that many are accepted)."""

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

    def verify(self, step: int, accept: Accept) -> tuple[list[str], list[list[int]]]:
        order = list(self.ctx)
        self.rng.shuffle(order)  # rows move between steps
        sampled = []
        for rid in order:
            d = self.drafts.get(rid, [])
            a = max(0, min(len(d), accept(rid, step, d)))
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
        order, sampled = self.verify(step, accept)
        tokens, lengths, prompts = self.arrays(order)
        if path == "matrix":
            drafts = matrix_step(core, order, sampled, tokens, lengths, prompts)
        elif path == "thread":
            assert isinstance(core, ThreadedProposerCore)
            core.submit(order, sampled, lengths, tokens, num_prompt_tokens=prompts)
            drafts = core.collect()
        else:
            drafts = core.step(order, sampled, lengths, tokens, num_prompt_tokens=prompts)
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


@pytest.mark.parametrize("path", PATHS)
def test_zero_acceptance_stops_padding_and_drafting_then_probes_ever_more_rarely(path):
    batch = Batch()
    core = make_core(path, batch.clock)
    steps, lengths = 260, []
    for step in range(steps):
        drafts = batch.step(core, path, step, never)
        lengths.append({rid: len(d) for rid, d in drafts.items()})
    # before the batch may count as low, every row is padded to k, as without back-off
    assert all(n == K for step in lengths[1:BATCH_MIN_STEPS] for n in step.values())
    # from then on: no padding, and every request's draft is withheld but for probes of at most PROBE_TOKENS
    assert all(n <= PROBE_TOKENS for step in lengths[BATCH_MIN_STEPS:] for n in step.values())
    for rid in batch.ctx:
        probes = [s for s in range(BATCH_MIN_STEPS, steps) if lengths[s][rid]]
        gaps = np.diff(probes)
        assert len(probes) >= 3 and (gaps >= PROBE_FIRST_AFTER).all() and (gaps <= PROBE_MAX_AFTER + 1).all()
        assert (np.diff(gaps) >= 0).all()  # each failed probe doubles the interval (capped)
        # the last 2 x PROBE_MAX_AFTER steps cost the request at most 3 probes
        assert sum(lengths[s][rid] for s in range(steps - 2 * PROBE_MAX_AFTER, steps)) <= 3 * PROBE_TOKENS
    st = core.stats_dict()
    assert st["backoff_requests_backed_off"] == st["backoff_requests_off"] == ROWS and st["backoff_recoveries"] == 0
    assert st["backoff_batch_low"] and st["backoff_batch_accepted_per_row"] == 0.0
    assert st["backoff_unpadded_steps"] == steps - BATCH_MIN_STEPS
    assert st["backoff_probes"] == st["backoff_probe_failures"] + sum(1 for n in lengths[-1].values() if n)
    assert st["backoff_withheld_rows"] > 0 and st["backoff_withheld_tokens"] > 0
    assert st["drafted_tokens"] == sum(sum(s.values()) for s in lengths)  # what vLLM got, not what was drafted
    assert st["accepted_tokens"] == 0
    core.close()


@pytest.mark.parametrize("path", PATHS)
def test_requests_recover_when_their_drafts_are_accepted_again(path):
    turn = 80  # from this step on the verifier accepts every draft token

    def later(rid: str, step: int, draft: list[int]) -> int:
        return len(draft) if step >= turn else 0

    batch = Batch(seed=1)
    core = make_core(path, batch.clock)
    lengths = [{rid: len(d) for rid, d in batch.step(core, path, s, later).items()} for s in range(turn)]
    st = core.stats_dict()
    assert st["backoff_requests_off"] == ROWS and st["backoff_batch_low"]
    bound = turn + PROBE_MAX_AFTER + 4  # a probe within one interval, then a step or two until padding pays again
    lengths += [{rid: len(d) for rid, d in batch.step(core, path, s, later).items()} for s in range(turn, bound + 10)]
    assert all(n == K for s in lengths[bound:] for n in s.values())  # full drafts, padded again
    st = core.stats_dict()
    assert st["backoff_recoveries"] == ROWS and st["backoff_requests_off"] == 0 and not st["backoff_batch_low"]
    assert st["accepted_tokens"] >= 10 * ROWS * K
    core.close()


@pytest.mark.parametrize("path", PATHS)
def test_a_request_new_to_a_low_batch_probes_first_then_drafts_alone_unpadded(path):
    """A request joining a batch that backed off starts backed off too; its first probe is accepted, so it drafts
    (its own chains, unpadded) while the others stay without drafts and the batch, whose rows accept too little on
    average to pay for padding (2 tokens per step of one row in 7), unpadded."""
    join = 60

    def newcomer(rid: str, step: int, draft: list[int]) -> int:
        return min(2, len(draft)) if rid == "new" else 0

    batch = Batch(seed=5, rows=6)
    core = make_core(path, batch.clock)
    lengths = []
    for step in range(join + 60):
        if step == join:
            assert core.backoff.low()
            batch.add("new")
        lengths.append({rid: len(d) for rid, d in batch.step(core, path, step, newcomer).items()})
    assert lengths[join]["new"] == 0  # held: its first probe comes on the next probe step
    new = [s["new"] for s in lengths[join + PROBE_FIRST_AFTER + 2 :]]
    assert sum(n > PROBE_TOKENS for n in new) > len(new) // 2 and max(new) <= K
    others = [n for s in lengths[join:] for r, n in s.items() if r != "new"]
    assert max(others) <= PROBE_TOKENS
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


def drive_backoff(bo: BackOff, steps: int, accept: Callable[[str, int], bool], joins: dict[str, int]) -> dict:
    """``bo`` alone over ``steps`` unpadded steps: request r joins at step ``joins[r]``, its drafter drafts 3 tokens
    every step, and ``accept(r, step)`` says whether what it handed is accepted. Returns each request's probe steps
    (``bo.step`` when a probe went out)."""
    handed: dict[str, int] = {}
    probes: dict[str, list[int]] = {r: [] for r in joins}
    for step in range(steps):
        ids = [r for r, j in joins.items() if j <= step]
        bo.observe(ids, [1 + (handed.get(r, 0) if accept(r, step) else 0) for r in ids])
        low = bo.low()
        for r in ids:
            limit = bo.limit(r, low=low)
            handed[r] = 3 if limit is None else min(3, limit)
            if limit is not None:
                bo.taken(r, limit, 3, handed[r])
                if limit:
                    probes[r].append(bo.step)
        bo.record(ids, [handed[r] for r in ids])
    return probes


def test_probes_double_their_interval_up_to_the_cap_on_aligned_steps_and_recovery_resets_it():
    bo = BackOff()
    late = 200  # "b" joins once the batch is low (after BATCH_MIN_STEPS steps with drafts): it starts backed off
    probes = drive_backoff(bo, 520, lambda r, s: False, {"a": 0, "b": late})
    assert bo.stats.requests_backed_off == 1 and bo.stats.newcomers_held == 1 and bo.requests_off == 2
    for r, steps in probes.items():
        gaps = list(np.diff(steps))
        assert gaps[:4] in ([8, 16, 32, 64], [4, 16, 32, 64]), r  # the next multiple of the doubled interval
        assert set(gaps[4:]) == {PROBE_MAX_AFTER}
        assert steps[0] % PROBE_FIRST_AFTER == 0 and all(s % PROBE_MAX_AFTER == 0 for s in steps[4:])
    assert probes["a"][-3:] == probes["b"][-3:]  # backed off at different steps, probing on the same ones
    assert bo.stats.probes == bo.stats.probe_failures  # each probe's outcome seen the step after it
    bo2 = BackOff()
    turn = 150  # from then on "a" accepts what it hands
    drive_backoff(bo2, 300, lambda r, s: r == "a" and s >= turn, {"a": 0, "b": 0})
    assert bo2.stats.recoveries == 1 and not bo2.rows["a"].off and bo2.rows["b"].off
    assert bo2.rows["a"].interval == PROBE_FIRST_AFTER and bo2.requests_off == 1
    bo2.prune({"b"})
    assert set(bo2.rows) == {"b"} and bo2.requests_off == 1


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
    whose drafts are never accepted the slots follow the back-off, one round late, down to probes; the emitted
    tokens are the target's throughout."""
    rng = random.Random(3)
    targets = {f"r{i}": [rng.randrange(SMALL_VOCAB) for _ in range(900)] for i in range(ROWS)}
    clock = SimpleNamespace(t=0.0)
    core = make_core("matrix", lambda: clock.t, pad_drafts="auto")
    core.pad_below_rows = NARROW_FROM_ROWS  # as the proposer sets it for adaptive slots
    book = SlotBook.policy(K, low_batch=core.backoff.low)
    sched = ScheduledDrafting(core, k=K, max_rows=ROWS, device="cpu", slot_book=book)
    seq, slots_per_step = drive_schedule(sched, targets, clock, steps=200, seed=3)
    sched.close()
    for rid, s in seq.items():  # lossless
        assert s == targets[rid][: len(s)]
    assert slots_per_step[1] == ROWS * K  # k slots each at first (below the narrow rows, padded)
    late = slots_per_step[-100:]
    assert sum(late) <= ROWS * 2 * PROBE_TOKENS * 3  # a few probes (with their growth slot) per request
    st = sched.stats()
    assert st["backoff_requests_off"] == ROWS and st["schedule"]["low_batch_schedules"] > 150
