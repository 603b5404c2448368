"""What ``ProposerCore`` reports: its statistics (``stats_dict``), the periodic log line (and the same line with the
totals when the engine goes idle, ``log_idle``, and once more when the drafting process exits or the core closes,
``log_final``, so a run shorter than ``log_every_s`` leaves its totals in the log; a line never repeats the totals
of the line before it), the drafter's size gauges sampled between steps (``metrics.drafter``) and the one-time
warning on a drafting timeout.

``ProposerReporting`` is a mixin of ``ProposerCore`` (``core/proposer_core.py``): it reads the core's statistics,
guard, engines, step-cost fits and back-off, and keeps its own state (``_init_reporting``).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing.util
import weakref
from collections.abc import Callable
from typing import Any

from specdec.drafters.base import DraftGuard
from specdec.vllm_plugin.core.backoff import BackOff
from specdec.vllm_plugin.core.engine import StepEngine
from specdec.vllm_plugin.core.lane import Lane
from specdec.vllm_plugin.core.policy import DraftingPolicy
from specdec.vllm_plugin.core.python_engine import PythonEngine
from specdec.vllm_plugin.core.state import ProposerStats
from specdec.vllm_plugin.core.user_options import CoreOptions
from specdec.vllm_plugin.faults import FaultyDrafter
from specdec.vllm_plugin.logs import LOGGER_NAME
from specdec.vllm_plugin.metrics.drafter import SAMPLE_PERIOD_S, drafter_gauges

logger = logging.getLogger(LOGGER_NAME)
FINAL_LOG_PRIORITY = 10  # multiprocessing's exit finalizers run highest first: before logging's own shutdown


class ProposerReporting:
    """The reporting of ``ProposerCore`` (see the module docstring)."""

    options: CoreOptions
    stats: ProposerStats
    guard: DraftGuard
    clock: Callable[[], float]
    python: PythonEngine
    engine: StepEngine
    lane: Lane | None
    policy: DraftingPolicy
    backoff: BackOff

    def _init_reporting(self) -> None:
        """The reporting's own state: nothing logged or sampled yet."""
        self._timeout_logged = False
        self._last_log = self.clock()
        self.drafter_state: dict[str, int] = {}  # the drafter's size gauges, last sample (metrics.drafter)
        self._sampled_at = -float("inf")
        self._sample_failed = False
        self._logged_steps = 0  # the step count of the last statistics line logged (periodic, idle or final)
        # exit hooks: atexit for the main process and spawned ones; a forked process (vLLM's engine core by default)
        # leaves by os._exit after multiprocessing's own exit finalizers, so one of those too
        final = weakref.WeakMethod(self.log_final)
        atexit.register(_log_final_if_alive, final)
        multiprocessing.util.Finalize(None, _log_final_if_alive, args=(final,), exitpriority=FINAL_LOG_PRIORITY)

    def on_timeout(self, n: int) -> None:
        self.stats.timeouts += 1
        self.guard.stats.timeouts += 1
        if not self._timeout_logged:
            self._timeout_logged = True
            logger.warning(
                "specdec: drafting %d request(s) took longer than draft_timeout_ms=%.1f; that step goes "
                "on without drafts (counted as draft_timeouts; not logged again)",
                n,
                self.options.draft_timeout_ms,
            )

    def _drafter_idle(self) -> bool:
        """Whether the drafter may be called now (no drafting job of the deadline thread still running)."""
        worker = self.python.worker
        return worker is None or not worker.busy

    def _maybe_sample(self) -> None:
        """Refresh ``drafter_state`` at most every SAMPLE_PERIOD_S, on this (the drafting) thread, between steps.
        A failed read keeps the last sample (logged once): statistics never fail a step."""
        now = self.clock()
        if now - self._sampled_at < SAMPLE_PERIOD_S or not self._drafter_idle():
            return
        self._sampled_at = now
        try:
            self.drafter_state = drafter_gauges(self.guard.drafter)
        except Exception as exc:  # noqa: BLE001 - a gauge must never fail a step
            if not self._sample_failed:
                self._sample_failed = True
                logger.warning("specdec: reading the drafter's size failed (%r); its gauges stay as they were", exc)

    def stats_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = self.stats.as_dict()
        d.update(self.guard.stats.as_dict())
        d["draft_timeouts"] = self.stats.timeouts
        d["active_requests"] = len(self.engine.request_ids)
        d["native_step"] = self.lane is not None
        d["cost_model"] = {str(b): c.as_dict() for b, c in sorted(self.policy.costs.items())}
        d["inline_drafting"] = self.python.inline_ok
        d["pad_token_us"] = 1e6 * self.policy.token_s
        d["step_period_ms"] = 1e3 * self.policy.period_s
        d["max_threaded_job_ms"] = 1e3 * self.python.max_job_s
        d["drafter_state"] = dict(self.drafter_state)
        d.update(self.backoff.as_dict())
        if isinstance(self.guard.drafter, FaultyDrafter):  # test-only fault injection (faults.py)
            d.update(self.guard.drafter.faults.as_dict())
        return d

    def _maybe_log(self) -> None:
        every = self.options.log_every_s
        now = self.clock()
        if every > 0 and now - self._last_log >= every:
            self._last_log = now
            self._log_line("specdec")

    def log_idle(self) -> bool:
        """The statistics line with the totals when the engine goes idle (its last requests finished), so a server
        leaves its totals in the log whenever traffic stops. Only when there were steps since the last line
        (``log_every_s`` 0: never). True if logged. The periodic line then counts ``log_every_s`` from here."""
        if not self._steps_unlogged():
            return False
        self._last_log = self.clock()
        self._log_line("specdec: idle")
        return True

    def log_final(self) -> None:
        """The statistics line once more, with the totals, when the drafting process exits or the core closes,
        whichever comes first: only when there were steps since the last line (``log_every_s`` 0: never)."""
        if self._steps_unlogged():
            self._log_line("specdec: final")

    def _steps_unlogged(self) -> bool:
        """Whether the totals have steps no statistics line showed yet (always False with ``log_every_s`` 0)."""
        return self.options.log_every_s > 0 and self.stats.steps != self._logged_steps

    def _log_line(self, prefix: str) -> None:
        s = self.stats
        self._logged_steps = s.steps
        logger.info(
            "%s: %d steps (%d with drafts), drafted %d, accepted %d (%.1f%%), %.3f ms/step in propose, "
            "%d timeouts, %d errors, %d plain steps, %d requests backed off (low acceptance; %d back-offs, "
            "%d recoveries, %d newcomers held so far; verified drafted steps %d before any back-off, "
            "%d after a recovery; %d steps gated)%s",
            prefix,
            s.steps,
            s.drafted_steps,
            s.drafted_tokens,
            s.accepted_tokens,
            100 * s.accepted_tokens / max(s.drafted_tokens, 1),
            1e3 * s.propose_seconds / s.steps,
            s.timeouts,
            self.guard.stats.errors,
            s.plain_steps,
            self.backoff.requests_off,
            self.backoff.stats.requests_backed_off,
            self.backoff.stats.recoveries,
            self.backoff.stats.newcomers_held,
            self.backoff.stats.outcomes_first,
            self.backoff.stats.outcomes_recovered,
            self.backoff.stats.gated_steps,
            ", batch not padded" if self.backoff.low() else "",
        )


def _log_final_if_alive(method: weakref.WeakMethod) -> None:
    """At the drafting process's exit: the core's final statistics line, if the core still exists."""
    log_final = method()
    if log_final is None:
        return
    raise_exceptions = logging.raiseExceptions
    logging.raiseExceptions = False  # a handler whose stream closed before the exit hooks ran stays silent
    try:
        with contextlib.suppress(Exception):  # the process is exiting: a statistics line must not fail that
            log_final()
    finally:
        logging.raiseExceptions = raise_exceptions
