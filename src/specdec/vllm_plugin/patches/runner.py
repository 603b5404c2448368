"""Runner hooks of the synchronous and thread modes (``GPUModelRunner``).

- ``propose_draft_token_ids`` (start): hands our proposer the step's input batch (request ids by row), which vLLM's
  ``propose`` call does not carry (``SpecdecProposer.bind_step``). Without it the proposer reads the batch from the
  calling frame.
- ``take_draft_token_ids`` (start): thread mode's drafts are collected there, after vLLM's scheduler has processed
  the step's outputs (``SpecdecProposer.collect_deferred``). Needs the runner to keep custom_class drafts as a list
  in ``_draft_token_ids``. Without it thread mode collects in ``propose``.
- ``execute_model`` (start): thread mode sees each step's scheduler output as vLLM starts executing it (finished
  requests stop, new ones start while the GPU runs: ``SpecdecProposer.prepare_step``). Without it they start and
  stop when the step drafts. In every mode a step that schedules no token (the engine goes idle) logs the statistics
  line with the totals (``SpecdecProposer.note_idle``; schedule mode's ``execute_model`` hook does too, so that it
  does without this row: the second call of a step logs nothing).
- ``_input_fits_in_drafter`` (every mode): vLLM runs no drafter for a step in which any request is within
  ``num_speculative_tokens`` of ``max_model_len`` (its guard for drafters that run the model past that length) and
  hands the next step zeros as every request's drafts, which it then verifies: while one request nears its end, the
  whole batch drafts nothing that can be accepted. Our drafts never reach past ``max_model_len`` (each row's draft is
  cut to the room it has, ``ProposerCore``), so for our drafter every step fits. Without it such steps verify zeros.
  ``NEAR_END_ON`` False leaves vLLM's guard as it is (the GPU gate's before/after of 455f854: docs/results.md).

Each wrapper (``wrap_*``: original method, the runner class -> wrapper; ``patches.table`` applies them) is a
pass-through for any drafter that is not ours. Never imports vLLM.
"""

from __future__ import annotations

from typing import Any

from specdec.vllm_plugin.patches.common import is_ours, leading_params

BIND_PARAMS = ["self", "scheduler_output"]  # leading parameters of propose_draft_token_ids and execute_model
FITS_PARAMS = ["self", "common_attn_metadata"]
NEAR_END_ON = True  # drafts near max_model_len (module docstring); False: vLLM's guard as it is


def bind_problem(runner_cls: Any) -> str:
    """'' if ``propose_draft_token_ids`` is the one the bind hook was written for, else the reason."""
    fn = getattr(runner_cls, "propose_draft_token_ids", None)
    if fn is None:
        return "propose_draft_token_ids is missing"
    params = leading_params(fn)
    return "" if params[:2] == BIND_PARAMS else f"propose_draft_token_ids{params} has an unexpected signature"


def take_problem(runner_cls: Any) -> str:
    """'' if ``take_draft_token_ids`` is the one thread mode's collection was written for, else the reason."""
    fn = getattr(runner_cls, "take_draft_token_ids", None)
    if fn is None or not hasattr(runner_cls, "_get_draft_token_ids_cpu"):
        return "take_draft_token_ids or _get_draft_token_ids_cpu is missing"
    params = leading_params(fn)
    return "" if params == ["self"] else f"take_draft_token_ids{params} has an unexpected signature"


def execute_problem(runner_cls: Any) -> str:
    """'' if ``execute_model`` is the one thread mode's early starts and stops were written for, else the reason."""
    fn = getattr(runner_cls, "execute_model", None)
    if fn is None:
        return "execute_model is missing"
    params = leading_params(fn)
    return "" if params[:2] == BIND_PARAMS else f"execute_model{params} has an unexpected signature"


def fits_problem(runner_cls: Any) -> str:
    """'' if ``_input_fits_in_drafter`` is vLLM's guard this row was written for (and the row is switched on), else
    the reason."""
    if not NEAR_END_ON:
        return "switched off (NEAR_END_ON)"
    fn = getattr(runner_cls, "_input_fits_in_drafter", None)
    if fn is None:
        return "_input_fits_in_drafter is missing"
    params = leading_params(fn)
    return "" if params[:2] == FITS_PARAMS else f"_input_fits_in_drafter{params} has an unexpected signature"


def wrap_fits(orig: Any, runner_cls: Any) -> Any:
    """``_input_fits_in_drafter``: every step with attention metadata fits our drafter (module docstring)."""

    def _input_fits_in_drafter(self: Any, common_attn_metadata: Any, *args: Any, **kwargs: Any) -> bool:
        if common_attn_metadata is not None and is_ours(getattr(self, "drafter", None)):
            return True
        return orig(self, common_attn_metadata, *args, **kwargs)

    return _input_fits_in_drafter


def wrap_bind(orig: Any, runner_cls: Any) -> Any:
    """``propose_draft_token_ids``: hands our proposer the step's input batch first."""

    def propose_draft_token_ids(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        drafter = getattr(self, "drafter", None)
        if is_ours(drafter):
            drafter.bind_step(self.input_batch, scheduler_output)
        return orig(self, scheduler_output, *args, **kwargs)

    return propose_draft_token_ids


def wrap_take(orig: Any, runner_cls: Any) -> Any:
    """``take_draft_token_ids``: thread mode's drafts collected first."""

    def take_draft_token_ids(self: Any) -> Any:
        drafter = getattr(self, "drafter", None)
        if is_ours(drafter):
            drafts = drafter.collect_deferred()
            if drafts is not None and isinstance(getattr(self, "_draft_token_ids", None), list):
                self._draft_token_ids = drafts
        return orig(self)

    return take_draft_token_ids


def wrap_execute(orig: Any, runner_cls: Any) -> Any:
    """``execute_model``: an idle step logs the totals, then thread mode sees the step's scheduler output."""

    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        drafter = getattr(self, "drafter", None)
        if is_ours(drafter):
            drafter.note_idle(scheduler_output)
            drafter.prepare_step(scheduler_output)
        return orig(self, scheduler_output, *args, **kwargs)

    return execute_model
