"""Synchronous drafting: vLLM's ``propose`` call drafts the step and returns its drafts.

The mode of a proposer whose drafting is not asynchronous (``async_drafting`` off), and the one a schedule-mode
proposer falls back to where vLLM runs without async scheduling (its runner then calls ``propose`` as for any
drafter). The step is ``ProposerCore.step``: the drafts vLLM verifies next come from the tokens it just sampled.
Each mode offers the proposer the same three calls (``propose``, ``prepare``, ``collect``); thread mode's are in
``modes/thread.py``, schedule mode drafts through the runner hooks instead (``modes/schedule.py``).
"""

from __future__ import annotations

from typing import Any

from specdec.vllm_plugin.core.batch import StepBatch
from specdec.vllm_plugin.core.proposer_core import ProposerCore


class SyncDrafting:
    """Drafts inside ``propose``; nothing happens before a step or after it."""

    def __init__(self, core: ProposerCore) -> None:
        self.core = core

    def propose(self, batch: StepBatch) -> list[list[int]]:
        """The step's drafts per row."""
        return self.core.step(batch)

    def prepare(self, scheduler_output: Any) -> None:
        """Nothing to do as vLLM starts a step: requests start and stop when the step drafts."""

    def collect(self) -> list[list[int]] | None:
        """None: the drafts were returned by ``propose``."""
        return None
