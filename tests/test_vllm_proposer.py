"""CPU tests of the vLLM proposer's bookkeeping with fake inputs shaped like vLLM's (no vLLM needed)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from unittest.mock import ANY

import numpy as np
import pytest

from benchmarks.vllm_cpu_engine import LLAMA_8B_HF
from specdec.drafters.base import Drafter
from specdec.tree import TokenTree, best_chain
from specdec.vllm_plugin.core.adaptive import AdaptiveController
from specdec.vllm_plugin.core.batch import StepBatch
from specdec.vllm_plugin.core.proposer_core import ProposerCore
from specdec.vllm_plugin.entry.options import SpecdecOptions
from specdec.vllm_plugin.internal import InternalSettings
from specdec.vllm_plugin.proposer import SpecdecProposer

VOCAB = 97
MAX_REQS = 8


def target_next(ctx: list[int]) -> int:
    """The fake target's greedy choice: a deterministic function of the last two tokens."""
    return (ctx[-1] * 7 + (ctx[-2] if len(ctx) > 1 else 0) + 3) % VOCAB


class OracleDrafter(Drafter):
    """Records every lifecycle call; drafts the fake target's continuation (wrong from position ``wrong_at``)."""

    name = "oracle"

    def __init__(self, *, wrong_at: int = 99, fail: bool = False, sleep_s: float = 0.0) -> None:
        self.ctx: dict[str, list[int]] = {}
        self.stopped: list[str] = []
        self.budgets: list[int] = []
        self.wrong_at, self.fail, self.sleep_s = wrong_at, fail, sleep_s
        self.threads: set[str] = set()

    def start(self, request_id, prompt_ids):
        self.threads.add(threading.current_thread().name)
        self.ctx[request_id] = list(prompt_ids)

    def extend(self, request_id, token_ids):
        self.ctx[request_id].extend(int(t) for t in token_ids)

    def stop(self, request_id):
        self.ctx.pop(request_id, None)
        self.stopped.append(request_id)

    def draft_batch(self, requests):
        if self.sleep_s:
            time.sleep(self.sleep_s)
        if self.fail:
            raise RuntimeError("boom")
        out = []
        for r in requests:
            self.budgets.append(r.budget)
            ctx = list(self.ctx[r.request_id])
            toks = []
            for j in range(r.budget + 3):  # deliberately too long: the guard must truncate
                t = target_next(ctx) if j < self.wrong_at else (target_next(ctx) + 1) % VOCAB
                toks.append(t)
                ctx.append(t)
            out.append(TokenTree.chain(toks, probs=[0.9] * len(toks)))
        return out


class FakeRunner:
    """A tiny stand-in for vLLM's input batch + greedy rejection sampler (rows move, requests come and go)."""

    def __init__(self, max_model_len: int = 64) -> None:
        self.max_model_len = max_model_len
        self.token_ids_cpu = np.zeros((MAX_REQS, max_model_len), np.int32)
        self.num_tokens_no_spec = np.zeros(MAX_REQS, np.int32)
        self.num_prompt_tokens = np.zeros(MAX_REQS, np.int32)
        self.req_ids: list[str] = []
        self.drafts: dict[str, list[int]] = {}
        self.prefilled: set[str] = set()

    def add(self, rid: str, prompt: list[int]) -> None:
        row = len(self.req_ids)
        self.req_ids.append(rid)
        self.token_ids_cpu[row, : len(prompt)] = prompt
        self.num_tokens_no_spec[row] = len(prompt)
        self.num_prompt_tokens[row] = len(prompt)

    def remove(self, rid: str) -> None:
        """Finish a request and condense: the last row moves into the hole (as vLLM's condense does)."""
        row = self.req_ids.index(rid)
        last = len(self.req_ids) - 1
        for arr in (self.token_ids_cpu, self.num_tokens_no_spec, self.num_prompt_tokens):
            arr[row] = arr[last]
        self.req_ids[row] = self.req_ids[last]
        self.req_ids.pop()
        self.drafts.pop(rid, None)

    def swap(self, a: int, b: int) -> None:
        for arr in (self.token_ids_cpu, self.num_tokens_no_spec, self.num_prompt_tokens):
            arr[[a, b]] = arr[[b, a]]
        self.req_ids[a], self.req_ids[b] = self.req_ids[b], self.req_ids[a]

    def verify(self, skip_prefill: set[str] = frozenset()) -> list[list[int]]:
        """Greedy verification of the stored drafts; appends accepted + bonus to the rows."""
        sampled = []
        for row, rid in enumerate(self.req_ids):
            if rid in skip_prefill:
                sampled.append([])
                continue
            n = int(self.num_tokens_no_spec[row])
            ctx = self.token_ids_cpu[row, :n].tolist()
            out = []
            for t in self.drafts.get(rid, []) + [None]:
                want = target_next(ctx + out)
                out.append(want)
                if t != want:
                    break
            out = out[: self.max_model_len - n]
            self.token_ids_cpu[row, n : n + len(out)] = out
            self.num_tokens_no_spec[row] = n + len(out)
            sampled.append(out)
        return sampled


