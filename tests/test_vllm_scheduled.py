"""Drafting under vLLM's async scheduling (``async_mode="schedule"``), on the CPU with a simulated engine.

The fake engine runs vLLM's async timeline: step N's sampled tokens ([rows, k+1], -1 = rejected) are captured
after sampling, vLLM gets an unfilled draft buffer at once, and the buffer is filled only when step N+1 prepares
its inputs; step N+1 then verifies exactly those drafts (the previous step's row order), greedily, against fixed
target sequences. Host-side vLLM state holds placeholders (-1) for outputs, as under async scheduling.
A synchronous ``ProposerCore`` twin is fed the true rows (real tokens, lengths, contexts) at the same moments:
its drafts, padded to k, must equal the filled buffer row for row, every step (rows move, requests join, finish,
pause and come back, partial prefills are discarded, one step's buffer is replaced by vLLM's zeros).
"""

from __future__ import annotations

import importlib.util
import random
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from benchmarks.bench_schedule_cpu import HostWait
from benchmarks.vllm_cpu_engine import LLAMA_8B_HF
from core_support import target_sequence
from patch_support import patch
from specdec.drafters.suffix import SuffixDrafter
from specdec.vllm_plugin.core.batch import StepBatch
from specdec.vllm_plugin.core.proposer_core import ProposerCore
from specdec.vllm_plugin.entry.options import SpecdecOptions
from specdec.vllm_plugin.internal import InternalSettings
from specdec.vllm_plugin.modes.feed import TokenFeed, pad_rows, valid_counts
from specdec.vllm_plugin.modes.schedule import ScheduledDrafting
from specdec.vllm_plugin.patches.features import Feature
from specdec.vllm_plugin.patches.table import RUNNER

K = 6
MAX_ROWS = 12
MAX_LEN = 4096
ADAPTIVE = Feature.ADAPTIVE_SLOTS
SLOTS = (Feature.SLOT_REGRANT, ADAPTIVE)  # the slot patches of AsyncScheduler
VOCAB = 100


def test_valid_counts_next_token_and_discarded_rows():
    sampled = torch.tensor([[5, 6, -1, -1], [7, -1, -1, -1], [1, 2, 3, 4], [9, 9, 9, -1]], dtype=torch.int32)
    mask = torch.tensor([False, False, False, True])
    backup = torch.tensor([0, 0, 0, 42], dtype=torch.int32)
    nxt, counts = valid_counts(sampled, mask, backup, vocab_size=VOCAB)
    assert counts.tolist() == [2, 1, 4, 0] and counts.dtype == torch.int32
    assert nxt.tolist() == [6, 7, 4, 42] and nxt.dtype == torch.int32
    assert valid_counts(sampled)[0].tolist() == [6, 7, 4, 9]  # no discarded rows
    big = torch.tensor([[5, VOCAB + 3, -1]], dtype=torch.int32)  # out-of-vocabulary ids are not tokens
    assert valid_counts(big, vocab_size=VOCAB)[1].tolist() == [1]
    sched = ScheduledDrafting(make_core(lambda: 0.0), k=K, max_rows=4, device="cpu")
    nxt, counts = sched.counts(sampled, {3: 42}, mask)  # the runner hook's path: backups from the slot's buffer
    assert nxt.tolist() == [6, 7, 4, 42] and counts.tolist() == [2, 1, 4, 0]


def test_pad_rows_fills_each_row_to_k_with_its_filler():
    out = np.full((3, 4), -7, dtype=np.int32)
    pad_rows([[1, 2], [], [3, 4, 5, 6, 7]], out, [9, 8, 0])
    assert out.tolist() == [[1, 2, 9, 9], [8, 8, 8, 8], [3, 4, 5, 6]]


def test_token_feed_history_pending_discard_blind_and_returning():
    feed = TokenFeed()
    feed.admit("a", [1, 2, 3], [], returning=False)
    feed.admit("b", [4], [7, -1], returning=False)  # mid-generation with placeholders: nothing real to start from
    feed.admit("c", None, [], returning=False)  # prompt embeddings: no token ids
    assert feed.blind == {"b", "c"} and feed.stats.blind_requests == 2
    feed.add(["a", "b"], np.array([[10, 11, -1], [5, 5, 5]]), discard=set())
    feed.add(["a"], np.array([[12, -1, -1]]), discard=set())
    feed.add(["a"], np.array([[99, 99, 99]]), discard={0})  # a partial prefill: its row is garbage
    rows = feed.rows(["b", "a"])
    assert (
        rows.sampled == [[], [10, 11, 12]] and rows.lengths.tolist() == [0, 6] and rows.prompt_lens.tolist() == [0, 3]
    )
    assert rows.contexts[1, :6].tolist() == [1, 2, 3, 10, 11, 12]
    assert feed.rows(["a"]).sampled == [[]]  # handed out once
    feed.admit("a", [1, 2, 3], [10, 11, -1], returning=True)  # back with placeholders: our history stands
    assert feed.history["a"] == [1, 2, 3, 10, 11, 12]
    feed.admit("a", [1, 2, 3], [10, 11, 12, 13], returning=True)  # back with vLLM's full record: it wins
    assert feed.history["a"] == [1, 2, 3, 10, 11, 12, 13] and feed.pending["a"] == []


