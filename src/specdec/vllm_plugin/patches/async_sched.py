"""vLLM patches of ``async_mode="schedule"`` (see ``scheduled.py``): the async-scheduling whitelist, runner hooks.

1. ``wrap_post_init``: ``VllmConfig.__post_init__`` refuses async scheduling for ``custom_class`` methods. For
   our proposer only, with ``"async": true, "async_mode": "schedule"``, PP = 1, and only when the method's
   source still contains the whitelist test this patch was written against, ``custom_class`` is added to the
   whitelist's ``NgramGPUTypes`` for the duration of that call (the module global is restored right after).
   vLLM then applies the side effects it applies to every async speculative method (cascade attention off).
   Anything unexpected: logged once, synchronous scheduling stays.
2. ``wrap_*``: five ``GPUModelRunner`` methods (one row each in ``patches.table``), each a pass-through unless the
   runner's drafter is our proposer in schedule mode and the runner really uses async scheduling:
   - ``_bookkeeping_sync`` (start): the valid-token counts vLLM's async path needs
     (``_copy_valid_sampled_token_count``, which must run before the bookkeeping, as for vLLM's GPU drafters)
     and the capture of the sampled tokens;
   - ``propose_draft_token_ids``: returns the draft buffer (``ScheduledDrafting.submit``);
   - ``_prepare_input_ids`` (start): fills the buffer (``ScheduledDrafting.fill``), or with the device wait
     enqueues the stream's wait and the buffer's copy; a step whose schedule holds no draft slot (a backed-off
     batch) waits for nothing: its drafting runs late, at the end of ``execute_model``, after the forward's launch;
   - ``_model_forward`` (start): drafts a deferred fill and releases the stream (``ScheduledDrafting.finish``):
     every input of the step is enqueued by then, and the forward's launch is the next thing; later host work
     of ``execute_model`` may block on the stream (vLLM 0.26's logits GEMM did), so not later;
   - ``execute_model`` (end, always): drafts a late fill, and drafts and releases if the step never reached the
     forward (an error, an early return). At its start, for our proposer in any mode: a step that schedules no
     token (the engine goes idle) logs the statistics line with the totals (``SpecdecProposer.note_idle``; the
     thread hand-off's ``execute_model`` hook calls it too, and the second call of a step logs nothing).
3. ``draft_slots="adaptive"``: the slot patches of ``AsyncScheduler``, in ``async_slots.py``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, Literal, get_args

import numpy as np

from specdec.vllm_plugin.entry.options import (
    ADDITIONAL_CONFIG_KEY,
    PROPOSER_PATH,
    options_from_vllm_config,
    schedule_mode_for,
)
from specdec.vllm_plugin.logs import LOGGER_NAME
from specdec.vllm_plugin.modes.tp import schedule_width
from specdec.vllm_plugin.patches.common import is_ours, signature_problem, source_has

logger = logging.getLogger(LOGGER_NAME)

WHITELIST_SOURCE = "get_args(NgramGPUTypes)"  # the expression of vLLM 0.26-0.32's async whitelist
RUNNER_SIGNATURES = {  # method -> leading parameters this patch relies on
    "_bookkeeping_sync": ["self", "scheduler_output", "sampler_output"],
    "propose_draft_token_ids": ["self", "scheduler_output", "sampled_token_ids"],
    "_prepare_input_ids": ["self", "scheduler_output"],
    "execute_model": ["self", "scheduler_output"],
    "_model_forward": ["self"],
}
RUNNER_METHODS = ("_copy_valid_sampled_token_count",)  # called by the capture hook


def wants_schedule(vllm_config: Any) -> bool:
    """True if the options of ``vllm_config`` (``additional_config["specdec"]``) ask for async_mode='schedule', or
    for 'auto' and the config (its target's size, TP, PP) resolves it so (``options.schedule_mode_for``, as
    ``EngineSettings`` decides). Runs inside ``VllmConfig.__post_init__``, before the config is final, so it reads
    the options through the one parser (``options_from_vllm_config``) without keeping an ``EngineSettings``."""
    extra = getattr(vllm_config, "additional_config", None)
    ours = extra.get(ADDITIONAL_CONFIG_KEY) if isinstance(extra, dict) else None
    if not isinstance(ours, dict):
        return False
    return schedule_mode_for(options_from_vllm_config(vllm_config), vllm_config)


def is_our_config(config: Any) -> bool:
    """``config`` (a ``VllmConfig``) runs our proposer."""
    spec = getattr(config, "speculative_config", None)
    return (
        spec is not None
        and getattr(spec, "method", None) == "custom_class"
        and getattr(spec, "model", None) == PROPOSER_PATH
    )


def is_schedule_config(config: Any) -> bool:
    """``config`` (a ``VllmConfig``) runs our proposer and asks for schedule mode."""
    return is_our_config(config) and wants_schedule(config)


def whitelist_problem(module: Any) -> str:
    """'' if ``module`` (vLLM's ``vllm.config.vllm``) has the async-scheduling whitelist this patch was written for."""
    orig = getattr(getattr(module, "VllmConfig", None), "__post_init__", None)
    if orig is None or not hasattr(module, "NgramGPUTypes"):
        return "VllmConfig.__post_init__ or NgramGPUTypes is missing"
    return "" if source_has(orig, WHITELIST_SOURCE) else "the async-scheduling whitelist is not the one patched"


def wrap_post_init(
    orig: Callable[..., Any],
    module: Any,
    *,
    hooks_problem: Callable[[], str] = lambda: "",
    tp_problem: Callable[[], str] = lambda: "",
) -> Callable[..., Any]:
    """The wrapper of ``module.VllmConfig.__post_init__`` (``orig``; item 1). ``hooks_problem``: the reason the
    runner hooks schedule mode needs cannot apply in this vLLM ('' if they can); ``tp_problem``: the same for the
    slot notes of TP > 1 (``tp_notes.py``). Asked only for our configurations, so no whitelist is lifted without
    its hooks."""

    def __post_init__(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not is_schedule_config(self):
            return orig(self, *args, **kwargs)
        par = getattr(self, "parallel_config", None)
        tp, pp = getattr(par, "tensor_parallel_size", 1), getattr(par, "pipeline_parallel_size", 1)
        why = "PP must be 1" if pp != 1 else hooks_problem() or (tp_problem() if tp > 1 else "")
        if why:
            logger.warning(
                "specdec: async_mode='schedule' unavailable (%s); vLLM schedules synchronously and "
                "specdec drafts in-process",
                why,
            )
            return orig(self, *args, **kwargs)
        saved = module.NgramGPUTypes
        module.NgramGPUTypes = Literal[(*get_args(saved), "custom_class")]  # type: ignore[misc]
        try:
            return orig(self, *args, **kwargs)
        finally:
            module.NgramGPUTypes = saved

    return __post_init__


def drafts_in_schedule_mode(runner: Any) -> bool:
    """The runner drafts with our proposer under vLLM's async scheduling (schedule mode)."""
    return is_ours(getattr(runner, "drafter", None)) and bool(getattr(runner, "use_async_scheduling", False))


def _scheduled(runner: Any, *, create: bool = True) -> Any:
    """The runner's ScheduledDrafting, or None when this runner does not draft in schedule mode. ``create``
    False: only an existing one (the forward hooks also run in vLLM's warm-up and CUDA-graph capture, where the
    device wait's start-up self-test must not run)."""
    if not drafts_in_schedule_mode(runner):
        return None
    return runner.drafter.scheduled_for(runner) if create else runner.drafter.scheduled


def _finish_deferred(runner: Any, *, late: bool = True) -> None:
    """Draft a deferred fill and release the stream waiting for it (device wait), if there is one; ``late`` False:
    only one the GPU waits for (a late fill, whose step verifies no draft, waits for the forward's launch)."""
    sched = _scheduled(runner, create=False)
    if sched is not None and sched.deferred is not None and (late or sched.gpu_waits):
        sched.finish()


def _capture(runner: Any, sched: Any, sampler_output: Any) -> None:
    sampled = sampler_output.sampled_token_ids  # [rows, k+1] on the GPU, -1 = rejected
    rows = int(sampled.shape[0])
    req_ids = list(runner.input_batch.req_ids[:rows])
    mask = runner.discard_request_mask  # vLLM's CpuGpuBuffer: .np on the host, .gpu on the device
    discard: dict[int, int] = {}
    for i in np.nonzero(mask.np[:rows])[0].tolist():  # the row's last context token (as vLLM's drafters do)
        try:
            discard[i] = int(
                runner.requests[req_ids[i]].get_token_id(int(runner.input_batch.num_tokens_no_spec[i]) - 1)
            )
        except (ValueError, IndexError, KeyError):
            discard[i] = 0
    device_mask = getattr(mask, "gpu", None)
    nxt, counts = sched.counts(sampled, discard, device_mask[:rows] if device_mask is not None else None)
    runner._copy_valid_sampled_token_count(nxt, counts)
    sched.capture(sampled, req_ids, set(discard), requests=runner.requests)


def async_runner_problem(runner_cls: Any) -> str:
    """'' if ``runner_cls`` has the methods schedule mode's hooks were written for, else the reason."""
    problem = signature_problem(runner_cls, RUNNER_SIGNATURES)
    if problem:
        return problem
    missing = [name for name in RUNNER_METHODS if not callable(getattr(runner_cls, name, None))]
    return f"{', '.join(missing)} missing" if missing else ""


def wrap_bookkeeping(orig_book: Callable[..., Any], runner_cls: Any) -> Callable[..., Any]:
    @functools.wraps(orig_book)
    def _bookkeeping_sync(self: Any, scheduler_output: Any, sampler_output: Any, *args: Any, **kwargs: Any) -> Any:
        sched = _scheduled(self)
        if sched is not None and self.speculative_config is not None:
            _finish_deferred(self)  # a late fill not drafted yet (no execute_model end in between): before the capture
            _capture(self, sched, sampler_output)
        return orig_book(self, scheduler_output, sampler_output, *args, **kwargs)

    return _bookkeeping_sync


def wrap_propose(orig_prop: Callable[..., Any], runner_cls: Any) -> Callable[..., Any]:
    @functools.wraps(orig_prop)
    def propose_draft_token_ids(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        sched = _scheduled(self)
        if sched is None:
            return orig_prop(self, scheduler_output, *args, **kwargs)
        k = getattr(scheduler_output, "num_spec_tokens_to_schedule", None)
        metadata = self.input_batch.sampling_metadata
        eager = bool(
            getattr(scheduler_output, "has_structured_output_requests", False)
            or getattr(metadata, "output_token_ids", None)
        )
        return sched.submit(list(self.input_batch.req_ids), k=k if isinstance(k, int) and k > 0 else None, eager=eager)

    return propose_draft_token_ids


def wrap_prepare(orig_prep: Callable[..., Any], runner_cls: Any) -> Callable[..., Any]:
    @functools.wraps(orig_prep)
    def _prepare_input_ids(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        sched = _scheduled(self)
        if sched is not None and sched.job is not None:
            verified = getattr(scheduler_output, "total_num_scheduled_tokens", 0)
            width = 0
            spec = getattr(scheduler_output, "scheduled_spec_decode_tokens", None)
            if getattr(sched, "notes", None) is not None:  # TP > 1: the scheduler tells a narrow step
                width = schedule_width(scheduler_output, sched.notes.k)
            sched.fill(
                getattr(self, "_draft_token_ids", None),
                verified=verified if isinstance(verified, int) else 0,
                width=width,
                needed=not isinstance(spec, dict) or any(spec.values()),  # no slot: a plain step waits for nothing
            )
        return orig_prep(self, scheduler_output, *args, **kwargs)

    return _prepare_input_ids


def wrap_execute(orig_exec: Callable[..., Any], runner_cls: Any) -> Callable[..., Any]:
    @functools.wraps(orig_exec)
    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        drafter = getattr(self, "drafter", None)
        if is_ours(drafter):
            drafter.note_idle(scheduler_output)  # an idle step: the statistics line with the totals
        try:
            return orig_exec(self, scheduler_output, *args, **kwargs)
        finally:  # whatever happened: a stream waiting for this step's drafts is released here
            _finish_deferred(self)

    return execute_model


def wrap_forward(orig_fwd: Callable[..., Any], runner_cls: Any) -> Callable[..., Any]:
    @functools.wraps(orig_fwd)
    def _model_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        _finish_deferred(self, late=False)  # inputs enqueued: draft now, let the stream go on, then the forward
        return orig_fwd(self, *args, **kwargs)

    return _model_forward
