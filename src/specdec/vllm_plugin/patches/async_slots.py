"""vLLM patches of ``draft_slots="adaptive"`` in schedule mode (``async_sched.py``): each request's draft slots.

``wrap_schedule``: ``AsyncScheduler.schedule`` (start) gives each running decoding request, instead of the
``k`` draft placeholders vLLM reserved at the end of the previous schedule, the slots of its latest draft
(``slots.SlotBook``, ``regrant_placeholders``), and with the book's ``prefill_cap`` (``prefill_step_slots``) caps
them when the step about to be scheduled will carry a prefill (``cap_prefill_steps``); a pass-through while no slot
book is registered (another method, uniform slots). Where ``schedule`` is not the one this patch was written
against, ``wrap_update``: ``_update_after_schedule`` (end) trims the placeholders as vLLM hands them
out instead (``trim_placeholders``: one drafting round older, no cap).
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

from specdec.vllm_plugin.logs import LOGGER_NAME
from specdec.vllm_plugin.modes.slots import PLACEHOLDER, book_of
from specdec.vllm_plugin.modes.tp import send_width
from specdec.vllm_plugin.patches.common import is_wrapped, signature_problem, source_has
from specdec.vllm_plugin.patches.features import Feature

logger = logging.getLogger(LOGGER_NAME)

SCHEDULER_SOURCE = "spec_token_ids = self._spec_token_placeholders"  # vLLM 0.26-0.32: the placeholders it hands out
SCHEDULE_SOURCE = "request.num_tokens_with_spec"  # vLLM 0.26-0.32's schedule: 1 + len(spec_token_ids) per decode
# prefill_step_slots applies to steps with at least this many prompt tokens to compute: from there a step is
# compute-bound on an H100/H200 whatever the dense model (the GEMMs' ridge is ~300 tokens), and each verified draft
# token costs its full share. Below it the cap is not applied: capping every step with any prefill cost short
# prompts arriving into a running batch more than it gained on long prompts.
PREFILL_HEAVY_TOKENS = 512


def scheduler_problem(scheduler_cls: Any) -> str:
    """'' if ``scheduler_cls._update_after_schedule`` is the one the slot patch was written for, else the reason."""
    orig = getattr(scheduler_cls, "_update_after_schedule", None)
    if orig is None:
        return "_update_after_schedule is missing"
    if signature_problem(scheduler_cls, {"_update_after_schedule": ["self", "scheduler_output"]}):
        return "_update_after_schedule has an unexpected signature"
    return "" if source_has(orig, SCHEDULER_SOURCE) else "_update_after_schedule is not the one patched"


def schedule_problem(scheduler_cls: Any) -> str:
    """'' if ``scheduler_cls.schedule`` is the one the slot re-grant and ``prefill_step_slots`` were written for."""
    orig = getattr(scheduler_cls, "schedule", None)
    if orig is None or not source_has(orig, SCHEDULE_SOURCE):
        return "schedule is not the one the slot re-grant and prefill_step_slots were written for"
    return ""


def wrap_update(orig: Any, scheduler_cls: Any) -> Any:
    """``_update_after_schedule`` (end): where ``schedule`` is not wrapped (``wrap_schedule``), each request's
    placeholders trimmed as vLLM hands them out (``trim_placeholders``). The slot book comes from the scheduler's
    own ``vllm_config`` (``slots.book_of``): the proposer of the same engine attached it."""
    logged: list[bool] = []
    # True: the start of `schedule` sets every step's final slots (its row applies before this one)
    regrants = is_wrapped(getattr(scheduler_cls, "schedule", None), Feature.SLOT_REGRANT.label)

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

    return _update_after_schedule


def wrap_schedule(orig_schedule: Any, scheduler_cls: Any) -> Any:
    """``schedule`` (start): every running request's slots from the latest drafts (``regrant_placeholders``), then
    the prefill steps' cap (``cap_prefill_steps``) if the book has one; (end) the width the book chose goes to the
    ranks under TP > 1."""
    logged: list[bool] = []

    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        book = book_of(getattr(self, "vllm_config", None))
        if book is not None:
            try:
                regrant_placeholders(self, book)
                if book.prefill_cap >= 0:
                    cap_prefill_steps(self, book)
            except Exception as exc:  # noqa: BLE001 - scheduling must never fail because of drafting
                book = None
                if not logged:
                    logged.append(True)
                    logger.warning("specdec: per-request draft slots failed (%r); vLLM's slots stay (logged once)", exc)
        out = orig_schedule(self, *args, **kwargs)
        if book is not None:
            send_width(out, book)  # TP > 1: the driver drafts to the width the book chose (modes/tp.py)
        return out

    return schedule


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