class AsyncEngine:
    """vLLM's async timeline over fake requests (see the module docstring)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.reqs: dict[str, dict] = {}
        self.paused: dict[str, dict] = {}
        self.state: dict[str, SimpleNamespace] = {}  # what the runner's ``requests`` holds
        self.next_id = 0
        self.order: list[str] = []  # previous step's rows
        self.prev_drafts: torch.Tensor | None = None  # [prev rows, K] as vLLM reads them
        self.unseen: dict[str, list[int]] = {}  # tokens the synchronous twin has not been given yet
        self.slots: dict[str, int] | None = None  # per-request draft slots of the step (None: K for every row)

    def add(self) -> None:
        rid = f"r{self.next_id}"
        target = target_sequence(self.next_id, 500)
        p = self.rng.randint(20, 100)
        self.reqs[rid] = {"seq": target[:p], "target": target, "prompt": p, "prefill": self.rng.random() < 0.3}
        self.state[rid] = SimpleNamespace(prompt_token_ids=target[:p], output_token_ids=[])
        self.next_id += 1

    def churn(self, step: int) -> None:
        for rid in [r for r, v in self.reqs.items() if len(v["seq"]) > len(v["target"]) - 30]:
            del self.reqs[rid]
        if step % 9 == 4 and self.reqs:  # paused (not scheduled) for a few steps, then back
            rid = self.rng.choice(list(self.reqs))
            self.paused[rid] = self.reqs.pop(rid)
        if step % 9 == 7:
            self.reqs.update(self.paused)
            self.paused.clear()
        while len(self.reqs) < MAX_ROWS - self.rng.randint(0, 3):
            self.add()

    def verify(self) -> tuple[list[str], torch.Tensor, set[int], list[list[int]]]:
        order = list(self.reqs)
        self.rng.shuffle(order)
        prev_row = {rid: i for i, rid in enumerate(self.order)}
        sampled = torch.full((len(order), K + 1), -1, dtype=torch.int32)
        discard: set[int] = set()
        emitted: list[list[int]] = []
        for row, rid in enumerate(order):
            r = self.reqs[rid]
            if r["prefill"]:
                r["prefill"] = False
                discard.add(row)
                sampled[row] = torch.randint(0, VOCAB, (K + 1,), dtype=torch.int32)  # garbage
                emitted.append([])
                continue
            i = prev_row.get(rid)
            draft = self.prev_drafts[i].tolist() if (i is not None and self.prev_drafts is not None) else []
            if self.slots is not None:  # vLLM reads the first slots of the row only
                draft = draft[: self.slots.get(rid, K)]
            out: list[int] = []
            for d in draft + [None]:
                want = r["target"][len(r["seq"])]
                out.append(want)
                r["seq"].append(want)
                if d != want:
                    break
            sampled[row, : len(out)] = torch.tensor(out, dtype=torch.int32)
            emitted.append(out)
            self.unseen.setdefault(rid, []).extend(out)
        self.order = order
        return order, sampled, discard, emitted

    def bookkeep(self, order: list[str], discard: set[int]) -> None:
        """vLLM's async bookkeeping (after the capture): one placeholder per decoding row."""
        for row, rid in enumerate(order):
            if row not in discard:
                self.state[rid].output_token_ids.append(-1)

    def expected_buffer(self, drafts: list[list[int]], rows: int) -> list[list[int]]:
        """The draft buffer [rows, K] a fill must write for the twin's ``drafts`` (each row padded with its last
        token)."""
        want = np.zeros((rows, K), np.int32)
        pad_rows(drafts, want, [self.reqs[r]["seq"][-1] for r in self.order])
        return want.tolist()

    def run_step(self, sched: ScheduledDrafting, step: int) -> torch.Tensor:
        """One step on vLLM's async timeline: churn, verify (no row more than 1 + its slots), capture, bookkeeping,
        and the next step's submit. Returns the submitted draft buffer."""
        self.churn(step)
        order, sampled, discard, emitted = self.verify()
        for row, rid in enumerate(order):
            if self.slots is not None and row not in discard:
                assert len(emitted[row]) <= 1 + self.slots.get(rid, K)
        sched.capture(sampled, order, discard, requests=self.state)
        self.bookkeep(order, discard)
        return sched.submit(order, k=None, eager=False)

    def twin_step(self, core: ProposerCore, order: list[str], **kw: Any) -> list[list[int]]:
        tokens = np.zeros((len(order), MAX_LEN), np.int32)
        lengths, prompts, sampled = np.zeros(len(order), np.int64), np.zeros(len(order), np.int64), []
        for row, rid in enumerate(order):
            r = self.reqs[rid]
            tokens[row, : len(r["seq"])] = r["seq"]
            lengths[row], prompts[row] = len(r["seq"]), r["prompt"]
            sampled.append(self.unseen.pop(rid, []))
        k = kw.pop("k", None)
        return core.step(StepBatch(order, sampled, lengths, tokens, prompts, k), **kw)


def make_core(clock, **opts) -> ProposerCore:
    """A core on the fake ``clock``, with no drafting deadline: the Python engine's deadline thread waits on the
    real clock, and a slow first job on a loaded machine would drop one core's drafts but not its twin's."""
    user, internal = InternalSettings.split(
        {"num_speculative_tokens": K, "pad_drafts": "on", "draft_timeout_ms": 0, **opts}
    )
    options = SpecdecOptions.from_dict(user)
    return ProposerCore(
        SuffixDrafter(), options, max_model_len=MAX_LEN, internal=internal, target_params=5e7, clock=clock
    )


class FakeDeviceWait(HostWait):
    """The GPU's wait on the CPU (the CPU bench's ``HostWait``: ``enqueue_copy`` queues the copy, ``release``
    performs it, as the stream would once the word reaches seq), recording the releases; ``fires`` stands for the
    watchdog's releases."""

    def __init__(self) -> None:
        super().__init__()
        self.fires = 0
        self.stall_count = 0
        self.released: list[int] = []

    def release(self, seq: int) -> None:
        super().release(seq)
        self.released.append(seq)

    def fired(self) -> int:
        return self.fires

    def stalls(self) -> int:
        return self.stall_count


@pytest.mark.parametrize(
    ("opts", "device_wait"),
    [
        ({}, False),
        ({"adaptive": False}, False),
        ({"native_step": False}, False),
        ({}, True),
        ({"native_step": False}, True),
        ({"matrix_step": False}, False),
        ({"matrix_step": False}, True),
    ],
)
def test_scheduled_drafts_equal_a_synchronous_twin_and_output_is_lossless(opts, device_wait):
    clock = SimpleNamespace(t=0.0)
    tick = lambda: clock.t  # noqa: E731
    eng = AsyncEngine(seed=3)
    dw = FakeDeviceWait() if device_wait else None
    sched = ScheduledDrafting(
        make_core(tick, **opts),
        k=K,
        max_rows=2 * MAX_ROWS,
        device="cpu",
        device_wait=dw,
    )
    twin = make_core(tick, **opts)  # the synchronous reference
    stolen = torch.zeros((2 * MAX_ROWS, K), dtype=torch.int32)
    out = None
    for step in range(150):
        if out is not None:  # step N+1 prepares its inputs: the buffer from step N is filled now
            current = stolen[: out.shape[0]] if step == 60 else out  # step 60: vLLM zeroed the drafts
            before = out.clone()
            filled = sched.fill(current)
            if filled and dw is not None:  # the stream waits: nothing copied before finish() (the forward)
                assert torch.equal(out, before) and sched.deferred is not None and dw.pending
                before_finish = sched.core.stats_dict()  # finished requests stopped, new ones started at fill
                sched.finish()  # the forward's launch
                after = sched.core.stats_dict()
                assert after["stopped"] == before_finish["stopped"]
                if opts.get("native_step", True):  # the native lane: no row restarts in finish either
                    assert after["started"] == before_finish["started"] and after["resyncs"] == before_finish["resyncs"]
                assert sched.deferred is None and not dw.pending and dw.released[-1] == dw.seq
            if filled:
                drafts = eng.twin_step(twin, eng.order)
                assert out.numpy().tolist() == eng.expected_buffer(drafts, out.shape[0]), step
                eng.prev_drafts = out.clone()
            else:
                eng.prev_drafts = None  # vLLM verifies zeros: nothing accepted
        clock.t += 1e-3
        out = eng.run_step(sched, step)
    for r in eng.reqs.values():  # lossless: every emitted token is the target's
        assert r["seq"] == r["target"][: len(r["seq"])]
    full = sched.stats()
    st = full["schedule"]
    sched.close()
    assert st["skipped_fills"] == 1 and st["fills"] >= 140 and full["draft_errors"] == 0 and st["blind_requests"] == 0
    assert st["deferred_fills"] == (st["fills"] if device_wait else 0) and st["watchdog_releases"] == 0
    if opts.get("native_step", True) and opts.get("matrix_step", True):  # the usual step: one native call
        assert st["matrix_steps"] > 0.8 * st["fills"]
    else:
        assert st["matrix_steps"] == 0
    stats = sched.core.stats_dict()
    assert stats["accepted_tokens"] > 200 and stats["stopped"] > 5 and stats["started"] > 5


def crash_drafting(core: ProposerCore) -> Callable[[], None]:
    """Make both of the core's drafting calls (rows, token matrix) raise; returns the function that undoes it."""
    real = core.step, core.step_tokens

    def boom(*args, **kwargs):
        raise RuntimeError("drafter crashed")

    core.step = core.step_tokens = boom

    def restore() -> None:
        core.step, core.step_tokens = real

    return restore


