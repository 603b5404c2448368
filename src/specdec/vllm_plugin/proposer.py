"""The proposer vLLM constructs for ``method="custom_class"``.

The speculative config names it as ``model="specdec.vllm_plugin.proposer.SpecdecProposer"``.

vLLM calls ``SpecdecProposer(vllm_config)`` in the model runner (``GPUModelRunner.__init__``) and then, each step,
``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None) -> list[list[int]]``.
That call carries no request ids; the plugin's runner patch (a "request ids" row of ``patches.table``) hands the
proposer the runner's input batch (``input_batch.req_ids``, row order of this step) just before each call.

Tensor parallelism: every TP rank builds a runner and a proposer. In schedule mode (the default there) TP rank 0
drafts and broadcasts its draft buffer to the other ranks on the GPU (``modes/tp.py``). In thread mode the engine
reads drafts from one rank only (``take_draft_token_ids`` is a collective RPC answered by the executor's output
rank, TP rank 0 with PP=1) and sends the scheduled drafts to all ranks. Either way only TP rank 0 builds a drafter
and a drafting core: the other ranks load no draft model and keep no drafter state (``core`` is None there).
This module imports vLLM only inside functions (CPU tests build it from a fake ``vllm_config``).
"""

from __future__ import annotations

import logging
import os
import sys
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from specdec.drafters.base import Drafter
from specdec.drafters.registry import build_drafter
from specdec.vllm_plugin.core.batch import StepBatch
from specdec.vllm_plugin.core.proposer_core import ProposerCore
from specdec.vllm_plugin.entry.options import (
    SpecdecOptions,
    estimate_params,
)
from specdec.vllm_plugin.faults import FAULTS_ENV, inject_faults
from specdec.vllm_plugin.logs import LOGGER_NAME
from specdec.vllm_plugin.metrics.server import start_exporter
from specdec.vllm_plugin.modes.device_wait import STALL_TIMEOUT_MS, DeviceWait
from specdec.vllm_plugin.modes.phases import DraftingObserver
from specdec.vllm_plugin.modes.schedule import ScheduledDrafting
from specdec.vllm_plugin.modes.slots import SlotBook, attach_book, book_of
from specdec.vllm_plugin.modes.sync import SyncDrafting
from specdec.vllm_plugin.modes.thread import ThreadDrafting, ThreadedProposerCore
from specdec.vllm_plugin.modes.tp import DRIVER_RANK, NoteMaker, TpFollower, tp_broadcast
from specdec.vllm_plugin.patches.features import Feature
from specdec.vllm_plugin.patches.graph_stats import GraphStats, graph_stats_of
from specdec.vllm_plugin.patches.table import PatchReport, apply_patches
from specdec.vllm_plugin.settings import engine_settings, resolve

logger = logging.getLogger(LOGGER_NAME)
INSTANCES: weakref.WeakSet[SpecdecProposer] = weakref.WeakSet()  # live proposers of this process (for stats)


def build_proposer_drafter(options: SpecdecOptions, *, target_tokenizer: str = "") -> Drafter:
    """The drafter named by the options. ``target_tokenizer``: the served model's tokenizer folder; a model drafter
    refuses a different tokenizer."""
    return build_drafter(options.drafter, options.resolved_drafter_options(target_tokenizer))


def _tp_rank() -> int:
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # noqa: BLE001 - not initialised (UniProc tests) -> behave as the driver
        return 0


