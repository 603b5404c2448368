"""Schedule mode's host record of every request's tokens (``TokenFeed``), the rows it hands the proposer, and the
tensor helpers around the draft buffer (``pad_rows``, ``valid_counts``). Never imports vLLM (CPU-tested)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

VALID_COUNT_DTYPE = "int32"  # torch dtype name of valid_counts' counts (compile_warmup traces vLLM's use of them)
MAX_ABSENT_STEPS = 4096  # a request absent this long forgets its history (it restarts from vLLM's if it returns)


@dataclass
class FeedStats:
    captures: int = 0
    fills: int = 0
    eager_fills: int = 0
    skipped_fills: int = 0  # vLLM replaced our buffer (e.g. a row too close to max_model_len): nothing to fill
    blind_requests: int = 0
    deferred_fills: int = 0  # device wait: the GPU waited for the drafts, drafted as the forward was launched
    late_fills: int = 0  # steps that verify no draft (no slots): drafted after the forward's launch, nothing waited
    matrix_steps: int = 0  # drafted straight from the captured token matrix (matrix_step)
    watchdog_releases: int = 0  # device wait: steps whose wait the watchdog released (stale drafts verified)
    watchdog_stalls: int = 0  # of those, waits the host never released in time (not drafting past the grace)
    wait_seconds: float = 0.0  # fill: waiting for a step's sampled tokens (the GPU still running it)
    draft_seconds: float = 0.0  # fill (device wait: finish): the whole call, waiting included
    capture_seconds: float = 0.0  # capture: counts, copy and bookkeeping on the engine thread

    def as_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


@dataclass
class Rows:
    """What ``ProposerCore.step`` reads for one step: new tokens, context lengths, contexts by row."""

    req_ids: list[str]
    sampled: list[list[int]]
    lengths: np.ndarray  # [rows] int64 context length after the new tokens
    prompt_lens: np.ndarray  # [rows] int64
    contexts: HistoryView = field(repr=False)
    fillers: list[int] = field(default_factory=list, repr=False)  # [rows] last known token (0: none): padding


class HistoryView:
    """Stands in for vLLM's ``token_ids_cpu`` [rows, max_model_len]: row i reads request i's token history."""

    def __init__(self, req_ids: Sequence[str], history: dict[str, list[int]]) -> None:
        self.req_ids, self.history = req_ids, history

    def __getitem__(self, index: tuple[int, slice]) -> np.ndarray:
        row, cols = index
        return np.asarray(self.history[self.req_ids[row]], dtype=np.int64)[cols]


class TokenFeed:
    """Host-side record of every request's real tokens, fed from captured sampled-token tensors.

    ``history[rid]`` = prompt + every token the verifier emitted for it (this module's own copy: under async
    scheduling vLLM's host arrays hold placeholders). ``pending[rid]``: tokens emitted since the last draft.
    """

    def __init__(self) -> None:
        self.history: dict[str, list[int]] = {}
        self.prompt_len: dict[str, int] = {}
        self.pending: dict[str, list[int]] = {}
        self.blind: set[str] = set()
        self.last_seen: dict[str, int] = {}
        self.step = 0
        self.stats = FeedStats()

    def admit(self, rid: str, prompt: Sequence[int] | None, outputs: Sequence[int] | None, *, returning: bool) -> None:
        """A request appears in a step: record its context if new (or back after an absence and known to vLLM)."""
        if rid in self.history and not returning:
            return
        outs = list(outputs or ())
        if prompt is None or any(t < 0 for t in outs):
            if rid not in self.history and rid not in self.blind:  # nothing real to start from
                self.blind.add(rid)
                self.stats.blind_requests += 1
            return
        self.blind.discard(rid)
        self.history[rid] = list(prompt) + outs  # vLLM's own record wins when it is complete
        self.prompt_len[rid] = len(prompt)
        self.pending[rid] = []

    def add(self, req_ids: Sequence[str], tokens: np.ndarray, discard: set[int], *, handed: bool = False) -> None:
        """One captured step: ``tokens`` [rows, width] int (``-1`` = rejected); discarded rows emit nothing.
        ``handed``: the drafter already got these tokens (``known_rows`` and the token-matrix step): history only,
        nothing pending. (On the GPU's critical path in schedule mode unless handed: one conversion per step, plain
        list work per row.)"""
        self.step += 1
        step, seen, history, pending = self.step, self.last_seen, self.history, self.pending
        counts = leading_counts(tokens).tolist()  # [rows]
        for i, (rid, row, c) in enumerate(zip(req_ids, tokens.tolist(), counts)):
            seen[rid] = step
            hist = history.get(rid)
            if hist is None or not c or i in discard:
                continue
            new = row[:c]
            hist += new
            if not handed:
                pending[rid] += new
        if step % 256 == 0:
            self._forget_absent()

    def known_rows(self, req_ids: Sequence[str]) -> tuple[list[int], list[int]] | None:
        """For a step whose captured tokens go to the drafter straight from their matrix: each row's context length
        before them and its last token (the padding of a row without new tokens). None if a row has no history
        (new or blind) or tokens still pending (a step whose fill vLLM skipped): those take ``add`` and ``rows``."""
        history, pending = self.history, self.pending
        known: list[int] = []
        last: list[int] = []
        for rid in req_ids:
            hist = history.get(rid)
            if not hist or pending[rid]:
                return None
            known.append(len(hist))
            last.append(hist[-1])
        return known, last

    def rows(self, req_ids: Sequence[str]) -> Rows:
        """The rows of one draft request (in the step's row order); pending tokens are handed out once."""
        sampled: list[list[int]] = []
        lengths: list[int] = []
        prompts: list[int] = []
        fillers: list[int] = []
        history, pending, prompt_len = self.history, self.pending, self.prompt_len
        for rid in req_ids:
            hist = history.get(rid)
            if hist is None:
                sampled.append([])
                lengths.append(0)
                prompts.append(0)
                fillers.append(0)
                continue
            sampled.append(pending[rid])
            pending[rid] = []
            lengths.append(len(hist))
            prompts.append(prompt_len[rid])
            fillers.append(hist[-1] if hist else 0)
        ids = list(req_ids)
        return Rows(
            ids,
            sampled,
            np.array(lengths, dtype=np.int64),
            np.array(prompts, dtype=np.int64),
            HistoryView(ids, history),
            fillers,
        )

    def _forget_absent(self) -> None:
        old = [rid for rid, seen in self.last_seen.items() if self.step - seen > MAX_ABSENT_STEPS]
        for rid in old:
            for table in (self.history, self.prompt_len, self.pending, self.last_seen):
                table.pop(rid, None)
            self.blind.discard(rid)


def leading_counts(tokens: np.ndarray) -> np.ndarray:
    """[rows] each row's leading valid tokens in ``tokens`` [rows, width] (``-1`` = rejected: vLLM's sampled
    tokens)."""
    return (tokens >= 0).cumprod(axis=1).sum(axis=1)


def pad_rows(drafts: Sequence[Sequence[int]], out: np.ndarray, fillers: Sequence[int]) -> None:
    """Write drafts into ``out`` [rows, k]: each row its draft, then its filler token up to k (three array
    operations instead of a row loop: half the time at 64 rows)."""
    n, k = len(drafts), out.shape[1]
    if n == 0:
        return
    lens = np.fromiter(map(len, drafts), dtype=np.int64, count=n)  # [rows]
    if lens.max() > k:
        drafts = [d[:k] for d in drafts]
        np.minimum(lens, k, out=lens)
    flat = np.fromiter(itertools.chain.from_iterable(drafts), dtype=out.dtype, count=int(lens.sum()))
    rows = out[:n]
    rows[:] = np.asarray(fillers[:n], dtype=out.dtype)[:, None]
    rows[np.arange(k) < lens[:, None]] = flat  # row-major, as ``flat`` is


def valid_counts(sampled: Any, discard_mask: Any = None, backup: Any = None, *, vocab_size: int = 0) -> tuple[Any, Any]:
    """vLLM's per-row (next token, valid count) from sampled ``[rows, k+1]`` (-1 = rejected), as tensor ops.

    next = the row's last valid token; count = number of valid tokens. Rows of ``discard_mask`` ([rows] bool, same
    device; partial prefills): count 0 and next = ``backup`` ([rows] int32, the row's last context token), as
    vLLM's own drafters report them. ``vocab_size`` > 0 also treats ids at or above it as rejected (vLLM's kernel
    does; its rejection sampler emits none). No host synchronisation.
    """
    import torch

    valid = sampled.ge(0) if vocab_size <= 0 else (sampled >= 0) & (sampled < vocab_size)  # [rows, k+1] bool
    counts = valid.sum(dim=1, dtype=getattr(torch, VALID_COUNT_DTYPE))  # [rows]
    last = valid.sum(dim=1, keepdim=True).sub_(1).clamp_(min=0)  # [rows, 1] int64
    nxt = sampled.gather(1, last).squeeze(1).to(torch.int32)  # [rows]
    if discard_mask is not None:
        counts.masked_fill_(discard_mask, 0)
        nxt = torch.where(discard_mask, backup, nxt)
    return nxt, counts