def test_eager_fill_and_a_failing_drafter_never_stop_generation():
    clock = SimpleNamespace(t=0.0)
    eng = AsyncEngine(seed=5)
    core = make_core(lambda: clock.t, strict=False)
    sched = ScheduledDrafting(core, k=K, max_rows=MAX_ROWS, device="cpu")
    eng.churn(0)
    order, sampled, discard, _ = eng.verify()
    sched.capture(sampled, order, discard, requests=eng.state)
    out = sched.submit(order, k=None, eager=True)  # structured output / penalties: filled at once
    assert sched.job is None and sched.stats()["schedule"]["eager_fills"] == 1

    crash_drafting(core)
    eng.prev_drafts = out.clone()
    order, sampled, discard, _ = eng.verify()
    sched.capture(sampled, order, discard, requests=eng.state)
    out = sched.submit(order, k=None, eager=False)
    assert sched.fill(out)
    assert sched.stats()["draft_errors"] == 1
    last = [eng.reqs[r]["seq"][-1] for r in order]
    assert out[:, 0].tolist() == last  # filler only: no speculation this step, generation goes on


def test_device_wait_always_releases_and_the_watchdog_switches_it_off():
    clock = SimpleNamespace(t=0.0)
    eng = AsyncEngine(seed=7)
    core = make_core(lambda: clock.t, strict=False)
    dw = FakeDeviceWait()
    sched = ScheduledDrafting(core, k=K, max_rows=MAX_ROWS, device="cpu", device_wait=dw)
    eng.churn(0)

    def step(eager: bool = False) -> torch.Tensor:
        order, sampled, discard, _ = eng.verify()
        sched.capture(sampled, order, discard, requests=eng.state)
        return sched.submit(order, k=None, eager=eager)

    out = step(eager=True)  # vLLM reads these drafts on the host right away: never deferred
    assert sched.deferred is None and not dw.pending and sched.stats()["schedule"]["eager_fills"] == 1
    restore = crash_drafting(core)
    out = step()
    assert sched.fill(out) and sched.deferred is not None
    sched.finish()  # the drafter failed: the stream is released all the same, with filler drafts
    assert dw.released == [1] and sched.stats()["draft_errors"] == 1
    assert out[:, 0].tolist() == [eng.reqs[r]["seq"][-1] for r in eng.order]
    restore()
    out = step()
    assert sched.fill(out)
    assert sched.fill(out) is False and dw.released == [1, 2]  # a second fill first releases the pending one
    for fires in (1, 3):  # the watchdog released steps: counted; at WATCHDOG_LIMIT the host fills from then on
        dw.fires = fires
        out = step()
        assert sched.fill(out) and sched.deferred is not None
        sched.finish()
    st = sched.stats()["schedule"]
    assert st["watchdog_releases"] == 3 and sched.device_wait is None
    out = step()
    assert sched.fill(out) and sched.deferred is None and not dw.pending  # host fill: drafted at once
    broken = FakeDeviceWait()
    broken.enqueue_copy = lambda dst, src: (_ for _ in ()).throw(RuntimeError("cuStreamWaitValue32 failed"))
    sched.device_wait = broken
    out = step()
    assert sched.fill(out) and sched.deferred is None and sched.device_wait is None  # refused: host fill, for good


def test_whitelist_patch_adds_custom_class_for_our_schedule_mode_only():
    from typing import Literal, get_args

    from specdec.vllm_plugin.entry.options import PROPOSER_PATH
    from specdec.vllm_plugin.patches.async_sched import whitelist_problem, wrap_post_init
    from specdec.vllm_plugin.patches.common import wrap_method

    module = SimpleNamespace(NgramGPUTypes=Literal["ngram_gpu"])
    seen: list[tuple] = []

    llama8b = LLAMA_8B_HF
    small = SimpleNamespace(
        hidden_size=640, num_hidden_layers=10, intermediate_size=1728, num_attention_heads=10, vocab_size=32000
    )

    class VllmConfig:
        def __init__(self, spec: dict | None, tp: int = 1, hf: SimpleNamespace | None = None, pp: int = 1) -> None:
            self.speculative_config = SimpleNamespace(method="custom_class", model=PROPOSER_PATH)
            self.additional_config = {"specdec": spec} if spec is not None else {}
            self.parallel_config = SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp)
            self.model_config = SimpleNamespace(hf_config=hf)
            self.__post_init__()

        def __post_init__(self) -> None:  # the whitelist test as vLLM writes it: get_args(NgramGPUTypes)
            allowed = self.speculative_config.method in get_args(module.NgramGPUTypes)
            seen.append((allowed, get_args(module.NgramGPUTypes)))

    module.VllmConfig = VllmConfig
    tp_problem = [""]
    assert whitelist_problem(module) == ""
    for _ in range(2):  # idempotent
        wrap = lambda orig: wrap_post_init(orig, module, tp_problem=lambda: tp_problem[0])  # noqa: E731
        assert wrap_method(VllmConfig, "__post_init__", Feature.SCHEDULE.label, wrap)
    VllmConfig({"async": True, "async_mode": "schedule"})
    VllmConfig({"async": True, "async_mode": "thread"})  # thread mode: vLLM's rule stands
    VllmConfig({"async_drafting": True, "async_mode": "schedule"}, tp=2)  # TP > 1: rank 0 drafts, broadcasts
    VllmConfig({"async_drafting": True, "async_mode": "schedule"}, pp=2)  # PP > 1: refused, synchronous
    VllmConfig(None)
    VllmConfig({}, hf=llama8b)  # async_mode "auto" (default) on an 8B target: schedule mode
    VllmConfig({}, hf=small)  # ... on the 53M target: thread mode
    VllmConfig({}, hf=llama8b, tp=2)  # ... on two GPUs: schedule mode
    VllmConfig({}, hf=small, tp=2)  # ... the 53M target on two GPUs too
    VllmConfig({"async": False}, hf=llama8b)  # the synchronous path
    tp_problem[0] = "update_from_output is missing"
    VllmConfig({}, hf=llama8b, tp=2)  # the slot notes cannot apply: TP > 1 refused
    VllmConfig({}, hf=llama8b)  # ... one GPU unaffected
    assert [a for a, _ in seen] == [True, False, True, False, False, True, False, True, True, False, False, True]
    assert get_args(module.NgramGPUTypes) == ("ngram_gpu",)  # restored after the call


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not importable (scripts/test.sh has vLLM)")
def test_real_vllm_has_the_hooks_and_the_whitelist_this_mode_patches():
    import inspect

    import vllm.config.vllm as module
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from specdec.vllm_plugin.patches.async_sched import (
        RUNNER_METHODS,
        WHITELIST_SOURCE,
        async_runner_problem,
        whitelist_problem,
    )

    assert async_runner_problem(GPUModelRunner) == "" and whitelist_problem(module) == ""
    assert all(callable(getattr(GPUModelRunner, name, None)) for name in RUNNER_METHODS)
    assert WHITELIST_SOURCE in inspect.getsource(module.VllmConfig.__post_init__)
    src = inspect.getsource(GPUModelRunner._prepare_input_ids)
    assert "self._draft_token_ids" in src  # the drafts are read there, after our fill


