"""Schedule mode's device wait on a real GPU: the stream waits for the host's word, then copies the drafts."""

from __future__ import annotations

import time

import pytest
import torch

pytestmark = pytest.mark.gpu

ROWS, K = 8, 16
TIMEOUT_MS = 200.0


@pytest.fixture()
def dw():
    from specdec.vllm_plugin.modes.device_wait import DeviceWait

    wait, why = DeviceWait.create("cuda", timeout_ms=TIMEOUT_MS)
    assert wait is not None, why  # the self-test (stream waits, host releases) passed
    yield wait
    wait.close()


def test_the_copy_waits_for_the_release_and_carries_the_late_drafts(dw):
    host = torch.zeros((ROWS, K), dtype=torch.int32, pin_memory=True)
    dst = torch.full((ROWS, K), -1, dtype=torch.int32, device="cuda")
    _ = dst + 1  # load the kernel now: with lazy module loading, loading a kernel while the stream waits blocks
    torch.cuda.synchronize()  # the host (until the watchdog), which made this test fail on the H200 at first
    seq = dw.enqueue_copy(dst, host)
    after = dst + 1  # a kernel behind the wait (vLLM's scatter and forward stand here)
    behind = torch.cuda.Event()
    behind.record()
    time.sleep(0.02)
    assert not behind.query() and dw.flag.value() == seq - 1  # still waiting for the word
    host.copy_(torch.arange(ROWS * K, dtype=torch.int32).view(ROWS, K))  # the drafts, written after the enqueue
    dw.release(seq)
    torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), host) and torch.equal(after.cpu(), host + 1) and dw.fired() == 0


def test_the_watchdog_frees_a_stream_nobody_releases(dw):
    dst = torch.zeros(4, dtype=torch.int32, device="cuda")
    dw.enqueue_copy(dst, torch.ones(4, dtype=torch.int32, pin_memory=True))
    t0 = time.perf_counter()
    torch.cuda.synchronize()  # would hang without the watchdog
    assert time.perf_counter() - t0 < 10 * TIMEOUT_MS / 1e3 and dw.fired() == 1 and dst.tolist() == [1] * 4


def test_the_grace_runs_from_the_streams_arrival():
    """The stream marks its arrival at the wait; unreleased, it is freed ``grace_ms`` later, not at the stall bound."""
    from specdec.vllm_plugin.modes.device_wait import DeviceWait

    wait, why = DeviceWait.create("cuda", timeout_ms=10_000.0, grace_ms=20.0)
    assert wait is not None, why
    try:
        assert wait.grace_us == 20_000.0  # the self-test saw the arrival word written
        dst = torch.zeros(4, dtype=torch.int32, device="cuda")
        wait.enqueue_copy(dst, torch.ones(4, dtype=torch.int32, pin_memory=True))
        t0 = time.perf_counter()
        torch.cuda.synchronize()
        assert time.perf_counter() - t0 < 1.0 and wait.fired() == 1 and dst.tolist() == [1] * 4
    finally:
        wait.close()
