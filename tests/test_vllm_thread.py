"""async_mode="thread": the native step on the suffix engine's own thread (submit at propose, collect at take).

The threaded core must hand vLLM the same drafts and statistics as the synchronous native step, step for step,
over the fake engine of ``test_vllm_lane.py`` (moving rows, finished and aborted requests, partial prefills, a
context jump). Steps whose drafts never reach vLLM (a late collect, a propose without take) must leave the
bookkeeping consistent: no resyncs, the dropped drafts forgotten, outputs unchanged.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from patch_support import wrap_unchecked
from specdec.config import ConfigError
from specdec.drafters.suffix import SuffixDrafter, native_available
from specdec.vllm_plugin.core.batch import StepBatch
from specdec.vllm_plugin.core.proposer_core import ProposerCore
from specdec.vllm_plugin.entry.options import SpecdecOptions
from specdec.vllm_plugin.modes.thread import ThreadedProposerCore
from specdec.vllm_plugin.patches.features import Feature
from specdec.vllm_plugin.patches.table import PatchReport
from specdec.vllm_plugin.proposer import SpecdecProposer
from test_vllm_lane import MAX_LEN, STAT_KEYS, FakeClock, FakeEngine, lane_core

pytestmark = pytest.mark.skipif(not native_available(), reason="native suffix core not built")


class Submitted:
    """Drives a threaded core through FakeEngine's ``core.step`` calls: submit, then collect."""

    def __init__(self, core: ThreadedProposerCore, *, drop_every: int = 0) -> None:
        self.core, self.drop_every, self.calls, self.dropped = core, drop_every, 0, 0

    def step(self, batch: StepBatch) -> list[list[int]]:
        self.calls += 1
        self.core.submit(batch)
        if self.drop_every and self.calls % self.drop_every == 0:  # vLLM never takes this step's drafts
            self.dropped += 1
            return [[] for _ in batch.sampled]
        return self.core.collect()


class Prepared(Submitted):
    """Also calls ``prepare`` first, as the runner patch does at ``execute_model``: the requests gone since the last
    step (vLLM's ``finished_req_ids``) and the new ones with their prompts (``scheduled_new_reqs``)."""

    def __init__(self, core: ThreadedProposerCore) -> None:
        super().__init__(core)
        self.seen: set[str] = set()

    def step(self, batch: StepBatch) -> list[list[int]]:
        order, tokens, prompts = batch.req_ids, batch.token_ids, batch.num_prompt_tokens
        finished = self.seen - set(order)
        new = [(rid, tokens[row, : prompts[row]].tolist()) for row, rid in enumerate(order) if rid not in self.seen]
        self.seen = set(order)
        self.core.prepare(finished, new)
        return super().step(batch)


def make(cls: type, clock: FakeClock, **opts) -> ProposerCore:
    return lane_core(clock, cls, **opts)


def run(eng: FakeEngine, cores: list, steps: int) -> None:
    drafts: dict[str, list[int]] = {}
    for step in range(steps):
        eng.churn(step)
        if step == 50:  # a context jump (preemption + recompute): the request must resync
            rid = next(iter(eng.reqs))
            eng.reqs[rid]["seq"] += eng.reqs[rid]["target"][len(eng.reqs[rid]["seq"]) :][:5]
        drafts = eng.step(cores, drafts)  # asserts every core's drafts are equal


@pytest.mark.parametrize(
    "opts",
    [
        {},  # adaptive, pad auto
        {"pad_drafts": "on"},
        {"adaptive": False, "min_path_prob": 0.3},
        {"min_path_prob_per_seq": 0.02},
        {"thread_spin_us": 2000.0},  # the drafter's thread and the collecting caller spin instead of sleeping
        {"lane_threads": 4},  # the drafter's thread and 3 helpers share the rows
        {"lane_threads": 8, "pad_drafts": "on", "thread_spin_us": 500.0},  # about as many threads as rows
        {"suffix": {"min_confidence": 0.06}},  # calibrated chains: the lane thread learns as the inline lane does
        {"suffix": {"min_confidence": 0.06}, "lane_threads": 4, "pad_drafts": "on"},
    ],
)
def test_threaded_drafts_and_stats_equal_the_synchronous_native_step(opts):
    eng = FakeEngine(seed=1)
    sync = make(ProposerCore, eng.clock, **opts)
    threaded = make(ThreadedProposerCore, eng.clock, **opts)
    assert sync.lane is not None and threaded.lane is not None
    run(eng, [sync, Submitted(threaded)], 160)
    a, b = sync.stats_dict(), threaded.stats_dict()
    for key in STAT_KEYS:
        assert a[key] == b[key], key
    assert a["resyncs"] >= 1 and a["stopped"] > 5 and a["drafted_tokens"] > 100 and a["accepted_tokens"] > 50
    assert a["active_requests"] == b["active_requests"]
    gs, gt = sync.guard.drafter.global_stats(), threaded.guard.drafter.global_stats()
    assert gs["cached_requests"] == gt["cached_requests"] > 5 and gs["nodes"] == gt["nodes"]
    timing = b["thread_timing_us"]
    assert sum(t["steps"] for t in timing.values()) == b["steps"]  # every step collected
    assert all(t["run_us"] > 0 and min(t["wait_us"], t["window_us"], t["wake_us"]) >= 0 for t in timing.values())


