"""The native lane's calibrated chains (``min_confidence`` > 0) against the library's, on the CPU.

The lane (``lane_step``, ``lane_submit``) learns the calibration from the tokens it appends for each request and
drafts calibrated chains; the library does the same through ``extend`` and ``draft_chains``. For the same sequence of
appends (a step's stops, its restarts, every other row's extend, then every row's draft) both must hand over the
same drafts: recorded traces (``../shared`` data, ``SPECDEC_SHARED``) and a synthetic repetitive stream are
replayed with several requests at once (rows shuffled every step, finished requests replaced, a context jump now and
then), greedily verified against the recorded responses, through the inline lane (1 and 3 threads) and the
lane thread, unpadded and padded. A hand-checked case pins the calibrated probabilities the lane cuts on.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np
import pytest

from core_support import target_sequence
from specdec.drafters.base import DraftRequest
from specdec.drafters.suffix import SuffixDrafter, native_available
from specdec.drafters.suffix_lane import LaneDecisions
from specdec.paths import TARGET_MODEL, data_dir, model_path
from specdec.vllm_plugin.core.lane import find_lane
from specdec.vllm_plugin.core.python_engine import chain_draft

pytestmark = pytest.mark.skipif(not native_available(), reason="native suffix core not built")

MIN_CONFIDENCE = 0.06  # the plugin's intended default (issue #42 item 3)
K = 8  # draft tokens per row at most
FLOOR = 0.15  # the step's cut (adaptive off): path probability a drafted token keeps
MAX_MODEL_LEN = 1 << 20
ROWS = 6  # requests decoding at once
JUMP_EVERY = 37  # steps between context jumps (a preemption's recompute: the row restarts from its context)
SHARED_TOK = model_path(TARGET_MODEL)
TRACES = ("code_alpaca", "gsm8k_175b")


def decisions(*, pad: bool) -> LaneDecisions:
    return LaneDecisions(k=K, max_model_len=MAX_MODEL_LEN, spec=True, pad=pad, adaptive=False, floor=FLOOR, value=0.0)


def records(source: str, n: int) -> list[tuple[list[int], list[int]]]:
    """(prompt, response) token ids: ``n`` recorded traces, or synthetic repetitive streams."""
    if source == "synthetic":
        return [(target_sequence(i % 9)[:40], target_sequence(i % 9)[40:300]) for i in range(n)]
    if not (data_dir() / "code").exists() or not (SHARED_TOK / "tokenizer.json").exists():
        pytest.skip("needs ../shared data and the shared tokenizer (SPECDEC_SHARED)")
    from specdec.eval.loaders import load_traces

    _, recs = load_traces(source, tokenizer=str(SHARED_TOK), limit=n)
    return [(r.prompt_ids.tolist(), r.response_ids.tolist()) for r in recs if r.response_ids.size > 1]


class Replay:
    """``ROWS`` requests decode their recorded responses at once: each step a row's new tokens are its draft's
    verified prefix and one more; rows are shuffled every step, a finished request leaves (stopped before the next
    step) and the next record joins; every ``JUMP_EVERY`` steps one context jumps ahead (it must restart)."""

    def __init__(self, recs: list[tuple[list[int], list[int]]], *, seed: int) -> None:
        self.rng = random.Random(seed)
        self.todo = list(reversed(recs))
        self.reqs: dict[str, dict] = {}
        self.next_id = 0
        self.steps = 0

    def step(self, drafts: dict[str, list[int]]) -> tuple[list[str], list[str], list[list[int]], list[int]]:
        """(stops, row ids, new tokens per row, context lengths per row) of the next step."""
        stops = [r for r, q in self.reqs.items() if len(q["seq"]) >= q["end"]]
        for r in stops:
            del self.reqs[r]
        while len(self.reqs) < ROWS and self.todo:
            prompt, response = self.todo.pop()
            self.reqs[f"q{self.next_id}"] = {"seq": list(prompt), "p": len(prompt), "end": len(prompt) + len(response)}
            self.reqs[f"q{self.next_id}"]["all"] = prompt + response
            self.next_id += 1
        ids = list(self.reqs)
        self.rng.shuffle(ids)
        self.steps += 1
        if self.steps % JUMP_EVERY == 0 and ids:
            q = self.reqs[ids[0]]
            q["seq"] = q["all"][: min(len(q["seq"]) + 5, q["end"] - 1)]
        return stops, ids, [self._advance(r, drafts.get(r, [])) for r in ids], [len(self.reqs[r]["seq"]) for r in ids]

    def _advance(self, rid: str, draft: list[int]) -> list[int]:
        q = self.reqs[rid]
        out: list[int] = []
        for d in [*draft, None]:
            want = q["all"][len(q["seq"])]
            out.append(want)
            q["seq"].append(want)
            if d != want or len(q["seq"]) >= q["end"]:
                break
        return out

    def context(self, rid: str) -> tuple[list[int], int]:
        return list(self.reqs[rid]["seq"]), self.reqs[rid]["p"]


class Library:
    """The library's calibrated drafts after the lane's sequence of appends: stops, restarts (start and extend from
    the context), every other row's extend, then every row's chain cut and padded as the proposer does."""

    def __init__(self, drafter: SuffixDrafter) -> None:
        self.d = drafter
        self.known: dict[str, int] = {}

    def step(
        self, replay: Replay, stops: list[str], ids: list[str], sampled: list[list[int]], lens: list[int], *, pad: bool
    ) -> list[list[int]]:
        for r in stops:
            self.d.stop(r)
            self.known.pop(r, None)
        restart = [i for i, r in enumerate(ids) if self.known.get(r, -1) + len(sampled[i]) != lens[i]]
        for i in restart:
            ctx, p = replay.context(ids[i])
            self.d.start(ids[i], ctx[:p])
            self.d.extend(ids[i], ctx[p:])
        for i, r in enumerate(ids):
            if i not in restart:
                self.d.extend(r, sampled[i])
            self.known[r] = lens[i]
        room = [min(K, MAX_MODEL_LEN - n - 1) for n in lens]
        chains = self.d.draft_chains([DraftRequest(r, room[i], free=pad) for i, r in enumerate(ids)])
        return [
            chain_draft(toks, probs, room[i], FLOOR, pad=room[i] if pad else 0, filler=sampled[i][-1])[0]
            for i, (toks, probs) in enumerate(chains)
        ]


def lane_inline(
    lane: SuffixDrafter,
    replay: Replay,
    stops: list[str],
    ids: list[str],
    sampled: list[list[int]],
    lens: list[int],
    *,
    pad: bool,
) -> list[list[int]]:
    """One step through ``lane_step`` as the proposer takes it (rows to restart restarted between two calls)."""
    for r in stops:
        lane.stop(r)
    lengths = np.asarray(lens, np.int32)  # [rows]
    drafts, redo, _, _ = lane.lane_step(ids, sampled, lengths, decisions=decisions(pad=pad))
    for i in redo:
        ctx, p = replay.context(ids[i])
        lane.lane_restart(ids[i], ctx[:p], ctx[p:], len(ctx))
    if redo:
        drafts, again, _, _ = lane.lane_step(ids, sampled, lengths, decisions=decisions(pad=pad))
        assert not again
    return drafts


def lane_thread(
    lane: SuffixDrafter,
    replay: Replay,
    stops: list[str],
    ids: list[str],
    sampled: list[list[int]],
    lens: list[int],
    *,
    pad: bool,
) -> list[list[int]]:
    """One step on the lane's own thread (``lane_submit`` / ``lane_collect``): stops and restarts happen there."""
    width = max(lens)
    tokens = np.zeros((len(ids), width), np.int32)  # [rows, width] the rows' contexts (vLLM's token_ids_cpu)
    prompts = np.zeros(len(ids), np.int32)  # [rows]
    for i, r in enumerate(ids):
        ctx, prompts[i] = replay.context(r)
        tokens[i, : len(ctx)] = ctx
    lane.lane_submit(
        ids, sampled, np.asarray(lens, np.int32), tokens, prompts, decisions=decisions(pad=pad), stops=stops
    )
    out = lane.lane_collect(None)
    assert out is not None
    return out[0]


