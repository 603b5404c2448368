"""Test-only fault injection (``SPECDEC_TEST_FAULTS``, ``faults.py``): a drafter that raises or sleeps past the
deadline on every Nth drafting call never fails a step, its failures and late steps are counted, and the emitted
tokens are those of a run without faults (drafts only drop), on every proposer path."""

from __future__ import annotations

import logging
import random
import time
from types import SimpleNamespace

import numpy as np
import pytest

from core_support import target_sequence
from specdec.config import ConfigError
from specdec.drafters.suffix import SuffixDrafter, native_available
from specdec.vllm_plugin.faults import FAULTS_ENV, SLEEP_WITHOUT_DEADLINE_S, Faults, FaultyDrafter, inject_faults
from specdec.vllm_plugin.modes.schedule import ScheduledDrafting
from specdec.vllm_plugin.patches.table import PatchReport
from specdec.vllm_plugin.proposer import SpecdecProposer
from test_vllm_backoff import STEP_S, K, drive_schedule, make_core

pytestmark = pytest.mark.skipif(not native_available(), reason="native suffix core not built")

ROWS = 4
MAX_LEN = 2048
EVERY = 7  # a fault every 7th drafting call
TIMEOUT_MS = 5.0


def test_fault_specs_parse_and_a_bad_one_names_the_variable_and_the_fix():
    f = Faults.parse("raise:100", timeout_ms=50.0)
    assert f is not None and (f.raise_every, f.sleep_every) == (100, 0)
    f = Faults.parse(" raise:3 , sleep:5 ", timeout_ms=50.0)
    assert f is not None and (f.raise_every, f.sleep_every) == (3, 5) and f.sleep_s == pytest.approx(0.1)
    assert Faults.parse("sleep:1", timeout_ms=0.0).sleep_s == SLEEP_WITHOUT_DEADLINE_S
    assert Faults.parse("  ", timeout_ms=50.0) is None
    drafter = SuffixDrafter()
    assert inject_faults(drafter, "", timeout_ms=50.0) is drafter
    for bad in ("raise", "raise:0", "explode:3", "sleep:x"):
        with pytest.raises(ConfigError, match=f"{FAULTS_ENV}=.*kind:N.*unset it"):
            Faults.parse(bad, timeout_ms=50.0)


def test_the_wrapper_raises_and_sleeps_on_schedule_and_is_the_drafter_otherwise():
    faults = Faults(raise_every=3, sleep_every=4, sleep_s=0.0)
    wrapped = FaultyDrafter(SuffixDrafter(backend="native"), faults)
    assert wrapped.name == "suffix" and wrapped.native_lane() is not None
    wrapped.start("a", [1, 2, 3, 1, 2])
    outcomes = []
    for _ in range(12):
        try:
            slept = faults.hit("test")
            outcomes.append("sleep" if slept else "ok")
        except RuntimeError:
            outcomes.append("raise")
    # raises on calls 3, 6, 9, 12; sleeps every 4th from half a period: calls 2, (6: the raise wins), 10
    assert outcomes == ["ok", "sleep", "raise", "ok", "ok", "raise", "ok", "ok", "raise", "sleep", "ok", "raise"]
    assert faults.as_dict() == {"test_fault_calls": 12, "test_faults_raised": 4, "test_faults_slept": 2}
    assert wrapped.active_requests() == ["a"] and wrapped.memory_bytes() > 0


def test_equal_periods_raise_and_sleep_on_different_calls():
    faults = Faults(raise_every=100, sleep_every=100, sleep_s=0.0)
    due = [faults.due() for _ in range(1000)]
    assert [i + 1 for i, d in enumerate(due) if d == "raise"] == list(range(100, 1001, 100))
    assert [i + 1 for i, d in enumerate(due) if d == "sleep"] == list(range(50, 1000, 100))


def proposer(monkeypatch, faults: str, *, python: bool = False, **opts) -> SpecdecProposer:
    """A proposer built as vLLM builds it (fake config), with ``SPECDEC_TEST_FAULTS`` set to ``faults``; ``python``:
    the suffix drafter's Python backend (no native lane: the Python engine drafts)."""
    if faults:
        monkeypatch.setenv(FAULTS_ENV, faults)
    else:
        monkeypatch.delenv(FAULTS_ENV, raising=False)
    cfg = SimpleNamespace(
        additional_config={"specdec": {"draft_timeout_ms": TIMEOUT_MS, **opts}},
        speculative_config=SimpleNamespace(num_speculative_tokens=K),
        model_config=SimpleNamespace(max_model_len=MAX_LEN),
    )
    drafter = SuffixDrafter(backend="python") if python else None
    return SpecdecProposer(cfg, drafter=drafter, patch_runner=False, patches=PatchReport("test"))


