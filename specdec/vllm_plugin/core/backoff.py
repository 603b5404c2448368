"""Back-off on low acceptance, per request and per batch (never imports vLLM; unit-tested on CPU).

On traffic whose drafts are not accepted (random tokens, open-ended chat) every draft token vLLM verifies is pure
cost, and padding (``pad_drafts``: every row k tokens, for uniform CUDA-graph batches; schedule mode's k slots below
``NARROW_FROM_ROWS`` running requests and its narrow widths) multiplies it: each request verifies k filler tokens
per step for nothing. No speculation runs a plain decode batch, one token per request; so does a backed-off batch.

**Per request** (``RowBackOff``): an EMA of the tokens the request got accepted per step that verified a draft of
it. After ``MIN_STEPS`` such steps, a request under ``MIN_ACCEPTED`` backs off: on steps that do not pad, its draft
is withheld (an empty row in thread mode; a draft length of 0 in schedule mode, so the slot book grants it no slot
one round later). Every ``interval`` steps it probes with a draft of at most ``PROBE_TOKENS`` tokens; a probe with
an accepted token brings the request back to full drafts, a failed one doubles the interval (``PROBE_FIRST_AFTER`` up
to ``PROBE_MAX_AFTER``). Probes fall on the steps that are multiples of the interval (counted by the back-off), so
the backed-off requests of a batch probe on the same few steps and the others are plain decoding steps, which a
single probing row would make ragged. Any accepted token while backed off (a probe, or a padded step's draft) is a
recovery: a request whose text turns repetitive drafts again within an interval. A request new to a low batch
(below) starts backed off, with a probe within ``PROBE_FIRST_AFTER`` steps.

**Per batch**: an EMA of the accepted tokens per decoding row per step (over steps with drafts; a backed-off row
counts 0, as padding would pad it too). After ``BATCH_MIN_STEPS`` such steps, a batch under ``PAD_MIN_ACCEPTED`` is
*low*: ``pad_drafts="auto"`` stops padding (rows keep the drafter's own chains,
cut at the confidence threshold, and backed-off rows nothing), and the slot book of schedule mode gives up its
narrow widths and its k slots for requests without a draft length (``SlotBook.low_batch``). While the batch pads,
every row is padded as before (a backed-off row's k tokens are the price of the uniform batch the others need), so a
batch of high-acceptance requests drafts exactly as without back-off.

Drafts only drop or shorten here: what vLLM emits does not change (the verifier decides).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from specdec.vllm_plugin.core.adaptive import PROBE_TOKENS

EMA_ALPHA = 0.25  # weight of the newest observed step in a request's accepted-tokens EMA
MIN_STEPS = 4  # steps with a verified draft before a request may back off (a new request's drafts get a chance)
MIN_ACCEPTED = 0.1  # a request accepting fewer tokens per drafted step (EMA) backs off: drafting gains it < 10%
PROBE_FIRST_AFTER = 4  # steps from a back-off to its first probe
PROBE_MAX_AFTER = 64  # each failed probe doubles the interval up to this: a hopeless request costs < 1/32 token/step
BATCH_EMA_ALPHA = 0.2  # weight of the newest step in the batch's accepted-tokens-per-decoding-row EMA
BATCH_MIN_STEPS = 8  # steps with drafts before the batch may count as low
# Padding makes every row verify k tokens; a padded step of a small target costs about 1.5x a plain one, so padding
# pays only where a row gets at least about half a token accepted per step.
PAD_MIN_ACCEPTED = 0.5


@dataclass
class RowBackOff:
    """One request's back-off state."""

    ema: float = 0.0  # accepted tokens per observed step (EMA)
    seen: int = 0  # observed steps since the request started or recovered
    off: bool = False  # backed off: no draft on steps that do not pad, save probes
    interval: int = PROBE_FIRST_AFTER  # steps between probes
    next_probe: int = 0  # the step (``BackOff.step``) from which it probes: a multiple of the interval
    probing: bool = False  # its last submitted draft was a probe


