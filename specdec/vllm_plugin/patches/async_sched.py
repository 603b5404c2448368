"""vLLM patches of ``async_mode="schedule"`` (see ``scheduled.py``): the async-scheduling whitelist, runner hooks.

1. ``patch_vllm_config``: ``VllmConfig.__post_init__`` refuses async scheduling for ``custom_class`` methods. For
   our proposer only, with ``"async": true, "async_mode": "schedule"``, PP = 1, and only when the method's
   source still contains the whitelist test this patch was written against, ``custom_class`` is added to the
   whitelist's ``NgramGPUTypes`` for the duration of that call (the module global is restored right after).
   vLLM then applies the side effects it applies to every async speculative method (cascade attention off).
   Anything unexpected: logged once, synchronous scheduling stays.
2. ``patch_async_runner``: three ``GPUModelRunner`` methods, each a pass-through unless the runner's drafter is
   our proposer in schedule mode and the runner really uses async scheduling:
   - ``_bookkeeping_sync`` (start): the valid-token counts vLLM's async path needs
     (``_copy_valid_sampled_token_count``, which must run before the bookkeeping, as for vLLM's GPU drafters)
     and the capture of the sampled tokens;
   - ``propose_draft_token_ids``: returns the draft buffer (``ScheduledDrafting.submit``);
   - ``_prepare_input_ids`` (start): fills the buffer (``ScheduledDrafting.fill``), or with the device wait
     enqueues the stream's wait and the buffer's copy;
   - ``_model_forward`` (start): drafts a deferred fill and releases the stream (``ScheduledDrafting.finish``):
     every input of the step is enqueued by then, and the forward's launch is the next thing; later host work
     of ``execute_model`` may block on the stream (vLLM 0.26's logits GEMM did), so not later;
   - ``execute_model`` (end, always): drafts and releases if the step never reached the forward (an error, an
     early return).
3. ``patch_async_scheduler`` (``draft_slots="adaptive"``): ``AsyncScheduler.schedule`` (start) gives each
   running decoding request, instead of the ``k`` draft placeholders vLLM reserved at the end of the previous
   schedule, the slots of its latest draft (``slots.SlotBook``, ``regrant_placeholders``), and with the book's
   ``prefill_cap`` (``prefill_step_slots``) caps them when the step about to be scheduled will carry a prefill
   (``cap_prefill_steps``); a pass-through while no slot book is registered (another method, uniform slots).
   Where ``schedule`` is not the one this patch was written against, ``_update_after_schedule`` (end) trims the
   placeholders as vLLM hands them out instead (``trim_placeholders``: one drafting round older, no cap).
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Callable
from typing import Any, Literal, get_args

import numpy as np

from specdec.vllm_plugin.core.slots import PLACEHOLDER, book_of
from specdec.vllm_plugin.entry.options import (
    ADDITIONAL_CONFIG_KEY,
    PROPOSER_PATH,
    SpecdecOptions,
    async_mode_for,
    normalise_keys,
)
from specdec.vllm_plugin.logs import LOGGER_NAME
from specdec.vllm_plugin.modes.tp import width_of_schedule
from specdec.vllm_plugin.patches.common import is_ours, is_wrapped, mark, signature_problem, source_has

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
SCHEDULER_SOURCE = "spec_token_ids = self._spec_token_placeholders"  # vLLM 0.26-0.32: the placeholders it hands out
SCHEDULE_SOURCE = "request.num_tokens_with_spec"  # vLLM 0.26-0.32's schedule: 1 + len(spec_token_ids) per decode
# prefill_step_slots applies to steps with at least this many prompt tokens to compute: from there a step is
# compute-bound on an H100/H200 whatever the dense model (the GEMMs' ridge is ~300 tokens), and each verified draft
# token costs its full share. Capping every step with any prefill cost code prompts (~50 tokens, one
# arriving as one finishes) 8% at batch 64 and gained agentic prompts (~1,500 tokens) 2-4%.
PREFILL_HEAVY_TOKENS = 512


def wants_schedule(additional_config: Any, vllm_config: Any = None) -> bool:
    """True if our options (``additional_config["specdec"]``) ask for async_mode='schedule', or for 'auto' and
    ``vllm_config`` (its target's size, TP, PP) resolves it so (``options.async_mode_for``)."""
    ours = additional_config.get(ADDITIONAL_CONFIG_KEY) if isinstance(additional_config, dict) else None
    if not isinstance(ours, dict):
        return False
    ours = normalise_keys(ours)
    if not ours.get("async_drafting", SpecdecOptions.async_drafting):
        return False
    return async_mode_for(ours.get("async_mode", SpecdecOptions.async_mode), vllm_config) == "schedule"


def is_schedule_config(config: Any) -> bool:
    """``config`` (a ``VllmConfig``) runs our proposer and asks for schedule mode."""
    spec = getattr(config, "speculative_config", None)
    return (
        spec is not None
        and getattr(spec, "method", None) == "custom_class"
        and getattr(spec, "model", None) == PROPOSER_PATH
        and wants_schedule(getattr(config, "additional_config", None), config)
    )


def whitelist_problem(module: Any) -> str:
    """'' if ``module`` (vLLM's ``vllm.config.vllm``) has the async-scheduling whitelist this patch was written for."""
    orig = getattr(getattr(module, "VllmConfig", None), "__post_init__", None)
    if orig is None or not hasattr(module, "NgramGPUTypes"):
        return "VllmConfig.__post_init__ or NgramGPUTypes is missing"
    return "" if source_has(orig, WHITELIST_SOURCE) else "the async-scheduling whitelist is not the one patched"


def wrap_post_init(
    module: Any, *, hooks_problem: Callable[[], str] = lambda: "", tp_problem: Callable[[], str] = lambda: ""
) -> bool:
    """Wrap ``VllmConfig.__post_init__`` of ``module`` (idempotent). Returns True if wrapped. ``hooks_problem``: the
    reason the runner hooks schedule mode needs cannot apply in this vLLM ('' if they can); ``tp_problem``: the
    same for the slot notes of TP > 1 (``tp_notes.py``). Asked only for our configurations, so no whitelist is
    lifted without its hooks."""
    if whitelist_problem(module):
        return False
    cls = module.VllmConfig
    orig = cls.__post_init__
    if is_wrapped(orig, "whitelist"):
        return True

    @functools.wraps(orig)
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

    cls.__post_init__ = mark(__post_init__, "whitelist")
    return True


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


def _finish_deferred(runner: Any) -> None:
    """Draft a deferred fill and release the stream waiting for it (device wait), if there is one."""
    sched = _scheduled(runner, create=False)
    if sched is not None and sched.deferred is not None:
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


def patch_async_runner(runner_cls: Any) -> bool:
    """Wrap the three runner methods (idempotent). Returns True if patched."""
    if async_runner_problem(runner_cls):
        return False
    if is_wrapped(runner_cls._bookkeeping_sync, "async_runner"):
        return True
    orig_book, orig_prop, orig_prep, orig_exec, orig_fwd = (
        runner_cls._bookkeeping_sync,
        runner_cls.propose_draft_token_ids,
        runner_cls._prepare_input_ids,
        runner_cls.execute_model,
        runner_cls._model_forward,
    )

    @functools.wraps(orig_book)
    def _bookkeeping_sync(self: Any, scheduler_output: Any, sampler_output: Any, *args: Any, **kwargs: Any) -> Any:
        sched = _scheduled(self)
        if sched is not None and self.speculative_config is not None:
            _capture(self, sched, sampler_output)
        return orig_book(self, scheduler_output, sampler_output, *args, **kwargs)

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

    @functools.wraps(orig_prep)
    def _prepare_input_ids(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        sched = _scheduled(self)
        if sched is not None and sched.job is not None:
            verified = getattr(scheduler_output, "total_num_scheduled_tokens", 0)
            width = 0
            if getattr(sched, "notes", None) is not None:  # TP > 1: the scheduler's grants tell a narrow step
                spec = getattr(scheduler_output, "scheduled_spec_decode_tokens", None)
                width = width_of_schedule(spec, sched.notes.k) if isinstance(spec, dict) else 0
            sched.fill(
                getattr(self, "_draft_token_ids", None),
                verified=verified if isinstance(verified, int) else 0,
                width=width,
            )
        return orig_prep(self, scheduler_output, *args, **kwargs)

    @functools.wraps(orig_exec)
    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return orig_exec(self, scheduler_output, *args, **kwargs)
        finally:  # whatever happened: a stream waiting for this step's drafts is released here
            _finish_deferred(self)

    @functools.wraps(orig_fwd)
    def _model_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        _finish_deferred(self)  # inputs enqueued: draft now and let the stream go on before the forward's launch
        return orig_fwd(self, *args, **kwargs)

    for fn in (_bookkeeping_sync, propose_draft_token_ids, _prepare_input_ids, execute_model, _model_forward):
        mark(fn, "async_runner")
    runner_cls._bookkeeping_sync = _bookkeeping_sync
    runner_cls.propose_draft_token_ids = propose_draft_token_ids
    runner_cls._prepare_input_ids = _prepare_input_ids
    runner_cls.execute_model = execute_model
    runner_cls._model_forward = _model_forward
    return True


def scheduler_problem(scheduler_cls: Any) -> str:
    """'' if ``scheduler_cls._update_after_schedule`` is the one the slot patch was written for, else the reason."""
    orig = getattr(scheduler_cls, "_update_after_schedule", None)
    if orig is None:
        return "_update_after_schedule is missing"
    if signature_problem(scheduler_cls, {"_update_after_schedule": ["self", "scheduler_output"]}):
        return "_update_after_schedule has an unexpected signature"
    return "" if source_has(orig, SCHEDULER_SOURCE) else "_update_after_schedule is not the one patched"


def patch_async_scheduler(scheduler_cls: Any) -> bool:
    """Wrap ``scheduler_cls._update_after_schedule`` (idempotent; see item 3 of the module docstring). Returns
    True if wrapped; False when the method is not the one this patch was written against. The slot book comes
    from the scheduler's own ``vllm_config`` (``slots.book_of``): the proposer of the same engine attached it."""
    if scheduler_problem(scheduler_cls):
        return False
    orig = scheduler_cls._update_after_schedule
    if is_wrapped(orig, "slots"):
        return True
    logged: list[bool] = []
    regrants = _wrap_schedule(scheduler_cls, logged)  # True: the start of `schedule` sets every step's final slots

    @functools.wraps(orig)
    def _update_after_schedule(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        out = orig(self, scheduler_output, *args, **kwargs)
        book = book_of(getattr(self, "vllm_config", None))
        if book is not None and not regrants:  # without the schedule hook: trimmed here, one drafting round older
            try:
                trim_placeholders(self, scheduler_output, book)
            except Exception as exc:  # noqa: BLE001 - scheduling must never fail because of drafting
                if not logged:
                    logged.append(True)
                    logger.warning(
                        "specdec: per-request draft slots failed (%r); vLLM's k slots stay (logged once)", exc
                    )
        return out

    scheduler_cls._update_after_schedule = mark(_update_after_schedule, "slots")
    return True


def _wrap_schedule(scheduler_cls: Any, logged: list[bool]) -> bool:
    """``schedule`` (start): every running request's slots from the latest drafts (``regrant_placeholders``), then
    the prefill steps' cap (``cap_prefill_steps``) if the book has one. Left alone when vLLM's ``schedule`` is not
    the one it was written against (logged; slots are then trimmed when vLLM reserves them, and no cap applies).
    Returns True if wrapped."""
    orig_schedule = getattr(scheduler_cls, "schedule", None)
    if orig_schedule is None or not source_has(orig_schedule, SCHEDULE_SOURCE):
        logger.info(
            "specdec: %s.schedule is not the one the slot re-grant and prefill_step_slots were written for; "
            "slots follow older drafts, no prefill cap",
            scheduler_cls.__name__,
        )
        return False

    @functools.wraps(orig_schedule)
    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        book = book_of(getattr(self, "vllm_config", None))
        if book is not None:
            try:
                regrant_placeholders(self, book)
                if book.prefill_cap >= 0:
                    cap_prefill_steps(self, book)
            except Exception as exc:  # noqa: BLE001 - scheduling must never fail because of drafting
                if not logged:
                    logged.append(True)
                    logger.warning("specdec: per-request draft slots failed (%r); vLLM's slots stay (logged once)", exc)
        return orig_schedule(self, *args, **kwargs)

    scheduler_cls.schedule = mark(schedule, "slots")
    return True


def prefill_tokens_pending(waiting: Any, running: Any, *, enough: int) -> int:
    """Context tokens vLLM still has to compute for waiting requests and running prompt chunks (an upper bound:
    prefix-cache hits are not known yet); counting stops once it reaches ``enough``."""
    total = 0
    for request in itertools.chain(waiting, (r for r in running if r.is_prefill_chunk)):
        total += max(0, request.num_tokens - request.num_computed_tokens)
        if total >= enough:
            break
    return total


def cap_prefill_steps(scheduler: Any, book: Any) -> int:
    """Before vLLM schedules a step: if it will carry a heavy prefill (at least ``PREFILL_HEAVY_TOKENS`` context
    tokens of waiting requests or running prompt chunks), every decoding request keeps at most
    ``book.prefill_cap`` draft placeholders (vLLM schedules ``1 + len(spec_token_ids)`` tokens for it). Returns the
    number of requests capped."""
    running = scheduler.running
    if prefill_tokens_pending(scheduler.waiting, running, enough=PREFILL_HEAVY_TOKENS) < PREFILL_HEAVY_TOKENS:
        return 0
    capped, taken = 0, 0
    for request in running:
        spec = request.spec_token_ids
        if request.is_prefill_chunk or not spec or spec[0] != PLACEHOLDER:
            continue  # a prefill chunk, no slots, or real draft ids (not schedule mode's placeholders)
        cap = book.prefill_cap
        if len(spec) <= cap:
            continue
        taken += len(spec) - cap
        request.spec_token_ids = book.placeholders(cap)
        capped += 1
    book.prefill_steps += 1
    book.prefill_trimmed += taken
    book.cap_grants()  # the growth's extra slots this step does not verify are not settled as unused
    return capped


def regrant_placeholders(scheduler: Any, book: Any) -> int:
    """Before vLLM schedules a step: every running request whose draft slots are placeholders (vLLM's shared list
    or one of the book's) gets the slots of its latest draft. vLLM reserved them at the end of the previous
    schedule, before the drafting of the step in flight had run; the book now holds that drafting's lengths, one
    round fresher (the slots of step N+2 follow step N+1's drafts, not step N's); on a narrow schedule
    (``SlotBook.width``) every one gets that many. Returns the requests changed."""
    shared = scheduler._spec_token_placeholders  # [k of the next step] (-1 each), one list for every request
    reserved = len(shared)
    if reserved == 0:
        return 0
    changed = 0
    book.begin_schedule(len(scheduler.running))
    for request in scheduler.running:
        spec = request.spec_token_ids
        if request.is_prefill_chunk or not (spec is shared or book.owns(spec)):
            continue  # a prompt chunk, or real draft ids (not schedule mode's placeholders)
        n = book.slots(request.request_id, reserved)
        if n != len(spec):
            request.spec_token_ids = shared if n == reserved else book.placeholders(n)
            changed += 1
    return changed


def trim_placeholders(scheduler: Any, scheduler_output: Any, book: Any) -> int:
    """Give each request vLLM just handed its shared placeholder list (decoding requests, not prefill chunks)
    ``book.slots`` placeholders instead: the fallback where ``schedule`` could not be wrapped (its re-grant then
    never runs). Returns the number of requests trimmed."""
    shared = scheduler._spec_token_placeholders  # [k of the next step] (-1 each), one list for every request
    reserved = len(shared)
    if reserved == 0:
        return 0
    trimmed = 0
    requests = scheduler.requests
    for rid in scheduler_output.num_scheduled_tokens:
        request = requests.get(rid)
        if request is None or request.spec_token_ids is not shared:
            continue
        n = book.slots(rid, reserved, fresh=False)  # the book is a round older here: no growth
        if n < reserved:
            request.spec_token_ids = book.placeholders(n)
            trimmed += 1
    return trimmed
