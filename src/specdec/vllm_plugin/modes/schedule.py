"""Drafting under vLLM's async scheduling (``"async": true, "async_mode": "schedule"``).

With async scheduling vLLM's engine runs one step ahead of the GPU: while the GPU verifies step N, the CPU
schedules and prepares step N+1, and nothing waits for step N's tokens on the host. vLLM allows it only for
GPU drafters (EAGLE, ``ngram_gpu``): step N+1's drafts must be a GPU tensor (``runner._draft_token_ids``,
``[rows of step N, k]``), and the tokens in ``token_ids_cpu`` are ``-1`` placeholders. This module lets a CPU
drafter take part (the plugin lifts the whitelist for our method only, version-checked):

1. ``capture`` (runner hook at the start of ``_bookkeeping_sync``, every step): a non-blocking copy of the
   sampled tokens ``[rows, k+1]`` (``-1`` = rejected) to a pinned ring slot, on a side stream; the step's request
   ids, its discarded rows (partial prefills) and, for requests seen for the first time, their prompt. The same
   hook hands vLLM the GPU-side counts its async path needs (``valid_counts``: valid tokens and last token per
   row, tensor ops, no host sync), as vLLM's own GPU drafters do before the bookkeeping.
2. ``submit`` (instead of vLLM's ``propose_draft_token_ids``, same call): hands vLLM a GPU buffer
   ``[rows, k]`` as the drafts. The buffer is not filled yet.
3. ``fill`` (runner hook at the start of ``_prepare_input_ids`` of step N+1, the last moment before vLLM
   scatters the drafts into its input ids): waits for step N's copy (the GPU has finished step N by then, or
   nearly), turns the captured tokens into the rows ``ProposerCore.step`` expects (real tokens, real context
   lengths, contexts from this module's own token history), drafts, pads every row to k, and enqueues the
   host-to-device copy on the current stream, ahead of vLLM's scatter.
   With the device wait (``device_wait.py``, default where the driver allows) the fill only enqueues, on the
   stream, a wait on a pinned word and the copy of the pinned draft buffer, and stops finished requests; the
   drafting itself (``finish``) runs at the start of ``_model_forward``, once vLLM has enqueued the step's other
   inputs, and releases the wait. The GPU then idles for the drafting only. In the usual case (``matrix_step``)
   that drafting is one native call on the captured matrix that writes the padded drafts into the pinned buffer;
   the token record follows after the release (``_draft_from_matrix``).

So the GPU idles only for the drafting itself (not for vLLM's output processing and scheduling, which the
synchronous path also puts between two forward passes). vLLM's scheduler reserves k draft slots for every
decoding request (fixed k, or vLLM's ``num_speculative_tokens_per_batch_size`` schedule); with
``draft_slots="adaptive"`` (default) each request's next step keeps only as many as its latest draft has tokens
past the confidence cut (``slots.py``). Rows are padded with the drafter's chain past its confidence cut, then
filler, up to the buffer's width (any token id is lossless: verification decides; vLLM reads a row's first
slots only).

Fallbacks: a step whose drafts vLLM copies to the host right after sampling (structured output, penalties)
is filled at once (``eager``). A drafting error or overrun gives that step all-filler drafts (no speculation
in effect), counted and logged once. A request first seen mid-generation whose tokens are placeholders is
"blind": it gets filler drafts for the rest of its life (counted). Under TP > 1 only TP rank 0 drafts and
broadcasts the buffer (``tp.py``); PP > 1 is refused at start.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from specdec.vllm_plugin.core.batch import StepBatch
from specdec.vllm_plugin.logs import LOGGER_NAME
from specdec.vllm_plugin.modes.capture import CaptureRing
from specdec.vllm_plugin.modes.feed import leading_counts, pad_rows
from specdec.vllm_plugin.modes.phases import PHASE_FILL, PHASE_FINISH, PHASE_WAIT
from specdec.vllm_plugin.modes.slots import UNKNOWN
from specdec.vllm_plugin.modes.tp import NoteMaker, SlotNote
from specdec.vllm_plugin.patches.graph_stats import GraphStats

logger = logging.getLogger(LOGGER_NAME)

WATCHDOG_LIMIT = 3  # device wait: watchdog releases after which the host fills instead
# whether a grace release (drafting still running draft_timeout_ms after the GPU reached its wait: a late step, as a
# deadline miss) counts toward WATCHDOG_LIMIT, as on the GPU-gated default path. False counts stalls only (a wait
# the host never released), so a drafter's few late steps do not switch the device wait off for the server's life
# (three sleep faults did in the soak); not yet through the GPU gate
WATCHDOG_GRACE_COUNTS = True
_DEBUG_WAIT = os.environ.get("SPECDEC_DEBUG_DEVICE_WAIT") == "1"  # stacks of a step whose finish() is late
DEBUG_DUMP_S = 0.05  # SPECDEC_DEBUG_DEVICE_WAIT=1: dump every thread's stack when finish() comes this long after fill


@dataclass
class Drafted:
    """One step's drafts, for the bookkeeping done after the GPU was released (``ScheduledDrafting._note``)."""

    req_ids: list[str]
    lengths: list[int]  # [rows] each row's draft length (unpadded)
    emitted: list[int]  # [rows] tokens each row got from the step just verified (accepted + bonus)
    verified: int  # tokens vLLM scheduled for the step (its verify batch)
    handed: tuple[Any, ...] | None = None  # (req ids, tokens, discard): drafted from the matrix, feed them after