class FakeRunner:
    """The slice of vLLM's GPUModelRunner the schedule-mode hooks touch (same method signatures)."""

    def __init__(self, drafter, *, use_async: bool = True) -> None:
        self.drafter, self.use_async_scheduling = drafter, use_async
        self.speculative_config = SimpleNamespace(method="custom_class")
        self.max_num_reqs, self.device, self.num_spec_tokens = 4, "cpu", K
        pattern = [1, 2, 3, 4, 5] * 8
        self.requests = {
            r: SimpleNamespace(
                prompt_token_ids=list(pattern), output_token_ids=[], get_token_id=lambda i: pattern[i % 5]
            )
            for r in ("a", "b")
        }
        self.input_batch = SimpleNamespace(
            req_ids=["a", "b"],
            num_tokens_no_spec=np.array([40, 40]),
            vocab_size=100,
            sampling_metadata=SimpleNamespace(output_token_ids=[]),
        )
        self.discard_request_mask = SimpleNamespace(np=np.zeros(4, dtype=bool), gpu=torch.zeros(4, dtype=torch.bool))
        self._draft_token_ids = None
        self.calls: list = []

    def _bookkeeping_sync(self, scheduler_output, sampler_output, logits=None, hidden_states=None, n=0):
        self.calls.append("bookkeeping")

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *rest):
        self.calls.append("propose")
        return [[9], [9]]

    def _prepare_input_ids(self, scheduler_output, num_reqs=0, total=0, cu=None):
        drafts = self._draft_token_ids
        self.calls.append(("prepare", drafts.tolist() if torch.is_tensor(drafts) else drafts))

    def _copy_valid_sampled_token_count(self, next_token_ids, counts):
        self.calls.append(("counts", next_token_ids.tolist(), counts.tolist()))

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        self._prepare_input_ids(scheduler_output, 2, 0, None)
        if getattr(scheduler_output, "fail", False):
            raise RuntimeError("vLLM failed after preparing the inputs")
        self._model_forward()
        self.calls.append("execute")

    def _model_forward(self, input_ids=None, positions=None):
        dw = getattr(getattr(self.drafter, "scheduled", None), "device_wait", None)
        self.calls.append(("forward", list(dw.released) if dw is not None else None))


def test_runner_hooks_count_capture_hand_out_and_fill_the_drafts():
    from specdec.vllm_plugin.proposer import SpecdecProposer

    cfg = SimpleNamespace(
        additional_config={"specdec": {"async": True, "async_mode": "schedule", "adaptive": False}},
        speculative_config=SimpleNamespace(num_speculative_tokens=K),
        model_config=SimpleNamespace(max_model_len=512),
    )
    assert patch(FakeRunner, Feature.SCHEDULE, targets=(RUNNER,)).on(Feature.SCHEDULE)
    first = FakeRunner._bookkeeping_sync
    assert patch(FakeRunner, Feature.SCHEDULE, targets=(RUNNER,)).on(Feature.SCHEDULE)
    assert FakeRunner._bookkeeping_sync is first  # idempotent
    prop = SpecdecProposer(cfg, patch_runner=False)
    assert prop.schedule_mode and prop.core.options.pad_mode == "auto"
    uniform = SimpleNamespace(
        **{
            **cfg.__dict__,
            "additional_config": {"specdec": {"async": True, "async_mode": "schedule", "draft_slots": "uniform"}},
        }
    )
    assert SpecdecProposer(uniform, patch_runner=False).core.options.pad_mode == "on"  # k slots: pad every row
    policy = prop.core.policy
    assert policy.pad_below_rows == 16 and policy.should_pad(15, K) and not policy.should_pad(16, K)
    runner = FakeRunner(prop)
    step = SimpleNamespace(num_spec_tokens_to_schedule=K, has_structured_output_requests=False)
    sampled = torch.tensor([[1, 2, -1, -1, -1, -1, -1], [1, -1, -1, -1, -1, -1, -1]], dtype=torch.int32)
    runner._bookkeeping_sync(step, SimpleNamespace(sampled_token_ids=sampled))
    runner._draft_token_ids = runner.propose_draft_token_ids(step, [], None)
    runner._prepare_input_ids(step, 2, 0, None)
    assert runner.calls[0] == ("counts", [2, 1], [2, 1]) and runner.calls[1] == "bookkeeping"
    assert "propose" not in runner.calls  # vLLM's own propose (a list) is never reached in schedule mode
    kind, drafts = runner.calls[-1]
    assert kind == "prepare" and len(drafts) == 2 and all(len(d) == K for d in drafts)
    assert drafts[0][:3] == [3, 4, 5] and drafts[1][:3] == [2, 3, 4]  # the prompt's pattern continues
    runner.discard_request_mask.np[1] = runner.discard_request_mask.gpu[1] = True  # row b: a partial prefill
    runner._bookkeeping_sync(step, SimpleNamespace(sampled_token_ids=sampled))
    assert runner.calls[-1] == "bookkeeping" and runner.calls[-2] == ("counts", [2, 5], [2, 0])  # b: its last token
    prop.scheduled.device_wait = dw = FakeDeviceWait()  # the GPU waits: filled as the forward is launched
    runner._bookkeeping_sync(step, SimpleNamespace(sampled_token_ids=sampled))
    runner._draft_token_ids = runner.propose_draft_token_ids(step, [], None)
    runner.execute_model(step)
    assert runner.calls[-1] == "execute" and dw.released == [1] and prop.scheduled.deferred is None
    assert runner.calls[-2] == ("forward", [1])  # released before the forward's launch
    kind, seen = runner.calls[-3]
    assert kind == "prepare" and seen == drafts  # vLLM enqueued its reads before the drafts existed (the stream waits)
    runner._bookkeeping_sync(step, SimpleNamespace(sampled_token_ids=sampled))
    runner._draft_token_ids = runner.propose_draft_token_ids(step, [], None)
    with pytest.raises(RuntimeError, match="after preparing"):
        runner.execute_model(SimpleNamespace(**vars(step), fail=True))
    assert dw.released == [1, 2]  # released even when vLLM raised
    plain = FakeRunner(prop, use_async=False)  # synchronous scheduling: every hook passes through
    plain._bookkeeping_sync(step, SimpleNamespace(sampled_token_ids=sampled))
    assert plain.propose_draft_token_ids(step, [], None) == [[9], [9]]
    assert plain.calls == ["bookkeeping", "propose"]


def test_k_of_the_step_bounds_the_real_draft_and_the_rest_is_filler():
    clock = SimpleNamespace(t=0.0)
    sched = ScheduledDrafting(make_core(lambda: clock.t, adaptive=False), k=K, max_rows=4, device="cpu")
    pattern = [1, 2, 3, 4, 5] * 8
    state = {"a": SimpleNamespace(prompt_token_ids=pattern, output_token_ids=[])}
    sched.capture(torch.tensor([[1, 2, -1, -1, -1, -1, -1]], dtype=torch.int32), ["a"], set(), requests=state)
    out = sched.submit(["a"], k=3, eager=False)  # vLLM's per-batch-size schedule asked for 3 draft tokens
    assert sched.fill(out)
    assert out[0].tolist() == [3, 4, 5] + [2] * (K - 3)  # 3 drafted, then the row's last token as filler
    narrow = torch.tensor([[3, 4, 5, -1], [1, -1, -1, -1]], dtype=torch.int32)  # a k=3 step: [rows, 4]
    sched.capture(narrow, ["a", "b"], set(), requests={**state, "b": state["a"]})
    assert sched.queue[-1].rows == 2 and sched._slot_view(sched.queue[-1].slot, 2, 4).is_contiguous()
    sched._drain()
    assert sched.feed.history["a"][-3:] == [3, 4, 5] and sched.feed.history["b"][-1] == 1
    out = sched.submit(["a"], k=3, eager=False)
    assert sched.fill(out)
    assert out[0].tolist() == [1, 2, 3] + [5] * (K - 3)  # the narrow step's tokens reached the drafter


