"""``core.gil.quick_reacquire``: the switch interval is lowered only around a critical-path wait and always restored;
schedule mode's wait for the sampled tokens and thread mode's wait for the lane's drafts run inside it."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from specdec.vllm_plugin.core.gil import QUICK_SWITCH_S, quick_reacquire


@pytest.fixture
def interval():
    before = sys.getswitchinterval()
    yield before
    sys.setswitchinterval(before)


def test_the_interval_is_lowered_for_the_body_and_restored(interval):
    with quick_reacquire():
        assert sys.getswitchinterval() == pytest.approx(QUICK_SWITCH_S)
        with quick_reacquire(1e-3):  # a higher interval inside keeps the lower one
            assert sys.getswitchinterval() == pytest.approx(QUICK_SWITCH_S)
        assert sys.getswitchinterval() == pytest.approx(QUICK_SWITCH_S)
    assert sys.getswitchinterval() == pytest.approx(interval)


def test_the_interval_is_restored_when_the_wait_raises(interval):
    with pytest.raises(RuntimeError), quick_reacquire():
        raise RuntimeError("the wait failed")
    assert sys.getswitchinterval() == pytest.approx(interval)


def test_a_lower_interval_already_set_is_kept(interval):
    sys.setswitchinterval(1e-4)
    with quick_reacquire():
        assert sys.getswitchinterval() == pytest.approx(1e-4)
    assert sys.getswitchinterval() == pytest.approx(1e-4)


class RecordingEvent:
    """A CUDA event stand-in that records the switch interval while the host waits on it."""

    def __init__(self) -> None:
        self.seen: list[float] = []

    def synchronize(self) -> None:
        self.seen.append(sys.getswitchinterval())


def test_schedule_modes_wait_for_the_sampled_tokens_hands_the_gil_back_quickly(interval):
    from specdec.vllm_plugin.modes.capture import Capture
    from specdec.vllm_plugin.modes.schedule import ScheduledDrafting
    from test_vllm_scheduled import K, make_core

    sched = ScheduledDrafting(make_core(lambda: 0.0), k=K, max_rows=4, device="cpu")
    event = RecordingEvent()
    sched._slot_view(0, 2, 3, sched.ring_np)[:] = [[5, 6, -1], [7, -1, -1]]  # as the capture's copy lands it
    tokens = sched._tokens(Capture(0, 2, 3, ["a", "b"], set(), event))
    assert tokens.tolist() == [[5, 6, -1], [7, -1, -1]]
    assert event.seen == [pytest.approx(QUICK_SWITCH_S)] and sys.getswitchinterval() == pytest.approx(interval)


def test_thread_modes_wait_for_the_lanes_drafts_hands_the_gil_back_quickly(interval):
    from specdec.vllm_plugin.modes.thread import ThreadedProposerCore

    seen: list[float] = []

    class Lane:
        def lane_collect(self, timeout: float | None) -> None:
            seen.append(sys.getswitchinterval())
            return None  # an overrun: the step gets no drafts

    core = SimpleNamespace(
        _ready=None,
        _plan=SimpleNamespace(rows=2, running=2),
        lane=Lane(),
        timeout_s=0.0,
        clock=lambda: 0.0,
        stats=SimpleNamespace(propose_seconds=0.0),
        stats_collect_seconds=0.0,
        _lane_overruns=0,
        on_timeout=lambda n: None,
        _end=lambda plan, drafts: drafts,
    )
    assert ThreadedProposerCore.collect(core) == [[], []]
    assert seen == [pytest.approx(QUICK_SWITCH_S)] and sys.getswitchinterval() == pytest.approx(interval)
