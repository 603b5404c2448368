"""The low-acceptance policy: the one rule that decides who hands vLLM drafts when drafts are not accepted (never
imports vLLM; unit-tested on CPU). Its constants and its state, per request and per batch, live here only.

On traffic whose drafts are not accepted (random tokens, open-ended chat) every draft token vLLM verifies is pure
cost, and padding (``pad_drafts``: every row k tokens, for uniform CUDA-graph batches; schedule mode's k slots below
``NARROW_FROM_ROWS`` running requests and its narrow widths) multiplies it. No speculation runs a plain decode batch,
one token per request; so does a backed-off batch.

**Per request** (``RowBackOff``): one EMA (``ema``) of the tokens the request's drafts got accepted per drafted step,
fed by two kinds of outcome:

- *verified*: a step that verified a draft of the request (accepted = its new tokens - 1);
- *shadow*: while backed off the request still drafts on the CPU every step, but hands vLLM nothing. Its latest
  withheld draft is checked against the tokens the target emits next: the prefix that matches is what vLLM would
  have accepted. No GPU work, so the check runs on every step, not on rare probes.

A request backs off once ``MIN_STEPS`` verified steps leave its EMA under ``MIN_ACCEPTED``. It drafts again as soon as
its EMA, shadow outcomes included, reaches ``RECOVER_ACCEPTED`` (a shadow still matching counts as far as it has
matched, so a request whose drafts would be accepted is back within ``PROBE_FIRST_AFTER`` steps: a shadow checked by
up to four tokens, plus schedule mode's one round of slot lag). Any verified accepted token of a backed-off request
(a padded step's draft) feeds the same EMA. In a batch whose mean EMA is under ``STRICT_BELOW`` recovery takes
``RECOVER_LOW_BATCH`` instead (four matched tokens: on random text two or three match by chance), and a recovered
request there that accepts nothing in ``STRICT_EXIT_STEPS`` verified steps leaves again.

**Per batch** (``low``): derived on each call from the requests of the current batch, never stored: the batch is low
while the mean EMA of its requests past ``MIN_STEPS`` verified steps (or backed off) is under ``PAD_MIN_ACCEPTED``.
A low batch is not padded (``pad_drafts="auto"``; schedule mode's slot book drops its narrow widths and its k slots
for requests without a draft length, ``SlotBook.low_batch``), and a request new to it starts backed off (it drafts
in shadow from its first step and joins as soon as its drafts would be accepted). Once the low requests leave, the
batch is not low: no state outlives the requests it was measured on.

**The large-batch step gate** (``STEP_GATE_ON``) acts only on a *low* batch of at least ``STEP_GATE_FROM_ROWS``
rows, as serving at load meets it (a batch whose drafts are accepted is not low). There a few rows' drafts, rarely
accepted, make the whole verify batch a drafted (ragged) step that every row pays for (docs/serving.md); so the
step's drafts go out only where the drafting rows' EMAs sum to ``STEP_GATE_SHARE`` accepted tokens per row of the
batch. Gated drafts are kept in shadow as a backed-off
request's are, so a batch whose drafts would be accepted leaves the gate as soon as its EMAs say so. It works with
the stricter recovery above, which keeps few rows drafting in such a batch.

While a batch pads, every row is padded as before (a backed-off row's k tokens are the price of the uniform batch the
others need, and its draft is verified: a real outcome). Drafts only drop here: what vLLM emits does not change (the
verifier decides). The drafting engine is told which drafts were withheld (``ProposerCore``: ``forget_drafts``), so
its calibration learns from verified drafts only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

EMA_ALPHA = 0.25  # weight of the newest outcome (verified or shadow) in a request's accepted-tokens EMA
MIN_STEPS = 4  # verified steps before a request may back off (a new request's drafts get a chance)
MIN_ACCEPTED = 0.25  # a request accepting fewer tokens per drafted step (EMA) backs off
RECOVER_ACCEPTED = 0.5  # ... and drafts again once its EMA (shadow outcomes included) reaches this (hysteresis)
# A backed-off request whose drafts would be accepted hands vLLM a draft within this many steps: four shadow tokens
# checked one a step (a low batch's threshold, below) and schedule mode's one round of slot lag.
PROBE_FIRST_AFTER = 5
# Padding makes every row verify k tokens; on a small target that adds a sizeable share of a plain step's cost, so
# padding pays only where a row gets at least about half a token accepted per step.
PAD_MIN_ACCEPTED = 0.5
# In a batch whose mean EMA (``low``'s measure) is under STRICT_BELOW, a backed-off request drafts again only once
# its EMA reaches RECOVER_LOW_BATCH (1.0: a shadow matching four tokens): on random text two or three tokens match by
# chance often enough to bring requests back for drafted steps that each cost the whole batch. Batches whose drafts
# are accepted rarely fall under STRICT_BELOW, so they keep the usual threshold.
RECOVER_LOW_BATCH = 1.0
STRICT_BELOW = 0.2
# In such a batch a recovered request backs off again once STRICT_EXIT_STEPS verified steps since its recovery have
# accepted nothing, instead of after MIN_STEPS and an EMA under MIN_ACCEPTED (four to five drafted steps, each one
# costing the whole batch). Not 1: in schedule mode a recovered request's first verified step has no slots yet (they
# follow its draft a round late), so its first outcome is always zero. 0: off.
STRICT_EXIT_STEPS = 2
STEP_GATE_ON = True  # the large-batch step gate (docstring)
STEP_GATE_FROM_ROWS = 16  # policy.NARROW_FROM_ROWS: smaller batches keep k slots (vLLM's own uniform graphs)
# expected accepted tokens per row of the batch a drafted step must bring: a tenth of a token, so it stops only
# steps where almost no row expects a draft to be accepted
STEP_GATE_SHARE = 0.1


@dataclass
class RowBackOff:
    """One request's state."""

    ema: float = 0.0  # accepted tokens per drafted step (EMA over verified and shadow outcomes)
    seen: int = 0  # verified steps since the request started or recovered
    off: bool = False  # backed off: its drafts are withheld (and checked in shadow)
    shadow: list[int] = field(default_factory=list)  # the withheld draft being checked (empty: none)
    matched: int = 0  # its leading tokens the target has emitted so far
    recovered: bool = False  # it has backed off and recovered at least once
    accepted: int = 0  # tokens its verified drafts had accepted since it started or recovered


