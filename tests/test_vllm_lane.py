"""The proposer's one-call native step (lane) against its Python path: same drafts, same statistics.

Two ``ProposerCore`` twins, each with its own native suffix drafter, one with ``native_step`` and one without,
are fed identical vLLM-shaped steps by a fake engine: requests decode fixed target sequences (repetitive, so the
suffix drafter hits and misses), rows move between steps, requests finish and new ones join, some rows are
partial prefills (no new tokens), one context jumps (resync), and a fake clock makes the adaptive controller's
cost model and A/B windows act. Every step's drafts must be equal, and so must the statistics.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from core_support import target_sequence
from specdec.drafters.suffix import SuffixDrafter, native_available
from specdec.drafters.suffix_lane import LaneDecisions
from specdec.vllm_plugin.core.batch import StepBatch
from specdec.vllm_plugin.core.engine import LaneEngine, StepEngine
from specdec.vllm_plugin.core.proposer_core import ProposerCore
from specdec.vllm_plugin.core.python_engine import PythonEngine
from specdec.vllm_plugin.entry.options import SpecdecOptions
from specdec.vllm_plugin.internal import InternalSettings

pytestmark = pytest.mark.skipif(not native_available(), reason="native suffix core not built")

MAX_LEN = 2048
MAX_ROWS = 16
STAT_KEYS = (
    "steps",
    "rows",
    "drafted_tokens",
    "accepted_tokens",
    "emitted_tokens",
    "resyncs",
    "started",
    "stopped",
    "plain_steps",
    "timeouts",
)


class FakeClock:
    """Step period = 1 ms + 20 us per verified token (set by the engine before each step)."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class FakeEngine:
    """Requests decode their target sequences with greedy verification of the drafts; rows move every step."""

    DISTINCT_TARGETS = 0  # > 0: request i decodes target i mod this (new requests repeat finished ones)
    PREFILL_SHARE = 0.3  # requests whose first step is a partial prefill (no new tokens)

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.tokens = np.zeros((MAX_ROWS, MAX_LEN), np.int32)  # [rows, max_model_len] like token_ids_cpu
        self.reqs: dict[str, dict] = {}
        self.next_id = 0
        self.clock = FakeClock()

    def add(self) -> None:
        rid = f"r{self.next_id}"
        target = target_sequence(self.next_id % self.DISTINCT_TARGETS if self.DISTINCT_TARGETS else self.next_id)
        prompt = self.rng.randint(20, 120)
        prefill = self.rng.random() < self.PREFILL_SHARE
        self.reqs[rid] = {"seq": target[:prompt], "target": target, "prompt": prompt, "prefill": prefill}
        self.next_id += 1

    def step(self, cores: list[ProposerCore], drafts: dict[str, list[int]]) -> dict[str, list[int]]:
        order = list(self.reqs)
        self.rng.shuffle(order)
        sampled, lengths, prompts = [], np.zeros(MAX_ROWS, np.int32), np.zeros(MAX_ROWS, np.int32)
        verified = 0
        for row, rid in enumerate(order):
            r = self.reqs[rid]
            if r["prefill"]:  # a partial prefill: no new tokens this step
                r["prefill"], out = False, []
            else:
                out = []
                for d in drafts.get(rid, []) + [None]:
                    want = r["target"][len(r["seq"])]
                    out.append(want)
                    r["seq"].append(want)
                    if d != want:
                        break
            verified += 1 + len(drafts.get(rid, []))
            sampled.append(out)
            self.tokens[row, : len(r["seq"])] = r["seq"]
            lengths[row], prompts[row] = len(r["seq"]), r["prompt"]
        self.clock.t += 1e-3 + 20e-6 * verified
        batch = StepBatch(order, sampled, lengths, self.tokens, prompts)
        results = [core.step(batch) for core in cores]
        assert all(r == results[0] for r in results)
        return dict(zip(order, results[0]))

    def run(self, cores: list, steps: int) -> dict[str, list[int]]:
        """``steps`` steps from the start, requests churning before each; the last step's drafts."""
        drafts: dict[str, list[int]] = {}
        for step in range(steps):
            self.churn(step)
            drafts = self.step(cores, drafts)
        return drafts

    def churn(self, step: int) -> None:
        for rid in [r for r, v in self.reqs.items() if len(v["seq"]) > len(v["target"]) - 40]:
            del self.reqs[rid]  # finished
        if step % 7 == 3 and self.reqs:
            del self.reqs[self.rng.choice(list(self.reqs))]  # aborted
        while len(self.reqs) < MAX_ROWS - self.rng.randint(0, 4):
            self.add()


