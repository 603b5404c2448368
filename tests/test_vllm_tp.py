"""Schedule mode under tensor parallelism (``modes/tp.py``, ``patches/tp_notes.py``), on the CPU.

Two ranks on vLLM's async timeline (the simulated engine of ``test_vllm_scheduled.py``): the driver drafts as on one
GPU and broadcasts its buffer; the follower drafts nothing and receives it. Every step both ranks must hold the same
drafts (the forward's all-reduces add up one batch), the driver's drafts must be the synchronous twin's, and the
scheduler's slot book, fed from the driver's notes, must grant what the notes say.
"""

from __future__ import annotations

import importlib.util
import pickle
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from patch_support import patch
from specdec.vllm_plugin.attrs import SCHEDULE_WIDTH, SLOT_NOTE_ATTR
from specdec.vllm_plugin.modes.schedule import ScheduledDrafting
from specdec.vllm_plugin.modes.slots import UNKNOWN, book_of
from specdec.vllm_plugin.modes.tp import (
    NoteMaker,
    SlotNote,
    TpFollower,
    schedule_width,
    scheduler_book,
    send_width,
    width_of_schedule,
)
from specdec.vllm_plugin.patches import tp_notes
from specdec.vllm_plugin.patches.features import Feature
from specdec.vllm_plugin.patches.table import RUNNER, SCHEDULER
from test_vllm_scheduled import MAX_ROWS, AsyncEngine, FakeDeviceWait, K, make_core


class Wire:
    """A broadcast between two ranks: the driver's call sends a copy, the follower's call receives it in place."""

    def __init__(self) -> None:
        self.queue: list[torch.Tensor] = []
        self.sent = self.received = 0

    def send(self, t: torch.Tensor) -> None:
        self.queue.append(t.clone())
        self.sent += 1

    def recv(self, t: torch.Tensor) -> None:
        t.copy_(self.queue.pop(0))
        self.received += 1


def two_ranks(tick: Any, **opts: Any) -> tuple[ScheduledDrafting, TpFollower, Wire]:
    wire = Wire()
    driver = ScheduledDrafting(
        make_core(tick, **opts),
        k=K,
        max_rows=2 * MAX_ROWS,
        device="cpu",
        share=wire.send,
        notes=NoteMaker(K, True, -1, lambda: True),
    )
    follower = TpFollower(k=K, max_rows=2 * MAX_ROWS, device="cpu", share=wire.recv)
    return driver, follower, wire


def test_followers_verify_the_drivers_drafts_every_step_and_output_is_lossless():
    clock = SimpleNamespace(t=0.0)
    tick = lambda: clock.t  # noqa: E731
    eng = AsyncEngine(seed=5)
    driver, follower, wire = two_ranks(tick)
    twin = make_core(tick)
    out_d = out_f = None
    zeroed = 40
    for step in range(120):
        if out_d is not None:
            cur_d, cur_f = out_d, out_f
            if step == zeroed:  # vLLM dropped the drafts on every rank (its max_model_len guard): no broadcast
                cur_d, cur_f = torch.zeros_like(out_d), torch.zeros_like(out_f)
            sent = wire.sent
            filled = driver.fill(cur_d)
            assert follower.fill(cur_f) == filled
            assert wire.sent == sent + filled and not wire.queue
            if filled:
                assert torch.equal(out_f, out_d), step  # the follower verifies exactly the driver's drafts
                drafts = eng.twin_step(twin, eng.order)
                assert out_d.numpy().tolist() == eng.expected_buffer(drafts, out_d.shape[0]), step
                eng.prev_drafts = out_d.clone()
            else:
                eng.prev_drafts = None
        clock.t += 1e-3
        out_d = eng.run_step(driver, step)
        sampled_rows = out_d.shape[0]
        out_f = follower.submit(eng.order, k=None, eager=False)  # the follower's runner: same rows, no capture
        assert out_f.shape == (sampled_rows, K)
    for r in eng.reqs.values():
        assert r["seq"] == r["target"][: len(r["seq"])]
    assert wire.sent == wire.received > 100 and follower.skipped == 1
    assert follower.stats()["tp_follower"]["broadcasts_received"] == wire.received


