"""Test doubles for the async pipeline tests: a deterministic toy target and a prompt-lookup drafter."""
from __future__ import annotations

import random
import threading
import time
from typing import Sequence

import numpy as np

from specdec.drafters.base import Drafter, DraftRequest
from specdec.tree import ROOT, TokenTree

VOCAB = 12
ORDER = 2  # the toy target's next token depends on the last ORDER tokens


class ToyTarget:
    """Greedy 'model': next token = table[last ORDER tokens] (cycles quickly, so lookup drafts hit)."""

    def __init__(self, seed: int = 0) -> None:
        rs = np.random.default_rng(seed)
        self.table = rs.integers(0, VOCAB, size=(VOCAB,) * ORDER)  # [V]*ORDER int

    def next_token(self, context: Sequence[int]) -> int:
        tail = [0] * ORDER + list(context)
        return int(self.table[tuple(tail[-ORDER:])])

    def verify(self, context: list[int], draft: TokenTree) -> list[int]:
        """Greedy tree walk: accepted draft tokens + the target's bonus token."""
        emitted: list[int] = []
        cur = ROOT
        while True:
            want = self.next_token(context + emitted)
            nxt = next((c for c in draft.children(cur) if int(draft.tokens[c]) == want), None)
            emitted.append(want)
            if nxt is None:
                return emitted
            cur = nxt


class LookupDrafter(Drafter):
    """Prompt lookup on each request's own context: continuations of earlier matches of the last N tokens.

    Tree mode branches over distinct continuations (most recent first) with frequency-based probs.
    ``draft_after`` drafts from ``context + extra`` without changing anything. ``delay_s`` (random up
    to it, seeded) makes calls slow so background completions interleave; ``fail_every`` makes every so many drafting calls raise.
    """

    name = "lookup"

    def __init__(self, *, n: int = 3, delay_s: float = 0.0, seed: int = 0, fail_every: int = 0,
                 supports_after: bool = True) -> None:
        self.n = n
        self.delay_s = delay_s
        self.rand = random.Random(seed)
        self.fail_every = fail_every
        self.supports_after = supports_after
        self.contexts: dict[str, list[int]] = {}
        self.calls = 0
        self._busy = threading.Lock()  # detects concurrent use (must never happen)

    def start(self, request_id: str, prompt_ids: Sequence[int]) -> None:
        with self._guard(can_fail=False):
            self.contexts[request_id] = list(prompt_ids)

    def extend(self, request_id: str, token_ids: Sequence[int]) -> None:
        with self._guard(can_fail=False):
            self.contexts[request_id].extend(int(t) for t in token_ids)

    def stop(self, request_id: str) -> None:
        with self._guard(can_fail=False):
            self.contexts.pop(request_id, None)

    def draft_batch(self, requests: Sequence[DraftRequest]) -> list[TokenTree]:
        with self._guard():
            return [self._draft(self.contexts.get(r.request_id, []), r.budget, r.tree) for r in requests]

    def draft_after(self, request_id: str, extra_tokens: Sequence[int], budget: int, *,
                    tree: bool = False) -> TokenTree | None:
        if not self.supports_after:
            return super().draft_after(request_id, extra_tokens, budget, tree=tree)
        with self._guard():
            ctx = self.contexts.get(request_id, []) + [int(t) for t in extra_tokens]
            return self._draft(ctx, budget, tree)

    def active_requests(self) -> list[str]:
        return list(self.contexts)

    def _guard(self, can_fail: bool = True):  # type: ignore[no-untyped-def]
        if not self._busy.acquire(blocking=False):
            raise AssertionError("LookupDrafter used from two threads at once")
        self.calls += 1
        if self.delay_s:
            time.sleep(self.rand.random() * self.delay_s)
        if can_fail and self.fail_every and self.calls % self.fail_every == 0:
            self._busy.release()
            raise RuntimeError("injected drafter failure")
        return _Release(self._busy)

    def _draft(self, ctx: list[int], budget: int, tree: bool) -> TokenTree:
        if len(ctx) < self.n or budget <= 0:
            return TokenTree.empty()
        tail = ctx[-self.n:]
        conts: list[list[int]] = []
        for s in range(len(ctx) - self.n - 1, -1, -1):  # most recent first
            if ctx[s:s + self.n] == tail:
                conts.append(ctx[s + self.n:s + self.n + budget])
        if not conts:
            return TokenTree.empty()
        if not tree:
            return TokenTree.chain(conts[0], [0.8] * len(conts[0]))
        tokens: list[int] = []
        parents: list[int] = []
        counts: list[int] = []
        index: dict[tuple[int, int], int] = {}
        for cont in conts:
            parent = ROOT
            for tok in cont:
                key = (parent, tok)
                if key not in index:
                    if len(tokens) >= budget:
                        break
                    index[key] = len(tokens)
                    tokens.append(tok)
                    parents.append(parent)
                    counts.append(0)
                counts[index[key]] += 1
                parent = index[key]
        totals = {p: 0 for p in set(parents)}
        for p, c in zip(parents, counts):
            totals[p] += c
        probs = [c / totals[p] * (0.9 if p == ROOT else 1.0) for p, c in zip(parents, counts)]
        return TokenTree(np.asarray(tokens, np.int64), np.asarray(parents, np.int32), probs)


class _Release:
    def __init__(self, lock: threading.Lock) -> None:
        self.lock = lock

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        self.lock.release()