def replay_both(source: str, *, n: int, mode: str, threads: int, pad: bool, backends: Sequence[str]) -> dict:
    """Replays ``source`` through a calibrated lane and the library (each of ``backends``), asserting equal drafts
    every step; returns counts: steps, drafted tokens, and steps where count / total chains would differ."""
    lane = SuffixDrafter(backend="native", min_confidence=MIN_CONFIDENCE)
    assert find_lane(lane) is lane  # the proposer's lane_config: the drafter's min_confidence goes with it
    lane.lane_threads(threads)
    refs = [Library(SuffixDrafter(backend=b, min_confidence=MIN_CONFIDENCE)) for b in backends]
    plain = Library(SuffixDrafter(backend="native"))  # count / total chains over the same appends
    replay, drafts, counts = Replay(records(source, n), seed=3), {}, {"steps": 0, "drafted": 0, "differ": 0}
    step = lane_inline if mode == "inline" else lane_thread
    while replay.reqs or replay.todo:
        stops, ids, sampled, lens = replay.step(drafts)
        if not ids:
            break
        got = step(lane, replay, stops, ids, sampled, lens, pad=pad)
        for ref in refs:
            assert ref.step(replay, stops, ids, sampled, lens, pad=pad) == got, f"step {counts['steps']}"
        counts["differ"] += plain.step(replay, stops, ids, sampled, lens, pad=pad) != got
        counts["steps"] += 1
        counts["drafted"] += sum(map(len, got))
        drafts = dict(zip(ids, got))
    return counts