def twins(clock: FakeClock | None = None, *, suffix: dict | None = None, **opts) -> list[ProposerCore]:
    """The Python-path core and the lane core over native suffix drafters (``suffix``: their options)."""
    cores = []
    for native in (False, True):
        user, internal = InternalSettings.split(  # no deadline unless asked: the thread's waits use the real clock
            {"num_speculative_tokens": 8, "native_step": native, "draft_timeout_ms": 0, **opts}
        )
        cores.append(
            ProposerCore(
                SuffixDrafter(backend="native", **(suffix or {})),
                SpecdecOptions.from_dict(user),
                max_model_len=MAX_LEN,
                internal=internal,
                target_params=5e7,
                clock=clock or FakeClock(),
            )
        )
    return cores


@pytest.mark.parametrize(
    "opts",
    [
        {},  # adaptive, pad auto, deadline auto
        {"pad_drafts": "on"},
        {"adaptive": False, "min_path_prob": 0.3},
        {"min_path_prob_per_seq": 0.02},
        {"lane_threads": 3},  # the engine thread and two helpers draft the rows of each step
        {"lane_threads": 4, "pad_drafts": "on", "min_path_prob": 0.2},
    ],
)
def test_lane_drafts_and_stats_equal_the_python_path(opts):
    eng = FakeEngine(seed=1)
    cores = twins(eng.clock, **opts)
    assert cores[0].lane is None and cores[1].lane is not None
    assert all(isinstance(c.engine, StepEngine) for c in cores)  # the one interface the proposer drafts through
    assert isinstance(cores[0].engine, PythonEngine) and isinstance(cores[1].engine, LaneEngine)
    drafts: dict[str, list[int]] = {}
    for step in range(160):
        eng.churn(step)
        if step == 50:  # a context jump (preemption + recompute): both must resync the request
            rid = next(iter(eng.reqs))
            eng.reqs[rid]["seq"] += eng.reqs[rid]["target"][len(eng.reqs[rid]["seq"]) :][:5]
        drafts = eng.step(cores, drafts)
    a, b = (c.stats_dict() for c in cores)
    for key in STAT_KEYS:
        assert a[key] == b[key], key
    assert a["resyncs"] >= 1 and a["stopped"] > 5 and a["drafted_tokens"] > 100 and a["accepted_tokens"] > 50
    assert b["native_step"] and not a["native_step"]
    assert a["active_requests"] == b["active_requests"] >= len(eng.reqs) - 4  # not yet started: prefilling


def through_the_matrix(core: ProposerCore) -> None:
    """Drive ``core`` through ``step_tokens`` (schedule mode's one call) while the engine calls ``step``: each step's
    rows become a token matrix (-1 past a row's new tokens), the drafts are read back from the buffer, whose padding
    is checked (each row's last token past its draft)."""

    def step(batch: StepBatch) -> list[list[int]]:
        order, sampled, lengths, tokens = batch.req_ids, batch.sampled, batch.num_tokens, batch.token_ids
        num_prompt_tokens = batch.num_prompt_tokens
        n = len(order)
        new = [len(s) for s in sampled]
        matrix = np.full((n, max(new, default=0) + 2), -1, np.int32)  # [rows, w]
        for i, s in enumerate(sampled):
            matrix[i, : len(s)] = s
        known = [int(lengths[i]) - new[i] for i in range(n)]
        fillers = [int(tokens[i, known[i] - 1]) for i in range(n)]
        out = np.full((n, core.k), -7, np.int32)  # [rows, k]

        def context(i: int) -> tuple[list[int], int]:
            return tokens[i, : int(lengths[i])].tolist(), int(num_prompt_tokens[i])

        lens = core.step_tokens(order, matrix, new, known, fillers, out, context=context)
        assert lens is not None and len(lens) == n
        for i in range(n):
            assert (out[i, lens[i] :] == (sampled[i][-1] if sampled[i] else fillers[i])).all()
        return [out[i, : lens[i]].tolist() for i in range(n)]

    core.step = step  # type: ignore[method-assign]


@pytest.mark.parametrize("opts", [{}, {"pad_drafts": "on"}, {"lane_threads": 3, "min_path_prob": 0.2}])
def test_the_token_matrix_step_equals_the_lane_and_python_paths(opts):
    """``ProposerCore.step_tokens`` (the lane reads the captured tokens in place and writes padded drafts into the
    draft buffer): the drafts and statistics of ``step`` on either path, through new requests, partial prefills,
    a context jump and a forced resync (rows restarted from ``context``)."""
    eng = FakeEngine(seed=4)
    cores = twins(eng.clock, **opts)
    matrix = twins(eng.clock, **opts)[1]
    through_the_matrix(matrix)
    cores.append(matrix)
    drafts: dict[str, list[int]] = {}
    for step in range(160):
        eng.churn(step)
        if step == 50:  # a context jump: every path resyncs the request
            rid = next(iter(eng.reqs))
            eng.reqs[rid]["seq"] += eng.reqs[rid]["target"][len(eng.reqs[rid]["seq"]) :][:5]
        if step == 90:
            for core in cores:
                core.force_resync(next(iter(eng.reqs)))
        drafts = eng.step(cores, drafts)
    stats = [c.stats_dict() for c in cores]
    for key in STAT_KEYS:
        assert stats[0][key] == stats[1][key] == stats[2][key], key
    assert stats[2]["resyncs"] >= 2 and stats[2]["started"] > 10 and stats[2]["accepted_tokens"] > 50