def test_a_follower_fills_with_the_drivers_keywords():
    """The runner patch calls every rank's fill alike (``async_sched.wrap_prepare``): a keyword the driver takes and
    a follower does not would stop TP > 1 at its first step."""
    import inspect

    driver = inspect.signature(ScheduledDrafting.fill).parameters
    follower = inspect.signature(TpFollower.fill).parameters
    assert list(follower) == list(driver)
    assert all(follower[n].default == driver[n].default for n in driver if n not in ("self", "current"))


def test_the_broadcast_is_enqueued_after_the_device_waits_copy():
    """With the device wait the driver's fill only enqueues (the wait, then the copy of the pinned drafts); the
    broadcast must be enqueued after that copy, so the stream sends the drafts, not the buffer's old contents."""
    calls: list[str] = []

    class Wait(FakeDeviceWait):
        def enqueue_copy(self, dst: Any, src: Any) -> int:
            calls.append("copy")
            return super().enqueue_copy(dst, src)

    clock = SimpleNamespace(t=0.0)
    eng = AsyncEngine(seed=2)
    driver = ScheduledDrafting(
        make_core(lambda: clock.t),
        k=K,
        max_rows=2 * MAX_ROWS,
        device="cpu",
        device_wait=Wait(),
        share=lambda t: calls.append("broadcast"),
        notes=NoteMaker(K, True, -1),
    )
    out = eng.run_step(driver, 0)
    assert driver.fill(out) and driver.deferred is not None
    assert calls == ["copy", "broadcast"]
    driver.finish()
    assert driver.deferred is None


def test_driver_notes_feed_the_schedulers_book_without_growth():
    clock = SimpleNamespace(t=0.0)
    eng = AsyncEngine(seed=9)
    driver, follower, _ = two_ranks(lambda: clock.t, pad_drafts="off", min_path_prob=0.3)
    config = SimpleNamespace()
    out = None
    for step in range(40):
        if out is not None:
            driver.fill(out)
            follower.fill(follower.submit(eng.order, k=None, eager=False))
            note = driver.latest_note
            assert isinstance(note, SlotNote) and list(note.req_ids) == eng.order
            assert pickle.loads(pickle.dumps(note)) == note  # it rides on a pickled ModelRunnerOutput
            book = scheduler_book(config, note)
            assert book is book_of(config) and book.growth == 0.0 and book.k == K
            want = {r: min(K, n) for r, n in zip(note.req_ids, note.lengths) if n != UNKNOWN}
            assert book.table == want == book.lengths, step
            assert book.high_ragged is not None and book.high_ragged()  # the driver's graphs are ready
            eng.prev_drafts = out.clone()
        clock.t += 1e-3
        out = eng.run_step(driver, step)
    assert book.notes == 39 and book.mat is not None and book.mat > 1.0


def test_width_of_schedule_is_the_common_slot_count_below_k():
    assert width_of_schedule({"a": [-1] * 4, "b": [-1] * 4}, 8) == 4
    assert width_of_schedule({"a": [-1] * 4, "b": [-1] * 3}, 8) == 0  # per-request slots
    assert width_of_schedule({"a": [-1] * 8, "b": [-1] * 8}, 8) == 0  # k itself: vLLM's uniform batch
    assert width_of_schedule({}, 8) == 0


@dataclass
class FakeOutput:
    req_ids: list[str] = field(default_factory=list)


class FakeAsyncOutput:
    def __init__(self) -> None:
        self._model_runner_output = FakeOutput(["a"])


class FakeProposer:
    specdec_proposer = True

    def __init__(self, note: SlotNote | None) -> None:
        self.scheduled = SimpleNamespace(latest_note=note)


def note(lengths: tuple[int, ...] = (3, UNKNOWN)) -> SlotNote:
    return SlotNote(("a", "b"), lengths, (2, 0), 0.2, K, True, False, -1)