@pytest.mark.parametrize("growth", [0.0, 1.0])
def test_adaptive_slots_follow_each_requests_latest_draft_and_stay_lossless(growth):
    """draft_slots='adaptive': after each fill the slot book holds every row's draft length (cut by confidence,
    not padded); the next step verifies only that many of the row's drafts (as vLLM's scheduler, patched, reserves
    them), or twice that with ``slot_growth`` 1, the buffer still equals the synchronous twin's, and every emitted
    token is the target's."""
    from specdec.vllm_plugin.modes.slots import SlotBook

    clock = SimpleNamespace(t=0.0)
    tick = lambda: clock.t  # noqa: E731
    opts = {"pad_drafts": "off", "min_path_prob": 0.3}
    eng = AsyncEngine(seed=11)
    book = SlotBook(K, growth=growth)
    sched = ScheduledDrafting(make_core(tick, **opts), k=K, max_rows=2 * MAX_ROWS, device="cpu", slot_book=book)
    twin = make_core(tick, **opts)  # the synchronous reference
    out = None
    short = 0
    for step in range(120):
        if out is not None:
            reserved = dict(book.table)  # what the scheduler gave this step's rows (from the previous drafts)
            assert sched.fill(out)
            drafts = eng.twin_step(twin, eng.order)
            assert out.numpy().tolist() == eng.expected_buffer(drafts, out.shape[0]), step
            drafted = {r: min(K, len(d)) for r, d in zip(eng.order, drafts) if r in book.table}
            assert book.lengths == drafted, step  # rows with no new token (prefilling) are left out: k slots
            assert book.table == {r: min(K, 2 * n if growth else n) for r, n in drafted.items()}, step
            assert not any(d for r, d in zip(eng.order, drafts) if r not in book.table), step
            short += sum(n < K for n in reserved.values())
            eng.prev_drafts, eng.slots = out.clone(), reserved
        clock.t += 1e-3
        out = eng.run_step(sched, step)  # each row verifies at most 1 + its slots
    for r in eng.reqs.values():
        assert r["seq"] == r["target"][: len(r["seq"])]
    assert short > 100  # the cut left rows with fewer than K slots
    assert sched.core.stats_dict()["accepted_tokens"] > 100
    assert "slot_share" in sched.stats()["schedule"]


def test_narrow_schedules_verify_the_width_and_stay_lossless():
    """narrow_slots: a narrow schedule gives every decoding row exactly the width, and that step's fill pads every
    row with the drafter's chain to it (as the synchronous twin drafting with k = width, padded); schedules that are
    not narrow keep the drafts' own slots. Switching between the two every few steps, every emitted token is the
    target's and no row verifies more than 1 + its slots."""
    from specdec.vllm_plugin.modes.slots import SlotBook

    clock = SimpleNamespace(t=0.0)
    tick = lambda: clock.t  # noqa: E731
    opts = {"pad_drafts": "off", "min_path_prob": 0.3}
    width = 3
    eng = AsyncEngine(seed=5)
    book = SlotBook(K, narrow=width, narrow_rows=(1, 1000))
    sched = ScheduledDrafting(make_core(tick, **opts), k=K, max_rows=2 * MAX_ROWS, device="cpu", slot_book=book)
    twin = make_core(tick, **opts)
    out, narrow_steps = None, 0
    for step in range(120):
        if out is not None:
            book.begin_schedule(0 if step % 3 == 0 else len(eng.order))  # every third schedule is not narrow
            reserved = {r: width for r in eng.order} if book.width else dict(book.table)
            assert sched.fill(out)
            kw = {"k": width, "pad": True} if book.width else {}
            drafts = eng.twin_step(twin, eng.order, **kw)
            if book.width:
                narrow_steps += 1
                assert all(len(d) == width for d in drafts if d), step  # padded with the chain to the width
            assert out.numpy().tolist() == eng.expected_buffer(drafts, out.shape[0]), step
            eng.prev_drafts, eng.slots = out.clone(), reserved
        clock.t += 1e-3
        out = eng.run_step(sched, step)  # each row verifies at most 1 + its slots
    for r in eng.reqs.values():
        assert r["seq"] == r["target"][: len(r["seq"])]
    assert narrow_steps > 60 and sched.stats()["schedule"]["narrow_steps"] == narrow_steps
    assert sched.core.stats_dict()["accepted_tokens"] > 100


class NotingDeviceWait(FakeDeviceWait):
    """Records, at each release, how many drafts the slot book had been told of by then."""

    def __init__(self, book: Any) -> None:
        super().__init__()
        self.book, self.notes_at_release = book, []

    def release(self, seq: int) -> None:
        self.notes_at_release.append(self.book.notes)
        super().release(seq)


def test_device_wait_releases_before_the_slot_bookkeeping():
    """With the device wait the GPU waits only for the drafts: the slot book's note (next schedule's grants) and the
    cost fit come after the release, and still before the next fill reads them; the buffer equals the twin's."""
    from specdec.vllm_plugin.modes.slots import SlotBook

    clock = SimpleNamespace(t=0.0)
    tick = lambda: clock.t  # noqa: E731
    opts = {"pad_drafts": "off", "min_path_prob": 0.3}
    eng = AsyncEngine(seed=13)
    book = SlotBook(K)
    dw = NotingDeviceWait(book)
    sched = ScheduledDrafting(
        make_core(tick, **opts), k=K, max_rows=2 * MAX_ROWS, device="cpu", device_wait=dw, slot_book=book
    )
    twin = make_core(tick, **opts)
    out, deferred = None, 0
    for step in range(60):
        if out is not None:
            reserved = dict(book.table)
            notes = book.notes
            assert sched.fill(out)
            if sched.deferred is not None:
                deferred += 1
                sched.finish()
                assert dw.notes_at_release[-1] == notes  # released before the note
            assert book.notes == notes + 1  # noted once the step's drafts went out
            drafts = eng.twin_step(twin, eng.order)
            assert out.numpy().tolist() == eng.expected_buffer(drafts, out.shape[0]), step
            assert book.lengths == {r: min(K, len(d)) for r, d in zip(eng.order, drafts) if r in book.table}, step
            eng.prev_drafts, eng.slots = out.clone(), reserved
        clock.t += 1e-3
        out = eng.run_step(sched, step)
    assert deferred > 50
    for r in eng.reqs.values():
        assert r["seq"] == r["target"][: len(r["seq"])]


def test_slot_book_tables_clamps_and_placeholders():
    from specdec.vllm_plugin.modes.slots import PLACEHOLDER, UNKNOWN, SlotBook

    book = SlotBook(4)
    assert book.slots("new", 4) == 4  # unknown request: vLLM's k
    book.note(["a", "b", "c", "p"], [0, 2, 9, UNKNOWN])
    assert book.table == {"a": 0, "b": 2, "c": 4}  # "p" (no new token yet) keeps k
    assert book.owns(book.placeholders(2)) and not book.owns([PLACEHOLDER] * 2)
    assert [book.slots(r, 4) for r in "abc"] == [0, 2, 4]
    assert book.slots("b", 1) == 1  # never more than vLLM reserved (its k by batch size)
    assert book.placeholders(2) == [-1, -1] and book.placeholders(2) is book.placeholders(2)
    book.note(["c"], [1])
    assert book.table == {"c": 1}  # requests that left the batch drop out
    assert book.as_dict()["slots_offered"] == 17 and book.as_dict()["slots_granted"] == 11
    with pytest.raises(ValueError, match="k=0"):
        SlotBook(0)
    with pytest.raises(ValueError, match="slot_growth=-1"):
        SlotBook(4, growth=-1)