def test_the_token_matrix_step_names_a_wrong_buffer():
    lane = lane_core(FakeClock()).lane
    assert lane is not None
    decisions = LaneDecisions(k=4, max_model_len=MAX_LEN, spec=True, pad=False, adaptive=False, floor=0.1, value=0.0)
    tokens, out = np.full((1, 3), -1, np.int32), np.zeros((1, 4), np.int32)
    with pytest.raises(ValueError, match="tokens must be a 2-D int32 array"):
        lane.lane_step_tokens(["a"], tokens.astype(np.int64), [5], [1], out, decisions=decisions)
    with pytest.raises(ValueError, match="out must be a 2-D int32 array"):
        lane.lane_step_tokens(["a"], tokens, [5], [1], out[0], decisions=decisions)
    with pytest.raises(ValueError, match="value 1099511627776 does not fit a 32-bit integer"):
        lane.lane_step_tokens(["a"], tokens, np.array([2**40]), [1], out, decisions=decisions)
    with pytest.raises(ValueError, match="does not fit 64 bits"):
        lane.lane_step_tokens(["a"], tokens, [2**70], [1], out, decisions=decisions)
    with pytest.raises(ValueError, match="2 request ids but 1 token rows"):
        lane.lane_step_tokens(["a", "b"], tokens, [5, 5], [1, 1], out, decisions=decisions)
    lengths, redo, _, _ = lane.lane_step_tokens(["a"], tokens, [5], [9], out, decisions=decisions)
    assert lengths == [0] and redo == [] and out.tolist() == [[9, 9, 9, 9]]  # unknown, no new tokens: its last token


class RepeatingEngine(FakeEngine):
    """New requests decode the targets of earlier ones (4 distinct targets): the global cache of finished
    responses gives longer matches than a request's own context, so a stale match front changes the drafts."""

    DISTINCT_TARGETS = 4
    PREFILL_SHARE = 0.0


@pytest.mark.parametrize("threads", [1, 3])
def test_early_stops_and_front_refreshes_keep_the_drafts(threads):
    """Schedule mode stops absent requests and rebuilds the global-cache match fronts before the step, while the GPU
    still runs (``refresh_early``): the drafts and statistics stay those of the Python path."""
    eng = RepeatingEngine(seed=2)
    cores = twins(eng.clock, lane_threads=threads)
    early, plain_step = cores[1], cores[1].step
    refreshed = 0

    def step(batch: StepBatch) -> list[list[int]]:
        nonlocal refreshed
        early.stop_absent(batch.req_ids)
        refreshed += early.refresh_early()
        assert early.refresh_early() == 0  # nothing is stale right after a refresh
        return plain_step(batch)

    early.step = step  # type: ignore[method-assign]
    eng.run(cores, 120)
    a, b = (c.stats_dict() for c in cores)
    for key in STAT_KEYS:
        assert a[key] == b[key], key
    assert a["stopped"] > 5 and a["accepted_tokens"] > 50
    assert refreshed > 20 and b["early_refreshes"] == refreshed and cores[0].refresh_early() == 0


def test_lane_is_off_for_thread_deadlines_and_non_native_drafters():
    options, threads = SpecdecOptions(), InternalSettings(deadline_mode="thread")
    assert ProposerCore(SuffixDrafter(backend="native"), options, max_model_len=MAX_LEN, internal=threads).lane is None
    python = SpecdecOptions.from_dict({})
    assert ProposerCore(SuffixDrafter(backend="python"), python, max_model_len=MAX_LEN).lane is None