class ScheduledDrafting(CaptureRing):
    """The three calls of the module docstring (the capture: ``CaptureRing``), bound to one model runner and one
    ``ProposerCore``."""

    def __init__(
        self,
        core: Any,
        *,
        k: int,
        max_rows: int,
        device: Any,
        device_wait: Any = None,
        slot_book: Any = None,
        graph_stats: GraphStats | None = None,
        share: Callable[[Any], None] | None = None,
        notes: NoteMaker | None = None,
    ) -> None:
        """``share``: TP > 1, broadcasts the filled draft buffer to the other ranks (``modes/tp.py``); ``notes``:
        TP > 1, the scheduler's book is fed from ``latest_note`` instead of ``slot_book``."""
        import torch

        super().__init__(k=k, max_rows=max_rows, device=device)
        self.core = core
        self.slot_book = slot_book  # SlotBook: each request's next step gets the slots of its latest draft
        self.share = share
        self.notes = notes
        self.latest_note: SlotNote | None = None  # TP > 1: the latest drafting's note, for the scheduler's book
        self.step_width = 0  # TP > 1: this step's narrow width, read from the scheduler's grants
        self.graph_stats = graph_stats  # the engine's added CUDA graphs (reported beside the slot book's counts)
        self.device_wait = device_wait  # DeviceWait: the GPU waits for the drafts, the host does not (fill/finish)
        self.deferred: tuple[list[str], int | None, Any, int, int] | None = None  # (req ids, k, host, seq, verified)
        pin = self.device.type == "cuda"
        self.host_drafts = [torch.zeros((max_rows, k), dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self.fills = 0
        self.gpu_drafts = torch.zeros((max_rows, k), dtype=torch.int32, device=self.device)
        self.job: tuple[list[str], int | None, Any] | None = None  # (req ids, k of the step, the tensor handed out)
        self.job_out: Any = None  # the tensor of the latest job filled (TP > 1: broadcast after the fill)

    # ----------------------------------------------------------------- 2. submit (instead of propose)
    def submit(self, req_ids: Sequence[str], *, k: int | None, eager: bool) -> Any:
        """The draft tensor [rows, k] for ``runner._draft_token_ids`` (filled later, or now if ``eager``)."""
        rows = len(req_ids)
        out = self.gpu_drafts[:rows]
        self.job = (list(req_ids), k, out)
        if eager:
            self.feed.stats.eager_fills += 1
            self.fill(out, defer=False)  # vLLM reads these drafts on the host right after sampling
        return out

    # ----------------------------------------------------------------- 3. fill (before vLLM reads the drafts)
    def fill(self, current: Any, *, defer: bool = True, verified: int = 0, width: int = 0, needed: bool = True) -> bool:
        """Draft the pending job into the GPU buffer if vLLM still holds it (``current``). True if filled.
        ``verified``: the tokens vLLM scheduled for this step (its verify batch; for the proposer's cost fit);
        ``width``: the step's narrow width where the scheduler's book is not this one (TP > 1); ``needed`` False:
        the step verifies no draft (the scheduler granted no request a slot: a backed-off batch), so nothing waits
        and nothing is copied: the drafting (its bookkeeping, the back-off's shadow checks and the next step's slots)
        runs after the forward's launch (``finish`` at the end of ``execute_model``).
        With ``share`` the buffer then goes to the other TP ranks, enqueued after its copy (not on a late fill)."""
        return self._observed(
            PHASE_FILL, self._fill_and_share, current, defer=defer, verified=verified, width=width, needed=needed
        )

    def _fill_and_share(self, current: Any, *, defer: bool, verified: int, width: int, needed: bool) -> bool:
        filled = self._fill(current, defer=defer and needed, verified=verified, width=width, late=not needed)
        if filled and self.share is not None and needed:  # the followers skip the same steps (same schedule)
            self.share(self.job_out)
        return filled

    def _fill(self, current: Any, *, defer: bool, verified: int, width: int, late: bool = False) -> bool:
        if self.deferred is not None:  # not expected: a second fill before the step's end; release the first
            self.finish()
        job, self.job = self.job, None
        if job is None:
            return False
        req_ids, k, out = job
        self.job_out, self.step_width = out, width
        if current is None or current.data_ptr() != out.data_ptr() or current.shape != out.shape:
            self.feed.stats.skipped_fills += 1  # vLLM zeroed the drafts this step (max_model_len guard)
            self._drain()  # the tokens stay pending: the next draft request hands them to the core
            return False
        t0 = time.perf_counter()
        n = len(req_ids)
        host = self.host_drafts[self.fills % 2][:n]  # two buffers: the previous copy may still be in flight
        self.fills += 1
        if late:  # no slot to fill: vLLM reads none of the buffer this step
            self.deferred = (req_ids, k, host, None, verified)
            self.feed.stats.late_fills += 1
            return True
        seq = self._enqueue_wait(out, host) if defer else None
        if seq is not None:  # the stream waits for seq, then copies the buffer; finish() drafts
            self._prepare_early(req_ids)
            if _DEBUG_WAIT:  # every thread's stack if finish() has not come within the watchdog's deadline
                faulthandler.dump_traceback_later(DEBUG_DUMP_S, exit=False)
            self.deferred = (req_ids, k, host, seq, verified)
            self.feed.stats.deferred_fills += 1
            return True
        done = self._draft_into(host, req_ids, k, verified)
        out.copy_(host, non_blocking=out.is_cuda)
        self.feed.stats.fills += 1
        self.feed.stats.draft_seconds += time.perf_counter() - t0
        self._note(done)
        return True

    @property
    def gpu_waits(self) -> bool:
        """A deferred fill the GPU waits for (device wait), as opposed to a late one that nothing waits for."""
        return self.deferred is not None and self.deferred[3] is not None

    def finish(self) -> None:
        """Start of the runner's ``_model_forward`` (the step's inputs are enqueued; safety net and late fills: the
        end of ``execute_model``): draft a deferred fill into its pinned buffer and release the GPU's wait. Always
        releases, whatever happens."""
        job, self.deferred = self.deferred, None
        if job is None:
            return
        self._observed(PHASE_FINISH, self._finish_job, job)

    def _finish_job(self, job: tuple[list[str], int | None, Any, int, int]) -> None:
        req_ids, k, host, seq, verified = job
        t0 = time.perf_counter()
        if _DEBUG_WAIT:
            faulthandler.cancel_dump_traceback_later()
        try:
            done = self._draft_into(host, req_ids, k, verified)
        finally:
            if seq is not None:
                self.device_wait.release(seq)
            self.feed.stats.fills += 1
            self.feed.stats.draft_seconds += time.perf_counter() - t0
            self._check_watchdog()
        self._note(done)  # bookkeeping for the next schedule, after the GPU was released

    def close(self) -> None:
        """Release a pending wait."""
        self.finish()

    def _enqueue_wait(self, out: Any, host: Any) -> int | None:
        """The device wait's seq for this step's copy of ``host`` into ``out``, or None (host fill): no device
        wait, not usable here, or the driver refused (then off for good, logged once)."""
        if self.device_wait is None or not self.device_wait.usable(out):
            return None
        try:
            return self._observed(PHASE_WAIT, self.device_wait.enqueue_copy, out, host)
        except Exception as exc:  # noqa: BLE001 - a request must never fail because of drafting
            logger.warning("specdec: the GPU's wait for drafts failed (%r); filling drafts from the host", exc)
            self.device_wait = None
            return None

    def _prepare_early(self, req_ids: list[str]) -> None:
        """While the GPU still runs the previous step, do the deferred step's request lifecycle: stop the requests
        it will not draft for (finished, aborted, preempted: a stop caches the response in the suffix drafter's
        global trie) and start those the drafter does not hold from the context known so far (new requests build
        their tries from the prompt), then rebuild the global-trie match fronts the stops made stale (every running
        request's: O(rows x depth^2) at batch 64). All would otherwise fall between the two forward passes. Same
        drafts.
        Never raises (``finish`` stops and restarts whatever is left)."""
        try:
            self.core.stop_absent(req_ids)
            feed = self.feed
            for rid in req_ids:
                hist = feed.history.get(rid)
                if hist is None or not self.core.needs_start(rid):  # no context copy for held ones (long prompts)
                    continue
                known = len(hist) - len(feed.pending[rid])  # tokens already handed to the drafter's rows
                p = feed.prompt_len[rid]
                self.core.start_early(rid, hist[:p], hist[p:known])
            if self.core.internal.early_refresh:
                self.core.refresh_early()  # the stops above made every request's global-cache front stale
        except Exception as exc:  # noqa: BLE001 - a request must never fail because of drafting
            if getattr(self.core.options, "strict", False):
                raise
            logger.debug("specdec: early stops and starts failed (%r); the step's drafting does them", exc)

    def _check_watchdog(self) -> None:
        """Steps released by the watchdog (drafting past the deadline, or a stream blocked before ``finish``):
        counted; after ``WATCHDOG_LIMIT`` of them the device wait is switched off (host fills from then on). None
        to check without a device wait (a late fill of host fills)."""
        if self.device_wait is None:
            return
        stats = self.feed.stats
        fired = self.device_wait.fired()
        if fired == stats.watchdog_releases:
            return
        stats.watchdog_releases, stats.watchdog_stalls = fired, self.device_wait.stalls()
        if (fired if WATCHDOG_GRACE_COUNTS else stats.watchdog_stalls) >= WATCHDOG_LIMIT:
            logger.warning(
                "specdec: the GPU's wait for drafts was released by the watchdog %d times; filling "
                "drafts from the host from now on",
                fired,
            )
            self.device_wait = None

    def _draft_into(self, host: Any, req_ids: list[str], k: int | None, verified: int) -> Drafted:
        """Drain captured steps, draft ``req_ids`` and write the padded drafts into ``host`` [rows, k] (pinned);
        ``verified``: the tokens vLLM scheduled for the step (the proposer's cost fit). Returns what ``_note``
        records once the drafts are on their way."""
        width = self.slot_book.width if self.slot_book is not None else self.step_width  # narrow: every row that long
        k, pad = width or k, True if width else None
        done = self._draft_from_matrix(host, req_ids, k, pad, verified)
        if done is not None:
            return done
        self._drain()
        rows = self.feed.rows(req_ids)
        n = len(req_ids)
        try:
            batch = StepBatch(rows.req_ids, rows.sampled, rows.lengths, rows.contexts, rows.prompt_lens, k)
            drafts = self.core.step(batch, pad=pad)
        except Exception as exc:  # noqa: BLE001 - a request must never fail because of drafting
            self.core.drafting_failed(exc, list(req_ids))
            drafts, verified = [[] for _ in range(n)], 0
        pad_rows(drafts, host.numpy(), rows.fillers)
        return Drafted(req_ids, list(map(len, drafts)), list(map(len, rows.sampled)), verified)

    def _draft_from_matrix(
        self, host: Any, req_ids: list[str], k: int | None, pad: bool | None, verified: int
    ) -> Drafted | None:
        """``_draft_into``'s usual case in one native call (``matrix_step``): one captured step, of exactly these
        rows, none discarded, every request known with nothing pending. The lane reads the captured tokens in
        place and writes the padded drafts into ``host``; the feed records the tokens after the GPU's release
        (``_note``). None: not that case (the general path runs). Same buffer, drafts and statistics."""
        if not self.core.internal.matrix_step or self.core.lane is None or len(self.queue) != 1:
            return None
        cap = self.queue[0]
        if cap.discard or cap.req_ids != req_ids:
            return None
        before = self.feed.known_rows(req_ids)
        if before is None:
            return None
        known, fillers = before
        tokens = self._tokens(cap)  # [rows, w] int32
        del self.queue[:1]
        new = leading_counts(tokens)  # [rows]
        emitted = new.tolist()
        out = host.numpy()  # [rows, k] int32
        feed = self.feed

        def context(i: int) -> tuple[list[int], int]:  # a row to restart: its context after the new tokens
            rid = req_ids[i]
            return feed.history[rid] + tokens[i, : new[i]].tolist(), feed.prompt_len[rid]

        try:
            lengths = self.core.step_tokens(
                req_ids, tokens, emitted, known, fillers, out, context=context, k=k, pad=pad
            )
        except Exception as exc:  # noqa: BLE001 - a request must never fail because of drafting
            self.core.drafting_failed(exc, list(req_ids))
            lengths, verified = None, 0
        n = len(req_ids)
        self.feed.stats.matrix_steps += 1
        if lengths is None:  # no drafts this step: every row its last token
            rows = np.arange(n)
            out[:n] = np.where(new > 0, tokens[rows, np.maximum(new - 1, 0)], fillers)[:, None]
            lengths = [0] * n
        return Drafted(req_ids, lengths, emitted, verified, handed=(cap.req_ids, tokens, cap.discard))

    def _note(self, done: Drafted) -> None:
        """After the drafts of a step went out (the GPU no longer waits): the proposer's cost fit and the slot
        book's grants for the next schedule. Never raises unless ``strict``."""
        try:
            if done.handed is not None:  # the tokens the drafting read from the matrix, into the host record
                self.feed.add(*done.handed, handed=True)
            self.core.note_verified(done.verified)
            if self.notes is None and self.slot_book is None:
                return
            emitted = done.emitted  # [rows] tokens from the step just verified
            lengths = [m if e else UNKNOWN for m, e in zip(done.lengths, emitted)]  # no new token (prefill): k slots
            cost = self.core.token_cost(len(emitted) - emitted.count(0))
            if self.notes is not None:  # TP > 1: for the scheduler's own book (it reads the latest one)
                self.latest_note = self.notes.make(done.req_ids, lengths, emitted, cost)
            if self.slot_book is not None:
                self.slot_book.note(done.req_ids, lengths, emitted=emitted, token_cost=cost)
        except Exception as exc:  # noqa: BLE001 - a request must never fail because of drafting
            self.core.drafting_failed(exc, list(done.req_ids))

    def stats(self) -> dict[str, Any]:
        out = {"schedule": self.feed.stats.as_dict(), **self.core.stats_dict()}
        if self.slot_book is not None:
            graphs = self.graph_stats.as_dict() if self.graph_stats is not None else {}
            out["schedule"].update(self.slot_book.as_dict(), **graphs)
        return out