def test_slot_growth_forecast_settles_its_extra_slots_and_stops_when_they_do_not_pay():
    """``slot_growth``: L + ceil(g * L) slots (at most k) while the share of extra slots that held an accepted token
    reaches the token cost; the share is settled from the step the grant was for (two schedules back at the note);
    below the cost the forecast is the draft's length except on every GROWTH_PROBE_EVERY-th note."""
    from specdec.vllm_plugin.modes.slots import GROWTH_PROBE_EVERY, SlotBook

    book = SlotBook(16, growth=1.0)
    book.note(["a", "b", "c"], [0, 3, 10])
    assert book.lengths == {"a": 0, "b": 3, "c": 10} and book.table == {"a": 0, "b": 6, "c": 16}
    book.begin_schedule()  # schedule of step 1: grants from that note
    assert [book.slots(r, 16) for r in "abc"] == [0, 6, 16]
    assert book.slots("b", 5) == 5 and book.slots("b", 16, fresh=False) == 3  # vLLM's cap; the trim path: no growth
    book.slots("b", 16)
    book.note(["a", "b", "c"], [0, 3, 10], emitted=[1, 2, 9])  # step 0's tokens: step 1's grants not settled yet
    assert book.extra_granted == 0 and book.paid is None
    book.begin_schedule()  # schedule of step 2
    book.slots("b", 16)
    # step 1's tokens: b accepted 5 of its 6 slots (2 of 3 extra), c 12 (2 of 6 extra)
    book.note(["a", "b", "c"], [0, 3, 10], emitted=[1, 6, 13], token_cost=0.5)
    assert (book.extra_granted, book.extra_used) == (3 + 6, 2 + 2) and book.paid == pytest.approx(4 / 9)
    assert not book.growing and book.table == book.lengths  # 4/9 < 0.5: the extra slots do not pay
    book.begin_schedule()
    assert book.slots("b", 16) == 3
    for _ in range(GROWTH_PROBE_EVERY):
        book.begin_schedule()
        book.note(["b"], [3], emitted=[1], token_cost=0.5)
        if book.growing:
            break
    assert book.growing and book.notes % GROWTH_PROBE_EVERY == 0 and book.table == {"b": 6}  # the probe
    book.note(["b"], [3], emitted=[1], token_cost=0.4)
    assert book.growing  # 4/9 >= 0.4
    assert book.as_dict()["growth_extra_slots"] == 9
    book.note(["b", "c"], [3, 4], token_cost=0.0)
    book.begin_schedule()
    assert (book.slots("b", 16), book.slots("c", 16)) == (6, 8)
    book.prefill_cap = 4
    book.cap_grants()  # a heavy prefill step: at most 4 slots each, so b keeps 1 extra slot and c none
    assert book._grants == {"b": (3, 4)}
    book.min_share = 0.5  # a floor above the token cost: 4/9 no longer pays
    book.notes = 0
    book.note(["b"], [3], token_cost=0.0)
    assert not book.growing and book.table == {"b": 3}


class FakeAsyncScheduler:
    """vLLM's AsyncScheduler._update_after_schedule, reduced to what the slot patch relies on."""

    def __init__(self, k: int, fail: bool = False) -> None:
        self._spec_token_placeholders = [-1] * k
        self.requests = {r: SimpleNamespace(is_prefill_chunk=r == "p", spec_token_ids=[]) for r in ("a", "b", "p")}
        self.fail = fail

    def _update_after_schedule(self, scheduler_output):
        if self.fail:
            self.requests = None  # the patch's own work then fails: it must not raise
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests[req_id] if self.requests else None
            if request is None or request.is_prefill_chunk:
                continue
            request.spec_token_ids = self._spec_token_placeholders


def test_scheduler_patch_trims_placeholders_only_while_a_book_is_registered():
    from specdec.vllm_plugin.modes import slots

    class Scheduler(FakeAsyncScheduler):
        pass

    assert patch(Scheduler, *SLOTS).on(ADAPTIVE) and patch(Scheduler, *SLOTS).on(ADAPTIVE)  # idempotent
    out = SimpleNamespace(num_scheduled_tokens={"a": 5, "b": 5, "p": 100})
    sch = Scheduler(4)
    sch.vllm_config = SimpleNamespace()  # the engine's config: the proposer attaches its slot book there
    try:
        slots.attach_book(sch.vllm_config, None)
        sch._update_after_schedule(out)
        assert sch.requests["a"].spec_token_ids is sch._spec_token_placeholders  # no book: vLLM's k slots
        book = slots.SlotBook(4)
        book.note(["a", "b"], [1, 7])
        slots.attach_book(sch.vllm_config, book)
        sch._update_after_schedule(out)
        assert sch.requests["a"].spec_token_ids == [-1] and sch.requests["b"].spec_token_ids == [-1] * 4
        assert sch.requests["p"].spec_token_ids == []  # a prefill chunk keeps what vLLM gave it
        bad = Scheduler(4, fail=True)
        bad.vllm_config = sch.vllm_config
        bad._update_after_schedule(SimpleNamespace(num_scheduled_tokens={}))  # the patch failing: logged, no raise
    finally:
        slots.attach_book(sch.vllm_config, None)

    class Other:
        def _update_after_schedule(self, scheduler_output):
            return None

    assert not patch(Other, *SLOTS).on(ADAPTIVE)  # not the method this patch was written against: left alone