@pytest.mark.parametrize(
    "opts",
    [
        {},
        {"pad_drafts": "on", "thread_spin_us": 500.0, "lane_threads": 3},
        {"suffix": {"min_confidence": 0.06}, "lane_threads": 3},
    ],
)
def test_early_stops_and_starts_leave_drafts_and_stats_unchanged(opts):
    eng = FakeEngine(seed=7)
    sync = make(ProposerCore, eng.clock, **opts)
    threaded = make(ThreadedProposerCore, eng.clock, **opts)
    run(eng, [sync, Prepared(threaded)], 160)
    a, b = sync.stats_dict(), threaded.stats_dict()
    for key in STAT_KEYS:
        assert a[key] == b[key], key
    assert a["started"] > 10 and a["stopped"] > 5 and a["resyncs"] >= 1
    assert sync.guard.drafter.global_stats() == threaded.guard.drafter.global_stats()


def test_drafts_vllm_never_took_are_forgotten_without_resyncs():
    eng = FakeEngine(seed=4)
    core = make(ThreadedProposerCore, eng.clock, adaptive=False, pad_drafts="on")
    shim = Submitted(core, drop_every=3)
    eng.run([shim], 90)  # FakeEngine verifies against the target: outputs stay exact
    s = core.stats_dict()
    assert shim.dropped == 30 and s["resyncs"] == 0 and s["timeouts"] == 0
    assert s["accepted_tokens"] > 100  # drafting went on between the dropped steps
    assert s["accepted_tokens"] <= s["drafted_tokens"]


def test_a_late_step_gets_no_drafts_and_the_third_goes_synchronous(monkeypatch):
    eng = FakeEngine(seed=5)
    core = make(ThreadedProposerCore, eng.clock, draft_timeout_ms=5.0, adaptive=False)
    lane = core.lane
    real = lane.lane_collect
    late = {"n": 0}

    def collect(timeout_s):  # steps 10, 11, 12 come back "still running"; the others wait (no wall-clock deadline)
        late["n"] += 1
        return None if 10 <= late["n"] <= 12 else real(None)

    monkeypatch.setattr(lane, "lane_collect", collect)
    drafts: dict[str, list[int]] = {}
    shim = Submitted(core)
    for step in range(40):
        eng.churn(step)
        drafts = eng.step([shim], drafts)
        if step in (9, 10, 11):
            assert all(not d for d in drafts.values())
        if step == 11:  # the Python path's own deadline is wall-clock: only the lane's three are counted here
            assert core.stats.timeouts == 3 and core.lane is None
    s = core.stats_dict()
    assert not s["native_step"]
    assert s["drafted_tokens"] > 0 and s["accepted_tokens"] > 0  # the Python path took over and drafts


def test_a_step_submitted_before_python_work_is_collected_after_it():
    """vLLM's order: submit, then the scheduler's Python (holding the GIL), then collect."""
    core = make(ThreadedProposerCore, FakeClock(), adaptive=False, pad_drafts="on")
    ctx = np.tile(np.arange(400, dtype=np.int32) % 37, (4, 1))  # [rows, len] repetitive contexts
    rows = [f"q{i}" for i in range(4)]
    core.submit(StepBatch(rows, [[int(ctx[i, 299])] for i in range(4)], np.full(4, 300, np.int32), ctx))
    spins = 0
    deadline = time.perf_counter() + 0.02
    while time.perf_counter() < deadline:  # pure Python on this thread, like update_from_output
        spins += 1
    drafts = core.collect()
    assert [len(d) for d in drafts] == [8] * 4 and spins > 0
    assert drafts[0][:4] == [int(t) for t in ctx[0, 300:304]]  # the repetition continues
    assert core.stats.started == 4


def test_bad_token_buffer_is_an_error_naming_it_and_the_proposer_goes_on(caplog):
    cfg = SimpleNamespace(
        additional_config={
            "specdec": {
                "drafter": "suffix",
                "async": True,
                "async_mode": "thread",
                "draft_timeout_ms": 0,
                "adaptive": False,
            }
        },
        speculative_config=SimpleNamespace(num_speculative_tokens=4),
        model_config=SimpleNamespace(max_model_len=64),
    )
    prop = SpecdecProposer(cfg, patch_runner=False)
    assert isinstance(prop.core, ThreadedProposerCore) and prop.threaded
    prop.bind_step(SimpleNamespace(req_ids=["a"], num_prompt_tokens=None))
    flat = np.arange(10, dtype=np.int32)  # 1-D: not vLLM's [rows, max_model_len] buffer
    with pytest.raises(ValueError, match="token_ids must be a 2-D"):
        prop.core.submit(StepBatch(["a"], [[9]], np.array([10], np.int32), flat))
    assert prop.propose([[9]], np.array([10], np.int32), flat) == [[]]  # counted, no exception
    assert prop.core.guard.stats.errors == 1
    good = np.tile(np.arange(64, dtype=np.int32) % 5, (1, 1))
    drafts = prop.propose([[int(good[0, 9])]], np.array([10], np.int32), good)
    assert prop.collect_deferred() is None  # no take hook here: propose collected its own step
    assert drafts == [good[0, 10:14].tolist()]  # a repetitive context drafts its continuation


