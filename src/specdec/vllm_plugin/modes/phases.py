"""The drafting phases schedule mode reports to a timing observer (``specdec.vllm_plugin.observe``), and the
observer's interface. Names only: no import of the plugin, so the modes and the hook's module both import it."""

from __future__ import annotations

from typing import Protocol

PHASE_CAPTURE = "capture"  # the runner's capture of a step's sampled tokens (``CaptureRing.capture``)
PHASE_FILL = "fill"  # the fill of the draft buffer, drafting inline when not deferred (``ScheduledDrafting.fill``)
PHASE_FINISH = "finish"  # a deferred fill's drafting, before the GPU's wait is released (``ScheduledDrafting.finish``)
PHASE_TOKENS = "tokens"  # reading a captured step's tokens (mostly waiting for the GPU to finish the step)
PHASE_WAIT = "wait"  # enqueueing the GPU's wait for the drafts and their copy (device wait; within a fill)
PHASES = (PHASE_CAPTURE, PHASE_FILL, PHASE_FINISH, PHASE_TOKENS, PHASE_WAIT)
# the phases vLLM's engine loop calls: their sum is the drafting's time on the engine thread (tokens and wait run
# inside them)
OUTER_PHASES = (PHASE_CAPTURE, PHASE_FILL, PHASE_FINISH)


class DraftingObserver(Protocol):
    """Told each drafting phase's wall time, on the drafting's thread, right after the phase."""

    def drafting_phase(self, phase: str, seconds: float) -> None: ...
