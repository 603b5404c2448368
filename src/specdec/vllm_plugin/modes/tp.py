"""Schedule mode under tensor parallelism (TP > 1, PP = 1).

Every TP rank runs its own model runner, and each scatters the drafts of its own GPU buffer
(``runner._draft_token_ids``, ``[rows, k]``) into its step's input ids. The ranks must verify the same drafts: the
all-reduces of the forward add up the ranks' partial results of one batch. So only TP rank 0 (the *driver*) drafts,
as on one GPU (``ScheduledDrafting``); once its fill has enqueued the copy of the drafts into the buffer, the buffer
is broadcast over the TP group, on the stream, before vLLM's scatter. The other ranks (*followers*, ``TpFollower``)
keep no drafter state and do no CPU drafting: their fill enqueues the receiving end of the same broadcast. With the
device wait the driver's stream waits for the drafting and the broadcast after it, so the followers' streams wait
too; no host waits anywhere. Control flow that decides whether a step broadcasts (a job, vLLM's guard that drops
drafts) depends only on the scheduler's output and the runner's state, which every rank shares.

The slot book (``modes/slots.py``) lives beside the scheduler, which runs in the engine-core process, not beside the
driver. The driver's notes of each drafting (draft lengths, tokens per step, the token cost, which CUDA graphs the
narrow and ragged steps have) ride on its ``ModelRunnerOutput`` (attribute ``SLOT_NOTE_ATTR``; vLLM pickles the
output to the scheduler). The scheduler's book (``scheduler_book``) takes each note as it arrives: one drafting
round later than the one-GPU book, so it grants the latest draft lengths without growth. The driver learns a
step's narrow width from the scheduler: with ``SCHEDULER_WIDTH`` the width the book chose rides on the pickled
``SchedulerOutput`` (``attrs.SCHEDULE_WIDTH``, ``schedule_width``); otherwise it is inferred from the slots the
scheduler granted (``width_of_schedule``), which cannot tell a narrow schedule from per-request slots that happen
to be equal (always so at batch 1): such a step is then drafted to at most those slots, its note grants no more,
and a request's drafts can only shrink until it gets no slot at all.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from specdec.vllm_plugin.attrs import SCHEDULE_WIDTH
from specdec.vllm_plugin.logs import LOGGER_NAME
from specdec.vllm_plugin.modes.capture import discard_counts
from specdec.vllm_plugin.modes.slots import SlotBook, attach_book, book_of

logger = logging.getLogger(LOGGER_NAME)

DRIVER_RANK = 0  # the TP rank that drafts and broadcasts
# the driver drafts to the width the scheduler's book chose (sent on its output) instead of inferring it from the
# grants: inferred widths cannot tell a narrow schedule from equal per-request slots, so small TP > 1 batches drafted
# short, ragged verify batches instead of ones padded to k (docstring)
SCHEDULER_WIDTH = True
BACKUP_SLOTS = 4  # pinned buffers of discarded rows' tokens a follower cycles through (as the driver's capture ring)


@dataclass(frozen=True)
class SlotNote:
    """One drafting step's record for the scheduler's slot book (``SlotBook.note``'s arguments and the book's
    configuration, so the scheduler can build the book from the first note)."""

    req_ids: tuple[str, ...]
    lengths: tuple[int, ...]  # [rows] draft length worth verifying, ``slots.UNKNOWN`` for rows without a new token
    emitted: tuple[int, ...]  # [rows] tokens each row got from the step just verified
    token_cost: float  # the acceptance probability a verified token needs
    k: int  # the engine's draft length
    narrow: bool  # narrow steps have their FULL CUDA graphs
    ragged: bool  # ragged verify batches have theirs (captured and ready)
    prefill_cap: int  # slots per request on heavy prefill steps (-1: no cap)
    low: bool = False  # the driver's back-off says the batch's drafts are not accepted


@dataclass(frozen=True)
class NoteMaker:
    """The driver's side of the notes: the book's configuration, and whether the ragged graphs are ready."""

    k: int
    narrow: bool
    prefill_cap: int
    ragged: Callable[[], bool] | None = None
    low: Callable[[], bool] | None = None

    def make(
        self, req_ids: Sequence[str], lengths: Sequence[int], emitted: Sequence[int], token_cost: float
    ) -> SlotNote:
        return SlotNote(
            tuple(req_ids),
            tuple(int(n) for n in lengths),
            tuple(int(e) for e in emitted),
            float(token_cost),
            self.k,
            self.narrow,
            bool(self.ragged()) if self.ragged is not None else False,
            self.prefill_cap,
            bool(self.low()) if self.low is not None else False,
        )


def scheduler_book(vllm_config: Any, note: SlotNote) -> SlotBook | None:
    """Feed ``note`` to the slot book of the scheduler whose config is ``vllm_config``, building it from the first
    note (no growth: the notes arrive one drafting round late). Returns the book, or None if the config takes no
    book (the scheduler then keeps vLLM's k slots)."""
    book = book_of(vllm_config)
    if book is None or book.k != note.k:
        book = SlotBook.policy(note.k, narrow=note.narrow, prefill_cap=note.prefill_cap, growth=0.0)
        if not attach_book(vllm_config, book):
            return None
    book.high_ragged = lambda: note.ragged  # the driver's graphs and back-off, as of its latest note
    book.low_batch = lambda: note.low
    book.note(note.req_ids, note.lengths, emitted=note.emitted, token_cost=note.token_cost)
    return book


def schedule_width(scheduler_output: Any, k: int, *, enabled: bool | None = None) -> int:
    """The narrow width of the step ``scheduler_output`` schedules, on a TP rank: the scheduler's (its book's
    ``width``, ``attrs.SCHEDULE_WIDTH``) where ``enabled`` (default ``SCHEDULER_WIDTH``) and it was sent, else
    ``width_of_schedule`` of its grants (0 for a step without per-request slots)."""
    enabled = SCHEDULER_WIDTH if enabled is None else enabled
    sent = getattr(scheduler_output, SCHEDULE_WIDTH, None) if enabled else None
    if isinstance(sent, int):
        return sent if 0 < sent < k else 0
    spec = getattr(scheduler_output, "scheduled_spec_decode_tokens", None)
    return width_of_schedule(spec, k) if isinstance(spec, dict) else 0


def send_width(scheduler_output: Any, book: SlotBook, *, enabled: bool | None = None) -> None:
    """The scheduler's side of ``schedule_width``: the width ``book`` chose for this schedule onto its output
    (pickled to every rank with it), where ``enabled`` (default ``SCHEDULER_WIDTH``)."""
    if (SCHEDULER_WIDTH if enabled is None else enabled) and scheduler_output is not None:
        with contextlib.suppress(AttributeError):  # an output class without room for it: the driver infers it
            setattr(scheduler_output, SCHEDULE_WIDTH, int(book.width))


def width_of_schedule(spec_tokens: Mapping[str, Sequence[int]], k: int) -> int:
    """The narrow width of a step whose decoding requests the scheduler gave ``spec_tokens`` (request id -> its
    draft slots): the common slot count if every request got the same one below ``k``, else 0 (per-request)."""
    widths = {len(v) for v in spec_tokens.values()}
    if len(widths) != 1:
        return 0
    (w,) = widths
    return w if 0 < w < k else 0


def tp_broadcast(device: Any) -> Callable[[Any], None]:
    """A function that broadcasts a tensor on ``device`` from the driver to every rank of this process's TP group,
    in place, enqueued on the stream (vLLM's group coordinator: NCCL). Every rank calls this at the same point (the
    first step's drafting hooks): one warm-up broadcast sets up the communicator there, never later, where the
    driver's stream may be waiting for drafts that only the host's next call releases."""
    import torch
    from vllm.distributed import get_tp_group

    group = get_tp_group()

    def share(tensor: Any) -> None:
        group.broadcast(tensor, src=DRIVER_RANK)

    share(torch.zeros(1, dtype=torch.int32, device=device))
    return share


class TpFollower:
    """A TP rank other than the driver under schedule mode: the runner hooks' calls (``ScheduledDrafting``'s
    interface), with no drafting. It hands vLLM a draft buffer [rows, k] and fills it by the driver's broadcast."""

    slot_book = None
    deferred = None
    gpu_waits = False
    remote_notes = False
    latest_note = None

    def __init__(self, *, k: int, max_rows: int, device: Any, share: Callable[[Any], None]) -> None:
        import torch

        self.device = torch.device(device)
        self.share = share
        self.gpu_drafts = torch.zeros((max_rows, k), dtype=torch.int32, device=self.device)
        pin = self.device.type == "cuda"
        # partial prefills' last tokens, [max_rows] each: a ring, since a step's copy to the device may still be
        # pending when the next step's counts fill a buffer (the host runs a step ahead under async scheduling)
        self.backups = [torch.zeros(max_rows, dtype=torch.int32, pin_memory=pin) for _ in range(BACKUP_SLOTS)]
        self.next_backup = 0
        self.job: tuple[list[str], int | None, Any] | None = None
        self.received = 0  # broadcasts received (statistics)
        self.skipped = 0  # steps whose drafts vLLM dropped before the fill

    def counts(self, sampled: Any, discard: dict[int, int], discard_mask: Any) -> tuple[Any, Any]:
        """``valid_counts`` for this step, as the driver computes them (every rank's runner needs its own)."""
        backup = self.backups[self.next_backup]
        if discard:
            self.next_backup = (self.next_backup + 1) % BACKUP_SLOTS
        return discard_counts(sampled, discard, discard_mask, backup=backup, device=self.device)

    def capture(self, sampled: Any, req_ids: Sequence[str], discard: set[int], *, requests: dict[str, Any]) -> None:
        """Nothing to record: followers keep no token history."""

    def submit(self, req_ids: Sequence[str], *, k: int | None, eager: bool) -> Any:
        out = self.gpu_drafts[: len(req_ids)]
        self.job = (list(req_ids), k, out)
        if eager:
            self.fill(out, defer=False)
        return out

    def fill(self, current: Any, *, defer: bool = True, verified: int = 0, width: int = 0, needed: bool = True) -> bool:
        """Receive the driver's drafts into the buffer vLLM holds (the same decisions as the driver's fill; a step
        that verifies no draft, ``needed`` False, has no broadcast)."""
        job, self.job = self.job, None
        if job is None:
            return False
        out = job[2]
        if current is None or current.data_ptr() != out.data_ptr() or current.shape != out.shape:
            self.skipped += 1
            return False
        if not needed:
            return True
        self.share(out)
        self.received += 1
        return True

    def finish(self) -> None:
        """Nothing deferred on a follower."""

    def close(self) -> None:
        """Nothing to release."""

    def stats(self) -> dict[str, Any]:
        return {"tp_follower": {"broadcasts_received": self.received, "skipped_fills": self.skipped}}