def test_prefill_steps_cap_the_decoding_requests_slots():
    from specdec.vllm_plugin.modes.slots import SlotBook
    from specdec.vllm_plugin.patches.async_slots import PREFILL_HEAVY_TOKENS, cap_prefill_steps

    book = SlotBook(4, prefill_cap=1)

    def req(spec, chunk=False, todo=0, rid="x"):
        return SimpleNamespace(
            spec_token_ids=spec, is_prefill_chunk=chunk, num_tokens=100 + todo, num_computed_tokens=100, request_id=rid
        )

    running = [req([-1] * 4), req([-1]), req([]), req([5, 6, 7])]
    sch = SimpleNamespace(running=running, waiting=[])
    assert cap_prefill_steps(sch, book) == 0 and running[0].spec_token_ids == [-1] * 4  # decode-only step
    sch.waiting = [req([], todo=PREFILL_HEAVY_TOKENS - 1)]
    assert cap_prefill_steps(sch, book) == 0 and book.prefill_steps == 0  # a light prefill rides along for free
    sch.waiting = [req([], todo=PREFILL_HEAVY_TOKENS // 2), req([], todo=PREFILL_HEAVY_TOKENS // 2)]
    assert cap_prefill_steps(sch, book) == 1
    assert running[0].spec_token_ids == [-1] and running[1].spec_token_ids == [-1]  # capped / already short
    assert running[2].spec_token_ids == [] and running[3].spec_token_ids == [5, 6, 7]  # none / real draft ids
    sch.waiting = []
    running[2].is_prefill_chunk, running[2].spec_token_ids = True, [-1] * 3
    running[2].num_tokens += PREFILL_HEAVY_TOKENS
    running[0].spec_token_ids = [-1] * 4
    assert cap_prefill_steps(sch, book) == 1  # a prompt still being chunked is a prefill too (and keeps its own)
    assert running[2].spec_token_ids == [-1] * 3
    assert book.as_dict()["prefill_steps"] == 2 and book.as_dict()["prefill_trimmed_slots"] == 6


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not importable (scripts/test.sh has vLLM)")
def test_real_vllm_async_scheduler_is_the_one_the_slot_patch_expects():
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    from specdec.vllm_plugin.patches.common import is_wrapped

    class Sub(AsyncScheduler):
        pass

    before = AsyncScheduler.__dict__.get("_update_after_schedule")  # the plugin's load may have wrapped it already
    assert patch(Sub, *SLOTS).on(Feature.SLOT_REGRANT)
    assert is_wrapped(Sub._update_after_schedule, ADAPTIVE.label)
    assert AsyncScheduler.__dict__.get("_update_after_schedule") is before  # this call changed the subclass only


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not importable (scripts/test.sh has vLLM)")
def test_real_vllm_async_scheduler_schedules_each_request_its_slots(monkeypatch):
    """vLLM's own AsyncScheduler (CPU, no model run) with the slot patch: a step's scheduled tokens per request are
    1 + the slots the book holds when that step is scheduled (vLLM reserved placeholders at the end of scheduling
    the step before; the patch re-grants them from the newer book at the start of ``schedule``), and vLLM's
    placeholder accounting stays consistent as outputs arrive."""
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, SpeculativeConfig, VllmConfig
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    from specdec.paths import TARGET_MODEL, model_path
    from specdec.vllm_plugin.modes import slots
    from specdec.vllm_plugin.patches import async_slots

    if not model_path(TARGET_MODEL).is_dir():
        pytest.skip("the shared target model is not here (SPECDEC_SHARED)")
    k, blocks = 4, 200
    cache = CacheConfig(block_size=16, cache_dtype="auto", enable_prefix_caching=False)
    cache.num_gpu_blocks = blocks
    config = VllmConfig(
        model_config=ModelConfig(model=str(model_path(TARGET_MODEL)), max_model_len=512, seed=0),
        scheduler_config=SchedulerConfig(
            max_num_seqs=8, max_num_batched_tokens=1024, max_model_len=512, is_encoder_decoder=False
        ),
        cache_config=cache,
        device_config=DeviceConfig("cpu"),
        speculative_config=SpeculativeConfig(
            method="ngram", num_speculative_tokens=k, prompt_lookup_max=3, prompt_lookup_min=2
        ),
    )
    kv = KVCacheConfig(
        num_blocks=blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"], FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float32)
            )
        ],
    )

    class Patched(AsyncScheduler):
        pass

    assert patch(Patched, *SLOTS).on(Feature.SLOT_REGRANT)
    sch = Patched(
        vllm_config=config, kv_cache_config=kv, structured_output_manager=StructuredOutputManager(config), block_size=16
    )
    params = SamplingParams(temperature=0.0, max_tokens=32)
    for rid in ("a", "b"):
        sch.add_request(
            Request(request_id=rid, prompt_token_ids=list(range(10, 30)), sampling_params=params, pooling_params=None)
        )

    def output(step, tokens):
        ids = list(step.num_scheduled_tokens)
        return ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=[tokens[r] for r in ids]
        )

    book = slots.SlotBook(k)
    try:
        slots.attach_book(sch.vllm_config, book)
        book.note(["a", "b"], [0, 2])
        s1 = sch.schedule()  # the prefills; step 2's placeholders follow the book as it is now
        assert s1.num_scheduled_tokens == {"a": 20, "b": 20}
        s2 = sch.schedule()  # async: before step 1's tokens are known
        assert s2.num_scheduled_tokens == {"a": 1, "b": 3}
        assert {r: len(t) for r, t in s2.scheduled_spec_decode_tokens.items()} == {"b": 2}
        sch.update_from_output(s1, output(s1, {"a": [7], "b": [8]}))
        book.note(["a", "b"], [3, 0])
        s3 = sch.schedule()  # reserved when step 2 was scheduled (a 0, b 2), re-granted from the book of now
        assert s3.num_scheduled_tokens == {"a": 4, "b": 1}
        sch.update_from_output(s2, output(s2, {"a": [9], "b": [5, 6, 7]}))  # b: both drafts accepted + bonus
        s4 = sch.schedule()
        assert s4.num_scheduled_tokens == {"a": 4, "b": 1}
        assert {r: len(t) for r, t in s4.scheduled_spec_decode_tokens.items()} == {"a": 3}
        assert list(sch.requests["a"].output_token_ids) == [7, 9]
        assert list(sch.requests["b"].output_token_ids) == [8, 5, 6, 7]
        assert all(sch.requests[r].num_output_placeholders >= 0 for r in ("a", "b"))
        assert book.as_dict()["slot_share"] < 0.5
        book.prefill_cap = 1  # prefill_step_slots: a step carrying a prefill verifies at most 1 draft per request
        book.note(["a", "b"], [3, 3])
        sch.update_from_output(s3, output(s3, {"a": [1], "b": [2]}))
        s5 = sch.schedule()  # a 3, b 3: the book of now
        sch.add_request(
            Request(request_id="c", prompt_token_ids=list(range(40, 60)), sampling_params=params, pooling_params=None)
        )
        monkeypatch.setattr(async_slots, "PREFILL_HEAVY_TOKENS", 20)  # c's 20 tokens count as a heavy prefill
        s6 = sch.schedule()  # c waits: a and b (3 slots each, reserved at s5) keep 1
        assert s6.num_scheduled_tokens == {"a": 2, "b": 2, "c": 20}
        assert book.as_dict()["prefill_steps"] == 1
        for s, toks in ((s4, {"a": [3], "b": [4]}), (s5, {"a": [5], "b": [6]}), (s6, {"a": [7], "b": [8], "c": [9]})):
            sch.update_from_output(s, output(s, toks))
        assert all(sch.requests[r].num_output_placeholders >= 0 for r in ("a", "b", "c"))
    finally:
        slots.attach_book(sch.vllm_config, None)


def test_schedule_cpu_benchmark_configs_draft_the_same():
    """benchmarks/bench_schedule_cpu: the refresh's place changes where the work runs, not the drafts
    (greedy verification against fixed responses: equal acceptance).
    Two lane threads, and every clock-driven decision off (``adaptive=False``: pad_drafts 'auto' once made the
    drafts depend on the measured step period, a CI failure)."""
    from benchmarks.bench_schedule_cpu import run
    from specdec.eval.records import TraceRecord

    rng = np.random.default_rng(2)
    phrases = [rng.integers(0, 30, 7) for _ in range(3)]
    records = [TraceRecord(str(i), rng.integers(0, 30, 50), np.concatenate([phrases[i % 3]] * 10)) for i in range(8)]
    out = {
        c: run(c, records[:4], records, k=4, steps=60, gpu_ms=0.0, threads=2, adaptive=False)
        for c in ("default", "no_early_refresh")
    }
    accepted = {c: (r["accepted_tokens"], r["drafted_tokens"], r["emitted_per_step"]) for c, r in out.items()}
    assert not any(v for r in out.values() for v in r["fallbacks"].values())  # no timeout, error, resync...
    assert len(set(accepted.values())) == 1 and out["default"]["accepted_tokens"] > 100