def run_greedy(prop: SpecdecProposer, steps: int, seed: int = 0) -> dict[str, list[int]]:
    """``ROWS`` requests decoding repetitive targets through ``prop.propose`` (greedy verification of its drafts,
    rows shuffled every step); returns each request's tokens. Every draft must be a chain of at most k tokens."""
    rng = random.Random(seed)
    targets = {f"r{i}": target_sequence(seed * 10 + i, 1500) for i in range(ROWS)}
    seq = {rid: t[:50] for rid, t in targets.items()}
    drafts: dict[str, list[int]] = {}
    for _ in range(steps):
        order = list(seq)
        rng.shuffle(order)
        sampled = []
        for rid in order:
            got: list[int] = []
            for d in drafts.get(rid, []) + [None]:
                got.append(targets[rid][len(seq[rid])])
                seq[rid].append(got[-1])
                if d != got[-1]:
                    break
            sampled.append(got)
        tokens = np.zeros((len(order), MAX_LEN), np.int32)  # [rows, max_model_len]
        for row, rid in enumerate(order):
            tokens[row, : len(seq[rid])] = seq[rid]
        lengths = np.array([len(seq[r]) for r in order], np.int32)
        prompts = np.full(len(order), 50, np.int32)
        prop.bind_step(SimpleNamespace(req_ids=order, num_prompt_tokens=prompts))
        time.sleep(STEP_S)  # the GPU's step: a late drafting job on the deadline thread finishes within a few
        out = prop.propose(sampled, lengths, tokens)
        assert len(out) == len(order) and all(len(d) <= K for d in out)
        drafts = dict(zip(order, out))
    for rid, s in seq.items():
        assert s == targets[rid][: len(s)]  # lossless
    return seq


MODES = {
    "sync-lane": {"async": False},
    "sync-python": {"async": False, "python": True},
    "thread": {"async": True, "async_mode": "thread"},
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind", ["raise", "sleep"])
def test_a_faulty_drafter_never_fails_a_step_and_the_outputs_are_those_without_faults(
    monkeypatch, plugin_log, mode, kind
):
    steps = 90
    clean = run_greedy(proposer(monkeypatch, "", **MODES[mode]), steps)
    prop = proposer(monkeypatch, f"{kind}:{EVERY}", **MODES[mode])
    assert sum("injecting drafter faults" in r.getMessage() for r in plugin_log()) == 1
    assert isinstance(prop.core.guard.drafter, FaultyDrafter)
    faulty = run_greedy(prop, steps)
    for rid, s in faulty.items():  # the same tokens (the target's) as without faults, whatever the drafts
        n = min(len(s), len(clean[rid]))
        assert s[:n] == clean[rid][:n] and len(s) >= 50 + steps  # at least a token per step
    st = prop.stats()
    assert st["test_fault_calls"] >= 3 * EVERY  # a drafting call per step, but while a late one still runs
    if kind == "raise":
        assert st["test_faults_raised"] >= 3 and st["draft_errors"] == st["test_faults_raised"]
    else:
        assert st["test_faults_slept"] >= 3 and st["draft_timeouts"] >= 1
    assert st["accepted_tokens"] >= 20  # drafting went on between the faults
    prop.close()


@pytest.mark.parametrize("kind", ["raise", "sleep"])
def test_schedule_mode_with_a_faulty_drafter_stays_lossless_and_counts_the_faults(kind, caplog):
    caplog.set_level(logging.WARNING)
    clock = SimpleNamespace(t=0.0)
    targets = {f"r{i}": target_sequence(40 + i, 1500) for i in range(ROWS)}
    core = make_core("matrix", lambda: clock.t, draft_timeout_ms=TIMEOUT_MS)
    faults = Faults.parse(f"{kind}:{EVERY}", timeout_ms=TIMEOUT_MS)
    assert faults is not None
    hit = faults.hit

    def late_on_the_clock(where: str) -> bool:
        slept = hit(where)
        if slept:
            clock.t += faults.sleep_s
        return slept

    faults.hit = late_on_the_clock  # type: ignore[method-assign]  # the deadline is checked on the batch's clock
    core.guard.drafter = FaultyDrafter(core.guard.drafter, faults)
    if core.lane is not None:
        core.engine.lane = core.guard.drafter.native_lane()
    sched = ScheduledDrafting(core, k=K, max_rows=ROWS, device="cpu")
    seq, _ = drive_schedule(sched, targets, clock, steps=120, seed=4)
    for rid, s in seq.items():
        assert s == targets[rid][: len(s)]  # lossless
    st = sched.stats()
    sched.close()
    assert st["test_fault_calls"] >= 3 * EVERY
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    if kind == "raise":
        assert st["test_faults_raised"] >= 5 and st["draft_errors"] == st["test_faults_raised"]
        # one line for the kind, the drafter guard's, whichever drafting path raised (as in thread mode)
        assert sum("failed for request(s)" in m for m in warned) == 1, warned
    else:
        assert st["test_faults_slept"] >= 3 and st["draft_timeouts"] >= 3
        assert sum("took longer than draft_timeout_ms" in m for m in warned) == 1, warned
    assert st["accepted_tokens"] >= 20
