"""The suffix drafter's native lane: the vLLM proposer's one-call step (``specdec.vllm_plugin.core.lane``).

``SuffixLane`` is a mixin of ``SuffixDrafter`` (native backend): the lane calls hand a whole proposer step (every
row's extend, statistics, draft, cut and padding) to the C++ engine in one call, inline (``lane_step``,
``lane_step_tokens``) or on the engine's own thread (``lane_submit`` / ``lane_collect``, ``lane_prepare``).
``LaneDecisions`` carries a step's decisions into those calls. Never imports vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LaneDecisions:
    """One proposer step's decisions for the native lane (``lane_step``, ``lane_step_tokens``, ``lane_submit``):
    ``k`` drafted tokens at most, ``max_model_len`` (no draft past it), ``spec`` (False: a plain step, no draft),
    ``pad`` (every row padded to its room), ``adaptive`` (the cost-model cut is on), ``floor`` (path probability a
    token must keep) and ``value`` (the calibrated probability a token must reach)."""

    k: int
    max_model_len: int
    spec: bool
    pad: bool
    adaptive: bool
    floor: float
    value: float

    def native_args(self) -> tuple[int, int, bool, bool, bool, float, float]:
        """The trailing arguments of the native engine's lane calls, in its order."""
        return (
            self.k,
            self.max_model_len,
            self.spec,
            self.pad,
            self.adaptive,
            self.floor,
            self.value,
        )