def make_core(drafter: Drafter, **opts) -> ProposerCore:
    opts.setdefault("num_speculative_tokens", 4)
    opts.setdefault("adaptive", False)
    opts.setdefault("draft_timeout_ms", 0.0)
    max_model_len = opts.pop("max_model_len", 64)
    params = opts.pop("target_params", 0.0)
    user, internal = InternalSettings.split(opts)
    options = SpecdecOptions.from_dict(user)
    return ProposerCore(drafter, options, max_model_len=max_model_len, internal=internal, target_params=params)


def run_step(core: ProposerCore, runner: FakeRunner, **kw) -> list[list[int]]:
    sampled = runner.verify(**kw)
    batch = StepBatch(
        list(runner.req_ids), sampled, runner.num_tokens_no_spec, runner.token_ids_cpu, runner.num_prompt_tokens
    )
    drafts = core.step(batch)
    runner.drafts = {rid: d for rid, d in zip(runner.req_ids, drafts)}
    return drafts


def test_state_follows_request_ids_across_moving_rows_and_finishes():
    drafter = OracleDrafter(wrong_at=2)
    core = make_core(drafter, num_speculative_tokens=4)
    runner = FakeRunner()
    for i, rid in enumerate(["a", "b", "c"]):
        runner.add(rid, [i + 1, i + 2, i + 3])
    for step in range(12):
        if step == 3:
            runner.swap(0, 2)
        if step == 5:
            runner.remove("b")  # finished; "c" moves into row 1
            runner.add("d", [5, 6])
        drafts = run_step(core, runner)
        for row, rid in enumerate(runner.req_ids):
            n = int(runner.num_tokens_no_spec[row])
            assert drafter.ctx[rid] == runner.token_ids_cpu[row, :n].tolist(), (step, rid)
            assert len(drafts[row]) <= 4
            assert len(drafts[row]) <= runner.max_model_len - n - 1
    assert "b" in drafter.stopped and "b" not in drafter.ctx
    assert set(core.requests) == set(runner.req_ids) == {"a", "c", "d"}
    # wrong_at=2: exactly 2 of each 4-token draft are accepted after the first step
    assert core.stats.accepted_tokens > 0
    assert 0.4 < core.stats.accepted_tokens / core.stats.drafted_tokens <= 0.5
    assert core.stats.resyncs == 0


def test_drafts_are_capped_by_k_and_max_model_len_and_empty_without_new_tokens():
    drafter = OracleDrafter()
    core = make_core(drafter, num_speculative_tokens=3, max_model_len=12)
    runner = FakeRunner(max_model_len=12)
    runner.add("a", [1, 2, 3])
    runner.add("p", [4, 5, 6])  # stays in "partial prefill": no sampled tokens
    lengths = []
    for _ in range(6):
        drafts = run_step(core, runner, skip_prefill={"p"})
        assert drafts[1] == []
        n = int(runner.num_tokens_no_spec[0])
        assert len(drafts[0]) <= max(0, min(3, 12 - n - 1))
        lengths.append((n, len(drafts[0])))
    assert max(b for b in drafter.budgets) <= 3
    assert lengths[-1][1] == 0  # at max_model_len: nothing drafted
    assert "p" not in drafter.ctx  # never started before its first sampled token
    assert runner.token_ids_cpu[0, :12].tolist()[:4] == [1, 2, 3, target_next([1, 2, 3])]


