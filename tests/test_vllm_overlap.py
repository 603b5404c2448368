"""Overlapped drafting (``"async": true``, async_mode "overlap"): the ProposerCore in a helper process.

A real helper process with a real drafter, driven by the fake vLLM runner of test_vllm_proposer: its drafts must
equal an in-process ProposerCore's step for step, through moving rows, finished and new requests, preemption-like
context jumps, late replies and a dead helper.
"""
from __future__ import annotations

import time

import numpy as np
import pytest

from specdec.vllm_plugin.proposer import build_proposer_drafter
from specdec.vllm_plugin.core import ProposerCore
from specdec.vllm_plugin.options import SpecdecOptions
from specdec.vllm_plugin.overlap import OverlapCore, RowStore
from test_vllm_proposer import FakeRunner

OPTS = {"drafter": "suffix", "num_speculative_tokens": 4, "adaptive": False, "draft_timeout_ms": 0.0}


def _steps(runner: FakeRunner, step_fn, n_steps: int) -> list[list[list[int]]]:
    """Drive ``step_fn`` like vLLM would; the same scripted request churn for every caller."""
    seen = []
    for step in range(n_steps):
        if step == 3:
            runner.swap(0, 2)
        if step == 5:
            runner.remove("b")
            runner.add("d", [5, 6, 5, 6, 5])
        if step == 7:  # a preemption-like jump: the row holds a token the proposer was never told about
            row = runner.req_ids.index("a")
            n = int(runner.num_tokens_no_spec[row])
            runner.token_ids_cpu[row, n] = 3
            runner.num_tokens_no_spec[row] = n + 1
        sampled = runner.verify()
        drafts = step_fn(list(runner.req_ids), sampled, runner.num_tokens_no_spec, runner.token_ids_cpu,
                         num_prompt_tokens=runner.num_prompt_tokens)
        runner.drafts = {rid: d for rid, d in zip(runner.req_ids, drafts)}
        seen.append(drafts)
    return seen


def _runner() -> FakeRunner:
    runner = FakeRunner(max_model_len=48)
    for rid, prompt in (("a", [1, 2, 3, 1, 2, 3, 1, 2]), ("b", [4, 5, 4, 5, 4]), ("c", [7, 8, 9, 7, 8])):
        runner.add(rid, prompt)
    return runner


def test_overlapped_drafts_equal_the_in_process_core_step_for_step():
    options = SpecdecOptions.from_dict(OPTS)
    local = ProposerCore(build_proposer_drafter(options), options, max_model_len=48)  # the plugin's drafter
    expected = _steps(_runner(), local.step, 12)
    remote = OverlapCore(options, max_model_len=48)
    try:
        assert not remote.dead

        def deferred(*args, **kwargs):  # submit now, collect later (as the take hook does)
            remote.submit(*args, **kwargs)
            return remote.collect()

        got = _steps(_runner(), deferred, 12)
        assert got == expected
        assert any(len(d) for step in got for d in step)  # drafts were actually made
        stats = remote.stats()
        assert stats["steps"] == 12 and stats["late"] == 0 and stats["resyncs"] == 1  # the step-7 jump
        assert stats["contexts_sent"] == 5  # a, b, c at start, d when it joined, a after the jump
    finally:
        remote.close()
    assert remote.proc.poll() is not None  # the helper exited


def test_a_late_reply_gives_an_empty_step_and_is_dropped_later():
    options = SpecdecOptions.from_dict({**OPTS, "draft_timeout_ms": 0.001})
    remote = OverlapCore(options, max_model_len=1 << 16)
    try:
        # a 30k-token prompt: the helper needs milliseconds to index it, far past the 1 µs deadline
        prompt = np.random.default_rng(0).integers(0, 50, size=30_000).astype(np.int32)
        tokens = np.zeros((1, 30_002), np.int32)
        tokens[0, :30_000] = prompt
        tokens[0, 30_000] = 7
        remote.submit(["long"], [[7]], np.array([30_001]), tokens, num_prompt_tokens=np.array([30_000]))
        assert remote.collect() == [[]]  # late: no drafts for this step
        time.sleep(1.0)
        remote.timeout_s = None
        tokens[0, 30_001] = 8
        remote.submit(["long"], [[8]], np.array([30_002]), tokens)
        drafts = remote.collect()  # the late reply arrives first and is skipped by its sequence number
        assert drafts is not None and len(drafts) == 1
        assert remote.counters["late"] == 1 and remote.counters["dropped_replies"] == 1
        assert remote.counters["contexts_sent"] == 1  # the helper kept the request: no resend
    finally:
        remote.close()


def test_a_dead_helper_turns_drafting_off_without_failing_steps(caplog):
    remote = OverlapCore(SpecdecOptions.from_dict(OPTS), max_model_len=48)
    remote.proc.kill()
    remote.proc.wait()
    runner = _runner()
    for _ in range(3):
        remote.submit(list(runner.req_ids), runner.verify(), runner.num_tokens_no_spec, runner.token_ids_cpu,
                      num_prompt_tokens=runner.num_prompt_tokens)
        assert remote.collect() == [[], [], []]
    assert remote.dead
    assert sum("drafting is off" in r.getMessage() for r in caplog.records) == 1


def test_a_bad_drafter_option_reports_at_start_and_drafts_nothing(caplog):
    remote = OverlapCore(SpecdecOptions.from_dict({**OPTS, "drafter": "no-such-drafter"}), max_model_len=48)
    assert remote.dead
    assert any("no-such-drafter" in r.getMessage() for r in caplog.records)
    remote.close()


def test_row_store_reads_only_rows_that_carried_a_context():
    store = RowStore({1: [5, 6, 7]})
    assert store[1, :2].tolist() == [5, 6]
    with pytest.raises(KeyError):
        store[0, :2]
    assert np.asarray(store[1, :3]).dtype == np.int64


def test_proposer_benchmark_modes_emit_the_same_tokens():
    """eval/bench_proposer_cpu: the fake engine verifies greedily (and replaces finished requests), so every mode
    (native step or Python path, in-process or overlapped) emits the same tokens."""
    from benchmarks.bench_proposer_cpu import FakeEngine, run
    from specdec.eval.records import TraceRecord

    rng = np.random.default_rng(1)
    records = [TraceRecord(str(i), rng.integers(0, 20, 40), np.tile(rng.integers(0, 20, 6), 12)) for i in range(3)]
    eng = FakeEngine(records, records, 400)
    resp = records[0].response_ids.tolist()
    sampled = eng.verify([resp[:3] + [99], [], []])  # 3 right, then wrong: 3 accepted + the target's token
    assert sampled[0] == resp[:4] and sampled[1] == records[1].response_ids.tolist()[:1]
    out = {m: run(m, records, records, k=4, steps=60, engine_work_ms=0.0)
           for m in ("sync", "sync-python", "overlap")}
    emitted = {m: r["emitted_tokens"] for m, r in out.items()}
    assert len(set(emitted.values())) == 1 and emitted["overlap"] > 3 * 62  # drafts were accepted
    assert out["sync-python"]["requests_started"] > 3  # finished requests were replaced