def test_threads_mode_is_validated_and_other_drafters_draft_synchronously():
    with pytest.raises(ConfigError, match="async_mode.*'threads'|'threads'.*async_mode"):
        SpecdecOptions.from_dict({"async_drafting": True, "async_mode": "threads"})
    with pytest.raises(ConfigError, match="lane_threads"):
        SpecdecOptions.from_dict({"lane_threads": -1})
    with pytest.raises(ValueError, match=r"lane_threads: 65 is outside \[1, 64\]"):
        SuffixDrafter(backend="native").lane_threads(65)
    core = ThreadedProposerCore(
        SuffixDrafter(backend="python"), SpecdecOptions.from_dict({"adaptive": False}), max_model_len=MAX_LEN
    )
    assert core.lane is None
    ctx = np.tile(np.arange(64, dtype=np.int32) % 7, (1, 1))
    core.submit(StepBatch(["a"], [[int(ctx[0, 29])]], np.array([30], np.int32), ctx))
    assert core.collect()[0][:3] == ctx[0, 30:33].tolist() and core.collect() is None
    assert threading.active_count() >= 1


def test_the_runner_patch_prepares_each_step_from_the_scheduler_output():
    cfg = SimpleNamespace(
        additional_config={
            "specdec": {"async": True, "async_mode": "thread", "adaptive": False, "draft_timeout_ms": 0}
        },
        speculative_config=SimpleNamespace(num_speculative_tokens=4),
        model_config=SimpleNamespace(max_model_len=64),
    )
    prop = SpecdecProposer(cfg, patch_runner=False)

    class Runner:  # shaped like GPUModelRunner.execute_model
        drafter = prop

        def execute_model(self, scheduler_output, intermediate_tensors=None):
            return "ran"

    assert wrap_unchecked(Runner, Feature.THREAD_HAND_OFF) == 1  # execute_model (no take_draft_token_ids here)
    first = Runner.execute_model
    assert wrap_unchecked(Runner, Feature.THREAD_HAND_OFF) == 1 and Runner.execute_model is first  # idempotent
    new = [
        SimpleNamespace(req_id="a", prompt_token_ids=[1, 2, 3, 1, 2]),
        SimpleNamespace(req_id="e", prompt_token_ids=None),
    ]  # prompt embeddings: started later, from context
    assert Runner().execute_model(SimpleNamespace(scheduled_new_reqs=new, finished_req_ids=set())) == "ran"
    assert prop.core.stats.started == 1 and set(prop.core.lane.request_ids) == {"a"}
    prop.bind_step(SimpleNamespace(req_ids=["a"], num_prompt_tokens=np.array([5])))
    ctx = np.array([[1, 2, 3, 1, 2, 3] + [0] * 10], np.int32)
    assert prop.propose([[3]], np.array([6], np.int32), ctx)[0][:3] == [1, 2, 3]  # extended, not restarted
    assert prop.core.stats.started == 1 and prop.core.stats.resyncs == 0
    Runner().execute_model(SimpleNamespace(scheduled_new_reqs=[], finished_req_ids={"a", "never-seen"}))
    assert prop.core.stats.stopped == 1 and prop.core.lane.request_ids == {}


def test_a_failed_step_is_counted_and_the_proposer_starts_over(monkeypatch):
    cfg = SimpleNamespace(
        additional_config={"specdec": {"adaptive": False, "draft_timeout_ms": 0}},  # async thread: the default
        speculative_config=SimpleNamespace(num_speculative_tokens=4),
        model_config=SimpleNamespace(max_model_len=64),
    )
    prop = SpecdecProposer(
        cfg,
        patch_runner=False,
        patches=PatchReport("test", {"thread hand-off: GPUModelRunner.take_draft_token_ids": ""}),
    )
    assert prop.threaded  # with the take hook: drafts are collected at take
    ctx = np.tile(np.arange(64, dtype=np.int32) % 5, (1, 1))
    prop.bind_step(SimpleNamespace(req_ids=["a"], num_prompt_tokens=None))
    assert prop.propose([[int(ctx[0, 9])]], np.array([10], np.int32), ctx) == [[]]  # placeholder
    lane = prop.core.lane

    def broken(timeout_s):
        raise RuntimeError("lane step failed: injected")

    monkeypatch.setattr(lane, "lane_collect", broken)
    assert prop.collect_deferred() is None  # take keeps the placeholders: no drafts, no exception
    assert prop.core.guard.stats.errors == 1 and lane.request_ids == {}  # state forgotten
    monkeypatch.undo()
    prop.drafting.hand_off = False  # as without the take hook: propose collects its own drafts
    assert prop.propose([[int(ctx[0, 10])]], np.array([11], np.int32), ctx) == [ctx[0, 11:15].tolist()]
    assert set(lane.request_ids) == {"a"} and prop.core.stats.resyncs == 0  # restarted from its context