def test_regrant_gives_running_requests_the_slots_of_their_latest_draft():
    from specdec.vllm_plugin.modes.slots import SlotBook
    from specdec.vllm_plugin.patches.async_slots import regrant_placeholders

    book = SlotBook(4)
    shared = [-1] * 4

    def req(rid, spec, chunk=False):
        return SimpleNamespace(request_id=rid, spec_token_ids=spec, is_prefill_chunk=chunk)

    running = [
        req("a", book.placeholders(0)),
        req("b", shared),
        req("c", book.placeholders(1)),
        req("d", [5, 6]),
        req("e", shared, chunk=True),
        req("f", book.placeholders(2)),
    ]
    sch = SimpleNamespace(_spec_token_placeholders=shared, running=running)
    book.note(["a", "b", "c", "d", "e"], [3, 1, 9, 0, 0])  # f: not drafted last step (no new token): k
    assert regrant_placeholders(sch, book) == 4
    assert [len(r.spec_token_ids) for r in running] == [3, 1, 4, 2, 4, 4]
    assert running[2].spec_token_ids is shared and running[5].spec_token_ids is shared  # all k: vLLM's own list
    assert running[3].spec_token_ids == [5, 6] and running[4].spec_token_ids is shared  # real ids, a prompt chunk
    assert book.as_dict()["slots_granted"] == 3 + 1 + 4 + 4 and book.as_dict()["slots_offered"] == 16
    sch._spec_token_placeholders = []
    assert regrant_placeholders(sch, book) == 0  # vLLM reserved nothing (no speculative step)


@pytest.mark.parametrize("with_wait", [True, False], ids=["device-wait", "host-fills"])
def test_a_step_that_verifies_no_draft_waits_for_nothing_and_drafts_after_the_forwards_launch(with_wait, monkeypatch):
    """No request has a slot this step (a backed-off batch): the fill enqueues no wait and no copy; the drafting
    (bookkeeping, shadow checks, the next step's slots) runs at ``finish``, which the forward's start leaves to the
    end of ``execute_model``. The next step drafts from every token all the same. Without a device wait (host fills:
    none could be made, or the watchdog switched it off) the same, where ``finish`` used to raise."""
    from specdec.vllm_plugin.patches import async_sched

    monkeypatch.setattr(async_sched, "drafts_in_schedule_mode", lambda runner: True)
    clock = SimpleNamespace(t=0.0)
    eng = AsyncEngine(seed=3)
    twin = make_core(lambda: clock.t)
    dw = FakeDeviceWait()
    sched = ScheduledDrafting(
        make_core(lambda: clock.t), k=K, max_rows=MAX_ROWS, device="cpu", device_wait=dw if with_wait else None
    )
    runner = SimpleNamespace(drafter=SimpleNamespace(scheduled=sched))
    out = eng.run_step(sched, 0)
    before = out.clone()
    assert sched.fill(out, needed=False) and sched.deferred is not None and not sched.gpu_waits
    assert not dw.pending and torch.equal(out, before)  # nothing enqueued, nothing copied
    async_sched._finish_deferred(runner, late=False)  # the forward's start: not a fill the GPU waits for
    assert sched.deferred is not None
    async_sched._finish_deferred(runner)  # the end of execute_model
    assert sched.deferred is None and dw.released == [] and sched.stats()["schedule"]["late_fills"] == 1
    eng.twin_step(twin, eng.order)  # the twin saw the same tokens
    out = eng.run_step(sched, 1)
    assert sched.fill(out) and sched.gpu_waits is with_wait  # a step with slots waits again (host fill: drafted now)
    sched.finish()
    drafts = eng.twin_step(twin, eng.order)
    assert out.numpy().tolist() == eng.expected_buffer(drafts, out.shape[0])
    sched.close()


def test_the_timing_hook_is_told_every_phase_and_changes_no_draft():
    """An observer (``observe.py``: benchmarks' timing hook) is told the wall time of each drafting phase; the drafts
    are those of the same steps without it."""
    from specdec.vllm_plugin.observe import PHASES

    runs = []
    for observed in (False, True):
        eng = AsyncEngine(seed=7)
        sched = ScheduledDrafting(
            make_core(lambda: 0.0), k=K, max_rows=MAX_ROWS, device="cpu", device_wait=FakeDeviceWait()
        )
        seen: list[tuple[str, float]] = []
        if observed:
            sched.observer = SimpleNamespace(drafting_phase=lambda phase, s, seen=seen: seen.append((phase, s)))
        eng.churn(0)
        drafts = []
        for _ in range(5):
            order, sampled, discard, _ = eng.verify()
            sched.capture(sampled, order, discard, requests=eng.state)
            out = sched.submit(order, k=None, eager=False)
            assert sched.fill(out)
            sched.finish()  # the deferred fill's drafting (device wait)
            drafts.append(out.tolist())
            eng.prev_drafts = out.clone()
        runs.append((drafts, seen))
    (plain, none_seen), (timed, seen) = runs
    assert timed == plain and none_seen == []
    assert {phase for phase, _ in seen} == set(PHASES) and all(s >= 0.0 for _, s in seen)  # (FakeDeviceWait)


def test_observe_gives_every_live_proposer_the_observer():
    from specdec.vllm_plugin.observe import observe
    from specdec.vllm_plugin.proposer import SpecdecProposer

    cfg = SimpleNamespace(
        additional_config={"specdec": {"async": True, "async_mode": "schedule", "adaptive": False}},
        speculative_config=SimpleNamespace(num_speculative_tokens=K),
        model_config=SimpleNamespace(max_model_len=512),
    )
    prop = SpecdecProposer(cfg, patch_runner=False)
    try:
        timer = SimpleNamespace(drafting_phase=lambda phase, s: None)
        assert observe(timer) >= 1 and prop.observer is timer
        assert observe(None) >= 1 and prop.observer is None
    finally:
        prop.close()


@pytest.mark.parametrize("grace_counts", [True, False])
def test_late_drafting_switches_the_device_wait_off_only_where_grace_releases_count(grace_counts, monkeypatch):
    """Three grace releases (drafting still running draft_timeout_ms after the GPU reached its wait) switch the
    device wait off under WATCHDOG_GRACE_COUNTS (the gated default); counting stalls only, it stays on until the
    host leaves three waits unreleased (stalls)."""
    import specdec.vllm_plugin.modes.schedule as schedule_mode

    monkeypatch.setattr(schedule_mode, "WATCHDOG_GRACE_COUNTS", grace_counts)
    clock = SimpleNamespace(t=0.0)
    eng = AsyncEngine(seed=9)
    dw = FakeDeviceWait()
    sched = ScheduledDrafting(make_core(lambda: clock.t, strict=False), k=K, max_rows=MAX_ROWS, device="cpu",
                              device_wait=dw)  # fmt: skip
    eng.churn(0)

    def step(fires: int, stalls: int) -> None:
        dw.fires, dw.stall_count = fires, stalls
        order, sampled, discard, _ = eng.verify()
        sched.capture(sampled, order, discard, requests=eng.state)
        assert sched.fill(sched.submit(order, k=None, eager=False))
        sched.finish()

    for fires in (1, 2, 3):  # three late drafting steps, the stream never stuck
        step(fires, 0)
    assert sched.stats()["schedule"]["watchdog_releases"] == 3
    assert (sched.device_wait is None) == grace_counts
    if not grace_counts:
        step(4, 1)
        step(5, 2)
        assert sched.device_wait is not None  # two stalls so far
        step(6, 3)  # the third stall
        st = sched.stats()["schedule"]
        assert st["watchdog_releases"] == 6 and st["watchdog_stalls"] == 3 and sched.device_wait is None
