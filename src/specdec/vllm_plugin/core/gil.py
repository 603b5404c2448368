"""Waits that hand the GIL back fast: ``quick_reacquire``.

The plugin's critical-path waits release the GIL: schedule mode's wait for the step's sampled tokens
(``torch.cuda.Event.synchronize``) right before the drafting the GPU waits for, and thread mode's wait for the
lane's drafts (``lane_collect``). While one of them waits, another Python thread of vLLM's process (the engine
core's output thread serialising the step's outputs, a worker's output thread) takes the GIL. When the wait ends,
CPython gives the GIL back only once that thread has run for the switch interval (5 ms by default) or blocks: the
drafting, and with it the GPU, waits up to 5 ms more on every step (``benchmarks/bench_gil_handoff.py`` measures
it). Around such a wait the switch interval is lowered to ``QUICK_SWITCH_S`` and restored once the waiting thread
holds the GIL again, so other threads still run during the wait and are asked to yield quickly after it. Never
imports vLLM.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

QUICK_SWITCH_S = 2e-4  # switch interval while a critical-path wait is pending (CPython's default: 5e-3)


@contextlib.contextmanager
def quick_reacquire(interval_s: float = QUICK_SWITCH_S) -> Iterator[None]:
    """Lower the interpreter's switch interval to ``interval_s`` for the body (a GIL-releasing wait), then restore
    it. Nested or concurrent uses restore what they found; a lower interval already set is kept."""
    before = sys.getswitchinterval()
    if interval_s >= before:
        yield
        return
    sys.setswitchinterval(interval_s)
    try:
        yield
    finally:
        sys.setswitchinterval(before)