def test_calibrated_chains_draft_on_the_native_lane():
    """With ``min_confidence`` > 0 the proposer keeps the native lane, which drafts calibrated chains: its drafts
    differ from the count / total lane's over the same steps (tests/test_suffix_lane_calib.py checks them against
    the library's)."""
    options = SpecdecOptions.from_dict({})
    calibrated = SuffixDrafter(backend="native", min_confidence=0.06)
    core = ProposerCore(calibrated, options, max_model_len=MAX_LEN)
    assert core.lane is calibrated and isinstance(core.engine, LaneEngine)
    digests = []
    for suffix in ({"min_confidence": 0.06}, {}):
        eng = RepeatingEngine(seed=5)
        core = lane_core(eng.clock, suffix=suffix)
        assert isinstance(core.engine, LaneEngine)
        drafts: dict[str, list[int]] = {}
        steps = []
        for step in range(60):
            eng.churn(step)
            drafts = eng.step([core], drafts)
            steps.append(sorted(drafts.items()))
        assert core.stats.accepted_tokens > 100
        digests.append(steps)
    assert digests[0] != digests[1]


@pytest.mark.parametrize("opts", [{}, {"pad_drafts": "on", "lane_threads": 3}, {"adaptive": False}])
def test_calibrated_lane_equals_the_python_path_without_resyncs(opts):
    """Calibrated chains (``min_confidence`` 0.06) on both paths: same drafts and statistics while no request
    resyncs. (A resync's stop caches the old response in the global trie, which the calibration's global cells
    observe: the lane restarts rows before the others extend, the Python path takes rows in order, so a resync can
    make the two learn slightly differently; the lane's drafts are checked against the library's after its own order
    of appends in tests/test_suffix_lane_calib.py.)"""
    for engine_cls in (FakeEngine, RepeatingEngine):
        eng = engine_cls(seed=1)
        cores = twins(eng.clock, suffix={"min_confidence": 0.06}, **opts)
        assert isinstance(cores[1].engine, LaneEngine)
        eng.run(cores, 120)
        a, b = (c.stats_dict() for c in cores)
        for key in STAT_KEYS:
            assert a[key] == b[key], key
        assert a["resyncs"] == 0 and a["stopped"] > 5 and a["accepted_tokens"] > 50


def test_lane_overruns_drop_their_steps_and_the_third_hands_over_to_the_python_path(monkeypatch):
    import specdec.vllm_plugin.core.engine as core_mod  # the lane engine calls lane_step

    eng = FakeEngine(seed=2)
    lane_core = twins(draft_timeout_ms=5.0)[1]
    now = [0.0]
    lane_core.clock = lambda: now[0]
    real = core_mod.lane_step

    def slow(*args, **kwargs):  # every native step appears to take 1 s
        now[0] += 1.0
        return real(*args, **kwargs)

    monkeypatch.setattr(core_mod, "lane_step", slow)
    for _ in range(3):
        eng.add()
    order = list(eng.reqs)
    for step in range(3):
        sampled = []
        for row, rid in enumerate(order):
            seq = eng.reqs[rid]["seq"]
            if step:
                seq.append(eng.reqs[rid]["target"][len(seq)])
            eng.tokens[row, : len(seq)] = seq
            sampled.append([seq[-1]])
        lengths = np.array([len(eng.reqs[r]["seq"]) for r in order] + [0] * (MAX_ROWS - len(order)), np.int32)
        out = lane_core.step(StepBatch(order, sampled, lengths, eng.tokens))
        assert out == [[], [], []] and lane_core.stats.timeouts == step + 1
        assert (lane_core.lane is None) == (step == 2)  # the third overrun leaves the lane
    assert lane_core.guard.drafter.request_ids == {}  # its requests stopped: the Python path restarts them
    out = lane_core.step(StepBatch(order, [[] for _ in order], lengths, eng.tokens))
    assert out == [[], [], []]


def test_force_resync_and_reset_restart_requests_from_their_context():
    eng = FakeEngine(seed=3)
    cores = twins(eng.clock)
    drafts = eng.run(cores, 20)
    rid = next(iter(eng.reqs))
    for core in cores:
        core.force_resync(rid)
    drafts = eng.step(cores, drafts)
    assert cores[0].stats.resyncs == cores[1].stats.resyncs >= 1
    for core in cores:
        core.reset()
    assert cores[1].lane is not None and cores[1].lane.request_ids == {}
    started = [c.stats.started for c in cores]
    drafts = eng.step(cores, drafts)
    assert [c.stats.started - s for c, s in zip(cores, started)] == [len(eng.reqs)] * 2


def lane_core(clock: FakeClock, cls: type = ProposerCore, *, suffix: dict | None = None, **opts) -> ProposerCore:
    """A core of ``cls`` over the native suffix drafter (``suffix``: its options), k = 8, no deadline, with ``opts``
    (user options and internal settings)."""
    user, internal = InternalSettings.split({"num_speculative_tokens": 8, "draft_timeout_ms": 0, **opts})
    options = SpecdecOptions.from_dict(user)
    return cls(
        SuffixDrafter(backend="native", **(suffix or {})),
        options,
        max_model_len=MAX_LEN,
        internal=internal,
        target_params=5e7,
        clock=clock,
    )
