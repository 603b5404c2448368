"""Per-request draft slots under vLLM's async scheduling (``async_mode="schedule"``, ``draft_slots="adaptive"``).

Under async scheduling vLLM's scheduler reserves the draft slots of step N+1 before step N's drafts exist: every
decoding request gets ``k`` placeholder tokens (``AsyncScheduler._update_after_schedule``), and the verifier runs
``rows x (k + 1)`` tokens per step whatever the drafts are worth. On an 8B-sized target at batch 64 that verify
work is most of what makes a speculative step dearer than a plain one (measured: 22.4 ms per step with
1,088 tokens against 18.0 ms for the synchronous path, which verifies only the drafts it has).

``SlotBook`` records, after each drafting step, how many tokens each request's draft really carries: its chain up
to the proposer's confidence cut (the cost-model cut of ``adaptive.py``: a token is drafted only if its calibrated
acceptance probability pays for its verification). The scheduler patch (``patches/async_slots.py``)
then gives the request that many placeholders instead of ``k``. vLLM reserves step N+2's placeholders at the end
of scheduling step N+1, when the book holds step N's drafts; at the start of scheduling step N+2 the patch re-grants
them from the book as step N+1's drafting (``finish``, at step N+1's forward) left it (``regrant_placeholders``): a
step's slots follow the drafts of the step before. A request without a confident draft verifies its one sampled
token, as in plain decoding; its later drafts (still computed every step) set its slots again. Small batches, where
the proposer pads every draft to ``k`` (``pad_drafts``: full CUDA graphs), keep ``k`` slots. Any draft token id in
any slot is lossless: the verifier decides.

``growth`` (``SLOT_GROWTH``): the slots follow the drafts one round late, so a draft that grew since (a suffix match
that lengthens as its copy is accepted: the depth cap is the match length) is cut to the older length. The forecast
is ``L + ceil(growth * L)`` for a latest draft of ``L`` tokens, at most ``k``; ``note`` keeps it only while the extra
slots pay: the share of them that ended up holding an accepted token (measured on the steps they were granted, an
EMA) must reach the proposer's token cost (the acceptance probability a verified token needs, ``adaptive.py``) and
``min_share`` (``SLOT_GROWTH_MIN_SHARE``).
While they do not, one note in ``GROWTH_PROBE_EVERY`` still grows, so the share keeps being measured. CPU replay of
the target's own outputs (``benchmarks/bench_slot_forecast.py``): growth 1 recovered most of the round's lag in accepted
tokens per step.

``prefill_cap`` (>= 0, ``prefill_step_slots``): a step that will also carry a heavy prefill (at least
``async_slots.PREFILL_HEAVY_TOKENS`` prompt tokens of waiting requests or prompts still being chunked) is
compute-bound, so every verified draft token costs its full share of the GEMMs; before vLLM schedules such a step
each decoding request keeps at most ``prefill_cap`` of its placeholders (``async_slots.cap_prefill_steps``).
Such a step runs as piecewise graphs whatever its slots (the prefill makes the batch mixed).

``narrow`` (``NARROW_WIDTH``, ``NARROW_FROM_ROWS``, ``NARROW_BELOW_ROWS``) with ``narrow_rows`` = (from, below): a
schedule of ``from <= running < below`` requests gives every decoding request exactly ``narrow`` slots (``width``); from
``below`` requests on, ``large`` = (width, max MAT) (``LARGE_BATCH_WIDTH``, ``LOW_MAT``) does so with its own width
while the tokens a request got per step (``mat``, a moving average over notes) stay at most that MAT; ``high`` = (width,
min MAT) (``HIGH_MAT_WIDTH``, ``HIGH_MAT``) widens the mid-size narrow steps while ``mat`` is at least that MAT. The
step's drafting pads each row to the width: the verify batch is uniform with ``width + 1`` tokens per request, which
vLLM runs as one FULL CUDA graph once ``graphs.py`` has captured that length (vLLM captures only ``k + 1``). Mid-size
batches are bound by the host's launches of the piecewise graphs a mixed batch gets; large ones by the GPU, where
verifying filler costs.

The book is shared between the runner (writer, after drafting) and the scheduler (reader), which live in the
same process with vLLM's one-GPU executor and share the engine's config object, which carries the book
(``attach_book``). Under tensor parallelism the scheduler keeps a book of its own, fed with the drafting rank's
notes (``modes/tp.py``). Never imports vLLM.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from specdec.vllm_plugin.attrs import ENGINE_BOOK
from specdec.vllm_plugin.core.policy import SLOT_GROWTH, SLOT_GROWTH_MIN_SHARE, SlotWidths, growth_pays, policy_widths

PLACEHOLDER = -1  # vLLM's draft-slot placeholder id under async scheduling (also its rejected-token id)
UNKNOWN = -1  # ``SlotBook.note``: a row without a draft length (no new token yet): its request gets k
GROWTH_EMA = 0.9  # decay per note of the extra slots' granted and used sums behind their paid share
MAT_EMA = 0.9  # decay per note of the moving average of tokens per request per step (large-batch narrow steps)
GROWTH_PROBE_EVERY = 8  # while growth does not pay, every 8th note still grows (keeps the share measured)


def narrow_widths(options: Any) -> tuple[int, ...]:
    """Every width a narrow step of an engine with these ``SpecdecOptions`` may have (each gets its own FULL CUDA
    graphs: ``patches/graphs.py``); () where narrow steps are off (uniform slots, or ``narrow_graphs`` off)."""
    if options.draft_slots != "adaptive" or not options.narrow_graphs:
        return ()
    return policy_widths(options.num_speculative_tokens)


class SlotBook:
    """request id -> draft slots of its next scheduled step (see the module docstring).

    ``note`` replaces the whole table with the rows of the latest drafting step (requests that left the batch drop
    out); a request not in the table (new, or back from preemption) gets ``k``."""

    def __init__(
        self,
        k: int,
        *,
        prefill_cap: int = -1,
        growth: float = 0.0,
        min_share: float = 0.0,
        narrow: int = 0,
        narrow_rows: tuple[int, int] = (0, 0),
        large: tuple[int, float] = (0, 0.0),
        high: tuple[int, float] = (0, 0.0),
        high_ragged: Callable[[], bool] | None = None,
        low_batch: Callable[[], bool] | None = None,
    ) -> None:
        if k < 1:
            raise ValueError(f"k={k}: a slot book needs at least one draft slot per request")
        if not growth >= 0:
            raise ValueError(f"slot_growth={growth}: must be >= 0 (0: slots = the latest draft's length)")
        self.k = k
        self.prefill_cap = prefill_cap  # slots per request on steps that carry a prefill (-1: no cap)
        self.growth = float(growth)
        self.min_share = float(min_share)  # the extra slots' paid share must reach max(token cost, this)
        self.prefill_steps = 0  # steps scheduled with the prefill cap (statistics)
        self.prefill_trimmed = 0  # slots those steps took away
        self.table: dict[str, int] = {}  # request id -> slots of its next step (the forecast)
        self.lengths: dict[str, int] = {}  # request id -> its latest draft's length (the forecast's base)
        self._placeholders = [[PLACEHOLDER] * n for n in range(k + 1)]  # read-only lists handed to vLLM, by length
        self.granted = 0  # slots handed out (statistics)
        self.offered = 0  # slots vLLM would have reserved (k per decoding request)
        self.growing = self.growth > 0
        self.widths = SlotWidths(k, narrow=narrow, narrow_rows=narrow_rows, large=large, high=high)  # the policy's
        self.high_ragged = high_ragged  # while the MAT is high: per-request slots if this says ragged graphs
        self.ragged_high_steps = 0  # mid-size schedules that took per-request slots for that (statistics)
        self.low_batch = low_batch  # True: the batch's drafts are not accepted (the proposer's back-off, backoff.py)
        self.low = False  # this schedule's: no narrow width, no k slots for requests without a draft length
        self.low_steps = 0  # schedules that were low (statistics)
        self.mat: float | None = None  # tokens per request per step (EMA over notes), None before any
        self.width = 0  # this schedule's slots per request when narrow, else 0 (per-request slots)
        self.width_steps: dict[int, int] = {}  # narrow schedules by width (statistics)
        self.notes = self.growth_notes = 0
        self.extra_granted = self.extra_used = 0  # growth's extra slots, settled (statistics)
        self._ema_extra = self._ema_used = 0.0  # decayed sums behind ``paid``
        self._grants: dict[str, tuple[int, int]] = {}  # this schedule's grants with extra slots: (base, slots)
        self._grants_before: dict[str, tuple[int, int]] = {}  # the previous schedule's (its step's tokens come next)

    @classmethod
    def policy(
        cls,
        k: int,
        *,
        narrow: bool = True,
        prefill_cap: int = -1,
        high_ragged: Callable[[], bool] | None = None,
        growth: float = SLOT_GROWTH,
        low_batch: Callable[[], bool] | None = None,
    ) -> SlotBook:
        """The book of the slot policy (the module constants); ``narrow`` False: per-request slots only (no narrow
        graphs); ``high_ragged``: while the MAT is high, mid-size steps take per-request slots if it says the
        ragged graphs are captured; ``growth`` 0: slots = the latest draft's length (a book fed a round late);
        ``low_batch``: the proposer's back-off says the batch's drafts are not accepted (then every request gets
        the slots of its latest draft, 0 without one)."""
        widths = SlotWidths.policy(k, narrow=narrow)
        return cls(
            k,
            prefill_cap=prefill_cap,
            growth=growth,
            min_share=SLOT_GROWTH_MIN_SHARE,
            narrow=widths.narrow,
            narrow_rows=widths.narrow_rows,
            large=widths.large,
            high=widths.high,
            high_ragged=high_ragged,
            low_batch=low_batch,
        )

    def note(
        self,
        req_ids: Sequence[str],
        draft_lengths: Sequence[int],
        *,
        emitted: Sequence[int] = (),
        token_cost: float = 0.0,
    ) -> None:
        """After drafting a step: ``draft_lengths`` [rows] = tokens of each row's draft worth verifying; ``UNKNOWN``
        for a row that had no new token to draft from (a prompt still prefilling): that request gets ``k``.
        ``emitted`` [rows]: the tokens each row got from the step just verified (accepted + 1), which settle the
        extra slots granted to that step; ``token_cost``: the acceptance probability a verified token needs."""
        self.notes += 1
        if emitted:
            self._settle(req_ids, emitted)
            self._observe_mat(emitted)
        probe = self.notes % GROWTH_PROBE_EVERY == 0
        pays = growth_pays(self.paid, token_cost=token_cost, min_share=self.min_share, probe=probe)
        self.growing = self.growth > 0 and pays
        self.growth_notes += self.growing
        k = self.k
        self.lengths = {rid: min(k, n) for rid, n in zip(req_ids, map(int, draft_lengths)) if n >= 0}
        if not self.growing:
            self.table = self.lengths
            return
        g = self.growth
        self.table = {rid: min(k, n + math.ceil(g * n)) for rid, n in self.lengths.items()}

    def _settle(self, req_ids: Sequence[str], emitted: Sequence[int]) -> None:
        """The extra slots of the step whose tokens arrived: how many of them held an accepted token."""
        grants, extra, used = self._grants_before, 0, 0
        if not grants:
            return
        for rid, e in zip(req_ids, emitted):
            g = grants.get(rid)
            if g is None or e <= 0:
                continue
            base, n = g
            extra += n - base
            used += min(max(e - 1 - base, 0), n - base)
        if extra:
            self.extra_granted += extra
            self.extra_used += used
            self._ema_extra = GROWTH_EMA * self._ema_extra + extra  # sums, not shares: weighted by slots
            self._ema_used = GROWTH_EMA * self._ema_used + used

    def _observe_mat(self, emitted: Sequence[int]) -> None:
        got = [e for e in emitted if e > 0]  # rows that decoded (not prompts still prefilling)
        if got:
            m = sum(got) / len(got)
            self.mat = m if self.mat is None else MAT_EMA * self.mat + (1 - MAT_EMA) * m

    @property
    def paid(self) -> float | None:
        """Share of the growth's extra slots that held an accepted token (decayed sums); None before any settled."""
        return self._ema_used / self._ema_extra if self._ema_extra else None

    def begin_schedule(self, running: int = 0) -> None:
        """A new schedule of ``running`` requests starts granting (``async_slots.regrant_placeholders``): it is
        narrow (``width`` > 0) as the policy's ``SlotWidths.choose`` says."""
        self._grants_before, self._grants = self._grants, {}
        self.low = self.low_batch is not None and self.low_batch()
        self.low_steps += self.low
        self.width, ragged = self.widths.choose(running, self.mat, low=self.low, ragged_ready=self.high_ragged)
        self.ragged_high_steps += ragged
        if self.width:
            self.width_steps[self.width] = self.width_steps.get(self.width, 0) + 1

    @property
    def narrow(self) -> int:
        """The mid-size narrow width (0: off), as the policy's ``SlotWidths`` has it; so the next three."""
        return self.widths.narrow_width

    @property
    def narrow_rows(self) -> tuple[int, int]:
        return self.widths.narrow_rows

    @property
    def large_width(self) -> int:
        return self.widths.large_width

    @property
    def high_width(self) -> int:
        return self.widths.high_width

    @property
    def narrow_steps(self) -> int:
        """Schedules that were narrow, whatever their width (statistics)."""
        return sum(self.width_steps.values())

    def cap_grants(self) -> None:
        """This schedule's grants were capped (a heavy prefill step, ``prefill_cap``): only the extra slots left
        are settled."""
        grants = {}
        for rid, (base, n) in self._grants.items():
            kept = min(n, self.prefill_cap)
            if kept > base:
                grants[rid] = (base, kept)
        self._grants = grants

    def slots(self, request_id: str, reserved: int, *, fresh: bool = True) -> int:
        """Slots for the request's next step, at most ``reserved`` (what vLLM's scheduler set aside). ``fresh``
        False (the book is a round older than usual: ``trim_placeholders``): the latest draft's length, no growth."""
        base = self.lengths.get(request_id)
        if self.width and fresh:  # a narrow schedule: every request the same, no growth to settle
            n = min(self.width, reserved)
        elif base is None:  # no draft length yet (new, prefilling, back from preemption): k, none on a low batch
            n = 0 if self.low else min(self.k, reserved)
        else:
            n = min(self.table[request_id] if fresh else base, reserved)
            if n > base:
                self._grants[request_id] = (base, n)
        self.granted += n
        self.offered += reserved
        return n

    def owns(self, ids: list[int]) -> bool:
        """``ids`` is one of this book's placeholder lists (by identity: real draft ids never are)."""
        return len(ids) <= self.k and ids is self._placeholders[len(ids)]

    def placeholders(self, n: int) -> list[int]:
        """A shared read-only list of ``n`` placeholder ids (vLLM's ``-1``), as vLLM's own scheduler hands out."""
        return self._placeholders[n]

    def as_dict(self) -> dict[str, float | None]:
        return {
            "slots_granted": self.granted,
            "slots_offered": self.offered,
            "slot_share": self.granted / self.offered if self.offered else 1.0,
            "prefill_steps": self.prefill_steps,
            "prefill_trimmed_slots": self.prefill_trimmed,
            "slot_growth": self.growth,
            "growth_notes": self.growth_notes,
            "notes": self.notes,
            "growth_extra_slots": self.extra_granted,
            "growth_extra_used": self.extra_used,
            "growth_paid_share": self.paid,
            "narrow_slots": self.narrow,
            "narrow_steps": self.narrow_steps,
            "large_batch_narrow_slots": self.large_width,
            "high_mat_narrow_slots": self.high_width,
            "mat": self.mat,
            "ragged_high_mat_steps": self.ragged_high_steps,
            "low_batch_schedules": self.low_steps,
            **{f"narrow_steps_w{w}": n for w, n in sorted(self.width_steps.items())},
        }


def attach_book(vllm_config: object, book: SlotBook | None) -> bool:
    """Make ``book`` the slot book of the engine whose config is ``vllm_config`` (None: vLLM's uniform slots). The
    scheduler and the runner of a one-GPU engine share that config object, so the scheduler patch reads the book of
    its own engine (``book_of``). False if the config takes no attribute (then the scheduler keeps vLLM's slots)."""
    try:
        object.__setattr__(vllm_config, ENGINE_BOOK, book)
    except (AttributeError, TypeError):
        return False
    return True


def book_of(vllm_config: object) -> SlotBook | None:
    """The slot book attached to this engine's config, or None."""
    return getattr(vllm_config, ENGINE_BOOK, None)
