"""``specdec._host_flag.Flag``: the pinned sequence word of schedule mode's device wait and its watchdog."""

from __future__ import annotations

import time

import pytest
import torch

host_flag = pytest.importorskip("specdec._host_flag", reason="the _host_flag extension is not built")

DEADLINE_US = 2_000.0  # the watchdog's deadline in these tests
IN_TIME_US = 100_000.0  # the deadline of a value released at once: no scheduling hiccup of a loaded machine reaches it
LONG_US = 5_000_000.0  # a deadline no test reaches


def _word() -> tuple[torch.Tensor, object]:
    word = torch.zeros(32, dtype=torch.int32)
    return word, host_flag.Flag(word.data_ptr())


def _wait_for(pred, timeout_s: float = 2.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.001)
    return pred()


def test_release_only_raises_the_word_cyclically():
    word, flag = _word()
    assert flag.release(3) and word[0].item() == 3 and flag.value() == 3
    assert not flag.release(2) and word[0].item() == 3  # never lowered
    word[0] = -5  # 0xFFFFFFFB: 2 is "after" it cyclically, as the driver's GEQ compares
    assert flag.release(2) and word[0].item() == 2
    flag.close()


def test_the_watchdog_stores_the_armed_value_at_the_deadline_unless_released():
    word, flag = _word()
    flag.arm(5, DEADLINE_US)
    assert _wait_for(lambda: word[0].item() == 5) and flag.fired() == 1
    flag.arm(7, LONG_US)
    flag.release(7)  # the owner released in time: the deadline stores nothing, nothing counted
    flag.arm(8, IN_TIME_US)
    flag.release(8)
    time.sleep(3 * IN_TIME_US / 1e6)
    assert word[0].item() == 8 and flag.fired() == 1
    flag.arm(9, LONG_US)
    flag.arm(10, LONG_US)  # 9 was never released: stored now, counted like a deadline
    assert word[0].item() == 9 and flag.fired() == 2
    assert flag.stalls() == 2  # both were the long deadline (no reached word here): stalls
    flag.close()


def test_bad_arguments_and_a_closed_flag_name_the_problem():
    with pytest.raises(ValueError, match="4-byte aligned"):
        host_flag.Flag(3)
    word, flag = _word()
    with pytest.raises(ValueError, match="timeout_us must be > 0"):
        flag.arm(1, 0.0)
    flag.close()
    flag.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        flag.release(1)


def test_grace_runs_from_the_gpu_reaching_the_wait():
    """With a reached word (the stream writes seq there as it starts waiting) the watchdog stores the value
    ``grace`` after it sees the arrival, however long before that the value was armed."""
    block = torch.zeros(32, dtype=torch.int32)
    word, reached = block[0:1], block[16:17]  # separate cache lines, as DeviceWait lays them out
    flag = host_flag.Flag(word.data_ptr(), reached.data_ptr())
    flag.arm(1, LONG_US, DEADLINE_US)
    time.sleep(10 * DEADLINE_US / 1e6)  # the GPU still runs the previous step: grace has not started
    assert word.item() == 0 and flag.fired() == 0
    reached[0] = 1  # the stream arrives at the wait
    assert _wait_for(lambda: word.item() == 1) and flag.fired() == 1
    assert flag.stalls() == 0  # the grace stored it: drafting was late, the stream was not stuck
    flag.arm(2, LONG_US, IN_TIME_US)
    reached[0] = 2
    flag.release(2)  # the owner in time: nothing stored by the watchdog
    time.sleep(3 * IN_TIME_US / 1e6)
    assert word.item() == 2 and flag.fired() == 1
    flag.close()