@dataclass
class BackOffStats:
    """Counts for the proposer's stats (``stats_dict``: ``backoff_*`` keys)."""

    requests_backed_off: int = 0  # requests that backed off (each time)
    newcomers_held: int = 0  # requests that started backed off (new to a low batch)
    probes: int = 0  # probe drafts handed out
    probe_failures: int = 0  # probes with no accepted token (their interval doubled)
    recoveries: int = 0  # backed-off requests back to full drafts
    withheld_rows: int = 0  # rows whose draft was dropped or shortened
    withheld_tokens: int = 0  # draft tokens dropped
    unpadded_steps: int = 0  # steps pad_drafts="auto" would have padded but the low batch did not

    def as_dict(self, prefix: str = "backoff_") -> dict[str, int]:
        return {prefix + k: v for k, v in self.__dict__.items()}


@dataclass
class BackOff:
    """Per-request and per-batch back-off (see the module docstring). ``enabled`` False: never backs off."""

    enabled: bool = True
    rows: dict[str, RowBackOff] = field(default_factory=dict)  # request id -> its state
    last: dict[str, int] = field(default_factory=dict)  # request id -> draft tokens (> 0) handed to vLLM last step
    batch_ema: float | None = None  # accepted tokens per decoding row per step (steps with drafts)
    batch_seen: int = 0
    requests_off: int = 0  # requests backed off now
    step: int = 0  # steps observed (the probes' clock)
    stats: BackOffStats = field(default_factory=BackOffStats)

    def low(self) -> bool:
        """The batch's drafts are not accepted enough to pay for padding (nor for schedule mode's slots without a
        draft behind them)."""
        return (
            self.enabled
            and self.batch_ema is not None
            and self.batch_seen >= BATCH_MIN_STEPS
            and self.batch_ema < PAD_MIN_ACCEPTED
        )

    def observe(self, req_ids: Sequence[str], emitted: Sequence[int]) -> None:
        """A step's new tokens per row (``emitted`` [rows]: accepted + 1, 0 for a row with none), against the drafts
        handed to vLLM at each request's previous step."""
        if not self.enabled:
            return
        self.step += 1
        if not self.last and max(emitted, default=0) <= 1:
            return  # nothing drafted, nothing accepted: a plain batch (a low one's usual step) costs nothing here
        rows, total, drafted = 0, 0, False
        for rid, e in zip(req_ids, emitted):
            if e <= 0:
                continue
            sub, acc = self.last.get(rid, 0), e - 1
            rows += 1
            total += acc
            drafted = drafted or sub > 0
            if sub > 0 or acc > 0:  # schedule mode: slots granted a round late may hold an accepted filler
                self._observe_row(rid, acc)
        if drafted:  # what padding would gain: accepted tokens per row it would pad (backed-off rows count 0)
            rate = total / rows
            a = BATCH_EMA_ALPHA
            self.batch_ema = rate if self.batch_ema is None else (1 - a) * self.batch_ema + a * rate
            self.batch_seen += 1

    def _observe_row(self, rid: str, accepted: int) -> None:
        st = self.rows.get(rid)
        if st is None:
            st = self.rows[rid] = RowBackOff()
        if st.off:
            if accepted > 0:  # a probe (or a padded draft) was accepted: full drafts again
                self.stats.recoveries += 1
                self.requests_off -= 1
                self.rows[rid] = RowBackOff(ema=float(accepted))
            elif st.probing:
                self.stats.probe_failures += 1
                st.interval = min(2 * st.interval, PROBE_MAX_AFTER)
                st.next_probe = self._next_probe(st.interval)
            st.probing = False
            return
        st.ema = float(accepted) if st.seen == 0 else (1 - EMA_ALPHA) * st.ema + EMA_ALPHA * accepted
        st.seen += 1
        if st.seen >= MIN_STEPS and st.ema < MIN_ACCEPTED:
            st.off, st.next_probe, st.probing = True, self._next_probe(st.interval), False
            self.stats.requests_backed_off += 1
            self.requests_off += 1

    def _next_probe(self, interval: int) -> int:
        """The first step after this one that is a multiple of ``interval``."""
        return (self.step // interval + 1) * interval

    def withhold(self, req_ids: Sequence[str], drafts: list[list[int]]) -> int:
        """A step that does not pad: backed-off requests' drafts (``drafts`` [rows], by ``req_ids``) dropped, a
        probe's shortened, in place. Returns the tokens withheld."""
        if not drafts:
            return 0
        withheld = 0
        for i, m in self._cuts(req_ids, lambda i: len(drafts[i])):
            withheld += len(drafts[i]) - m
            drafts[i] = drafts[i][:m]
        return withheld

    def withhold_matrix(
        self,
        req_ids: Sequence[str],
        lengths: list[int],
        out: np.ndarray,
        tokens: np.ndarray,
        new: Sequence[int],
        fillers: Sequence[int],
    ) -> int:
        """``withhold`` for schedule mode's matrix step: ``lengths`` [rows] shortened in place, and the withheld part
        of each row of ``out`` [>= rows, width] overwritten with the row's last token (``tokens`` [>= rows, w] and
        ``new`` [rows]: its new tokens, ``fillers`` [rows]: its last token before them), as the lane pads. Returns the
        tokens withheld."""
        withheld = 0
        for i, m in self._cuts(req_ids, lengths.__getitem__):
            withheld += lengths[i] - m
            lengths[i] = m
            out[i, m:] = tokens[i, new[i] - 1] if new[i] > 0 else fillers[i]
        return withheld

    def _cuts(self, req_ids: Sequence[str], length: Callable[[int], int]) -> Iterator[tuple[int, int]]:
        """The rows a step that does not pad must shorten: (row, its new length) for each row whose draft of
        ``length(row)`` tokens passes its limit; every limited row's draft is booked (``taken``)."""
        low = self.low()
        if not (self.requests_off or low):
            return
        for i, rid in enumerate(req_ids):
            limit = self.limit(rid, low=low)
            if limit is None:
                continue
            n = length(i)
            m = min(n, limit)
            self.taken(rid, limit, n, m)
            if m < n:
                yield i, m

    def limit(self, rid: str, *, low: bool) -> int | None:
        """On a step that does not pad: the most draft tokens the request may hand vLLM (0: none; a probe:
        ``PROBE_TOKENS``), or None (no limit); then ``taken`` with what it handed. ``low``: the batch is (a request
        it has no state of starts backed off)."""
        st = self.rows.get(rid)
        if st is None:
            if not low:
                return None
            st = self.rows[rid] = RowBackOff(off=True, next_probe=self._next_probe(PROBE_FIRST_AFTER))
            self.requests_off += 1
            self.stats.newcomers_held += 1
        elif not st.off:
            return None
        return PROBE_TOKENS if self.step >= st.next_probe else 0

    def taken(self, rid: str, limit: int | None, draft_len: int, handed: int) -> None:
        """Book a row's draft under ``limit``: ``draft_len`` tokens drafted, ``handed`` of them handed to vLLM."""
        if draft_len > handed:
            self.stats.withheld_rows += 1
            self.stats.withheld_tokens += draft_len - handed
        if limit:  # a probe step: the next one an interval on (a probe that went out sets it on its outcome)
            st = self.rows[rid]
            st.next_probe = self._next_probe(st.interval)
            if handed:
                st.probing = True
                self.stats.probes += 1

    def record(self, req_ids: Sequence[str], lengths: Sequence[int]) -> None:
        """The draft tokens each row handed vLLM this step (what the next step's tokens are checked against)."""
        if self.enabled:
            self.last = {rid: n for rid, n in zip(req_ids, lengths) if n}

    def prune(self, present: set[str]) -> None:
        """Forget the requests not in this step's batch (finished, aborted, preempted: a preempted one starts afresh
        when it returns)."""
        if present.issuperset(self.rows):
            return
        self.rows = {rid: st for rid, st in self.rows.items() if rid in present}
        self.requests_off = sum(st.off for st in self.rows.values())

    def as_dict(self) -> dict[str, float | int | None]:
        return {
            **self.stats.as_dict(),
            "backoff_requests_off": self.requests_off,
            "backoff_batch_low": self.low(),
            "backoff_batch_accepted_per_row": self.batch_ema,
        }
