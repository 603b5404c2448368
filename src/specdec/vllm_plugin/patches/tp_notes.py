"""vLLM patches of schedule mode under tensor parallelism: the driver's slot notes reach the scheduler's book.

1. ``GPUModelRunner.sample_tokens`` (end): on the drafting rank, the latest drafting's ``SlotNote`` goes onto the
   step's ``ModelRunnerOutput`` (the async output's wrapped one), which vLLM pickles to the scheduler. Each note is
   sent once.
2. ``AsyncScheduler.update_from_output`` (start): a note on the output feeds the scheduler's own slot book
   (``modes/tp.scheduler_book``), which the slot patches of ``async_slots.py`` read as they read the one-GPU book.

Both are pass-throughs for every other engine (no note is ever made without TP > 1 in schedule mode).
"""

from __future__ import annotations

import logging
from typing import Any

from specdec.vllm_plugin.attrs import SLOT_NOTE_ATTR, WRAPPED_OUTPUT
from specdec.vllm_plugin.logs import LOGGER_NAME
from specdec.vllm_plugin.modes.tp import scheduler_book
from specdec.vllm_plugin.patches.common import is_ours, signature_problem

logger = logging.getLogger(LOGGER_NAME)

RUNNER_SIGNATURES = {"sample_tokens": ["self", "grammar_output"]}
SCHEDULER_SIGNATURES = {"update_from_output": ["self", "scheduler_output", "model_runner_output"]}


def runner_problem(runner_cls: Any) -> str:
    """'' if ``sample_tokens`` has the leading parameters (self, grammar_output), else the reason."""
    return signature_problem(runner_cls, RUNNER_SIGNATURES)


def scheduler_problem(scheduler_cls: Any) -> str:
    """'' if ``update_from_output`` has the leading parameters (self, scheduler_output, model_runner_output)."""
    return signature_problem(scheduler_cls, SCHEDULER_SIGNATURES)


def attach_note(runner: Any, output: Any) -> bool:
    """Put the drafting's latest note on ``output`` (the runner's return value of ``sample_tokens``) once. True if
    one went."""
    drafter = getattr(runner, "drafter", None)
    if not is_ours(drafter):
        return False
    sched = getattr(drafter, "scheduled", None)
    note = getattr(sched, "latest_note", None)
    if note is None:
        return False
    target = getattr(output, WRAPPED_OUTPUT, output)
    try:
        setattr(target, SLOT_NOTE_ATTR, note)
    except (AttributeError, TypeError):
        return False
    sched.latest_note = None
    return True


def wrap_sample_tokens(orig: Any, runner_cls: Any) -> Any:
    """``sample_tokens`` (end): the drafting's latest note onto the step's output (item 1)."""

    def sample_tokens(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = orig(self, *args, **kwargs)
        if out is not None:
            attach_note(self, out)
        return out

    return sample_tokens


def wrap_update_from_output(orig: Any, scheduler_cls: Any) -> Any:
    """``update_from_output`` (start): a note on the output feeds the scheduler's slot book (item 2)."""
    logged: list[bool] = []

    def update_from_output(self: Any, scheduler_output: Any, model_runner_output: Any, *args: Any, **kw: Any) -> Any:
        note = getattr(model_runner_output, SLOT_NOTE_ATTR, None)
        if note is not None:
            try:
                scheduler_book(getattr(self, "vllm_config", None), note)
            except Exception as exc:  # noqa: BLE001 - scheduling must never fail because of drafting
                if not logged:
                    logged.append(True)
                    logger.warning("specdec: a slot note could not be read (%r); slots follow older notes", exc)
        return orig(self, scheduler_output, model_runner_output, *args, **kw)

    return update_from_output