class SuffixLane:
    """The lane calls of ``SuffixDrafter`` (see the module docstring); they use its engine, its request-id map and
    its lifecycle (``start``, ``extend``, ``_forget``, ``_new_engine_id``, ``_factor``)."""

    engine: Any
    config: Any
    _ids: dict[str, int]

    def lane_config(
        self,
        *,
        calib_decay: float,
        min_calib_mass: float,
        min_calib: float,
        max_calib: float,
        max_cut: float,
    ) -> None:
        """The proposer's constants for ``lane_step`` (see specdec/vllm_plugin/core/lane.py), with the drafter's own
        (``SuffixConfig``: the one source of the lane's draft parameters). ``min_confidence`` > 0: the lane learns the
        calibration from every row's tokens and drafts calibrated chains, as the library's extend and draft do."""
        c = self.config
        self._lane_args = (
            calib_decay,
            min_calib_mass,
            min_calib,
            max_calib,
            max_cut,
            c.max_spec_factor,
            c.max_spec_offset,
            c.min_token_prob,
            c.leaf_prior,
            self._factor(True),
            c.min_confidence,
            c.use_local,
            c.use_global,
        )
        self.engine.lane_config(*self._lane_args)

    def lane_restart(self, request_id: str, prompt_ids: Sequence[int], rest_ids: Sequence[int], n_known: int) -> None:
        """(Re)start a request from its context (prompt, then the rest); its next ``lane_step`` row must carry
        context length ``n_known`` and does not extend (the row's tokens are already in ``rest_ids``)."""
        self._lane_begin(request_id, prompt_ids, rest_ids, n_known, fresh=True)

    def lane_start(self, request_id: str, prompt_ids: Sequence[int], rest_ids: Sequence[int]) -> None:
        """Start a request from its context before its next row (prompt, then the rest); that row extends the
        context by its sampled tokens, as if the request had been running (``lane_restart``: the row's tokens are
        already in the context)."""
        self._lane_begin(request_id, prompt_ids, rest_ids, len(prompt_ids) + len(rest_ids), fresh=False)

    def _lane_begin(
        self, request_id: str, prompt_ids: Sequence[int], rest_ids: Sequence[int], n_known: int, *, fresh: bool
    ) -> None:
        """Start from the context (prompt, then the rest) and set the lane's book: ``n_known`` tokens, ``fresh``
        (the next row carries exactly ``n_known``) or not (the next row extends it by its sampled tokens)."""
        self.start(request_id, prompt_ids)
        if len(rest_ids):
            self.extend(request_id, rest_ids)
        self.engine.lane_mark(self._ids[request_id], n_known, fresh)

    def lane_refresh(self) -> int:
        """Bring every active request's match front in the global cache up to date (after stops cached their
        responses) so that the next ``lane_step`` does not rebuild them; same drafts. Returns how many were stale."""
        return int(self.engine.lane_refresh())

    def lane_forget(self, request_ids: Sequence[str]) -> None:
        """These requests' drafts of the last step were withheld (the back-off): vLLM verifies none of them, so the
        lane's books forget them (the calibration counts verified drafts only)."""
        ids = self._ids
        self.engine.lane_forget([ids[r] for r in request_ids if r in ids])

    def lane_invalidate(self, request_id: str) -> None:
        """Make the request's next ``lane_step`` row ask for a restart (its context is about to be resent)."""
        rid = self._ids.get(request_id)
        if rid is not None:
            self.engine.lane_mark(rid, -1)

    def lane_step(
        self,
        req_ids: Sequence[str],
        sampled: Sequence[Sequence[int]],
        lengths: Any,
        *,
        decisions: LaneDecisions,
    ) -> tuple[list[list[int]], list[int], int, int]:
        """Every row's proposer step in one native call: extend by ``sampled[i]``, update the request's
        statistics, draft, cut and pad (the semantics of ``ProposerCore``'s Python path).
        ``lengths`` [rows] int32: context length after ``sampled[i]``. Returns (drafts, rows to restart (unknown
        request or unexpected length: their drafts are empty), accepted tokens, drafted tokens)."""
        ids = self._ids
        rids = [ids.get(r, -1) for r in req_ids]
        rows = sampled if type(sampled) is list else list(sampled)
        return self.engine.lane_step(rids, rows, lengths, *decisions.native_args())

    def lane_step_tokens(
        self,
        req_ids: Sequence[str],
        tokens: Any,
        known: Sequence[int],
        fillers: Sequence[int],
        out: Any,
        *,
        decisions: LaneDecisions,
    ) -> tuple[list[int] | None, list[int], int, int]:
        """``lane_step`` for rows given as a token matrix, drafts written into a buffer (schedule mode's step):
        ``tokens`` [>= rows, w] int32 (row i's new tokens: its leading entries >= 0), ``known`` [rows] context
        lengths before them, ``fillers`` [rows] each row's last token before them, ``out`` [>= rows, width] int32
        (C-contiguous): row i gets its draft, then its last token up to the width. Returns (the drafts' lengths, or
        None when rows must restart first: then nothing was drafted or written; rows to restart; accepted tokens;
        drafted tokens)."""
        ids = self._ids
        rids = [ids.get(r, -1) for r in req_ids]
        return self.engine.lane_step_tokens(rids, tokens, known, fillers, out, *decisions.native_args())

    def lane_submit(
        self,
        req_ids: Sequence[str],
        sampled: Sequence[Sequence[int]],
        lengths: Any,
        token_ids: Any,
        num_prompt_tokens: Any,
        *,
        decisions: LaneDecisions,
        stops: Sequence[str],
    ) -> None:
        """``lane_step`` on the engine's own thread (GIL released), collected by ``lane_collect``: first the
        ``stops`` (request ids absent from the batch), then every row as ``lane_step`` does it; rows that must
        restart (new request, unexpected length) restart there from ``token_ids`` [rows, max_len] (row i's
        context, vLLM's ``token_ids_cpu``) with ``num_prompt_tokens`` [rows] prompt lengths (or None).
        Every other call on this drafter waits for the step first."""
        ids = self._ids
        stop_ids = self._forget(stops)
        rows = sampled if type(sampled) is list else list(sampled)
        rids = []
        for r, toks in zip(req_ids, rows):
            rid = ids.get(r, -1)
            if rid < 0 and len(toks):  # a new request: it starts on the lane thread
                rid = self._new_engine_id(r)
            rids.append(rid)
        self._hand_over(
            stop_ids,
            self.engine.lane_submit,
            rids,
            rows,
            lengths,
            token_ids,
            num_prompt_tokens,
            stop_ids,
            *decisions.native_args(),
        )

    def lane_collect(self, timeout_s: float | None) -> tuple[list[list[int]], int, int, int, int, tuple] | None:
        """The submitted step's (drafts, accepted, drafted, started, resyncs, (wake_us, run_us, window_us,
        wait_us)); None if it is still running after ``timeout_s`` (None: wait for it): its drafts are then dropped
        (vLLM goes on without them). Timing: submit to the job's start, the job, submit to this call, the wait."""
        return self.engine.lane_collect(-1.0 if timeout_s is None else 1e6 * timeout_s)

    def lane_prepare(self, stops: Sequence[str], starts: Sequence[tuple[str, Sequence[int]]]) -> None:
        """Early lifecycle on the engine's thread (GIL released), before the step that needs it: stop ``stops``
        (finished requests) and start ``starts`` ((request id, prompt ids): new requests, whose first
        ``lane_submit`` row then extends by the first sampled token). Runs while vLLM executes the step."""
        stop_ids = self._forget(stops)
        start_ids = []
        for r, prompt in starts:
            stop_ids += self._forget([r])  # a request id seen again starts over
            start_ids.append((self._new_engine_id(r), prompt))
        self._hand_over(stop_ids, self.engine.lane_prepare, stop_ids, start_ids)

    def _hand_over(self, stop_ids: list[int], call: Any, *args: Any) -> None:
        """``call(*args)``, an engine call that stops ``stop_ids`` among other things; if it fails, they are
        stopped here (the id map has forgotten them already)."""
        try:
            call(*args)
        except Exception:
            for rid in stop_ids:
                self.engine.stop(rid)
            raise

    def lane_spin(self, us: float) -> None:
        """After a step, the lane thread looks for the next one awake for up to ``us`` (and ``lane_collect`` spins
        that long before sleeping): no futex wake-ups, one busy core. 0: sleep at once."""
        self.engine.lane_spin(float(us))

    def lane_threads(self, n: int) -> None:
        """Threads that share the rows of one ``lane_submit`` job: the lane thread and ``n - 1`` helpers (rows are
        independent: each extends and drafts its own request, the global trie is only read). Same drafts and
        statistics for every ``n``."""
        self.engine.lane_threads(int(n))
