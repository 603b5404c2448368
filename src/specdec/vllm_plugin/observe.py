"""Timing hooks for benchmarks: schedule mode's drafting tells an observer the wall time of each of its phases, so a
benchmark (``benchmarks/step_timer.py``) times them without wrapping the plugin's private methods.

One public function registers an observer with every specdec proposer of this process::

    observe(observer)   # None: no observer (the default)

and schedule mode then calls ``observer.drafting_phase(phase, seconds)`` after each phase of ``PHASES``
(``modes/phases.py``), each call's wall time, whether it returned or raised. While no observer is set each phase
costs one ``is None`` check (in ``CaptureRing._observed``).
"""

from __future__ import annotations

from specdec.vllm_plugin.modes.phases import (
    OUTER_PHASES,
    PHASE_CAPTURE,
    PHASE_FILL,
    PHASE_FINISH,
    PHASE_TOKENS,
    PHASE_WAIT,
    PHASES,
    DraftingObserver,
)
from specdec.vllm_plugin.proposer import INSTANCES

__all__ = [
    "PHASES",
    "PHASE_CAPTURE",
    "PHASE_FILL",
    "PHASE_FINISH",
    "PHASE_TOKENS",
    "PHASE_WAIT",
    "OUTER_PHASES",
    "DraftingObserver",
    "observe",
]


def observe(observer: DraftingObserver | None) -> int:
    """Give every live specdec proposer of this process ``observer`` (None: remove it); a proposer's schedule-mode
    drafting built later gets it too. Returns the number of proposers. Call it after the engine was built, in the
    process that holds its model runner."""
    proposers = list(INSTANCES)
    for proposer in proposers:
        proposer.observe(observer)
    return len(proposers)