def test_the_runner_patch_sends_each_note_once_and_the_scheduler_patch_reads_it():
    class Runner:
        def __init__(self, drafter: Any) -> None:
            self.drafter = drafter

        def sample_tokens(self, grammar_output: Any) -> Any:
            return FakeAsyncOutput()

    class Scheduler:
        def __init__(self) -> None:
            self.vllm_config = SimpleNamespace()
            self.seen: list[Any] = []

        def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> dict:
            self.seen.append(model_runner_output)
            return {}

    for _ in range(2):  # idempotent
        assert patch(Runner, Feature.TP_SCHEDULE, targets=(RUNNER,)).on(Feature.TP_SCHEDULE)
        assert patch(Scheduler, Feature.TP_SCHEDULE, targets=(SCHEDULER,)).on(Feature.TP_SCHEDULE)
    proposer = FakeProposer(note())
    runner = Runner(proposer)
    first = runner.sample_tokens(None)
    wire = pickle.loads(pickle.dumps(first._model_runner_output))  # vLLM pickles it to the scheduler
    assert getattr(wire, SLOT_NOTE_ATTR) == note() and proposer.scheduled.latest_note is None
    second = runner.sample_tokens(None)
    assert not hasattr(second._model_runner_output, SLOT_NOTE_ATTR)  # each note goes once
    assert not hasattr(Runner(object()).sample_tokens(None)._model_runner_output, SLOT_NOTE_ATTR)  # not ours
    sched = Scheduler()
    assert sched.update_from_output(None, wire) == {} and sched.seen == [wire]
    book = book_of(sched.vllm_config)
    assert book is not None and book.table == {"a": 3}  # "b" had no new token: it keeps k
    sched.update_from_output(None, FakeOutput())  # no note: the book stays
    assert book_of(sched.vllm_config) is book and book.notes == 1


def test_a_broken_note_never_breaks_scheduling(plugin_log):
    class Scheduler:
        vllm_config = None  # takes no book

        def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> str:
            return "ok"

    assert patch(Scheduler, Feature.TP_SCHEDULE, targets=(SCHEDULER,)).on(Feature.TP_SCHEDULE)
    bad = FakeOutput()
    setattr(bad, SLOT_NOTE_ATTR, "not a note")
    assert Scheduler().update_from_output(None, bad) == "ok"
    assert Scheduler().update_from_output(None, bad) == "ok"
    assert sum("slot note" in r.getMessage() for r in plugin_log()) == 1  # logged once


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not importable (scripts/test.sh has vLLM)")
def test_real_vllm_has_what_the_tp_patches_wrap_and_its_output_carries_a_note():
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert tp_notes.runner_problem(GPUModelRunner) == ""
    assert tp_notes.scheduler_problem(AsyncScheduler) == ""
    out = ModelRunnerOutput(req_ids=["a"], req_id_to_index={"a": 0})
    setattr(out, SLOT_NOTE_ATTR, note())
    assert getattr(pickle.loads(pickle.dumps(out)), SLOT_NOTE_ATTR) == note()


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not importable (scripts/test.sh has vLLM)")
def test_real_vllms_scheduler_output_carries_the_schedules_width_to_the_ranks():
    from vllm.v1.core.sched.output import SchedulerOutput

    out = SchedulerOutput.make_empty()
    send_width(out, SimpleNamespace(width=4), enabled=True)
    sent = pickle.loads(pickle.dumps(out))  # vLLM's executor pickles it to every worker
    assert getattr(sent, SCHEDULE_WIDTH) == 4 and schedule_width(sent, 8, enabled=True) == 4


def test_the_drivers_back_off_reaches_the_schedulers_book():
    config = SimpleNamespace()
    book = scheduler_book(config, note())
    assert book is not None and book.low_batch is not None and not book.low_batch()
    low = SlotNote(("a", "b"), (0, 0), (1, 1), 0.2, K, True, False, -1, low=True)
    assert scheduler_book(config, low) is book and book.low_batch()  # the same book follows the latest note