@pytest.mark.parametrize("source", [*TRACES, "synthetic"])
@pytest.mark.parametrize(("mode", "threads", "pad"), [("inline", 1, False), ("inline", 3, True), ("thread", 3, False)])
def test_lane_drafts_equal_the_librarys_calibrated_chains(source, mode, threads, pad):
    counts = replay_both(source, n=40, mode=mode, threads=threads, pad=pad, backends=("native",))
    assert counts["steps"] > 100 and counts["drafted"] > 200
    assert counts["differ"] > 0  # the calibration changed drafts (else this test would check nothing of it)


def test_lane_drafts_equal_the_python_reference():
    counts = replay_both("synthetic", n=12, mode="inline", threads=2, pad=False, backends=("native", "python"))
    assert counts["steps"] > 50 and counts["differ"] > 0


def hand_lane(**config: float) -> list[int]:
    """Prompt 5 6 7 8 5 6 7, then rows of 8 | 4 | 6 7 8 through the lane (tests/test_suffix_calibration.py's
    sequence): the last step's draft, k = 4, no cut but the drafter's own."""
    d = SuffixDrafter(backend="native", max_depth=8, **config)
    assert find_lane(d) is d
    d.lane_start("a", [5, 6, 7, 8, 5, 6, 7], [])
    step = LaneDecisions(k=4, max_model_len=MAX_MODEL_LEN, spec=True, pad=False, adaptive=False, floor=0.0, value=0.0)
    n, drafts = 7, [[]]
    for toks in ([8], [4], [6, 7, 8]):
        n += len(toks)
        drafts, redo, _, _ = d.lane_step(["a"], [toks], np.array([n], np.int32), decisions=step)
        assert redo == []
    return drafts[0]


def test_calibration_cuts_a_chain_count_over_total_keeps_by_hand():
    """The learned table (tests/test_suffix_calibration.py, by hand): the match "6 7 8" continues with 4 (count 1 of
    2: 0.5), then 6 (cell local, 4 tokens matched, count 1 of 1: 0 hits in 1 trial, (0 + 2) / (1 + 2) = 2/3), 7, 8
    (unseen cells: 1). Path probabilities 0.5, 1/3, 1/3, 1/3: min_confidence 0.34 cuts after 4, 0.33 keeps all; by
    count / total (0.5, 1, 1, 1) a path floor of 0.34 keeps all four."""
    assert hand_lane(min_confidence=0.34) == [4]
    assert hand_lane(min_confidence=0.33) == [4, 6, 7, 8]
    assert hand_lane(min_token_prob=0.34) == [4, 6, 7, 8]
    assert hand_lane(min_token_prob=0.51) == []