@dataclass
class BackOffStats:
    """Counts for the proposer's stats (``stats_dict``: ``backoff_*`` keys)."""

    requests_backed_off: int = 0  # requests that backed off (each time)
    newcomers_held: int = 0  # requests that started backed off (new to a low batch)
    shadow_checks: int = 0  # withheld drafts checked against the target's tokens
    recoveries: int = 0  # backed-off requests back to drafting
    withheld_rows: int = 0  # rows whose draft was withheld
    withheld_tokens: int = 0  # draft tokens withheld
    unpadded_steps: int = 0  # steps pad_drafts="auto" would have padded but the low batch did not
    gated_steps: int = 0  # steps the large-batch step gate withheld every draft of
    gated_rows: int = 0  # rows (not backed off) whose drafts it withheld
    # verified outcomes of drafting requests (not backed off), split by whether the request had recovered before:
    # on low-acceptance traffic, which of the two rules lets drafts through (the newcomer's first steps or recovery)
    outcomes_first: int = 0
    outcomes_recovered: int = 0

    def as_dict(self, prefix: str = "backoff_") -> dict[str, int]:
        return {prefix + k: v for k, v in self.__dict__.items()}


@dataclass
class BackOff:
    """The low-acceptance policy (see the module docstring). ``enabled`` False: never backs off."""

    enabled: bool = True
    # the large-batch step gate: STEP_GATE_ON when the policy is made (a field, so tests and proxies can set it)
    step_gate: bool = field(default_factory=lambda: STEP_GATE_ON)
    rows: dict[str, RowBackOff] = field(default_factory=dict)  # request id -> its state
    last: dict[str, int] = field(default_factory=dict)  # request id -> draft tokens (> 0) handed to vLLM last step
    stats: BackOffStats = field(default_factory=BackOffStats)

    @property
    def requests_off(self) -> int:
        """Requests backed off now."""
        return sum(st.off for st in self.rows.values())

    def low(self, below: float | None = None) -> bool:
        """The current batch's drafts are not accepted enough to pay for padding (nor for schedule mode's slots
        without a draft behind them): the mean EMA of its requests past ``MIN_STEPS`` verified steps (or backed off)
        is under ``below`` (``PAD_MIN_ACCEPTED``). Derived from its requests' state, never stored."""
        if not self.enabled:
            return False
        known = [st.ema for st in self.rows.values() if st.off or st.seen >= MIN_STEPS]
        return bool(known) and sum(known) / len(known) < (PAD_MIN_ACCEPTED if below is None else below)

    def observe(self, req_ids: Sequence[str], emitted: Sequence[int], tokens: Callable[[int], Sequence[int]]) -> None:
        """A step's new tokens per row (``emitted`` [rows]: accepted + 1, 0 for a row with none; ``tokens(i)``: row
        i's new tokens), against the drafts handed to vLLM at each request's previous step and the withheld drafts
        in shadow."""
        if not self.enabled or not (self.last or self.rows):
            return
        strict = RECOVER_LOW_BATCH > RECOVER_ACCEPTED and self.low(STRICT_BELOW)
        recover_at = RECOVER_LOW_BATCH if strict else RECOVER_ACCEPTED  # this step's recovery threshold
        for i, (rid, e) in enumerate(zip(req_ids, emitted)):
            if e <= 0:
                continue
            st = self.rows.get(rid)
            if st is not None and st.shadow:
                self._check_shadow(st, tokens(i), recover_at)
            acc = e - 1
            if self.last.get(rid, 0) > 0 or acc > 0:  # schedule mode: slots granted a round late may hold a match
                if st is None:
                    st = self.rows[rid] = RowBackOff()
                self._outcome(st, acc, verified=True, recover_at=recover_at, strict=strict)

    def _check_shadow(self, st: RowBackOff, new: Sequence[int], recover_at: float) -> None:
        """Advance the withheld draft by the target's new tokens; settle it at the first mismatch or its end, or as
        soon as what matched already brings the request back."""
        shadow, m = st.shadow, st.matched
        settled = False
        for t in new:
            if m < len(shadow) and int(t) == shadow[m]:
                m += 1
            else:
                settled = True
                break
        settled = settled or m >= len(shadow)
        st.matched = m
        early = st.off and self._blend(st.ema, m) >= recover_at  # enough to bring a backed-off request back
        if settled or early:
            st.shadow, st.matched = [], 0
            self.stats.shadow_checks += 1
            self._outcome(st, m, verified=False, recover_at=recover_at)

    @staticmethod
    def _blend(ema: float, accepted: int) -> float:
        return (1 - EMA_ALPHA) * ema + EMA_ALPHA * accepted

    def _outcome(
        self, st: RowBackOff, accepted: int, *, verified: bool, recover_at: float, strict: bool = False
    ) -> None:
        """One outcome of the request's drafts: the EMA moves, then the request backs off or recovers (``strict``:
        the batch is under ``STRICT_BELOW``, where a recovered request that accepts nothing leaves early)."""
        st.ema = float(accepted) if (verified and st.seen == 0 and not st.off) else self._blend(st.ema, accepted)
        if st.off:
            if st.ema >= recover_at:
                st.off, st.seen, st.recovered, st.accepted = False, 0, True, 0
                st.shadow, st.matched = [], 0
                self.stats.recoveries += 1
            return
        if verified:
            st.seen += 1
            st.accepted += accepted
            if st.recovered:
                self.stats.outcomes_recovered += 1
            else:
                self.stats.outcomes_first += 1
        early = strict and st.recovered and 0 < STRICT_EXIT_STEPS <= st.seen and st.accepted == 0
        if early or (st.seen >= MIN_STEPS and st.ema < MIN_ACCEPTED):
            st.off = True
            self.stats.requests_backed_off += 1

    def withhold(self, req_ids: Sequence[str], drafts: list[list[int]]) -> list[tuple[int, int]]:
        """A step that does not pad: backed-off requests' drafts (``drafts`` [rows], by ``req_ids``) are withheld
        (emptied in place) and kept in shadow. Returns (row, tokens withheld) of each row withheld."""
        cut = []
        for i in self._off_rows(req_ids, lambda i: len(drafts[i])):
            self._keep_shadow(req_ids[i], drafts[i])
            cut.append((i, len(drafts[i])))
            drafts[i] = []
        return cut

    def withhold_matrix(
        self,
        req_ids: Sequence[str],
        lengths: list[int],
        out: np.ndarray,
        tokens: np.ndarray,
        new: Sequence[int],
        fillers: Sequence[int],
    ) -> list[tuple[int, int]]:
        """``withhold`` for schedule mode's matrix step: ``lengths`` [rows] zeroed in place, and each withheld row of
        ``out`` [>= rows, width] overwritten with the row's last token (``tokens`` [>= rows, w] and ``new`` [rows]:
        its new tokens, ``fillers`` [rows]: its last token before them), as the lane pads. Returns (row, tokens
        withheld) of each row withheld."""
        cut = []
        for i in self._off_rows(req_ids, lengths.__getitem__):
            self._keep_shadow(req_ids[i], out[i, : lengths[i]].tolist())
            cut.append((i, lengths[i]))
            lengths[i] = 0
            out[i, :] = tokens[i, new[i] - 1] if new[i] > 0 else fillers[i]
        return cut

    def _off_rows(self, req_ids: Sequence[str], length: Callable[[int], int]) -> Iterator[int]:
        """The rows that hold a draft and hand vLLM none: backed-off requests' (a request new to a low batch starts
        backed off)."""
        if not self.enabled:
            return
        low = None
        off = []  # every row decided before the caller withholds any
        for i, rid in enumerate(req_ids):
            st = self.rows.get(rid)
            if st is None:
                if low is None:
                    low = self.low()
                if low:
                    st = self.rows[rid] = RowBackOff(off=True)
                    self.stats.newcomers_held += 1
            if st is not None and st.off and length(i) > 0:
                off.append(i)
        if self.step_gate and len(req_ids) >= STEP_GATE_FROM_ROWS and (self.low() if low is None else low):
            off += self._gated(req_ids, length, set(off))
        yield from sorted(off)

    def _gated(self, req_ids: Sequence[str], length: Callable[[int], int], off: set[int]) -> list[int]:
        """A low batch's drafting rows (not backed off), all of them where their EMAs sum to less than
        ``STEP_GATE_SHARE`` accepted tokens per row of the batch, else none."""
        drafting = [i for i, rid in enumerate(req_ids) if i not in off and rid in self.rows and length(i) > 0]
        expected = sum(self.rows[req_ids[i]].ema for i in drafting)
        if not drafting or expected >= STEP_GATE_SHARE * len(req_ids):
            return []
        self.stats.gated_steps += 1
        self.stats.gated_rows += len(drafting)
        return drafting

    def _keep_shadow(self, rid: str, draft: list[int]) -> None:
        st = self.rows[rid]
        self.stats.withheld_rows += 1
        self.stats.withheld_tokens += len(draft)
        if not st.shadow:  # one shadow at a time: the next is taken once this one settles
            st.shadow, st.matched = [int(t) for t in draft], 0

    def record(self, req_ids: Sequence[str], lengths: Sequence[int]) -> None:
        """The draft tokens each row handed vLLM this step (what the next step's tokens are checked against)."""
        if self.enabled:
            self.last = {rid: n for rid, n in zip(req_ids, lengths) if n}

    def prune(self, present: set[str]) -> None:
        """Forget the requests not in this step's batch (finished, aborted, preempted: a preempted one starts afresh
        when it returns)."""
        if not present.issuperset(self.rows):
            self.rows = {rid: st for rid, st in self.rows.items() if rid in present}

    def as_dict(self) -> dict[str, float | int | None]:
        emas = [st.ema for st in self.rows.values()]
        return {
            **self.stats.as_dict(),
            "backoff_requests_off": self.requests_off,
            "backoff_batch_low": self.low(),
            "backoff_batch_accepted_per_row": sum(emas) / len(emas) if emas else None,
        }