class SpecdecProposer:
    """vLLM custom_class proposer backed by a specdec drafter (see the module docstring)."""

    specdec_proposer = True  # ``patches.common.PROPOSER_MARK``: the runner patches recognise us by it

    def __init__(
        self,
        vllm_config: Any,
        *,
        drafter: Drafter | None = None,
        patch_runner: bool = True,
        patches: PatchReport | None = None,
    ) -> None:
        """``patch_runner``: apply the patch table (its model-runner rows; the plugin's entry point applied the
        others in this process already, so those report as they stand) and log the start-up line, once per engine;
        ``patches``: the report to act on instead (tests)."""
        self.vllm_config = vllm_config
        self.patches = apply_patches("all") if patch_runner else (patches or PatchReport("unknown"))
        if patch_runner:
            logger.info("%s", self.patches.line())
        self.settings = engine_settings(vllm_config) or resolve(vllm_config)  # the options, resolved once
        self.options = self.settings.options
        model_config = getattr(vllm_config, "model_config", None)
        max_model_len = int(getattr(model_config, "max_model_len", 0) or 1 << 30)
        tokenizer = str(getattr(model_config, "tokenizer", "") or "")
        target_tokenizer = tokenizer if os.path.isdir(tokenizer) else ""  # local folders only (no hub access)
        params = estimate_params(getattr(model_config, "hf_config", None))
        self.schedule_mode, self.threaded = self.settings.schedule, self.settings.threaded
        self.scheduled: Any = None  # ScheduledDrafting, built at the first step under vLLM's async scheduling
        self.observer: DraftingObserver | None = None  # timing hook of its drafting (``observe.py``)
        self.drafts_here = _tp_rank() == DRIVER_RANK  # vLLM builds the runner after its process groups
        self.core: ProposerCore | None = None  # the drafting core: TP rank 0 only
        self.drafting: SyncDrafting | ThreadDrafting | None = None  # the mode's calls (schedule mode: the hooks')
        if self.drafts_here:
            drafter = drafter or build_proposer_drafter(self.options, target_tokenizer=target_tokenizer)
            self.core = self._build_core(drafter, max_model_len=max_model_len, params=params)
            if isinstance(self.core, ThreadedProposerCore):
                self.drafting = ThreadDrafting(self.core, hand_off=self.patches.on(Feature.THREAD_HAND_OFF))
            else:
                self.drafting = SyncDrafting(self.core)
        logger.info(
            "specdec: drafter=%s k=%d pad_drafts=%s (target ~%.0fM parameters) async=%s",
            self.options.drafter,
            self.settings.k,
            self.options.pad_mode,
            params / 1e6,
            self.options.async_mode if self.options.async_drafting else "off",
        )
        self._input_batch: Any = None
        self._scheduler_output: Any = None
        self._warned_unbound = False
        self._idle_failed = False
        INSTANCES.add(self)
        self.exporter = start_exporter(self.options, self.stats, vllm_config=vllm_config, tp_rank=_tp_rank)

    def _build_core(self, drafter: Drafter, *, max_model_len: int, params: float) -> ProposerCore:
        """The drafting core of this mode. Schedule mode: with vLLM's uniform k slots every row is padded to k;
        with adaptive slots the drafts stay cut (their lengths are the next step's slots), and below the narrow
        steps every row keeps k slots, padded."""
        opts = self.options
        core_options = self.settings.core_options()
        faults = os.environ.get(FAULTS_ENV, "")  # test only (the soak's --faults): never a user option
        core = (ThreadedProposerCore if self.threaded else ProposerCore)(
            inject_faults(drafter, faults, timeout_ms=opts.draft_timeout_ms) if faults else drafter,
            core_options,
            max_model_len=max_model_len,
            internal=self.settings.internal,
            target_params=params,
        )
        if self.schedule_mode and opts.draft_slots == "adaptive":
            core.policy.use_adaptive_slots()
        return core

    # ----------------------------------------------------------------- runner binding
    def bind_step(self, input_batch: Any, scheduler_output: Any = None) -> None:
        """Called by the runner patch before every ``propose``: this step's input batch (req ids by row)."""
        self._input_batch = input_batch
        self._scheduler_output = scheduler_output

    def _batch(self) -> Any:
        if self._input_batch is not None:
            return self._input_batch
        frame = sys._getframe(2)  # fallback: the runner method that called propose()
        runner = frame.f_locals.get("self") if frame is not None else None
        return getattr(runner, "input_batch", None)

    # ----------------------------------------------------------------- vLLM's call
    def propose(
        self,
        sampled_token_ids: Sequence[Sequence[int]],
        num_tokens_no_spec: np.ndarray,
        token_ids_cpu: np.ndarray,
        slot_mappings: Any = None,
    ) -> list[list[int]]:
        """Drafts per row: ``sampled_token_ids`` [num_reqs] lists, ``num_tokens_no_spec`` [max_num_reqs] int32,
        ``token_ids_cpu`` [max_num_reqs, max_model_len] int32. Never raises (a bookkeeping failure -> no drafts)."""
        n = len(sampled_token_ids)
        if self.drafting is None:  # a TP rank other than 0: the engine reads rank 0's drafts
            return [[] for _ in range(n)]
        inputs = self._batch()  # vLLM's input batch: the rows' request ids and prompt lengths
        if inputs is None:
            if not self._warned_unbound:
                self._warned_unbound = True
                logger.warning(
                    "specdec: no request ids from the model runner (runner patch not applied to this "
                    "vLLM version); drafting is disabled, generation goes on without speculation"
                )
            return [[] for _ in range(n)]
        req_ids = list(inputs.req_ids)
        prompts = getattr(inputs, "num_prompt_tokens", None)
        step = StepBatch(req_ids, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, prompts, self._dynamic_k())
        try:
            return self.drafting.propose(step)
        except Exception as exc:  # noqa: BLE001 - a request must never fail because of drafting
            self._drafting_failed(exc, [str(r) for r in req_ids[:n]])
            return [[] for _ in range(n)]

    def _drafting_failed(self, exc: Exception, req_ids: list[str]) -> None:
        """``ProposerCore.drafting_failed`` (the core's options are these: ``strict`` re-raises there)."""
        assert self.core is not None  # only a drafting rank drafts
        self.core.drafting_failed(exc, req_ids)

    def prepare_step(self, scheduler_output: Any) -> None:
        """Called by the runner patch as vLLM starts executing a step (thread mode: finished requests stop and new
        ones start on the drafter's thread while the GPU runs). Never raises (the next step catches up)."""
        if self.drafting is None:
            return
        try:
            self.drafting.prepare(scheduler_output)
        except Exception as exc:  # noqa: BLE001 - a request must never fail because of drafting
            self._drafting_failed(exc, [])

    def note_idle(self, scheduler_output: Any) -> None:
        """Called by the runner patches as vLLM starts executing a step: a step that schedules no token (vLLM's engine
        core runs one after its last requests finish, to send their ids) means the engine goes idle, and the drafting
        core logs its statistics line with the totals (``ProposerReporting.log_idle``: only if there were steps since
        the last line, so a second call for the same step logs nothing). A TP rank without a core logs nothing. Never
        raises (a statistics line must never fail a step; a failure is logged once)."""
        if self.core is None or getattr(scheduler_output, "total_num_scheduled_tokens", None) != 0:
            return
        try:
            if self.core.log_idle():
                self._log_graphs("specdec: idle graphs")
        except Exception as exc:  # noqa: BLE001 - a statistics line must never fail a step
            if not self._idle_failed:
                self._idle_failed = True
                logger.warning("specdec: the idle statistics line failed (%r); later failures are not logged", exc)

    def _log_graphs(self, prefix: str) -> None:
        """Where this engine's verify batches ran so far: FULL graphs of ours or vLLM's piecewise graphs (a step
        vLLM's own uniform graphs ran is in neither)."""
        g = self.graph_stats
        logger.info(
            "%s: plain %d and narrow %d steps on FULL graphs, %d on piecewise; ragged %d FULL (%d with prompt "
            "chunks), %d piecewise",
            prefix,
            g.plain_full,
            g.narrow_full - g.plain_full,
            g.narrow_piecewise,
            g.ragged_full,
            g.ragged_prefill_full,
            g.ragged_piecewise,
        )

    @property
    def graph_stats(self) -> GraphStats:
        """This engine's counts of the CUDA graphs the plugin added (shared with its dispatcher through the config)."""
        return graph_stats_of(self.vllm_config)

    def scheduled_for(self, runner: Any) -> Any:
        """The ``ScheduledDrafting`` of this proposer (schedule mode under vLLM's async scheduling), or None. Under
        TP > 1, TP rank 0 drafts and broadcasts the drafts, the other ranks receive them (``TpFollower``)."""
        if not self.schedule_mode:
            return None
        if self.scheduled is None:
            k = self.settings.k  # vLLM's speculative config's (the runner's num_spec_tokens is the same number)
            tp = int(getattr(getattr(self.vllm_config, "parallel_config", None), "tensor_parallel_size", 1) or 1)
            share = tp_broadcast(runner.device) if tp > 1 else None
            if share is not None and self.core is None:
                self.scheduled = TpFollower(k=k, max_rows=int(runner.max_num_reqs), device=runner.device, share=share)
                logger.info("specdec: TP rank %d takes the drafts of TP rank %d (broadcast)", _tp_rank(), DRIVER_RANK)
                return self.scheduled
            if self.core is None:  # no TP group to receive drafts from: this rank proposes nothing
                return None
            self.scheduled = self._build_scheduled(self.core, runner, k, share=share)
        return self.scheduled

    def _build_scheduled(self, core: ProposerCore, runner: Any, k: int, *, share: Any) -> ScheduledDrafting:
        """The drafting rank's ``ScheduledDrafting``: its device wait, and its slot book (one GPU: attached to this
        engine's config, which its scheduler shares; TP > 1: notes sent to the scheduler's own book instead)."""
        opts, internal = self.options, self.settings.internal
        device_wait, why = None, "device_wait is off"
        if internal.device_wait:  # reached only through the runner hooks, which release it
            device_wait, why = DeviceWait.create(
                runner.device, timeout_ms=STALL_TIMEOUT_MS, grace_ms=opts.draft_timeout_ms
            )
        book, notes = None, None
        if opts.draft_slots == "adaptive":
            ragged = opts.ragged_graphs and self.patches.on(Feature.RAGGED_GRAPHS)
            narrow = bool(self.settings.narrow_widths) and self.patches.on(Feature.NARROW_GRAPHS)
            ragged_ready = self.graph_stats.ragged_ready if ragged else None
            low = core.backoff.low if core.backoff.enabled else None
            if share is None:
                book = SlotBook.policy(
                    k, narrow=narrow, prefill_cap=internal.prefill_step_slots, high_ragged=ragged_ready, low_batch=low
                )
                attach_book(self.vllm_config, book)  # this engine's scheduler trims each request's slots to it
            else:
                notes = NoteMaker(k, narrow, internal.prefill_step_slots, ragged_ready, low)
        scheduled = ScheduledDrafting(
            core,
            k=k,
            max_rows=int(runner.max_num_reqs),
            device=runner.device,
            device_wait=device_wait,
            slot_book=book,
            graph_stats=self.graph_stats,
            share=share,
            notes=notes,
        )
        scheduled.observer = self.observer
        logger.info(
            "specdec: drafting under vLLM's async scheduling (k=%d, up to %d rows; %s%s)",
            k,
            runner.max_num_reqs,
            "the GPU waits for drafts" if device_wait else f"host fill: {why}",
            "; drafts broadcast to the other TP ranks" if share is not None else "",
        )
        return scheduled

    def observe(self, observer: DraftingObserver | None) -> None:
        """Timing hook (``observe.observe``): schedule mode's drafting tells ``observer`` each phase's wall time."""
        self.observer = observer
        if isinstance(self.scheduled, ScheduledDrafting):
            self.scheduled.observer = observer

    def collect_deferred(self) -> list[list[int]] | None:
        """Drafts of the step submitted by the last ``propose`` (thread mode), or None if none is pending. Never raises
        (a failed step -> no drafts, counted and logged once)."""
        if self.drafting is None:
            return None
        try:
            return self.drafting.collect()
        except Exception as exc:  # noqa: BLE001 - a request must never fail because of drafting
            self._drafting_failed(exc, [])
            return None

    def _dynamic_k(self) -> int | None:
        k = getattr(self._scheduler_output, "num_spec_tokens_to_schedule", None)
        return int(k) if isinstance(k, int) and k > 0 else None

    def stats(self) -> dict[str, Any]:
        if self.scheduled is not None:
            out = self.scheduled.stats()
        else:
            out = self.core.stats_dict() if self.core is not None else {"drafting_rank": False}
        return {**out, "graphs": self.graph_stats.as_dict()}  # this engine's narrow and ragged dispatches and keys

    def close(self) -> None:
        if self.exporter is not None:
            self.exporter.close()
        if self.scheduled is not None:
            self.scheduled.close()
        book = self.scheduled.slot_book if self.scheduled is not None else None
        if book is not None and book_of(self.vllm_config) is book:
            attach_book(self.vllm_config, None)
        if self.core is not None:
            self.core.close()