def test_a_followers_counts_of_discarded_rows_never_reuse_a_buffer_still_being_copied():
    """Each step's tokens of discarded rows (partial prefills) go to the device from their own pinned buffer: the
    next step must not overwrite one whose copy may still be pending."""
    follower = TpFollower(k=K, max_rows=4, device="cpu", share=lambda t: None)
    sampled = torch.tensor([[5, -1, -1], [9, 9, -1]], dtype=torch.int32)
    mask = torch.tensor([False, True])
    seen = []
    for step in range(3):
        nxt, counts = follower.counts(sampled, {1: 40 + step}, mask)
        assert nxt.tolist() == [5, 40 + step] and counts.tolist() == [1, 0]
        seen.append(follower.backups[step][:2].tolist())
    assert seen == [[0, 40], [0, 41], [0, 42]]  # three steps, three buffers, none overwritten


ENGINE_CORE_SCRIPT = """
import pickle
import torch
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, SpeculativeConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from specdec.paths import TARGET_MODEL, model_path
from specdec.vllm_plugin.entry.register import register
from specdec.vllm_plugin.attrs import SCHEDULE_WIDTH, SLOT_NOTE_ATTR
from specdec.vllm_plugin.modes.tp import SlotNote

register()  # all an engine-core process of TP > 1 does: it builds no proposer
from vllm.v1.core.sched.async_scheduler import AsyncScheduler

k = 4
cache = CacheConfig(block_size=16, cache_dtype="auto", enable_prefix_caching=False)
cache.num_gpu_blocks = 200
config = VllmConfig(
    model_config=ModelConfig(model=str(model_path(TARGET_MODEL)), max_model_len=512, seed=0),
    scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024, max_model_len=512,
                                     is_encoder_decoder=False),
    cache_config=cache,
    device_config=DeviceConfig("cpu"),
    speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=k, prompt_lookup_max=3,
                                         prompt_lookup_min=2),
)
spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float32)
kv = KVCacheConfig(num_blocks=200, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
sch = AsyncScheduler(vllm_config=config, kv_cache_config=kv, structured_output_manager=StructuredOutputManager(config),
                     block_size=16)
params = SamplingParams(temperature=0.0, max_tokens=32)
for rid in ("a", "b"):
    sch.add_request(Request(request_id=rid, prompt_token_ids=list(range(10, 30)), sampling_params=params,
                            pooling_params=None))
s1 = sch.schedule()  # the prefills
s2 = sch.schedule()  # before any note: vLLM's k slots
out = ModelRunnerOutput(req_ids=["a", "b"], req_id_to_index={"a": 0, "b": 1}, sampled_token_ids=[[7], [8]])
setattr(out, SLOT_NOTE_ATTR, SlotNote(("a", "b"), (0, 2), (1, 1), 0.0, k, False, False, -1))
sch.update_from_output(s1, pickle.loads(pickle.dumps(out)))  # the driver's note, as vLLM's pickle carries it
s3 = sch.schedule()  # re-granted from the note's book
print(sorted(s2.num_scheduled_tokens.items()), sorted(s3.num_scheduled_tokens.items()))
"""


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not importable (scripts/test.sh has vLLM)")
def test_an_engine_core_that_only_loaded_the_plugin_grants_the_drivers_slots():
    """TP > 1 end to end on the scheduler's side: a fresh process that only loads the plugin (vLLM's engine core
    under TP > 1), with vLLM's own AsyncScheduler on the CPU. The driver's slot note arrives pickled on a
    ModelRunnerOutput; the next schedule gives each request 1 + its noted draft length instead of 1 + k."""
    import subprocess
    import sys

    from specdec.paths import TARGET_MODEL, model_path

    if not model_path(TARGET_MODEL).is_dir():
        pytest.skip("the shared target model is not here (SPECDEC_SHARED)")
    run = subprocess.run([sys.executable, "-c", ENGINE_CORE_SCRIPT], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.splitlines()[-1] == "[('a', 5), ('b', 5)] [('a', 1), ('b', 3)]", run.stdout[-2000:]


class OneRequestEngine(AsyncEngine):
    """vLLM's async timeline with one running request at a time (a new one once it finishes): a batch of one."""

    def churn(self, step: int) -> None:
        for rid in [r for r, v in self.reqs.items() if len(v["seq"]) > len(v["target"]) - 30]:
            del self.reqs[rid]
        while not self.reqs:
            self.add()


def _tp_batch_of_one(enabled: bool, steps: int = 300) -> tuple[int, int]:
    """The driver and the scheduler's book over a batch of one: each step the scheduler grants the slots of the
    book (fed by the driver's notes) and sends its width (``send_width``), the driver drafts to the width it reads
    (``schedule_width``). Returns (steps whose draft outgrew the slots the request had, accepted tokens)."""
    clock = SimpleNamespace(t=0.0)
    eng = OneRequestEngine(seed=3)
    driver, _, _ = two_ranks(lambda: clock.t, pad_drafts="off", min_path_prob=0.3)
    config = SimpleNamespace()
    out, grew = None, 0
    for step in range(steps):
        if out is not None:
            book = book_of(config)
            reserved = {r: K for r in eng.order}
            output = SimpleNamespace(scheduled_spec_decode_tokens=None)
            if book is not None:
                book.begin_schedule(len(eng.order))
                reserved = {r: book.slots(r, K) for r in eng.order}
                output.scheduled_spec_decode_tokens = {r: [-1] * n for r, n in reserved.items() if n}
                send_width(output, book, enabled=enabled)
            assert driver.fill(out, width=schedule_width(output, K, enabled=enabled))
            note = driver.latest_note
            scheduler_book(config, note)
            grew += sum(0 < reserved.get(r, K) < n != UNKNOWN for r, n in zip(note.req_ids, note.lengths))
            eng.prev_drafts, eng.slots = out.clone(), reserved
        clock.t += 1e-3
        out = eng.run_step(driver, step)
    for r in eng.reqs.values():
        assert r["seq"] == r["target"][: len(r["seq"])]
    return grew, int(driver.core.stats_dict()["accepted_tokens"])


def test_a_batch_of_one_under_tp_drafts_past_its_last_slots_with_the_schedulers_width():
    """At TP > 1 the driver does not hold the slot book: inferring a narrow width from the grants reads a batch of
    one (every request the same slots) as narrow, so each draft is cut to the slots the request had and its next
    grant is no larger: drafts only shrink (issue 41's TP = 2 batches of one). With the scheduler's own width (0:
    per-request slots) the drafts outgrow the last grant as the suffix match lengthens, and more tokens are accepted."""
    grew_sent, accepted_sent = _tp_batch_of_one(enabled=True)
    grew_inferred, accepted_inferred = _tp_batch_of_one(enabled=False)
    assert grew_inferred == 0  # the ratchet: never a draft longer than the slots it replaced
    assert grew_sent > 10
    assert accepted_sent > 1.2 * accepted_inferred  # measured: 605 against 442 tokens


def test_schedule_width_prefers_the_width_the_scheduler_sent():
    spec = {"a": [-1] * 3}  # one request, three slots: inferred as a narrow width of 3
    book = SimpleNamespace(width=0)
    output = SimpleNamespace(scheduled_spec_decode_tokens=spec)
    assert schedule_width(output, 8, enabled=True) == 3  # nothing sent: inferred from the grants
    send_width(output, book, enabled=True)
    assert getattr(output, SCHEDULE_WIDTH) == 0 and schedule_width(output, 8, enabled=True) == 0
    assert schedule_width(output, 8, enabled=False) == 3  # off: the grants, whatever was sent
    book.width = 4
    send_width(output, book, enabled=True)
    assert schedule_width(output, 8, enabled=True) == 4
    quiet = SimpleNamespace(scheduled_spec_decode_tokens=spec)
    send_width(quiet, book, enabled=False)
    assert not hasattr(quiet, SCHEDULE_WIDTH)
    assert schedule_width(SimpleNamespace(), 8, enabled=True) == 0  # no per-request slots at all