class ShortDrafter(OracleDrafter):
    """Drafts at most ``n`` correct tokens whatever the budget (so padding has something to add)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def draft_batch(self, requests):
        trees = super().draft_batch(requests)
        return [TokenTree.chain(t.tokens[: self.n].tolist(), probs=[0.9] * min(self.n, len(t))) for t in trees]


def test_pad_drafts_makes_every_decoding_row_exactly_k_long_and_keeps_outputs():
    k, max_len = 4, 40
    plain_runner, pad_runner = FakeRunner(max_model_len=max_len), FakeRunner(max_model_len=max_len)
    plain = make_core(ShortDrafter(2), num_speculative_tokens=k, max_model_len=max_len)
    padded = make_core(ShortDrafter(2), num_speculative_tokens=k, max_model_len=max_len, pad_drafts=True)
    for runner in (plain_runner, pad_runner):
        runner.add("a", [1, 2, 3])
        runner.add("b", [7, 8])
        runner.add("p", [4, 5, 6])  # partial prefill: no sampled tokens, no draft
    for _ in range(12):
        run_step(plain, plain_runner, skip_prefill={"p"})
        drafts = run_step(padded, pad_runner, skip_prefill={"p"})
        for row, rid in enumerate(pad_runner.req_ids):
            room = max_len - int(pad_runner.num_tokens_no_spec[row]) - 1
            want = 0 if rid == "p" else max(0, min(k, room))
            assert len(drafts[row]) == want, (rid, drafts[row])
    # same emitted tokens, whatever was padded
    assert plain_runner.token_ids_cpu.tolist() == pad_runner.token_ids_cpu.tolist()
    # the drafter's own tokens: 2 per step (both right), so its calibration is not diluted by the filler; the
    # submitted count includes the padding
    st = padded.requests["a"]
    assert st.last_real == 2 and st.acc_ema >= st.pred_ema * 0.99
    assert padded.stats.drafted_tokens > plain.stats.drafted_tokens


def test_pad_auto_pads_small_targets_and_not_large_batches_of_large_ones():
    from specdec.vllm_plugin.proposer import estimate_params

    llama8b = LLAMA_8B_HF
    assert estimate_params(llama8b) == pytest.approx(8.0e9, rel=0.03)
    assert estimate_params(SimpleNamespace()) == 0.0
    tiny = make_core(OracleDrafter(), num_speculative_tokens=16, target_params=53e6)
    big = make_core(OracleDrafter(), num_speculative_tokens=16, target_params=estimate_params(llama8b))
    unknown = make_core(OracleDrafter(), num_speculative_tokens=16)
    for core in (tiny, big, unknown):
        core.policy.period_s = 5e-3  # a measured 5 ms step
    assert tiny.policy.should_pad(64, 16) and tiny.policy.should_pad(1, 16)
    assert big.policy.should_pad(1, 16) and not big.policy.should_pad(64, 16)
    assert not unknown.policy.should_pad(1, 16)  # no size known: never pads
    forced = make_core(OracleDrafter(), num_speculative_tokens=16, pad_drafts="off", target_params=53e6)
    assert not forced.policy.should_pad(1, 16)
    with pytest.raises(Exception, match="pad_drafts='sometimes'"):
        SpecdecOptions.from_dict({"pad_drafts": "sometimes"})


def test_pad_fills_with_the_chain_past_the_cut_then_the_last_token():
    tree = TokenTree.chain([5, 6, 7], probs=[0.9, 0.5, 0.4])
    assert ProposerCore._chain(*best_chain(tree), 3, 0.6, pad=5, filler=9) == ([5, 6, 7, 7, 7], pytest.approx(0.9), 1)
    assert ProposerCore._chain([], None, 3, 0.0, pad=3, filler=9) == ([9, 9, 9], None, 0)


def test_resync_when_context_length_jumps():
    drafter = OracleDrafter()
    core = make_core(drafter)
    runner = FakeRunner()
    runner.add("a", [1, 2, 3])
    run_step(core, runner)
    run_step(core, runner)
    # a preemption/recompute: vLLM's row now holds more tokens than the drafter was told about
    n = int(runner.num_tokens_no_spec[0])
    runner.token_ids_cpu[0, n] = 11
    runner.num_tokens_no_spec[0] = n + 1
    run_step(core, runner)
    m = int(runner.num_tokens_no_spec[0])
    assert core.stats.resyncs == 1
    assert drafter.ctx["a"] == runner.token_ids_cpu[0, :m].tolist()


def test_drafter_errors_never_fail_a_step_and_are_counted(caplog):
    drafter = OracleDrafter(fail=True)
    core = make_core(drafter)
    runner = FakeRunner()
    runner.add("a", [1, 2, 3])
    for _ in range(3):
        assert run_step(core, runner) == [[]]
    assert core.guard.stats.errors == 3
    assert sum("failed" in r.message for r in caplog.records) == 1  # logged once
    strict = make_core(OracleDrafter(fail=True), strict=True)
    runner2 = FakeRunner()
    runner2.add("a", [1, 2, 3])
    with pytest.raises(RuntimeError, match="boom"):
        run_step(strict, runner2)


def test_slow_drafter_hits_the_deadline_and_ops_stay_in_order(plugin_log):
    drafter = OracleDrafter(sleep_s=0.3)
    core = make_core(drafter, draft_timeout_ms=20)
    runner = FakeRunner()
    runner.add("a", [1, 2, 3])
    assert run_step(core, runner) == [[]]  # did not wait for the 0.3 s drafter
    assert core.stats.timeouts == 1
    assert run_step(core, runner) == [[]]  # still busy: skipped, its ops queued
    assert core.stats.busy_skips == 1
    drafter.sleep_s = 0.0
    worker = core.python.worker
    assert worker is not None
    deadline = time.monotonic() + 30.0  # the slow job finishes in 0.3 s; a loaded machine may take longer
    while worker.busy and time.monotonic() < deadline:
        time.sleep(0.01)
    core.timeout_s = 30.0  # this step drafts whatever the machine's load (its ops must apply in order)
    drafts = run_step(core, runner)
    assert len(drafts[0]) == 4
    n = int(runner.num_tokens_no_spec[0])
    assert drafter.ctx["a"] == runner.token_ids_cpu[0, :n].tolist()
    assert drafter.threads == {t for t in drafter.threads if t.startswith("specdec-draft")}
    assert sum("draft_timeout_ms" in r.message for r in plugin_log()) == 1
    core.close()


def test_best_chain_of_a_tree_follows_the_most_probable_child():
    tree = TokenTree(np.array([5, 6, 7, 8]), np.array([-1, -1, 1, 1]), probs=np.array([0.3, 0.7, 0.2, 0.6]))
    tokens, probs = best_chain(tree)
    assert tokens == [6, 8]
    assert np.allclose(probs, [0.7, 0.42])
    chain = TokenTree.chain([1, 2, 3])
    assert best_chain(chain) == ([1, 2, 3], None)
    assert best_chain(TokenTree.empty()) == ([], None)


def test_confidence_cut_grows_with_batch_size():
    ctl = AdaptiveController(min_path_prob=0.0, min_path_prob_per_seq=0.01)
    assert ctl.cut(1) == 0.0
    assert ctl.cut(64) == pytest.approx(0.63)
    core = make_core(OracleDrafter(), adaptive=True, min_path_prob_per_seq=0.01)
    # chain probs 0.9 each -> path probs 0.9, 0.81, 0.729, 0.656: at batch 64 (cut 0.63) all 4 pass, at a
    # stricter per-seq step only the first ones survive
    assert core._chain(*best_chain(TokenTree.chain([1, 2, 3, 4], probs=[0.9] * 4)), 4, 0.75)[0] == [1, 2]
    assert core._chain(*best_chain(TokenTree.chain([1, 2, 3, 4], probs=[0.9] * 4)), 3, 0.0) == (
        [1, 2, 3],
        pytest.approx(2.439),
        3,
    )


def test_specdec_proposer_with_fake_vllm_config_and_tp_ranks(monkeypatch):
    cfg = SimpleNamespace(
        additional_config={"specdec": {"drafter": "suffix", "draft_timeout_ms": 0, "adaptive": False}},
        speculative_config=SimpleNamespace(num_speculative_tokens=5),
        model_config=SimpleNamespace(max_model_len=64),
    )
    drafter = OracleDrafter()
    prop = SpecdecProposer(cfg, drafter=drafter, patch_runner=False)
    assert prop.options.num_speculative_tokens == 5
    runner = FakeRunner()
    runner.add("x", [1, 2, 3])
    sampled = runner.verify()
    prop.bind_step(
        SimpleNamespace(req_ids=runner.req_ids, num_prompt_tokens=runner.num_prompt_tokens),
        SimpleNamespace(num_spec_tokens_to_schedule=5),
    )
    drafts = prop.propose(sampled, runner.num_tokens_no_spec, runner.token_ids_cpu)
    assert len(drafts[0]) == 5
    monkeypatch.setattr("specdec.vllm_plugin.proposer._tp_rank", lambda: 1)
    built = []
    monkeypatch.setattr("specdec.vllm_plugin.proposer.build_proposer_drafter", lambda *a, **kw: built.append(a))
    for mode in ("off", "thread"):  # sync and thread mode on TP rank 1: no drafter, no core, no drafts
        cfg.additional_config["specdec"].update(async_drafting=mode == "thread", async_mode="thread")
        other = SpecdecProposer(cfg, patch_runner=False)
        assert other.core is None and not other.drafts_here and built == []
        other.bind_step(SimpleNamespace(req_ids=runner.req_ids, num_prompt_tokens=None))
        assert other.propose(sampled, runner.num_tokens_no_spec, runner.token_ids_cpu) == [[]]
        other.prepare_step(SimpleNamespace(scheduled_new_reqs=[], finished_req_ids=["x"]))
        assert other.collect_deferred() is None and other.stats() == {"drafting_rank": False, "graphs": ANY}
        other.close()


def test_unbound_proposer_falls_back_to_the_callers_input_batch():
    cfg = SimpleNamespace(
        additional_config={"specdec": {"draft_timeout_ms": 0, "adaptive": False}},
        speculative_config=SimpleNamespace(num_speculative_tokens=2),
        model_config=SimpleNamespace(max_model_len=64),
    )
    prop = SpecdecProposer(cfg, drafter=OracleDrafter(), patch_runner=False)
    runner = FakeRunner()
    runner.add("x", [1, 2, 3])

    class Runner:  # shaped like GPUModelRunner.propose_draft_token_ids calling drafter.propose
        input_batch = SimpleNamespace(req_ids=runner.req_ids, num_prompt_tokens=None)

        def propose_draft_token_ids(self, sampled):
            return prop.propose(sampled, runner.num_tokens_no_spec, runner.token_ids_cpu)

    assert len(Runner().propose_draft_token_ids(runner.verify())[0]) == 2


def test_auto_deadline_mode_goes_inline_for_a_fast_drafter_and_back_on_an_overrun():
    from specdec.vllm_plugin.core import python_engine as core_mod

    drafter = OracleDrafter()
    core = make_core(drafter, draft_timeout_ms=1000, max_model_len=4096)  # a quarter of it: no loaded machine's hiccup
    runner = FakeRunner(max_model_len=4096)
    runner.add("a", [1, 2, 3])
    for _ in range(core_mod.AUTO_PROBE_JOBS):
        run_step(core, runner)
    assert core.python.inline_ok and any(t.startswith("specdec-draft") for t in drafter.threads)
    drafter.sleep_s = 1.2  # now slower than the 1 s deadline
    assert run_step(core, runner) == [[]]
    assert core.stats.timeouts == 1 and not core.python.inline_ok
    drafter.sleep_s = 0.0
    for _ in range(core_mod.AUTO_PROBE_JOBS + 2):
        run_step(core, runner)
    assert not core.python.inline_ok  # an overrun bans inline drafting for good
    n = int(runner.num_tokens_no_spec[0])
    assert drafter.ctx["a"] == runner.token_ids_cpu[0, :n].tolist()
    core.close()


def test_cost_model_fits_the_step_cost_and_cuts_unprofitable_tokens():
    from specdec.vllm_plugin.core.adaptive import StepCostModel

    free = StepCostModel()
    for t in range(40):  # batch 1 on a big GPU: verifying more tokens costs nothing
        free.observe(0.002, 1 + t % 9, 3)
    assert free.slope == pytest.approx(0.0, abs=1e-9) and free.token_cost() == 0.0
    busy = StepCostModel()
    for t in range(40):  # batch 64: 4 ms + 20 us per verified token, ~80 tokens emitted per step
        tokens = 64 + 8 * (t % 10)
        busy.observe(0.004 + 20e-6 * tokens, tokens, 80)
    assert busy.slope == pytest.approx(20e-6, rel=1e-3)
    assert busy.token_cost() == pytest.approx(20e-6 * busy.rate, rel=1e-6) and 0.2 < busy.token_cost() < 0.5
    for _ in range(200):  # drafting suppressed: no spread; the slope is kept, not reset to "free"
        busy.observe(0.004 + 20e-6 * 64, 64, 64)
    assert busy.slope == pytest.approx(20e-6, rel=1e-3)


def test_per_request_calibration_scales_the_cut():
    from specdec.vllm_plugin.core.proposer_core import RequestState

    st = RequestState(n_known=10)
    assert st.calibration() == 1.0  # no evidence yet
    st.pred_ema, st.acc_ema = 10.0, 2.5
    assert st.calibration() == 0.25


def test_draft_model_option_fills_the_model_drafters_path_and_target_tokenizer():
    opts = SpecdecOptions.from_dict(
        {
            "drafter": ["suffix", "model"],
            "draft_model": "/models/draft",
            "drafter_options": {"model": {"backend": "onnx"}},
        }
    )
    resolved = opts.resolved_drafter_options("/models/target")
    assert resolved["model"] == {
        "backend": "onnx",
        "path": "/models/draft",
        "target_tokenizer": "/models/target",
        "shared_host": True,
    }
    # an explicit drafter_options path wins over the shorthand; the user's dict is not mutated
    opts = SpecdecOptions.from_dict({"draft_model": "/a", "drafter_options": {"model": {"path": "/b"}}})
    assert opts.resolved_drafter_options()["model"]["path"] == "/b"
    assert opts.drafter_options == {"model": {"path": "/b"}}


def test_suffix_depth_caps_default_for_vllm_and_user_values_win():
    from specdec.vllm_plugin.entry.options import (
        VLLM_SUFFIX_FREE_SPEC_FACTOR,
        VLLM_SUFFIX_MAX_DEPTH,
        VLLM_SUFFIX_MIN_CONFIDENCE,
        VLLM_SUFFIX_SPEC_FACTOR,
    )
    from specdec.vllm_plugin.proposer import build_proposer_drafter

    opts = SpecdecOptions.from_dict({})
    want = {
        "max_spec_factor": VLLM_SUFFIX_SPEC_FACTOR,
        "free_spec_factor": VLLM_SUFFIX_FREE_SPEC_FACTOR,
        "max_depth": VLLM_SUFFIX_MAX_DEPTH,
    }
    if VLLM_SUFFIX_MIN_CONFIDENCE > 0:  # calibrated chains: only where the constant turns them on
        want["min_confidence"] = VLLM_SUFFIX_MIN_CONFIDENCE
    assert opts.resolved_drafter_options()["suffix"] == want
    drafter = build_proposer_drafter(opts)
    assert (drafter.config.max_spec_factor, drafter.config.free_spec_factor, drafter.config.max_depth) == (1.0, 8.0, 32)
    assert drafter.config.min_confidence == VLLM_SUFFIX_MIN_CONFIDENCE
    mine = SpecdecOptions.from_dict({"drafter_options": {"suffix": {"max_spec_factor": 4.0, "max_depth": 64}}})
    assert build_proposer_drafter(mine).config.max_spec_factor == 4.0
    assert build_proposer_drafter(mine).config.max_depth == 64


def test_async_mode_and_lane_threads_auto_resolve_by_target_size_and_parallelism():
    from specdec.vllm_plugin.entry.options import (
        AUTO_SCHEDULE_MIN_PARAMS,
        SCHEDULE_LANE_THREADS,
        resolve_async_mode,
        resolve_lane_threads,
    )
    from specdec.vllm_plugin.proposer import SpecdecProposer

    assert resolve_async_mode("auto", params=AUTO_SCHEDULE_MIN_PARAMS) == "schedule"
    assert resolve_async_mode("auto", params=5.3e7) == "thread"
    assert resolve_async_mode("auto", params=8e9, tp=2) == "schedule"  # rank 0 drafts and broadcasts
    assert resolve_async_mode("auto", params=5.3e7, tp=2) == "schedule"  # thread mode would forgo async scheduling
    assert resolve_async_mode("auto", params=8e9, pp=2) == "thread"  # schedule mode needs PP = 1
    assert resolve_async_mode("thread", params=8e9) == "thread"  # an explicit mode stands
    llama8b = LLAMA_8B_HF

    def proposer(hf, **extra):
        cfg = SimpleNamespace(
            additional_config={"specdec": {"adaptive": False, **extra}},
            speculative_config=SimpleNamespace(num_speculative_tokens=4),
            model_config=SimpleNamespace(max_model_len=512, hf_config=hf),
            parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        )
        return SpecdecProposer(cfg, patch_runner=False)

    big, small = proposer(llama8b), proposer(None)
    assert big.options.async_mode == "schedule" and big.schedule_mode and not big.threaded
    assert small.options.async_mode == "thread" and small.threaded and not small.schedule_mode
    # lane_threads 0 ("auto"): the schedule mode's drafting (the GPU waits for it) on SCHEDULE_LANE_THREADS threads
    assert big.core.options.lane_threads == SCHEDULE_LANE_THREADS and small.core.options.lane_threads == 1
    assert resolve_lane_threads(0, schedule=False) == 1 and resolve_lane_threads(2, schedule=True) == 2
    big.close()
    small.close()
